"""When the device is checked again sooner than its next event or interval, decided from each
check's outcome alone (device/checker.py runs the timer): a check that says nothing about the
device is retried soon, a helper fault gets one prompt re-check per streak, and a spec write that
failed in a system call is retried with a short backoff.

    rechecks = Rechecks()
    rechecks.after(observation or None, helper_trouble, cdi_transient) → seconds, or None

Why: docs/decisions/spec-write-retried.md.
"""

from __future__ import annotations

from typing import Optional

from hyperlight_agent.backoff import Backoff
from hyperlight_agent.device.observation import Cause, Observation

# After a check failed because of the helper (stalled, killed, died), check again this soon
# rather than a whole check interval later; once per streak, so a stuck kernel cannot loop us.
HELPER_RECHECK_S = 0.2
# While the spec cannot be written (ENOSPC, a read-only remount, EIO), check again after this,
# doubling up to the cap: when such a cause goes away no inotify event says so, and the slots
# must be Healthy again within about a second, not a check interval later.
CDI_RETRY_INITIAL_S = 0.1
CDI_RETRY_CAP_S = 1.0
# Out of descriptors or memory: the check says nothing about the device, so its result is not
# published (the last one stands); check again this soon.
EXHAUSTED_RETRY_S = 1.0


class Rechecks:
    def __init__(self) -> None:
        self._rechecked = False  # this streak of helper faults had its prompt re-check
        self._cdi_retry = Backoff(CDI_RETRY_INITIAL_S, CDI_RETRY_CAP_S)

    def after(self, observation: Optional[Observation], helper_trouble: bool, cdi_transient: bool) -> Optional[float]:
        """The delay of the next check after one that found `observation` (None: inconclusive,
        out of resources), or None: no sooner than the next event or interval."""
        if observation is None:
            return EXHAUSTED_RETRY_S
        delay: Optional[float] = None
        if not helper_trouble:
            self._rechecked = False
        elif not self._rechecked:
            self._rechecked = True
            delay = HELPER_RECHECK_S
        if observation.cause is Cause.CDI and cdi_transient:
            delay = self._cdi_retry.next()  # the spec's retry replaces the helper's re-check
        else:
            self._cdi_retry.reset()
        return delay
