"""The agent built in-process, on the test's own event loop, against the kubelet stand-in:
status lines, readiness transitions and sd_notify messages observed directly, not from logs.

Most tests here run in the fast loop: a fake probe helper answers and regular files stand for
device nodes (tests/fakes.py). test_status_and_readiness_through_a_lifecycle uses a real node
(mknod, the `root` marker by its fixture) and the real helper."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from typing import Any, Awaitable, Callable, Optional

import pytest
from grpc_health.v1 import health_pb2

from hyperlight_agent import config, contracts, identity, modes, waits
from hyperlight_agent.agent import Agent
from hyperlight_agent.config import Settings
from hyperlight_agent.device.checker import Checker
from hyperlight_agent.device.helper import ProbeResult
from hyperlight_agent.device.observation import Observation
from hyperlight_agent.deviceplugin.plugin_server import AlreadyServed
from hyperlight_agent.deviceplugin.registration import Registrar
from hyperlight_agent.deviceplugin.registration_state import State
from hyperlight_agent.deviceplugin.side import DevicePluginSnapshot
from hyperlight_agent.files import cdi, labels
from standin.kubelet import KubeletStandin
from tests.conftest import START_S, read_bytes, until
from tests.fakes import VERSION_SUFFIX, FakeHelper, RecordingNotifier, device_dir, dp_side, shut

R = contracts.RESOURCE_HYPERVISOR


def serving(agent: Agent, service: str) -> Optional[int]:
    status = agent.face.health_service._server_status.get(service)  # the value the exec probes read
    return int(status) if status is not None else None


async def test_status_and_readiness_through_a_lifecycle(tmp: str, kvm_dir: str) -> None:
    kubelet_dir = os.path.join(tmp, "kubelet")

    notifier = RecordingNotifier()
    settings = Settings.defaults(
        kubelet_dir=kubelet_dir, cdi_dir=os.path.join(tmp, "cdi"), device_dir=kvm_dir, device_count=3
    )
    agent = Agent(settings, notifier=notifier)
    await agent.start()
    try:
        # No kubelet yet: live, not ready, and the status says what it waits for.
        await until(lambda: agent.status().startswith("waiting for kubelet at "), what="waiting")
        assert not agent.ready
        assert serving(agent, contracts.HEALTH_SERVICES["liveness"]) == health_pb2.HealthCheckResponse.SERVING
        assert serving(agent, "") == health_pb2.HealthCheckResponse.NOT_SERVING

        kubelet = KubeletStandin(kubelet_dir)
        await kubelet.start()
        await until(lambda: agent.ready, timeout=START_S, what="ready")
        assert agent.status() == "ready: kvm, 3 slots, 1 stream"
        # The health service is set by a task the change schedules: it follows within the loop.
        await until(lambda: serving(agent, "") == health_pb2.HealthCheckResponse.SERVING, what="SERVING")
        assert ("READY=1", "STATUS=ready: kvm, 3 slots, 1 stream" + VERSION_SUFFIX) in notifier.messages

        # The kubelet ends the stream: not ready, the status says why, then ready again (the
        # first loss registers again at once, so "lost" is seen in what was said).
        said = len(notifier.messages)
        await kubelet.drop_stream(R)
        await until(
            lambda: len(kubelet.register_calls) == 2 and agent.ready and kubelet.allocatable() == 3,
            what="registered again",
        )
        lost = [m for m in notifier.messages[said:] if m[0].startswith("STATUS=")]
        assert ("STATUS=the kubelet's ListAndWatch stream ended; registering again" + VERSION_SUFFIX,) in lost, lost
        assert len(kubelet.register_calls) == 2
        ready = ("READY=1", "STATUS=ready: kvm, 3 slots, 1 stream" + VERSION_SUFFIX)
        assert sum(m == ready for m in notifier.messages) == 1, "READY=1 is sent once"

        # An unusable device: not ready, live; the reason is the status.
        node = os.path.join(kvm_dir, "kvm")
        os.unlink(node)
        os.mknod(node, 0o600 | 0o020000, os.makedev(1, 3))
        await until(lambda: agent.status().startswith("unhealthy: "), what="unhealthy")
        assert "KVM_GET_API_VERSION failed" in agent.status()
        await until(lambda: serving(agent, "") == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
    finally:
        agent.stop()
        await agent.wait()
        await agent.close()
        await kubelet.stop()
    # STOPPING=1 is the last thing said.
    assert notifier.messages[-1] == ("STOPPING=1", "STATUS=stopping")
    assert not os.path.exists(os.path.join(kubelet_dir, contracts.PLUGIN_SOCKET))


Snap = DevicePluginSnapshot


def test_status_lines_are_pure_functions_of_state() -> None:
    ok = Observation(True, "", "kvm")
    base = Snap(ok, True, State.STREAMED, "", "/k/kubelet.sock", 2, 1)
    cases = {
        base: "ready: kvm, 1 slot, 2 streams",
        Snap(
            ok, True, State.REGISTERED, "", "/k/kubelet.sock", 0, 4
        ): "registered; waiting for the kubelet's ListAndWatch stream",
        Snap(
            ok, False, State.WAITING, "Register with /k/kubelet.sock: UNAVAILABLE: x", "/k/kubelet.sock", 0, 4
        ): "waiting for kubelet at /k/kubelet.sock: Register with /k/kubelet.sock: UNAVAILABLE: x",
        Snap(ok, False, State.STREAMED, "", "/k/kubelet.sock", 1, 4): "checking the device",
        Snap(Observation(False, "gone", None), True, State.STREAMED, "", "/k", 1, 4): "unhealthy: gone",
        Snap(
            ok, True, State.LOST, "no ListAndWatch stream within 3 s of registering", "/k", 0, 4
        ): "no ListAndWatch stream within 3 s of registering; registering again",
    }
    for snapshot, text in cases.items():
        assert snapshot.status() == text
        assert snapshot.ready() == text.startswith("ready:")


def test_nothing_is_said_after_stopping_when_the_first_check_ends_during_the_stop(
    tmp: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGTERM early in startup: the first check is cancelled before the registrar stops, so no
    "device healthy" or "CDI spec written" follows "stopping" (issue 19, item 8)."""
    gate: list[asyncio.Event] = []

    async def first_check(self: Checker) -> tuple[Observation, bool]:
        await gate[0].wait()
        log = logging.getLogger("hyperlight_agent.device.checker")
        log.info("CDI spec written (the check ran on)")
        return Observation(True, "", "kvm"), False

    real_stop = Registrar.stop

    async def stop(self: Registrar, grace: float = 1.0) -> None:
        gate[0].set()  # the first check completes while the registrar stops...
        for _ in range(3):
            await asyncio.sleep(0)  # ...given every chance to run on
        await real_stop(self, grace)

    monkeypatch.setattr(Checker, "_check_once", first_check)
    monkeypatch.setattr(Registrar, "stop", stop)
    caplog.set_level("INFO")

    async def run() -> None:
        gate.append(asyncio.Event())
        settings = Settings.defaults(
            kubelet_dir=os.path.join(tmp, "kubelet"), cdi_dir=os.path.join(tmp, "cdi"), device_dir=tmp, device_count=1
        )
        agent = Agent(settings, notifier=RecordingNotifier())
        await agent.start()
        agent.stop()
        await agent.wait()
        await agent.close()

    asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("hyperlight_agent")]
    assert "stopping" in messages
    assert messages[messages.index("stopping") + 1 :] == []


