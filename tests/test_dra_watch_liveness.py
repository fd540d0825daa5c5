"""When a ResourceSlice watch's silence means a dead connection (dra/watch_liveness.py): the
decisions alone, as tables; tests/test_dra_client.py drives them through real watches."""

from __future__ import annotations

import logging

import pytest

from hyperlight_agent.dra.watch_liveness import Bookmarks, Watch

HEARTBEAT, FIRST = 75.0, 60.0


@pytest.mark.parametrize(
    ("bookmarked", "first_due", "heard", "ends", "until"),
    [
        (False, True, 0.0, 300.0, 60.0),  # the first bookmark is due a minute after the answer
        (False, True, 0.0, 30.0, 30.0),  # ...unless the watch ends before
        (False, False, 0.0, 300.0, 300.0),  # not expected: only its end
        (True, True, 100.0, 300.0, 175.0),  # after one, a heartbeat after the last word
        (True, False, 290.0, 300.0, 300.0),  # ...never past its end
    ],
)
def test_a_watch_is_dead_after_its_end_or_its_bookmarks_silence(
    bookmarked: bool, first_due: bool, heard: float, ends: float, until: float
) -> None:
    watch = Watch(0.0, ends, first_due)
    watch.bookmarked, watch.heard = bookmarked, heard
    assert watch.until(HEARTBEAT, FIRST) == until


def test_two_watches_in_a_row_without_a_first_bookmark_stop_expecting_one_until_one_comes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    bookmarks = Bookmarks(HEARTBEAT, FIRST, 5.0)
    assert bookmarks.watch(0.0, 300.0).first_due
    assert not bookmarks.forgiven() and bookmarks.expected, "the first miss: a fresh connection next"
    assert bookmarks.forgiven() and not bookmarks.expected, "the second in a row: the server's way"
    assert not bookmarks.watch(0.0, 300.0).first_due
    assert caplog.text.count("sent no bookmark within 60 s of two watches in a row") == 1
    bookmarks.came()
    assert bookmarks.expected and "sends bookmarks again" in caplog.text
    assert not bookmarks.forgiven(), "counted from the last bookmark: one miss is given up again"


def test_a_miss_between_bookmarks_starts_the_count_again() -> None:
    bookmarks = Bookmarks(HEARTBEAT, FIRST, 5.0)
    assert not bookmarks.forgiven()
    bookmarks.came()
    assert not bookmarks.forgiven() and bookmarks.expected


@pytest.mark.parametrize(
    ("bookmarked", "early", "said"),
    [
        (True, True, "sent nothing for 75 s after a bookmark"),
        (False, True, "sent no bookmark within 60 s of its start"),
        (False, False, "went on 5 s past its timeoutSeconds=290"),
        (True, False, "went on 5 s past its timeoutSeconds=290"),
    ],
)
def test_why_a_watch_was_given_up(bookmarked: bool, early: bool, said: str) -> None:
    assert said in Bookmarks(HEARTBEAT, FIRST, 5.0).why("290", bookmarked, early)
