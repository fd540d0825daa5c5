"""An unusable device's taint (dra/taints.py): NoSchedule at once, NoExecute only when opted in and
only after the device stayed unusable for the whole debounce; a shorter flap evicts nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hyperlight_agent import cli, config, modes
from hyperlight_agent.agent import Agent
from hyperlight_agent.config import EVICT_CHECKS, ConfigError
from hyperlight_agent.device.helper import ProbeRequest, ProbeResult
from hyperlight_agent.device.observation import Cause, Observation
from hyperlight_agent.dra.taints import Escalation, Taint, taint_for
from standin.apiserver import FakeApiServer
from standin.dra_kubelet import DraKubeletStandin
from tests.conftest import START_S, until
from tests.fakes import FakeHelper, shut
from tests.test_dra_side import settings_in, with_cluster

pytestmark = pytest.mark.usefixtures("quick_deregistration")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_noschedule_at_once_and_noexecute_only_when_a_check_a_whole_debounce_later_fails() -> None:
    clock = Clock()
    escalation = Escalation(60, clock)
    escalation.observe(True)
    assert escalation.effect() == "NoSchedule" and escalation.check_due_in() is None
    escalation.observe(False)  # seen at 100
    assert escalation.effect() == "NoSchedule" and escalation.check_due_in() == 20
    clock.now += 1000  # long past the debounce, and no check since: no eviction (issue 47, 2)
    assert escalation.effect() == "NoSchedule" and escalation.check_due_in() == 0
    escalation.observe(False)  # a failure seen, not known to have started within: no evidence
    assert escalation.effect() == "NoSchedule" and escalation.check_due_in() == 0
    escalation.observe(False, started=clock.now)
    assert escalation.effect() == "NoExecute" and escalation.check_due_in() is None


def test_while_an_eviction_is_pending_checks_are_due_every_third_of_the_debounce() -> None:
    """Three checks fall within the debounce, the last at its end; a check that started before
    the end does not evict, one started at or after it and failed does."""
    clock = Clock()
    escalation = Escalation(60, clock)
    escalation.observe(False)
    due: list[float] = []
    while escalation.effect() == "NoSchedule":
        wait = escalation.check_due_in()
        assert wait is not None and len(due) < 10
        clock.now += wait
        due.append(clock.now - 100)
        escalation.observe(False, started=clock.now)
    assert due == [20, 40, 60]
    escalation.observe(True)  # recovery: the count starts again
    clock.now += 1
    escalation.observe(False)
    clock.now += 59.5
    escalation.observe(False, started=clock.now)  # within the new debounce: no eviction yet
    assert escalation.effect() == "NoSchedule" and escalation.check_due_in() == 0.5


def test_a_check_that_concludes_nothing_is_no_evidence_and_the_next_waits_a_step() -> None:
    clock = Clock()
    escalation = Escalation(60, clock)
    escalation.observe(False)
    clock.now += 100
    escalation.inconclusive(clock.now)  # stuck, or the agent out of descriptors
    assert escalation.effect() == "NoSchedule" and escalation.check_due_in() == 20, "not at once again"
    clock.now += 20
    escalation.observe(False, started=clock.now)
    assert escalation.effect() == "NoExecute"


def test_a_flap_shorter_than_the_debounce_starts_the_count_again() -> None:
    clock = Clock()
    escalation = Escalation(60, clock)
    for _ in range(10):  # unusable 50 s, usable for one check, again and again: never evicts
        escalation.observe(False)
        clock.now += 50
        escalation.observe(False, started=clock.now)
        assert escalation.effect() == "NoSchedule"
        escalation.observe(True)
        assert escalation.check_due_in() is None
        clock.now += 1


def test_without_the_opt_in_a_taint_never_evicts() -> None:
    clock = Clock()
    escalation = Escalation(0, clock)
    escalation.observe(False)
    clock.now += 10**6
    escalation.observe(False, started=clock.now)
    assert escalation.effect() == "NoSchedule" and escalation.check_due_in() is None


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


# Issue 47, 2: `--check-interval 300 --dra-evict-after 30` was accepted, and 30 s after one failed
# check the taint turned NoExecute with no check run since. The debounce means "failing for that
# long, as seen by checks run within it": settings whose checks cannot fill it are refused.
@pytest.mark.parametrize(
    ("interval", "evict", "ok"),
    [("300", "30", False), ("100.5", "30", False), ("100", "30", True), ("3000", "900", True), ("3000", "0", True)],
)
def test_an_eviction_debounce_its_checks_cannot_fill_is_refused(interval: str, evict: str, ok: bool) -> None:
    args = cli.build_parser().parse_args(["--check-interval", interval, "--dra-evict-after", evict])
    if ok:
        settings = config.load(args, {}, "/nonexistent/agent.toml")
        assert (settings.check_interval_seconds, settings.dra_evict_after_seconds) == (float(interval), float(evict))
        return
    with pytest.raises(ConfigError) as refused:
        config.load(args, {}, "/nonexistent/agent.toml")
    assert str(refused.value) == (
        f"dra_evict_after_seconds = {evict} with check_interval_seconds = {interval}: an eviction waits for "
        f"{config.EVICT_CHECKS} failed checks within its {evict} s, and checks run at most "
        f"{config.EVICT_CHECK_SPEEDUP} times as often as the interval; use check_interval_seconds at most 100 "
        "or dra_evict_after_seconds at least "
        f"{float(interval) * config.EVICT_CHECKS / config.EVICT_CHECK_SPEEDUP:g}"
    )


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
    broken for longer, NoExecute about the debounce after it broke, decided by the checks run
    within it; recovery removes the taint."""
    debounce = 0.8

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        agent: Any = Agent(settings_in(tmp, config, dra_evict_after_seconds=debounce), modes.DRA)
        await agent.start()
        loop = asyncio.get_running_loop()
        try:
            await until(lambda: agent.ready, timeout=START_S, what="ready")
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
            # Decided by checks run within the debounce (the interval is 30 s: none of them).
            assert len(helpers[0].requests) >= checks + 1 + EVICT_CHECKS, "escalated by checks"
            helpers[0].answers.clear()
            agent.checker.request()
            await until(lambda: effects(fake)[-1:] == [""], timeout=1, what="the taint gone on recovery")
            assert effects(fake) == ["", "NoSchedule", "", "NoSchedule", "NoExecute", ""], effects(fake)
        finally:
            await shut(agent)

    with_cluster(tmp, body)


