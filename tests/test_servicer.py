"""The DevicePlugin service in-process (no gRPC transport): first list after the first check,
and Allocate repairing the CDI spec itself before it answers."""

from __future__ import annotations

import asyncio
import os
from typing import Any, NoReturn

import pytest

from hyperlight_agent.device.checker import Checker, CheckTarget
from hyperlight_agent.device.helper import ProbeHelper
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.deviceplugin.servicer import DevicePluginServicer, Profile
from hyperlight_agent.files import cdi
from tests.conftest import read_bytes


class Context:
    """What the servicer uses of grpc.aio's ServicerContext."""

    def __init__(self, remaining: float | None = None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining

    async def abort(self, code: Any, message: str) -> NoReturn:
        raise RuntimeError(f"{code.name}: {message}")


def setup(tmp: str, kvm_dir: str) -> tuple[SharedObservation, ProbeHelper, DevicePluginServicer]:
    state = SharedObservation()
    helper = ProbeHelper()
    checker = Checker(CheckTarget(kvm_dir, None, os.path.join(tmp, "cdi"), 65534, 65534), helper, state)
    return state, helper, DevicePluginServicer(Profile("hyperlight.dev/hypervisor", "x.sock", 3, "cdi"),
                                               state, checker)


async def test_first_list_only_after_the_first_check(tmp: str, kvm_dir: str) -> None:
    state, helper, servicer = setup(tmp, kvm_dir)
    stream = servicer.watch(asyncio.Event()).__aiter__()
    first = asyncio.ensure_future(stream.__anext__())
    for _ in range(20):  # let every ready callback run: nothing may be sent yet
        await asyncio.sleep(0)
    assert not first.done(), "a list was sent before any check completed"
    assert servicer.open_streams == 1
    state.publish(Observation(True, "", "kvm"))
    response = await asyncio.wait_for(first, 5)
    assert [(d.ID, d.health) for d in response.devices] == [(f"kvm-{i}", "Healthy") for i in range(3)]
    await stream.aclose()  # type: ignore[attr-defined]
    assert servicer.open_streams == 0
    await helper.close()


async def test_allocate_repairs_the_spec_before_answering(tmp: str, kvm_dir: str) -> None:
    """No watcher here: only Allocate's own check can have put the spec back."""
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["kvm-1"])])
    spec = cdi.spec_path(os.path.join(tmp, "cdi"))
    wanted = cdi.render("kvm", "/dev/kvm", 65534, 65534)

    _, helper, servicer = setup(tmp, kvm_dir)
    for damage in (b"", b'{"cdiVersion": "0.3.0"', None):
        if damage is None:
            if os.path.exists(spec):
                os.unlink(spec)
        else:
            os.makedirs(os.path.dirname(spec), exist_ok=True)
            with open(spec, "wb") as f:
                f.write(damage)
        response = await servicer.Allocate(request, Context())
        assert response.container_responses[0].cdi_devices[0].name == "hyperlight.dev/hypervisor=kvm"
        assert read_bytes(spec) == wanted
    await helper.close()


async def test_allocate_respects_a_caller_deadline(tmp: str, kvm_dir: str) -> None:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["kvm-0"])])

    _, helper, servicer = setup(tmp, kvm_dir)
    with pytest.raises(RuntimeError, match="DEADLINE_EXCEEDED"):
        await servicer.Allocate(request, Context(remaining=0.0))
    assert (await servicer.Allocate(request, Context())).container_responses
    await helper.close()
