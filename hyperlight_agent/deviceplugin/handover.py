"""Handing the kubelet over to a successor when we are stopped, so that it never counts zero devices.

In a surge update (or when a deleted pod's replacement starts while it terminates) a successor
agent starts beside us under its own socket name (settings.instance), registers, and is ready
while we still serve. On SIGTERM we keep serving until such a successor answers ready (gRPC
health, the readiness service: registered, streamed, healthy), then end our stream:
- kubelets from 1.35 on keep one endpoint per socket path and promote the remaining one when
  ours ends: the resource never drops to zero;
- 1.34 keeps one client per resource, and our stream ending disconnects the newest client as well
  (kubernetes issue 121994, fixed in 1.35): the successor registers again at once, so the gap is
  one Register round trip.
Without a successor within settings.handover_seconds we stop anyway (an uninstall, a drain).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from typing import Callable, Optional

from hyperlight_agent.host import healthcheck

log = logging.getLogger(__name__)

# How often we look for a successor while handing over (bounded by handover_seconds).
POLL_S = 0.1
# A successor answers its health service in milliseconds; one that does not is not ready.
PEER_TIMEOUT_S = 0.5


def peers(kubelet_dir: str, base_socket: str, own: str) -> list[str]:
    """Sockets of other agents for the same resource: hyperlight.sock and hyperlight.<instance>.sock
    (for base hyperlight.sock), never our own."""
    stem, _, suffix = base_socket.rpartition(".")
    try:
        names = sorted(os.listdir(kubelet_dir))
    except OSError:
        return []
    found = []
    for name in names:
        if name == own or not (name == base_socket or (name.startswith(stem + ".") and name.endswith("." + suffix)
                                                       and name.count(".") >= 2)):
            continue
        path = os.path.join(kubelet_dir, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                found.append(path)
        except OSError:
            continue
    return found


async def peer_ready(path: str) -> bool:
    """Whether the agent serving `path` says it is ready (registered, streamed, healthy)."""
    return await healthcheck.peer_ready(path, PEER_TIMEOUT_S)


async def wait_for_successor(kubelet_dir: str, base_socket: str, own: str, timeout: float) -> Optional[str]:
    """The socket path of a ready successor, or None after `timeout` seconds without one."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for path in peers(kubelet_dir, base_socket, own):
            if await peer_ready(path):
                return path
        if loop.time() >= deadline:
            return None
        await asyncio.sleep(min(POLL_S, max(0.0, deadline - loop.time())))


async def drained(in_flight: Callable[[], int], timeout: float) -> bool:
    """Whether in_flight() reached 0 within `timeout` seconds (polled: a stop is the only caller)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while in_flight() > 0:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True
