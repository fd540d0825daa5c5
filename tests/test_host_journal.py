"""Logging (host/journal.py): to the journal only when stderr is the journal, else stderr; one
line per event, with its UTC time or as one JSON object with the entry's fields; debug keeps the
libraries at info. (The agent's process writing its log: test_health_reporting.py.)"""

from __future__ import annotations

import os
import sys

import pytest

from hyperlight_agent.host import journal


def test_journal_only_when_stderr_is_the_journal(tmp: str) -> None:
    with open(os.path.join(tmp, "f"), "w") as f:
        st = os.fstat(f.fileno())
    assert not journal.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    assert not journal.stderr_is_journal({"JOURNAL_STREAM": "garbage"})
    st = os.fstat(sys.stderr.fileno())
    matching = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    assert journal.stderr_is_journal(matching)
    # stderr is the journal: python-systemd's handler if it is installed, else stderr, no error.
    try:
        import systemd.journal  # noqa: F401

        expected = "journal"
    except ImportError:
        expected = "stderr"
    assert journal.setup("info", matching) == expected
    assert journal.setup("info", {}) == "stderr"


def test_log_lines_carry_their_time_or_are_json_and_debug_keeps_libraries_quiet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Outside the journal a line says when (issue 36: 5); `log_format = "json"` makes one object
    per line with the entry's fields; at debug, grpc's internals stay at info."""
    import json
    import logging
    import re

    try:
        journal.setup("debug", {}, {"resource": "hyperlight.dev/hypervisor"})
        logging.getLogger("hyperlight_agent.test").info("status: %s", "ready")
        line = capsys.readouterr().err.strip()
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO: status: ready", line), line
        assert logging.getLogger("grpc").getEffectiveLevel() == logging.INFO
        assert logging.getLogger("hyperlight_agent").getEffectiveLevel() == logging.DEBUG
        journal.setup("info", {}, {"resource": "hyperlight.dev/hypervisor"}, "json")
        logging.getLogger("hyperlight_agent.test").warning("device unhealthy: %s", "gone")
        entry = json.loads(capsys.readouterr().err)
        assert entry["level"] == "warning" and entry["message"] == "device unhealthy: gone"
        assert entry["resource"] == "hyperlight.dev/hypervisor" and entry["time"].endswith("Z")
    finally:
        journal.setup("info", {})
