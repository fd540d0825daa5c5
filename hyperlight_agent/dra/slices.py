"""This node's ResourceSlice: the hypervisor as one device every claim may share, or N identical
devices where the API server cannot say that; kept equal to what the device check says, whoever
deletes or edits it.

One slice, one pool named after the node. Where the API server keeps a device's
`allowMultipleAllocations` (Kubernetes 1.36+, DRAConsumableCapacity), one device `kvm` (or `mshv`)
that any number of claims are allocated at once: what /dev/kvm is. Elsewhere (1.34, 1.35, or
sharing switched off), `identical_devices` devices `kvm-0` … `kvm-{N-1}`, each allocated to one claim. All
are handed out as the same CDI device by the node service. Which the server keeps is found out by
a dry run of the write (what the server would store, nothing stored): a server that drops the field
gets the N devices from then on, without ever showing the one device the scheduler would give to
one claim at a time (docs/decisions/dra-one-shared-device.md).

A device that is absent or failed its check stays in the slice with our taint (dra/taints.py:
key hyperlight.dev/unusable, the cause as its value, NoSchedule, or NoExecute once the opt-in
debounce has passed), so the scheduler keeps new claims off it and says why, and pods already
using it see its health (dra/health.py). A slice with a taint holds at most 64 devices, so N
identical devices beyond that leave it while tainted. Where the API server drops device taints
(DRADeviceTaints: beta and on from 1.36), found out as for sharing, by a dry run of a tainted
write, the device leaves the slice instead: the slice stays, with no devices (spec.devices is
optional, `omitempty`, and "Only one of Devices and SharedCounters can be set" allows neither), and
pool.generation moves on. Why keep an empty slice rather than delete it: the scheduler sees the
same "no devices here" either way, but an empty slice says "this node's agent runs and has nothing
to offer" where a missing one says nothing; and every change stays one update of one object, with
the generation never going back.

How the server's state is known: list once, then watch from the list's resourceVersion, keeping
the node's slices of our driver as the events say (dra/slice_informer.py, as client-go's informer).
A watch asks the server to end it after WATCH_TIMEOUT_S and is opened again from the last version
it saw, without a list; 410 Gone (too old a version) and a conflict on write mean "list again". A dead connection
is found out by the client (client.py) by the server's minutely bookmarks (their silence, or the
first one's absence) and TCP keepalive, within two minutes, long before a watch's end. Anything
that fails, or a watch that ends early, waits the jittered backoff; it starts over only after a
watch ran to its end.

What is ours in the slice is compared, nothing else (`owned`): the driver, node and pool, and each
device's name and our attributes. Fields and attributes others add (a mutating webhook, a newer
API's defaults) are left alone; and if the server changes what we wrote on the way in, that answer
is accepted once (said once) rather than fought.

One writer per node: during a rolling update two instances of the driver run, maybe with other
settings. Before writing, the publisher asks `newer()` for another live instance of our driver on
this node that keeps the slice instead (the agent's side gives the newest serving one, so a
successor whose device check fails never empties a ready predecessor's slice); while there is
one, it yields and leaves the slice to it (docs/decisions/whose-spec-and-slice-stand.md).

The kubelet deletes all of its node's slices when it starts; anyone with RBAC may delete or edit
ours. The slice is not deleted on close: a successor instance (rolling update) publishes the same
slice, and the kubelet wipes it 30 s after the last instance unregisters.

Why: docs/decisions/dra-one-shared-device.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from hyperlight_agent import backoff, contracts
from hyperlight_agent.backoff import Backoff
from hyperlight_agent.dra.client import SLICES, KubeApi
from hyperlight_agent.dra.slice_informer import SliceInformer
from hyperlight_agent.dra.slice_report import SliceReport
from hyperlight_agent.dra.slice_spec import (
    DeviceInfo,
    Learned,
    choose,
    desired_spec,
    dropped_text,
    learn,
    object_name,
    owned,
    pool_generation,
    right,
    unsure,
)
from hyperlight_agent.dra.slice_writes import SliceWrites
from hyperlight_agent.dra.taints import Taint
from hyperlight_agent.dra.types import Json

log = logging.getLogger(__name__)

# Failures back off 0.5, 1, 2 … 30 s, jittered (a restarted API server meets every node at once);
# the first retry of a streak is immediate.
BACKOFF_INITIAL_S = 0.5
BACKOFF_CAP_S = 30.0
# Each watch asks the server to end it after a time in this range, client-go's (spread, so that a
# fleet's watches do not end together): an idle node renews its watch about 8 times an hour. Its
# liveness is not the timeout's: a connection that stopped forwarding (no FIN, no RST, a proxy that
# still acknowledges) is found by the server's bookmarks, 75 s after the last one or, before the
# first, 75 s after the server answered (client.py); a peer gone from the network by TCP keepalive
# too (docs/decisions/dra-an-informer-and-one-backoff.md).
WATCH_TIMEOUT_S = (300.0, 600.0)


@dataclass(frozen=True)
class Pacing:
    """How soon failures are retried and how long each watch is asked to last (tests shorten them),
    and the clock of first_published_at."""

    backoff_initial_s: float = BACKOFF_INITIAL_S
    backoff_cap_s: float = BACKOFF_CAP_S
    watch_timeout_s: tuple[float, float] = WATCH_TIMEOUT_S
    clock: Callable[[], float] = time.monotonic

    def backoff(self) -> Backoff:
        """The retries' backoff; the first retry of a streak is immediate."""
        return Backoff(self.backoff_initial_s, self.backoff_cap_s, rand=backoff.JITTER, immediate_first=True)


