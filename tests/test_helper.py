"""The bounded probe helper: one long-lived process, killed past its deadline, never more than
one alive, and failing fast while a killed helper cannot be reaped."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from hyperlight_agent.helper import ProbeHelper, default_argv
from tests.procs import alive, my_helpers


def hanging_helper(marker: str) -> list[str]:
    """A helper that answers normally, except it hangs while `marker` exists."""
    code = (
        "import os, sys, time, json\n"
        "for line in sys.stdin:\n"
        "    while os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
        "    sys.stdout.write(json.dumps({'ok': True, 'reason': ''}) + '\\n'); sys.stdout.flush()\n"
    )
    return [sys.executable, "-I", "-S", "-c", code, marker]


def request(kvm_dir: str) -> dict[str, Any]:
    return {"hypervisor": "kvm", "device": os.path.join(kvm_dir, "kvm"), "host": None}


def test_one_long_lived_helper_serves_many_checks(kvm_dir: str) -> None:
    async def run() -> int:
        helper = ProbeHelper()
        for _ in range(20):
            assert await helper.run(request(kvm_dir)) == {"ok": True, "reason": ""}
        assert helper.started == 1
        pid = helper.pid
        assert pid is not None and my_helpers() == [pid]
        await helper.close()
        assert helper.pid is None
        return pid

    pid = asyncio.run(run())
    assert alive([pid]) == []


def test_helper_argv_isolates_from_site_packages_and_writes_no_bytecode() -> None:
    argv = default_argv()
    assert argv[1:4] == ["-I", "-S", "-B"]


def test_deadline_kills_and_replaces_the_helper(tmp: str, kvm_dir: str) -> None:
    marker = os.path.join(tmp, "hang")
    open(marker, "w").close()
    timeouts = []

    async def run() -> None:
        helper = ProbeHelper(argv=hanging_helper(marker), deadline=0.3,
                             on_timeout=lambda: timeouts.append(1))
        reply = await helper.run(request(kvm_dir))
        assert reply == {"ok": False, "reason": "probe did not finish within 0.3 s (helper killed)"}
        assert helper.pid is None
        os.unlink(marker)
        assert (await helper.run(request(kvm_dir)))["ok"]
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
        helper = ProbeHelper(argv=hanging_helper(marker), deadline=0.3,
                             kill=lambda pid, sig: killed.append(pid))
        assert "did not finish" in (await helper.run(request(kvm_dir)))["reason"]
        stuck_pid = helper.dying_pid
        assert stuck_pid is not None and killed == [stuck_pid]
        first = await helper.run(request(kvm_dir))  # spends its budget waiting for the exit
        assert first["reason"] == f"previous probe has not exited (pid {stuck_pid})"
        started = loop.time()
        for _ in range(5):
            again = await helper.run(request(kvm_dir))
            assert again["reason"] == first["reason"]
        assert loop.time() - started < 0.3, "later checks must fail fast, not wait each time"
        assert len(hanging_pids(marker)) == 1, "never more than one helper"
        # The stuck helper finally exits: a check after that reaps it and starts afresh.
        os.unlink(marker)
        os.kill(stuck_pid, 9)
        deadline = loop.time() + 5
        while not (await helper.run(request(kvm_dir)))["ok"]:
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
        assert (await helper.run(request(kvm_dir)))["ok"]  # reaps the cancelled one first
        await helper.close()

    asyncio.run(run())
    assert hanging_pids(marker) == []


def test_helper_that_dies_is_reported_and_replaced(kvm_dir: str) -> None:
    async def run() -> None:
        helper = ProbeHelper(argv=[sys.executable, "-I", "-S", "-c", "import sys; sys.stdin.readline()"])
        reply = await helper.run(request(kvm_dir))
        assert reply == {"ok": False, "reason": "probe helper exited unexpectedly"}
        await helper.close()

    asyncio.run(run())
