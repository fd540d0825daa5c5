"""One run of a coroutine at a time, shared: every caller gets a run that started after it asked.

    flight = SingleFlight(run)      run: an async function, called with no arguments
    await flight.next()             the result of a run that starts after this call
    flight.close()                  no new runs; the running one and every wait are cancelled
    await flight.closed_and_done()  close(), then until the running one has ended

A run already going may have started before the caller's reason to ask, so a caller arriving
meanwhile waits for the run after it, which every such caller shares: a burst of callers costs at
most two runs per run's time. The running one belongs to no caller: a caller that gives up (its
own cancellation, a deadline) leaves it alone, as asyncio.shield around next() keeps it.

Why: docs/decisions/single-flight-checks.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self, run: Callable[[], Awaitable[T]]) -> None:
        self._run = run
        self._running: Optional[asyncio.Task[T]] = None
        self._next: Optional[asyncio.Future[T]] = None  # the callers' share of the run after it
        self.closed = False

    def next(self) -> asyncio.Future[T]:
        """A run that starts after now: the one started at once when none runs, else the next."""
        if self.closed:  # shutting down: nothing new starts
            refused: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            refused.cancel()
            return refused
        if self._running is None:
            return self._start()
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    def close(self) -> None:
        """Refuse new runs, and cancel the running one and the callers waiting for the next."""
        self.closed = True
        if self._next is not None:
            self._next.cancel()
        if self._running is not None:
            self._running.cancel()

    async def closed_and_done(self) -> None:
        self.close()
        if self._running is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._running

    def _start(self) -> asyncio.Task[T]:
        task = asyncio.ensure_future(self._run())
        task.add_done_callback(self._finished)
        self._running = task
        return task

    def _finished(self, task: asyncio.Task[T]) -> None:
        self._running = None
        waiting, self._next = self._next, None
        if waiting is None or waiting.done():
            return
        if self.closed or task.cancelled():
            waiting.cancel()
            return
        self._start().add_done_callback(lambda t: _forward(t, waiting))


def _forward(source: asyncio.Task[T], target: asyncio.Future[T]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())  # type: ignore[arg-type]
    else:
        target.set_result(source.result())
