"""The agent in its DRA mode, in-process: the same device check (a fake helper), CDI spec,
readiness and health service as the device plugin modes, with the DRA stand-in as the kubelet's
plugin watcher and the fake API server of test_dra_slices as the API."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from typing import Any, Awaitable, Callable, Optional

import grpc
import pytest

from hyperlight_agent import modes, transport, waits
from hyperlight_agent.agent import Agent
from hyperlight_agent.config import Settings
from hyperlight_agent.device.helper import ProbeResult
from hyperlight_agent.dra import client as dra_client
from hyperlight_agent.dra import registration as dra_registration
from hyperlight_agent.dra import side as dra_side_module
from hyperlight_agent.files import cdi
from hyperlight_agent.host import healthcheck
from standin.apiserver import FakeApiServer, kubeconfig, recorded
from standin.dra_kubelet import Claim, DraKubeletStandin, Instance
from tests.conftest import START_S, until
from tests.fakes import FakeHelper, RecordingNotifier, device_dir, dra_side, shut

DRIVER = "hypervisor.hyperlight.dev"
UID = "8d5c0f2a-1b3e-4d6f-a7c9-0e1f2a3b4c5d"  # the recorded claim's uid (default/pod-hv-9x2lq)


pytestmark = pytest.mark.usefixtures("quick_deregistration")


def settings_in(tmp: str, config: str, **kw: Any) -> Settings:
    registry, plugins = dirs(tmp)
    return Settings.defaults(
        kubelet_dir=os.path.join(tmp, "kubelet"),
        cdi_dir=os.path.join(tmp, "cdi"),
        device_dir=device_dir(tmp, "kvm"),
        kubeconfig=config,
        node_name="node1",
        dra_devices=4,
        dra_registry_dir=registry,
        dra_plugins_dir=plugins,
        **{"instance": "pod-a", **kw},
    )


def dirs(tmp: str) -> tuple[str, str]:
    registry, plugins = os.path.join(tmp, "plugins_registry"), os.path.join(tmp, "plugins")
    os.makedirs(registry, exist_ok=True)
    os.makedirs(plugins, exist_ok=True)
    return registry, plugins


Body = Callable[[FakeApiServer, DraKubeletStandin, str], Awaitable[None]]


def with_cluster(tmp: str, body: Body) -> None:
    """A fake API server, the DRA stand-in on our registry dir, and a kubeconfig for the first."""

    async def main() -> None:
        fake = FakeApiServer()
        url = await fake.start()
        config = kubeconfig(tmp, url)
        registry, _ = dirs(tmp)
        try:
            async with DraKubeletStandin(registry) as kubelet:
                await asyncio.wait_for(body(fake, kubelet, config), 2 * START_S)  # a backstop for a hang
        finally:
            await fake.stop()

    asyncio.run(main())


def devices_published(fake: FakeApiServer) -> int:
    ours = fake.ours()
    return len(ours[0]["spec"].get("devices") or []) if len(ours) == 1 else -1


class WritesNoting(list):  # type: ignore[type-arg]
    """The fake server's event list, noting for each event whether `registered()` held then and
    the taints the slice carried."""

    def __init__(self, events: list[Any], registered: Callable[[], bool]) -> None:
        super().__init__(events)
        self._registered = registered
        self.noted: list[tuple[bool, list[Any]]] = []

    def append(self, event: Any) -> None:
        self.noted.append((self._registered(), taints_of(event[2])))
        super().append(event)


def taints_of(obj: Any) -> list[Any]:
    """Every taint of a slice's devices, as the slice carries them (without timeAdded)."""
    return [
        {k: v for k, v in t.items() if k != "timeAdded"}
        for d in obj.get("spec", {}).get("devices") or []
        for t in d.get("taints", [])
    ]


# The taint of a device whose probe fails, as the slice carries it (the server adds timeAdded).
UNUSABLE_PROBE = {"key": "hyperlight.dev/unusable", "value": "probe", "effect": "NoSchedule"}


def taints_published(fake: FakeApiServer) -> list[Any]:
    """The taints of the slice's devices, all alike (else the list of each device's)."""
    ours = fake.ours()
    found = [
        [{k: v for k, v in t.items() if k != "timeAdded"} for t in d.get("taints", [])]
        for d in (ours[0]["spec"].get("devices") or [] if len(ours) == 1 else [])
    ]
    return found[0] if found and all(f == found[0] for f in found) else found


