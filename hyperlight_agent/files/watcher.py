"""inotify on the directories the agent depends on, turned into wake-up calls.

Events are hints, not facts: each callback re-checks the real state (a socket's inode, the
spec's bytes, the device node). So a lost or coalesced event costs only latency, covered by the
periodic check, and our own writes causing events are harmless.

A filesystem mounted over a watched directory raises no inotify event: the mount table's own
change notification (/proc/self/mountinfo) makes the watcher compare each directory with the one
it watches. Nothing runs on a timer unless a directory cannot be watched (yet), or the mount
table cannot be polled.

Why: docs/decisions/watches-follow-their-directory.md and docs/decisions/events-are-hints.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import select
from typing import Any, Callable, Collection, Optional

from asyncinotify import Inotify, Mask

from hyperlight_agent.text import cause

log = logging.getLogger(__name__)

# Entries appearing, vanishing or changing owner/mode, and the directory itself going away.
ENTRIES = (
    Mask.CREATE
    | Mask.DELETE
    | Mask.MOVED_FROM
    | Mask.MOVED_TO
    | Mask.ATTRIB
    | Mask.DELETE_SELF
    | Mask.MOVE_SELF
    | Mask.ONLYDIR
)
# ...and their content being written. Not for device directories: the probe's own
# open(O_RDWR)/close of the device node raises CLOSE_WRITE, which would trigger the next check.
CONTENT = ENTRIES | Mask.CLOSE_WRITE | Mask.MODIFY
# For a directory's parent, to see the directory itself replaced (by a symlink, say) or removed.
NAMES = Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.ONLYDIR
# How often to retry watching a directory that does not exist (yet) or could not be watched; and,
# only where the mount table cannot be polled, to check that each watched path is still the
# directory we watch: a filesystem mounted over it (a tmpfs over the CDI dir, a kubelet dir
# mounted late) raises no inotify event at all.
RETRY_S = 1.0
# Reports EPOLLPRI|EPOLLERR after every mount or unmount in our mount namespace (proc(5)).
MOUNTINFO = "/proc/self/mountinfo"
# A host's pod volumes mount and unmount all the time, and a unit's private mount namespace still
# receives them: a burst of mount changes is looked at once at its start and then at most this
# often (the table is read and parsed each time), so a storm costs a bounded share of a core and
# a change that matters is still seen within this.
MOUNT_INTERVAL_S = 0.1

# callback(name) — name is the entry that changed, or "" when the directory itself did.
Callback = Callable[[str], None]


class MountTable:
    """Calls callback() after mounts or unmounts in our mount namespace: at the first change of
    a burst at once, then at most every `interval` seconds while changes go on.

    /proc/self/mountinfo is always readable (EPOLLIN), and signals a change with EPOLLPRI, which
    asyncio's add_reader cannot ask for: so the file sits in an epoll of its own that waits for
    EPOLLPRI only, and the loop watches that epoll's descriptor. The kernel marks a change as
    seen when the file is polled, which the loop's own readiness check of the inner epoll does:
    nothing needs to be read. Between two calls the loop stops watching the descriptor, so the
    changes of a storm cost no wake-ups: the kernel keeps them pending until it watches again."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None], interval: float = MOUNT_INTERVAL_S
    ) -> None:
        self._loop = loop
        self._callback = callback
        self._interval = interval
        self._last = -interval  # loop.time() of the last call
        self._later: Optional[asyncio.TimerHandle] = None
        self.calls = 0
        self._fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._epoll = select.epoll()
            try:
                self._epoll.register(self._fd, select.EPOLLPRI)  # a regular file: EPERM
                loop.add_reader(self._epoll.fileno(), self._changed)
            except BaseException:
                self._epoll.close()
                raise
        except BaseException:
            os.close(self._fd)
            raise

    def _changed(self) -> None:
        self._epoll.poll(0)  # drains the inner epoll's ready list
        self._loop.remove_reader(self._epoll.fileno())
        due = self._last + self._interval - self._loop.time()
        if due <= 0:
            self._call()
        else:
            self._later = self._loop.call_later(due, self._call)

    def _call(self) -> None:
        self._later = None
        self._last = self._loop.time()
        self.calls += 1
        self._loop.add_reader(self._epoll.fileno(), self._changed)  # changes meanwhile: at once
        self._callback()

    def close(self) -> None:
        if self._later is not None:
            self._later.cancel()
        self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()
        os.close(self._fd)


