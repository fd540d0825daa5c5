"""The DRAPlugin service (v1 and v1beta1 alike): the kubelet's NodePrepareResources and
NodeUnprepareResources for our driver.

    Service(driver, claim_reader, observe, prepared)
    NodePrepareResources, per claim (concurrently, at most MAX_CONCURRENT_CLAIMS at once):
      recorded in `prepared` → the recorded answer (the kubelet asks again after its restart,
                               and a rolling update's other instance may have prepared it);
      else claim_reader.allocation(ns, name, uid) → the results of our driver
          none of ours          → "claim ns/name has no device of driver hyperlight.dev"
          device unhealthy      → "device kvm-3 (/dev/kvm) failed its check: <reason>"
          else                  → one Device per result with our CDI id, recorded, answered
    NodeUnprepareResources: forget the claim; an unknown claim is a success (the kubelet's
      reconcile retries every 60 s and may ask for claims we never saw).

Every claim of a request gets an entry: a claim's failure is its `error`, never the RPC's (a gRPC
error would fail every claim of the batch). The only RPC-level error is a malformed request.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from types import ModuleType
from typing import Any, Awaitable, Callable, Optional, Union

import grpc

from hyperlight_agent import waits
from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.observation import Observation
from hyperlight_agent.dra.prepared import Prepared, PreparedClaim, PreparedDevice, PreparedError
from hyperlight_agent.dra.types import ClaimError, ClaimReader
from hyperlight_agent.node import cdi

log = logging.getLogger(__name__)

# Claims of all requests being prepared at once: each may be an API read. The kubelet batches one
# pod's claims per driver, so this bounds a burst of pod starts, not one pod.
MAX_CONCURRENT_CLAIMS = 16
# One claim's read from the API; below the kubelet's 45 s per call, so a slow API server shows as
# that claim's error rather than the whole call's deadline.
CLAIM_READ_TIMEOUT_S = 30.0

Observe = Callable[[], Union[Observation, Awaitable[Observation]]]


class Service:
    """Answers both DRAPlugin versions (api.dra_handlers(service)).

    observe() gives the device observation to prepare against: a plain function returning the
    current one, or a coroutine function (say, one running a fresh check). cdi_id(hypervisor)
    names the CDI device the runtime injects; the default is the device plugin's own
    (node.cdi.device_name: hyperlight.dev/hypervisor=kvm)."""

    def __init__(self, driver: str, claims: ClaimReader, observe: Observe, prepared: Prepared,
                 cdi_id: Callable[[str], str] = cdi.device_name,
                 max_concurrent: int = MAX_CONCURRENT_CLAIMS,
                 claim_read_timeout: float = CLAIM_READ_TIMEOUT_S) -> None:
        self.driver = driver
        self.claims = claims
        self._observe = observe
        self.prepared = prepared
        self._cdi_id = cdi_id
        self._max_concurrent = max_concurrent
        self._claim_read_timeout = claim_read_timeout
        self._slots: Optional[asyncio.Semaphore] = None  # made in the loop (Python 3.9)
        # One claim is prepared or unprepared by one call at a time; entries go when idle.
        self._busy: dict[str, tuple[asyncio.Lock, int]] = {}  # uid → (its lock, calls using it)

    # --- the gRPC methods (api.dra_handlers passes the version's message module) ----------------

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext[Any, Any],
                                   messages: ModuleType) -> Any:
        answers = await asyncio.gather(*(self._one(c.uid, self._prepare(c.namespace, c.name, c.uid))
                                         for c in request.claims))
        response = messages.NodePrepareResourcesResponse()
        for claim, (error, devices) in zip(request.claims, answers):
            entry = response.claims[claim.uid]
            if error:
                entry.error = error
                continue
            for device in devices:
                out = entry.devices.add(request_names=[device.request], pool_name=device.pool,
                                        device_name=device.device, cdi_device_ids=list(device.cdi_device_ids))
                if device.share_id is not None and "share_id" in out.DESCRIPTOR.fields_by_name:
                    out.share_id = device.share_id  # v1 only: v1beta1 has no such field
        return response

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext[Any, Any],
                                     messages: ModuleType) -> Any:
        answers = await asyncio.gather(*(self._one(c.uid, self._unprepare(c.namespace, c.name, c.uid))
                                         for c in request.claims))
        response = messages.NodeUnprepareResourcesResponse()
        for claim, (error, _) in zip(request.claims, answers):
            response.claims[claim.uid].error = error
        return response

    # --- one claim ------------------------------------------------------------------------------

    async def _one(self, uid: str, work: Awaitable[tuple[str, tuple[PreparedDevice, ...]]]
                   ) -> tuple[str, tuple[PreparedDevice, ...]]:
        """Run one claim's work under the concurrency bound and the claim's own lock."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_concurrent)
        lock, users = self._busy.get(uid) or (asyncio.Lock(), 0)
        self._busy[uid] = (lock, users + 1)
        try:
            async with self._slots, lock:
                return await work
        finally:
            lock, users = self._busy[uid]
            if users == 1:
                del self._busy[uid]
            else:
                self._busy[uid] = (lock, users - 1)

    async def _prepare(self, namespace: str, name: str, uid: str) -> tuple[str, tuple[PreparedDevice, ...]]:
        """(error, devices) for one claim: error is "" on success."""
        known = self.prepared.get(uid)
        if known is not None:
            return "", known.devices
        try:
            devices = await self._devices(namespace, name, uid)
            await self.prepared.record(uid, PreparedClaim(namespace=namespace, name=name, devices=devices))
        except (ClaimError, PreparedError) as exc:
            # Not recorded, not answered: answering without a record would leave a later
            # Unprepare, or the other instance, unaware of the claim. The kubelet asks again.
            return self._refuse(namespace, name, str(exc)), ()
        log.info("prepared claim %s/%s (%s): %s", namespace, name, uid,
                 ", ".join(f"{d.pool}/{d.device}" for d in devices))
        return "", devices

    async def _devices(self, namespace: str, name: str, uid: str) -> tuple[PreparedDevice, ...]:
        """Our devices of the claim's allocation, with the CDI id of the healthy device; ClaimError."""
        try:
            allocated = await waits.within(self.claims.allocation(namespace, name, uid), self._claim_read_timeout)
        except asyncio.TimeoutError:
            raise ClaimError(f"claim {namespace}/{name}: reading its allocation took longer than "
                             f"{self._claim_read_timeout:g} s") from None
        ours = [d for d in allocated if d.driver == self.driver]
        if not ours:
            raise ClaimError(f"claim {namespace}/{name} has no device of driver {self.driver}")
        observation = await self._observation()
        if not observation.healthy or observation.hypervisor is None:
            where = (hypervisors.BY_NAME[observation.hypervisor].container_path
                     if observation.hypervisor in hypervisors.BY_NAME else "no hypervisor device")
            names = ", ".join(sorted({d.device for d in ours}))
            raise ClaimError(f"device {names} ({where}) failed its check: "
                             f"{observation.reason or 'no device check has passed'}")
        cdi_ids = (self._cdi_id(observation.hypervisor),)
        return tuple(PreparedDevice(request=d.request, pool=d.pool, device=d.device, cdi_device_ids=cdi_ids,
                                    share_id=d.share_id) for d in ours)

    async def _unprepare(self, namespace: str, name: str, uid: str) -> tuple[str, tuple[PreparedDevice, ...]]:
        try:
            forgotten = await self.prepared.forget(uid)
        except PreparedError as exc:
            return self._refuse(namespace, name, str(exc)), ()
        if forgotten:
            log.info("unprepared claim %s/%s (%s)", namespace, name, uid)
        return "", ()

    async def _observation(self) -> Observation:
        observation = self._observe()
        if inspect.isawaitable(observation):
            return await observation
        return observation

    @staticmethod
    def _refuse(namespace: str, name: str, error: str) -> str:
        log.warning("claim %s/%s: %s", namespace, name, error)
        return error
