"""What the slice publisher (dra/slices.py) says of its failures and of what others do to its
slice, so that a retry loop or a fighting editor never floods the log: each distinct problem once
per streak of failures, "published again" once when a streak ends, and a notice (an edit, a
deletion, a duplicate) at most once per NOTICE_INTERVAL_S, then with how often it happened
meanwhile.

    report.problem("relist", line)   a failure (kept as last_error; said if new in this streak)
    report.succeeded(slice_name)     a read or write succeeded: last_error is ""
    report.streak_over()             a whole watch without trouble: the next streak starts afresh
    report.notice("edited", line)    something others did that we answer
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)

# "Edited by someone else" and the like: said once per this long, with a count of the repeats.
NOTICE_INTERVAL_S = 600.0


class SliceReport:
    """`last_error`: the last failure's line, "" once a read or write succeeded again;
    `on_change` is told when it may have changed."""

    def __init__(self, clock: Callable[[], float], on_change: Callable[[], None]) -> None:
        self._clock = clock
        self._on_change = on_change
        self._logged: set[str] = set()  # problems said in this streak of failures
        self._said_recovered = False  # "published again" said in this streak
        self._notices: dict[str, tuple[float, int]] = {}  # notice → (when last said, repeats since)
        self.last_error = ""

    def problem(self, problem: str, line: str) -> None:
        self.last_error = line
        self._on_change()
        if problem not in self._logged:
            self._logged.add(problem)
            self._said_recovered = False
            log.warning("%s; retrying with backoff", line)

    def succeeded(self, slice_name: str) -> None:
        if self._logged and not self._said_recovered:
            self._said_recovered = True
            log.info("ResourceSlice %s published again", slice_name)
        self.last_error = ""
        self._on_change()

    def streak_over(self) -> None:
        self._logged.clear()
        self._said_recovered = False

    def notice(self, key: str, line: str) -> None:
        now = self._clock()
        said, repeats = self._notices.get(key, (None, 0))
        if said is not None and now - said < NOTICE_INTERVAL_S:
            self._notices[key] = (said, repeats + 1)
            log.debug("%s", line)
            return
        self._notices[key] = (now, 0)
        log.warning("%s%s", line, f" ({repeats} more times since it was last said)" if repeats else "")


__all__ = ["NOTICE_INTERVAL_S", "SliceReport"]
