"""Shared health: single-flight checks, callers that give up, broadcast and recovery."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sys

import pytest

from hyperlight_agent.device.checker import Checker, CheckTarget
from hyperlight_agent.device.helper import ProbeHelper
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.files import atomic, cdi
from standin.procs import my_helpers
from tests.conftest import make_node, read_bytes, until


def target(tmp: str, device_dir: str, **kw: object) -> CheckTarget:
    return CheckTarget(device_dir=device_dir, host_device_dir=None,
                       cdi_dir=os.path.join(tmp, "cdi"), uid=65534, gid=65534, **kw)  # type: ignore[arg-type]


async def test_initial_state_is_unhealthy_until_a_check_completes() -> None:
    state = SharedObservation()
    assert state.version == 0 and not state.current.healthy
    waiter = asyncio.ensure_future(state.wait_newer(0))
    await asyncio.sleep(0)
    assert not waiter.done()
    state.publish(Observation(True, "", "kvm"))
    assert (await waiter).healthy


async def test_publish_wakes_all_waiters_once_per_change() -> None:
    state = SharedObservation()
    state.publish(Observation(True, "", "kvm"))
    waiters = [asyncio.ensure_future(state.wait_newer(state.version)) for _ in range(50)]
    assert not state.publish(Observation(True, "", "kvm"))  # same observation: no wake-up
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    assert state.publish(Observation(False, "gone", "kvm"))
    results = await asyncio.gather(*waiters)
    assert all(r.reason == "gone" for r in results)


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
    slow = [sys.executable, "-I", "-S", "-c",
            "import os, sys, time, json\n"
            "for line in sys.stdin:\n"
            "    while os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
            "    print(json.dumps({'ok': True, 'reason': ''}), flush=True)\n", marker]

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
    t = CheckTarget(device_dir=kvm_dir, host_device_dir=None, cdi_dir=os.path.join(blocker, "cdi"),
                    uid=65534, gid=65534)
    checker = Checker(t, helper, state)
    first = await checker.check()
    assert not first.healthy and first.cause == "cdi" and "Not a directory" in first.reason
    os.unlink(blocker)
    await until(lambda: state.current.healthy, 10, "Healthy again with nobody asking for a check")
    assert cdi.listed_devices(read_bytes(cdi.spec_path(t.cdi_dir)) or b"") == {"kvm"}
    await checker.close()
    await helper.close()


async def test_running_out_of_descriptors_is_no_device_failure(tmp: str, kvm_dir: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
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
