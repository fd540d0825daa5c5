"""The one shared observation of the device: versioned, replaced as a whole, broadcast to waiters.

(Not the gRPC health service, nor the exec probe: those are agent.py and healthcheck.py.) The
observation recovers, never a latch: every completed check publishes a fresh
observation, and every ListAndWatch stream wakes when it changes. Create inside the event loop.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Optional


class Cause(str, enum.Enum):
    """What kind of failure an unhealthy observation is (a str: the metrics' label value)."""

    NONE = ""  # healthy
    STARTING = "starting"  # no check has completed yet
    NO_DEVICE = "no-device"
    PROBE = "probe"
    CDI = "cdi"


@dataclass(frozen=True)
class Observation:
    healthy: bool
    # Why the device is unhealthy (empty when healthy); shown in logs, status and RPC errors.
    reason: str
    # The detected hypervisor's name ("kvm", "mshv"), or None when no device exists.
    hypervisor: Optional[str]
    cause: Cause = Cause.NONE


INITIAL = Observation(healthy=False, reason="no device check has completed yet", hypervisor=None, cause=Cause.STARTING)


class SharedObservation:
    """Holds the current Observation; version 0 means no check has completed yet."""

    def __init__(self) -> None:
        self.version = 0
        self.current = INITIAL
        # Conclusive checks published, changed or not (an inconclusive one publishes nothing): a
        # reader that asked for a check tells by it whether one concluded since.
        self.checks = 0
        self._changed = asyncio.Event()

    def publish(self, observation: Observation) -> bool:
        """Record a completed check's result; wakes waiters if it differs. True if it did.

        The first publication always counts as a change: it is what lets streams send their
        first list.
        """
        self.checks += 1
        if observation == self.current and self.version > 0:
            return False
        self.current = observation
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return True

    def republish(self) -> None:
        """Wake every waiter with the same observation (what they derive from it changed)."""
        if self.version > 0:
            self.version += 1
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def wait_newer(self, version: int) -> Observation:
        """Return the current observation once its version is greater than `version`."""
        while self.version <= version:
            await self._changed.wait()
        return self.current
