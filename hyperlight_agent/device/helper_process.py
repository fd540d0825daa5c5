"""The probe helper's own process: one JSON request per line in, one JSON result per line out.

Started by the agent (helper.py) as `python -I -S -B`: standard library only, no grpc, so it
stays small; it imports the kernel checks and the hypervisor table, nothing else of ours, from
the sources the agent hands it (helper.SOURCES: the code the agent itself runs), never from disk.

Why: docs/decisions/probe-helper.md.
"""

from __future__ import annotations

import json
import sys

from hyperlight_agent import text
from hyperlight_agent.device import kernel
from hyperlight_agent.device.hypervisors import BY_NAME

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time
if TYPE_CHECKING:
    from typing import Any

# Fields of a request (helper.ProbeRequest on the agent's side).
REQUEST_FIELDS = ("hypervisor", "device", "host")
# Said once, first, when the helper has started and imported the probes.
READY_LINE = b'{"ready": true}\n'


def _invalid(request: Any) -> str:
    """What is wrong with a request's shape ("" when nothing is)."""
    if not isinstance(request, dict) or set(request) != set(REQUEST_FIELDS):
        return f"fields must be {', '.join(REQUEST_FIELDS)}"
    for field in ("device", "host"):
        path = request[field]
        if path is None and field == "host":
            continue
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
            return f"{field} must be an absolute path" + (" or null" if field == "host" else "")
    return ""


def run_request(request: Any) -> dict[str, Any]:
    """One request → one result: {"ok": bool, "reason": str}. Anything malformed is a failed
    result saying why, never an exception."""
    problem = _invalid(request)
    if problem:
        return {"ok": False, "reason": f"bad probe request: {problem}"}
    hypervisor = BY_NAME.get(request["hypervisor"]) if isinstance(request["hypervisor"], str) else None
    if hypervisor is None:
        return {"ok": False, "reason": f"unknown hypervisor {str(request['hypervisor'])[:40]!r}"}
    try:
        kernel.probe_device(hypervisor.probe, request["device"], request["host"])
    except kernel.ProbeError as exc:
        return {"ok": False, "reason": str(exc)}
    except (OSError, ValueError) as exc:  # e.g. a path too long for the kernel
        return {"ok": False, "reason": f"{text.shown(request['device'])}: {text.cause(exc)}"}
    return {"ok": True, "reason": ""}


def handle_line(line: str) -> str:
    """One request line → one reply line (without the newline)."""
    try:
        request = json.loads(line)
    except (ValueError, RecursionError) as exc:
        return json.dumps({"ok": False, "reason": f"bad probe request: {str(exc)[:80]}"})
    return json.dumps(run_request(request))


def serve(stdin: Any = None, stdout: Any = None) -> None:
    """The helper's main loop, until EOF on stdin."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    stdout.write(READY_LINE.decode())
    stdout.flush()
    for line in stdin:
        stdout.write(handle_line(line) + "\n")
        stdout.flush()


if __name__ == "__main__":  # pragma: no cover - started by helper.py
    serve()
