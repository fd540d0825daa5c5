"""dra/slice_keeper.py: the DRA side's API half, on its own (its slice against the fake API server
is tests/test_dra_side.py's and tests/test_dra_slices.py's)."""

from __future__ import annotations

import os
from typing import Optional

import pytest

from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.dra import client
from hyperlight_agent.dra.slice_keeper import SliceKeeper, SliceTarget, device_info
from hyperlight_agent.dra.slice_spec import DeviceInfo
from tests.fakes import FakeChecker, dra_outcomes


def keeper(shared: bool, kubeconfig: Optional[str] = None) -> SliceKeeper:
    async def nobody() -> Optional[str]:
        return None

    target = SliceTarget("node1", "hypervisor.hyperlight.dev", 3, shared, kubeconfig, 0.0)
    return SliceKeeper(
        target,
        SharedObservation(),
        FakeChecker(),
        dra_outcomes(),
        nobody,
        lambda: None,
        lambda: None,  # type: ignore[arg-type]
    )


def test_device_info_comes_from_the_table() -> None:
    from hyperlight_agent.device.observation import Observation

    assert device_info(Observation(True, "", "mshv")) == DeviceInfo("mshv", 0, "/dev/mshv")
    # A device that failed its check is still described (it stays in the slice, tainted).
    assert device_info(Observation(False, "failed", "kvm")) == DeviceInfo("kvm", 12, "/dev/kvm")
    assert device_info(Observation(False, "gone", None)) is None


@pytest.mark.parametrize(("shared", "offered"), [(True, ["kvm"]), (False, ["kvm-0", "kvm-1", "kvm-2"])])
def test_the_slice_offers_its_shape_of_the_last_device_found(shared: bool, offered: list[str]) -> None:
    subject = keeper(shared)
    assert subject.offered() == [], "no device found yet: nothing offered"
    subject.device = device_info(Observation(False, "failed", "kvm"))  # a failing device stays, tainted
    assert subject.offered() == offered


def test_an_unusable_kubeconfig_is_said_and_raised_until_it_can_be_used(tmp: str) -> None:
    missing = os.path.join(tmp, "kubeconfig")
    subject = keeper(True, missing)
    with pytest.raises(client.ClientConfigError):
        subject.connect({})
    assert missing in subject.api_error and subject.kube is None