# --- the fast loop: a fake helper, a regular file for the node --------------------------------


def settings_in(tmp: str, **kw: Any) -> Settings:
    return Settings.defaults(
        kubelet_dir=os.path.join(tmp, "kubelet"),
        cdi_dir=os.path.join(tmp, "cdi"),
        device_dir=device_dir(tmp, "kvm"),
        device_count=3,
        **kw,
    )


def with_kubelet(tmp: str, body: Callable[[KubeletStandin], Awaitable[None]]) -> None:
    async def main() -> None:
        kubelet = KubeletStandin(os.path.join(tmp, "kubelet"))
        await kubelet.start()
        try:
            await body(kubelet)
        finally:
            await kubelet.stop()

    asyncio.run(main())


def test_start_register_allocate_unhealthy_and_stop_in_process(tmp: str, helpers: list[FakeHelper]) -> None:
    async def body(kubelet: KubeletStandin) -> None:
        notifier = RecordingNotifier()
        agent = Agent(settings_in(tmp), notifier=notifier)
        await agent.start()
        try:
            await until(
                lambda: agent.ready and kubelet.allocatable() == 3, timeout=START_S, what="ready with 3 healthy slots"
            )
            assert agent.status() == "ready: kvm, 3 slots, 1 stream"
            assert read_bytes(cdi.spec_path(os.path.join(tmp, "cdi"))) == cdi.render("kvm", "/dev/kvm", 65534, 65534)
            response = await kubelet.allocate(R, ["kvm-2"])
            assert [d.name for d in response.container_responses[0].cdi_devices] == ["hyperlight.dev/hypervisor=kvm"]
            await until(lambda: serving(agent, "") == health_pb2.HealthCheckResponse.SERVING, what="SERVING")

            # The device fails its check: the slots follow, readiness and the health service too.
            helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
            agent.checker.request()
            await until(lambda: kubelet.allocatable() == 0 and kubelet.plugins[R].devices, what="unhealthy slots")
            assert agent.status() == "unhealthy: KVM_CREATE_VM failed" and not agent.ready
            await until(lambda: serving(agent, "") == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
            helpers[0].answers.clear()
            agent.checker.request()
            await until(lambda: agent.ready and kubelet.allocatable() == 3, timeout=START_S, what="recovered")
        finally:
            await shut(agent)
        assert helpers[0].closed
        assert notifier.messages[-1] == ("STOPPING=1", "STATUS=stopping")
        assert sum(m[0] == "READY=1" for m in notifier.messages) == 1
        assert not os.path.exists(os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET))
        assert os.path.exists(cdi.spec_path(os.path.join(tmp, "cdi"))), "the spec stays"
        await until(lambda: not kubelet.plugins[R].stream_open, what="the kubelet's stream to end")

    with_kubelet(tmp, body)


