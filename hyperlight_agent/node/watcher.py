"""inotify on the directories the agent depends on, turned into wake-up calls.

Events are hints, not facts: each callback re-checks the real state (a socket's inode, the
spec's bytes, the device node). So a lost or coalesced event costs only latency, covered by the
periodic check, and our own writes causing events are harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from typing import Any, Callable, Optional

from asyncinotify import Inotify, Mask

log = logging.getLogger(__name__)

# Entries appearing, vanishing or changing owner/mode, and the directory itself going away.
ENTRIES = (Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.ATTRIB
           | Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.ONLYDIR)
# ...and their content being written. Not for device directories: the probe's own
# open(O_RDWR)/close of the device node raises CLOSE_WRITE, which would trigger the next check.
CONTENT = ENTRIES | Mask.CLOSE_WRITE | Mask.MODIFY
# For a directory's parent, to see the directory itself replaced (by a symlink, say) or removed.
NAMES = Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.ONLYDIR
# How often to retry watching a directory that does not exist (yet), and to check that each
# watched path is still the directory we watch: a filesystem mounted over it (a tmpfs over the
# CDI dir, a kubelet dir mounted late) raises no event at all.
RETRY_S = 1.0

# callback(name) — name is the entry that changed, or "" when the directory itself did.
Callback = Callable[[str], None]


class DirectoryWatcher:
    def __init__(self) -> None:
        self._wanted: dict[str, list[tuple[Optional[frozenset[str]], Callback]]] = {}
        self._masks: dict[str, Mask] = {}
        self._failed: dict[str, Optional[int]] = {}  # directory → errno of its last failed watch

    def watch(self, directory: str, callback: Callback,
              names: Optional[set[str]] = None, mask: Mask = ENTRIES, follow: bool = True) -> None:
        """Call callback(name) when an entry in directory changes (only `names` if given).

        follow=False: a symlink at `directory` is never followed: it cannot be watched (it is
        retried like a missing directory), and its target is never watched in its place."""
        directory = os.path.normpath(directory)
        self._wanted.setdefault(directory, []).append(
            (frozenset(names) if names is not None else None, callback))
        self._masks[directory] = self._masks.get(directory, Mask(0)) | mask | (
            Mask(0) if follow else Mask.DONT_FOLLOW)

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
        watching: dict[str, tuple[Any, tuple[int, int]]] = {}  # directory → (watch, identity)
        pending = set(self._wanted)
        loop = asyncio.get_running_loop()
        next_look = loop.time()
        while True:
            if loop.time() >= next_look:  # on a timer, however busy the directories are
                next_look = loop.time() + RETRY_S
                for directory in self._moved(watching):
                    log.info("%s is another directory now (a mount?); watching it anew", directory)
                    with contextlib.suppress(OSError):
                        inotify.rm_watch(watching.pop(directory)[0])
                    pending.add(directory)
            for directory in sorted(pending):
                if self._add(inotify, directory, watching):
                    pending.discard(directory)
                    # Anything may have happened while we were not watching.
                    self._fire(directory, "")
            if not reading:
                reading.append(asyncio.ensure_future(inotify.get()))
            done, _ = await asyncio.wait(reading, timeout=max(0.0, next_look - loop.time()))
            if not done:
                continue
            event = reading.pop().result()
            if event.mask & Mask.Q_OVERFLOW:
                for directory in watching:
                    self._fire(directory, "")
                continue
            if event.watch is None or event.watch.path is None:
                continue
            directory = os.path.normpath(str(event.watch.path))
            if event.mask & (Mask.IGNORED | Mask.DELETE_SELF | Mask.MOVE_SELF):
                watching.pop(directory, None)
                pending.add(directory)
            self._fire(directory, str(event.name) if event.name else "")

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
                log.log(level, "cannot watch %s (%s); retrying every %g s, periodic checks go on",
                        directory, exc.strerror or exc, RETRY_S)
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
