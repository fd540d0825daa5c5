"""The device check: single-flight checks, callers that give up, and recovery, with the
real probe helper on real nodes (root: mknod); and its logic in-process for the fast loop, where a
fake probe helper answers, regular files stand for device nodes (the files_are_devices fixture)
and the CDI spec is written for real in a temp dir."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import sys
from typing import Any, Optional

import pytest

from hyperlight_agent.device import rechecks
from hyperlight_agent.device.checker import Checker, CheckTarget
from hyperlight_agent.device.helper import ProbeHelper, ProbeResult
from hyperlight_agent.device.observation import Cause, Observation, SharedObservation
from hyperlight_agent.files import atomic, cdi
from hyperlight_agent.files import watcher as watcher_module
from hyperlight_agent.files.watcher import DirectoryWatcher
from standin.procs import my_helpers
from tests.conftest import make_node, read_bytes, until
from tests.fakes import FakeHelper, device_dir, files_as_devices


def target(tmp: str, device_dir: str, **kw: object) -> CheckTarget:
    return CheckTarget(
        device_dir=device_dir,
        host_device_dir=None,
        cdi_dir=os.path.join(tmp, "cdi"),
        uid=65534,
        gid=65534,
        **kw,  # type: ignore[arg-type]
    )


async def test_burst_of_500_checks_runs_a_handful_of_probes(tmp: str, kvm_dir: str) -> None:
    helper = ProbeHelper()
    checker = Checker(target(tmp, kvm_dir), helper, SharedObservation())
    most_alive = 0
    burst = asyncio.gather(*(checker.check() for _ in range(500)))
    while not burst.done():  # sample the process table while the burst runs
        most_alive = max(most_alive, len(my_helpers()))
        await asyncio.sleep(0)
    results = await burst
    assert all(r.healthy for r in results)
    assert checker.completed <= 5, f"{checker.completed} checks for one burst"
    assert helper.started == 1 and most_alive == 1
    await helper.close()


async def test_check_after_arrival_never_a_cached_result(tmp: str, kvm_dir: str) -> None:
    helper = ProbeHelper()
    checker = Checker(target(tmp, kvm_dir), helper, SharedObservation())
    assert (await checker.check()).healthy
    os.unlink(os.path.join(kvm_dir, "kvm"))
    after = await checker.check()  # nothing in flight: a new check must run
    assert not after.healthy and "no hypervisor device" in after.reason
    await helper.close()


async def test_caller_that_gives_up_does_not_change_shared_health(tmp: str, kvm_dir: str) -> None:
    marker = os.path.join(tmp, "slow")
    open(marker, "w").close()
    slow = [
        sys.executable,
        "-I",
        "-S",
        "-c",
        "import os, sys, time, json\n"
        "print(json.dumps({'ready': True}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    while os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
        "    print(json.dumps({'ok': True, 'reason': ''}), flush=True)\n",
        marker,
    ]

    state = SharedObservation()
    helper = ProbeHelper(argv=slow, deadline=5)
    checker = Checker(target(tmp, kvm_dir), helper, state)
    cancelled = asyncio.ensure_future(checker.check())
    with pytest.raises(asyncio.TimeoutError):
        await checker.check(timeout=0.05)  # a caller deadline is respected...
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    assert state.version == 0  # ...and neither caller published anything
    os.unlink(marker)
    result = await checker.check()  # the shared check carried on and completed
    assert result.healthy and state.current.healthy
    assert helper.started == 1, "a caller giving up must not kill the shared probe"
    await helper.close()


async def test_recovery_without_restart(tmp: str, kvm_dir: str) -> None:
    state = SharedObservation()
    helper = ProbeHelper()
    checker = Checker(target(tmp, kvm_dir), helper, state)
    node = os.path.join(kvm_dir, "kvm")
    assert (await checker.check()).healthy
    os.unlink(node)
    make_node(node, 1, 3)  # /dev/null's numbers: an unusable device
    bad = await checker.check()
    assert not bad.healthy and "KVM_GET_API_VERSION failed" in bad.reason
    os.unlink(node)
    make_node(node, 10, 232)
    assert (await checker.check()).healthy
    assert state.version == 3
    await helper.close()


async def test_cdi_failure_makes_the_device_unhealthy(tmp: str, kvm_dir: str) -> None:
    checker = Checker(target(tmp, kvm_dir), helper := ProbeHelper(), SharedObservation())
    os.makedirs(cdi.spec_path(os.path.join(tmp, "cdi")))  # a directory at our path
    bad = await checker.check()
    assert not bad.healthy and "is a directory" in bad.reason
    os.rmdir(cdi.spec_path(os.path.join(tmp, "cdi")))
    assert (await checker.check()).healthy
    await helper.close()


@pytest.mark.root
async def test_inventory_mode_never_opens_the_device(tmp: str) -> None:
    """A node whose open would fail (numbers of no existing device) still inventories."""
    device_dir = os.path.join(tmp, "dev")
    os.mkdir(device_dir)
    make_node(os.path.join(device_dir, "kvm"), 250, 250)
    with pytest.raises(OSError):
        os.close(os.open(os.path.join(device_dir, "kvm"), os.O_RDWR))

    helper = ProbeHelper()
    checker = Checker(target(tmp, device_dir, inventory_only=True), helper, SharedObservation())
    assert (await checker.check()).healthy
    assert helper.started == 0
    assert not os.path.exists(os.path.join(tmp, "cdi"))
    await helper.close()


def check_once(tmp: str, device_dir: str) -> Observation:
    async def run() -> Observation:
        helper = ProbeHelper()
        try:
            return await Checker(target(tmp, device_dir), helper, SharedObservation()).check()
        finally:
            await helper.close()

    return asyncio.run(run())


@pytest.mark.parametrize("junk", ["regular file", "symlink", "directory"])
def test_junk_at_another_hypervisors_path_changes_nothing(tmp: str, kvm_dir: str, junk: str) -> None:
    mshv = os.path.join(kvm_dir, "mshv")
    if junk == "regular file":
        with open(mshv, "w") as f:
            f.write("x")
    elif junk == "symlink":
        os.symlink("kvm", mshv)
    else:
        os.mkdir(mshv)
    observation = check_once(tmp, kvm_dir)
    assert (observation.healthy, observation.hypervisor) == (True, "kvm")
    with open(cdi.spec_path(os.path.join(tmp, "cdi")), "rb") as f:
        assert f.read() == cdi.render("kvm", "/dev/kvm", 65534, 65534)


@pytest.mark.root
def test_a_failing_probe_never_changes_the_spec(tmp: str) -> None:
    dev = os.path.join(tmp, "dev")
    os.mkdir(dev)
    make_node(os.path.join(dev, "mshv"), 1, 3)  # /dev/null's numbers: the MSHV ioctl fails
    cdi_dir = os.path.join(tmp, "cdi")
    os.mkdir(cdi_dir)
    kvm_spec = cdi.render("kvm", "/dev/kvm", 65534, 65534)
    with open(cdi.spec_path(cdi_dir), "wb") as f:
        f.write(kvm_spec)
    observation = check_once(tmp, dev)
    assert (observation.healthy, observation.hypervisor, observation.cause) == (False, "mshv", "probe")
    with open(cdi.spec_path(cdi_dir), "rb") as f:
        assert f.read() == kvm_spec


def test_a_working_row_serves_when_a_preferred_row_fails_its_probe(tmp: str, kvm_dir: str) -> None:
    make_node(os.path.join(kvm_dir, "mshv"), 1, 3)
    observation = check_once(tmp, kvm_dir)
    assert (observation.healthy, observation.hypervisor) == (True, "kvm")


def test_names_handed_out_earlier_keep_resolving_after_the_hypervisor_changes(tmp: str, kvm_dir: str) -> None:
    """A node that served mshv and now serves kvm: containers whose replayed Allocate names
    hyperlight.dev/hypervisor=mshv must still find that device in the spec."""
    cdi_dir = os.path.join(tmp, "cdi")
    os.mkdir(cdi_dir)
    with open(cdi.spec_path(cdi_dir), "wb") as f:
        f.write(cdi.render("mshv", "/dev/mshv", 65534, 65534))
    assert check_once(tmp, kvm_dir).healthy
    both = cdi.render("kvm", "/dev/kvm", 65534, 65534, kept=[("mshv", "/dev/mshv")])
    with open(cdi.spec_path(cdi_dir), "rb") as f:
        assert f.read() == both
    assert [d["name"] for d in json.loads(both)["devices"]] == ["kvm", "mshv"]


async def test_a_failed_spec_write_is_retried_promptly_without_any_event(tmp: str, kvm_dir: str) -> None:
    """ENOSPC or a read-only remount going away raises no inotify event: while the spec cannot be
    written the checker looks again by itself, within about a second (issue 19, item 4)."""
    blocker = os.path.join(tmp, "not-a-dir")
    with open(blocker, "w") as f:
        f.write("x")  # the CDI dir's parent is a file: ENOTDIR until it goes

    helper = ProbeHelper()
    state = SharedObservation()
    t = CheckTarget(
        device_dir=kvm_dir, host_device_dir=None, cdi_dir=os.path.join(blocker, "cdi"), uid=65534, gid=65534
    )
    checker = Checker(t, helper, state)
    first = await checker.check()
    assert not first.healthy and first.cause == "cdi" and "Not a directory" in first.reason
    os.unlink(blocker)
    await until(lambda: state.current.healthy, 10, "Healthy again with nobody asking for a check")
    assert cdi.listed_devices(read_bytes(cdi.spec_path(t.cdi_dir)) or b"") == {"kvm"}
    await checker.close()
    await helper.close()


async def test_running_out_of_descriptors_is_no_device_failure(
    tmp: str, kvm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMFILE while checking (idle connections ate the descriptors) is not the device's fault: the
    last result stands and the check is repeated (issue 19, item 1)."""

    helper = ProbeHelper()
    state = SharedObservation()
    checker = Checker(target(tmp, kvm_dir), helper, state)
    assert (await checker.check()).healthy
    version = state.version
    real = atomic.read_regular

    def exhausted(path: str, limit: int) -> object:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)

    monkeypatch.setattr(atomic, "read_regular", exhausted)
    assert (await checker.check()).healthy, "the last result stands"
    assert state.version == version, "nothing was published"
    monkeypatch.setattr(atomic, "read_regular", real)
    completed = checker.completed
    await until(lambda: checker.completed > completed, 10, "a check again by itself")
    assert state.current.healthy
    await checker.close()
    await helper.close()