# Issue 40, 2: what a running pod holding a slot shows in its allocatedResourcesStatus (1.36+)
# follows the device: Unhealthy when its check fails or the device vanishes, Healthy again after.
def test_a_running_pods_slot_health_follows_the_device_also_when_it_vanishes(
    tmp: str, helpers: list[FakeHelper]
) -> None:
    async def body(kubelet: KubeletStandin) -> None:
        settings = settings_in(tmp)
        agent = Agent(settings)
        await agent.start()
        try:
            await until(lambda: agent.ready and kubelet.allocatable() == 3, timeout=START_S, what="ready")
            await kubelet.allocate(R, ["kvm-2"])  # the pod's container holds kvm-2
            assert kubelet.allocated_health(R, "kvm-2") == "Healthy"
            helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
            agent.checker.request()
            await until(lambda: kubelet.allocated_health(R, "kvm-2") == "Unhealthy", what="Unhealthy")
            helpers[0].answers.clear()
            agent.checker.request()
            await until(lambda: kubelet.allocated_health(R, "kvm-2") == "Healthy", what="Healthy again")
            # The device node vanishes: an ID no list names would read Healthy to the kubelet.
            node = os.path.join(settings.device_dir, "kvm")
            os.remove(node)
            agent.checker.request()
            await until(lambda: kubelet.allocatable() == 0, what="nothing allocatable")
            assert kubelet.allocated_health(R, "kvm-2") == "Unhealthy", kubelet.listed[R]
            with open(node, "w"):
                pass
            agent.checker.request()
            await until(lambda: kubelet.allocated_health(R, "kvm-2") == "Healthy" and agent.ready, what="back")
        finally:
            await shut(agent)

    with_kubelet(tmp, body)


