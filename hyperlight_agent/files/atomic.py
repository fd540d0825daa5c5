"""Replace a file we own so readers see the complete old or the complete new content, and
never replace or remove anything that is not ours.

Write a temp file in the same directory (under a name the file's readers ignore), fsync it,
then put it in place with one renameat2(2) and fsync the directory:
- creating a missing file uses RENAME_NOREPLACE: if anything (a symlink, a directory, another
  writer's file) appeared at the path meanwhile, nothing is replaced;
- replacing a drifted file uses RENAME_EXCHANGE and then looks at what it swapped out: if that
  is not the regular file we inspected (say a symlink planted after we looked), it is swapped
  straight back, so an obstruction is never removed.
Where the filesystem lacks renameat2 flags, link(2) gives the same "create only if absent" and a
re-check just before rename(2) narrows the replace case to a window of microseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import stat
import time
from typing import Callable, NamedTuple, Optional

# <linux/fs.h>: renameat2 flags; AT_FDCWD from <fcntl.h>.
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# Temp files older than this are abandoned (a write takes milliseconds); younger ones may belong
# to a write in progress, ours or another agent's on the same directory.
ABANDONED_AFTER_S = 60.0
# Marks our temp names: <prefix>hlagent-<pid>-<12 hex><suffix>.
_TEMP_TAG = "hlagent"

_renameat2: Optional[Callable[..., int]]
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
except (AttributeError, OSError):  # pragma: no cover - glibc before 2.28, or no libc symbol table
    _renameat2 = None


class Refused(Exception):
    """Something other than our regular file is at a path we own: never followed or replaced."""


class Current(NamedTuple):
    """What is at a path we own: its first bytes and its metadata."""

    data: bytes
    st: os.stat_result

    @property
    def identity(self) -> tuple[int, int]:
        return (self.st.st_dev, self.st.st_ino)


def read_regular(path: str, limit: int) -> Optional[Current]:
    """Up to `limit` bytes and the metadata of the regular file at path, or None if nothing is
    there.

    Raises Refused for a symlink, directory, FIFO or device (the message says which), OSError
    for other failures. Never follows a symlink, never blocks on a FIFO.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{path} is a symlink; refusing to follow or replace it") from exc
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise Refused(f"{path} is a directory; refusing to replace it")
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path} is not a regular file; refusing to replace it")
        chunks: list[bytes] = []
        remaining = limit
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return Current(b"".join(chunks), st)
    finally:
        os.close(fd)


def is_exact(current: Optional[Current], data: bytes, mode: int) -> bool:
    """The file holds exactly `data`, with `mode`, owned by us (whoever wrote it last)."""
    if current is None or current.data != data:
        return False
    st = current.st
    return stat.S_IMODE(st.st_mode) == mode and st.st_uid == os.geteuid() and st.st_gid == os.getegid()


def write(
    directory: str,
    name: str,
    data: bytes,
    temp_prefix: str,
    temp_suffix: str = ".tmp",
    mode: int = 0o644,
    replace: Optional[tuple[int, int]] = None,
) -> None:
    """Atomically make `directory/name` hold `data` with `mode`.

    replace=None: create the file only if nothing is at the path. replace=(st_dev, st_ino):
    replace only that regular file (the one the caller inspected). Raises Refused when
    something else is there by the time we commit (nothing is replaced), OSError otherwise; the
    temp file is removed either way.
    """
    temp = os.path.join(directory, f"{temp_prefix}{_TEMP_TAG}-{os.getpid()}-{secrets.token_hex(6)}{temp_suffix}")
    target = os.path.join(directory, name)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    ours = True  # whether `temp` names something we may delete
    try:
        try:
            os.fchmod(fd, mode)  # the umask must not decide who may read it
            _fill(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace is None:
            _create(temp, target)
        else:
            _replace(temp, target, replace)
    except _StuckSwap:
        ours = False  # an obstruction we swapped out sits at `temp`: it is not ours to delete
        raise Refused(
            f"{target} changed while we were writing it, and could not be put back; it is now at {temp}"
        ) from None
    finally:
        if ours:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)  # gone after a commit; the swapped-out old file after a replace
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _fill(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _rename2(src: str, dst: str, flags: int) -> None:
    if _renameat2 is None:  # pragma: no cover - see the import
        raise OSError(errno.ENOSYS, "renameat2 unavailable")
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), src, dst)  # ENOENT may be either: name both