@pytest.fixture
def files_are_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the in-process tests: a regular file at a row's path is its node (tests/fakes.py)."""
    files_as_devices(monkeypatch)


def make(tmp: str, helper: FakeHelper, *nodes: str, **kw: Any) -> tuple[Checker, SharedObservation, list[Any]]:
    results: list[Any] = []
    state = SharedObservation()
    target = CheckTarget(device_dir(tmp, *nodes), None, os.path.join(tmp, "cdi"), 65534, 65534, **kw)
    checker = Checker(
        target,
        helper,  # type: ignore[arg-type]
        state,
        on_result=lambda o, s, repaired: results.append((o, repaired)),
    )
    return checker, state, results


def spec_names(tmp: str) -> list[str]:
    data = read_bytes(os.path.join(tmp, "cdi", "hyperlight.json"))
    assert data is not None
    return [d["name"] for d in json.loads(data)["devices"]]


@pytest.mark.usefixtures("files_are_devices")
async def test_no_device_is_unhealthy_and_names_the_directory_without_probing(tmp: str) -> None:
    helper = FakeHelper()
    checker, state, _ = make(tmp, helper)
    found = await checker.check()
    assert not found.healthy and found.cause == "no-device" and found.hypervisor is None
    assert f"no hypervisor device in {tmp}/dev" in found.reason
    assert helper.requests == [] and state.version == 1