def test_a_dra_agent_registers_publishes_prepares_and_follows_the_device(tmp: str, helpers: list[FakeHelper]) -> None:
    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        notifier = RecordingNotifier()
        agent = Agent(settings_in(tmp, config), modes.DRA, notifier=notifier)
        assert agent.mode is modes.DRA and dra_side(agent).registrar.driver == DRIVER
        await agent.start()
        try:
            await until(lambda: agent.ready, timeout=START_S, what="registered, published and healthy")
            assert agent.status() == "ready: kvm, one device in the ResourceSlice, shared by every claim"
            (published,) = fake.ours()
            assert published["spec"]["nodeName"] == "node1" and published["spec"]["driver"] == DRIVER
            (shared,) = published["spec"]["devices"]
            assert shared == {
                "name": "kvm",
                "allowMultipleAllocations": True,
                "attributes": {
                    "hypervisor": {"string": "kvm"},
                    "apiVersion": {"int": 12},
                    "devicePath": {"string": "/dev/kvm"},
                },
            }
            # The CDI spec is the device plugin's, and a claim gets its device.
            assert os.path.exists(cdi.spec_path(os.path.join(tmp, "cdi")))
            fake.claims[("default", "pod-hv-9x2lq")] = recorded("resourceclaim-allocated.json")
            answer = await kubelet.prepare(DRIVER, [Claim("default", "pod-hv-9x2lq", UID)])
            (device,) = answer[UID].devices
            assert list(device.cdi_device_ids) == ["hyperlight.dev/hypervisor=kvm"] and device.device_name == "kvm-3"
            # The exec probes ask the health service on the DRA socket.
            socket = dra_side(agent).registrar.service_socket
            assert await healthcheck.peer_ready(socket, 2)

            # The device fails its check: it stays in the slice with our taint, readiness follows.
            helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
            agent.checker.request()
            await until(lambda: taints_published(fake) == [UNUSABLE_PROBE] and not agent.ready, what="the taint")
            assert devices_published(fake) == 1
            # (followed by what the slice publisher last met, if anything)
            assert agent.status().startswith("unhealthy: KVM_CREATE_VM failed"), agent.status()
            assert not await healthcheck.peer_ready(socket, 2)
            helpers[0].answers.clear()
            agent.checker.request()
            await until(lambda: taints_published(fake) == [] and agent.ready, what="the taint gone")
            assert devices_published(fake) == 1
        finally:
            await shut(agent)
        assert not os.listdir(os.path.join(tmp, "plugins_registry")), "our registration socket is gone"
        assert fake.ours(), "the slice stays for a successor"
        assert notifier.messages[-1] == ("STOPPING=1", "STATUS=stopping")

    with_cluster(tmp, body)


