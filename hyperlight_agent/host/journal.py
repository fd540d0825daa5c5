"""Where log lines go: the journal with structured fields under systemd, else concise stderr.

python-systemd is optional at run time: without it (or without journald) we log to stderr.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping, Optional

from hyperlight_agent import contracts


def stderr_is_journal(environ: Mapping[str, str]) -> bool:
    """systemd sets JOURNAL_STREAM=<dev>:<inode> when stderr is connected to the journal."""
    value = environ.get(contracts.JOURNAL_STREAM_ENV, "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup(level: str, environ: Mapping[str, str], fields: Optional[Mapping[str, str]] = None) -> str:
    """Configure the root logger; returns "journal" or "stderr". `fields` go on every entry."""
    handler: logging.Handler
    kind = "stderr"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    if stderr_is_journal(environ):
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
    root.setLevel(level.upper())
    return kind