def test_a_device_seen_failing_once_is_not_evicted_when_no_check_runs_again(
    tmp: str, helpers: list[FakeHelper]
) -> None:
    """Issue 47, 2, on the agent: a check interval far longer than the debounce (no periodic check
    within the test), one failed check, then the device is fine again (a loaded node's probe that
    missed its deadline) and nothing asks for a check: the checks the pending eviction runs itself,
    more often than the interval, see it usable, and nothing is evicted."""
    debounce = 0.8

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        settings = settings_in(tmp, config, dra_evict_after_seconds=debounce, check_interval_seconds=300.0)
        agent: Any = Agent(settings, modes.DRA)
        await agent.start()
        failed: list[ProbeRequest] = []

        def once(request: ProbeRequest) -> ProbeResult:
            """The first probe fails, every later one passes: the load went, and nothing said so."""
            if failed:
                return ProbeResult(True)
            failed.append(request)
            return ProbeResult(False, "the probe helper missed its deadline")

        try:
            await until(lambda: agent.ready, timeout=START_S, what="ready")
            checks = len(helpers[0].requests)
            helpers[0].answers["kvm"] = once
            agent.checker.request()
            await until(lambda: "NoSchedule" in effects(fake), timeout=1, what="NoSchedule at once")
            await until(lambda: effects(fake)[-1:] == [""], timeout=5, what="the taint gone by a pending check")
            assert len(helpers[0].requests) == checks + 2, "one failed check, one passing pending check"
            assert "NoExecute" not in effects(fake), effects(fake)
        finally:
            await shut(agent)

    with_cluster(tmp, body)


def test_no_eviction_without_a_failed_check_within_the_debounce(tmp: str, helpers: list[FakeHelper]) -> None:
    """One failed check, then every probe hangs (no check completes): the debounce passes and
    nothing is evicted, for no check saw the device failing within it. Once the probes answer
    (still failing), the checks decide: NoExecute. The debounce is long enough (its checks a
    second apart) that the hung check starts within it even on a loaded machine: at 0.6 s a slow
    wake-up let it start after, and decide alone."""
    debounce = 3.0

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        settings = settings_in(tmp, config, dra_evict_after_seconds=debounce, check_interval_seconds=300.0)
        agent: Any = Agent(settings, modes.DRA)
        await agent.start()
        loop = asyncio.get_running_loop()
        try:
            await until(lambda: agent.ready, timeout=START_S, what="ready")
            helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
            agent.checker.request()
            await until(lambda: effects(fake)[-1:] == ["NoSchedule"], timeout=1, what="NoSchedule at once")
            broke = loop.time()
            checks = len(helpers[0].requests)
            helpers[0].gate = asyncio.Event()  # every probe from now on waits
            await until(
                lambda: loop.time() - broke > 2 * debounce, timeout=3 * debounce, what="twice the debounce passed"
            )
            assert effects(fake)[-1:] == ["NoSchedule"] and "NoExecute" not in effects(fake), effects(fake)
            assert len(helpers[0].requests) <= checks + 1, "at most one pending check asked, its probe hanging"
            helpers[0].gate.set()  # the hung check fails; it started within the debounce
            await until(lambda: effects(fake)[-1:] == ["NoExecute"], timeout=5, what="NoExecute by a check")
            assert len(helpers[0].requests) >= checks + 2, "the check that decided started after the debounce"
        finally:
            helpers[0].gate = None
            await shut(agent)

    with_cluster(tmp, body)
