"""Logging (host/journal.py): to the journal only when stderr is the journal, else stderr; one
line per event, with its UTC time or as one JSON object with the entry's fields; debug keeps the
libraries at info. (The agent's process writing its log: test_health_reporting.py.)"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import types
from typing import Any

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


def documented_log_fields() -> list[tuple[str, str, str]]:
    """docs/agent.md's log-fields table: (journal field, JSON key, on which entries), each row."""

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "agent.md")) as f:
        text = f.read()
    found = re.search(r"<!-- log-fields:[^\n]*-->\n(.*?)<!-- end log-fields -->", text, re.S)
    assert found, "docs/agent.md has no log-fields table"
    rows = [line.strip("|").split("|") for line in found.group(1).splitlines()[2:]]
    return [(a.strip(), b.strip(), c.strip()) for a, b, c in rows]


def health_change(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real Checker's health change (a fake probe helper fails kvm), logged as the agent logs it."""
    import asyncio

    from hyperlight_agent.device.checker import Checker, CheckTarget
    from hyperlight_agent.device.helper import ProbeResult
    from hyperlight_agent.device.observation import SharedObservation
    from tests.fakes import FakeHelper, device_dir, files_as_devices

    files_as_devices(monkeypatch)
    helper = FakeHelper({"kvm": ProbeResult(False, "KVM_CREATE_VM failed")})
    target = CheckTarget(device_dir(tmp, "kvm"), None, os.path.join(tmp, "cdi"), 65534, 65534)
    checker = Checker(target, helper, SharedObservation())  # type: ignore[arg-type]
    assert not asyncio.run(checker.check()).healthy


def test_a_health_changes_json_line_and_journal_fields_carry_every_documented_field(
    tmp: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/agent.md's log-fields table is what a health change's entry carries, in both forms (issue 50:
    3): the JSON line had only the fields of every entry, dropping the entry's own."""

    from hyperlight_agent import cli, config

    documented = documented_log_fields()
    assert {journal_name for journal_name, _, _ in documented} >= {"RESOURCE", "HYPERVISOR", "REASON"}
    every = cli.log_fields(config.Settings.defaults(cdi_dir=os.path.join(tmp, "cdi")))
    try:
        journal.setup("info", {}, every, "json")
        health_change(tmp, monkeypatch)
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        entry = next(e for e in lines if e["message"].startswith("device unhealthy"))
        assert entry["reason"] == "KVM_CREATE_VM failed" and entry["hypervisor"] == "kvm"
        assert entry["device_path"] == os.path.join(tmp, "dev", "kvm")
        missing = [key for _, key, _ in documented if key not in entry]
        assert not missing, f"the JSON line lacks {missing}: {entry}"

        # The journal: python-systemd's JournalHandler, at the seam setup() imports it from, is
        # given the fields of every entry when made and each record to emit; it sends the record's
        # attributes, of which journald keeps those with a valid field name.
        given, emitted = fake_journal_handler(monkeypatch)
        assert journal.setup("info", {}, every, "text") == "journal"
        health_change(os.path.join(tmp, "again"), monkeypatch)
        record = next(r for r in emitted if r.getMessage().startswith("device unhealthy"))
        sent = {**given, **{k: v for k, v in vars(record).items() if re.fullmatch(r"[A-Z][A-Z0-9_]*", k)}}
        missing = [name for name, _, _ in documented if name not in sent]
        assert not missing, f"the journal entry lacks {missing}: {sent}"
        assert sent["REASON"] == "KVM_CREATE_VM failed" and sent["CDI_PATH"] == every["cdi_path"]
    finally:
        journal.setup("info", {})


def fake_journal_handler(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[logging.LogRecord]]:
    """python-systemd's JournalHandler, at the seam setup() imports it from, with stderr taken for
    the journal: what the handler was given when made, and each record it was to send."""
    given: dict[str, Any] = {}
    emitted: list[logging.LogRecord] = []

    class JournalHandler(logging.Handler):
        def __init__(self, **fields: str) -> None:
            super().__init__()
            given.update(fields)

        def emit(self, record: logging.LogRecord) -> None:
            emitted.append(record)

    fake = types.ModuleType("systemd.journal")
    fake.JournalHandler = JournalHandler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "systemd", types.ModuleType("systemd"))
    monkeypatch.setitem(sys.modules, "systemd.journal", fake)
    monkeypatch.setattr(journal, "stderr_is_journal", lambda environ: True)
    return given, emitted


def test_last_words_go_on_the_stream_under_the_journal_else_to_the_log(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line said just before exit: on the journal's stderr stream, as errors, traceback and all
    (journald files a native message from an exited sender under no unit: test_systemd.py shows
    it); without the journal, an error entry like any other."""
    log = logging.getLogger("hyperlight-agent")

    def fail() -> None:
        raise RuntimeError("broken on purpose")

    try:
        fail()
    except RuntimeError as caught:
        exc = caught
    try:
        _, emitted = fake_journal_handler(monkeypatch)
        assert journal.setup("info", {}) == "journal"
        journal.last_words(log, "fatal: broken on purpose", exc)
        lines = capsys.readouterr().err.splitlines()
        assert emitted == []
        assert lines[0] == "<3>fatal: broken on purpose" and lines[-1] == "<3>RuntimeError: broken on purpose"
        assert all(line.startswith("<3>") for line in lines) and any("Traceback" in line for line in lines)

        monkeypatch.setattr(journal, "stderr_is_journal", lambda environ: False)
        assert journal.setup("info", {}) == "stderr"
        journal.last_words(log, "fatal: broken on purpose")
        (line,) = capsys.readouterr().err.splitlines()
        assert line.endswith("ERROR: fatal: broken on purpose") and "<3>" not in line
    finally:
        journal.setup("info", {})
