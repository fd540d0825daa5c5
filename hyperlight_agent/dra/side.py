"""The DRA mode as the agent's kubelet side: its kubelet half (the DRAPlugin service and the
plugin watcher's registration), which builds and runs its API half (dra/slice_keeper.py: this
node's ResourceSlice) and its succession (dra/succession.py: handing over to another instance of
ours) and reads claims for Prepare, on the agent's loop.

    DraSide(DraTarget(node_name, instance, identical_devices, kubeconfig, registry_dir, plugins_dir), wiring,
            DraOutcomes(series))
    run(): connect to the API server (retried with backoff until it can), serve and register with
           the kubelet's plugin watcher (retried likewise), publish this node's ResourceSlice and
           keep it following every device check until cancelled
    close(): deregister and stop serving; the slice stays (a successor instance during a rolling
             update publishes the same one, and the kubelet removes a driver's slices 30 s after
             its last instance is gone)

The device check, the CDI spec, readiness, sd_notify and metrics are the agent's, as in the device
plugin modes: this module only turns observations into a ResourceSlice (an unusable device tainted,
dra/taints.py), into the health the kubelet shows in pod status (dra/health.py), and claims into
CDI devices.

Why: docs/decisions/dra-a-second-kubelet-protocol.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Optional

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.backoff import Backoff
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.dra import names, registration
from hyperlight_agent.dra.health import Health
from hyperlight_agent.dra.instances import Instances
from hyperlight_agent.dra.outcomes import DraOutcomes
from hyperlight_agent.dra.prepared import Prepared
from hyperlight_agent.dra.service import Service
from hyperlight_agent.dra.slice_keeper import SliceKeeper, SliceTarget
from hyperlight_agent.dra.succession import DraSuccession
from hyperlight_agent.dra.types import AllocatedDevice, ClaimError
from hyperlight_agent.kubelet_side import Checks, Wiring, count

log = logging.getLogger(__name__)

# Starting (the API client, our sockets) is retried 0.5, 1, 2 … 30 s apart: a missing plugin
# directory or an API server that is not there yet must not turn into a crash loop.
RETRY_INITIAL_S = 0.5
RETRY_CAP_S = 30.0
# Each Prepare runs a fresh device check (as Allocate does), bounded well below the kubelet's 45 s.
PREPARE_CHECK_TIMEOUT_S = 10.0


class _NotConnected:
    """The claim reader before the API client exists: every claim says why."""

    def __init__(self, why: Callable[[], str]) -> None:
        self._why = why

    async def allocation(self, namespace: str, name: str, uid: str) -> list[AllocatedDevice]:
        raise ClaimError(f"claim {namespace}/{name}: no API connection yet: {self._why()}")


@dataclass(frozen=True)
class DraTarget:
    """Who the DRA driver is and where it talks: its node, its instance (its sockets' names), how
    many identical devices it publishes where one shared device cannot be, the API credentials and
    the kubelet's plugin directories."""

    node_name: str
    instance: str
    identical_devices: int  # the dra_devices setting
    kubeconfig: Optional[str]
    registry_dir: str
    plugins_dir: str
    driver: str = contracts.DRA_DRIVER
    shared: bool = True  # one shared device where the API server keeps allowMultipleAllocations
    # An unusable device's taint turns NoExecute after this long without a passing check (0: never).
    evict_after_s: float = 0.0


@dataclass(frozen=True)
class DraSnapshot:
    """What the DRA side's readiness depends on."""

    observation: Observation
    checked: bool
    registered: bool  # the kubelet's plugin watcher said so
    registration_error: str
    registration_socket: str
    published: bool  # the API server's ResourceSlice equals what the last check says (or a newer instance keeps it)
    slice_error: str
    slots: int  # the devices published (the API's word; SlicePublisher.published_devices): a share each
    kept_by: str = ""  # a newer instance of ours that keeps the slice
    shared: bool = False  # one device every claim shares

    def ready(self) -> bool:
        """Registered with the plugin watcher, the ResourceSlice published, and the last device check passed."""
        return self.registered and self.published and self.checked and self.observation.healthy

    def status(self) -> str:  # noqa: PLR0911 - one return per state reads best
        """What the DRA driver is doing or waiting for.

        >>> from hyperlight_agent.device.observation import Observation
        >>> DraSnapshot(Observation(True, "", "kvm"), True, True, "", "/r/x-reg.sock", True, "", 128).status()
        'ready: kvm, 128 devices in the ResourceSlice'
        """
        obs = self.observation
        if self.checked and not obs.healthy:
            return f"unhealthy: {obs.reason}" + (f"; ResourceSlice: {self.slice_error}" if self.slice_error else "")
        if not self.registered:
            if self.registration_error:
                return f"not registered with the kubelet ({self.registration_socket}): {self.registration_error}"
            return f"waiting for the kubelet's plugin watcher to register {self.registration_socket}"
        if not self.checked:
            return "checking the device"
        if not self.published:
            if self.slice_error:
                return f"ResourceSlice not published: {self.slice_error}"
            return "publishing the ResourceSlice"
        if self.kept_by:
            return f"ready: {obs.hypervisor}, the ResourceSlice kept by newer instance {self.kept_by}"
        if self.shared:
            return f"ready: {obs.hypervisor}, one device in the ResourceSlice, shared by every claim"
        return f"ready: {obs.hypervisor}, {count(self.slots, 'device')} in the ResourceSlice"


class DraSide:
    # The calls in flight, deregistration's wait for the kubelet, then the service's stop grace.
    close_bound_s = registration.CALLS_DRAIN_S + registration.DEREGISTER_GRACE_S + transport.STOP_GRACE_S

    def __init__(self, target: DraTarget, wiring: Wiring, outcomes: DraOutcomes) -> None:
        self._wiring = wiring
        self._outcomes = outcomes
        self.identity = wiring.identity
        self.node_name = target.node_name
        self.identical_devices = target.identical_devices
        self._shared_device = target.shared
        self._on_change = wiring.on_change
        self._registered = asyncio.Event()  # the kubelet registered us (since the last time we were not)
        self.health = Health(
            wiring.observation, self.health_devices, lambda: self.node_name, on_stream=outcomes.health_stream
        )
        self.service = self._service(target)
        sockets = (
            names.registration_socket(target.registry_dir, target.driver, target.instance),
            names.service_socket(target.plugins_dir, target.driver, target.instance),
        )
        self.instances = Instances(wiring.identity, target.registry_dir, target.driver, sockets[0])
        self.registrar = self._driver_servers(target, sockets)
        self.slices = self._slice_keeper(target, outcomes)  # the API half
        self.succession = DraSuccession(
            self.instances, self.registrar, self.service.calls, wiring.observation, self.slices.wake
        )
        # Our two sockets (removed by a cleanup tool: served again), and other instances'
        # registration sockets coming and going (whether a newer one keeps the slice).
        for path in sockets:
            wiring.watcher.watch(os.path.dirname(path), lambda name: self.sockets_changed())

    def _service(self, target: DraTarget) -> Service:
        """The DRAPlugin service: claims read once the API client exists, each Prepare a fresh check."""
        wiring = self._wiring
        return Service(
            target.driver,
            _NotConnected(lambda: self.slices.api_error),
            functools.partial(fresh_check, wiring.checker, wiring.observation),
            Prepared(os.path.join(target.plugins_dir, target.driver)),
            on_call=self._prepared,
        )

    def _driver_servers(self, target: DraTarget, sockets: tuple[str, str]) -> registration.DriverServers:
        """The kubelet half: our service and registration sockets, served while succession allows."""
        watcher = self._wiring.watcher
        return registration.DriverServers(
            self.service,
            target.driver,
            target.instance,
            target.registry_dir,
            target.plugins_dir,
            registration.Hooks(
                on_change=self._registration_changed,
                configure=self._wiring.serve_ours,
                watched=lambda: all(watcher.watching(os.path.dirname(p)) for p in sockets),
                may_register=lambda: self.succession.may_register(),  # noqa: PLW0108 - built after this
            ),
            health=self.health,
        )

    def _slice_keeper(self, target: DraTarget, outcomes: DraOutcomes) -> SliceKeeper:
        """The API half: the slice, kept by the newest serving instance of ours."""
        return SliceKeeper(
            SliceTarget(
                target.node_name,
                target.driver,
                target.identical_devices,
                target.shared,
                target.kubeconfig,
                target.evict_after_s,
            ),
            self._wiring.observation,
            self._wiring.checker,
            outcomes,
            keeper=lambda: self.succession.slice_keeper(),  # noqa: PLW0108 - likewise
            on_change=self._slice_changed,
            on_checked=self.health.refresh,
        )

    def describe(self) -> str:
        shape = "one shared device (else " if self._shared_device else "("
        return (
            f"DRA driver {self.registrar.driver}, node {self.node_name}, {shape}{self.identical_devices} device(s)), "
            f"socket {self.registrar.service_socket}"
        )

    def begin_stop(self) -> None:
        """Nothing the kubelet must see before close(): deregistration comes first there."""

    def snapshot(self, observation: Observation, checked: bool) -> DraSnapshot:
        p = self.slices.publisher
        return DraSnapshot(
            observation,
            checked,
            self.registrar.registered,
            self.registrar.error,
            self.registrar.registration_socket,
            p is not None and p.standing.published,
            self.slices.api_error if p is None else p.last_error,
            self.identical_devices if p is None else p.published_devices,
            p.standing.kept_by if p is not None else "",
            p is not None and p.shared,
        )

    def reconfigure(self, target: DraTarget) -> None:
        """Every DRA setting changes only on restart (the device check's follow on their own)."""

    # --- lifecycle ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled; never raises anything else (each part retries on its own). Serving
        does not wait for the API: without it a Prepare gets a claim error saying why, and the
        status says why no slice is published."""
        tasks = [
            asyncio.ensure_future(retrying("DRA registration", self._serve, self._on_change)),
            asyncio.ensure_future(self.health.expect_stream(self._registered, self.registrar.driver)),
        ]
        try:
            await retrying("API client", self._connect, self._on_change)
            tasks += [asyncio.ensure_future(job) for job in self.slices.jobs()]
            await asyncio.gather(*tasks)
        finally:
            await waits.cancelled(tasks)

    def described(self) -> Mapping[str, Any]:
        """What Describe adds for this side (peers.py): `serving` is ready but for the slice;
        `settling`: registered too recently to hand over to (registration.REGISTRATION_SETTLE_S)."""
        return {
            "serving": self.succession.serving(),
            "calls": self.service.calls.received,
            "settling": self.registrar.settling(),
        }

    def sockets_changed(self) -> None:
        """A socket came or went in the registry or our plugin directory: ours may need serving
        again, and another instance may have come or gone (who keeps the slice)."""
        self.registrar.wake()
        self.slices.wake()
        # The kubelet forgets our driver's health when another instance's stream ends: say it again.
        self.health.nudge()

    def _registration_changed(self) -> None:
        """Registered or not: readiness, whether we may keep the slice (slice_keeper), and the
        wait for the kubelet's health stream."""
        if self.registrar.registered:
            self._registered.set()
        else:
            self._registered.clear()
        self._on_change()
        self.slices.wake()

    async def close(self) -> None:
        self.health.close()
        await self.registrar.close()
        await self.slices.close()

    # --- parts ----------------------------------------------------------------------------------

    async def _connect(self) -> None:
        from hyperlight_agent.dra import claims, client  # lightkube only in this mode

        try:
            kube = self.slices.connect(self._wiring.environ)
        except client.ClientConfigError as exc:
            raise _Retry(str(exc)) from exc
        self.service.claims = claims.ApiClaims(kube)
        self._on_change()

    async def _serve(self) -> None:
        try:
            await self.registrar.run()
        except transport.NotServing as exc:
            raise _Retry(str(exc)) from exc

    def health_devices(self) -> list[str]:
        """The devices whose health the kubelet hears of: those the slice offers (or offered, for
        a device gone missing: the shape it had) and those of claims prepared on this node."""
        found = set(self.slices.offered())
        for claim in self.service.prepared.claims().values():
            found.update(d.device for d in claim.devices if d.pool == self.node_name)
        return sorted(found)

    def _prepared(self, operation: str, seconds: float, ok: int, failed: int) -> None:
        """After each Prepare or Unprepare: the metrics, and the health of a device of a claim we
        did not list yet."""
        self._outcomes.call(operation, seconds, ok, failed)
        self.health.refresh()

    def _slice_changed(self) -> None:
        """The publisher's state changed, its shape maybe (identical devices after all)."""
        self.health.refresh()
        self._on_change()


class _Retry(Exception):
    """A start-up step failed in a way that may pass (said once, then retried with backoff)."""


async def retrying(what: str, attempt: Callable[[], Awaitable[Any]], on_failure: Callable[[], None]) -> Any:
    """attempt() until it returns, backed off after each _Retry (each distinct problem said once)."""
    backoff, said = Backoff(RETRY_INITIAL_S, RETRY_CAP_S), ""
    while True:
        try:
            return await attempt()
        except _Retry as exc:
            if str(exc) != said:
                said = str(exc)
                log.error("%s: %s; retrying with backoff", what, said)
            on_failure()
        await asyncio.sleep(backoff.next())


async def fresh_check(checker: Checks, observation: SharedObservation) -> Observation:
    """What a Prepare is answered from: a fresh check. Once the agent stops, its checker checks
    no more (its first step), while a call already with us is still to be answered (the
    registrar deregisters only after it): that one gets the last check's result, a moment old,
    rather than a dropped call, which the kubelet only sees fail as it deregisters us."""
    check = asyncio.ensure_future(checker.check(timeout=PREPARE_CHECK_TIMEOUT_S))
    try:
        await asyncio.wait({check})
    except asyncio.CancelledError:  # our caller's own cancellation (a server stopping)
        check.cancel()
        raise
    if check.cancelled():  # the checker's: the agent is stopping
        return observation.current
    return check.result()
