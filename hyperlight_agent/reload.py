"""Re-reading the settings (SIGHUP, `systemctl reload`), one read at a time, on the agent's loop.

The file is read in a daemon thread: a slow or hostile path never stalls Allocate, checks or a
stop, and a read stuck in a hung filesystem never holds up the process's exit (the loop's
default executor would). A reload asked for during a read gets one more read after it. An
invalid file is refused with the running settings kept; settings that apply only on a restart
are kept too, with a warning. systemd hears RELOADING=1 first and READY=1 whatever happens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable, Optional, TypeVar

from hyperlight_agent import config, waits
from hyperlight_agent.config import Settings
from hyperlight_agent.host.notify import Notifier
from hyperlight_agent.text import quote

log = logging.getLogger(__name__)
T = TypeVar("T")


def changes(running: Settings, new: Settings) -> list[str]:
    """What a reload changes, one "key old → new" each, in the settings table's order.

    >>> changes(Settings.defaults(), Settings.defaults(log_level="debug", check_interval_seconds=5.0))
    ['check_interval_seconds 30 → 5.0', "log_level 'info' → 'debug'"]
    """
    return [
        f"{s.key} {quote(getattr(running, s.key))} → {quote(getattr(new, s.key))}"
        for s in config.SETTINGS
        if getattr(running, s.key) != getattr(new, s.key)
    ]


def kept_restart_only(running: Settings, new: Settings) -> tuple[Settings, list[str]]:
    """`new`, with every setting that changes only on a restart kept as `running` has it, and the
    names of those that differed."""
    fixed = [k for k in config.RESTART_ONLY if getattr(new, k) != getattr(running, k)]
    return dataclasses.replace(new, **{k: getattr(running, k) for k in fixed}), fixed


class Reloader:
    def __init__(
        self,
        read: Optional[Callable[[], Settings]],
        running: Callable[[], Settings],
        apply: Callable[[Settings], None],
        notifier: Notifier,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self._read = read  # raises config.ConfigError; None: reloads re-apply the running settings
        self._running = running
        self._apply = apply
        self._notifier = notifier
        self._on_refused = on_refused  # the refusal replaced systemd's status line
        self._task: Optional[asyncio.Future[None]] = None
        self._again = False
        self._stopped = False

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def request(self) -> None:
        if self._stopped:
            return  # no reload may start work while the agent is taken down
        if self.busy:
            self._again = True
            return
        self._notifier.reloading()
        log.info("reloading configuration")
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> Optional[asyncio.Future[None]]:
        """Refuse further reloads; the one running, if any, for the caller to cancel and await."""
        self._stopped = True
        return self._task

    async def _run(self) -> None:
        try:
            while True:
                self._again = False
                try:
                    new = await waits.in_thread(self._read, "config-reload") if self._read else self._running()
                except config.ConfigError as exc:
                    log.error("reload failed, keeping the running configuration: %s", exc)
                    self._notifier.status(f"reload failed, kept running configuration: {exc}")
                    self._on_refused()
                else:
                    if not self._stopped:
                        running = self._running()
                        new, fixed = kept_restart_only(running, new)
                        if fixed:
                            log.warning("reload: %s change only on restart; kept", ", ".join(fixed))
                        changed = changes(running, new)
                        log.info("reload: %s", "; ".join(changed) if changed else "no setting changed")
                        self._apply(new)
                if not self._again or self._stopped:
                    return
        finally:
            self._notifier.reloaded()  # systemd must never be left waiting in "reloading"
