"""Replace a file so readers see the complete old or the complete new content, never a mix.

Write a temp file in the same directory (under a name the file's readers ignore), fsync it,
rename it over the target, fsync the directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets


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
