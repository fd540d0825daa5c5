"""The processes a test created, found by parentage: other agents may run on the same machine
(a packaged agent, `make run` in another terminal, another checkout's tests), and their probe
helpers are none of a test's business."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Iterable

from hyperlight_agent.device.helper import HELPER_MARK


def _parent(pid: str) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        # The command name (field 2) may contain spaces and parentheses: split after the last ")".
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def children(parent: int, mark: str = HELPER_MARK) -> list[int]:
    """PIDs of parent's child processes whose command line contains `mark` (by default: the
    probe helpers that parent started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if _parent(entry) != parent:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if mark.encode() in f.read():
                    pids.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
    return pids


def my_helpers(mark: str = HELPER_MARK) -> list[int]:
    """Probe helpers started by this (test) process itself, e.g. by an in-process ProbeHelper."""
    return children(os.getpid(), mark)


def terminate(proc: subprocess.Popen[bytes], timeout: float = 15) -> int:
    """SIGTERM, then its exit status (TimeoutExpired if it does not exit in time)."""
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout)


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Whatever happened: leave no process running (for a finally clause)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def alive(pids: Iterable[int], mark: str = HELPER_MARK) -> list[int]:
    """Those of pids still running with `mark` in their command line (a reused PID does not count)."""
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if mark.encode() in f.read():
                    left.append(pid)
        except OSError:
            continue
    return left