@pytest.mark.usefixtures("files_are_devices")
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


@pytest.mark.usefixtures("files_are_devices")
async def test_a_failing_probe_is_unhealthy_and_never_writes_the_spec(tmp: str) -> None:
    helper = FakeHelper({"kvm": ProbeResult(False, "KVM_GET_API_VERSION failed")})
    checker, _, _ = make(tmp, helper, "kvm")
    found = await checker.check()
    assert found == Observation(False, "KVM_GET_API_VERSION failed", "kvm", Cause.PROBE)
    assert read_bytes(os.path.join(tmp, "cdi", "hyperlight.json")) is None


@pytest.mark.usefixtures("files_are_devices")
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


@pytest.mark.usefixtures("files_are_devices")
async def test_names_listed_in_the_spec_before_keep_resolving(tmp: str) -> None:
    helper = FakeHelper()
    checker, _, _ = make(tmp, helper, "mshv")
    await checker.check()
    assert spec_names(tmp) == ["mshv"]
    os.unlink(os.path.join(tmp, "dev", "mshv"))
    device_dir(tmp, "kvm")
    assert (await checker.check()).hypervisor == "kvm"
    assert spec_names(tmp) == ["kvm", "mshv"]


@pytest.mark.usefixtures("files_are_devices")
async def test_a_recovered_device_is_healthy_again(tmp: str) -> None:
    helper = FakeHelper({"kvm": ProbeResult(False, "busy")})
    checker, state, _ = make(tmp, helper, "kvm")
    assert not (await checker.check()).healthy
    helper.answers.clear()
    assert (await checker.check()).healthy
    assert state.version == 2


