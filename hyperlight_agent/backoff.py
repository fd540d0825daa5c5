"""Capped exponential backoff: the one retry schedule of every part that retries (registration
with the kubelet, the DRA driver's start, the ResourceSlice publisher, the metrics listener, a
CDI spec write). Standard library only."""

from __future__ import annotations

import random
from typing import Callable, Optional

# Retrying against the kubelet or the API server: 0.5, 1, 2 … 30 s.
INITIAL_S = 0.5
CAP_S = 30.0

# The jitter source registration uses: agents woken together by one kubelet restart (every plugin
# on the node) must not retry in step.
JITTER: Callable[[], float] = random.random


class Backoff:
    """Delays doubling from `initial` up to `cap`; reset() starts over.

    With `rand`, each delay is scaled by 0.5–1.0 (0.5 + rand()/2); with `immediate_first`, a 0 s
    retry comes before those (and again after each reset).

    >>> b = Backoff(1, 4)
    >>> [b.next() for _ in range(4)]
    [1, 2, 4, 4]
    >>> Backoff(1, 4, immediate_first=True).next()
    0.0
    """

    def __init__(
        self,
        initial: float = INITIAL_S,
        cap: float = CAP_S,
        rand: Optional[Callable[[], float]] = None,
        immediate_first: bool = False,
    ) -> None:
        self._initial, self._cap, self._rand = initial, cap, rand
        self._immediate_first = immediate_first
        self._immediate_due = immediate_first
        self.attempt = 0

    def next(self) -> float:
        if self._immediate_due:
            self._immediate_due = False
            return 0.0
        base: float = min(self._cap, self._initial * (2**self.attempt))
        if base < self._cap:  # past the cap the exponent stops growing (and cannot overflow)
            self.attempt += 1
        return base if self._rand is None else base * (0.5 + 0.5 * float(self._rand()))

    def reset(self) -> None:
        self.attempt = 0
        self._immediate_due = self._immediate_first

    @staticmethod
    def floor(attempt: int, initial: float = INITIAL_S, cap: float = CAP_S) -> float:
        """The shortest wait the attempt-th jittered retry can have (jitter at its lowest)."""
        return 0.5 * min(cap, initial * 2.0**attempt)
