"""A service manager stand-in: what systemd does for a Type=notify, NotifyAccess=main unit, as far
as our agent can tell, in a process of its own, for tests without systemd as PID 1.

    python -m standin.manager EVENTS NOTIFY_SOCKET -- COMMAND...

As strict as systemd 252 (Debian 12), never more forgiving:
- it is a child subreaper, as PID 1 is: a process orphaned below it (the child an in-place upgrade
  starts through sh) becomes its child, and it reaps every child;
- a notify message counts only when its sender (SCM_CREDENTIALS) is the main process; from anyone
  else it is dropped and said as rejected (systemd logs "reception only permitted for main PID");
- MAINPID= from the main process makes another process main; one that is not its child is said
  as "alien" (systemd warns it may not see that process exit);
- when the main process exits, every other process it still has is sent SIGTERM, then SIGKILL
  after 5 s (KillMode=control-group), and it exits with the main process's status;
- SIGTERM to it is SIGTERM to the main process (`systemctl stop`).
Everything is written to EVENTS as one JSON object per line, flushed at once:
  {"event": "main", "pid": 42}, {"event": "notify", "pid": 42, "accepted": true, "lines": [...]},
  {"event": "exit", "pid": 42, "status": 0, "main": true}, {"event": "alien", "pid": 43}
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any, TextIO

PR_SET_CHILD_SUBREAPER = 36
KILL_GRACE_S = 5.0


class Manager:
    def __init__(self, events: TextIO, notify_path: str) -> None:
        self.events = events
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(notify_path)
        self.main = 0
        self.children: set[int] = set()
        self.status: int | None = None

    def say(self, **fields: Any) -> None:
        self.events.write(json.dumps(fields) + "\n")
        self.events.flush()

    def start(self, argv: list[str], environ: dict[str, str]) -> None:
        process = subprocess.Popen(argv, env=environ, stdin=subprocess.DEVNULL)
        self.main = process.pid
        self.children.add(process.pid)
        self.say(event="main", pid=self.main)

    def receive(self) -> None:
        size = struct.calcsize("3i")
        data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(size))
        sender = 0
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = struct.unpack("3i", payload[:size])[0]
        lines = data.decode(errors="replace").split("\n")
        accepted = sender == self.main
        self.say(event="notify", pid=sender, accepted=accepted, lines=lines)
        if not accepted:
            return
        for line in lines:
            if line.startswith("MAINPID=") and line[8:].isdigit() and int(line[8:]) != self.main:
                self.main = int(line[8:])
                if not self._is_child(self.main):
                    self.say(event="alien", pid=self.main)
                self.say(event="main", pid=self.main)

    def _is_child(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
        except (OSError, ValueError, IndexError):
            return False

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            is_main = pid == self.main
            self.say(event="exit", pid=pid, status=os.waitstatus_to_exitcode(status), main=is_main)
            if is_main:
                self.status = os.waitstatus_to_exitcode(status)

    def descendants(self) -> list[int]:
        """Our children now (orphans below us are reparented to us)."""
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit() and self._is_child(int(name)):
                found.append(int(name))
        return found

    def run(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self._forward(signal.SIGTERM))
        signal.signal(signal.SIGINT, lambda *_: self._forward(signal.SIGTERM))
        while self.status is None:
            readable, _, _ = select.select([self.sock.fileno(), wake_r], [], [], 1.0)
            if self.sock.fileno() in readable:
                self.receive()
            if wake_r in readable:
                os.read(wake_r, 256)
            self.reap()
        self._end_the_rest()
        return self.status if self.status >= 0 else 128 - self.status

    def _forward(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.main, signum)

    def _end_the_rest(self) -> None:
        """KillMode=control-group: what is left after the main process is stopped."""
        for signum, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
            left = self.descendants()
            if not left:
                return
            self.say(event="left", pids=left, signal=signal.Signals(signum).name)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            deadline = time.monotonic() + grace
            while self.descendants() and time.monotonic() < deadline:
                self.reap()
                time.sleep(0.02)
            self.reap()


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m standin.manager EVENTS NOTIFY_SOCKET -- COMMAND...", file=sys.stderr)
        return 2
    events_path, notify_path, command = argv[0], argv[1], argv[3:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    with open(events_path, "a") as events:
        manager = Manager(events, notify_path)
        manager.start(command, {**os.environ, "NOTIFY_SOCKET": notify_path})
        return manager.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
