"""Handing the kubelet over to a successor when we are stopped, so that it never counts zero devices.

In a surge update (or when a deleted pod's replacement starts while it terminates) a successor
agent starts beside us under its own socket name (settings.instance), registers, and is ready
while we still serve. On SIGTERM we keep serving until such a successor answers ready (peers.py:
an agent of ours for the same resource, registered, streamed, healthy), then end our stream:
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
from typing import Callable, Optional

import grpc

from hyperlight_agent import contracts, peers, transport
from hyperlight_agent.deviceplugin import api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.files import sockets
from hyperlight_agent.host import healthcheck

log = logging.getLogger(__name__)


def candidates(kubelet_dir: str, base_socket: str, own: str) -> list[str]:
    """Sockets that may be other agents for the same resource: hyperlight.sock and
    hyperlight.<instance>.sock (for base hyperlight.sock), never our own. Whether one is an agent
    of ours is for peers.py to find out."""
    return sockets.listing(
        kubelet_dir, lambda name: name != own and contracts.is_instance_socket_name(name, base_socket)
    )


async def legacy_ready(path: str, timeout: float) -> bool:
    """An agent of an earlier release (no Describe): a device plugin (it answers
    GetDevicePluginOptions) whose gRPC health says it is ready."""
    async with grpc.aio.insecure_channel(transport.unix_target(path)) as channel:
        try:
            await api.device_plugin_stub(channel).GetDevicePluginOptions(pb.Empty(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
    return await healthcheck.peer_ready(path, timeout)


async def wait_for_successor(
    me: peers.Identity,
    kubelet_dir: str,
    base_socket: str,
    own: str,
    timeout: float,
    pid: Optional[int] = None,
    ready: bool = True,
) -> Optional[str]:
    """The socket path of a ready successor (with `pid`, that process; without `ready`, one that
    answers), or None after `timeout` seconds without one."""
    deadline = asyncio.get_running_loop().time() + timeout
    return await peers.successor(
        me,
        lambda: candidates(kubelet_dir, base_socket, own),
        deadline,
        legacy_ready=legacy_ready,
        pid=pid,
        require_ready=ready,
    )


async def drained(in_flight: Callable[[], int], timeout: float) -> bool:
    """Whether in_flight() reached 0 within `timeout` seconds (polled: a stop is the only caller)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while in_flight() > 0:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True
