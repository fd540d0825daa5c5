"""The bounded probe helper: one long-lived process, killed past its deadline, never more than
one alive, and failing fast while a killed helper cannot be reaped."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from hyperlight_agent.device import helper as helper_module
from hyperlight_agent.device.helper import ProbeHelper, ProbeRequest, ProbeResult, default_argv
from standin.procs import alive, my_helpers
from tests.conftest import wait_for


def hanging_helper(marker: str) -> list[str]:
    """A helper that answers normally, except it hangs while `marker` exists."""
    code = (
        "import os, sys, time, json\n"
        "print(json.dumps({'ready': True}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    while os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
        "    sys.stdout.write(json.dumps({'ok': True, 'reason': ''}) + '\\n'); sys.stdout.flush()\n"
    )
    return [sys.executable, "-I", "-S", "-c", code, marker]


def request(kvm_dir: str) -> ProbeRequest:
    return ProbeRequest("kvm", os.path.join(kvm_dir, "kvm"))


def test_one_long_lived_helper_serves_many_checks(kvm_dir: str) -> None:
    async def run() -> int:
        helper = ProbeHelper()
        for _ in range(20):
            assert await helper.run(request(kvm_dir)) == ProbeResult(True, "")
        assert helper.started == 1
        pid = helper.pid
        assert pid is not None and my_helpers() == [pid]
        await helper.close()
        assert helper.pid is None
        return pid

    pid = asyncio.run(run())
    assert alive([pid]) == []


def test_helper_argv_isolates_from_site_packages_and_writes_no_bytecode() -> None:
    """Run the real helper command line with a script in place of the helper's loop."""
    argv = default_argv()
    argv[argv.index("-c") + 1] = (
        "import sys, importlib.util; "
        "print(importlib.util.find_spec('grpc') is None, sys.flags.isolated, sys.dont_write_bytecode)"
    )
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
    assert out.split() == ["True", "1", "True"], out


def test_deadline_kills_and_replaces_the_helper(tmp: str, kvm_dir: str) -> None:
    marker = os.path.join(tmp, "hang")
    open(marker, "w").close()
    timeouts = []

    async def run() -> None:
        helper = ProbeHelper(argv=hanging_helper(marker), deadline=0.3, on_timeout=lambda: timeouts.append(1))
        reply = await helper.run(request(kvm_dir))
        assert reply == ProbeResult(False, "probe did not finish within 0.3 s (helper killed)", helper_fault=True)
        assert helper.pid is None
        os.unlink(marker)
        assert (await helper.run(request(kvm_dir))).ok
        assert helper.started == 2
        await helper.close()

    asyncio.run(run())
    assert timeouts == [1]


def test_unreaped_helper_blocks_new_checks_until_it_exits(tmp: str, kvm_dir: str) -> None:
    """A kill that does not take (as for a process stuck in the kernel) must not lead to a second
    helper: checks fail with "previous probe has not exited", fast after the first, until reaped."""
    marker = os.path.join(tmp, "hang")
    open(marker, "w").close()
    killed: list[int] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        helper = ProbeHelper(argv=hanging_helper(marker), deadline=1.0, kill=lambda pid, sig: killed.append(pid))
        assert "did not finish" in (await helper.run(request(kvm_dir))).reason
        stuck_pid = helper.dying_pid
        assert stuck_pid is not None and killed == [stuck_pid]
        first = await helper.run(request(kvm_dir))  # spends its budget waiting for the exit
        assert first.reason == f"previous probe has not exited (pid {stuck_pid})"
        started = loop.time()
        for _ in range(5):
            again = await helper.run(request(kvm_dir))
            assert again.reason == first.reason
        # Five checks that each waited their budget would take five budgets; together they
        # must take less than one.
        assert loop.time() - started < helper.deadline, "later checks must fail fast, not wait each time"
        assert len(hanging_pids(marker)) == 1, "never more than one helper"
        # The stuck helper finally exits: a check after that reaps it and starts afresh.
        os.unlink(marker)
        os.kill(stuck_pid, 9)
        deadline = loop.time() + 5
        while not (await helper.run(request(kvm_dir))).ok:
            assert loop.time() < deadline, "the reaped helper was never replaced"
            await asyncio.sleep(0.01)
        assert helper.started == 2
        await helper.close()

    asyncio.run(run())
    assert hanging_pids(marker) == []


def hanging_pids(marker: str) -> list[int]:
    return my_helpers(marker)


def test_cancelled_request_abandons_the_helper(tmp: str, kvm_dir: str) -> None:
    marker = os.path.join(tmp, "hang")
    open(marker, "w").close()

    async def run() -> None:
        helper = ProbeHelper(argv=hanging_helper(marker), deadline=5)
        task = asyncio.ensure_future(helper.run(request(kvm_dir)))
        while helper.pid is None:  # noqa: ASYNC110 - the helper starts inside run(); no event exists
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert helper.pid is None and helper.dying_pid is not None
        os.unlink(marker)
        assert (await helper.run(request(kvm_dir))).ok  # reaps the cancelled one first
        await helper.close()

    asyncio.run(run())
    assert hanging_pids(marker) == []


