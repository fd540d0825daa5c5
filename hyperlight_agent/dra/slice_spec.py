"""What this node's ResourceSlice should say, and what the API server's answers teach about it:
the desired spec, the part of a stored slice that is ours, which of our stored slices to keep, and
which optional fields the server keeps (one shared device, device taints). Pure decisions for the
publisher (dra/slices.py), which does the reading, writing and saying: no I/O, no clock, no log.

Why: docs/decisions/dra-one-shared-device.md,
docs/decisions/dra-compare-only-what-we-own.md.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional

from hyperlight_agent import contracts
from hyperlight_agent.dra.taints import Taint
from hyperlight_agent.dra.types import Json

# The attributes we publish per device; others' attributes are not compared.
ATTRIBUTES = ("hypervisor", "apiVersion", "devicePath")
# The device field that lets the scheduler allocate one device to many claims (KEP-5075).
SHARED_FIELD = "allowMultipleAllocations"
# The device field holding its taints (KEP-5055); of those, ours (contracts.TAINT_UNUSABLE) are
# compared by key, value and effect (the server adds timeAdded).
TAINTS_FIELD = "taints"
TAINT_FIELDS = ("key", "value", "effect")


class DeviceInfo(NamedTuple):
    """The device the check found usable: ("kvm", 12, "/dev/kvm")."""

    hypervisor: str
    api_version: int
    path: str


def device_names(hypervisor: str, count: int) -> list[str]:
    """kvm-0 … kvm-{count-1}."""
    return [f"{hypervisor}-{i}" for i in range(count)]


def desired_spec(
    node_name: str,
    driver: str,
    identical_devices: int,
    device: Optional[DeviceInfo],
    shared: bool = False,
    taint: Optional[Taint] = None,
    taints: bool = True,
) -> Json:
    """The slice's spec without pool.generation (which only says how often it changed): one shared
    device, or `identical_devices` identical ones; each with `taint` when the device is unusable, or none at
    all where the server keeps no taints (`taints` false)."""
    devices: list[Json] = []
    if device is not None and (taint is None or taints):
        # Unprefixed attribute names are in the driver's domain:
        # device.attributes["hypervisor.hyperlight.dev"].hypervisor.
        attributes = {
            "hypervisor": {"string": device.hypervisor},
            "apiVersion": {"int": device.api_version},
            "devicePath": {"string": device.path},
        }
        if shared:
            devices = [{"name": device.hypervisor, SHARED_FIELD: True, "attributes": attributes}]
        else:
            if taint is not None:
                identical_devices = min(identical_devices, contracts.RESOURCE_SLICE_MAX_TAINTED_DEVICES)
            names = device_names(device.hypervisor, identical_devices)
            devices = [{"name": name, "attributes": attributes} for name in names]
        if taint is not None:
            for entry in devices:
                entry[TAINTS_FIELD] = [taint.as_json()]
    return {
        "driver": driver,
        "nodeName": node_name,
        "pool": {"name": node_name, "resourceSliceCount": 1},
        "devices": devices,
    }


def owned(spec: Any) -> Json:
    """What of a slice's spec is ours to compare with the desired one: the driver, node, pool (no
    generation), and per device its name, our attributes and our taint (key, value, effect). No
    devices is the same as `[]` (the server omits an empty list); anything others add is left out.

    >>> owned({"driver": "d", "nodeName": "n", "pool": {"name": "n", "generation": 3, "resourceSliceCount": 1},
    ...        "devices": [{"name": "kvm-0", "attributes": {"hypervisor": {"string": "kvm"}, "x": {"int": 1}}}]})
    ... # doctest: +NORMALIZE_WHITESPACE
    {'driver': 'd', 'nodeName': 'n', 'pool': {'name': 'n', 'resourceSliceCount': 1},
     'devices': [{'name': 'kvm-0', 'attributes': {'hypervisor': {'string': 'kvm'}}}]}
    """
    spec = mapping(spec)
    found = []
    for entry in spec.get("devices") if isinstance(spec.get("devices"), list) else []:
        device = mapping(entry)
        attributes = mapping(device.get("attributes"))
        mine: Json = {"name": device.get("name")}
        if device.get(SHARED_FIELD) is True:
            mine[SHARED_FIELD] = True
        mine["attributes"] = {k: attributes[k] for k in ATTRIBUTES if k in attributes}
        listed = device.get(TAINTS_FIELD)
        taints = [
            {k: mapping(t).get(k) for k in TAINT_FIELDS}
            for t in (listed if isinstance(listed, list) else [])
            if mapping(t).get("key") == contracts.TAINT_UNUSABLE
        ]
        if taints:
            mine[TAINTS_FIELD] = taints
        found.append(mine)
    pool = mapping(spec.get("pool"))
    return {
        "driver": spec.get("driver"),
        "nodeName": spec.get("nodeName"),
        "pool": {k: pool.get(k) for k in ("name", "resourceSliceCount")},
        "devices": found,
    }


def mapping(value: Any) -> Json:
    return value if isinstance(value, dict) else {}


def pool_generation(obj: Json) -> int:
    value = ((obj.get("spec") or {}).get("pool") or {}).get("generation")
    return value if isinstance(value, int) else 0


def object_name(obj: Json) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def object_version(obj: Json) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion", ""))


def is_newer(candidate: Json, current: Optional[Json]) -> bool:
    """Whether `candidate` is a later state of an object than `current` (resourceVersions are
    opaque, but etcd's are integers: compared as such when both are; else the later arrival wins)."""
    if current is None:
        return True
    a, b = object_version(candidate), object_version(current)
    return int(a) >= int(b) if a.isdigit() and b.isdigit() else True


class Learned(NamedTuple):
    """What the API server has shown of the fields it may drop: whether we still publish each
    (until an answer drops it), and whether an answer has kept it (until then a write of it is
    tried dry first)."""

    shared: bool = True
    taints: bool = True
    keeps_shared: bool = False
    keeps_taints: bool = False


def unsure(learned: Learned, desired: Json) -> bool:
    """Whether desired holds a field the server has not yet been seen to keep.

    >>> unsure(Learned(), {"devices": [{"name": "kvm", SHARED_FIELD: True}]})
    True
    >>> unsure(Learned(keeps_shared=True), {"devices": [{"name": "kvm", SHARED_FIELD: True}]})
    False
    """
    devices = desired["devices"]
    shared = learned.shared and not learned.keeps_shared and any(d.get(SHARED_FIELD) for d in devices)
    return shared or (learned.taints and not learned.keeps_taints and any(TAINTS_FIELD in d for d in devices))


def learn(learned: Learned, desired: Json, answer_spec: Any) -> tuple[Learned, str]:
    """What the server's answer to a write of desired (stored or dry run) teaches, and the field it
    dropped: "shared" (allowMultipleAllocations: the scheduler would give our one device to one
    claim at a time) or "taints" (an unusable device would look usable), published no more from
    then on, so desired changes and the write is moot; "" when it dropped neither."""
    kept = owned(answer_spec)["devices"]
    if learned.shared and desired["devices"]:
        if not any(d.get(SHARED_FIELD) for d in kept):
            return learned._replace(shared=False), "shared"
        learned = learned._replace(keeps_shared=True)
    if learned.taints and any(TAINTS_FIELD in d for d in kept):
        return learned._replace(keeps_taints=True), ""
    if learned.taints and any(TAINTS_FIELD in d for d in desired["devices"]):
        return learned._replace(taints=False), "taints"
    return learned, ""


def dropped_text(dropped: str, slice_name: str, identical_devices: int) -> str:
    """What learn()'s dropped field means for the slice, said once."""
    if dropped == "shared":
        return (
            f"ResourceSlice {slice_name}: the API server does not keep {SHARED_FIELD} (Kubernetes before 1.36, "
            f"or DRAConsumableCapacity off); publishing {identical_devices} identical devices instead"
        )
    return (
        f"ResourceSlice {slice_name}: the API server does not keep device taints (Kubernetes before 1.36, or "
        "DRADeviceTaints off); an unusable device leaves the slice instead"
    )


def right(obj: Json, desired: Json, accepted: Optional[tuple[Json, Json]]) -> bool:
    """The server's slice says what we want: equal in what is ours, or what the server made of
    exactly this desired spec when we wrote it (`accepted`: once, not fought)."""
    found = owned(obj.get("spec"))
    return found == desired or accepted == (desired, found)


def choose(
    ours: Iterable[Json], desired: Json, accepted: Optional[tuple[Json, Json]]
) -> tuple[Optional[Json], list[Json]]:
    """Of our node's slices, the one to keep and the duplicates to delete: the oldest stays, unless
    another is already right."""
    oldest_first = sorted(
        ours, key=lambda o: (str(mapping(o.get("metadata")).get("creationTimestamp", "")), object_name(o))
    )
    keep = next((o for o in oldest_first if right(o, desired, accepted)), oldest_first[0] if oldest_first else None)
    return keep, [o for o in oldest_first if o is not keep]


def slice_object(desired: Json, metadata: Json, generation: int) -> Json:
    """The ResourceSlice to write: desired at pool generation `generation`, with `metadata` (an update's, with its
    resourceVersion; a create's generateName)."""
    spec: Any = dict(desired)
    spec["pool"] = dict(desired["pool"], generation=generation)
    if not spec["devices"]:
        del spec["devices"]  # as the server would store it
    api_version = f"{contracts.RESOURCE_API_GROUP}/{contracts.RESOURCE_API_VERSION}"
    return {"apiVersion": api_version, "kind": "ResourceSlice", "metadata": dict(metadata), "spec": spec}


__all__ = [
    "DeviceInfo",
    "Learned",
    "choose",
    "desired_spec",
    "device_names",
    "is_newer",
    "learn",
    "object_name",
    "object_version",
    "owned",
    "pool_generation",
    "right",
    "slice_object",
    "unsure",
]
