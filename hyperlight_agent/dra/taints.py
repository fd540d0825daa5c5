"""What an unusable device's taint says in the ResourceSlice, and when it evicts.

    taint_for(observation, effect) → Taint("probe", "NoSchedule"): the key is ours
        (contracts.TAINT_UNUSABLE), the value why (the check's Cause: no-device, probe, cdi)
    Escalation(evict_after_s, clock)
        observe(usable, started) after a completed check; effect() → NoSchedule, or NoExecute once
        a check started evict_after_s after the first failed one was seen failed too, with no
        passing check between (0: never); check_due_in() → seconds until the next check the
        pending eviction runs (None: none pending); inconclusive(asked) when that check
        concluded nothing

Why NoSchedule at once: it only keeps new claims off the device, with the taint as the
scheduler's reason, and goes as soon as a check passes; nothing running is touched.

Why NoExecute only on request, and only after a debounce: the device taint eviction controller
deletes every pod whose claim uses a NoExecute-tainted device and does not tolerate it, and a
deleted sandbox is work lost. A probe can fail for a moment for reasons that are not the device's
(a helper that missed its deadline on a loaded node, a CDI spec being rewritten), and the next
check passes. So the taint turns NoExecute only after the device has been seen unusable for the
whole of `evict_after_s` by checks run within it: while the eviction is pending, a check runs every
evict_after_s / config.EVICT_CHECKS seconds, whatever the check interval (a node that checks every
300 s would otherwise evict 30 s after one failed check, on no further evidence), and only a
failed check that started at the debounce's end or later evicts. No check concluding (a probe
stuck on a loaded node) is no evidence: nothing is evicted until one does. A passing check in
between starts the count again, so a flap shorter than the debounce, or a device flapping faster
than it, evicts nothing (its NoSchedule taint comes and goes, and the metrics and the alert show
the flapping). A device that stays broken is the case the eviction is for: its pods cannot start
a sandbox again anyway, and elsewhere they can. On recovery the taint goes at once, whatever its
effect: what was evicted stays evicted, new pods may come.

Why: docs/decisions/health-where-the-cluster-sees-it.md.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional

from hyperlight_agent import config, contracts
from hyperlight_agent.device.observation import Observation

# What a taint's value says when the check gave no cause (it always does; a value is never empty).
UNKNOWN_CAUSE = "unusable"


class Taint(NamedTuple):
    """Our taint on every device of the slice: its value (why) and its effect."""

    value: str
    effect: str

    def as_json(self) -> dict[str, str]:
        """The DeviceTaint as written (the API server adds timeAdded)."""
        return {"key": contracts.TAINT_UNUSABLE, "value": self.value, "effect": self.effect}


def taint_for(observation: Observation, effect: str = contracts.TAINT_NO_SCHEDULE) -> Optional[Taint]:
    """The taint an observation calls for: none while the device is usable.

    >>> from hyperlight_agent.device.observation import Cause
    >>> taint_for(Observation(False, "/dev/kvm is missing", None, Cause.NO_DEVICE))
    Taint(value='no-device', effect='NoSchedule')
    >>> taint_for(Observation(True, "", "kvm")) is None
    True
    """
    if observation.healthy:
        return None
    return Taint(observation.cause.value or UNKNOWN_CAUSE, effect)


class Escalation:
    """When an unusable device's taint becomes NoExecute, and when the checks that decide it are
    due (see the module's docstring). Times are the clock's."""

    def __init__(self, evict_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.evict_after_s = evict_after_s
        self.clock = clock
        # When this streak's first failed check was seen (no earlier than it started: the
        # debounce counts from then), and the latest start of a failed check since.
        self._unusable_since: Optional[float] = None
        self._failing_at: Optional[float] = None
        # A check asked for concluded nothing: the next one not before this (never in a loop).
        self._retry_at: Optional[float] = None

    def observe(self, usable: bool, started: Optional[float] = None) -> None:
        """A completed check's verdict; `started`: a time it started no earlier than. A failure
        seen without one (a check someone else asked for) only starts a streak: it may have
        started well before it was seen, so it never counts as failing later in the debounce."""
        if started is not None or usable:
            self._retry_at = None
        if usable:
            self._unusable_since = self._failing_at = None
        elif self._unusable_since is None or self._failing_at is None:
            self._unusable_since = self.clock()
            self._failing_at = self._unusable_since if started is None else started
        elif started is not None:
            self._failing_at = max(self._failing_at, started)

    def inconclusive(self, asked: float) -> None:
        """A check asked for at `asked` concluded nothing (stuck, or the agent out of resources):
        no evidence either way, and the next is due a step later, not at once."""
        self._retry_at = asked + self._step()

    def check_due_in(self) -> Optional[float]:
        """Seconds until the next check the pending eviction runs (0: now); None while none is
        pending (no eviction opted in, the device usable, or the taint NoExecute already)."""
        if self._unusable_since is None or self._failing_at is None or not self.evict_after_s or self._evicts():
            return None
        due = min(self._failing_at + self._step(), self._unusable_since + self.evict_after_s)
        if self._retry_at is not None:
            due = max(due, self._retry_at)
        return max(0.0, due - self.clock())

    def _step(self) -> float:
        return self.evict_after_s / config.EVICT_CHECKS

    def effect(self) -> str:
        return contracts.TAINT_NO_EXECUTE if self._evicts() else contracts.TAINT_NO_SCHEDULE

    def _evicts(self) -> bool:
        """A failed check started a whole debounce after the first failure was seen."""
        if not self.evict_after_s or self._unusable_since is None or self._failing_at is None:
            return False
        return self._failing_at - self._unusable_since >= self.evict_after_s
