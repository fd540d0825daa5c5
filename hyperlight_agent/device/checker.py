"""One device check (detect → bounded probe with host identity → CDI repair), run single-flight
(single_flight.py): a caller always gets a check that started after it asked, a burst of
Allocates costs at most two probes per probe time, and a caller that gives up leaves the check,
and the shared health observation it will publish, untouched.

Why: docs/decisions/out-of-descriptors.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from hyperlight_agent import waits
from hyperlight_agent.device import hypervisors, kernel
from hyperlight_agent.device.helper import ProbeHelper, ProbeRequest
from hyperlight_agent.device.observation import Cause, Observation, SharedObservation
from hyperlight_agent.device.rechecks import Rechecks
from hyperlight_agent.files import cdi
from hyperlight_agent.files.watcher import DirectoryWatcher
from hyperlight_agent.single_flight import SingleFlight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckTarget:
    """Where to look, and what the spec must say. Replaced as a whole on reload."""

    device_dir: str
    host_device_dir: Optional[str]
    cdi_dir: str
    uid: int
    gid: int
    # Bootstrap (--device-access) mode: inventory only; never open the device, never write CDI.
    inventory_only: bool = False
    # --check: inspect the spec instead of repairing it (the problem is kept in Checker.cdi_note).
    read_only: bool = False


class Checker:
    def __init__(
        self,
        target: CheckTarget,
        helper: ProbeHelper,
        observation: SharedObservation,
        on_result: Optional[Callable[[Observation, float, bool], None]] = None,
        keeper: Optional[Callable[[], Awaitable[Optional[str]]]] = None,
        interval_s: float = 0.0,
    ) -> None:
        self.target = target
        self.interval_s = interval_s  # periodic(): a check at least this often
        self._interval_changed: Optional[asyncio.Event] = None  # made in periodic(), on its loop
        # Asked before repairing a spec someone else wrote: the name of a newer instance of ours
        # that keeps the spec now (peers.py), or None. Its spec stands, if it resolves our device.
        self._keeper = keeper
        self.kept_by = ""
        self._helper = helper
        self._observation = observation
        self._on_result = on_result  # (observation, seconds, cdi_repaired) for logs and metrics
        self._flight = SingleFlight(self._run_one)
        self._helper_trouble = False  # the last check failed because of the helper
        self._rechecks = Rechecks()
        self._exhausted = False  # the last check was inconclusive: out of resources
        self._exhausted_reason = ""
        self._cdi_transient = False  # the last check's spec write failed in a system call
        self._retry: Optional[asyncio.TimerHandle] = None
        self.completed = 0  # checks completed (tests and benchmarks read this)
        self.cdi_note: Optional[str] = None  # read_only: what is wrong with the spec, if anything

    async def check(self, timeout: Optional[float] = None) -> Observation:
        """The result of a check that starts after this call.

        If a check is in flight (it may have looked before our caller's reason to ask), wait for
        the next one; every caller arriving meanwhile shares that same next check. Raises
        asyncio.TimeoutError past `timeout`; the check itself carries on.
        """
        return await waits.within(asyncio.shield(self._flight.next()), timeout)

    def request(self) -> None:
        """Ask for a check that starts after now (for change events); never waits."""
        self._flight.next()

    def watch(self, watcher: DirectoryWatcher) -> None:
        """A check whenever the device nodes change, or (unless inventory only) our CDI spec."""
        t = self.target
        nodes = {h.node for h in hypervisors.HYPERVISORS}
        for directory in filter(None, (t.device_dir, t.host_device_dir)):
            watcher.watch(directory, lambda name: self.request(), nodes)
        if not t.inventory_only:
            cdi.watch(watcher, t.cdi_dir, self.request)

    async def periodic(self) -> None:
        """A check every interval_s, until cancelled; reconfigure() with a new one waits anew."""
        self._interval_changed = asyncio.Event()
        while True:
            self._interval_changed.clear()
            if not await waits.event(self._interval_changed, self.interval_s):
                self.request()

    def reconfigure(self, target: CheckTarget, interval_s: float) -> None:
        """Reloaded settings: checked at once (the CDI spec follows a new uid/gid), the interval's
        wait started anew if it changed."""
        self.target = target
        if interval_s != self.interval_s:
            self.interval_s = interval_s
            if self._interval_changed is not None:
                self._interval_changed.set()
        self.request()

    def cancel(self) -> None:
        """Refuse new checks and cancel the running one at once: from now on nothing is published
        or logged (the first step of a shutdown)."""
        if self._retry is not None:
            self._retry.cancel()
        self._flight.close()

    async def close(self) -> None:
        """cancel(), then wait for the running check to end."""
        self.cancel()
        await self._flight.closed_and_done()

    async def _run_one(self) -> Observation:
        started = time.monotonic()
        self._helper_trouble = False
        found, repaired = await self._check_once()
        self.completed += 1
        if found is None:
            # Inconclusive: the agent is out of descriptors or memory. That is no device failure:
            # the last result stands, and we look again soon.
            if not self._exhausted:
                log.warning(
                    "device check inconclusive, keeping the last result (%s): %s",
                    "healthy" if self._observation.current.healthy else "unhealthy",
                    self._exhausted_reason,
                )
            self._exhausted = True
        elif self._exhausted:
            log.info("device check conclusive again")
            self._exhausted = False
        delay = self._rechecks.after(found, self._helper_trouble, self._cdi_transient)
        if delay is not None:
            self._schedule(delay)
        if found is None:
            return self._observation.current
        observation = found
        if self._observation.publish(observation):
            _say(observation, self.target.device_dir)
        if self._on_result:
            self._on_result(observation, time.monotonic() - started, repaired)
        return observation

    def _schedule(self, delay: float) -> None:
        """A check `delay` from now (replacing any retry already scheduled)."""
        if self._flight.closed:
            return
        if self._retry is not None:
            self._retry.cancel()
        self._retry = asyncio.get_running_loop().call_later(delay, self._retry_due)

    def _retry_due(self) -> None:
        self._retry = None
        self.request()

    @property
    def retry_pending(self) -> bool:
        """Whether a check is due on a timer (a prompt re-check, or a retry of the spec write or of
        an inconclusive check) rather than waiting for the next event or interval."""
        return self._retry is not None

    async def _check_once(self) -> tuple[Optional[Observation], bool]:  # noqa: PLR0911 - one per outcome
        """The observation, or None when the check was inconclusive (see _exhausted_reason)."""
        self._cdi_transient = False
        self._exhausted_reason = ""
        t = self.target
        candidates = hypervisors.present(t.device_dir)
        if not candidates:
            return Observation(False, hypervisors.absence_reason(t.device_dir), None, Cause.NO_DEVICE), False
        if t.inventory_only:
            hypervisor = candidates[0]
            ok, reason = _inventory(hypervisor.device_path(t.device_dir), _host_path(hypervisor, t))
            return Observation(ok, reason, hypervisor.name, Cause.NONE if ok else Cause.PROBE), False
        # The first row whose probe passes serves; when none does, the first row's failure is
        # what the node reports.
        failure: Optional[Observation] = None
        for hypervisor in candidates:
            result = await self._helper.run(
                ProbeRequest(hypervisor.name, hypervisor.device_path(t.device_dir), _host_path(hypervisor, t))
            )
            if result.exhausted:
                self._exhausted_reason = result.reason
                return None, False
            if result.ok:
                break
            self._helper_trouble = self._helper_trouble or result.helper_fault
            failure = failure or Observation(False, result.reason or "probe failed", hypervisor.name, Cause.PROBE)
        else:
            assert failure is not None
            return failure, False
        # Only a hypervisor that passed its probe may change the spec.
        try:
            if t.read_only:
                self.cdi_note = cdi.inspect(t.cdi_dir, _spec(hypervisor, t))
                return Observation(True, "", hypervisor.name), False
            plan = cdi.examine(t.cdi_dir, _spec(hypervisor, t))
            if plan is not None and await self._kept_by_newer(plan, hypervisor.name):
                return Observation(True, "", hypervisor.name), False
            if plan is not None:
                cdi.repair(plan)
            repaired = plan is not None
        except cdi.CdiError as exc:
            if exc.exhausted:
                self._exhausted_reason = str(exc)
                return None, False
            self._cdi_transient = exc.errno is not None
            return Observation(False, str(exc), hypervisor.name, Cause.CDI), False
        if repaired:
            log.info("CDI spec %s written", cdi.spec_path(t.cdi_dir))
        return Observation(True, "", hypervisor.name), repaired

    async def _kept_by_newer(self, plan: cdi.Plan, name: str) -> bool:
        """Whether a newer instance of ours keeps the spec that is there (one that resolves our
        device): then it stands, unrepaired, and no two instances rewrite it in turn (a surge
        update that changes device_uid). Said once per keeper."""
        keeper = await self._keeper() if self._keeper is not None and plan.lists(name) else None
        if keeper and keeper != self.kept_by:
            log.info("CDI spec %s is kept by newer instance %s; not rewriting it", cdi.spec_path(plan.cdi_dir), keeper)
        elif not keeper and self.kept_by:
            log.info(
                "instance %s no longer keeps CDI spec %s; keeping it again", self.kept_by, cdi.spec_path(plan.cdi_dir)
            )
        self.kept_by = keeper or ""
        return bool(keeper)


def _inventory(device: str, host: Optional[str]) -> tuple[bool, str]:
    """lstat only: the node must be a character device (not a symlink) and match the host's."""
    try:
        if kernel.host_identity(device) != kernel.host_identity(host or device):
            return False, f"{host} is not the same character device as {device}"
    except kernel.ProbeError as exc:
        return False, str(exc)
    return True, ""


def _spec(hypervisor: hypervisors.Hypervisor, target: CheckTarget) -> cdi.Spec:
    """Our device; every other row stays while the spec lists it (cdi.Spec says why)."""
    return cdi.Spec(
        hypervisor.name,
        hypervisor.container_path,
        target.uid,
        target.gid,
        tuple((h.name, h.container_path) for h in hypervisors.HYPERVISORS),
    )


def _host_path(hypervisor: hypervisors.Hypervisor, target: CheckTarget) -> Optional[str]:
    return hypervisor.device_path(target.host_device_dir) if target.host_device_dir else None


def _say(observation: Observation, device_dir: str) -> None:
    """A newly published observation, with structured fields for the journal (journal.py; plain
    stderr ignores them)."""
    device = hypervisors.BY_NAME[observation.hypervisor].device_path(device_dir) if observation.hypervisor else ""
    fields = {"HYPERVISOR": observation.hypervisor or "", "REASON": observation.reason, "DEVICE_PATH": device}
    if observation.healthy:
        log.info("device healthy: %s", observation.hypervisor, extra=fields)
    else:
        log.warning("device unhealthy: %s", observation.reason, extra=fields)
