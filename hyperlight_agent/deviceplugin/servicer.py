"""The DevicePlugin service: what the kubelet sees of the agent.

Slots are IDs `<hypervisor>-<n>`, all sharing the one device; their health is all Healthy or
all Unhealthy, straight from the shared observation. A device that goes missing keeps its slots,
Unhealthy: the kubelet shows a running pod's device as Healthy once no list names its ID any more
(allocatedResourcesStatus, 1.36+), so the IDs must stay for the pods to see the device broken. Only
a device never seen advertises no slots.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Optional

import grpc

from hyperlight_agent import contracts, text, transport
from hyperlight_agent.config import ALLOCATION_BOTH, ALLOCATION_CDI, ALLOCATION_DEVICE_SPEC, MAX_DEVICE_COUNT
from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.deviceplugin import api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.files import cdi
from hyperlight_agent.kubelet_side import Checks

log = logging.getLogger(__name__)


# Matched whole (fullmatch): "kvm-0\n" is no ID. The length limit is checked first, so the
# number never meets int()'s digit limit.
_DEVICE_ID = re.compile(r"([a-z]+)-(0|[1-9][0-9]*)")
# How much of an offending value a log line or an error message quotes.
QUOTE_LIMIT = 40


@dataclass(frozen=True)
class Profile:
    """What one plugin advertises and how it allocates; replaced as a whole on reload."""

    resource: str
    socket: str
    slots: int
    # One of config.ALLOCATION_MODES.
    allocation: str
    # Whether a DeviceSpec comes with the workload environment the CDI spec sets (not for the
    # bootstrap grant, which only the plugin's own pod receives).
    workload_env: bool = True


def device_ids(hypervisor: str, slots: int) -> list[str]:
    return [f"{hypervisor}-{i}" for i in range(slots)]


class DevicePluginServicer:
    def __init__(
        self,
        profile: Profile,
        observation: SharedObservation,
        checker: Checks,
        on_streams_changed: Optional[Callable[[int], None]] = None,
        on_allocate: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.profile = profile
        self._observation = observation
        self._checker = checker
        self._on_streams_changed = on_streams_changed
        self._on_allocate = on_allocate  # outcome ("ok", "invalid", "unavailable") for metrics
        self.open_streams = 0
        # Allocates: a handover lets those in flight end first (the kubelet cancels them itself
        # when our stream ends); a successor says how many it received (peers.py).
        self.calls = transport.Calls()
        # The last response built, reused by every stream until health or slots change.
        self._cached: Optional[tuple[Observation, int, Optional[str], pb.ListAndWatchResponse]] = None
        self._hypervisor: Optional[str] = None  # the last device seen: its slots outlive it

    def list_response(self, observation: Observation) -> pb.ListAndWatchResponse:
        slots = self.profile.slots
        self._hypervisor = observation.hypervisor or self._hypervisor
        key = (observation, slots, self._hypervisor)
        if self._cached and self._cached[:3] == key:
            return self._cached[3]
        health = contracts.HEALTHY if observation.healthy else contracts.UNHEALTHY
        ids = device_ids(self._hypervisor, slots) if self._hypervisor else []
        response = pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health=health) for i in ids])
        self._cached = (*key, response)
        return response

    # --- RPCs -------------------------------------------------------------------------------

    async def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return api.plugin_options()

    async def watch(
        self,
        closed: asyncio.Event,
        on_stream: Optional[Callable[[int], None]] = None,
    ) -> AsyncGenerator[pb.ListAndWatchResponse, None]:
        """A ListAndWatch stream's lists, until `closed` is set (then the stream ends at once); the
        RPC itself is Endpoint's, which knows the server the stream belongs to.
        on_stream(+1) and on_stream(-1) are called as it opens and ends."""
        self._streams_changed(+1)
        if on_stream:
            on_stream(+1)
        try:
            # The first list goes out only after the first check has completed.
            if not await _unless_closed(self._observation.wait_newer(0), closed):
                return
            last_sent: Optional[pb.ListAndWatchResponse] = None
            while True:
                version = self._observation.version
                response = self.list_response(self._observation.current)
                if response is not last_sent:
                    yield response
                    last_sent = response
                if not await _unless_closed(self._observation.wait_newer(version), closed):
                    return
        finally:
            self._streams_changed(-1)
            if on_stream:
                on_stream(-1)

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        # Slots are interchangeable: honour must-include IDs, then take the first available.
        # Linear in the request's size, which is bounded: this runs on the event loop.
        total = sum(len(r.available_deviceIDs) + len(r.must_include_deviceIDs) for r in request.container_requests)
        # More than twice the most slots a node can advertise is no request the kubelet makes.
        if total > 2 * MAX_DEVICE_COUNT:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{total} device IDs in one request; at most {2 * MAX_DEVICE_COUNT}"
            )
        responses = []
        for req in request.container_requests:
            chosen = list(dict.fromkeys(req.must_include_deviceIDs))
            seen = set(chosen)
            room = req.allocation_size - len(chosen)
            for device_id in req.available_deviceIDs:
                if room <= 0:
                    break
                if device_id not in seen:
                    seen.add(device_id)
                    chosen.append(device_id)
                    room -= 1
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        async with self.calls.counted(context):
            return await self._allocate(request, context)

    async def _allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        if not request.container_requests:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", "no container requests")
        # Answer from a check that completes after this request arrived, never from a cached
        # result; the kubelet sets no deadline, but honour one if a caller does.
        try:
            observation = await self._checker.check(timeout=context.time_remaining())
        except asyncio.TimeoutError:
            await self._refuse(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "deadline",
                "deadline passed while waiting for the device check",
            )
        if observation.hypervisor is None or not observation.healthy:
            await self._refuse(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "unavailable",
                f"{self.profile.resource} is unhealthy: {observation.reason}",
            )
        hypervisor = hypervisors.BY_NAME[str(observation.hypervisor)]
        named = sum(len(req.devices_ids) for req in request.container_requests)
        if named > self.profile.slots:
            await self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "invalid",
                f"{named} device IDs requested; this node has {self.profile.slots} slots",
            )
        responses = []
        for n, req in enumerate(request.container_requests):
            if not req.devices_ids:
                await self._refuse(
                    context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", f"container request {n} names no device IDs"
                )
            for device_id in req.devices_ids:
                problem = self._id_problem(device_id, hypervisor.name)
                if problem:
                    await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", problem)
            responses.append(self._container_response(hypervisor))
        if self._on_allocate:
            self._on_allocate("ok")
        return pb.AllocateResponse(container_responses=responses)

    # --- helpers ----------------------------------------------------------------------------

    def _id_problem(self, device_id: str, hypervisor: str) -> Optional[str]:
        quoted = text.quote(device_id, QUOTE_LIMIT)
        if len(device_id) > contracts.MAX_DEVICE_ID_LENGTH:
            return f"malformed device ID {quoted}: longer than {contracts.MAX_DEVICE_ID_LENGTH} characters"
        match = _DEVICE_ID.fullmatch(device_id)
        if not match:
            return f"malformed device ID {quoted}"
        if match.group(1) != hypervisor or int(match.group(2)) >= self.profile.slots:
            return f"unknown device ID {quoted}"
        return None

    def _container_response(self, hypervisor: hypervisors.Hypervisor) -> pb.ContainerAllocateResponse:
        response = pb.ContainerAllocateResponse()
        if self.profile.allocation in (ALLOCATION_CDI, ALLOCATION_BOTH):
            response.cdi_devices.append(pb.CDIDevice(name=cdi.device_name(hypervisor.name)))
        if self.profile.allocation in (ALLOCATION_DEVICE_SPEC, ALLOCATION_BOTH):
            response.devices.append(
                pb.DeviceSpec(
                    container_path=hypervisor.container_path,
                    host_path=hypervisor.container_path,
                    permissions="rw",
                )
            )
            if self.profile.workload_env:
                # What the CDI spec sets, for runtimes that ignore CDI (containerd 1.6). Where
                # both arrive, the values are the same.
                response.envs[contracts.ENV_HYPERVISOR] = hypervisor.name
                response.envs[contracts.ENV_DEVICE_PATH] = hypervisor.container_path
        return response

    async def _refuse(self, context: Any, code: grpc.StatusCode, outcome: str, message: str) -> None:
        if self._on_allocate:
            self._on_allocate(outcome)
        log.info("Allocate refused: %s", message)
        await context.abort(code, message)

    def _streams_changed(self, delta: int) -> None:
        self.open_streams += delta
        if self._on_streams_changed:
            self._on_streams_changed(self.open_streams)


async def _unless_closed(waiter: Awaitable[object], closed: asyncio.Event) -> bool:
    """Await waiter; False (waiter cancelled) as soon as `closed` is set."""
    work = asyncio.ensure_future(waiter)
    if closed.is_set():
        work.cancel()
        return False
    closing = asyncio.ensure_future(closed.wait())
    try:
        await asyncio.wait((work, closing), return_when=asyncio.FIRST_COMPLETED)
    finally:
        work.cancel()
        closing.cancel()
    return not closed.is_set()


class Endpoint:
    """What one server serves: the servicer's methods, with that server's streams counted on
    their own and ended together when the server stops (the kubelet must see the stream end
    before our socket disappears)."""

    def __init__(self, servicer: DevicePluginServicer, on_stream: Callable[[int, object], None]) -> None:
        self._servicer = servicer
        self._on_stream = on_stream
        self._closed = asyncio.Event()

    def close(self) -> None:
        self._closed.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._servicer, name)

    async def ListAndWatch(self, request: pb.Empty, context: Any) -> AsyncIterator[pb.ListAndWatchResponse]:
        # grpc.aio wants an async generator function here, so the stream is relayed.
        # on_stream(delta, key): the key tells this stream from the server's others.
        key = object()
        stream = self._servicer.watch(self._closed, lambda delta: self._on_stream(delta, key))
        try:
            async for response in stream:
                yield response
        finally:
            await stream.aclose()  # `async for` alone leaves the inner generator to the GC
