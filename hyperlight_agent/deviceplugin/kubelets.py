"""The kubelets the registrar has met, known by their socket's (device, inode): the one our last
successful Register went through, the one our last attempt used, and the one whose stream our stop
ended. From these alone it tells a kubelet restart from a stream lost to the same kubelet.

Each remembered socket is held open (sockets.Pin), so its inode cannot be freed and its number
handed to a new file meanwhile: a restarted kubelet's new socket may otherwise get the old one's.

Why: docs/decisions/a-restart-is-a-different-file.md.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from hyperlight_agent import waits
from hyperlight_agent.files import sockets
from hyperlight_agent.files.sockets import Identity, Pin, Pins

# After ending a stream the kubelet still had open, before registering again with that same kubelet:
# it handles the end asynchronously, and in 1.28 an old stream ending after a new Register
# disconnects the new one (kubernetes issue 121994); later releases mark the resource unhealthy
# instead. A kubelet that restarted meanwhile never knew that stream: no wait then.
STREAM_SETTLE_S = 0.1
# A safety net for when the kubelet directory is not watched (inotify unavailable, the directory
# missing or its watch refused): re-check the sockets this often. While it is watched, events wake
# us instead (an overflow or the watch's loss too), and no timer runs.
VERIFY_INTERVAL_S = 5.0

# Pins' names: the kubelet of our last successful Register, of our last attempt (None: there was
# none; any other one ends a backoff at once, even one that appeared before the backoff began),
# and the one whose stream stop() ended.
SEEN, TRIED, STREAM_ENDED_WITH = "seen", "tried", "stream-ended-with"


class Kubelets:
    def __init__(self, kubelet_socket: str) -> None:
        self.socket = kubelet_socket
        self._pins = Pins()

    def trying(self) -> Optional[Pin]:
        """The kubelet socket there now, remembered as the one our attempt uses (None: none)."""
        return self._pins.put(TRIED, Pin.take(self.socket))

    @property
    def registered_with(self) -> Optional[Identity]:
        return self._pins.identity(SEEN)

    def now(self) -> Optional[Identity]:
        return sockets.identity(self.socket)

    def registered(self, kubelet: Pin) -> bool:
        """Our Register through `kubelet` went through: whether it is a new kubelet (one restarted
        since our last registration; not the first we met)."""
        previous = self._pins.identity(SEEN)
        self._pins.put(SEEN, kubelet)
        return previous is not None and previous != kubelet.identity

    def stream_ended(self) -> None:
        """Our stop ends the stream of the kubelet of our last attempt: remember which."""
        self._pins.put(STREAM_ENDED_WITH, self._pins.get(TRIED))

    async def settle(self) -> None:
        """Before registering again: give a kubelet whose stream our stop ended, if it is still
        the one there, STREAM_SETTLE_S to handle that end."""
        ended = self._pins.get(STREAM_ENDED_WITH)
        if ended is None:
            return
        same_kubelet = ended.is_at(self.socket)
        self._pins.put(STREAM_ENDED_WITH, None)
        if same_kubelet:
            await asyncio.sleep(STREAM_SETTLE_S)

    async def wait_for_new(self, delay: float, wake: asyncio.Event, watched: Callable[[], bool]) -> bool:
        """Sleep `delay`, cut short (True) as soon as a kubelet socket other than our last
        attempt's exists: woken by `wake` (the watcher), or looked at every VERIFY_INTERVAL_S
        while the kubelet directory is not watched()."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        while loop.time() < deadline:
            wake.clear()
            now = self.now()
            if now is not None and now != self._pins.identity(TRIED):
                return True
            left = deadline - loop.time()
            await waits.event(wake, left if watched() else min(left, VERIFY_INTERVAL_S))
        return False
