"""The DRA resource-health service (dra/health.py): what the kubelet would write into a running
pod's allocatedResourcesStatus, with the DRA stand-in opening the streams as the 1.37 kubelet does
(standin/dra_kubelet.py), and the fallback on a kubelet that opens none."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Optional

import pytest

from hyperlight_agent import contracts, modes
from hyperlight_agent.agent import Agent
from hyperlight_agent.device.helper import ProbeResult
from hyperlight_agent.device.observation import Cause, Observation, SharedObservation
from hyperlight_agent.dra import api, health, prepared, prepared_format
from hyperlight_agent.dra import side as dra_side_module
from hyperlight_agent.dra.health import Health
from hyperlight_agent.dra.slice_keeper import device_info
from standin import dra_kubelet as standin_kubelet
from standin.apiserver import FakeApiServer
from standin.dra_kubelet import DraKubeletStandin
from tests.conftest import START_S, until
from tests.fakes import FakeHelper, dra_outcomes, dra_side, shut
from tests.fakes import wiring as fake_wiring
from tests.test_dra_side import DRIVER, dirs, settings_in, taints_published, with_cluster

pytestmark = pytest.mark.usefixtures("quick_deregistration")

NODE = "node1"


def kubelets_view(kubelet: DraKubeletStandin, device: str = "kvm") -> tuple[str, str]:
    return kubelet.health(DRIVER, NODE, device)


@pytest.mark.parametrize(
    ("known", "offer", "chosen"),
    [
        (standin_kubelet.KNOWN_HEALTH_SERVICES, True, contracts.DRA_HEALTH_V1),  # 1.37
        ((contracts.DRA_HEALTH_V1ALPHA1,), False, contracts.DRA_HEALTH_V1ALPHA1),  # 1.36
    ],
)
def test_a_pods_device_health_follows_the_check_within_a_second(
    tmp: str,
    helpers: list[FakeHelper],
    caplog: pytest.LogCaptureFixture,
    known: tuple[str, ...],
    offer: bool,
    chosen: str,
) -> None:
    """Healthy once registered; Unhealthy with the check's reason within a second of the device
    failing; Healthy again on recovery: what `kubectl describe pod` shows of the claim."""

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        kubelet.known_health_services, kubelet.health_needs_offer = known, offer
        agent = Agent(settings_in(tmp, config), modes.DRA)
        await agent.start()
        try:
            await until(
                lambda: kubelets_view(kubelet) == ("Healthy", "") and DRIVER in kubelet.instances,
                timeout=START_S,  # the start, as every test's: 10 s ran out beside a cold build
                what="registered, and the kubelet hears Healthy",
            )
            (instance,) = kubelet.instances[DRIVER]
            # The kubelet's own order: v1 before v1alpha1, whatever the order offered.
            assert instance.health_service == chosen and instance.health_streams == 1
            assert dra_side(agent).health.streams == 1

            loop = asyncio.get_running_loop()
            broke = loop.time()
            helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed: ENOMEM")
            agent.checker.request()  # what an inotify event on the device node does
            await until(lambda: kubelets_view(kubelet)[0] == "Unhealthy", timeout=1, what="Unhealthy within 1 s")
            delay = loop.time() - broke
            assert "KVM_CREATE_VM failed: ENOMEM" in kubelets_view(kubelet)[1]
            print(f"\nfigure dra_health_unhealthy_in_pod_status_s: {delay:.3f}")

            helpers[0].answers.clear()
            agent.checker.request()
            await until(lambda: kubelets_view(kubelet) == ("Healthy", ""), timeout=1, what="Healthy again")
            changes = [h for _, d, k, h in kubelet.health_changes if (d, k) == (DRIVER, f"{NODE}/kvm")]
            assert changes == ["Healthy", "Unhealthy", "Healthy"], changes
        finally:
            await shut(agent)
        assert not any("opened no resource-health stream" in r.message for r in caplog.records)

    with_cluster(tmp, body)


def test_a_missing_device_reads_unhealthy_under_the_name_it_had(tmp: str, helpers: list[FakeHelper]) -> None:
    """The device node vanishes: its devices stay known to the kubelet as Unhealthy (and tainted
    in the slice), not dropped to Unknown."""

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        settings = settings_in(tmp, config)
        agent = Agent(settings, modes.DRA)
        await agent.start()
        try:
            await until(lambda: kubelets_view(kubelet) == ("Healthy", ""), what="Healthy")
            os.remove(os.path.join(settings.device_dir, "kvm"))
            agent.checker.request()
            await until(lambda: kubelets_view(kubelet)[0] == "Unhealthy", timeout=2, what="Unhealthy")
            assert "kvm" in kubelets_view(kubelet)[1], kubelets_view(kubelet)
            # (the health stream says Unhealthy on its own: the slice may not be published yet)
            await until(
                lambda: [t.get("value") for t in taints_published(fake)] == ["no-device"],
                what="the taint says no-device",
            )
        finally:
            await shut(agent)

    with_cluster(tmp, body)


def test_unknown_until_the_first_check_finishes(tmp: str, helpers: list[FakeHelper]) -> None:
    """A claim prepared before this agent started (its record on disk) reads Unknown while no
    check has finished, then Healthy."""

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        settings = settings_in(tmp, config)
        _, plugins = dirs(tmp)
        record = prepared.Prepared(os.path.join(plugins, DRIVER))
        claim = prepared_format.PreparedClaim(
            "default",
            "pod-hv",
            (prepared_format.PreparedDevice("hv", NODE, "kvm", ("hyperlight.dev/hypervisor=kvm",)),),
        )
        await record.record("uid-1", claim)
        agent = Agent(settings, modes.DRA)
        gate = asyncio.Event()
        helpers[0].gate = gate
        await agent.start()
        try:
            # Reported as Unknown with why (a device never reported reads Unknown with no message).
            await until(
                lambda: kubelets_view(kubelet) == ("Unknown", "no device check has completed yet"),
                what="Unknown, said by the driver",
            )
            assert dra_side(agent).health.reports > 0 and not helpers[0].requests[1:]
            gate.set()
            await until(lambda: kubelets_view(kubelet) == ("Healthy", ""), what="Healthy after the first check")
        finally:
            gate.set()
            await shut(agent)

    with_cluster(tmp, body)


def test_a_kubelet_without_the_health_stream_gets_todays_behaviour_and_one_line(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ResourceHealthStatus off (or a kubelet before 1.36): no stream is opened; the agent registers
    and becomes ready as before, and says once why pods' status shows no health (not again when it
    registers again)."""
    monkeypatch.setattr(health, "STREAM_WAIT_S", 0.3)
    caplog.set_level(logging.INFO)

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        kubelet.resource_health = False
        agent = Agent(settings_in(tmp, config), modes.DRA)
        await agent.start()
        try:
            await until(lambda: agent.ready, timeout=START_S, what="ready without a health stream")
            await until(
                lambda: len([r for r in caplog.records if "opened no resource-health stream" in r.message]) == 1,
                what="the line",
            )
            # Registered again (our registration socket replaced): not said again.
            os.remove(dra_side(agent).registrar.registration_socket)
            await until(lambda: dra_side(agent).registrar.served_again == 1 and agent.ready, what="registered again")
            await asyncio.sleep(0.5)  # longer than the wait: a second line would be there now
            said = [r.message for r in caplog.records if "opened no resource-health stream" in r.message]
            assert len(said) == 1 and "ResourceHealthStatus" in said[0], said
            assert dra_side(agent).health.opened == 0
        finally:
            await shut(agent)

    with_cluster(tmp, body)


