"""Where log lines go: the journal with structured fields under systemd, else stderr, one line
per event: `text` (its UTC time, level and message) or `json` (one object per line, for a
cluster's log pipeline).

python-systemd is optional at run time: without it (or without journald) we log to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import traceback
from typing import Mapping, Optional

from hyperlight_agent import contracts

# Libraries whose debug lines are about their own internals (every HTTP/2 frame, every poll of
# grpc's completion queue): at log_level debug they stay at info, so debug shows the agent's.
QUIET_LIBRARIES = ("grpc", "asyncio", "httpx", "httpcore", "hpack", "h2", "prometheus_client")


# A journal field's name (systemd.journal-fields(7)). A log call gives its entry fields as
# logging's `extra` under such names (`extra={"REASON": …}`): python-systemd's handler sends the
# record's attributes to the journal, which keeps those validly named; json lowercases them.
# The record's own attributes (name, msg, levelname, …) are never upper case.
_FIELD_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def entry_fields(record: logging.LogRecord) -> dict[str, str]:
    """The fields a log call gave its entry (`extra`), by their journal names.

    >>> record = logging.LogRecord("x", logging.INFO, "", 0, "device unhealthy", (), None)
    >>> record.REASON = "gone"
    >>> entry_fields(record)
    {'REASON': 'gone'}
    """
    return {k: str(v) for k, v in vars(record).items() if _FIELD_NAME.fullmatch(k)}


class TextFormatter(logging.Formatter):
    """`2025-01-02T03:04:05.678Z INFO: message` (UTC, milliseconds)."""

    converter = time.gmtime  # type: ignore[assignment]  # typeshed's gmtime has no default argument

    def __init__(self) -> None:
        super().__init__("%(asctime)s.%(msecs)03dZ %(levelname)s: %(message)s", "%Y-%m-%dT%H:%M:%S")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the fields of every entry, the
    entry's own (`extra`, lowercased: REASON is "reason"), and a traceback under "exception" when
    there is one.

    >>> record = logging.LogRecord("hyperlight_agent.agent", logging.INFO, "", 0, "ready: %s", ("kvm",), None)
    >>> record.created = 0.0
    >>> print(JsonFormatter({"resource": "hyperlight.dev/hypervisor"}).format(record))  # doctest: +NORMALIZE_WHITESPACE
    {"time": "1970-01-01T00:00:00.000Z", "level": "info", "logger": "hyperlight_agent.agent",
     "message": "ready: kvm", "resource": "hyperlight.dev/hypervisor"}
    """

    def __init__(self, fields: Optional[Mapping[str, str]] = None) -> None:
        super().__init__()
        self._fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry = {
            "time": f"{stamp}.{int(record.created * 1000) % 1000:03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self._fields,
            **{k.lower(): v for k, v in entry_fields(record).items()},
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def stderr_is_journal(environ: Mapping[str, str]) -> bool:
    """systemd sets JOURNAL_STREAM=<dev>:<inode> when stderr is connected to the journal."""
    value = environ.get(contracts.JOURNAL_STREAM_ENV, "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup(level: str, environ: Mapping[str, str], fields: Optional[Mapping[str, str]] = None, fmt: str = "text") -> str:
    """Configure the root logger; returns "journal" or "stderr". `fields` go on every entry (the
    journal's fields, json's keys)."""
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    kind = "stderr"
    journal = stderr_is_journal(environ)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(fields))
    elif journal:
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))  # the journal stamps it
    else:
        handler.setFormatter(TextFormatter())
    if journal:
        try:
            from systemd.journal import JournalHandler

            handler = JournalHandler(
                SYSLOG_IDENTIFIER="hyperlight-agent", **{k.upper(): v for k, v in (fields or {}).items()}
            )
            kind = "journal"
        except ImportError:
            pass
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)
    return kind


def last_words(logger: logging.Logger, message: str, exc: Optional[BaseException] = None) -> None:
    """An error said just before the process exits (with `exc`'s traceback when given).

    journald files a native message under its sender's unit by reading the sender's /proc entry
    when it gets to the message: from a process that has exited by then (a busy journald, a
    sender that exits at once) the line is filed under no unit, and `journalctl -u` and `systemctl
    status` never show why the unit failed. A line on the stderr stream is filed under the unit
    the stream was opened for, whoever wrote it and however late it is read: under the native
    handler, these words go there, as errors."""
    # setup() left a stream handler (stderr) or python-systemd's (the native socket).
    handlers = logging.getLogger().handlers
    if not handlers or any(isinstance(h, logging.StreamHandler) for h in handlers):
        logger.error("%s", message, exc_info=exc)
        return
    text = message
    if exc is not None:
        text += "\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip("\n")
    sys.stderr.write("".join(f"{contracts.JOURNAL_STREAM_ERR_PREFIX}{line}\n" for line in text.splitlines()))
    sys.stderr.flush()


def set_level(level: str) -> None:
    """The root logger's level (also on a reload); libraries' internals never below info."""
    logging.getLogger().setLevel(level.upper())
    for name in QUIET_LIBRARIES:
        library = logging.getLogger(name)
        library.setLevel(max(library.level, logging.INFO))  # a library set quieter stays so
