"""Waiting with a deadline without ever losing a cancellation.

asyncio.wait_for before Python 3.12 returns the awaited result, and swallows the cancellation,
when the two arrive together (python/cpython#86296). For a loop such as "wait for a wake-up or a
timeout, then look again" that turns a shutdown's cancel into one more turn of the loop, which
can then run forever: the agent hung on SIGTERM when its own stream ending (a wake-up) coincided
with the cancel. asyncio.wait never swallows a cancellation, so these are built on it.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Optional, TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: Optional[float]) -> T:
    """awaitable's result, or asyncio.TimeoutError after `timeout` seconds (it is cancelled then).
    A cancellation of the caller always propagates (and cancels awaitable too)."""
    if timeout is None:
        return await awaitable  # nothing to race against: a plain await loses no cancellation
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(timeout, 0.0))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})  # let it finish cancelling (a subprocess read, a stream)
        raise asyncio.TimeoutError
    return task.result()


async def event(flag: asyncio.Event, timeout: Optional[float]) -> bool:
    """True once `flag` is set, False after `timeout` seconds."""
    if flag.is_set():
        return True
    try:
        await within(flag.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True
