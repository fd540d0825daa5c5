"""Signals, in one place. What each one means:

    SIGTERM, SIGINT  stop gracefully (systemd stop, kubelet pod deletion, Ctrl-C): the kubelet's
                     stream ends and our socket goes in the same moment; in-flight Allocates
                     get a short grace; with handover_seconds, after a successor is ready
                     (a second one ends that wait at once)
    SIGHUP           re-read the config file and apply it (settings that change only on a
                     restart keep their running value)
    SIGUSR2          upgrade in place (systemctl reload, package upgrades): start the installed
                     code as a child, hand the kubelet over to it once it is ready, make it the
                     unit's main process, and leave (host/successor.py)

install_early() runs first, when the entry module (__main__.py) is imported: a signal that
arrives while the agent is still starting is remembered instead of killing the process with the
default action, and replayed once the event loop takes over (attach()).

Why: docs/decisions/signals-from-the-first-line.md.
"""

from __future__ import annotations

import signal

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: this runs first, keep it light
if TYPE_CHECKING:
    import asyncio
    from typing import Any, Callable

STOP = (signal.SIGTERM, signal.SIGINT)
RELOAD = (signal.SIGHUP,)
UPGRADE = (signal.SIGUSR2,)
_early: list[int] = []


def _remember(signum: int, frame: Any) -> None:
    _early.append(signum)


def install_early() -> None:
    for signum in (*STOP, *RELOAD, *UPGRADE):
        signal.signal(signum, _remember)


def restore_defaults() -> None:
    """For the one-shot modes (--check, --health-check): signals act as usual, also one that
    arrived while we were parsing."""
    for signum in (*STOP, *RELOAD, *UPGRADE):
        signal.signal(signum, signal.SIG_DFL)
    pending, _early[:] = list(_early), []
    for early in pending:
        signal.raise_signal(early)


def attach(
    loop: asyncio.AbstractEventLoop,
    stop: Callable[[], None],
    reload: Callable[[], None],
    upgrade: Callable[[], None] = lambda: None,
) -> None:
    """Hand the signals to the event loop; replay any that arrived early (a stop wins)."""
    for signum in STOP:
        loop.add_signal_handler(signum, stop)
    for signum in RELOAD:
        loop.add_signal_handler(signum, reload)
    for signum in UPGRADE:
        loop.add_signal_handler(signum, upgrade)
    pending, _early[:] = list(_early), []
    if any(s in STOP for s in pending):
        stop()
        return
    if any(s in RELOAD for s in pending):
        # The settings were read at some point before now, maybe before this HUP arrived: read
        # the file again, as it is now.
        reload()
    if any(s in UPGRADE for s in pending):
        upgrade()  # a package upgrade while we started: the code installed now is not what runs


def stopping(loop: asyncio.AbstractEventLoop) -> None:
    """While shutting down: a reload or upgrade must not start work; another TERM/INT still reaches
    the agent's stop (it ends a handover's wait, and changes nothing after)."""
    for signum in (*RELOAD, *UPGRADE):
        loop.add_signal_handler(signum, lambda: None)


def detach(loop: asyncio.AbstractEventLoop) -> None:
    """Back to remembering: a signal during the last steps of exit must not kill us mid-way."""
    for signum in (*STOP, *RELOAD, *UPGRADE):
        loop.remove_signal_handler(signum)
    install_early()
