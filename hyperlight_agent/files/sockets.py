"""Unix socket files we serve on, told apart by (device, inode) and held open so that number
stays theirs: whether one is ours, whether anyone is listening on one, putting a freshly bound
socket in place without taking over a live one, removing only our own, and sweeping the private
names a killed run abandoned.

Used by both kubelet protocols (device plugin and DRA registration): each binds a private name
(which the kubelet's watchers ignore) and renames it into place.

Why: docs/decisions/our-socket.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import stat
from typing import Callable, Optional

from hyperlight_agent.files import atomic
from hyperlight_agent.text import cause, file_kind

log = logging.getLogger(__name__)

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


class Pins:
    """Sockets remembered under several names at once (say, the kubelet we registered with and
    the one we last tried, often the same file): a pin is closed once no name holds it."""

    def __init__(self) -> None:
        self._held: dict[str, Pin] = {}

    def get(self, name: str) -> Optional[Pin]:
        return self._held.get(name)

    def identity(self, name: str) -> Optional[Identity]:
        pin = self._held.get(name)
        return None if pin is None else pin.identity

    def put(self, name: str, new: Optional[Pin]) -> Optional[Pin]:
        """Remember `new` under `name` (None: forget it); returns `new`."""
        old = self._held.pop(name, None)
        if new is not None:
            self._held[name] = new
        if old is not None and all(old is not p for p in self._held.values()):
            old.close()
        return new


def not_a_socket(path: str, owner: str) -> str:
    """Why there is no socket of `owner`'s (as "kubelet") to connect to at path."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return f"no {owner} socket at {path}"
    except OSError as exc:
        return f"cannot look at {path}: {cause(exc)}"
    return f"{path} is {file_kind(mode)}, not the {owner}'s socket"


def listing(directory: str, wanted: Callable[[str], bool]) -> list[str]:
    """The sockets in `directory` (sorted by name) whose names are `wanted` ([] when it cannot be
    read): what might be another instance's, for peers.py to ask."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(directory, name)
        if wanted(name) and identity(path) is not None:
            found.append(path)
    return found


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


class NotPlaced(Exception):
    """Our socket could not be put at its path; the message names the path and why."""


class InUse(NotPlaced):
    """A live server (another agent) listens at the path: it is never taken over."""


def put_in_place(private: str, path: str) -> Pin:
    """Rename our freshly bound socket at `private` to `path`, never over a live one or anything
    that is not a socket; a stale socket (no one listening) is swapped out. Returns ours, pinned.

    Anything at either path may vanish at any moment (a starting kubelet removes every socket in
    its directory, our private one included): a vanished path is a changed path, so we look again.
    Raises InUse, or NotPlaced (then `private` may be gone: bind anew).
    """
    mine = identity(private)
    for _ in range(3):  # each retry follows a concurrent change at our path
        if mine is None or identity(private) != mine:
            raise NotPlaced(
                f"{private}: our socket was removed before it was put in place (a kubelet starting?); serving anew"
            )
        existing = identity(path)
        if existing is None:
            if os.path.lexists(path):
                raise NotPlaced(f"{path} exists and is not a socket; not replacing it")
            try:
                atomic.rename_noreplace(private, path)
            except (atomic.Refused, FileNotFoundError):
                continue  # something appeared at our path, or our private socket vanished
            return _pinned(path, mine)
        if is_live(path):
            raise InUse(f"{path}: another agent is serving it; not taking it over")
        # A stale socket: swap ours in, and drop it only if it is the stale one we probed.
        try:
            exchanged = atomic.exchange(private, path)
        except FileNotFoundError:
            continue  # the stale socket (or ours) vanished meanwhile: look again
        swapped_out = identity(private)
        if not exchanged or swapped_out in (existing, None):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(private)
            log.info("replaced a stale socket at %s", path)
            return _pinned(path, mine)
        with contextlib.suppress(FileNotFoundError):
            atomic.exchange(private, path)  # not what we probed: put it back
        mine = identity(private)
    raise NotPlaced(f"{path} keeps changing; not serving there")


def _pinned(path: str, mine: Identity) -> Pin:
    placed = Pin.take(path)
    if placed is None or placed.identity != mine:
        if placed is not None:
            placed.close()
        raise NotPlaced(f"{path} changed right after we put our socket there")
    return placed


def remove_ours(pin: Optional[Pin], path: str) -> None:
    """Unlink the socket at path if it is still the one `pin` holds; anything someone put there
    instead stays. The pin is closed."""
    if pin is None:
        return
    if pin.is_at(path):
        try:
            os.unlink(path)
        except OSError as exc:
            log.warning("cannot remove %s: %s", path, cause(exc))
    elif os.path.lexists(path):
        log.info("%s is no longer our socket; leaving it", path)
    pin.close()


def sweep(directory: str, private_name: re.Pattern[str]) -> None:
    """Remove private sockets an earlier run of ours abandoned between bind and rename, by the
    rules for temp files (atomic.remove_abandoned): our exact name pattern, a socket we own, older
    than atomic.ABANDONED_AFTER_S, and no one listening. A neighbour's similar name is never ours."""
    for path in atomic.remove_abandoned(
        directory,
        lambda name: bool(private_name.fullmatch(name)),
        lambda st, path: stat.S_ISSOCK(st.st_mode) and not is_live(path),
    ):
        log.info("removed abandoned socket %s", path)
