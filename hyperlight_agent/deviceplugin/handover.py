"""Handing the kubelet over to a successor when we are stopped, so that it never counts zero devices.

In a surge update (or when a deleted pod's replacement starts while it terminates) a successor
agent starts beside us under its own socket name (settings.instance), registers, and is ready
while we still serve. On SIGTERM we keep serving until such a successor answers ready (peers.py:
an agent of ours for the same resource, registered, streamed, healthy), then end our stream:
- kubelets from 1.37 on keep one endpoint per socket path and promote the remaining one when
  ours ends: the resource never drops to zero;
- 1.34 to 1.36 keep one client per resource, and our stream ending disconnects the newest client
  as well (kubernetes issue 121994, fixed in 1.37): the successor registers again at once, so the
  gap is one Register round trip.
Without a successor within settings.handover_seconds we stop anyway (an uninstall, a drain); a
second SIGTERM ends the wait at once (kubelet_side.hand_over_on_stop).

Once the successor is ready, our stream ends only when the kubelet can send us no more Allocates
(`released`): ending it closes the kubelet's connection to us at once, failing any Allocate still
on its way (docs/decisions/the-last-allocate.md).

Why: docs/decisions/surge-and-handover.md and docs/decisions/the-last-allocate.md.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Optional

import grpc

from hyperlight_agent import contracts, peers, transport
from hyperlight_agent.deviceplugin import api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.files import sockets
from hyperlight_agent.host import healthcheck
from hyperlight_agent.identity import Description, Identity

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
    me: Identity,
    kubelet_dir: str,
    base_socket: str,
    own: str,
    timeout: float,
    pid: Optional[int] = None,
    require_ready: bool = True,
    seen: Optional[Callable[[Description], None]] = None,
    leaving_too: bool = False,
) -> Optional[str]:
    """The socket path of a ready successor (with `pid`, that process; without `require_ready`, one that
    answers; `seen` gets each of its answers; with `leaving_too`, a stopping one too: peers.successor),
    or None after `timeout` seconds without one."""
    return await peers.successor(
        me,
        lambda: candidates(kubelet_dir, base_socket, own),
        timeout,
        legacy_ready=legacy_ready,
        pid=pid,
        require_ready=require_ready,
        seen=seen,
        leaving_too=leaving_too,
    )


async def calls_of(path: str) -> Optional[int]:
    """The Allocates the instance of ours at `path` has received, if it says (an earlier release
    does not; one that does not answer says nothing)."""
    try:
        found = await peers.describe(path, peers.PEER_TIMEOUT_S)
    except (OSError, grpc.RpcError, peers.Legacy):
        return None
    return found.calls if found is not None else None


async def released(
    allocating: Callable[[], int],
    received: Callable[[], int],
    successor_calls: Callable[[], Awaitable[Optional[int]]],
    quiet: float = transport.QUIET_S,
) -> str:
    """Called once the successor is ready; returns, saying why, once the kubelet can send us no
    more Allocates, so that ending our stream fails none.

    The successor's registration made it the kubelet's endpoint for the resource: every Allocate
    from then on goes there. One the kubelet addressed to us just before may still be on its way
    (it looks the endpoint up, then calls it: devicemanager/manager.go, allocateContainerResources),
    and admission is serial (the allocation manager holds its mutex through Allocate), so there is
    at most one such call and nothing after it comes to us. It is over when
    - an Allocate that arrived after the successor was ready has been answered: it was that call;
    - the successor has received an Allocate: the kubelet finished every earlier one first;
    - or, proving nothing but bounding the wait, none arrived for `quiet` seconds."""
    baseline = received()

    async def proof() -> Optional[str]:
        if received() > baseline:
            return "answered the kubelet's last Allocate addressed to us"
        if await successor_calls():
            return "the successor has received an Allocate"
        return None

    return await transport.until_quiet(allocating, received, proof, quiet)
