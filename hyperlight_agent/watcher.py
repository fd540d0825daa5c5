"""inotify on the directories the agent depends on, turned into wake-up calls.

Events are hints, not facts: each callback re-checks the real state (a socket's inode, the
spec's bytes, the device node). So a lost or coalesced event costs only latency, covered by the
periodic check, and our own writes causing events are harmless.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, Optional

from asyncinotify import Inotify, Mask

log = logging.getLogger(__name__)

# Entries appearing, vanishing or changing owner/mode, and the directory itself going away.
ENTRIES = (Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.ATTRIB
           | Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.ONLYDIR)
# ...and their content being written. Not for device directories: the probe's own
# open(O_RDWR)/close of the device node raises CLOSE_WRITE, which would trigger the next check.
CONTENT = ENTRIES | Mask.CLOSE_WRITE | Mask.MODIFY
# How often to retry watching a directory that does not exist (yet).
RETRY_S = 1.0

# callback(name) — name is the entry that changed, or "" when the directory itself did.
Callback = Callable[[str], None]


class DirectoryWatcher:
    def __init__(self) -> None:
        self._wanted: dict[str, list[tuple[Optional[frozenset[str]], Callback]]] = {}
        self._masks: dict[str, Mask] = {}

    def watch(self, directory: str, callback: Callback,
              names: Optional[set[str]] = None, mask: Mask = ENTRIES) -> None:
        """Call callback(name) when an entry in directory changes (only `names` if given)."""
        directory = os.path.normpath(directory)
        self._wanted.setdefault(directory, []).append(
            (frozenset(names) if names is not None else None, callback))
        self._masks[directory] = self._masks.get(directory, Mask(0)) | mask

    async def run(self) -> None:
        """Watch until cancelled. Missing directories are retried; an unusable inotify
        (no kernel support, watch limits) is logged and the periodic checks carry on alone."""
        try:
            inotify = Inotify()
        except OSError as exc:
            log.warning("inotify unavailable (%s); relying on periodic checks", exc)
            await asyncio.Event().wait()
            return
        with inotify:
            watching: dict[str, object] = {}
            pending = set(self._wanted)
            while True:
                for directory in sorted(pending):
                    try:
                        watching[directory] = inotify.add_watch(directory, self._masks[directory])
                        pending.discard(directory)
                        # Anything may have happened while we were not watching.
                        self._fire(directory, "")
                    except OSError:
                        pass
                try:
                    event = await asyncio.wait_for(inotify.get(), RETRY_S if pending else None)
                except asyncio.TimeoutError:
                    continue
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

    def _fire(self, directory: str, name: str) -> None:
        for names, callback in self._wanted.get(directory, []):
            if not name or names is None or name in names:
                callback(name)
