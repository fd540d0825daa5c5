"""The shared observation of the device (device/observation.py): unhealthy until a check completes,
versioned, replaced whole, and broadcast: every waiter wakes once per change (and on a
republish), none on a repeat of the same observation."""

from __future__ import annotations

import asyncio

from hyperlight_agent.device.observation import INITIAL, Cause, Observation, SharedObservation


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


async def test_a_republish_wakes_every_waiter_with_the_same_observation_but_not_before_a_first_check() -> None:
    state = SharedObservation()
    state.republish()  # nothing checked yet: nothing to wake anyone with
    assert (state.version, state.current) == (0, INITIAL) and state.current.cause is Cause.STARTING
    unhealthy = Observation(False, "KVM_CREATE_VM failed: EPERM", "kvm", Cause.PROBE)
    assert state.publish(unhealthy), "the first publication counts as a change"
    version = state.version
    waiters = [asyncio.ensure_future(state.wait_newer(version)) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    state.republish()
    assert await asyncio.gather(*waiters) == [unhealthy] * 3
    assert state.version == version + 1 and state.current is unhealthy


async def test_the_first_publication_counts_even_when_it_equals_the_initial_observation() -> None:
    state = SharedObservation()
    waiter = asyncio.ensure_future(state.wait_newer(0))
    assert state.publish(INITIAL) and state.version == 1
    assert await waiter == INITIAL
    assert not state.publish(INITIAL) and state.version == 1
