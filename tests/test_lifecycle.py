"""The agent's phases: a stop's handover happens once, and only for a running agent."""

from __future__ import annotations

import asyncio

import pytest

from hyperlight_agent.lifecycle import Lifecycle, Phase


async def test_the_first_close_hands_over_then_stops_and_a_later_one_does_nothing() -> None:
    life = Lifecycle()
    seen: list[Phase] = []

    async def hand_over(stopped_again: asyncio.Event) -> None:
        seen.append(life.phase)
        assert not stopped_again.is_set()
        assert not await life.begin_stopping(hand_over), "a close during the handover does nothing"

    assert life.may_upgrade and life.speaking
    assert await life.begin_stopping(hand_over)
    assert seen == [Phase.HANDING_OVER]
    assert life.phase is Phase.STOPPING and not life.speaking and not life.may_upgrade
    assert not await life.begin_stopping(hand_over)
    assert seen == [Phase.HANDING_OVER], "no second handover"


async def test_an_agent_its_upgrade_replaced_stops_without_a_handover() -> None:
    life = Lifecycle()
    life.handed_over()
    assert not life.may_upgrade and life.speaking
    await life.until_stopped([])  # handed_over asked the stop

    async def hand_over(stopped_again: asyncio.Event) -> None:
        raise AssertionError("the child has the kubelet already")

    assert await life.begin_stopping(hand_over)
    assert life.phase is Phase.STOPPING


async def test_a_second_stop_ends_the_handover_wait() -> None:
    life = Lifecycle()

    async def hand_over(stopped_again: asyncio.Event) -> None:
        life.stop()
        assert not stopped_again.is_set(), "the first stop only ends the wait for a stop"
        life.stop()
        await asyncio.wait_for(stopped_again.wait(), 5)

    assert await life.begin_stopping(hand_over)


async def test_a_task_ending_before_the_stop_is_raised() -> None:
    life = Lifecycle()

    async def fails() -> None:
        raise ValueError("broken part")

    with pytest.raises(ValueError, match="broken part"):
        await life.until_stopped([asyncio.ensure_future(fails())])

    async def returns() -> None:
        return None

    with pytest.raises(RuntimeError, match="ended unexpectedly"):
        await life.until_stopped([asyncio.ensure_future(returns())])
