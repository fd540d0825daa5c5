"""An unusable device's taint (dra/taints.py): NoSchedule at once, NoExecute only when opted in and
only after the device stayed unusable for the whole debounce; a shorter flap evicts nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hyperlight_agent import cli, config, modes
from hyperlight_agent.agent import Agent
from hyperlight_agent.config import ConfigError
from hyperlight_agent.device.helper import ProbeResult
from hyperlight_agent.device.observation import Cause, Observation
from hyperlight_agent.dra.taints import Escalation, Taint, taint_for
from standin.apiserver import FakeApiServer
from standin.dra_kubelet import DraKubeletStandin
from tests.conftest import until
from tests.fakes import FakeHelper, shut
from tests.test_dra_side import settings_in, with_cluster

pytestmark = pytest.mark.usefixtures("quick_deregistration")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_noschedule_at_once_and_noexecute_after_the_debounce_without_a_passing_check() -> None:
    clock = Clock()
    escalation = Escalation(60, clock)
    escalation.observe(True)
    assert escalation.effect() == "NoSchedule" and escalation.due_in() is None
    escalation.observe(False)
    assert escalation.effect() == "NoSchedule" and escalation.due_in() == 60
    clock.now += 59
    escalation.observe(False)  # another failed check: the count goes on
    assert escalation.effect() == "NoSchedule" and escalation.due_in() == 1
    clock.now += 1
    assert escalation.effect() == "NoExecute" and escalation.due_in() == 0


def test_a_flap_shorter_than_the_debounce_starts_the_count_again() -> None:
    clock = Clock()
    escalation = Escalation(60, clock)
    for _ in range(10):  # unusable 50 s, usable for one check, again and again: never evicts
        escalation.observe(False)
        clock.now += 50
        assert escalation.effect() == "NoSchedule"
        escalation.observe(True)
        assert escalation.due_in() is None
        clock.now += 1


def test_without_the_opt_in_a_taint_never_evicts() -> None:
    clock = Clock()
    escalation = Escalation(0, clock)
    escalation.observe(False)
    clock.now += 10**6
    assert escalation.effect() == "NoSchedule" and escalation.due_in() is None


def test_the_taint_says_why() -> None:
    for cause in (Cause.NO_DEVICE, Cause.PROBE, Cause.CDI):
        assert taint_for(Observation(False, "x", None, cause)) == Taint(cause.value, "NoSchedule")
    assert taint_for(Observation(False, "x", "kvm", Cause.NONE), "NoExecute") == Taint("unusable", "NoExecute")
    assert Taint("probe", "NoExecute").as_json() == {
        "key": "hyperlight.dev/unusable",
        "value": "probe",
        "effect": "NoExecute",
    }


@pytest.mark.parametrize(("value", "ok"), [("0", True), ("30", True), ("300.5", True), ("29", False), ("-1", False)])
def test_the_opt_in_is_0_or_at_least_a_check_interval(value: str, ok: bool) -> None:
    args = cli.build_parser().parse_args(["--dra-evict-after", value])
    if ok:
        assert config.load(args, {}, "/nonexistent/agent.toml").dra_evict_after_seconds == float(value)
    else:
        with pytest.raises(ConfigError, match=r"--dra-evict-after = .*: must be 0 \(never\) or a number of sec"):
            config.load(args, {}, "/nonexistent/agent.toml")


def effects(fake: FakeApiServer) -> list[str]:
    """The effect of our taint in every version of the slice the server kept, in order ("" none)."""
    seen: list[str] = []
    for _, _, obj in fake.events:
        devices = obj["spec"].get("devices") or []
        taints = [t["effect"] for t in (devices[0].get("taints", []) if devices else [])]
        effect = taints[0] if taints else ""
        if not seen or seen[-1] != effect:
            seen.append(effect)
    return seen


def test_an_opted_in_device_evicts_only_after_the_debounce(tmp: str, helpers: list[FakeHelper]) -> None:
    """On the agent: NoSchedule at once; a flap shorter than the debounce never reaches NoExecute;
    broken for longer, NoExecute about the debounce after it broke, without another check; recovery
    removes the taint."""
    debounce = 0.8

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        agent: Any = Agent(settings_in(tmp, config, dra_evict_after_seconds=debounce), modes.DRA)
        await agent.start()
        loop = asyncio.get_running_loop()
        try:
            await until(lambda: agent.ready, what="ready")
            # A flap: broken, then well within the debounce usable again.
            helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
            agent.checker.request()
            await until(lambda: effects(fake)[-1:] == ["NoSchedule"], timeout=1, what="NoSchedule at once")
            helpers[0].answers.clear()
            agent.checker.request()
            await until(lambda: effects(fake)[-1:] == [""], timeout=1, what="the taint gone")
            await asyncio.sleep(debounce)  # past when the flap's NoExecute would have come
            assert "NoExecute" not in effects(fake), effects(fake)

            broke = loop.time()
            checks = len(helpers[0].requests)
            helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
            agent.checker.request()
            await until(lambda: effects(fake)[-1:] == ["NoExecute"], timeout=5, what="NoExecute")
            assert loop.time() - broke >= debounce
            assert len(helpers[0].requests) == checks + 1, "escalated by its own timer, not by a check"
            helpers[0].answers.clear()
            agent.checker.request()
            await until(lambda: effects(fake)[-1:] == [""], timeout=1, what="the taint gone on recovery")
            assert effects(fake) == ["", "NoSchedule", "", "NoSchedule", "NoExecute", ""], effects(fake)
        finally:
            await shut(agent)

    with_cluster(tmp, body)
