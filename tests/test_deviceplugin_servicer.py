"""The DevicePlugin service: its rules in-process against a fake checker (anything with
check(timeout)), for the fast loop (Allocate's answers and refusals, ListAndWatch's lists,
GetPreferredAllocation); and, on a real node with the real probe helper, the first list after the
first check and Allocate repairing the CDI spec itself before it answers."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import grpc
import pytest

from hyperlight_agent import contracts
from hyperlight_agent.device.checker import Checker, CheckTarget
from hyperlight_agent.device.helper import ProbeHelper
from hyperlight_agent.device.observation import Cause, Observation, SharedObservation
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.deviceplugin.servicer import DevicePluginServicer, Endpoint, Profile
from hyperlight_agent.files import cdi
from tests.conftest import read_bytes, until
from tests.fakes import Aborted, Context, FakeChecker


def setup(tmp: str, kvm_dir: str) -> tuple[SharedObservation, ProbeHelper, DevicePluginServicer]:
    state = SharedObservation()
    helper = ProbeHelper()
    checker = Checker(CheckTarget(kvm_dir, None, os.path.join(tmp, "cdi"), 65534, 65534), helper, state)
    return state, helper, DevicePluginServicer(Profile("hyperlight.dev/hypervisor", "x.sock", 3, "cdi"), state, checker)


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
    with pytest.raises(Aborted, match="DEADLINE_EXCEEDED"):
        await servicer.Allocate(request, Context(remaining=0.0))
    assert (await servicer.Allocate(request, Context())).container_responses
    await helper.close()


R = contracts.RESOURCE_HYPERVISOR
HEALTHY = Observation(True, "", "kvm")


def make(
    allocation: str = "both", slots: int = 3, workload_env: bool = True, observation: Observation = HEALTHY
) -> tuple[DevicePluginServicer, FakeChecker, list[str], list[int]]:
    outcomes: list[str] = []
    streams: list[int] = []
    checker = FakeChecker(observation)
    servicer = DevicePluginServicer(
        Profile(R, "hyperlight.sock", slots, allocation, workload_env=workload_env),
        SharedObservation(),
        checker,  # type: ignore[arg-type]
        on_streams_changed=streams.append,
        on_allocate=outcomes.append,
    )
    return servicer, checker, outcomes, streams


def allocate(servicer: DevicePluginServicer, *containers: list[str], remaining: Any = None) -> pb.AllocateResponse:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    return asyncio.run(servicer.Allocate(request, Context(remaining)))


def refusal(servicer: DevicePluginServicer, *containers: list[str], remaining: Any = None) -> Aborted:
    with pytest.raises(Aborted) as info:
        allocate(servicer, *containers, remaining=remaining)
    return info.value


def test_allocate_both_gives_the_cdi_name_the_device_spec_and_the_environment() -> None:
    servicer, checker, outcomes, _ = make()
    response = allocate(servicer, ["kvm-0"], ["kvm-2"])
    assert len(response.container_responses) == 2
    for container in response.container_responses:
        assert [d.name for d in container.cdi_devices] == ["hyperlight.dev/hypervisor=kvm"]
        assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
            ("/dev/kvm", "/dev/kvm", "rw")
        ]
        assert dict(container.envs) == {contracts.ENV_HYPERVISOR: "kvm", contracts.ENV_DEVICE_PATH: "/dev/kvm"}
    assert outcomes == ["ok"] and checker.timeouts == [None]
    assert servicer.calls.in_flight == 0


@pytest.mark.parametrize(
    ("allocation", "workload_env", "cdi", "spec", "env"),
    [
        ("cdi", True, True, False, False),
        ("device-spec", True, False, True, True),
        ("device-spec", False, False, True, False),  # the bootstrap grant: no workload environment
    ],
)
def test_allocation_modes(allocation: str, workload_env: bool, cdi: bool, spec: bool, env: bool) -> None:
    servicer, _, _, _ = make(allocation, workload_env=workload_env)
    container = allocate(servicer, ["kvm-1"]).container_responses[0]
    assert bool(container.cdi_devices) == cdi
    assert bool(container.devices) == spec
    assert bool(container.envs) == env


def test_allocate_answers_from_a_check_honouring_the_callers_deadline() -> None:
    servicer, checker, _, _ = make()
    allocate(servicer, ["kvm-0"], remaining=2.5)
    assert checker.timeouts == [2.5]
    checker.error = asyncio.TimeoutError()
    refused = refusal(servicer, ["kvm-0"], remaining=0.1)
    assert refused.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline passed while waiting for the device check" in refused.message


@pytest.mark.parametrize(
    "observation",
    [
        Observation(False, "KVM_CREATE_VM failed", "kvm", Cause.PROBE),
        Observation(False, "no hypervisor device in /dev", None, Cause.NO_DEVICE),
    ],
)
def test_allocate_on_an_unhealthy_device_is_unavailable_with_the_reason(observation: Observation) -> None:
    servicer, _, outcomes, _ = make(observation=observation)
    refused = refusal(servicer, ["kvm-0"])
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    assert refused.message == f"{R} is unhealthy: {observation.reason}"
    assert outcomes == ["unavailable"]


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        ((), "no container requests"),
        ((["kvm-0"], []), "container request 1 names no device IDs"),
        ((["kvm-0", "kvm-1", "kvm-2", "kvm-0"],), "4 device IDs requested; this node has 3 slots"),
        ((["kvm-3"],), "unknown device ID 'kvm-3'"),
        ((["mshv-0"],), "unknown device ID 'mshv-0'"),
        ((["kvm-01"],), "malformed device ID 'kvm-01'"),
        ((["kvm-" + "1" * 300],), "longer than"),
    ],
)
def test_allocate_refuses_what_this_node_never_advertised(containers: tuple[list[str], ...], message: str) -> None:
    servicer, _, outcomes, _ = make()
    refused = refusal(servicer, *containers)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in refused.message
    assert outcomes == ["invalid"]
    assert servicer.calls.in_flight == 0


async def test_list_and_watch_sends_the_first_list_after_the_first_check_then_each_change() -> None:
    servicer, _, _, streams = make(slots=2)
    state: SharedObservation = servicer._observation
    stream = servicer.watch(asyncio.Event())
    first = asyncio.ensure_future(stream.__anext__())
    await until(lambda: streams == [1], what="the stream to open")
    assert not first.done(), "no list before the first check"
    state.publish(HEALTHY)
    devices = (await first).devices
    assert [(d.ID, d.health) for d in devices] == [("kvm-0", "Healthy"), ("kvm-1", "Healthy")]
    state.publish(Observation(False, "gone", "kvm", Cause.PROBE))
    assert {d.health for d in (await stream.__anext__()).devices} == {"Unhealthy"}
    servicer.profile = Profile(R, "hyperlight.sock", 1, "both")
    state.republish()  # a reload changed the slot count
    assert [d.ID for d in (await stream.__anext__()).devices] == ["kvm-0"]
    # The device gone: its slots stay, Unhealthy (the kubelet shows an ID no list names as Healthy).
    state.publish(Observation(False, "no device", None, Cause.NO_DEVICE))
    assert [(d.ID, d.health) for d in (await stream.__anext__()).devices] == [("kvm-0", "Unhealthy")]
    await stream.aclose()
    assert streams == [1, 0]


async def test_an_endpoint_ends_its_streams_at_once_when_closed() -> None:
    servicer, _, _, _ = make()
    seen: list[int] = []
    keys: set[object] = set()

    def on_stream(delta: int, key: object) -> None:
        seen.append(delta)
        keys.add(key)

    endpoint = Endpoint(servicer, on_stream)
    servicer._observation.publish(HEALTHY)
    streams = [endpoint.ListAndWatch(pb.Empty(), Context()) for _ in range(2)]
    for stream in streams:
        assert len((await stream.__anext__()).devices) == 3
    waiting = [asyncio.ensure_future(s.__anext__()) for s in streams]
    endpoint.close()
    for waiter in waiting:
        with pytest.raises(StopAsyncIteration):
            await waiter
    assert sorted(seen) == [-1, -1, 1, 1] and len(keys) == 2, "each stream counted on its own"
    # A stream opened on a closed endpoint ends before its first list.
    late = endpoint.ListAndWatch(pb.Empty(), Context())
    with pytest.raises(StopAsyncIteration):
        await late.__anext__()
    assert endpoint.calls.in_flight == 0  # the servicer's attributes show through


def test_preferred_allocation_honours_must_include_then_takes_the_first_available() -> None:
    servicer, _, _, _ = make()
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=["kvm-2", "kvm-0", "kvm-1"],
                must_include_deviceIDs=["kvm-1", "kvm-1"],
                allocation_size=2,
            ),
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=["kvm-0", "kvm-1"], allocation_size=0),
        ]
    )
    response = asyncio.run(servicer.GetPreferredAllocation(request, Context()))
    assert [list(r.deviceIDs) for r in response.container_responses] == [["kvm-1", "kvm-2"], []]


def test_preferred_allocation_refuses_an_oversized_request() -> None:
    servicer, _, _, _ = make()
    ids = [f"kvm-{i}" for i in range(100_001)]
    request = pb.PreferredAllocationRequest(
        container_requests=[pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, must_include_deviceIDs=ids)]
    )
    with pytest.raises(Aborted) as info:
        asyncio.run(servicer.GetPreferredAllocation(request, Context()))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "device IDs in one request" in info.value.message


def test_options_and_prestart() -> None:
    servicer, _, _, _ = make()
    options = asyncio.run(servicer.GetDevicePluginOptions(pb.Empty(), Context()))
    assert not options.pre_start_required and not options.get_preferred_allocation_available
    assert (
        asyncio.run(servicer.PreStartContainer(pb.PreStartContainerRequest(), Context()))
        == pb.PreStartContainerResponse()
    )
