"""A cancellation that arrives together with the awaited result is never lost: the agent once
hung on SIGTERM because asyncio.wait_for (Python < 3.12) swallowed exactly that."""

from __future__ import annotations

import ast
import asyncio
import os
import sys
from typing import Awaitable, Callable

import pytest

from hyperlight_agent import waits


async def loop_until_cancelled(wait: Callable[[asyncio.Event], Awaitable[object]]) -> bool:
    """A 'wait for a wake-up, look again' loop, woken and cancelled in the same moment.
    True if the cancel ended it."""
    wake = asyncio.Event()

    async def body() -> None:
        while True:
            await wait(wake)
            wake.clear()

    task = asyncio.ensure_future(body())
    await asyncio.sleep(0)  # the task is waiting now
    wake.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1)
    ended = task.cancelled()
    task.cancel()  # tidy up whatever happened
    await asyncio.gather(task, return_exceptions=True)
    return ended


def test_event_wait_never_swallows_a_cancel() -> None:
    assert asyncio.run(loop_until_cancelled(lambda e: waits.event(e, 10)))


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="fixed in 3.12's wait_for")
def test_why_wait_for_is_not_used() -> None:
    """The failure this module exists for, shown on the interpreter that has it."""
    assert not asyncio.run(loop_until_cancelled(lambda e: asyncio.wait_for(e.wait(), 10)))


async def test_within_times_out_and_returns_results() -> None:
    assert await waits.within(asyncio.sleep(0, "done"), 1) == "done"
    with pytest.raises(asyncio.TimeoutError):
        await waits.within(asyncio.sleep(10), 0.01)
    assert not await waits.event(asyncio.Event(), 0.01)


def wait_for_uses(source: str) -> list[int]:
    """Lines of `source` that call or import asyncio.wait_for (under any alias of asyncio)."""
    tree = ast.parse(source)
    aliases = {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.name == "asyncio"
    }
    lines = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr == "wait_for"
        and isinstance(n.value, ast.Name)
        and n.value.id in aliases
    ]
    lines += [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "asyncio" and any(a.name == "wait_for" for a in n.names)
    ]
    return sorted(lines)


def test_wait_for_uses_finds_each_spelling() -> None:
    assert wait_for_uses("import asyncio as aio\nx = aio.wait_for\n") == [2]
    assert wait_for_uses("from asyncio import sleep, wait_for\n") == [1]
    assert wait_for_uses("import asyncio\nasync def f(): await asyncio.wait({t}, timeout=1)\n") == []


def test_no_wait_in_the_package_uses_asyncio_wait_for() -> None:
    # ARCHITECTURE.md: waits with a deadline use waits.py, never asyncio.wait_for.
    from tests.test_layers import PACKAGE

    found = {}
    for name in sorted(os.listdir(PACKAGE)):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE, name)) as f:
                lines = wait_for_uses(f.read())
            if lines:
                found[name] = lines
    assert not found, f"asyncio.wait_for in {found}: use waits.within or waits.event"


async def test_condition_looks_again_on_each_wake_and_returns_once_it_holds() -> None:
    wake, state = asyncio.Event(), {"holds": False, "looked": 0}

    def holds() -> bool:
        state["looked"] += 1
        return bool(state["holds"])

    waiting = asyncio.ensure_future(waits.condition(holds, wake))
    await asyncio.sleep(0)
    wake.set()  # woken, but it does not hold yet
    await asyncio.sleep(0)
    assert not waiting.done() and state["looked"] == 2 and not wake.is_set(), "looked again, and the wake taken"
    state["holds"] = True
    wake.set()
    await asyncio.wait_for(waiting, 5)
    assert state["looked"] == 3


async def test_cancelled_ends_every_task_given_skips_none_and_swallows_what_they_raise() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    async def fails() -> None:
        raise RuntimeError("already failed")

    running, failed = asyncio.ensure_future(forever()), asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    assert failed.done() and not running.done()
    await waits.cancelled([running, None, failed])
    assert running.cancelled() and isinstance(failed.exception(), RuntimeError)
