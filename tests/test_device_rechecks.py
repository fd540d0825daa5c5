"""device/rechecks.py: when a check is followed by another sooner than the next event or
interval, from its outcome alone."""

from __future__ import annotations

from typing import Optional

import pytest

from hyperlight_agent.device.observation import Cause, Observation
from hyperlight_agent.device.rechecks import (
    CDI_RETRY_CAP_S,
    CDI_RETRY_INITIAL_S,
    EXHAUSTED_RETRY_S,
    HELPER_RECHECK_S,
    Rechecks,
)

HEALTHY = Observation(True, "", "kvm")
PROBE_FAILED = Observation(False, "probe helper stalled", "kvm", Cause.PROBE)
CDI_FAILED = Observation(False, "cannot write the spec", "kvm", Cause.CDI)

# (observation or None: inconclusive, helper trouble, spec write failed in a system call) → delay
Step = tuple[Optional[Observation], bool, bool, Optional[float]]


@pytest.mark.parametrize(
    "steps",
    [
        # A helper fault is re-checked promptly once per streak; a passing check ends the streak.
        [
            (PROBE_FAILED, True, False, HELPER_RECHECK_S),
            (PROBE_FAILED, True, False, None),
            (HEALTHY, False, False, None),
            (PROBE_FAILED, True, False, HELPER_RECHECK_S),
        ],
        # An inconclusive check (out of descriptors) is retried soon, and leaves the streak alone.
        [
            (PROBE_FAILED, True, False, HELPER_RECHECK_S),
            (None, False, False, EXHAUSTED_RETRY_S),
            (PROBE_FAILED, True, False, None),
        ],
        # A spec write failing in a system call backs off, doubling to its cap, until one passes.
        [
            (CDI_FAILED, False, True, CDI_RETRY_INITIAL_S),
            (CDI_FAILED, False, True, CDI_RETRY_INITIAL_S * 2),
            (HEALTHY, False, False, None),
            (CDI_FAILED, False, True, CDI_RETRY_INITIAL_S),
        ],
        # A spec that is wrong but not for a system call's failure waits for an event.
        [(CDI_FAILED, False, False, None)],
        # Both at once: the spec's retry replaces the helper's prompt re-check.
        [(CDI_FAILED, True, True, CDI_RETRY_INITIAL_S)],
    ],
)
def test_the_next_check_comes_sooner_only_for_what_no_event_would_announce(steps: list[Step]) -> None:
    rechecks = Rechecks()
    assert [rechecks.after(o, helper, cdi) for o, helper, cdi, _ in steps] == [delay for *_, delay in steps]


def test_the_spec_retry_stops_doubling_at_its_cap() -> None:
    rechecks = Rechecks()
    delays = [rechecks.after(CDI_FAILED, False, True) for _ in range(10)]
    assert delays[-1] == CDI_RETRY_CAP_S and all(d is not None and d <= CDI_RETRY_CAP_S for d in delays)