def test_another_instances_end_forgets_the_drivers_health_and_ours_puts_it_back(
    tmp: str, helpers: list[FakeHelper], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling update: two instances, each with the kubelet's stream. The old one stops; the
    kubelet forgets the whole driver's health as its stream ends; the new one, woken by the old
    one's registration socket going, reports again."""
    monkeypatch.setattr(health, "PEER_SETTLE_S", 0.3)

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        old: Any = Agent(settings_in(tmp, config, instance="pod-a"), modes.DRA)
        await old.start()
        new = None
        try:
            await until(lambda: kubelets_view(kubelet) == ("Healthy", ""), what="Healthy")
            new = Agent(settings_in(tmp, config, instance="pod-b"), modes.DRA)
            await new.start()
            await until(lambda: dra_side(new).health.streams == 1, what="the new instance's stream")
            stopping, old = old, None
            since = asyncio.get_running_loop().time()
            await shut(stopping)

            # From the kubelet's records, not by looking at its view: the Unknown between lasts
            # PEER_SETTLE_S, which a busy machine's shut() can outlast.
            def put_back_after() -> Optional[float]:
                """Seconds from the driver's health last forgotten to its next Healthy report."""
                forgotten = [t for t, d in kubelet.health_forgotten if d == DRIVER and t >= since]
                if not forgotten:
                    return None
                healthy = (DRIVER, f"{NODE}/kvm", "Healthy")
                back = next(
                    (t for t, *change in kubelet.health_changes if tuple(change) == healthy and t > forgotten[-1]), None
                )
                return None if back is None else back - forgotten[-1]

            await until(lambda: put_back_after() is not None, what="the driver's health forgotten, then reported")
            delay = put_back_after()
            assert delay is not None and delay < 3 and kubelets_view(kubelet) == ("Healthy", "")
        finally:
            for agent in (old, new):
                if agent is not None:
                    await shut(agent)

    with_cluster(tmp, body)


async def test_reports_come_within_the_timeout_so_the_kubelet_never_drops_to_unknown() -> None:
    """Nothing changes, yet each device is reported again well within the timeout it was given
    (the kubelet reads a device as Unknown after it). Here the timeout is 40 resends (the
    agent's is 3): a loaded machine's late wake-up (0.36 s seen beside a cold build, for a 0.1 s
    resend) stays within it, and only a report left out would not."""
    observation = SharedObservation()
    observation.publish(Observation(True, "", "kvm"))
    subject = Health(observation, lambda: ["kvm"], lambda: NODE, resend_s=0.05, timeout_s=2.0)
    closed = asyncio.Event()
    messages = api.HEALTH_VERSIONS[contracts.DRA_HEALTH_V1]
    loop = asyncio.get_running_loop()
    stream = subject.watch(messages, closed)
    times = []
    async for report in stream:
        times.append(loop.time())
        (device,) = report.devices
        assert device.health == messages.HEALTHY and device.health_check_timeout_seconds == 2
        if len(times) == 4:
            closed.set()
    assert len(times) == 4 and max(b - a for a, b in zip(times, times[1:])) < 2.0
    assert subject.streams == 0


def test_the_timeout_given_is_three_resends() -> None:
    assert health.TIMEOUT_S == 3 * health.RESEND_S
    assert health.TIMEOUT_S > contracts.DRA_HEALTH_DEFAULT_TIMEOUT_S


async def test_a_device_not_reported_within_its_timeout_reads_unknown_to_the_kubelet(tmp: str) -> None:
    """The stand-in's clock for a report: stamped on arrival, Unknown after the timeout."""
    registry, _ = dirs(tmp)
    async with DraKubeletStandin(registry) as kubelet:
        messages = api.HEALTH_VERSIONS[contracts.DRA_HEALTH_V1]
        report = messages.NodeWatchResourcesResponse()
        report.devices.add(
            device=messages.DeviceIdentifier(pool_name=NODE, device_name="kvm"),
            health=messages.UNHEALTHY,
            health_check_timeout_seconds=1,
            message="x" * 2000,
        )
        kubelet._reported(DRIVER, report)
        state, message = kubelet.health(DRIVER, NODE, "kvm")
        assert state == "Unhealthy" and len(message) == 1024 and message.endswith("...")
        await until(lambda: kubelet.health(DRIVER, NODE, "kvm") == ("Unknown", ""), timeout=3, what="Unknown")


def test_device_health_per_device() -> None:
    failed = Observation(False, "KVM_CREATE_VM failed", "kvm", Cause.PROBE)
    assert health.device_health(failed, True, "kvm-7") == ("UNHEALTHY", "KVM_CREATE_VM failed")
    assert health.device_health(failed, False, "kvm") == ("UNKNOWN", "no device check has completed yet")


async def test_a_device_of_a_recorded_claim_is_reported_too(tmp: str) -> None:
    """Devices the slice does not list (any more) but a prepared claim uses are reported: the
    kubelet shows only devices it is told of."""
    _, plugins = dirs(tmp)
    side: Any = dra_side_module.DraSide(
        dra_side_module.DraTarget(NODE, "pod-a", 4, None, *dirs(tmp), shared=False),
        fake_wiring(),
        dra_outcomes(),
    )
    assert side.health_devices() == []
    await side.service.prepared.record(
        "uid-1",
        prepared_format.PreparedClaim("ns", "c", (prepared_format.PreparedDevice("r", NODE, "mshv-9", ("x",)),)),
    )
    await side.service.prepared.record(
        "uid-2",
        prepared_format.PreparedClaim("ns", "d", (prepared_format.PreparedDevice("r", "other-node", "kvm-1", ("x",)),)),
    )
    assert side.health_devices() == ["mshv-9"]
    side.slices.device = device_info(Observation(False, "failed", "kvm"))
    assert side.health_devices() == ["kvm-0", "kvm-1", "kvm-2", "kvm-3", "mshv-9"]
    assert os.path.isdir(os.path.join(plugins, DRIVER))
