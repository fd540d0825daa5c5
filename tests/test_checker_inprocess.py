"""The checker's logic in-process, for the fast loop: a fake probe helper answers, regular files
stand for device nodes, the CDI spec is written for real in a temp dir. What the kernel says
about a real node is tests/test_checker.py's business (root: mknod)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
from typing import Any, Optional

import pytest

from hyperlight_agent.device import checker as checker_module
from hyperlight_agent.device.checker import Checker, CheckTarget
from hyperlight_agent.device.helper import ProbeResult
from hyperlight_agent.device.observation import Cause, Observation, SharedObservation
from hyperlight_agent.files import atomic, cdi
from tests.conftest import read_bytes, until
from tests.fakes import FakeHelper, device_dir, files_as_devices


@pytest.fixture(autouse=True)
def _files_are_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    files_as_devices(monkeypatch)


def make(tmp: str, helper: FakeHelper, *nodes: str, **kw: Any) -> tuple[Checker, SharedObservation, list[Any]]:
    results: list[Any] = []
    state = SharedObservation()
    target = CheckTarget(device_dir(tmp, *nodes), None, os.path.join(tmp, "cdi"), 65534, 65534, **kw)
    checker = Checker(target, helper, state,  # type: ignore[arg-type]
                      on_result=lambda o, s, repaired: results.append((o, repaired)))
    return checker, state, results


def spec_names(tmp: str) -> list[str]:
    data = read_bytes(os.path.join(tmp, "cdi", "hyperlight.json"))
    assert data is not None
    return [d["name"] for d in json.loads(data)["devices"]]


async def test_no_device_is_unhealthy_and_names_the_directory_without_probing(tmp: str) -> None:
    helper = FakeHelper()
    checker, state, _ = make(tmp, helper)
    found = await checker.check()
    assert not found.healthy and found.cause == "no-device" and found.hypervisor is None
    assert f"no hypervisor device in {tmp}/dev" in found.reason
    assert helper.requests == [] and state.version == 1


async def test_a_passing_probe_writes_the_spec_once_and_is_healthy(tmp: str) -> None:
    helper = FakeHelper()
    checker, state, results = make(tmp, helper, "kvm")
    assert await checker.check() == Observation(True, "", "kvm")
    assert helper.requests[0].device == os.path.join(tmp, "dev", "kvm") and helper.requests[0].host is None
    assert spec_names(tmp) == ["kvm"]
    assert await checker.check() == Observation(True, "", "kvm")
    assert [r[1] for r in results] == [True, False], "written once, then found exact"
    assert state.version == 1, "the same observation is published once"
    assert checker.completed == 2


async def test_a_failing_probe_is_unhealthy_and_never_writes_the_spec(tmp: str) -> None:
    helper = FakeHelper({"kvm": ProbeResult(False, "KVM_GET_API_VERSION failed")})
    checker, _, _ = make(tmp, helper, "kvm")
    found = await checker.check()
    assert found == Observation(False, "KVM_GET_API_VERSION failed", "kvm", Cause.PROBE)
    assert read_bytes(os.path.join(tmp, "cdi", "hyperlight.json")) is None


async def test_the_first_passing_row_serves_and_the_first_failure_is_reported_when_none_does(tmp: str) -> None:
    helper = FakeHelper({"mshv": ProbeResult(False, "partition refused")})
    checker, _, _ = make(tmp, helper, "mshv", "kvm")
    assert (await checker.check()).hypervisor == "kvm"
    assert [r.hypervisor for r in helper.requests] == ["mshv", "kvm"]
    helper.answers["kvm"] = ProbeResult(False, "kvm broken")
    found = await checker.check()
    assert found == Observation(False, "partition refused", "mshv", Cause.PROBE)
    # An empty reason still says something.
    helper.answers = {"mshv": ProbeResult(False), "kvm": ProbeResult(False)}
    assert (await checker.check()).reason == "probe failed"


async def test_names_listed_in_the_spec_before_keep_resolving(tmp: str) -> None:
    helper = FakeHelper()
    checker, _, _ = make(tmp, helper, "mshv")
    await checker.check()
    assert spec_names(tmp) == ["mshv"]
    os.unlink(os.path.join(tmp, "dev", "mshv"))
    device_dir(tmp, "kvm")
    assert (await checker.check()).hypervisor == "kvm"
    assert spec_names(tmp) == ["kvm", "mshv"]


async def test_a_recovered_device_is_healthy_again(tmp: str) -> None:
    helper = FakeHelper({"kvm": ProbeResult(False, "busy")})
    checker, state, _ = make(tmp, helper, "kvm")
    assert not (await checker.check()).healthy
    helper.answers.clear()
    assert (await checker.check()).healthy
    assert state.version == 2


async def test_callers_during_a_check_share_the_next_one(tmp: str) -> None:
    helper = FakeHelper()
    helper.gate = asyncio.Event()
    checker, _, _ = make(tmp, helper, "kvm")
    first = asyncio.ensure_future(checker.check())
    await until(lambda: len(helper.requests) == 1, what="the first probe")
    later = [asyncio.ensure_future(checker.check()) for _ in range(20)]
    checker.request()
    helper.gate.set()
    results = await asyncio.gather(first, *later)
    assert all(r.healthy for r in results)
    assert checker.completed == 2 and len(helper.requests) == 2, "one running, one shared next check"


async def test_a_caller_that_gives_up_leaves_the_check_running(tmp: str) -> None:
    helper = FakeHelper()
    helper.gate = asyncio.Event()
    checker, state, _ = make(tmp, helper, "kvm")
    with pytest.raises(asyncio.TimeoutError):
        await checker.check(timeout=0.01)
    assert state.version == 0
    helper.gate.set()
    await until(lambda: state.version == 1, what="the abandoned check to publish")
    assert state.current.healthy


async def test_a_check_that_raises_reaches_every_waiter(tmp: str) -> None:
    helper = FakeHelper({"kvm": RuntimeError("boom")})
    helper.gate = asyncio.Event()
    checker, _, _ = make(tmp, helper, "kvm")
    first = asyncio.ensure_future(checker.check())
    await until(lambda: helper.requests, what="the first probe")
    second = asyncio.ensure_future(checker.check())  # shares the next check
    helper.gate.set()
    for waiter in (first, second):
        with pytest.raises(RuntimeError, match="boom"):
            await waiter


async def test_close_cancels_the_running_check_and_refuses_new_ones(tmp: str) -> None:
    helper = FakeHelper()
    helper.gate = asyncio.Event()
    checker, state, _ = make(tmp, helper, "kvm")
    running = asyncio.ensure_future(checker.check())
    await until(lambda: helper.requests, what="the probe")
    waiting = asyncio.ensure_future(checker.check())
    await asyncio.sleep(0)
    await checker.close()
    for waiter in (running, waiting):
        with pytest.raises(asyncio.CancelledError):
            await waiter
    with pytest.raises(asyncio.CancelledError):
        await checker.check()
    assert state.version == 0, "nothing published after close"


async def test_a_helper_fault_is_checked_again_promptly_once_per_streak(
        tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checker_module, "HELPER_RECHECK_S", 0.01)

    helper = FakeHelper({"kvm": ProbeResult(False, "probe helper exited unexpectedly", helper_fault=True)})
    checker, _, _ = make(tmp, helper, "kvm")
    assert not (await checker.check()).healthy
    await until(lambda: checker.completed == 2, what="the prompt re-check")
    # The re-check failed the same way: no third check of its own (a stuck kernel cannot loop us).
    assert not checker.retry_pending and checker.completed == 2
    helper.answers.clear()
    assert (await checker.check()).healthy
    await checker.close()


async def test_out_of_descriptors_keeps_the_last_result_and_looks_again(
        tmp: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(checker_module, "EXHAUSTED_RETRY_S", 0.01)
    caplog.set_level(logging.INFO, "hyperlight_agent")

    helper = FakeHelper()
    checker, state, _ = make(tmp, helper, "kvm")
    assert (await checker.check()).healthy
    helper.answers["kvm"] = ProbeResult(False, "cannot run the probe helper: Too many open files",
                                        helper_fault=True, exhausted=True)
    assert (await checker.check()).healthy, "inconclusive: the last result stands"
    assert state.version == 1
    done = checker.completed
    await until(lambda: checker.completed > done, what="the retry after an inconclusive check")
    helper.answers.clear()
    await until(lambda: "device check conclusive again" in caplog.text, what="a conclusive check")
    assert state.current.healthy and state.version == 1
    assert caplog.text.count("device check inconclusive") == 1, "said once per streak"
    await checker.close()


async def test_a_failed_spec_write_is_unhealthy_and_retried_with_growing_delays(
        tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checker_module, "CDI_RETRY_INITIAL_S", 0.01)
    monkeypatch.setattr(checker_module, "CDI_RETRY_CAP_S", 0.02)
    real_write = atomic.write
    full = [True]

    def write(*args: Any, **kw: Any) -> Any:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kw)

    monkeypatch.setattr(atomic, "write", write)

    checker, state, _ = make(tmp, FakeHelper(), "kvm")
    found = await checker.check()
    assert not found.healthy and found.cause == "cdi" and "No space left on device" in found.reason
    await until(lambda: checker.completed >= 3, what="retries without any event")
    full[0] = False
    await until(lambda: state.current.healthy, what="healthy once the spec can be written")
    assert spec_names(tmp) == ["kvm"]
    await checker.close()


async def test_a_refused_spec_path_is_unhealthy_and_not_retried_on_a_timer(
        tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checker_module, "CDI_RETRY_INITIAL_S", 0.01)

    checker, _, _ = make(tmp, FakeHelper(), "kvm")
    os.makedirs(os.path.join(tmp, "cdi", "hyperlight.json"))
    found = await checker.check()
    assert not found.healthy and found.cause == "cdi"
    assert not checker.retry_pending, "a refusal waits for an event, not a timer"


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
async def test_a_spec_read_out_of_descriptors_is_inconclusive(tmp: str, monkeypatch: pytest.MonkeyPatch,
                                                         code: int) -> None:
    def read_regular(path: str, limit: int) -> Optional[atomic.Current]:
        raise OSError(code, os.strerror(code))

    checker, state, _ = make(tmp, FakeHelper(), "kvm")
    os.makedirs(os.path.join(tmp, "cdi"))
    with open(os.path.join(tmp, "cdi", "hyperlight.json"), "w") as f:
        f.write("{}")
    monkeypatch.setattr(atomic, "read_regular", read_regular)
    await checker.check()
    assert state.version == 0, "nothing published"
    await checker.close()


async def test_read_only_inspects_the_spec_and_never_writes_it(tmp: str) -> None:
    checker, _, _ = make(tmp, FakeHelper(), "kvm", read_only=True)
    assert (await checker.check()).healthy
    assert checker.cdi_note == f"{tmp}/cdi/hyperlight.json is missing"
    assert not os.path.exists(os.path.join(tmp, "cdi"))
    writer, _, _ = make(tmp, FakeHelper(), "kvm")
    await writer.check()
    await checker.check()
    assert checker.cdi_note is None
    with open(os.path.join(tmp, "cdi", "hyperlight.json"), "ab") as f:
        f.write(b" ")
    await checker.check()
    assert checker.cdi_note == f"{tmp}/cdi/hyperlight.json differs from the expected spec"


async def test_inventory_mode_never_probes_and_refuses_a_non_device(tmp: str) -> None:
    helper = FakeHelper()
    checker, _, _ = make(tmp, helper, "kvm", inventory_only=True)
    found = await checker.check()
    assert helper.requests == []
    assert not found.healthy and found.cause == "probe" and found.hypervisor == "kvm"
    assert "not a character device" in found.reason
    assert not os.path.exists(os.path.join(tmp, "cdi")), "no CDI in inventory mode"


async def test_the_host_path_is_the_same_row_under_the_host_device_dir(tmp: str) -> None:
    helper = FakeHelper()
    state = SharedObservation()
    target = CheckTarget(device_dir(tmp, "kvm"), "/host-dev", os.path.join(tmp, "cdi"), 1, 2)
    await Checker(target, helper, state).check()  # type: ignore[arg-type]
    assert helper.requests[0].host == "/host-dev/kvm"
    assert b'"uid": 1' in (read_bytes(cdi.spec_path(target.cdi_dir)) or b"")
