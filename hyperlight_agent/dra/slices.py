"""This node's ResourceSlice: N identical devices of one driver, kept equal to what the device
check says, whoever deletes or edits it.

One slice, one pool named after the node, `count` devices `kvm-0` … `kvm-{count-1}` (or `mshv-…`),
each allocated to one claim, all handed out as the same CDI device by the node service. Why N
identical devices and not one shareable device: ARCHITECTURE.md, "DRA: why N devices".

A device that is absent or failed its check leaves the slice: the slice stays, with no devices
(spec.devices is optional, `omitempty`, and "Only one of Devices and SharedCounters can be set"
allows neither), and pool.generation moves on. Why keep an empty slice rather than delete it: the
scheduler sees the same "no devices here" either way, but an empty slice says "this node's agent
runs and has nothing to offer" where a missing one says nothing; and every change stays one
update of one object, with the generation never going back.

The server's state is read, never assumed (events are hints, as elsewhere in the agent): a watch
event only wakes the publisher, which lists this node's slices of our driver afresh and writes
what differs. The kubelet deletes all of its node's slices when it starts; anyone with RBAC may
delete or edit ours. The slice is not deleted on close: a successor instance (rolling update)
publishes the same slice, and the kubelet wipes it 30 s after the last instance unregisters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable, NamedTuple, NoReturn, Optional

from hyperlight_agent import contracts
from hyperlight_agent.backoff import Backoff
from hyperlight_agent.dra.client import GROUP, SLICES, VERSION, ApiError, Json, KubeApi

log = logging.getLogger(__name__)

DRIVER = contracts.DRA_DRIVER
MAX_DEVICES_PER_SLICE = contracts.RESOURCE_SLICE_MAX_DEVICES
DEFAULT_DEVICE_COUNT = MAX_DEVICES_PER_SLICE
# Failures back off 0.5, 1, 2 … 30 s; a conflict (someone wrote first) is re-read at once, this often
# in a row before it counts as a failure too.
BACKOFF_INITIAL_S = 0.5
BACKOFF_CAP_S = 30.0
CONFLICTS_BEFORE_BACKOFF = 3


class DeviceInfo(NamedTuple):
    """The device the check found usable: ("kvm", 12, "/dev/kvm")."""

    hypervisor: str
    api_version: int
    path: str


def device_names(hypervisor: str, count: int) -> list[str]:
    """kvm-0 … kvm-{count-1}."""
    return [f"{hypervisor}-{i}" for i in range(count)]


def desired_spec(node_name: str, driver: str, count: int, device: Optional[DeviceInfo]) -> Json:
    """The slice's spec without pool.generation (which only says how often it changed)."""
    devices: list[Json] = []
    if device is not None:
        # Unprefixed attribute names are in the driver's domain: device.attributes["hyperlight.dev"].hypervisor.
        attributes = {"hypervisor": {"string": device.hypervisor}, "apiVersion": {"int": device.api_version},
                      "devicePath": {"string": device.path}}
        devices = [{"name": name, "attributes": attributes} for name in device_names(device.hypervisor, count)]
    return {"driver": driver, "nodeName": node_name, "pool": {"name": node_name, "resourceSliceCount": 1},
            "devices": devices}


def essence(spec: Json) -> Json:
    """A spec as compared with the desired one: no generation, and no devices the same as `[]`
    (the server omits an empty list)."""
    found = dict(spec)
    found["pool"] = {k: v for k, v in (spec.get("pool") or {}).items() if k != "generation"}
    found["devices"] = spec.get("devices") or []
    return found


def _generation(obj: Json) -> int:
    value = ((obj.get("spec") or {}).get("pool") or {}).get("generation")
    return value if isinstance(value, int) else 0


def _name(obj: Json) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


class _Relist(Exception):
    """The server changed under us (a conflict, an object gone, the watch ended): read it again."""