class _MountWakes:
    """The watcher's side of MountTable: whether the table changed since last asked, and a
    future to wait on for the next change. table is None where it cannot be polled (said once)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._event = asyncio.Event()
        self._wait: Optional[asyncio.Future[Any]] = None
        self.table: Optional[MountTable] = None
        try:
            self.table = MountTable(loop, self._event.set)
        except OSError as exc:
            log.warning(
                "cannot poll %s for mount changes (%s); looking for filesystems mounted over "
                "watched directories every %g s instead",
                MOUNTINFO,
                cause(exc),
                RETRY_S,
            )

    def changed(self) -> bool:
        changed = self._event.is_set()
        self._event.clear()
        return changed

    def waiting(self) -> list[asyncio.Future[Any]]:
        if self.table is None:
            return []
        if self._wait is None or self._wait.done():
            self._wait = asyncio.ensure_future(self._event.wait())
        return [self._wait]

    async def close(self) -> None:
        if self._wait is not None:
            self._wait.cancel()
            await asyncio.wait([self._wait])
        if self.table is not None:
            self.table.close()


_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo escapes space, tab, newline and backslash


def mount_points(mountinfo: str, within: Optional[Collection[str]] = None) -> set[str]:
    r"""The mount points listed in /proc/self/mountinfo's text (field 5, octal escapes decoded);
    with `within`, only those directly in one of these directories (the others are not parsed:
    a busy host lists thousands).

    >>> sorted(mount_points("36 35 0:3 / /dev/kvm rw - devtmpfs udev rw\n37 35 0:4 / /a\\040b rw - tmpfs t rw"))
    ['/a b', '/dev/kvm']
    >>> sorted(mount_points("36 35 0:3 / /dev/kvm rw - devtmpfs udev rw\n37 35 0:4 / /a\\040b rw - t t rw", ["/dev"]))
    ['/dev/kvm']
    """
    # A directory as mountinfo writes it (escaped), followed by "/": a cheap test per line first.
    wanted = None if within is None else {_escape(d.rstrip("/")) + "/" for d in within}
    points = set()
    for line in mountinfo.splitlines():
        if wanted is not None and not any(w in line for w in wanted):
            continue
        fields = line.split(" ")
        if len(fields) > 4:
            point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
            if within is None or os.path.dirname(point) in within:
                points.add(point)
    return points


def _escape(path: str) -> str:
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


def _read_mount_points(within: Collection[str]) -> Optional[set[str]]:
    try:
        with open(MOUNTINFO) as f:
            return mount_points(f.read(), within)
    except OSError:
        return None


class DirectoryWatcher:
    def __init__(self) -> None:
        self._watching: dict[str, tuple[Any, tuple[int, int]]] = {}  # directory → (watch, identity)
        self._wanted: dict[str, list[tuple[Optional[frozenset[str]], Callback]]] = {}
        self._masks: dict[str, Mask] = {}
        self._failed: dict[str, Optional[int]] = {}  # directory → errno of its last failed watch
        self._mount_points: Optional[set[str]] = None  # as last read (from the start of run())

    def watch(
        self,
        directory: str,
        callback: Callback,
        names: Optional[set[str]] = None,
        mask: Mask = ENTRIES,
        follow: bool = True,
    ) -> None:
        """Call callback(name) when an entry in directory changes (only `names` if given).

        follow=False: a symlink at `directory` is never followed: it cannot be watched (it is
        retried like a missing directory), and its target is never watched in its place."""
        directory = os.path.normpath(directory)
        self._wanted.setdefault(directory, []).append((frozenset(names) if names is not None else None, callback))
        self._masks[directory] = self._masks.get(directory, Mask(0)) | mask | (Mask(0) if follow else Mask.DONT_FOLLOW)

    async def run(self) -> None:
        """Watch until cancelled. Missing directories are retried; an unusable inotify
        (no kernel support, watch limits) is logged and the periodic checks carry on alone."""
        try:
            inotify = Inotify()
        except OSError as exc:
            log.warning("inotify unavailable (%s); relying on periodic checks", exc)
            await asyncio.Event().wait()
            return
        # The pending read is ended (and its reader removed) before the inotify fd is closed:
        # closing first left a read callback queued that then failed on the closed fd, logged as
        # an asyncio traceback when a SIGTERM came early.
        reading: list[asyncio.Future[Any]] = []
        try:
            await self._run(inotify, reading)
        finally:
            for task in reading:
                task.cancel()
            if reading:
                await asyncio.wait(reading)
            inotify.close()

    async def _run(self, inotify: Inotify, reading: list[asyncio.Future[Any]]) -> None:
        pending = set(self._wanted)
        loop = asyncio.get_running_loop()
        mounts = _MountWakes(loop)
        self._mount_points = _read_mount_points(self._wanted) if mounts.table is not None else None
        next_look = loop.time()
        try:
            while True:
                # On a mount change; on a timer only while something cannot be watched, or the
                # mount table cannot be polled (then however busy the directories are).
                moved: list[str] = []
                changed = mounts.changed()
                if changed:
                    self._fire_mounted_entries()
                if changed or ((mounts.table is None or pending) and loop.time() >= next_look):
                    next_look = loop.time() + RETRY_S
                    moved = self._unwatch_moved(inotify, pending)
                self._add_pending(inotify, pending, moved)
                if not reading:
                    reading.append(asyncio.ensure_future(inotify.get()))
                timeout = None if mounts.table is not None and not pending else max(0.0, next_look - loop.time())
                await asyncio.wait([*reading, *mounts.waiting()], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if reading[0].done():
                    self._handle(reading.pop().result(), pending)
        finally:
            self._watching.clear()
            await mounts.close()

    def _fire_mounted_entries(self) -> None:
        """Something mounted over (or unmounted from) an entry of a watched directory changes that
        entry without an inotify event (/dev/null bound over /dev/kvm): it counts as a change of
        that entry."""
        points = _read_mount_points(self._wanted)
        if points is None:
            return
        before, self._mount_points = self._mount_points, points
        if before is None:
            return  # not readable at the start: nothing to compare with
        for point in sorted(before ^ points):
            directory, name = os.path.split(point)
            if directory in self._wanted:
                self._fire(directory, name)

    def _unwatch_moved(self, inotify: Inotify, pending: set[str]) -> list[str]:
        """Directories whose path leads elsewhere now (a mount): unwatched, to be watched anew."""
        moved = self._moved(self._watching)
        for directory in moved:
            log.info("%s is another directory now (a mount?); watching it anew", directory)
            with contextlib.suppress(OSError):
                inotify.rm_watch(self._watching.pop(directory)[0])
            pending.add(directory)
        return moved

    def _add_pending(self, inotify: Inotify, pending: set[str], moved: list[str]) -> None:
        for directory in sorted(pending):
            if self._add(inotify, directory, self._watching):
                pending.discard(directory)
                # Anything may have happened while we were not watching.
                self._fire(directory, "")
            elif directory in moved:
                self._fire(directory, "")  # no longer watched: whoever relied on it looks now

    def _handle(self, event: Any, pending: set[str]) -> None:
        if event.mask & Mask.Q_OVERFLOW:  # events were lost: everyone looks
            for directory in self._watching:
                self._fire(directory, "")
            return
        if event.watch is None or event.watch.path is None:
            return
        directory = os.path.normpath(str(event.watch.path))
        if event.mask & (Mask.IGNORED | Mask.DELETE_SELF | Mask.MOVE_SELF):
            current = self._watching.get(directory)
            if current is not None and current[0] is not event.watch:
                return  # the end of a watch we removed (the directory moved): its new one stays
            self._watching.pop(directory, None)
            pending.add(directory)
        self._fire(directory, str(event.name) if event.name else "")

    def watching(self, directory: str) -> bool:
        """Whether `directory` has a live watch now: its events will come (or, lost, an overflow
        or the watch's loss calls every callback of it with "")."""
        return os.path.normpath(directory) in self._watching

    def _add(self, inotify: Inotify, directory: str, watching: dict[str, tuple[Any, tuple[int, int]]]) -> bool:
        try:
            st = self._stat(directory)
            watch = inotify.add_watch(directory, self._masks[directory])
        except OSError as exc:
            # A missing directory is normal (kubelet not started yet); a watch limit or a
            # permission problem is not, and is said once, not at every retry.
            level = logging.DEBUG if exc.errno == errno.ENOENT else logging.WARNING
            if self._failed.get(directory) != exc.errno:
                self._failed[directory] = exc.errno
                log.log(
                    level,
                    "cannot watch %s (%s); retrying every %g s, periodic checks go on",
                    directory,
                    cause(exc),
                    RETRY_S,
                )
            return False
        if self._failed.pop(directory, None) is not None:
            log.info("watching %s", directory)
        watching[directory] = (watch, (st.st_dev, st.st_ino))
        return True

    def _stat(self, directory: str) -> os.stat_result:
        return os.stat(directory, follow_symlinks=not self._masks[directory] & Mask.DONT_FOLLOW)

    def _moved(self, watching: dict[str, tuple[Any, tuple[int, int]]]) -> list[str]:
        moved = []
        for directory, (_, identity) in watching.items():
            try:
                st = self._stat(directory)
            except OSError:
                continue  # gone: the kernel tells us with IGNORED
            if (st.st_dev, st.st_ino) != identity:
                moved.append(directory)
        return moved

    def _fire(self, directory: str, name: str) -> None:
        for names, callback in self._wanted.get(directory, []):
            if not name or names is None or name in names:
                callback(name)
