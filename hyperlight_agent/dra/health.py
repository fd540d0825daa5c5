"""The kubelet's DRA resource-health service (DRAResourceHealth, v1 and v1alpha1): the health of
each of our devices as the device check sees it, streamed to the kubelet, which writes it into the
status of the pods using them (`status.containerStatuses[].allocatedResourcesStatus`).

    Health(observation, devices=lambda: ["kvm"], pool=lambda: "node1")
    NodeWatchResources → one report at once, then another whenever the observation or the devices
      change, and every RESEND_S in any case; each report names every device:
        HEALTHY    the last check passed, on this device's hypervisor
        UNHEALTHY  it failed or the device is gone; `message` says why (the check's reason)
        UNKNOWN    no check has finished yet
    endpoint() → one server's face of it, whose streams all end when that server stops

What the kubelet does with the reports (pkg/kubelet/cm/dra, 1.37; standin/dra_kubelet.py plays it):
- it opens the stream for an instance that names the service in its PluginInfo, once per
  registration, again DRA_HEALTH_REOPEN_S after it ended, never after UNIMPLEMENTED;
- it stamps each reported device on arrival and reads a device as Unknown once it has not been
  reported for health_check_timeout_seconds (TIMEOUT_S here): hence a report every RESEND_S even
  when nothing changed, a third of the timeout, so one late report changes nothing;
- it forgets the whole driver's health when any stream of it ends (a rolling update's old
  instance going away), without telling the pods; the next report of each device counts as a
  change and updates them: hence `nudge()`, a report soon after another instance came or went.

Why: docs/decisions/health-where-the-cluster-sees-it.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import ModuleType
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Optional, Sequence

import grpc

from hyperlight_agent import contracts, text, waits
from hyperlight_agent.device.observation import Observation, SharedObservation

# A report of every device this often even when nothing changed; the kubelet trusts each one for
# TIMEOUT_S. An agent that stops reporting (wedged: the liveness probe restarts it) shows Unknown
# after that, never a stale Healthy for long.
RESEND_S = 60.0
TIMEOUT_S = 3 * RESEND_S
# The kubelet's plugin watcher looks at the registry every second; after another instance's
# registration socket went, its stream ends (and the driver's health is forgotten) within about
# that, and our next report puts it back.
PEER_SETTLE_S = 2.0
# The kubelet opens its resource-health stream as it registers us (1.37: in the same call). No
# stream this long after registration: a kubelet that never will (before 1.36, or its
# ResourceHealthStatus gate off), said once.
STREAM_WAIT_S = 10.0

log = logging.getLogger(__name__)

HEALTHY, UNHEALTHY, UNKNOWN = "HEALTHY", "UNHEALTHY", "UNKNOWN"


def hypervisor_of(device: str) -> str:
    """The hypervisor a device of our slice stands for: "kvm" for kvm or kvm-3."""
    return device.split("-", 1)[0]


def device_health(observation: Observation, checked: bool, device: str) -> tuple[str, str]:
    """(health, message) of one device of ours.

    >>> device_health(Observation(True, "", "kvm"), True, "kvm-3")
    ('HEALTHY', '')
    >>> device_health(Observation(False, "/dev/kvm is missing", None), True, "kvm")
    ('UNHEALTHY', '/dev/kvm is missing')
    >>> device_health(Observation(True, "", "mshv"), True, "kvm")
    ('UNHEALTHY', "kvm is no longer this node's hypervisor (mshv is)")
    """
    if not checked:
        return UNKNOWN, "no device check has completed yet"
    hypervisor = hypervisor_of(device)
    if observation.hypervisor not in (None, hypervisor):
        return UNHEALTHY, f"{hypervisor} is no longer this node's hypervisor ({observation.hypervisor} is)"
    if observation.healthy:
        return HEALTHY, ""
    return UNHEALTHY, observation.reason or "the device check failed"


class Health:
    """The service's state: what to report, and who listens. Create inside the event loop."""

    def __init__(
        self,
        observation: SharedObservation,
        devices: Callable[[], Sequence[str]],
        pool: Callable[[], str],
        *,
        clock: Callable[[], float] = time.time,
        resend_s: float = RESEND_S,
        timeout_s: float = TIMEOUT_S,
        on_stream: Callable[[int], None] = lambda delta: None,
    ) -> None:
        self._observation = observation
        self._devices = devices
        self._pool = pool
        self._clock = clock
        self._resend_s = resend_s
        self._timeout_s = timeout_s
        self._on_stream = on_stream  # +1 / -1 as streams open and end (the metric)
        self._kick = asyncio.Event()  # replaced on each change: every stream wakes
        self._nudge: Optional[asyncio.TimerHandle] = None
        self._stamp = (-1, 0)  # (observation version, when we first saw it: Unix seconds)
        self._listed: list[str] = []  # the devices of the last report
        self.streams = 0  # open now
        self.opened = 0  # ever opened
        self.reports = 0  # reports sent, on every stream
        self.first_opened = asyncio.Event()

    def changed(self) -> None:
        """Report now, on every stream."""
        kick, self._kick = self._kick, asyncio.Event()
        kick.set()

    def refresh(self) -> None:
        """Report now if the devices are not those last reported (the slice's shape changed, a
        claim on a device we did not list was recorded)."""
        if self.streams and list(self._devices()) != self._listed:
            self.changed()

    def nudge(self, after: Optional[float] = None) -> None:
        """Report again `after` (PEER_SETTLE_S) seconds from now, once however often this is
        called meanwhile."""
        if self._nudge is None or self._nudge.cancelled():
            loop = asyncio.get_running_loop()
            self._nudge = loop.call_later(PEER_SETTLE_S if after is None else after, self._nudged)

    def _nudged(self) -> None:
        self._nudge = None
        self.changed()

    def close(self) -> None:
        if self._nudge is not None:
            self._nudge.cancel()

    async def expect_stream(self, registered: asyncio.Event, driver: str) -> None:
        """Say once if the kubelet registers us (`registered` set, cleared while we are not) but
        opens no resource-health stream: pods' status then shows nothing of the device's health
        (the slice's taint still does)."""
        while not self.first_opened.is_set():
            await registered.wait()
            if await waits.event(self.first_opened, STREAM_WAIT_S):
                return
            if registered.is_set():
                log.info(
                    "the kubelet registered DRA driver %s but opened no resource-health stream within %g s "
                    "(a kubelet before 1.36, or its ResourceHealthStatus feature gate off): pods' status will "
                    "not show the hypervisor's health; the ResourceSlice's taint still does",
                    driver,
                    STREAM_WAIT_S,
                )
                return

    def endpoint(self) -> HealthEndpoint:
        return HealthEndpoint(self)

    def report(self, messages: ModuleType) -> Any:
        """One NodeWatchResourcesResponse (of `messages`' version) naming every device."""
        observation, version = self._observation.current, self._observation.version
        if version != self._stamp[0]:
            self._stamp = (version, int(self._clock()))
        response = messages.NodeWatchResourcesResponse()
        pool = self._pool()
        self._listed = list(self._devices())
        for name in self._listed:
            health, message = device_health(observation, version > 0, name)
            response.devices.add(
                device=messages.DeviceIdentifier(pool_name=pool, device_name=name),
                health=messages.HealthStatus.Value(health),
                last_updated_time=self._stamp[1],
                health_check_timeout_seconds=int(self._timeout_s),
                message=text.shown(message, contracts.DRA_HEALTH_MESSAGE_MAX - 30),
            )
        return response

    async def watch(self, messages: ModuleType, closed: asyncio.Event) -> AsyncGenerator[Any, None]:
        """The stream: a report at once, then on every change and every resend_s, until `closed`."""
        self.streams += 1
        self.opened += 1
        self.first_opened.set()
        self._on_stream(1)
        try:
            while not closed.is_set():
                kick, version = self._kick, self._observation.version
                self.reports += 1
                yield self.report(messages)
                waiters = [
                    asyncio.ensure_future(kick.wait()),
                    asyncio.ensure_future(closed.wait()),
                    asyncio.ensure_future(self._observation.wait_newer(version)),
                ]
                try:
                    await asyncio.wait(waiters, timeout=self._resend_s, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiter in waiters:
                        waiter.cancel()
        finally:
            self.streams -= 1
            self._on_stream(-1)


class HealthEndpoint:
    """What one server serves of the service (api.health_handlers(endpoint)): its streams end
    together when close() is called, before that server stops (a stream left open would hold the
    server's stop for its whole grace)."""

    def __init__(self, health: Health) -> None:
        self._health = health
        self._closed = asyncio.Event()

    def close(self) -> None:
        self._closed.set()

    async def NodeWatchResources(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any], messages: ModuleType
    ) -> AsyncIterator[Any]:
        stream = self._health.watch(messages, self._closed)
        try:
            async for report in stream:
                yield report
        finally:
            await stream.aclose()  # `async for` alone leaves the inner generator to the GC
