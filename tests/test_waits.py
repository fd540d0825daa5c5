"""A cancellation that arrives together with the awaited result is never lost: the agent once
hung on SIGTERM because asyncio.wait_for (Python < 3.12) swallowed exactly that."""

from __future__ import annotations

import asyncio
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


def test_within_times_out_and_returns_results() -> None:
    async def run() -> None:
        assert await waits.within(asyncio.sleep(0, "done"), 1) == "done"
        with pytest.raises(asyncio.TimeoutError):
            await waits.within(asyncio.sleep(10), 0.01)
        assert not await waits.event(asyncio.Event(), 0.01)

    asyncio.run(run())