@pytest.mark.parametrize(("setting", "capacity"), [("auto", False), ("off", True)])
def test_identical_devices_where_the_api_server_drops_sharing_or_it_is_off(
    tmp: str, helpers: list[FakeHelper], setting: str, capacity: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A server without DRAConsumableCapacity drops allowMultipleAllocations: the agent finds out from
    the answer and publishes dra_devices identical devices; dra_shared_device=off never tries."""
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        fake.consumable_capacity = capacity
        agent = Agent(settings_in(tmp, config, dra_shared_device=setting), modes.DRA)
        await agent.start()
        try:
            await until(
                lambda: agent.ready and devices_published(fake) == 4, timeout=START_S, what="four identical devices"
            )
            assert agent.status() == "ready: kvm, 4 devices in the ResourceSlice"
            assert [d["name"] for d in fake.ours()[0]["spec"]["devices"]] == ["kvm-0", "kvm-1", "kvm-2", "kvm-3"]
            tried = [
                r
                for r in fake.requests
                if r.body and any("allowMultipleAllocations" in d for d in r.body.get("spec", {}).get("devices", []))
            ]
            assert len(tried) == (1 if setting == "auto" else 0)
            said = "does not keep allowMultipleAllocations (Kubernetes before 1.36, or DRAConsumableCapacity off)"
            assert (said in caplog.text) == (setting == "auto")
        finally:
            await shut(agent)

    with_cluster(tmp, body)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dra_metrics_count_calls_claims_writes_and_watches(tmp: str, helpers: list[FakeHelper]) -> None:
    """The DRA mode's series (issue 29: 5): Prepare and Unprepare calls, claims by result and a
    latency histogram; slice writes; API errors; watches opened again."""
    from prometheus_client import generate_latest

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        agent = Agent(settings_in(tmp, config, metrics_address=f"127.0.0.1:{free_port()}"), modes.DRA)
        await agent.start()
        try:
            await until(lambda: agent.ready, timeout=START_S, what="ready and registered")
            fake.claims[("default", "pod-hv-9x2lq")] = recorded("resourceclaim-allocated.json")
            await kubelet.prepare(DRIVER, [Claim("default", "pod-hv-9x2lq", UID), Claim("default", "gone", "u2")])
            await kubelet.unprepare(DRIVER, [Claim("default", "pod-hv-9x2lq", UID)])
            text = generate_latest(agent.face.metrics.registry).decode()
        finally:
            await shut(agent)
        for line in (
            'hyperlight_dra_calls_total{operation="prepare"} 1.0',
            'hyperlight_dra_calls_total{operation="unprepare"} 1.0',
            'hyperlight_dra_claims_total{operation="prepare",result="ok"} 1.0',
            'hyperlight_dra_claims_total{operation="prepare",result="error"} 1.0',
            'hyperlight_dra_claims_total{operation="unprepare",result="ok"} 1.0',
            'hyperlight_dra_call_duration_seconds_count{operation="prepare"} 1.0',
            'hyperlight_dra_slice_writes_total{verb="create"} 1.0',
        ):
            assert line in text, (line, [t for t in text.splitlines() if "hyperlight_dra" in t])

    with_cluster(tmp, body)


def test_a_stopped_dra_agent_hands_over_to_a_ready_successor(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        old = Agent(settings_in(tmp, config, handover_seconds=30), modes.DRA)
        new = Agent(settings_in(tmp, config, instance="pod-b"), modes.DRA)
        await old.start()
        await until(lambda: old.ready, timeout=START_S, what="the old agent ready")
        await new.start()
        try:
            await until(lambda: new.ready, timeout=START_S, what="its successor ready")
            await waits.within(shut(old), 20)
            successor = dra_side(new).registrar.service_socket
            assert f"handing over to {successor}" in caplog.text
            assert new.ready, "the successor serves on"
        finally:
            await shut(new)

    with_cluster(tmp, body)


def test_no_handover_while_the_kubelet_may_still_take_the_successors_registration_back(
    tmp: str, helpers: list[FakeHelper], monkeypatch: pytest.MonkeyPatch
) -> None:
    """1.36 on take a registration back when its NotifyRegistrationStatus fails, and it fails on
    the kubelet's deadline even after the plugin answered (a starved node): the successor believes
    it is registered. Handing over to it then left the kubelet with no instance of the driver (a
    red CI run: pods failed "DRA driver ... is not registered" during a driver pod's deletion). A
    successor is handed over to only once its registration has stood REGISTRATION_SETTLE_S."""
    monkeypatch.setattr(dra_registration, "REGISTRATION_SETTLE_S", 2.0)

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        old = Agent(settings_in(tmp, config, handover_seconds=30), modes.DRA)
        new = Agent(settings_in(tmp, config, instance="pod-b"), modes.DRA)
        await old.start()
        await until(lambda: old.ready, timeout=START_S, what="the old agent ready")
        loop = asyncio.get_running_loop()
        lost: list[float] = []  # when the successor's notifies were lost: for 2.5 s from the first

        def lose(path: str) -> bool:
            if "pod-b" not in path or (lost and loop.time() > lost[0] + 2.5):
                return False
            lost.append(loop.time())
            return True

        kubelet.notify_lost = lose
        await new.start()
        try:
            await until(lambda: new.ready, timeout=START_S, what="its successor ready (as it believes)")
            await waits.within(shut(old), 20)
            counts = [count for _, driver, count in kubelet.registered_counts if driver == DRIVER]
            assert lost and 0 not in counts, (lost, counts)
            assert [i.registration_socket for i in kubelet.instances[DRIVER]] == [
                dra_side(new).registrar.registration_socket
            ]
        finally:
            await shut(new)

    with_cluster(tmp, body)


def test_a_successor_whose_device_fails_holds_back_beside_an_agent_still_settling(
    tmp: str, helpers: list[FakeHelper], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a handover waits for a registration to settle: to a next release whose check fails, a
    ready instance registered a moment ago serves the kubelet all the same, so it holds its
    registration back (the real-cluster test caught a first version that made it register)."""
    monkeypatch.setattr(dra_registration, "REGISTRATION_SETTLE_S", 600.0)  # the old agent settles throughout
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        old = Agent(settings_in(tmp, config), modes.DRA)
        await old.start()
        new: Optional[Agent] = None
        try:
            await until(lambda: old.ready, timeout=START_S, what="the old agent ready")
            empty = os.path.join(tmp, "no-device")
            os.makedirs(empty)
            new = Agent(dataclasses.replace(settings_in(tmp, config, instance="pod-b"), device_dir=empty), modes.DRA)
            await new.start()
            await until(
                lambda: "not registering while the device is unhealthy" in caplog.text,
                timeout=START_S,
                what="the new agent holding its registration back",
            )
            assert [i.registration_socket for i in kubelet.instances[DRIVER]] == [
                dra_side(old).registrar.registration_socket
            ]
        finally:
            if new is not None:
                await shut(new)
            await shut(old)

    with_cluster(tmp, body)


def test_two_agents_stopping_at_once_wait_for_a_third_rather_than_hand_over_to_each_other(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    """A driver pod deleted while the one it replaced still hands over (the real-cluster test
    deletes them again and again): each, still ready, looked like the other's successor; both
    handed over and left, and pods failed "DRA driver ... is not registered". A stopping instance
    is no successor: both serve on until the next pod is ready, then hand over to it."""
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        first = Agent(settings_in(tmp, config, handover_seconds=30), modes.DRA)
        second = Agent(settings_in(tmp, config, instance="pod-b", handover_seconds=30), modes.DRA)
        third = Agent(settings_in(tmp, config, instance="pod-c"), modes.DRA)
        stops: list[asyncio.Future[None]] = []
        try:
            await first.start()
            await until(lambda: first.ready, timeout=START_S, what="the first agent ready")
            await second.start()
            await until(lambda: second.ready, timeout=START_S, what="the second agent ready")
            stops = [asyncio.ensure_future(shut(agent)) for agent in (first, second)]
            passed_over = ("instance pod-b is stopping too", f"instance {first.identity.instance} is stopping too")
            await until(
                lambda: all(said in caplog.text for said in passed_over) or any(stop.done() for stop in stops),
                timeout=START_S,
                what="each stopping agent passing the other over",
            )
            assert not any(stop.done() for stop in stops), "one handed over to the other"
            await third.start()
            await waits.within(asyncio.gather(*stops), 30)
            successor = dra_side(third).registrar.service_socket
            assert caplog.text.count(f"handing over to {successor}") == 2, caplog.text
            counts = [count for _, driver, count in kubelet.registered_counts if driver == DRIVER]
            assert counts and 0 not in counts, counts
        finally:
            for agent in (first, second):
                agent.stop()  # again, if its stop waits for a successor: at once
            await asyncio.gather(*stops)
            for agent in (third, *([] if stops else [first, second])):
                await shut(agent)

    with_cluster(tmp, body)


def test_a_successor_whose_device_breaks_before_the_handover_leaves_the_slice_to_its_predecessor_until_it_went(
    tmp: str, helpers: list[FakeHelper]
) -> None:
    """A replacement pod ready, then its device failing its check while the pod it replaces still
    hands over (the real-cluster test broke the new agent's device seconds after the old pod's
    deletion): the predecessor, healthy and registered, serves the kubelet and keeps the slice
    untainted for as long as it is registered; once it has deregistered, the successor's slice
    says the device is unusable. Whether the predecessor took the successor while it was ready is a race either way."""

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        old = Agent(settings_in(tmp, config, handover_seconds=2), modes.DRA)
        new = Agent(settings_in(tmp, config, instance="pod-b"), modes.DRA)
        old_registered = lambda: os.path.exists(dra_side(old).registrar.registration_socket)  # noqa: E731
        writes = WritesNoting(fake.events, old_registered)
        fake.events = writes
        await old.start()
        stop: Optional[asyncio.Future[None]] = None
        try:
            await until(lambda: old.ready and devices_published(fake) == 1, timeout=START_S, what="the old agent ready")
            stop = asyncio.ensure_future(shut(old))
            await new.start()
            await until(lambda: new.ready, timeout=START_S, what="the new agent ready")
            helpers[1].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
            await new.checker.check()
            await until(lambda: taints_published(fake) == [UNUSABLE_PROBE], what="the new agent's slice tainted")
            while_old_registered = [taints for registered, taints in writes.noted if registered]
            assert while_old_registered and all(t == [] for t in while_old_registered), writes.noted
        finally:
            await (stop if stop is not None else shut(old))
            await shut(new)

    with_cluster(tmp, body)


def test_an_in_place_upgrade_waits_for_the_child_it_started(tmp: str, helpers: list[FakeHelper]) -> None:
    """The in-place upgrade's hand-over (host/successor.py) names the child's pid: another ready
    instance of the driver is no successor; the child, once ready, is."""

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        old = Agent(settings_in(tmp, config), modes.DRA)
        child = Agent(settings_in(tmp, config, instance="host-g0123abcd"), modes.DRA)
        await old.start()
        try:
            await until(lambda: old.ready, timeout=START_S, what="the old agent ready")
            await child.start()
            await until(lambda: child.ready, timeout=START_S, what="the child ready")
            assert old.succession is not None
            assert await old.succession.hand_over(0.3, pid=os.getpid() + 1) is None, (
                "a ready instance of another pid is none"
            )
            found = await old.succession.hand_over(10, pid=os.getpid())
            assert found == dra_side(child).registrar.service_socket and child.ready
        finally:
            await shut(child)
            await shut(old)

    with_cluster(tmp, body)


def test_no_api_access_is_said_once_and_retried_without_stopping(
    tmp: str, helpers: list[FakeHelper], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(dra_side_module, "RETRY_INITIAL_S", 0.01)
    monkeypatch.setattr(dra_side_module, "RETRY_CAP_S", 0.02)
    caplog.set_level(logging.INFO, "hyperlight_agent")

    attempts: list[str] = []
    connect = dra_client.connect

    def counted(path: Any, **kw: Any) -> Any:
        attempts.append(path)
        return connect(path, **kw)

    monkeypatch.setattr(dra_client, "connect", counted)

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        agent = Agent(settings_in(tmp, os.path.join(tmp, "missing-kubeconfig")), modes.DRA)
        await agent.start()
        try:
            # The first device check too: until it ends the status says so, whatever the API.
            await until(
                lambda: (
                    len(attempts) >= 5 and dra_side(agent).registrar.registered and agent.parts.observation.version > 0
                ),
                what="retries, and registered and checked meanwhile",
            )
            lines = [r.getMessage() for r in caplog.records if "API client" in r.getMessage()]
            assert len(lines) == 1 and "missing-kubeconfig" in lines[0], lines
            assert not agent.ready and agent.status().startswith("ResourceSlice not published: kubeconfig ")
            # A claim meanwhile gets an error saying why.
            answer = await kubelet.prepare(DRIVER, [Claim("default", "pod-hv-9x2lq", UID)])
            assert "no API connection yet" in answer[UID].error
        finally:
            await shut(agent)

    with_cluster(tmp, body)


def test_dra_status_names_what_it_waits_for() -> None:
    from hyperlight_agent.device.observation import Observation

    ok = Observation(True, "", "kvm")
    s = dra_side_module.DraSnapshot(ok, True, False, "", "/r/x-reg.sock", False, "", 4)
    assert s.status() == "waiting for the kubelet's plugin watcher to register /r/x-reg.sock"
    refused = "API server at x: connection refused"
    s = dra_side_module.DraSnapshot(ok, True, True, "", "/r/x-reg.sock", False, refused, 4)
    assert s.status() == "ResourceSlice not published: API server at x: connection refused"
    assert not s.ready()
    s = dra_side_module.DraSnapshot(ok, True, True, "", "/r/x-reg.sock", True, "", 1)
    assert s.status() == "ready: kvm, 1 device in the ResourceSlice" and s.ready()


# Issue 26, 2: a removed registration socket is put back, the kubelet registers us again, and we
# are not ready meanwhile; a removed service socket is served again too.
def test_a_removed_socket_is_served_again_and_readiness_follows_the_registration(
    tmp: str, helpers: list[FakeHelper]
) -> None:
    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        notifier = RecordingNotifier()
        agent = Agent(settings_in(tmp, config), modes.DRA, notifier=notifier)
        await agent.start()
        try:
            await until(
                lambda: agent.ready and len(kubelet.instances.get(DRIVER, [])) == 1, timeout=START_S, what="ready"
            )
            registrar = dra_side(agent).registrar
            said = len(notifier.messages)
            os.unlink(registrar.registration_socket)  # a cleanup tool, an administrator
            await until(
                lambda: registrar.served_again == 1 and os.path.exists(registrar.registration_socket),
                what="the socket back",
            )
            await until(
                lambda: agent.ready and len(kubelet.instances.get(DRIVER, [])) == 1,
                timeout=START_S,
                what="registered again",
            )
            statuses = [m[0] for m in notifier.messages[said:] if m[0].startswith("STATUS=")]
            assert any("our registration socket was removed" in m for m in statuses), statuses

            fake.claims[("default", "pod-hv-9x2lq")] = recorded("resourceclaim-allocated.json")
            # The kubelet's connection to the old server: it ends when that server has stopped.
            channel = kubelet.instance(DRIVER).channel
            ready = grpc.ChannelConnectivity.READY
            await until(lambda: channel.get_state(try_to_connect=True) == ready, what="the kubelet connected")
            left = asyncio.ensure_future(channel.wait_for_state_change(ready))
            os.unlink(registrar.service_socket)
            # Its old server stops (calls in flight get the grace, new ones on its connection are
            # refused); once the kubelet has seen its connection end, its next call dials the
            # socket anew and reaches the new one. (A call sent before the kubelet read that end
            # fails UNAVAILABLE, as a real kubelet's would, and the pod's setup is tried again.)
            await until(
                lambda: registrar.served_again == 2 and os.path.exists(registrar.service_socket),
                what="the service socket back, the old server gone",
            )
            await asyncio.wait_for(left, START_S)
            answer = await kubelet.prepare(DRIVER, [Claim("default", "pod-hv-9x2lq", UID)])
            assert list(answer[UID].devices[0].cdi_device_ids) == ["hyperlight.dev/hypervisor=kvm"]
            await until(lambda: agent.ready, timeout=START_S, what="ready with both sockets back")
        finally:
            await shut(agent)

    with_cluster(tmp, body)


# Issue 26, 17: a stop at any moment of the start leaves none of our private sockets behind.
@pytest.mark.parametrize("delay", [0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12])
def test_a_stop_during_the_start_leaves_nothing_behind(tmp: str, helpers: list[FakeHelper], delay: float) -> None:
    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        agent = Agent(settings_in(tmp, config), modes.DRA)
        await agent.start()
        await asyncio.sleep(delay)  # the moment of the stop is the variable here
        await shut(agent)
        registry, plugins = dirs(tmp)
        left = [
            os.path.join(d, n)
            for d in (registry, plugins, os.path.join(plugins, DRIVER))
            if os.path.isdir(d)
            for n in os.listdir(d)
            if n.endswith(".sock") or n.startswith(".hl-dra.")
        ]
        assert left == [], left

    with_cluster(tmp, body)


# Issue 30, 2: a close with a Prepare in flight ends within the agent's shutdown bound, with the
# service socket removed and the helper closed (the bound was a guess that cut the close short).
def test_a_stop_with_a_prepare_in_flight_ends_within_the_bound(tmp: str, helpers: list[FakeHelper]) -> None:
    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        agent = Agent(settings_in(tmp, config), modes.DRA)
        await agent.start()
        await until(lambda: agent.ready and bool(kubelet.instances.get(DRIVER)), timeout=START_S, what="ready")
        side = dra_side(agent)
        reading = asyncio.Event()

        class Hanging:
            async def allocation(self, namespace: str, name: str, uid: str) -> list[Any]:
                reading.set()
                await asyncio.Event().wait()  # an API server that never answers
                return []

        side.service.claims = Hanging()
        prepare = asyncio.ensure_future(kubelet.prepare(DRIVER, [Claim("default", "pod-hv-9x2lq", UID)]))
        await until(reading.is_set, what="the Prepare in flight")
        await waits.within(shut(agent), agent.shutdown_bound_s)
        assert not os.path.exists(side.registrar.service_socket), "the service socket went with the close"
        assert helpers[0].closed, "the helper was closed inside the bound"
        # The kubelet's call ends with the server (it asks the successor again).
        await asyncio.wait([prepare], timeout=5)
        assert prepare.done() and (prepare.cancelled() or prepare.exception() is not None)

    with_cluster(tmp, body)


def test_a_successor_that_never_becomes_ready_never_takes_the_slice(tmp: str, helpers: list[FakeHelper]) -> None:
    """Issue 35, 2: the newest instance kept the slice, so a next release whose device check fails
    published it with no device and its ready predecessor stepped aside: no device on the node for
    as long as the failing one ran. Now a serving instance outranks one that is not."""

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        old = Agent(settings_in(tmp, config), modes.DRA)
        empty = os.path.join(tmp, "no-device")
        os.makedirs(empty)
        new = Agent(dataclasses.replace(settings_in(tmp, config, instance="pod-b"), device_dir=empty), modes.DRA)
        await old.start()
        try:
            await until(lambda: old.ready and devices_published(fake) == 1, timeout=START_S, what="the old agent ready")
            since = len(fake.events)
            await new.start()

            def decided() -> bool:
                publisher = dra_side(new).slices.publisher
                return devices_published(fake) == 0 or (publisher is not None and publisher.standing.kept_by == "pod-a")

            await until(decided, what="the failing successor leaving the slice to the old agent, or not")
            assert new.status().startswith("unhealthy: no hypervisor device"), new.status()
            await shut(new)
            assert [len(obj["spec"].get("devices") or []) for _, _, obj in fake.events[since:]] == []
            assert old.ready and devices_published(fake) == 1
            assert dra_side(old).slices.publisher is not None and dra_side(old).slices.publisher.standing.kept_by == ""
        finally:
            await shut(old)

    with_cluster(tmp, body)


def test_a_prepare_in_flight_as_the_agent_stops_is_answered_before_it_deregisters(
    tmp: str, helpers: list[FakeHelper], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling update on the 1.34 kubelet failed a pod so: the old instance stopped (its checker
    first) while a Prepare read its claim; the Prepare's fresh check was refused, the call was
    dropped, and the kubelet cancelled it as it deregistered us ("the client connection is
    closing"). Now the call is answered (from the last check) and only then are we deregistered.
    (The drain's bound, for a call never answered, is test_dra_registration's: here it is long, so
    that a loaded machine's slow answer does not race it.)"""
    monkeypatch.setattr(dra_registration, "CALLS_DRAIN_S", 60.0)
    monkeypatch.setattr(dra_side_module.DraSide, "close_bound_s", 90.0)

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        agent = Agent(settings_in(tmp, config), modes.DRA)
        await agent.start()
        await until(lambda: agent.ready and bool(kubelet.instances.get(DRIVER)), timeout=START_S, what="ready")
        side = dra_side(agent)
        reading, answer = asyncio.Event(), asyncio.Event()
        real = side.service.claims

        class Slow:
            async def allocation(self, namespace: str, name: str, uid: str) -> list[Any]:
                reading.set()
                await answer.wait()
                return list(await real.allocation(namespace, name, uid))

        fake.claims[("default", "pod-hv-9x2lq")] = recorded("resourceclaim-allocated.json")
        side.service.claims = Slow()
        prepare = asyncio.ensure_future(kubelet.prepare(DRIVER, [Claim("default", "pod-hv-9x2lq", UID)]))
        await until(reading.is_set, what="the Prepare reading its claim")
        stopping = asyncio.ensure_future(shut(agent))
        await until(lambda: not side.registrar.serving, what="the close begun")
        assert os.path.lexists(side.registrar.registration_socket), "deregistered with a call in flight"
        answer.set()
        entry = (await prepare)[UID]
        assert not entry.error and [d.device_name for d in entry.devices] == ["kvm-3"], entry
        await stopping
        assert not os.path.lexists(side.registrar.registration_socket)

    with_cluster(tmp, body)


def test_a_prepare_on_its_way_to_the_old_agent_is_answered_before_it_deregisters(
    tmp: str, helpers: list[FakeHelper], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35, 13 (DRA): the kubelet picked the old instance for a claim, then the successor
    became the newest; the call reached the old agent after it had found its successor, and its
    deregistration closed the kubelet's connection ("the client connection is closing": the pod
    waited for the kubelet's retry, over a minute)."""
    found = asyncio.Event()
    until_quiet = getattr(transport, "until_quiet", None)  # (none before issue 35)

    async def noted(*args: Any, **kw: Any) -> str:
        found.set()
        assert until_quiet is not None
        return str(await until_quiet(*args, **kw))

    monkeypatch.setattr(transport, "until_quiet", noted, raising=False)

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        old = Agent(settings_in(tmp, config, handover_seconds=30), modes.DRA)
        new = Agent(settings_in(tmp, config, instance="pod-b"), modes.DRA)
        await old.start()
        picked: list[Instance] = []
        deregistered = asyncio.Event()

        async def slow_kubelet(instance: Instance) -> None:
            picked.append(instance)
            waiting = [asyncio.ensure_future(found.wait()), asyncio.ensure_future(deregistered.wait())]
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in waiting:
                task.cancel()

        stopping: Optional[asyncio.Future[None]] = None
        try:
            # Ready is ours to say; the kubelet calls only an instance its watcher has registered.
            await until(
                lambda: old.ready and bool(kubelet.instances.get(DRIVER)),
                timeout=START_S,
                what="the old agent registered",
            )
            fake.claims[("default", "pod-hv-9x2lq")] = recorded("resourceclaim-allocated.json")
            kubelet.before_call = slow_kubelet
            call = asyncio.ensure_future(kubelet.prepare(DRIVER, [Claim("default", "pod-hv-9x2lq", UID)]))
            await until(lambda: picked, what="the kubelet picking the old instance")
            assert picked[0].endpoint == dra_side(old).registrar.service_socket
            kubelet.before_call = None
            await new.start()
            await until(lambda: new.ready, timeout=START_S, what="the successor ready")
            stopping = asyncio.ensure_future(shut(old))
            await until(lambda: found.is_set() or picked[0].closed, what="the handover under way, or over")
            if picked[0].closed:
                deregistered.set()
            answer = await waits.within(call, 10)
            assert list(answer[UID].devices[0].cdi_device_ids) == ["hyperlight.dev/hypervisor=kvm"]
        finally:
            await shut(new)
            await waits.within(stopping if stopping is not None else shut(old), 20)

    with_cluster(tmp, body)


# Issue 40, 4: after a reboot the kubelet prepares its pods' claims again, and the record on disk
# outlives the CDI spec (in /run): an entry of an earlier boot is no answer until a fresh check has
# written the spec.
def test_a_claim_recorded_before_a_reboot_is_checked_again_and_its_cdi_spec_written(
    tmp: str, helpers: list[FakeHelper], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hyperlight_agent.dra import prepared

    boot = ["boot-1"]
    monkeypatch.setattr(prepared, "read_boot_id", lambda path="": boot[0])
    spec = cdi.spec_path(os.path.join(tmp, "cdi"))
    claim = Claim("default", "pod-hv-9x2lq", UID)

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        fake.claims[("default", "pod-hv-9x2lq")] = recorded("resourceclaim-allocated.json")
        first = Agent(settings_in(tmp, config), modes.DRA)
        await first.start()
        try:
            await until(lambda: first.ready and bool(kubelet.instances.get(DRIVER)), timeout=START_S, what="ready")
            (device,) = (await kubelet.prepare(DRIVER, [claim]))[UID].devices
            assert dra_side(first).service.prepared.this_boot(UID)
        finally:
            await shut(first)

        # The reboot: /run's CDI spec gone, the record kept; the claim is not read from the API again.
        boot[0] = "boot-2"
        os.remove(spec)
        fake.claims.clear()
        second = Agent(settings_in(tmp, config, instance="pod-b"), modes.DRA)
        gate = asyncio.Event()
        helpers[-1].gate = gate  # no check finishes until the gate opens
        await second.start()
        try:
            await until(lambda: bool(kubelet.instances.get(DRIVER)), what="registered")
            record = dra_side(second).service.prepared
            assert record.get(UID) is not None and not record.this_boot(UID)
            answer = asyncio.ensure_future(kubelet.prepare(DRIVER, [claim]))
            await asyncio.sleep(0.2)
            assert not answer.done(), "answered from a record of an earlier boot, before any check"
            gate.set()
            (again,) = (await answer)[UID].devices
            assert not (await answer)[UID].error
            assert (again.device_name, list(again.cdi_device_ids)) == (
                device.device_name,
                ["hyperlight.dev/hypervisor=kvm"],
            )
            assert os.path.exists(spec), "the fresh check wrote the CDI spec before the answer"
            assert record.this_boot(UID) and [r.verb for r in fake.requests].count("get") == 1

            # In this boot the record answers at once again, with no check: every check waits on a
            # closed gate now. (A check the agent starts on its own meanwhile is no matter.)
            helpers[-1].gate = asyncio.Event()
            (once_more,) = (await waits.within(kubelet.prepare(DRIVER, [claim]), 5))[UID].devices
            assert once_more == again
        finally:
            for waiting in (helpers[-1].gate, gate):  # whatever check waits now goes on
                if waiting is not None:
                    waiting.set()
            await shut(second)

    with_cluster(tmp, body)
