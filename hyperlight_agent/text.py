"""Values and paths in one-line messages: shortened and escaped, so that a hostile or mistaken
input (a megabyte of device ID, a path with a newline) never floods a log or splits a line.

Standard library only: the probe helper imports it.
"""

from __future__ import annotations

import stat

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time (the helper)
if TYPE_CHECKING:
    from typing import Any


def quote(value: Any, limit: int = 60) -> str:
    """repr(value), shortened to about `limit` characters of the value (a string's escapes, up
    to 10 characters each, at most double that).

    >>> quote("kvm-" + "1" * 100, 40)
    "'kvm-111111111111111111111111111111111111'… (104 characters)"
    >>> quote(12)
    '12'
    """
    if isinstance(value, str):
        text, size = repr(value[:limit]), len(value)
        whole = size <= limit
    else:
        text = repr(value)
        size, whole = len(text), len(text) <= limit
        text = text[:limit]
    if len(text) > 2 * limit:
        text, whole = text[: 2 * limit], False
    return text if whole else f"{text}… ({size} characters)"


def shown(text: str, limit: int = 120) -> str:
    """text for a message: non-printable characters escaped (a newline must not split the line);
    a long one keeps its start and its end (a path's end names the file).

    >>> shown("/etc/a\\nb.toml")
    '/etc/a\\\\nb.toml'
    >>> shown("/d/" + "x" * 300, 30)
    '/d/xxxxxxxxxxxxxxxxx…xxxxxxxxxx (303 characters)'
    """
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(text) <= limit:
        return text
    return f"{text[: limit * 2 // 3]}…{text[-(limit // 3) :]} ({len(text)} characters)"


def cause(exc: BaseException) -> str:
    """Why something failed, in one line: the OS's words for an OSError ("Permission denied", not
    "[Errno 13] Permission denied: '/dev/kvm'": the message names the path itself), else the
    exception's own first line, shortened.

    >>> cause(PermissionError(13, "Permission denied", "/dev/kvm")), cause(ValueError("bad\\nrest"))
    ('Permission denied', 'bad')
    """
    strerror = getattr(exc, "strerror", None)
    if isinstance(exc, OSError) and strerror:
        return str(strerror)
    lines = str(exc).splitlines()
    return shown(lines[0], 300) if lines else type(exc).__name__


def file_kind(mode: int) -> str:
    """What kind of file an st_mode is, as a message says it ("/dev/kvm is a directory, not …").

    >>> file_kind(0o040755), file_kind(0o100644), file_kind(0o140777)
    ('a directory', 'a regular file', 'a socket')
    """
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "an unknown kind of file"
