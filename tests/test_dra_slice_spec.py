"""The slice's pure decisions (dra/slice_spec.py) as tables: which stored slice is kept, and what
an API server's answer teaches about the fields it may drop. The publisher's behaviour against a
server is tests/test_dra_slices.py's."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from hyperlight_agent import contracts
from hyperlight_agent.dra.slice_spec import (
    DeviceInfo,
    Learned,
    choose,
    desired_spec,
    learn,
    owned,
    right,
    slice_object,
    unsure,
)
from hyperlight_agent.dra.taints import Taint

KVM = DeviceInfo("kvm", 12, "/dev/kvm")
UNUSABLE = Taint("probe", "NoSchedule")
SHARED = desired_spec("n", "d", 4, KVM, shared=True)
IDENTICAL = desired_spec("n", "d", 4, KVM)
TAINTED_SHARED = desired_spec("n", "d", 4, KVM, shared=True, taint=UNUSABLE)
TAINTED = desired_spec("n", "d", 4, KVM, taint=UNUSABLE)
NOTHING = desired_spec("n", "d", 4, None)


def stored(spec: Any, name: str = "s", created: str = "2026-01-01T00:00:00Z", **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": created, **extra}, "spec": spec}


def without_taints(spec: Any) -> Any:
    return {**spec, "devices": [{k: v for k, v in d.items() if k != "taints"} for d in spec["devices"]]}


def without_sharing(spec: Any) -> Any:
    return {
        **spec,
        "devices": [{k: v for k, v in d.items() if k != "allowMultipleAllocations"} for d in spec["devices"]],
    }


@pytest.mark.parametrize(
    ("learned", "desired", "expected"),
    [
        (Learned(), SHARED, True),  # one shared device, never seen kept: a dry run first
        (Learned(keeps_shared=True), SHARED, False),
        (Learned(), IDENTICAL, False),  # nothing the server may drop
        (Learned(keeps_shared=True), TAINTED_SHARED, True),  # a taint, never seen kept
        (Learned(keeps_shared=True, keeps_taints=True), TAINTED_SHARED, False),
        (Learned(shared=False, taints=False), TAINTED, False),  # dropped already: not tried again
        (Learned(), NOTHING, False),
    ],
)
def test_a_field_never_seen_kept_is_written_dry_first(learned: Learned, desired: Any, expected: bool) -> None:
    assert unsure(learned, desired) is expected


@pytest.mark.parametrize(
    ("learned", "desired", "answer", "expected", "dropped"),
    [
        # The server keeps what we wrote: learned, nothing dropped.
        (Learned(), SHARED, SHARED, Learned(keeps_shared=True), ""),
        (Learned(), TAINTED_SHARED, TAINTED_SHARED, Learned(keeps_shared=True, keeps_taints=True), ""),
        # 1.35: allowMultipleAllocations dropped; N identical devices from then on.
        (Learned(), SHARED, without_sharing(SHARED), Learned(shared=False), "shared"),
        # Sharing dropped and taints too: sharing is said first (desired changes; taints next time).
        (Learned(), TAINTED_SHARED, without_taints(without_sharing(TAINTED_SHARED)), Learned(shared=False), "shared"),
        # DRADeviceTaints off: the taints dropped; an unusable device leaves the slice from then on.
        (Learned(shared=False), TAINTED, without_taints(TAINTED), Learned(shared=False, taints=False), "taints"),
        # A usable device written: nothing about taints is learned either way.
        (Learned(shared=False), IDENTICAL, IDENTICAL, Learned(shared=False), ""),
        # No devices: nothing about either field.
        (Learned(), NOTHING, NOTHING, Learned(), ""),
        # Dropped before: not learned again.
        (Learned(shared=False, taints=False), IDENTICAL, IDENTICAL, Learned(shared=False, taints=False), ""),
    ],
)
def test_an_answer_teaches_which_fields_the_server_keeps(
    learned: Learned, desired: Any, answer: Any, expected: Learned, dropped: str
) -> None:
    assert learn(learned, desired, answer) == (expected, dropped)


def test_what_the_server_adds_is_not_ours_and_what_it_changed_is_accepted_once() -> None:
    mutated = {**SHARED, "devices": [{**SHARED["devices"][0], "attributes": {"hypervisor": {"string": "x"}}}]}
    added = {**SHARED, "pool": {**SHARED["pool"], "generation": 7}, "extra": 1}
    added["devices"] = [{**SHARED["devices"][0], "attributes": {**SHARED["devices"][0]["attributes"], "zone": {}}}]
    assert right(stored(added), SHARED, None)
    assert not right(stored(mutated), SHARED, None)
    assert right(stored(mutated), SHARED, (SHARED, owned(mutated)))
    assert not right(stored(mutated), IDENTICAL, (SHARED, owned(mutated)))  # accepted for that spec only


@pytest.mark.parametrize(
    ("slices", "kept", "extras"),
    [
        ([], None, []),
        ([("b", "2026-01-02", IDENTICAL), ("a", "2026-01-01", IDENTICAL)], "a", ["b"]),  # the oldest
        ([("b", "2026-01-02", SHARED), ("a", "2026-01-01", IDENTICAL)], "b", ["a"]),  # unless another is right
        ([("b", "2026-01-01", IDENTICAL), ("a", "2026-01-01", IDENTICAL)], "a", ["b"]),  # same age: by name
    ],
)
def test_of_several_slices_one_is_kept(
    slices: list[tuple[str, str, Any]], kept: Optional[str], extras: list[str]
) -> None:
    keep, rest = choose([stored(spec, name, created) for name, created, spec in slices], SHARED, None)
    assert (keep or {}).get("metadata", {}).get("name") == kept
    assert [o["metadata"]["name"] for o in rest] == extras


def test_the_object_written_carries_the_next_generation_and_no_empty_device_list() -> None:
    written = slice_object(NOTHING, {"generateName": "n-d-"}, 3)
    assert written["apiVersion"] == f"{contracts.RESOURCE_API_GROUP}/{contracts.RESOURCE_API_VERSION}"
    assert written["spec"]["pool"]["generation"] == 3 and "devices" not in written["spec"]
    assert "generation" not in NOTHING["pool"] and NOTHING["devices"] == []  # desired untouched