def gated(
    tmp: str, answers: Optional[dict[str, Any]] = None
) -> tuple[FakeHelper, asyncio.Event, Checker, SharedObservation]:
    """A checker on kvm whose probes wait for the gate."""
    helper = FakeHelper(answers)
    helper.gate = gate = asyncio.Event()
    checker, state, _ = make(tmp, helper, "kvm")
    return helper, gate, checker, state


@pytest.mark.usefixtures("files_are_devices")
async def test_callers_during_a_check_share_the_next_one(tmp: str) -> None:
    helper, gate, checker, _ = gated(tmp)
    first = asyncio.ensure_future(checker.check())
    await until(lambda: len(helper.requests) == 1, what="the first probe")
    later = [asyncio.ensure_future(checker.check()) for _ in range(20)]
    checker.request()
    gate.set()
    results = await asyncio.gather(first, *later)
    assert all(r.healthy for r in results)
    assert checker.completed == 2 and len(helper.requests) == 2, "one running, one shared next check"


@pytest.mark.usefixtures("files_are_devices")
async def test_a_caller_that_gives_up_leaves_the_check_running(tmp: str) -> None:
    _helper, gate, checker, state = gated(tmp)
    with pytest.raises(asyncio.TimeoutError):
        await checker.check(timeout=0.01)
    assert state.version == 0
    gate.set()
    await until(lambda: state.version == 1, what="the abandoned check to publish")
    assert state.current.healthy


@pytest.mark.usefixtures("files_are_devices")
async def test_a_check_that_raises_reaches_every_waiter(tmp: str) -> None:
    helper, gate, checker, _ = gated(tmp, {"kvm": RuntimeError("boom")})
    first = asyncio.ensure_future(checker.check())
    await until(lambda: helper.requests, what="the first probe")
    second = asyncio.ensure_future(checker.check())  # shares the next check
    gate.set()
    for waiter in (first, second):
        with pytest.raises(RuntimeError, match="boom"):
            await waiter


@pytest.mark.usefixtures("files_are_devices")
async def test_close_cancels_the_running_check_and_refuses_new_ones(tmp: str) -> None:
    helper, _gate, checker, state = gated(tmp)
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


@pytest.mark.usefixtures("files_are_devices")
async def test_a_helper_fault_is_checked_again_promptly_once_per_streak(
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rechecks, "HELPER_RECHECK_S", 0.01)

    helper = FakeHelper({"kvm": ProbeResult(False, "probe helper exited unexpectedly", helper_fault=True)})
    checker, _, _ = make(tmp, helper, "kvm")
    assert not (await checker.check()).healthy
    await until(lambda: checker.completed == 2, what="the prompt re-check")
    # The re-check failed the same way: no third check of its own (a stuck kernel cannot loop us).
    assert not checker.retry_pending and checker.completed == 2
    helper.answers.clear()
    assert (await checker.check()).healthy
    await checker.close()


