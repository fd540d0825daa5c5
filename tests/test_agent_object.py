"""The agent built in-process, on the test's own event loop, against the kubelet stand-in:
status lines, readiness transitions and sd_notify messages observed directly, not from logs."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Optional

import pytest
from grpc_health.v1 import health_pb2

from hyperlight_agent import contracts, modes, readiness
from hyperlight_agent.agent import Agent
from hyperlight_agent.config import Settings
from hyperlight_agent.device.checker import Checker
from hyperlight_agent.device.observation import Observation
from hyperlight_agent.deviceplugin import registration
from hyperlight_agent.deviceplugin.registration import Registrar
from hyperlight_agent.host.notify import Notifier
from standin.kubelet import KubeletStandin
from tests.conftest import until

# Real agents on real device nodes (mknod) and the host's /dev/kvm.
pytestmark = pytest.mark.root

R = contracts.RESOURCE_HYPERVISOR


class RecordingNotifier(Notifier):
    """sd_notify messages, kept instead of sent."""

    def __init__(self) -> None:
        super().__init__(environ={})
        self.messages: list[tuple[str, ...]] = []

    def send(self, *lines: str) -> None:
        self.messages.append(lines)

    @property
    def statuses(self) -> list[str]:
        return [line[len("STATUS="):] for m in self.messages for line in m if line.startswith("STATUS=")]



def healthy(kubelet: KubeletStandin) -> int:
    p = kubelet.plugins.get(R)
    return p.healthy if p else 0


def serving(agent: Agent, service: str) -> Optional[int]:
    status = agent.health_service._server_status.get(service)  # the value the exec probes read
    return int(status) if status is not None else None


def test_status_and_readiness_through_a_lifecycle(tmp: str, kvm_dir: str) -> None:
    kubelet_dir = os.path.join(tmp, "kubelet")

    async def run() -> None:
        notifier = RecordingNotifier()
        settings = Settings.defaults(kubelet_dir=kubelet_dir, cdi_dir=os.path.join(tmp, "cdi"),
                                     device_dir=kvm_dir, device_count=3)
        agent = Agent(settings, notifier=notifier)
        await agent.start()
        try:
            # No kubelet yet: live, not ready, and the status says what it waits for.
            await until(lambda: agent.status().startswith("waiting for kubelet at "), what="waiting")
            assert not agent.ready
            assert serving(agent, modes.HEALTH_SERVICES["liveness"]) == health_pb2.HealthCheckResponse.SERVING
            assert serving(agent, "") == health_pb2.HealthCheckResponse.NOT_SERVING

            kubelet = KubeletStandin(kubelet_dir)
            await kubelet.start()
            await until(lambda: agent.ready, what="ready")
            assert agent.status() == "ready: kvm, 3 slots, 1 stream"
            # The health service is set by a task the change schedules: it follows within the loop.
            await until(lambda: serving(agent, "") == health_pb2.HealthCheckResponse.SERVING, what="SERVING")
            assert ("READY=1", "STATUS=ready: kvm, 3 slots, 1 stream") in notifier.messages

            # The kubelet ends the stream: not ready, the status says why, then ready again (the
            # first loss registers again at once, so "lost" is seen in what was said).
            said = len(notifier.messages)
            await kubelet.drop_stream(R)
            await until(lambda: len(kubelet.register_calls) == 2 and agent.ready and healthy(kubelet) == 3,
                        what="registered again")
            lost = [m for m in notifier.messages[said:] if m[0].startswith("STATUS=")]
            assert ("STATUS=the kubelet's ListAndWatch stream ended; registering again",) in lost, lost
            assert len(kubelet.register_calls) == 2
            assert sum(m == ("READY=1", "STATUS=ready: kvm, 3 slots, 1 stream") for m in notifier.messages) == 1, \
                "READY=1 is sent once"

            # An unusable device: not ready, live; the reason is the status.
            node = os.path.join(kvm_dir, "kvm")
            os.unlink(node)
            os.mknod(node, 0o600 | 0o020000, os.makedev(1, 3))
            await until(lambda: agent.status().startswith("unhealthy: "), what="unhealthy")
            assert "KVM_GET_API_VERSION failed" in agent.status()
            await until(lambda: serving(agent, "") == health_pb2.HealthCheckResponse.NOT_SERVING,
                        what="NOT_SERVING")
        finally:
            agent.stop()
            await agent.wait()
            await agent.close()
            await kubelet.stop()
        # STOPPING=1 is the last thing said.
        assert notifier.messages[-1] == ("STOPPING=1", "STATUS=stopping")
        assert not os.path.exists(os.path.join(kubelet_dir, contracts.PLUGIN_SOCKET))

    asyncio.run(run())


def test_status_lines_are_pure_functions_of_state() -> None:
    ok = Observation(True, "", "kvm")
    base = readiness.Snapshot(ok, True, registration.STREAMED, "", "/k/kubelet.sock", 2, 1)
    cases = {
        base: "ready: kvm, 1 slot, 2 streams",
        readiness.Snapshot(ok, True, registration.REGISTERED, "", "/k/kubelet.sock", 0, 4):
            "registered; waiting for the kubelet's ListAndWatch stream",
        readiness.Snapshot(ok, False, registration.WAITING, "Register with /k/kubelet.sock: UNAVAILABLE: x",
                           "/k/kubelet.sock", 0, 4):
            "waiting for kubelet at /k/kubelet.sock: Register with /k/kubelet.sock: UNAVAILABLE: x",
        readiness.Snapshot(ok, False, registration.STREAMED, "", "/k/kubelet.sock", 1, 4): "checking the device",
        readiness.Snapshot(Observation(False, "gone", None), True, registration.STREAMED, "", "/k", 1, 4):
            "unhealthy: gone",
        readiness.Snapshot(ok, True, registration.LOST, "no ListAndWatch stream within 3 s of registering",
                           "/k", 0, 4): "no ListAndWatch stream within 3 s of registering; registering again",
    }
    for snapshot, text in cases.items():
        assert readiness.status(snapshot) == text
        assert readiness.ready(snapshot) == text.startswith("ready:")


def test_nothing_is_said_after_stopping_when_the_first_check_ends_during_the_stop(
        tmp: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
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
        settings = Settings.defaults(kubelet_dir=os.path.join(tmp, "kubelet"), cdi_dir=os.path.join(tmp, "cdi"),
                                     device_dir=tmp, device_count=1)
        agent = Agent(settings, notifier=RecordingNotifier())
        await agent.start()
        agent.stop()
        await agent.wait()
        await agent.close()

    asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("hyperlight_agent")]
    assert "stopping" in messages
    assert messages[messages.index("stopping") + 1:] == []