class SlicePublisher:
    """Keeps this node's ResourceSlice equal to the desired one while `run()` runs.

    State for readiness and status: `published` (the server's slice was equal to the desired one
    at the last read or write, and the desired one has not changed since), `last_error` ("" once a
    read or write succeeds again) and `first_published_at` (clock() of the first such success).
    """

    def __init__(self, api: KubeApi, node_name: str, driver: str = DRIVER, count: int = DEFAULT_DEVICE_COUNT, *,
                 clock: Callable[[], float] = time.monotonic, backoff_initial_s: float = BACKOFF_INITIAL_S,
                 backoff_cap_s: float = BACKOFF_CAP_S, on_change: Optional[Callable[[], None]] = None) -> None:
        if not 1 <= count <= MAX_DEVICES_PER_SLICE:
            raise ValueError(f"DRA device count {count}: must be 1 to {MAX_DEVICES_PER_SLICE} "
                             f"(the devices of one ResourceSlice)")
        self._api, self.node_name, self.driver, self.count = api, node_name, driver, count
        self._clock = clock
        self._backoff_initial_s, self._backoff_cap_s = backoff_initial_s, backoff_cap_s
        self._device: Optional[DeviceInfo] = None
        self._wake = asyncio.Event()
        self._written: Optional[Json] = None  # the spec essence we last saw on the server as ours
        self._generation = 0  # the highest pool.generation seen for our pool
        self._logged: set[str] = set()  # problems said once since the last success
        self._conflicts = 0  # conflicts in a row
        self._succeeded_since_failure = False
        self.slice_name = ""
        self.published = False
        self.last_error = ""
        self.first_published_at: Optional[float] = None
        self._on_change = on_change  # told when published or last_error may have changed

    def set_device(self, device: Optional[DeviceInfo]) -> None:
        """The device the last check found usable, or None: absent or unusable (its devices leave)."""
        if device == self._device:
            return
        self._device = device
        self.published = False
        self._changed()
        self._wake.set()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def desired(self) -> Json:
        return desired_spec(self.node_name, self.driver, self.count, self._device)

    async def run(self) -> None:
        """Publish, then keep the slice right until cancelled. Never raises but CancelledError."""
        backoff = Backoff(self._backoff_initial_s, self._backoff_cap_s)
        while True:
            try:
                await self._session()
            except _Relist as exc:
                self._conflicts += 1
                log.debug("ResourceSlice: %s; reading again", exc)
                if self._conflicts < CONFLICTS_BEFORE_BACKOFF:
                    continue
                line = f"ResourceSlice for node {self.node_name}: {exc}, {self._conflicts} times in a row"
                problem = "conflicts"
            except ApiError as exc:
                line, problem = str(exc), exc.problem
            if self._succeeded_since_failure:
                backoff.reset()  # the session got as far as a success: start over
            self._succeeded_since_failure = False
            self._problem(problem, line)
            await asyncio.sleep(backoff.next())
            self._conflicts = 0

    def _problem(self, problem: str, line: str) -> None:
        """Say each distinct problem once until the next success, not once per retry."""
        self.last_error = line
        self._changed()
        if problem not in self._logged:
            self._logged.add(problem)
            log.warning("%s; retrying with backoff", line)

    def _succeeded(self) -> None:
        if self._logged:
            log.info("ResourceSlice %s published again", self.slice_name)
        self._logged.clear()
        self.last_error = ""
        self._changed()
        self._conflicts = 0
        self._succeeded_since_failure = True

    async def _session(self) -> NoReturn:
        """List, reconcile, then reconcile again on every watch event or desired change."""
        self._wake.clear()
        items, version = await self._api.list_slices(self.node_name, self.driver)
        await self._reconcile(items)
        watch_ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        watcher = asyncio.ensure_future(self._watch(version, watch_ended))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if watch_ended.done():
                    raise watch_ended.result()
                items, _ = await self._api.list_slices(self.node_name, self.driver)
                await self._reconcile(items)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _watch(self, version: str, ended: asyncio.Future[BaseException]) -> None:
        """Wake the session on every change; an ended or failed watch ends the session."""
        error: BaseException = _Relist("the watch ended")
        try:
            async for kind, _ in self._api.watch_slices(self.node_name, self.driver, version):
                if kind != "BOOKMARK":
                    self._wake.set()
        except ApiError as exc:
            # 410 Gone: our version is too old to watch from; anything else is a real problem.
            error = _Relist("the watch expired") if exc.code == 410 else exc
        ended.set_result(error)
        self._wake.set()

    async def _reconcile(self, items: list[Json]) -> None:
        desired = self.desired()
        # Oldest first: of several slices of ours the oldest stays, unless another is already right.
        ours = sorted(items, key=lambda o: (str(o.get("metadata", {}).get("creationTimestamp", "")), _name(o)))
        self._generation = max([self._generation, *(_generation(o) for o in ours)])
        keep = next((o for o in ours if essence(o.get("spec") or {}) == desired), ours[0] if ours else None)
        try:
            for extra in ours:
                if extra is not keep:
                    log.warning("ResourceSlice %s duplicates %s for node %s; deleting it", _name(extra),
                                _name(keep or {}), self.node_name)
                    await self._delete(_name(extra))
            if keep is None:
                if self._written is not None:
                    log.info("ResourceSlice %s was deleted (a kubelet start wipes them); re-creating", self.slice_name)
                result = await self._api.create_slice(self._object(desired, {"generateName": self._prefix()}))
            elif essence(keep.get("spec") or {}) != desired:
                if self._written is not None and self._written == desired and _name(keep) == self.slice_name:
                    log.warning("ResourceSlice %s edited by someone else; restoring", _name(keep))
                result = await self._api.replace_slice(self._object(desired, keep.get("metadata") or {}))
            else:
                result = keep
        except ApiError as exc:
            if exc.code == 409:
                raise _Relist(f"conflict: {exc.message}") from exc
            if exc.code == 404 and exc.verb == "update":
                raise _Relist("the slice went away while we updated it") from exc
            raise
        self._generation = max(self._generation, _generation(result))
        self.slice_name = _name(result)
        self._written = desired
        self.published = essence(result.get("spec") or {}) == self.desired()
        self._changed()
        if self.published and self.first_published_at is None:
            self.first_published_at = self._clock()
            log.info("ResourceSlice %s published: %d devices", self.slice_name, len(desired["devices"]))
        self._succeeded()

    async def _delete(self, name: str) -> None:
        try:
            await self._api.delete_slice(name)
        except ApiError as exc:
            if exc.code != 404:  # already gone is what we wanted
                raise

    def _prefix(self) -> str:
        """generateName: the server appends five random characters ("node1-hyperlight.dev-x7k2p")."""
        return f"{self.node_name}-{self.driver}-"

    def _object(self, desired: Json, metadata: Json) -> Json:
        spec: Any = dict(desired)
        spec["pool"] = dict(desired["pool"], generation=self._generation + 1)
        if not spec["devices"]:
            del spec["devices"]  # as the server would store it
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceSlice", "metadata": dict(metadata), "spec": spec}


__all__ = ["DRIVER", "MAX_DEVICES_PER_SLICE", "SLICES", "DeviceInfo", "SlicePublisher", "desired_spec"]
