"""How a load pod ended, in the terms the e2e's figures count: rejected at admission, or failed
after it, and why; and which failures the kubelet's own restart causes, whatever the device."""

from __future__ import annotations

from typing import Any

# containerd's CRI marks a container whose start failed as exited with this reason and exit code,
# its message the start's error (internal/cri/server/helpers.go, containerd 2.2).
START_ERROR = "StartError"
START_ERROR_EXIT_CODE = 128
# The end of that message when the kubelet's call was cancelled: its process exited mid-start.
CANCELLED_BY_CALLER = "context canceled"


def rejected_at_admission(status: dict[str, Any]) -> bool:
    """The kubelet refused the pod before any container: a device it could not allocate
    (UnexpectedAdmissionError) or a resource it had too little of (OutOf<resource>)."""
    reason = status.get("reason", "")
    return bool(reason == "UnexpectedAdmissionError" or reason.startswith("OutOf"))


def why_failed(pod: dict[str, Any]) -> tuple[str, str]:
    """The reason and message of a failed pod: the pod's own, else its first ended container's
    ("<reason> exit <code>")."""
    status = pod["status"]
    if status.get("reason"):
        return status["reason"], status.get("message", "")
    for container in status.get("containerStatuses") or []:
        ended = container.get("state", {}).get("terminated")
        if ended:
            return f"{ended.get('reason', '')} exit {ended.get('exitCode')}", ended.get("message", "")
    return "", ""


def start_cut(reason: str, message: str) -> bool:
    """Whether the container never ran because the kubelet exited while starting it: containerd's
    StartContainer ended with the kubelet's call cancelled. The pod had been admitted and its
    container created (the device allocated and its CDI edits applied), so no device plugin is
    involved; with restartPolicy Never the restarted kubelet leaves it Failed."""
    return reason == f"{START_ERROR} exit {START_ERROR_EXIT_CODE}" and message.endswith(CANCELLED_BY_CALLER)
