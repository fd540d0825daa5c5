"""single_flight.py: every caller gets a run that started after it asked, shared by the callers
that arrived meanwhile; a caller that gives up leaves the run; a closed flight starts nothing."""

from __future__ import annotations

import asyncio

import pytest

from hyperlight_agent.single_flight import SingleFlight
from tests.conftest import until


class Runs:
    """Runs that each end once the test lets one go (release); each returns its number."""

    def __init__(self) -> None:
        self.started = 0
        self._gates: asyncio.Queue[None] = asyncio.Queue()

    def release(self) -> None:
        self._gates.put_nowait(None)

    async def run(self) -> int:
        self.started += 1
        number = self.started
        await self._gates.get()
        return number


async def test_callers_during_a_run_share_the_next_one() -> None:
    runs = Runs()
    flight = SingleFlight(runs.run)
    first = flight.next()
    await until(lambda: runs.started == 1, what="the first run")
    later = [flight.next() for _ in range(5)]
    assert all(f is later[0] for f in later), "one shared next run"
    runs.release()
    assert await first == 1
    await until(lambda: runs.started == 2, what="the next run, as the first ended")
    runs.release()
    assert [await f for f in later] == [2] * 5
    assert runs.started == 2


async def test_a_caller_that_gives_up_leaves_the_run_going() -> None:
    runs = Runs()
    flight = SingleFlight(runs.run)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(flight.next()), 0.01)
    second = flight.next()  # the first run still goes on: this is the next one
    runs.release()
    runs.release()
    assert await second == 2


async def test_a_closed_flight_cancels_its_run_and_waits_and_starts_nothing() -> None:
    runs = Runs()
    flight = SingleFlight(runs.run)
    running = flight.next()
    await until(lambda: runs.started == 1, what="the run")
    waiting = flight.next()
    await flight.closed_and_done()
    assert running.cancelled() and waiting.cancelled()
    assert flight.next().cancelled() and runs.started == 1


async def test_a_run_that_fails_fails_its_callers() -> None:
    async def broken() -> int:
        await asyncio.sleep(0)
        raise OSError("no")

    flight = SingleFlight(broken)
    first, second = flight.next(), flight.next()
    for caller in (first, second):
        with pytest.raises(OSError, match="no"):
            await caller