async def test_helper_that_dies_is_reported_and_replaced(kvm_dir: str) -> None:
    helper = ProbeHelper(
        argv=[
            sys.executable,
            "-I",
            "-S",
            "-c",
            "import sys; print('{\"ready\": true}', flush=True); sys.stdin.readline()",
        ]
    )
    reply = await helper.run(request(kvm_dir))
    assert reply == ProbeResult(False, "probe helper exited unexpectedly", helper_fault=True)
    await helper.close()


def dead(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


async def test_an_idle_helper_that_died_is_replaced_before_any_failure(kvm_dir: str) -> None:
    """Killed while idle (OOM killer, an operator), the helper's death says nothing about the
    device: the next request gets a fresh helper, not a failure (issue 19, item 7)."""

    helper = ProbeHelper()
    assert (await helper.run(request(kvm_dir))).ok
    pid = helper.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # Wait without yielding to the loop: the agent's next check can come before the loop
    # has seen the helper exit.
    wait_for(lambda: dead(pid), 10, "the killed helper to exit")
    assert await helper.run(request(kvm_dir)) == ProbeResult(True, "")
    assert helper.started == 2 and helper.pid not in (None, pid)
    await helper.close()


def slow_start(seconds: float, ready: bool = True) -> list[str]:
    """A helper whose start (its interpreter, its imports) takes `seconds`; then it says READY
    (or not) and answers every request healthy at once."""
    code = (
        "import sys, time, json\n"
        f"time.sleep({seconds})\n"
        + ("print(json.dumps({'ready': True}), flush=True)\n" if ready else "sys.stdin.readline()\n")
        + "for line in sys.stdin:\n"
        "    print(json.dumps({'ok': True, 'reason': ''}), flush=True)\n"
    )
    return [sys.executable, "-I", "-S", "-c", code]


async def test_a_slow_helper_start_is_not_counted_against_the_probe(kvm_dir: str) -> None:
    """On a loaded node a fresh interpreter may take longer than the probe's deadline to start:
    that is no failure of the device (the first check of a successor failed for it once, and
    its first list to the kubelet said unhealthy)."""
    helper = ProbeHelper(argv=slow_start(0.6), deadline=0.3)
    try:
        assert await helper.run(request(kvm_dir)) == ProbeResult(True, "")
    finally:
        await helper.close()


async def test_a_helper_that_never_says_ready_is_killed_after_the_start_bound(
    kvm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(helper_module, "HELPER_START_S", 0.3)
    helper = ProbeHelper(argv=slow_start(0, ready=False))
    try:
        reply = await helper.run(request(kvm_dir))
        assert reply == ProbeResult(False, "probe helper did not start within 0.3 s (killed)", helper_fault=True)
        assert helper.pid is None
    finally:
        await helper.close()


# What the test below installs as the next release's helper: its probe says so, whatever it is asked.
NEXT_RELEASE_PROBE = """

def run_request(request):
    return {"ok": False, "reason": "the next release's probe"}
"""
# Run from a copy of the package: the probe helper of an agent whose installed tree is replaced
# under it (a package upgrade), restarted after that (here: killed, as a missed deadline does).
UPGRADED_UNDER_IT = """
import asyncio, os, signal, sys
tree = sys.argv[1]
sys.path.insert(0, tree)
from hyperlight_agent.device import helper

async def main():
    h = helper.ProbeHelper()
    request = helper.ProbeRequest("kvm", os.path.join(tree, "no-such-device"))
    print((await h.run(request)).reason)
    with open(os.path.join(tree, "hyperlight_agent", "device", "helper_process.py"), "a") as f:
        f.write(sys.argv[2])
    os.kill(h.pid, signal.SIGKILL)
    print((await h.run(request)).reason, "(started", h.started, "helpers)")
    await h.close()

asyncio.run(main())
"""


def test_a_helper_started_after_the_tree_was_upgraded_runs_the_agents_own_code(tmp: str) -> None:
    """Issue 35 (observed): after a failed in-place upgrade the old agent restarted its probe
    helper from the newly installed tree, an agent and a helper of two releases. A helper runs the
    sources the agent read at its start."""
    package = os.path.dirname(os.path.abspath(helper_module.__file__ or ""))
    tree = os.path.join(tmp, "tree")
    shutil.copytree(
        os.path.dirname(package), os.path.join(tree, "hyperlight_agent"), ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        [sys.executable, "-B", "-c", UPGRADED_UNDER_IT, tree, NEXT_RELEASE_PROBE],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first.endswith("no-such-device: host device node is missing"), first
    assert second == f"{first} (started 2 helpers)", "the restarted helper runs the agent's own probe"


def test_the_helper_runs_only_the_sources_it_is_given(tmp: str) -> None:
    """Nothing of ours is on the helper's path: a module missing from SOURCES fails its start."""
    partial = json.loads(helper_module.SOURCES)
    del partial["hyperlight_agent.device.kernel"]
    done = subprocess.run(
        default_argv(),
        input=json.dumps(partial).encode() + b"\n",
        cwd=tmp,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and b"cannot import name 'kernel' from 'hyperlight_agent.device'" in done.stderr, done
