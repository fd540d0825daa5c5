"""Values and paths in one-line messages (text.py), for any input: what `shown` and `quote` give is
one printable line, bounded in length, whole where the input fits (a quoted value reads back as
itself) and saying the input's length where it was shortened; `cause` is one line in the OS's
words. (The docstrings' examples: test_doctests.py.)"""

from __future__ import annotations

import ast
import errno
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from hyperlight_agent.text import cause, quote, shown
from tests.conftest import fuzz_budget


def escaped(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@settings(max_examples=fuzz_budget(500))
@given(st.text(), st.integers(min_value=3, max_value=300))
def test_shown_is_one_printable_line_keeping_the_start_and_end_of_a_long_text(text: str, limit: int) -> None:
    line = shown(text, limit)
    assert line.isprintable(), "no newline or control character splits the message"
    whole = escaped(text)
    if len(whole) <= limit:
        assert line == whole
    else:
        suffix = f" ({len(whole)} characters)"
        assert line.endswith(suffix) and len(line) == limit * 2 // 3 + 1 + limit // 3 + len(suffix)
        assert line.startswith(whole[: limit * 2 // 3]) and line[: -len(suffix)].endswith(whole[-(limit // 3) :])


@settings(max_examples=fuzz_budget(500))
@given(st.one_of(st.text(), st.integers(), st.lists(st.text())), st.integers(min_value=1, max_value=200))
def test_quote_is_bounded_and_a_whole_string_reads_back_as_itself(value: object, limit: int) -> None:
    line = quote(value, limit)
    assert "\n" not in line
    size = len(value) if isinstance(value, str) else len(repr(value))
    suffix = f"… ({size} characters)"
    assert len(line) <= 2 * limit + len(suffix)
    if not line.endswith(suffix):
        assert ast.literal_eval(line) == value


def test_cause_is_the_os_words_or_the_first_line_or_the_type() -> None:
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/dev/kvm")
    assert cause(denied) == "Permission denied", "the message names the path itself"
    assert cause(ValueError("bad value\nTraceback: more")) == "bad value"
    assert cause(RuntimeError()) == "RuntimeError"
    assert cause(OSError("no errno here")) == "no errno here"
    long = cause(ValueError("x" * 1000))
    assert len(long) < 400 and long.endswith("(1000 characters)")
