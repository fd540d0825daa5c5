"""Waiting with a deadline without ever losing a cancellation.

asyncio.wait_for before Python 3.12 returns the awaited result, and swallows the cancellation,
when the two arrive together (python/cpython#86296). For a loop such as "wait for a wake-up or a
timeout, then look again" that turns a shutdown's cancel into one more turn of the loop, which
can then run forever: the agent hung on SIGTERM when its own stream ending (a wake-up) coincided
with the cancel. asyncio.wait never swallows a cancellation, so these are built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Awaitable, Callable, Iterable, Optional, TypeVar

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


async def condition(holds: Callable[[], bool], wake: asyncio.Event) -> None:
    """Returns once holds(), looked at again each time `wake` is set (which this clears)."""
    while True:
        wake.clear()
        if holds():
            return
        await wake.wait()


async def event(flag: asyncio.Event, timeout: Optional[float]) -> bool:
    """True once `flag` is set, False after `timeout` seconds."""
    if flag.is_set():
        return True
    try:
        await within(flag.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


async def cancelled(tasks: Iterable[Optional[asyncio.Future[Any]]]) -> None:
    """Cancel each task (None: no task there) and wait until all have ended, whatever they raise."""
    found = [task for task in tasks if task is not None]
    for task in found:
        task.cancel()
    await asyncio.gather(*found, return_exceptions=True)


async def in_thread(fn: Callable[[], T], name: str) -> T:
    """fn() in a daemon thread of its own, awaited on the loop: file work that may block (a hung
    filesystem, a large fsync) without stalling the loop. Not asyncio.to_thread: its executor's
    threads are not daemons, so one stuck in the kernel would hold up the process's exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine, which decides
            _post(loop, future, None, exc)
        else:
            _post(loop, future, result, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def _post(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], result: Optional[T], error: Optional[BaseException]
) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
        loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[T], result: Optional[T], error: Optional[BaseException]) -> None:
    if future.done():
        return  # the waiter was cancelled (shutdown)
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]
