"""How a load pod ended, in the terms the e2e's figures count: rejected at admission, or failed
after it, and why; and which failures the kubelet's own restart causes, whatever the device. And how
many of a load's pods may be unfinished at once (PodSlots)."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Optional

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


class PodSlots:
    """At most `cap` of a load's pods unfinished (not yet Succeeded or Failed) at once.

    A node holds at most its status.allocatable.pods (the kubelet's maxPods, 110 by default) pods
    that are not finished: the scheduler counts them so (its pod informer skips only Succeeded and
    Failed pods) and, on a full node, makes room for a pod of higher priority by deleting the
    least important one of lower priority. A load that outruns the node (a pod every 0.3 s, each
    unfinished for 30 s or more on a busy two-core node) fills it, and the DRA driver's replacement
    pod (system-node-critical) then preempted a just-bound load pod: one pod deleted under the test
    by the scheduler ("Preempted by pod <uid> on node a").

    `unfinished()` names the load's unfinished pods (one request); free() asks for it only when
    the pods created since the last answer could have reached the cap.

    >>> slots = PodSlots(2, lambda: {"load-1"})
    >>> slots.free(["load-0"]), slots.listings
    (True, 0)
    >>> slots.free(["load-0", "load-1"]), slots.listings  # load-0 finished meanwhile
    (True, 1)
    """

    def __init__(self, cap: int, unfinished: Callable[[], set[str]]) -> None:
        self.cap = cap
        self._unfinished = unfinished
        self._finished: set[str] = set()
        self.listings = 0

    def free(self, created: list[str]) -> bool:
        """Whether one more pod may be created now."""
        if len(created) - len(self._finished) < self.cap:
            return True
        self.listings += 1
        unfinished = self._unfinished()
        self._finished = {name for name in created if name not in unfinished}
        return len(created) - len(self._finished) < self.cap


def naming(lines: Iterable[str], namespace: str, name: str) -> list[str]:
    """The log lines that name the pod namespace/name (klog's form), not a longer name it starts:
    load-22 is not load-225."""
    pattern = re.compile(re.escape(f"{namespace}/{name}") + r"(?![\w.-])")
    return [line.rstrip("\n") for line in lines if pattern.search(line)]


# A klog line: severity, MMDD hh:mm:ss.micros, thread/PID, file:line] message.
_KLOG = re.compile(r"^[IWEF](\d{4} \d\d:\d\d:\d\d\.\d+)\s+\d+ [^\]]*\] (.*)$")
KUBELET_STARTED = '"Kubelet version"'  # the first thing each kubelet process logs at its default verbosity
_LIST_RECEIVED = re.compile(r'"State pushed for device plugin" resource="([^"]+)"')
_DENIED = re.compile(r'"Pod admission denied" .*?pod="([^"]+)"')


def _klog_seconds(stamp: str) -> float:
    """Seconds since the day began, of a klog "MMDD hh:mm:ss.micros" (runs do not span a midnight)."""
    hours, minutes, seconds = stamp.split(" ")[1].split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def _klog(log: str) -> Iterator[tuple[str, str]]:
    """The (time stamp, message) of each klog line in `log`; other lines (flag warnings) skipped."""
    for line in log.splitlines():
        klog = _KLOG.match(line)
        if klog is not None:
            yield klog.group(1), klog.group(2)


def start_to_list_s(log: str, resource: str) -> Optional[float]:
    """From the last kubelet process's start marker to the first list it received from
    `resource`'s plugin (None if it has none yet): how long our part of its start gap was."""
    started: Optional[float] = None
    listed: Optional[float] = None
    for stamp, message in _klog(log):
        if message.startswith(KUBELET_STARTED):
            started, listed = _klog_seconds(stamp), None
        pushed = _LIST_RECEIVED.match(message)
        if pushed and pushed.group(1) == resource and started is not None and listed is None:
            listed = _klog_seconds(stamp)
    return None if started is None or listed is None else round(listed - started, 3)


def denied_before_a_list(log: str, resource: str) -> dict[str, bool]:
    """For each pod ("namespace/name") a kubelet refused at admission: whether its last refusal
    came from a kubelet process that had not yet received any list from `resource`'s plugin.
    A kubelet starting admits the pods bound to its node while it was down as soon as its pod
    informer has them, while every plugin is still registering again (it removed their sockets):
    those refusals are the kubelet's own start, whatever the plugin does (kubernetes issue 133382).
    A list counts from its "State pushed" line (logged at -v=2 as the list arrives)."""
    refused: dict[str, bool] = {}
    listed = True  # lines before the first start marker: a kubelet that was there already
    for _, message in _klog(log):
        if message.startswith(KUBELET_STARTED):
            listed = False
            continue
        pushed = _LIST_RECEIVED.match(message)
        if pushed and pushed.group(1) == resource:
            listed = True
            continue
        denied = _DENIED.match(message)
        if denied:
            refused[denied.group(1)] = not listed
    return refused