@dataclass
class Standing:
    """Where the slice stands, for readiness and status: `published` (the server's slice was equal
    to the desired one at the last look, and the desired one has not changed since; or a newer
    instance, `kept_by`, keeps it), its name, and clock() of the first time it was published."""

    published: bool = False
    kept_by: str = ""
    slice_name: str = ""
    first_published_at: Optional[float] = None


def devices_of_one_slice(identical_devices: int) -> int:
    """The dra_devices setting, if one ResourceSlice can hold that many devices."""
    if not 1 <= identical_devices <= contracts.RESOURCE_SLICE_MAX_DEVICES:
        raise ValueError(
            f"DRA device count {identical_devices}: must be 1 to {contracts.RESOURCE_SLICE_MAX_DEVICES} "
            f"(the devices of one ResourceSlice)"
        )
    return identical_devices


class SlicePublisher:
    """Keeps this node's ResourceSlice equal to the desired one while `run()` runs.

    State for readiness and status: `published` (the server's slice was equal to the desired one
    at the last look, and the desired one has not changed since; or a newer instance keeps it:
    `kept_by`), `last_error` ("" once a read or write succeeds again) and `first_published_at`
    (clock() of the first such success).
    """

    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        driver: str = contracts.DRA_DRIVER,
        identical_devices: int = contracts.RESOURCE_SLICE_MAX_DEVICES,
        *,
        pacing: Pacing = Pacing(),
        newer: Optional[Callable[[], Awaitable[Optional[str]]]] = None,
        on_change: Optional[Callable[[], None]] = None,
        drivers_before: tuple[str, ...] = contracts.DRA_DRIVERS_BEFORE,
        shared: bool = True,
        on_event: Callable[..., None] = lambda kind, *labels: None,
    ) -> None:
        self.node_name, self.driver = node_name, driver
        self.identical_devices = devices_of_one_slice(identical_devices)  # offered now: published_devices
        self._clock, self._backoff, self._newer = pacing.clock, pacing.backoff(), newer
        self._sweep_first = drivers_before  # our driver's earlier names, swept once (_compare_and_write)
        self._learned = Learned(shared=shared)  # sharing and taints, until the server shows it drops them
        self._changed = on_change or (lambda: None)  # the standing or last_error may have changed
        self._event = on_event  # metrics: ("write", verb), ("api_error", verb, code), ("watch", why)
        self._said: Optional[tuple[Optional[DeviceInfo], Optional[Taint]]] = None  # see set_device
        self._dirty = asyncio.Event()
        self._informer = SliceInformer(api, node_name, driver, pacing.watch_timeout_s, self._dirty)
        self._accepted: Optional[tuple[Json, Json]] = None  # (desired, what the server made of it)
        self._generation = 0  # the highest pool.generation seen for our pool
        self._report = SliceReport(pacing.clock, self._changed)
        self._writes = SliceWrites(api, node_name, driver, self._informer, self._report, on_event)
        self.standing = Standing()
        self.looks = 0  # comparisons of the server's slices with the desired one done (tests read this)

    def set_device(self, device: Optional[DeviceInfo], taint: Optional[Taint] = None) -> None:
        """The device the slice describes (None: no device known, no devices), and its taint while
        it is unusable (where the server keeps no taints, its devices leave the slice).

        Until a check has said, nothing is written: a successor's empty slice would take the node's
        devices from the scheduler while its predecessor, whose slice stands, still serves them."""
        if self._said == (device, taint):
            return
        self._said = (device, taint)
        self.standing.published = False
        self._changed()
        self._dirty.set()

    def wake(self) -> None:
        """Look again (another instance came or went)."""
        self._dirty.set()

    @property
    def shared(self) -> bool:
        """Whether the slice is one shared device (where the API server keeps the field)."""
        return self._learned.shared

    @property
    def taints(self) -> bool:
        """Whether an unusable device is tainted (where the API server keeps taints)."""
        return self._learned.taints

    def desired(self) -> Json:
        device, taint = self._said or (None, None)
        return desired_spec(
            self.node_name, self.driver, self.identical_devices, device, self.shared, taint, self.taints
        )

    @property
    def last_error(self) -> str:
        """The last failure's line, "" once a read or write succeeded again."""
        return self._report.last_error

    @property
    def requests(self) -> int:
        """Requests sent to the API server (benchmarks read this)."""
        return self._informer.requests + self._writes.requests

    @property
    def published_devices(self) -> int:
        """The devices the slice offers: 1 while it is one shared device, else identical_devices
        (fewer while tainted, none without a device)."""
        return len(self.desired()["devices"])

    async def run(self) -> None:
        """Publish, then keep the slice right until cancelled. Never raises but CancelledError."""
        await self._informer.run(self._reconcile, self._backoff, self._report, self._event)

    async def _reconcile(self) -> None:
        try:
            await self._compare_and_write()
        finally:
            self.looks += 1

    async def _compare_and_write(self) -> None:
        if self._said is None:
            return  # set_device wakes us
        desired = self.desired()
        cache = self._informer.cache
        keep, extras = choose(cache.values(), desired, self._accepted)
        self._generation = max([self._generation, *(pool_generation(o) for o in cache.values())])
        if keep is not None and not extras and right(keep, desired, self._accepted):
            self._settled(keep, desired)
            return
        if self._newer is not None:
            newer = await self._newer()
            if newer:
                self._yield_to(newer, keep)
                return
        if self.standing.kept_by:
            log.info(
                "ResourceSlice for node %s: instance %s is gone; keeping the slice again",
                self.node_name,
                self.standing.kept_by,
            )
            self.standing.kept_by = ""
        # Our driver's earlier names: this node's slices under them are deleted once, before our
        # first write (nothing allocates from them any more; the kubelet would keep them 30 s).
        if self._sweep_first:
            await self._writes.sweep(self._sweep_first)
            self._sweep_first = ()
        # A field the server may drop is found out by a dry run first: a stored write of it would
        # show the scheduler, until our next write, one device that holds one claim (or an
        # unusable device without its taint).
        if unsure(self._learned, desired) and self._dropped(
            desired, await self._write(desired, keep, [], dry_run=True)
        ):
            return
        result = await self._write(desired, keep, extras)
        self._writes.written = desired
        self._informer.put(result)
        if self._dropped(desired, result):
            return
        if owned(result.get("spec")) != desired:
            self._accepted = (desired, owned(result.get("spec")))
            self._report.notice(
                "mutated",
                f"ResourceSlice {object_name(result)}: the API server changed what we wrote "
                "(a mutating webhook or policy?); keeping its version rather than writing it again",
            )
        self._settled(result, desired)

    def _dropped(self, desired: Json, answer: Json) -> bool:
        """Whether the server's answer to a write of desired (stored or dry run) dropped a field of a
        feature it lacks: then desired changes (said once, dirty again) and this write is moot."""
        self._learned, dropped = learn(self._learned, desired, answer.get("spec"))
        if not dropped:
            return False
        log.info("%s", dropped_text(dropped, object_name(answer), self.identical_devices))
        self._changed()
        self._dirty.set()
        return True

    async def _write(self, desired: Json, keep: Optional[Json], extras: list[Json], dry_run: bool = False) -> Json:
        return await self._writes.write(desired, keep, extras, self._generation + 1, self.standing.slice_name, dry_run)

    def _settled(self, obj: Json, desired: Json) -> None:
        self._generation = max(self._generation, pool_generation(obj))
        st = self.standing
        st.slice_name, st.kept_by, st.published = object_name(obj), "", desired == self.desired()
        if st.published and st.first_published_at is None:
            st.first_published_at = self._clock()
            log.info("ResourceSlice %s published: %d devices", st.slice_name, len(desired["devices"]))
        self._report.succeeded(st.slice_name)

    def _yield_to(self, newer: str, current: Optional[Json]) -> None:
        st = self.standing
        if st.kept_by != newer:
            log.info("ResourceSlice for node %s: instance %s keeps it; not writing it", self.node_name, newer)
        st.kept_by = newer
        self._writes.written = None  # what the newer one writes is no edit to complain of when we take over
        st.published, st.slice_name = current is not None, object_name(current or {})
        self._report.succeeded(st.slice_name)


__all__ = ["SLICES", "Pacing", "SlicePublisher", "Standing"]
