"""The DRAPlugin service (v1 and v1beta1 alike): the kubelet's NodePrepareResources and
NodeUnprepareResources for our driver.

    Service(driver, claim_reader, observe, prepared)
    NodePrepareResources:
      claims recorded in `prepared` in this boot → the recorded answer at once (the kubelet asks
                               again after its restart, and a rolling update's other instance may
                               have prepared it);
      claims recorded in an earlier boot → a fresh device check (which writes the CDI spec the
                               reboot took, /run being a tmpfs), then the recorded devices with the
                               device's CDI id, recorded anew; no API read (the allocation of a
                               claim uid never changes);
      the others, concurrently (at most MAX_CONCURRENT_READS API reads at once, over all requests):
        claim_reader.allocation(ns, name, uid) → the results of our driver
          none of ours          → "claim ns/name has no device of driver hypervisor.hyperlight.dev"
          device unhealthy      → "device kvm-3 (/dev/kvm) failed its check: <reason>"
          else                  → one Device per result with our CDI id
      then all of those recorded in one change of the record (one wait for its lock), answered.
    NodeUnprepareResources: forget the recorded claims in one change; an unknown claim is a
      success at once (the kubelet's reconcile retries every 60 s and may ask for claims we never
      saw).

A claim is worked on by one call at a time (a per-claim lock); work that needs no API read never
waits for the reads of other claims.

Every claim of a request gets an entry: a claim's failure is its `error`, never the RPC's (a gRPC
error would fail every claim of the batch). The only RPC-level error is a malformed request.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from types import ModuleType
from typing import Any, Awaitable, Callable, Optional, Union

import grpc

from hyperlight_agent import transport, waits
from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.observation import Observation
from hyperlight_agent.dra.claim_locks import ClaimLocks
from hyperlight_agent.dra.prepared import Prepared, PreparedError
from hyperlight_agent.dra.prepared_format import PreparedClaim, PreparedDevice
from hyperlight_agent.dra.types import ClaimError, ClaimReader
from hyperlight_agent.files import cdi

log = logging.getLogger(__name__)

# How long an answer sent is given to be read before a stop deregisters us: grpc says when it has
# sent the answer, not when the kubelet has read it, and a deregistration closes the kubelet's
# connection, cancelling an answer not yet read. The stand-in deregisters the moment our socket
# goes (the real kubelet's 1 s reconciler loop: 0 to 1 s later); beside two CPU hogs its answered
# call failed so in 7 of 30 stops counted to the handler's return, 4 of 30 counted to grpc's
# sending, 0 of 40 with this margin.
ANSWER_DELIVERY_S = 0.5

# Claims of all requests being read from the API at once. The kubelet batches one pod's claims per
# driver, so this bounds a burst of pod starts, not one pod.
MAX_CONCURRENT_READS = 16
# One claim's read from the API; below the kubelet's 45 s per call, so a slow API server shows as
# that claim's error rather than the whole call's deadline.
CLAIM_READ_TIMEOUT_S = 30.0

Observe = Callable[[], Union[Observation, Awaitable[Observation]]]
Answers = dict[str, tuple[str, tuple[PreparedDevice, ...]]]  # claim uid → (error or "", devices)


class Service:
    """Answers both DRAPlugin versions (api.dra_handlers(service)).

    observe() gives the device observation to prepare against: a plain function returning the
    current one, or a coroutine function (say, one running a fresh check). cdi_id(hypervisor)
    names the CDI device the runtime injects; the default is the device plugin's own
    (files.cdi.device_name: hyperlight.dev/hypervisor=kvm)."""

    def __init__(
        self,
        driver: str,
        claims: ClaimReader,
        observe: Observe,
        prepared: Prepared,
        cdi_id: Callable[[str], str] = cdi.device_name,
        max_concurrent: int = MAX_CONCURRENT_READS,
        claim_read_timeout: float = CLAIM_READ_TIMEOUT_S,
        on_call: Callable[[str, float, int, int], None] = lambda operation, seconds, ok, failed: None,
    ) -> None:
        self.driver = driver
        self.claims = claims
        self._observe = observe
        self.prepared = prepared
        self._cdi_id = cdi_id
        self._max_concurrent = max_concurrent
        self._claim_read_timeout = claim_read_timeout
        self._slots: Optional[asyncio.Semaphore] = None  # made in the loop (Python 3.9)
        self._locks = ClaimLocks()
        self._on_call = on_call  # (operation, seconds, claims answered, claims failed): the metrics
        self.calls = transport.Calls()  # the kubelet's: a handover and a stop wait for them

    # --- the gRPC methods (api.dra_handlers passes the version's message module) ----------------

    async def idle(self) -> None:
        """Return once no call is in flight and the last answer had ANSWER_DELIVERY_S to reach the
        kubelet (a stop deregisters only then: the kubelet cancels the calls it has in flight with
        an instance as it deregisters it, an answer it has not yet read among them)."""
        while True:
            await self.calls.none_in_flight()
            left = self.calls.last_ended + ANSWER_DELIVERY_S - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(left)

    async def NodePrepareResources(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any], messages: ModuleType
    ) -> Any:
        claims = list(request.claims)
        started = time.monotonic()
        async with self.calls.counted(context), self._locks.held(c.uid for c in claims):
            answers = await self._prepare(claims)
        failed = sum(1 for error, _ in answers.values() if error)
        self._on_call("prepare", time.monotonic() - started, len(answers) - failed, failed)
        return _prepared_response(messages, claims, answers)

    async def NodeUnprepareResources(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any], messages: ModuleType
    ) -> Any:
        claims = list(request.claims)
        started = time.monotonic()
        async with self.calls.counted(context), self._locks.held(c.uid for c in claims):
            errors = await self._unprepare(claims)
        failed = sum(1 for uid in {c.uid for c in claims} if errors.get(uid))
        self._on_call("unprepare", time.monotonic() - started, len({c.uid for c in claims}) - failed, failed)
        response = messages.NodeUnprepareResourcesResponse()
        for claim in claims:
            response.claims[claim.uid].error = errors.get(claim.uid, "")
        return response

    # --- the claims of one request --------------------------------------------------------------

    async def _prepare(self, claims: list[Any]) -> Answers:
        """(error, devices) per claim uid: error is "" on success."""
        recorded = self.prepared.claims()
        current = {c.uid for c in claims if c.uid in recorded and self.prepared.this_boot(c.uid)}
        answers = {uid: ("", recorded[uid].devices) for uid in current}
        earlier = {c.uid: c for c in claims if c.uid in recorded and c.uid not in current}
        new = {c.uid: c for c in claims if c.uid not in recorded}
        found = await asyncio.gather(
            *(self._read(c.namespace, c.name, c.uid) for c in new.values()),
            *(self._again(c.namespace, c.name, recorded[c.uid].devices) for c in earlier.values()),
        )
        ready: dict[str, PreparedClaim] = {}
        for claim, result in zip([*new.values(), *earlier.values()], found):
            if isinstance(result, str):
                answers[claim.uid] = (_refused(claim.namespace, claim.name, result), ())
            else:
                ready[claim.uid] = PreparedClaim(namespace=claim.namespace, name=claim.name, devices=result)
        if ready:
            try:
                await self.prepared.change(ready, ())
            except PreparedError as exc:
                # Not recorded, not answered: answering without a record would leave a later
                # Unprepare, or the other instance, unaware of the claim. The kubelet asks again.
                answers.update({uid: (str(exc), ()) for uid in ready})
                _all_refused(list(ready.values()), str(exc))
                return answers
        for uid, claim in ready.items():
            answers[uid] = ("", claim.devices)
            log.info(
                "prepared claim %s/%s (%s): %s",
                claim.namespace,
                claim.name,
                uid,
                ", ".join(f"{d.pool}/{d.device}" for d in claim.devices),
            )
        return answers

    async def _read(self, namespace: str, name: str, uid: str) -> Union[str, tuple[PreparedDevice, ...]]:
        """One claim's devices, from the API (within the bound on concurrent reads), or the error."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_concurrent)
        try:
            async with self._slots:
                return await self._devices(namespace, name, uid)
        except ClaimError as exc:
            return str(exc)

    async def _again(
        self, namespace: str, name: str, devices: tuple[PreparedDevice, ...]
    ) -> Union[str, tuple[PreparedDevice, ...]]:
        """A claim recorded in an earlier boot: its devices after a fresh check, or the error."""
        try:
            hypervisor = await self._usable(sorted({d.device for d in devices}))
        except ClaimError as exc:
            return str(exc)
        cdi_ids = (self._cdi_id(hypervisor),)
        log.info("claim %s/%s was prepared before this boot: checked the device again", namespace, name)
        return tuple(d._replace(cdi_device_ids=cdi_ids) for d in devices)

    async def _devices(self, namespace: str, name: str, uid: str) -> tuple[PreparedDevice, ...]:
        """Our devices of the claim's allocation, with the CDI id of the healthy device; ClaimError."""
        try:
            allocated = await waits.within(self.claims.allocation(namespace, name, uid), self._claim_read_timeout)
        except asyncio.TimeoutError:
            raise ClaimError(
                f"claim {namespace}/{name}: reading its allocation took longer than {self._claim_read_timeout:g} s"
            ) from None
        ours = [d for d in allocated if d.driver == self.driver]
        if not ours:
            raise ClaimError(f"claim {namespace}/{name} has no device of driver {self.driver}")
        cdi_ids = (self._cdi_id(await self._usable(sorted({d.device for d in ours}))),)
        return tuple(
            PreparedDevice(request=d.request, pool=d.pool, device=d.device, cdi_device_ids=cdi_ids, share_id=d.share_id)
            for d in ours
        )

    async def _usable(self, devices: list[str]) -> str:
        """The hypervisor, after a fresh check that passed; ClaimError naming the devices if not."""
        observation = await self._observation()
        if not observation.healthy or observation.hypervisor is None:
            where = (
                hypervisors.BY_NAME[observation.hypervisor].container_path
                if observation.hypervisor in hypervisors.BY_NAME
                else "no hypervisor device"
            )
            raise ClaimError(
                f"device {', '.join(devices)} ({where}) failed its check: "
                f"{observation.reason or 'no device check has passed'}"
            )
        return observation.hypervisor

    async def _unprepare(self, claims: list[Any]) -> dict[str, str]:
        """The error per claim uid that could not be forgotten (none: all were, or were unknown)."""
        recorded = self.prepared.claims()
        known = tuple(sorted({c.uid for c in claims if c.uid in recorded}))
        if not known:
            return {}
        try:
            forgotten = await self.prepared.change({}, known)
        except PreparedError as exc:
            _all_refused([c for c in claims if c.uid in known], str(exc))
            return {uid: str(exc) for uid in known}
        for claim in claims:
            if claim.uid in forgotten:
                log.info("unprepared claim %s/%s (%s)", claim.namespace, claim.name, claim.uid)
        return {}

    async def _observation(self) -> Observation:
        observation = self._observe()
        if inspect.isawaitable(observation):
            return await observation
        return observation


def _prepared_response(messages: ModuleType, claims: list[Any], answers: Answers) -> Any:
    """NodePrepareResourcesResponse of the version's `messages`: each claim's devices or error."""
    response = messages.NodePrepareResourcesResponse()
    for claim in claims:
        error, devices = answers[claim.uid]
        entry = response.claims[claim.uid]
        if error:
            entry.error = error
            continue
        for device in devices:
            out = entry.devices.add(
                request_names=[device.request],
                pool_name=device.pool,
                device_name=device.device,
                cdi_device_ids=list(device.cdi_device_ids),
            )
            if device.share_id is not None and "share_id" in out.DESCRIPTOR.fields_by_name:
                out.share_id = device.share_id  # v1 only: v1beta1 has no such field
    return response


def _refused(namespace: str, name: str, error: str) -> str:
    log.warning("claim %s/%s: %s", namespace, name, error)
    return error


def _all_refused(claims: list[Any], error: str) -> None:
    """One line for the claims of a request refused for one reason (the record's)."""
    names = [f"{c.namespace}/{c.name}" for c in claims]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    log.warning("claim%s %s: %s", "s" if len(names) > 1 else "", shown, error)
