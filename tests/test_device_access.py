"""Bootstrap mode (--device-access): four slots (the device plugin and the DRA driver, each with
its successor during a handover) that grant the raw device, found without opening it."""

from __future__ import annotations

import os

import grpc
import pytest

from hyperlight_agent import contracts, modes
from standin.kubelet import KubeletStandin, StandinThread
from tests.conftest import StartAgent, make_node, wait_for

R = contracts.RESOURCE_DEVICE_ACCESS


def plugin_slots(k: KubeletStandin) -> list[tuple[str, str]]:
    p = k.plugins.get(R)
    return p.devices if p and p.lists else []


def test_its_slots_are_devicespec_only_no_cdi_never_opened(
    kubelet: StandinThread, start_agent: StartAgent, tmp: str
) -> None:
    host_dev = os.path.join(tmp, "host-dev")
    os.mkdir(host_dev)
    # Numbers of no existing device: any open() would fail, so a Healthy slot proves none happened.
    node = make_node(os.path.join(host_dev, "kvm"), 250, 250)
    with pytest.raises(OSError):
        os.close(os.open(node, os.O_RDWR))
    agent = start_agent("--device-access", "--device-dir", host_dev)
    # One slot for each of our pods that holds the device, and one for each one's surge successor.
    slots = modes.DEVICE_ACCESS.slots
    assert slots == 4
    kubelet.wait_until(lambda k: plugin_slots(k) == [(f"kvm-{i}", "Healthy") for i in range(slots)], 15)
    ((_, request),) = kubelet.kubelet.register_calls
    assert (request.endpoint, request.resource_name) == ("hyperlight-access.sock", R)
    assert agent.helpers() == [], "bootstrap mode never starts the probe helper"

    (container,) = kubelet.call(kubelet.kubelet.allocate(R, ["kvm-0"])).container_responses
    assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
        ("/dev/kvm", "/dev/kvm", "rw")
    ]
    assert list(container.cdi_devices) == [] and not container.envs and not container.mounts
    with pytest.raises(grpc.aio.AioRpcError) as info:
        kubelet.call(kubelet.kubelet.raw_allocate(R, [f"kvm-{slots}"]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not os.path.exists(os.path.join(tmp, "cdi")), "bootstrap mode writes no CDI"
    assert agent.stop() == 0


@pytest.mark.parametrize("kind", ["regular file", "symlink"])
def test_non_device_at_the_path_is_no_device(
    kubelet: StandinThread, start_agent: StartAgent, tmp: str, kind: str
) -> None:
    host_dev = os.path.join(tmp, "host-dev")
    os.mkdir(host_dev)
    path = os.path.join(host_dev, "kvm")
    if kind == "symlink":
        os.symlink("/dev/kvm", path)
    else:
        open(path, "w").close()
    agent = start_agent("--device-access", "--device-dir", host_dev)
    # Only a character device is a hypervisor: nothing is advertised, and the reason says why.
    kubelet.wait_until(lambda k: (p := k.plugins.get(R)) is not None and p.lists and p.devices == [], 15)
    wait_for(lambda: f"{path} is not a character device" in agent.log, 10, "the reason in the log")