def rename_noreplace(src: str, dst: str) -> None:
    """Rename src to dst only if nothing is at dst (Refused otherwise); atomic."""
    _create(src, dst)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(src)  # still there only after the link(2) fallback


def exchange(src: str, dst: str) -> bool:
    """Swap the entries at src and dst atomically (True). Where the filesystem cannot, dst is
    replaced by src (False; the caller has just checked what dst is: a window of microseconds)."""
    try:
        _rename2(src, dst, RENAME_EXCHANGE)
    except OSError as exc:
        if not _unsupported(exc):
            raise
        os.rename(src, dst)
        return False
    return True


def _unsupported(exc: OSError) -> bool:
    return exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _create(temp: str, target: str) -> None:
    try:
        _rename2(temp, target, RENAME_NOREPLACE)
    except FileExistsError:
        raise Refused(f"{target} appeared while we were writing it; left as it is") from None
    except OSError as exc:
        if not _unsupported(exc):
            raise
    else:
        return
    try:
        os.link(temp, target)  # never follows or replaces what is at target
    except FileExistsError:
        raise Refused(f"{target} appeared while we were writing it; left as it is") from None


def _replace(temp: str, target: str, expected: tuple[int, int]) -> None:
    try:
        _rename2(temp, target, RENAME_EXCHANGE)
    except FileNotFoundError:
        _create(temp, target)  # it vanished meanwhile: create, still without replacing
        return
    except OSError as exc:
        if not _unsupported(exc):
            raise
        st = os.lstat(target)
        if (st.st_dev, st.st_ino) != expected or not stat.S_ISREG(st.st_mode):
            raise Refused(f"{target} changed while we were writing it; left as it is") from None
        os.rename(temp, target)
        return
    # `temp` now names what was at target. Ours to drop only if it is the file we inspected.
    st = os.lstat(temp)
    if (st.st_dev, st.st_ino) != expected or not stat.S_ISREG(st.st_mode):
        try:
            _rename2(temp, target, RENAME_EXCHANGE)  # put it back; our new file returns to `temp`
        except OSError as exc:
            raise _StuckSwap() from exc
        raise Refused(f"{target} changed while we were writing it; left as it is")


class _StuckSwap(Exception):
    """A swapped-out obstruction could not be swapped back (it is at the temp name)."""


_TEMP_NAME = re.compile(_TEMP_TAG + r"-[0-9]+-[0-9a-f]{12}")


def remove_temps(directory: str, temp_prefix: str, temp_suffix: str = ".tmp", now: Optional[float] = None) -> list[str]:
    """Delete temp files an earlier run of ours abandoned (a crash mid-write); returns their paths.
    Only our exact name pattern and regular files, by remove_abandoned's rules."""

    def ours(name: str) -> bool:
        middle = name[len(temp_prefix) : len(name) - len(temp_suffix)]
        return name.startswith(temp_prefix) and name.endswith(temp_suffix) and bool(_TEMP_NAME.fullmatch(middle))

    return remove_abandoned(directory, ours, lambda st, path: stat.S_ISREG(st.st_mode), now)


def remove_abandoned(
    directory: str,
    ours: Callable[[str], bool],
    kind: Callable[[os.stat_result, str], bool],
    now: Optional[float] = None,
) -> list[str]:
    """Delete what an earlier run of ours left behind in `directory`; returns the paths removed.

    Only names `ours` accepts, only files we own that `kind` accepts (given their lstat and
    path), only once they are older than ABANDONED_AFTER_S: a neighbour's file with a similar
    name, or a write in progress, is left alone.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    now = time.time() if now is None else now
    removed = []
    for name in names:
        if not ours(name):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if st.st_uid == os.geteuid() and now - st.st_mtime >= ABANDONED_AFTER_S and kind(st, path):
                os.unlink(path)
                removed.append(path)
    return removed
