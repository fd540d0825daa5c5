"""The DRA side's API half: the API client, this node's ResourceSlice published and kept following
every device check (an unusable device tainted NoSchedule at once, NoExecute once the escalation
says so, dra/taints.py), and the devices the slice offers. The node half (dra/side.py: the
kubelet's plugin watcher and the DRAPlugin service) builds it, connects it and runs it, as the
kubelet's Go helper leaves the slice to its resourceslice controller.

    keeper = SliceKeeper(SliceTarget(...), observation, checker, outcomes, ...)
    kube = keeper.connect(environ)   the API client, or ClientConfigError (api_error says why)
    keeper.jobs()                    what runs until cancelled: publish, follow the checks
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Mapping, Optional

from hyperlight_agent import waits
from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.dra.outcomes import DraOutcomes
from hyperlight_agent.dra.slice_spec import DeviceInfo, device_names
from hyperlight_agent.dra.slices import SlicePublisher
from hyperlight_agent.dra.taints import Escalation, taint_for
from hyperlight_agent.kubelet_side import Checks

# A check for a pending eviction is waited for this long (the helper's start and a probe's deadline
# fit); one that takes longer is no evidence, and the next is asked for.
PENDING_CHECK_TIMEOUT_S = 15.0


def device_info(observation: Observation) -> Optional[DeviceInfo]:
    """What the slice says about the device found (its path in containers), usable or not; None
    when no device was found.

    >>> device_info(Observation(False, "KVM_CREATE_VM failed", "kvm"))
    DeviceInfo(hypervisor='kvm', api_version=12, path='/dev/kvm')
    """
    if observation.hypervisor is None:
        return None
    row = hypervisors.BY_NAME[observation.hypervisor]
    return DeviceInfo(row.name, row.api_version or 0, row.container_path)


@dataclass(frozen=True)
class SliceTarget:
    """Whose slice, of what shape, from which API credentials (the DRA side's DraTarget's part)."""

    node_name: str
    driver: str
    identical_devices: int
    shared: bool
    kubeconfig: Optional[str]
    evict_after_s: float


class SliceKeeper:
    def __init__(
        self,
        target: SliceTarget,
        observation: SharedObservation,
        checker: Checks,
        outcomes: DraOutcomes,
        keeper: Callable[[], Awaitable[Optional[str]]],
        on_change: Callable[[], None],
        on_checked: Callable[[], None],
    ) -> None:
        """`keeper`: a newer instance of ours that keeps the slice instead of us, if any;
        `on_change`: the publisher's state changed; `on_checked`: the slice followed a check."""
        self.target = target
        self._observation = observation
        self._checker = checker
        self._outcomes = outcomes
        self._keeper = keeper
        self._on_change = on_change
        self._on_checked = on_checked
        self.kube: Any = None  # the API client (client.KubeApi), once connected
        self.api_error = ""  # why there is no API client yet ("" once there is)
        self.publisher: Optional[SlicePublisher] = None
        # The device the slice describes: the last one a check found (a missing device stays in
        # the slice, tainted, under the name it had).
        self.device: Optional[DeviceInfo] = None
        self.escalation = Escalation(target.evict_after_s)

    def connect(self, environ: Mapping[str, str]) -> Any:
        """The API client; raises client.ClientConfigError (and api_error says it) until it can."""
        from hyperlight_agent.dra import client  # lightkube only in this mode

        try:
            self.kube = client.connect(self.target.kubeconfig, environ=environ)
        except client.ClientConfigError as exc:
            self.api_error = str(exc)
            raise
        self.api_error = ""
        return self.kube

    def jobs(self) -> list[Coroutine[Any, Any, None]]:
        """Once connected: the publisher of the slice, and the slice following the checks; the
        caller runs them until cancelled."""
        t = self.target
        publisher = self.publisher = SlicePublisher(
            self.kube,
            t.node_name,
            t.driver,
            t.identical_devices,
            newer=self._keeper,
            on_change=self._on_change,
            shared=t.shared,
            on_event=self._outcomes.slice_event,
        )
        return [self._follow_checks(publisher), publisher.run()]

    def wake(self) -> None:
        """Another instance may have come or gone (who keeps the slice): look again."""
        if self.publisher is not None:
            self.publisher.wake()

    def offered(self) -> list[str]:
        """The devices the slice offers (or offered, for a device gone missing: the shape it had)."""
        if self.device is None:
            return []
        shared = self.publisher.shared if self.publisher is not None else self.target.shared
        hypervisor = self.device.hypervisor
        return [hypervisor] if shared else device_names(hypervisor, self.target.identical_devices)

    async def close(self) -> None:
        if self.kube is not None:
            kube, self.kube = self.kube, None
            await kube.close()

    async def _follow_checks(self, publisher: SlicePublisher) -> None:
        """The slice follows every completed check: an unusable device tainted NoSchedule at once,
        NoExecute once the escalation says so. While an eviction is pending, the escalation's own
        checks run when it says (taints.py: the checks run within the debounce decide it)."""
        version = 0
        while True:
            due = self.escalation.check_due_in()
            with contextlib.suppress(asyncio.TimeoutError):
                await waits.within(self._observation.wait_newer(version), due)
            if self._observation.version != version:
                version = self._observation.version
                self.escalation.observe(self._observation.current.healthy)
            elif due is not None:  # the timeout: a check for the pending eviction
                version = await self._pending_check()
            observation = self._observation.current
            self.device = device_info(observation) or self.device
            taint = taint_for(observation, self.escalation.effect())
            publisher.set_device(self.device, taint)
            self._outcomes.taint(taint.effect if taint and publisher.taints and self.device else "")
            self._on_checked()

    async def _pending_check(self) -> int:
        """Run a check for the pending eviction and tell the escalation what it found, with when
        it started at the earliest (now: it starts after we ask); the observation's version then.
        A check that does not conclude (stuck past PENDING_CHECK_TIMEOUT_S, inconclusive, the
        checker closing) says nothing: the next one is asked for a step later."""
        asked, concluded = self.escalation.clock(), self._observation.checks
        check = asyncio.ensure_future(self._checker.check(timeout=PENDING_CHECK_TIMEOUT_S))
        try:
            await asyncio.wait({check})
        except asyncio.CancelledError:  # our own cancellation (the side closing)
            check.cancel()
            raise
        if not check.cancelled() and check.exception() is None and self._observation.checks > concluded:
            self.escalation.observe(self._observation.current.healthy, started=asked)
        else:
            self.escalation.inconclusive(asked)
        return self._observation.version
