"""The one retry schedule: doubling to a cap, optional jitter and a 0 s first retry."""

from __future__ import annotations

from hyperlight_agent.backoff import Backoff


def test_backoff_is_capped_jittered_and_never_overflows() -> None:
    backoff = Backoff(rand=lambda: 1.0)
    delays = [backoff.next() for _ in range(5000)]
    assert delays[:7] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert max(delays) == 30.0 and delays[-1] == 30.0
    low = Backoff(rand=lambda: 0.0)
    assert [low.next() for _ in range(3)] == [0.25, 0.5, 1.0]  # jitter: half to full
    assert [Backoff.floor(n) for n in range(3)] == [0.25, 0.5, 1.0]
    backoff.reset()
    assert backoff.next() == 0.5


def test_without_jitter_the_delays_are_exact_and_reset_starts_over() -> None:
    backoff = Backoff(0.1, 1.0)
    assert [backoff.next() for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    backoff.reset()
    assert backoff.next() == 0.1


def test_an_immediate_first_retry_comes_again_after_each_reset() -> None:
    backoff = Backoff(1, 8, immediate_first=True)
    assert [backoff.next() for _ in range(3)] == [0.0, 1, 2]
    backoff.reset()
    assert [backoff.next() for _ in range(2)] == [0.0, 1]
