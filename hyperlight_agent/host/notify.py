"""systemd readiness protocol (sd_notify) through the sdnotify library.

Without NOTIFY_SOCKET (not under systemd) every call does nothing and nothing fails.
"""

from __future__ import annotations

from typing import Mapping, Optional

from hyperlight_agent import contracts


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
        self._status = ""

    def send(self, *lines: str) -> None:
        if self._notifier is not None:
            self._notifier.notify("\n".join(lines))

    def status(self, text: str) -> None:
        if text != self._status:
            self._status = text
            self.send(f"STATUS={text}")

    def ready(self) -> None:
        """READY=1, once: the first time readiness holds (later losses show in STATUS only)."""
        if not self.ready_sent:
            self.ready_sent = True
            self.send("READY=1", f"STATUS={self._status}")

    def watchdog(self) -> None:
        """WATCHDOG=1; before readiness also EXTEND_TIMEOUT_USEC, so systemd's start timeout keeps
        moving while (and only while) the loop is alive: waiting hours for a kubelet is fine,
        a wedged agent still times out and is restarted."""
        if self.ready_sent or self.watchdog_interval is None:
            self.send("WATCHDOG=1")
        else:
            self.send("WATCHDOG=1", f"EXTEND_TIMEOUT_USEC={int(self.watchdog_interval * 4e6)}")

    def reloading(self) -> None:
        self.send("RELOADING=1", "STATUS=reloading configuration")

    def reloaded(self) -> None:
        """End a reload: READY=1 again only if we had been ready (a reload must not make an
        activating unit active), never after STOPPING=1."""
        if self.stopping_sent:
            return
        if self.ready_sent:
            self.send("READY=1", f"STATUS={self._status}")
        else:
            self.send(f"STATUS={self._status}")

    def stopping(self) -> None:
        self.stopping_sent = True
        self.send("STOPPING=1", "STATUS=stopping")
