"""Unix socket files we serve on, told apart by (device, inode) and held open so that number
stays theirs: whether one is ours, whether anyone is listening on one.

Used by both kubelet protocols (device plugin and DRA registration), which bind a private name
and rename it into place, and remove only the socket they put there.
"""

from __future__ import annotations

import os
import socket
import stat
from typing import Optional

# A live server answers connect() at once; a full backlog or a slow peer counts as live.
CONNECT_TIMEOUT_S = 1.0

Identity = tuple[int, int]


def identity(path: str) -> Optional[Identity]:
    """(device, inode) of a socket at path, or None if there is none. Metadata changes (chmod,
    touch, chown, links) and renames keep it; only another file has another one, provided the
    file we compare with is pinned (see Pin)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


class Pin:
    """A socket file we remember, held open with O_PATH (which a socket allows).

    ext4 and xfs hand a deleted file's inode number to the next file created, so a kubelet.sock
    recreated at once could reuse the old one's (device, inode). While we hold the old inode open
    it cannot be freed, so an equal (device, inode) at the path is this very file. (The ctime
    would tell new files apart too, but it also changes on chmod, touch, chown and hard links,
    which made relabelling tools look like kubelet restarts.)
    """

    def __init__(self, fd: int, identity: Identity) -> None:
        self._fd: Optional[int] = fd
        self.identity = identity

    @classmethod
    def take(cls, path: str) -> Optional[Pin]:
        """Pin the socket at path; None if there is no socket there."""
        try:
            fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return None
        if not stat.S_ISSOCK(st.st_mode):
            os.close(fd)
            return None
        return cls(fd, (st.st_dev, st.st_ino))

    def is_at(self, path: str) -> bool:
        return identity(path) == self.identity

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def is_live(path: str) -> bool:
    """Whether something accepts connections on the unix socket at path (a stale file refuses)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as client:
        client.settimeout(CONNECT_TIMEOUT_S)
        try:
            client.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            # A full backlog, a slow peer, a permission we lack: maybe live, so never ours to take.
            return True
        return True
