"""systemd readiness protocol (sd_notify) through the sdnotify library.

Without NOTIFY_SOCKET (not under systemd) every call does nothing and nothing fails.

An in-place upgrade (host/successor.py) moves the unit from one process to another: the old agent
ends with hand_off() (MAINPID= of its child, and READY=1 if the unit was active, then silence), and
the child, which holds its tongue while its predecessor lives (PREDECESSOR_ENV), speaks from
take_over() on, READY=1 included once it is ready. The hand-off is the one message that must
arrive: it is sent without sdnotify (which drops what it cannot send), waiting for room on a full
socket, and a failure is said to the caller.
"""

from __future__ import annotations

import asyncio
from typing import Mapping, Optional

from hyperlight_agent import __version__, contracts, waits
from hyperlight_agent.text import cause

# The hand-off waits this long for systemd's notify socket to take it (a full queue drains as
# systemd reads; one that does not within this is a failed hand-off, and the old agent serves on).
HAND_OFF_TIMEOUT_S = 5.0


def watchdog_usec(environ: Mapping[str, str]) -> Optional[int]:
    """WATCHDOG_USEC as systemd sets it (ASCII digits), or None when unset. Raises ValueError."""
    usec = environ.get(contracts.WATCHDOG_USEC_ENV, "")
    if not usec:
        return None
    if not (usec.isascii() and usec.isdigit() and len(usec) <= 20) or int(usec) == 0:
        raise ValueError("must be a positive number of microseconds")
    return int(usec)


class Notifier:
    def __init__(self, environ: Mapping[str, str]) -> None:
        self._notifier = None
        # sdnotify reads the socket's address from the process environment itself: `environ` only
        # decides whether we are under systemd at all.
        if environ.get(contracts.NOTIFY_SOCKET_ENV):
            import sdnotify  # only under systemd

            self._notifier = sdnotify.SystemdNotifier()
            if self._notifier.socket is not None:
                # Never block the event loop on a full notify queue (a stuck or absent reader):
                # a dropped STATUS line is better than a wedged agent.
                self._notifier.socket.setblocking(False)
        usec = watchdog_usec(environ)  # validated by the CLI before anything started
        # systemd asks for pings at least every WATCHDOG_USEC; half of it leaves room for a slow tick.
        self.watchdog_interval: Optional[float] = usec / 2e6 if usec and self._notifier else None
        self.ready_sent = False
        self.stopping_sent = False
        self.handed_off = False  # another process is the unit's main process now: we say nothing
        # The pid of the agent we replace in an in-place upgrade, while it may still be main.
        predecessor = environ.get(contracts.PREDECESSOR_ENV, "")
        self.predecessor: Optional[int] = int(predecessor) if predecessor.isdigit() else None
        self._status = ""

    def close(self) -> None:
        """Close the socket to systemd (nothing more can be said)."""
        if self._notifier is not None and self._notifier.socket is not None:
            self._notifier.socket.close()
            self._notifier.socket = None

    @property
    def under_systemd(self) -> bool:
        return self._notifier is not None

    def send(self, *lines: str) -> None:
        if self.speaks:
            self._deliver(lines)

    def _deliver(self, lines: tuple[str, ...]) -> None:
        if self._notifier is not None:
            self._notifier.notify("\n".join(lines))

    async def hand_off(self, pid: int, status: str, timeout: float = HAND_OFF_TIMEOUT_S) -> Optional[str]:
        """Make `pid` the unit's main process (an in-place upgrade's child), with READY=1 ending
        the reload if the unit was active (an activating unit stays so: its READY=1 is the child's
        to send, once the child is ready). None once systemd has the message: from now on `pid`
        speaks for the unit and nothing more is said from here (a STOPPING=1 of ours would stop
        the unit). Else why it could not be sent, and nothing changed."""
        # WATCHDOG=1 restarts systemd's watchdog clock here: the child is silent until we have
        # exited and only then pings on its own tick, so without it the gap between our last ping
        # and its first could pass WatchdogSec= (two ping intervals plus our exit).
        lines = (
            *(["READY=1"] if self.ready_sent else []),
            *(self._watchdog_ping()),
            f"STATUS={status}",
            f"MAINPID={pid}",
        )
        why = await self._deliver_surely(lines, timeout)
        if why is None:
            self.handed_off = True
        return why

    async def _deliver_surely(self, lines: tuple[str, ...], timeout: float) -> Optional[str]:
        """One message, waiting up to `timeout` for room on the socket; None once sent, else why not."""
        sock = self._notifier.socket if self._notifier is not None else None
        if sock is None:
            return "systemd's notify socket is not open"
        try:
            await waits.within(asyncio.get_running_loop().sock_sendall(sock, "\n".join(lines).encode()), timeout)
        except asyncio.TimeoutError:
            return f"systemd's notify socket took no message within {timeout:g} s (its queue is full)"
        except OSError as exc:
            return f"cannot tell systemd ({cause(exc)})"
        return None

    def take_over(self) -> None:
        """Our predecessor is gone and we are the unit's main process: say where we are (and
        READY=1 at once if we are ready: ready() again)."""
        self.predecessor = None
        self.send(*self._watchdog_ping(), f"STATUS={self._line}")  # our first ping: hand_off() says why

    def _watchdog_ping(self) -> tuple[str, ...]:
        return ("WATCHDOG=1",) if self.watchdog_interval is not None else ()

    @property
    def speaks(self) -> bool:
        """Whether what we say reaches systemd: not after a hand-off, not before our predecessor left."""
        return not self.handed_off and self.predecessor is None

    @property
    def _line(self) -> str:
        """systemd's status line: ours, and which version says it (after an in-place upgrade,
        `systemctl status` shows the new one)."""
        return f"{self._status}; version {__version__}"

    def status(self, text: str) -> None:
        if text != self._status:
            self._status = text
            self.send(f"STATUS={self._line}")

    def ready(self) -> None:
        """READY=1, once: the first time readiness holds while we speak for the unit (later losses
        show in STATUS only)."""
        if not self.ready_sent and self.speaks:
            self.ready_sent = True
            self.send("READY=1", f"STATUS={self._line}")

    def watchdog(self) -> None:
        """WATCHDOG=1; before readiness also EXTEND_TIMEOUT_USEC, so systemd's start timeout keeps
        moving while (and only while) the loop is alive: waiting hours for a kubelet is fine,
        a wedged agent still times out and is restarted."""
        if self.ready_sent or self.watchdog_interval is None:
            self.send("WATCHDOG=1")
        else:
            self.send("WATCHDOG=1", f"EXTEND_TIMEOUT_USEC={int(self.watchdog_interval * 4e6)}")

    def reloading(self, status: str = "reloading configuration") -> None:
        self.send("RELOADING=1", f"STATUS={status}")

    def reloaded(self) -> None:
        """End a reload: READY=1 again only if we had been ready (a reload must not make an
        activating unit active), never after STOPPING=1."""
        if self.stopping_sent:
            return
        if self.ready_sent:
            self.send("READY=1", f"STATUS={self._line}")
        else:
            self.send(f"STATUS={self._line}")

    def stopping(self) -> None:
        self.stopping_sent = True
        self.send("STOPPING=1", "STATUS=stopping")