@pytest.mark.usefixtures("files_are_devices")
async def test_out_of_descriptors_keeps_the_last_result_and_looks_again(
    tmp: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(rechecks, "EXHAUSTED_RETRY_S", 0.01)
    caplog.set_level(logging.INFO, "hyperlight_agent")

    helper = FakeHelper()
    checker, state, _ = make(tmp, helper, "kvm")
    assert (await checker.check()).healthy
    helper.answers["kvm"] = ProbeResult(
        False, "cannot run the probe helper: Too many open files", helper_fault=True, exhausted=True
    )
    assert (await checker.check()).healthy, "inconclusive: the last result stands"
    assert state.version == 1
    done = checker.completed
    await until(lambda: checker.completed > done, what="the retry after an inconclusive check")
    helper.answers.clear()
    await until(lambda: "device check conclusive again" in caplog.text, what="a conclusive check")
    assert state.current.healthy and state.version == 1
    assert caplog.text.count("device check inconclusive") == 1, "said once per streak"
    await checker.close()


@pytest.mark.usefixtures("files_are_devices")
async def test_a_failed_spec_write_is_unhealthy_and_retried_with_growing_delays(
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rechecks, "CDI_RETRY_INITIAL_S", 0.01)
    monkeypatch.setattr(rechecks, "CDI_RETRY_CAP_S", 0.02)
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


@pytest.mark.usefixtures("files_are_devices")
async def test_a_refused_spec_path_is_unhealthy_and_not_retried_on_a_timer(
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rechecks, "CDI_RETRY_INITIAL_S", 0.01)

    checker, _, _ = make(tmp, FakeHelper(), "kvm")
    os.makedirs(os.path.join(tmp, "cdi", "hyperlight.json"))
    found = await checker.check()
    assert not found.healthy and found.cause == "cdi"
    assert not checker.retry_pending, "a refusal waits for an event, not a timer"


@pytest.mark.usefixtures("files_are_devices")
@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
async def test_a_spec_read_out_of_descriptors_is_inconclusive(
    tmp: str, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
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


@pytest.mark.usefixtures("files_are_devices")
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


@pytest.mark.usefixtures("files_are_devices")
async def test_inventory_mode_never_probes_and_refuses_a_non_device(tmp: str) -> None:
    helper = FakeHelper()
    checker, _, _ = make(tmp, helper, "kvm", inventory_only=True)
    found = await checker.check()
    assert helper.requests == []
    assert not found.healthy and found.cause == "probe" and found.hypervisor == "kvm"
    assert "not a character device" in found.reason
    assert not os.path.exists(os.path.join(tmp, "cdi")), "no CDI in inventory mode"


@pytest.mark.usefixtures("files_are_devices")
async def test_the_host_path_is_the_same_row_under_the_host_device_dir(tmp: str) -> None:
    helper = FakeHelper()
    state = SharedObservation()
    target = CheckTarget(device_dir(tmp, "kvm"), "/host-dev", os.path.join(tmp, "cdi"), 1, 2)
    await Checker(target, helper, state).check()  # type: ignore[arg-type]
    assert helper.requests[0].host == "/host-dev/kvm"
    assert b'"uid": 1' in (read_bytes(cdi.spec_path(target.cdi_dir)) or b"")


@pytest.mark.usefixtures("files_are_devices")
async def test_a_new_interval_starts_the_periodic_wait_anew(tmp: str) -> None:
    """A reload from an hour to a hundredth of a second: the next check comes at once, not an hour
    after the old wait began."""
    checker, _, _ = make(tmp, FakeHelper(), "kvm")
    checker.interval_s = 3600.0
    timer = asyncio.ensure_future(checker.periodic())
    try:
        await checker.check()
        done = checker.completed
        checker.reconfigure(checker.target, 0.01)
        await until(lambda: checker.completed >= done + 3, what="checks at the new interval")
    finally:
        timer.cancel()
        await checker.close()


@pytest.mark.usefixtures("files_are_devices")
async def test_the_checker_watches_the_devices_and_the_cdi_directory_without_following_it(
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlink at cdi_dir is refused, never followed or watched through: when a directory takes
    its place, the check comes from the parent's watch (the retry of an unwatchable directory is
    put off here, so nothing else could bring it). A device node that goes starts a check too."""
    monkeypatch.setattr(watcher_module, "RETRY_S", 3600.0)
    checker, state, _ = make(tmp, FakeHelper(), "kvm")
    cdi_dir = checker.target.cdi_dir
    os.mkdir(cdi_dir + ".real")
    os.symlink(cdi_dir + ".real", cdi_dir)
    watcher = DirectoryWatcher()
    checker.watch(watcher)
    watching = asyncio.ensure_future(watcher.run())
    try:
        await until(lambda: watcher.watching(os.path.join(tmp, "dev")) and watcher.watching(tmp), what="the watches")
        refused = await checker.check()
        assert refused.cause is Cause.CDI and "symlink" in refused.reason, refused
        os.unlink(cdi_dir)
        os.mkdir(cdi_dir)
        await until(lambda: os.path.exists(cdi.spec_path(cdi_dir)), what="the spec written in the new directory")
        await until(lambda: state.current.healthy, what="healthy")
        os.unlink(os.path.join(tmp, "dev", "kvm"))
        await until(lambda: state.current.cause is Cause.NO_DEVICE, what="a check on the node's removal")
    finally:
        watching.cancel()
        await checker.close()