def test_run_returns_after_stop_and_close_twice_is_harmless(tmp: str, helpers: list[FakeHelper]) -> None:
    async def body(kubelet: KubeletStandin) -> None:
        agent = Agent(settings_in(tmp), notifier=RecordingNotifier())
        running = asyncio.ensure_future(agent.run())
        await until(lambda: agent.ready, timeout=START_S, what="ready")
        agent.stop()
        await running
        await agent.close()
        assert not os.path.exists(os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET))

    with_kubelet(tmp, body)


def test_a_second_agent_on_the_same_socket_fails_from_wait(tmp: str, helpers: list[FakeHelper]) -> None:
    async def body(kubelet: KubeletStandin) -> None:
        first = Agent(settings_in(tmp), notifier=RecordingNotifier())
        await first.start()
        second = Agent(settings_in(tmp), notifier=RecordingNotifier())
        try:
            await until(lambda: first.ready, timeout=START_S, what="the first agent ready")
            await second.start()
            with pytest.raises(AlreadyServed, match="another agent is serving it"):
                await second.wait()
            await second.close()
            assert first.ready and os.path.exists(dp_side(first).registrar.socket_path), (
                "the first agent's socket stays"
            )
        finally:
            await shut(first)

    with_kubelet(tmp, body)


def test_reload_applies_settings_keeps_restart_only_ones_and_refuses_invalid_files(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hyperlight_agent")
    base = settings_in(tmp)
    new: list[Any] = []
    reading = threading.Event()  # set by a read in progress (the file is read in a thread)
    gate = threading.Event()  # a read given as (gate, settings) waits for it

    def reload() -> Settings:
        item = new.pop(0)
        reading.set()
        if isinstance(item, tuple):
            assert item[0].wait(10)
            item = item[1]
        if isinstance(item, Exception):
            raise item
        return item  # type: ignore[no-any-return]

    async def body(kubelet: KubeletStandin) -> None:
        notifier = RecordingNotifier()
        agent = Agent(base, notifier=notifier, reload=reload)
        await agent.start()
        try:
            await until(lambda: agent.ready and kubelet.allocatable() == 3, timeout=START_S, what="ready")
            # More slots and another owner apply at once; a new kubelet_dir only on restart.
            new.append(
                Settings.defaults(
                    **{
                        **base.__dict__,
                        "device_count": 5,
                        "device_uid": 1000,
                        "kubelet_dir": os.path.join(tmp, "elsewhere"),
                        "check_interval_seconds": 60.0,
                    }
                )
            )
            agent.reload()
            await until(lambda: kubelet.allocatable() == 5, what="5 slots after the reload")
            await until(
                lambda: b'"uid": 1000' in (read_bytes(cdi.spec_path(base.cdi_dir)) or b""),
                what="the spec following the new uid",
            )
            assert agent.settings.kubelet_dir == base.kubelet_dir
            assert agent.settings.check_interval_seconds == 60.0
            assert "reload: kubelet_dir change only on restart; kept" in caplog.text
            # What changed is said (issue 36: 5), the kept setting not among it.
            assert (
                "reload: device_count 3 → 5; device_uid 65534 → 1000; check_interval_seconds 30 → 60.0" in caplog.text
            )
            assert ("RELOADING=1", "STATUS=reloading configuration") in notifier.messages
            await until(lambda: notifier.messages[-1][0] == "READY=1", what="READY=1 after the reload")

            # An invalid file: refused, the running settings stay, systemd hears why.
            new.append(config.ConfigError("device_count: 'x' is not a number"))
            agent.reload()
            await until(lambda: any("reload failed" in s for s in notifier.statuses), what="the refusal")
            assert {s for s in notifier.statuses if "reload failed" in s} == {
                "reload failed, kept running configuration: device_count: 'x' is not a number"
            }
            assert agent.settings.device_count == 5
            await until(lambda: not agent.reloader.busy, what="the reload to end")
            # A reload asked for while a read is in progress reads the file once more after it.
            new.extend(
                [
                    (gate, Settings.defaults(**{**base.__dict__, "device_count": 4})),
                    Settings.defaults(**{**base.__dict__, "device_count": 2}),
                ]
            )
            reading.clear()
            agent.reload()
            await until(reading.is_set, what="the first read to begin")
            agent.reload()
            gate.set()
            await until(lambda: kubelet.allocatable() == 2 and not new, what="both reads applied")
        finally:
            await shut(agent)
        agent.reload()  # after the stop: nothing starts
        assert not agent.reloader.busy

    with_kubelet(tmp, body)


def get(address: str, path: str) -> tuple[int, str]:
    """An HTTP GET as the kubelet's httpGet probe sends it: (status, body)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_http_probes_answer_from_the_agents_state_on_one_port_with_metrics(tmp: str, helpers: list[FakeHelper]) -> None:
    """/livez, /readyz and /healthz answered by the agent itself (no process per probe, issue 36:
    2), saying what the gRPC health service says; metrics on the same port when the addresses are
    the same; / lists the paths."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"

    async def body(kubelet: KubeletStandin) -> None:
        agent = Agent(settings_in(tmp, probe_address=address, metrics_address=address), notifier=RecordingNotifier())
        await agent.start()
        try:
            await until(lambda: agent.face.http_servers[0].listening, what="the probe port")
            assert len(agent.face.http_servers) == 1

            async def ask(path: str) -> tuple[int, str]:
                return await waits.in_thread(lambda: get(address, path), "probe")

            await until(lambda: agent.ready, timeout=START_S, what="ready")
            await until(lambda: serving(agent, "") == health_pb2.HealthCheckResponse.SERVING, what="SERVING")
            assert await ask("/readyz") == (200, "ready: kvm, 3 slots, 1 stream\n")
            assert await ask("/livez") == await ask("/healthz") == (200, "live: serving\n")
            assert await ask("/") == (200, "/healthz\n/livez\n/metrics\n/readyz\n")
            code, text = await ask("/metrics")
            assert code == 200 and "hyperlight_advertised_slots 3.0" in text
            helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
            agent.checker.request()
            await until(lambda: serving(agent, "") == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
            assert await ask("/readyz") == (503, "not ready: unhealthy: KVM_CREATE_VM failed\n")
            assert (await ask("/livez"))[0] == 200
            assert "hyperlight_advertised_slots 0.0" in (await ask("/metrics"))[1]
        finally:
            await shut(agent)

    with_kubelet(tmp, body)


async def test_periodic_checks_follow_the_interval(tmp: str, helpers: list[FakeHelper]) -> None:
    agent = Agent(settings_in(tmp, check_interval_seconds=0.01), notifier=RecordingNotifier())
    await agent.start()
    try:
        await until(lambda: agent.checker.completed >= 3, what="periodic checks")
    finally:
        await shut(agent)


async def test_the_watchdog_pings_and_extends_the_start_timeout_until_ready(
    tmp: str, helpers: list[FakeHelper]
) -> None:
    notifier = RecordingNotifier(watchdog_interval=0.01)
    agent = Agent(settings_in(tmp), notifier=notifier)
    await agent.start()
    try:
        await until(lambda: sum(m[0] == "WATCHDOG=1" for m in notifier.messages) >= 2, what="pings")
        assert ("WATCHDOG=1", "EXTEND_TIMEOUT_USEC=40000") in notifier.messages, "not ready: no kubelet"
        assert not agent.ready
    finally:
        await shut(agent)


async def test_node_labels_follow_the_device_and_are_repaired(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    features = os.path.join(tmp, "features.d")
    os.mkdir(features)
    path = os.path.join(features, labels.FEATURE_FILE)

    agent = Agent(settings_in(tmp, nfd_features_dir=features), notifier=RecordingNotifier())
    await agent.start()
    try:
        await until(lambda: read_bytes(path) == labels.render("kvm"), what="the feature file")
        os.unlink(path)
        await until(lambda: read_bytes(path) == labels.render("kvm"), what="the feature file repaired")
        # Not a regular file at our path: left alone, said once.
        os.unlink(path)
        os.mkdir(path)
        agent.checker.request()
        await until(lambda: "node labels not written" in caplog.text, what="the refusal")
        agent.checker.request()
        done = agent.checker.completed
        await until(lambda: agent.checker.completed > done, what="another check")
        assert caplog.text.count("node labels not written") == 1
        assert os.path.isdir(path)
    finally:
        await shut(agent)


def test_a_stop_with_handover_time_and_no_successor_stops_after_it(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(kubelet: KubeletStandin) -> None:
        agent = Agent(settings_in(tmp, handover_seconds=0.2), notifier=RecordingNotifier())
        await agent.start()
        await until(lambda: agent.ready, timeout=START_S, what="ready")
        await shut(agent)
        assert "serving until a successor is ready (up to 0.2 s; stop again to stop now)" in caplog.text
        assert "no successor within 0.2 s" in caplog.text
        assert dp_side(agent).registrar is not None
        assert not os.path.exists(dp_side(agent).registrar.socket_path)

    with_kubelet(tmp, body)


def test_an_unready_agent_hands_nothing_over(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    """A DaemonSet replaces an unavailable pod only once it is gone: waiting for a successor then
    would only hold the replacement back for handover_seconds."""
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(kubelet: KubeletStandin) -> None:
        agent = Agent(settings_in(tmp, handover_seconds=3600), notifier=RecordingNotifier())
        await agent.start()
        await until(lambda: bool(helpers), what="the helper")
        helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
        agent.checker.request()
        await until(lambda: agent.status().startswith("unhealthy"), what="unhealthy")
        await waits.within(shut(agent), 30)  # not the hour of handover_seconds
        assert "serving until a successor" not in caplog.text

    with_kubelet(tmp, body)


def test_device_access_mode_lists_its_one_slot_without_cdi(tmp: str, helpers: list[FakeHelper]) -> None:
    async def body(kubelet: KubeletStandin) -> None:
        agent = Agent(settings_in(tmp), modes.DEVICE_ACCESS, notifier=RecordingNotifier())
        await agent.start()
        try:
            resource = modes.of(True).resource
            await until(lambda: (p := kubelet.plugins.get(resource)) and p.devices, what="the access slot")
            assert dp_side(agent).profile.slots == modes.of(True).slots == len(kubelet.plugins[resource].devices)
            assert helpers[0].requests == [], "inventory only: never probed"
            # A regular file is no device node: inventory lstats it and says so.
            assert agent.status().endswith("host device node is a regular file, not a character device")
            assert not os.path.exists(os.path.join(tmp, "cdi"))
        finally:
            await shut(agent)

    with_kubelet(tmp, body)


async def test_the_environment_comes_from_the_caller(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    """What the image baked in (the commit) is read from the environ the entry point handed over."""
    caplog.set_level(logging.INFO, "hyperlight_agent")
    agent = Agent(settings_in(tmp), notifier=RecordingNotifier(), environ={contracts.COMMIT_ENV: "0123abc"})
    await agent.start()
    await shut(agent)
    assert "(commit 0123abc)" in caplog.text
    bare = Agent(settings_in(tmp), notifier=RecordingNotifier())
    await bare.start()
    await shut(bare)
    # Without it: the checkout's commit (issue 50: 9), or unknown where there is no git.
    assert f"(commit {identity.commit({})})" in caplog.text


# Issue 26, 10: two agents on one CDI directory with other settings (a surge update that changes
# device_uid): the newer one's spec stands, and the older one does not rewrite it.
def test_the_newest_instance_keeps_the_cdi_spec_and_the_older_does_not_fight(
    tmp: str, helpers: list[FakeHelper], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec_path = cdi.spec_path(os.path.join(tmp, "cdi"))
    writes: list[bytes] = []
    repair = cdi.repair

    def counted(plan: cdi.Plan) -> None:
        writes.append(plan.wanted)
        repair(plan)

    monkeypatch.setattr(cdi, "repair", counted)

    def uid_in_spec() -> Optional[int]:
        data = read_bytes(spec_path)
        return None if data is None else int(json.loads(data)["devices"][0]["containerEdits"]["deviceNodes"][0]["uid"])

    async def body(kubelet: KubeletStandin) -> None:
        old = Agent(settings_in(tmp, instance="old", device_uid=65534), notifier=RecordingNotifier())
        await old.start()
        new: Optional[Agent] = None
        try:
            await until(lambda: old.ready and uid_in_spec() == 65534, timeout=START_S, what="the old agent's spec")
            new = Agent(settings_in(tmp, instance="new", device_uid=1000), notifier=RecordingNotifier())
            await new.start()
            await until(lambda: new is not None and new.ready and uid_in_spec() == 1000, what="the new agent's spec")
            for _ in range(20):  # both look again, as their inotify events and timers would have them
                for agent in (old, new):
                    await agent.checker.check(timeout=5)
            assert uid_in_spec() == 1000 and len(writes) == 2, (uid_in_spec(), len(writes))
            assert old.ready and old.checker.kept_by == "new" and new.checker.kept_by == ""
            await shut(new)
            new = None
            await old.checker.check(timeout=5)
            assert uid_in_spec() == 65534 and old.checker.kept_by == "", "the newer one gone, the older keeps it"
        finally:
            await shut(old)
            if new is not None:
                await shut(new)

    with_kubelet(tmp, body)


def test_a_kubelet_restart_is_said_before_the_status_it_causes(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    """The cause first (issue 50: 9): `status: registered; waiting for the kubelet's ListAndWatch
    stream` came before `kubelet restart detected`, as if we had lost our stream for no reason."""
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(kubelet: KubeletStandin) -> None:
        agent = Agent(settings_in(tmp), notifier=RecordingNotifier())
        await agent.start()
        try:
            await until(lambda: agent.ready, timeout=START_S, what="ready")
            since = len(caplog.records)
            await kubelet.restart()
            await until(lambda: len(kubelet.register_calls) == 2 and agent.ready, what="registered again")
            said = [r.getMessage() for r in caplog.records[since:]]
            registered = next(i for i, line in enumerate(said) if line.startswith("registered hyperlight.dev/"))
            # The stream's end is said as what it is, not as a wait for a first stream. Which the
            # agent sees first, the stream's end (over gRPC) or its socket's removal (inotify), is
            # the machine's timing, as with a real kubelet: the first line is either cause.
            assert said[0] in (
                "status: the kubelet's ListAndWatch stream ended; registering again",
                "kubelet restart detected; serving and registering again",
            ), said
            assert "status: registered; waiting for the kubelet's ListAndWatch stream" not in said[:registered], said
            # The restart is named before the registration (and the status lines) it explains.
            assert any(line.startswith("kubelet restart detected") for line in said[:registered]), said
        finally:
            await shut(agent)

    with_kubelet(tmp, body)


def test_a_second_stop_ends_the_wait_for_a_successor_at_once(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    """A second SIGTERM (or Ctrl-C) cuts the handover short (issue 50: 9): with no successor
    coming (an uninstall) the first would wait all of handover_seconds."""
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(kubelet: KubeletStandin) -> None:
        agent = Agent(settings_in(tmp, handover_seconds=3600), notifier=RecordingNotifier())
        await agent.start()
        await until(lambda: agent.ready, timeout=START_S, what="ready")
        agent.stop()
        await agent.wait()
        closing = asyncio.ensure_future(agent.close())
        await until(lambda: "serving until a successor is ready" in caplog.text, what="the handover's wait")
        agent.stop()  # the second signal
        await waits.within(closing, 30)  # not the hour of handover_seconds
        assert "stopped again: not waiting for a successor" in caplog.text
        assert not os.path.exists(dp_side(agent).registrar.socket_path)

    with_kubelet(tmp, body)
