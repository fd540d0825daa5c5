"""The agent, a fully built object: construct → start() → wait() → close(), on one event loop.

Everything the agent waits on is an event on this loop: gRPC calls and streams, inotify on the
kubelet, CDI and device directories, the check timer, the probe helper's pipe. One thread of
control means the agent's state needs no locks. Signals are the entry point's business (cli.py,
signals.py): it calls stop(), reload() and upgrade().

Construct it inside the running event loop (asyncio objects bind to it on Python 3.9).

Why: docs/decisions/one-event-loop.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable, Mapping, Optional

from hyperlight_agent import __version__, identity, modes, parts, waits
from hyperlight_agent.assembly import AgentHooks, assemble
from hyperlight_agent.config import Settings
from hyperlight_agent.device.helper import CLOSE_BOUND_S
from hyperlight_agent.host import journal, successor
from hyperlight_agent.host.notify import Notifier
from hyperlight_agent.kubelet_side import Snapshot, hand_over_on_stop, succession
from hyperlight_agent.lifecycle import Lifecycle
from hyperlight_agent.reload import Reloader

log = logging.getLogger(__name__)

# A cap on the whole of _shutdown beyond what its parts bound themselves (the kubelet side's
# close_bound_s, the probe helper's CLOSE_BOUND_S): only the last resort for a part that is stuck.
SHUTDOWN_MARGIN_S = 0.5


class Agent:
    def __init__(
        self,
        settings: Settings,
        mode: modes.Mode = modes.PLUGIN,
        reload: Optional[Callable[[], Settings]] = None,
        notifier: Optional[Notifier] = None,
        environ: Optional[Mapping[str, str]] = None,
    ) -> None:
        # The process environment is the entry point's to hand over (cli.main); none by default.
        self._environ: Mapping[str, str] = environ if environ is not None else {}
        self.settings = settings
        self.mode = mode
        self.life = Lifecycle()
        self.notifier = notifier or Notifier(self._environ)
        # The parts (assembly.py): our face, who we are to our peers, the checks, the kubelet side.
        built = self.parts = assemble(settings, mode, self.notifier, self._environ, self._hooks())
        self.face, self.identity, self.checker, self.side = built.face, built.identity, built.checker, built.side
        self.succession = succession(self.side)  # None: the side cannot be succeeded without a gap
        self._tasks: list[asyncio.Future[Any]] = []
        self.upgrader = self._upgrader()
        self.reloader = Reloader(
            reload,
            lambda: self.settings,
            self._apply_reload,
            self.notifier,
            on_refused=self.face.readiness.forget_status,
        )

    def _hooks(self) -> AgentHooks:
        """What the parts ask of the agent."""
        return AgentHooks(
            status_changed=self._status_changed,
            ready=lambda: self.ready,
            # Describe's word on our upgrades and our stop (then we are no successor: peers.successor)
            described=lambda: {**self.upgrader.said(), "stopping": self.life.leaving},
            predecessor=lambda: self.notifier.predecessor,
            upgrading=lambda: self.upgrader.upgrading,
        )

    def _upgrader(self) -> successor.Upgrader:
        """In-place upgrades: a successor started beside us (host/successor.py)."""
        return successor.Upgrader(
            self.settings.instance,
            self._environ,
            self.succession,
            self.notifier,
            ready=lambda: self.ready,
            handed_over=self.life.handed_over,
            on_change=self._status_changed,
        )

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Begin serving: first check, registration, watches and timers run as tasks."""
        log.info(
            "starting hyperlight-agent %s (commit %s): %s, device dir %s",
            __version__,
            identity.commit(self._environ),
            self.side.describe(),
            self.settings.device_dir,
        )
        self._status_changed()
        self.checker.request()
        await self.face.readiness.start()
        jobs = [self.side.run(), self.parts.watcher.run(), self.checker.periodic(), *self.face.jobs()]
        if self.notifier.predecessor is not None:
            jobs.append(self.upgrader.predecessor_gone(self.notifier.predecessor))
        self._tasks = [asyncio.ensure_future(c) for c in jobs]

    def stop(self) -> None:
        """Ask wait() to return (signal handlers call this); asked again, end a handover's wait
        for a successor at once."""
        self.life.stop()

    async def wait(self) -> None:
        """Until stop(); raises what a task that ended early raised (they run until cancelled)."""
        await self.life.until_stopped(self._tasks)

    async def close(self) -> None:
        """Shut down, bounded: first, with handover_seconds set, serve on until a successor is ready
        (the side's hand_over); then what the kubelet must see at once (the side's begin_stop: the
        device plugin's streams end), the side closes (calls in flight get transport.STOP_GRACE_S),
        then the helper is stopped. The CDI spec stays: containers created during an agent restart
        still resolve it."""
        hand_over = functools.partial(hand_over_on_stop, self.succession, self.settings.handover_seconds, self.ready)
        if not await self.life.begin_stopping(hand_over):
            return
        log.info("stopping")
        self.notifier.stopping()
        self.side.begin_stop()
        # Before anything else can run: a check finishing during the shutdown would publish and
        # log after "stopping" (and a first check may still be running this early).
        self.checker.cancel()
        if self.parts.labels is not None:
            self.parts.labels.close()
        await waits.cancelled([*self._tasks, self.reloader.stop(), self.upgrader.under_way()])
        await waits.within(self._shutdown(), self.shutdown_bound_s)

    async def run(self) -> None:
        """start → wait → close."""
        await self.start()
        try:
            await self.wait()
        finally:
            await self.close()

    @property
    def shutdown_bound_s(self) -> float:
        """The most a shutdown after the handover takes: the side's close, then the helper's."""
        return self.side.close_bound_s + CLOSE_BOUND_S + SHUTDOWN_MARGIN_S

    async def _shutdown(self) -> None:
        await self.side.close()
        await self.checker.close()
        await self.parts.helper.close()

    def reload(self) -> None:
        """Re-read the settings and apply them (SIGHUP): reload.py."""
        self.reloader.request()

    def upgrade(self) -> None:
        """Replace this process with the code installed now, without a gap (SIGUSR2): host/successor.py."""
        if self.life.may_upgrade:
            self.upgrader.request()

    def _apply_reload(self, new: Settings) -> None:
        self.settings = new
        journal.set_level(new.log_level)
        self.side.reconfigure(parts.side_target(new, self.mode))
        self.checker.reconfigure(parts.check_target(new, self.mode), new.check_interval_seconds)
        self._status_changed()

    # --- readiness ----------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        observation = self.parts.observation
        return self.side.snapshot(observation.current, observation.version > 0)

    @property
    def ready(self) -> bool:
        return self.snapshot().ready()

    def status(self) -> str:
        return self.snapshot().status()

    def _status_changed(self) -> None:
        if self.life.speaking:
            self.face.readiness.changed(self.snapshot())
