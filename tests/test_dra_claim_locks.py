"""dra/claim_locks.py: one call at a time per claim, others unhindered, no lock kept for a claim
no call uses, and two calls sharing claims in any order never wait for each other in turn."""

from __future__ import annotations

import asyncio

from hyperlight_agent.dra.claim_locks import ClaimLocks
from tests.conftest import until


async def test_a_claim_in_use_waits_and_another_claim_does_not() -> None:
    locks = ClaimLocks()
    release = asyncio.Event()
    order: list[str] = []

    async def call(name: str, uids: list[str], hold: bool) -> None:
        async with locks.held(uids):
            order.append(name)
            if hold:
                await release.wait()

    first = asyncio.ensure_future(call("first", ["a", "b"], hold=True))
    await until(lambda: order == ["first"], what="the first call holding a and b")
    same = asyncio.ensure_future(call("same claim", ["b"], hold=False))
    await asyncio.wait_for(call("other claim", ["c"], hold=False), 5)
    assert order == ["first", "other claim"] and not same.done()
    release.set()
    await asyncio.wait_for(asyncio.gather(first, same), 5)
    assert order == ["first", "other claim", "same claim"] and len(locks) == 0


async def test_calls_sharing_claims_in_opposite_orders_both_finish() -> None:
    locks = ClaimLocks()
    done: list[int] = []

    async def call(n: int, uids: list[str]) -> None:
        async with locks.held(uids):
            await asyncio.sleep(0)  # each holds its locks across a turn of the loop
            done.append(n)

    await asyncio.wait_for(asyncio.gather(*(call(n, ["x", "y"] if n % 2 else ["y", "x"]) for n in range(20))), 5)
    assert sorted(done) == list(range(20)) and len(locks) == 0
