"""What the slice publisher says (dra/slice_report.py): each problem once per streak, "published
again" once when a streak ends, notices at most once per interval with the repeats counted. (The
publisher saying them in its scenarios: test_dra_slices.py.)"""

from __future__ import annotations

import logging

import pytest

from hyperlight_agent.dra.slice_report import NOTICE_INTERVAL_S, SliceReport


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    said = [r.getMessage() for r in caplog.records]
    caplog.clear()
    return said


def test_a_problem_is_said_once_per_streak_and_the_recovery_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "hyperlight_agent")
    changes: list[str] = []
    report = SliceReport(lambda: 0.0, lambda: changes.append(report.last_error))
    report.problem("relist", "ResourceSlice for node n: conflict")
    report.problem("relist", "ResourceSlice for node n: conflict again")
    report.problem("unreachable", "the API server is unreachable")
    assert lines(caplog) == [
        "ResourceSlice for node n: conflict; retrying with backoff",
        "the API server is unreachable; retrying with backoff",
    ]
    assert report.last_error == "the API server is unreachable"
    report.succeeded("n-hv-x7k2p")
    report.succeeded("n-hv-x7k2p")
    assert lines(caplog) == ["ResourceSlice n-hv-x7k2p published again"] and report.last_error == ""
    assert changes[-1] == "" and len(changes) == 5  # told of every change of last_error
    # Within the same streak a problem already said stays quiet; after the streak it is said again.
    report.problem("relist", "conflict")
    assert lines(caplog) == []
    report.streak_over()
    report.problem("relist", "conflict")
    report.succeeded("n-hv-x7k2p")
    assert lines(caplog) == ["conflict; retrying with backoff", "ResourceSlice n-hv-x7k2p published again"]
    # Success without a streak says nothing.
    report.streak_over()
    report.succeeded("n-hv-x7k2p")
    assert lines(caplog) == []


def test_a_notice_is_said_at_most_once_per_interval_then_with_its_repeats(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "hyperlight_agent")
    now = [100.0]
    report = SliceReport(lambda: now[0], lambda: None)
    report.notice("edited", "ResourceSlice s edited by someone else; restoring")
    report.notice("edited", "ResourceSlice s edited by someone else; restoring")
    report.notice("deleted", "ResourceSlice s was deleted; creating it again")  # its own clock
    now[0] += NOTICE_INTERVAL_S - 1
    report.notice("edited", "ResourceSlice s edited by someone else; restoring")
    assert lines(caplog) == [
        "ResourceSlice s edited by someone else; restoring",
        "ResourceSlice s was deleted; creating it again",
    ]
    now[0] += 1
    report.notice("edited", "ResourceSlice s edited by someone else; restoring")
    report.notice("edited", "ResourceSlice s edited by someone else; restoring")
    assert lines(caplog) == ["ResourceSlice s edited by someone else; restoring (2 more times since it was last said)"]
