"""What an unusable device's taint says in the ResourceSlice, and when it evicts.

    taint_for(observation, effect) → Taint("probe", "NoSchedule"): the key is ours
        (contracts.TAINT_UNUSABLE), the value why (the check's Cause: no-device, probe, cdi)
    Escalation(evict_after_s, clock)
        observe(usable) after every completed check; effect() → NoSchedule, or NoExecute once the
        device has been unusable for evict_after_s with no passing check between (0: never);
        due_in() → seconds until that moment, for a timer

Why NoSchedule at once: it only keeps new claims off the device, with the taint as the
scheduler's reason, and goes as soon as a check passes; nothing running is touched.

Why NoExecute only on request, and only after a debounce: the device taint eviction controller
deletes every pod whose claim uses a NoExecute-tainted device and does not tolerate it, and a
deleted sandbox is work lost. A probe can fail for a moment for reasons that are not the device's
(a helper that missed its deadline on a loaded node, a CDI spec being rewritten), and the next
check passes. So the taint turns NoExecute only after the device has been unusable for the whole
of `evict_after_s`: a passing check in between starts the count again, so a flap shorter than the
debounce, or a device flapping faster than it, evicts nothing (its NoSchedule taint comes and goes,
and the metrics and the alert show the flapping). A device that stays broken is the case the
eviction is for: its pods cannot start a sandbox again anyway, and elsewhere they can. On
recovery the taint goes at once, whatever its effect: what was evicted stays evicted, new pods
may come.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional

from hyperlight_agent import contracts
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
    """When an unusable device's taint becomes NoExecute (see the module's docstring)."""

    def __init__(self, evict_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.evict_after_s = evict_after_s
        self._clock = clock
        self._unusable_since: Optional[float] = None  # the first failed check of this streak

    def observe(self, usable: bool) -> None:
        """A completed check's verdict."""
        if usable:
            self._unusable_since = None
        elif self._unusable_since is None:
            self._unusable_since = self._clock()

    def due_in(self) -> Optional[float]:
        """Seconds until the taint turns NoExecute (0: it has), None while it never will."""
        if not self.evict_after_s or self._unusable_since is None:
            return None
        return max(0.0, self._unusable_since + self.evict_after_s - self._clock())

    def effect(self) -> str:
        return contracts.TAINT_NO_EXECUTE if self.due_in() == 0 else contracts.TAINT_NO_SCHEDULE
