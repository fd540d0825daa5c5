"""Replace a file so readers see the complete old or the complete new content, never a mix.

Write a temp file in the same directory (under a name the file's readers ignore), fsync it,
rename it over the target, fsync the directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import Optional


class Refused(Exception):
    """Something other than a regular file is at a path we own: never followed or replaced."""


def read_regular(path: str, limit: int) -> Optional[bytes]:
    """Up to `limit` bytes of the regular file at path, or None if nothing is there.

    Raises Refused for a symlink, directory, FIFO or device (the message says which), OSError
    for other failures. Never follows a symlink, never blocks on a FIFO.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{path} is a symlink; refusing to follow or replace it") from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise Refused(f"{path} is a directory; refusing to replace it")
        if not stat.S_ISREG(mode):
            raise Refused(f"{path} is not a regular file; refusing to replace it")
        chunks: list[bytes] = []
        remaining = limit
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write(directory: str, name: str, data: bytes, temp_prefix: str, temp_suffix: str = ".tmp",
          mode: int = 0o644) -> None:
    """Atomically make `directory/name` hold `data`. Raises OSError (the temp file is removed)."""
    temp = os.path.join(directory, f"{temp_prefix}{secrets.token_hex(6)}{temp_suffix}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask must not decide who may read it
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, os.path.join(directory, name))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_temps(directory: str, temp_prefix: str, temp_suffix: str = ".tmp") -> None:
    """Delete our temp files left behind by a crash mid-write; nothing else is touched."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(temp_prefix) and name.endswith(temp_suffix):
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if os.path.isfile(path) and not os.path.islink(path):
                    os.unlink(path)
