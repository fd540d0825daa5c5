"""The other instances of our DRA driver on this node, for the DRA side's handovers and for who
keeps the slice: found by the registration sockets they put in the kubelet's plugin registry (the
names dra/names.py gives), each asked, through peers.py, on the service socket it names in
GetInfo. An instance of an earlier release, which answers no Describe, counts as ready once its
health endpoint says so (host/healthcheck.py).

    instances = Instances(identity, registry_dir, driver, own_registration_socket)
    await instances.successor(timeout, pid=..., require_ready=..., seen=...)   its service socket
    await instances.settled(service_socket, deadline)  once the kubelet can no longer take it back
    await instances.newer()                       the name of a live one started after us
    await instances.keeping_slice(serving=True)   the name of the newest serving one, if not us
"""

from __future__ import annotations

import asyncio
import os
from typing import Callable, Optional

import grpc

from hyperlight_agent import contracts, peers, transport
from hyperlight_agent.dra import api
from hyperlight_agent.dra import pluginregistration_pb2 as reg
from hyperlight_agent.files import sockets
from hyperlight_agent.host import healthcheck
from hyperlight_agent.identity import Description, Identity


def candidates(registry_dir: str, driver: str, own: str) -> list[str]:
    """Registration sockets in the registry that may be another instance of our driver: the
    names registration.registration_socket gives (<driver>-*-reg.sock, or the hashed dra-*), never
    ours. Whether one is an instance of ours is for GetInfo and peers.py to find out."""
    return sockets.listing(
        registry_dir,
        lambda name: (
            os.path.join(registry_dir, name) != own
            and name.endswith("-reg.sock")
            and name.startswith((f"{driver}-", "dra-"))
        ),
    )


class Instances:
    def __init__(self, identity: Identity, registry_dir: str, driver: str, own: str) -> None:
        self._identity = identity
        self._registry_dir, self._driver, self._own = registry_dir, driver, own

    def candidates(self) -> list[str]:
        return candidates(self._registry_dir, self._driver, self._own)

    async def service_socket(self, registration_socket: str, timeout: float) -> Optional[str]:
        """The DRA service socket an instance of our driver names in GetInfo (None: not one)."""
        async with grpc.aio.insecure_channel(transport.unix_target(registration_socket)) as channel:
            try:
                info = await api.registration_stub(channel).GetInfo(reg.InfoRequest(), timeout=timeout)
            except grpc.aio.AioRpcError:
                return None
        if info.type != contracts.DRA_PLUGIN_TYPE or info.name != self._driver or not info.endpoint:
            return None
        return str(info.endpoint)

    async def successor(
        self,
        timeout: float,
        pid: Optional[int] = None,
        require_ready: bool = True,
        seen: Optional[Callable[[Description], None]] = None,
        leaving_too: bool = False,
    ) -> Optional[str]:
        """The service socket of a ready instance of ours (peers.successor), at most `timeout` s."""
        return await peers.successor(
            self._identity,
            self.candidates,
            timeout,
            resolve=self.service_socket,
            legacy_ready=healthcheck.peer_ready,
            pid=pid,
            require_ready=require_ready,
            seen=seen,
            leaving_too=leaving_too,
        )

    async def settled(self, service_socket: str, deadline: float) -> bool:
        """Whether the instance at `service_socket` no longer says it is settling (a registration
        the kubelet may still take back: registration.REGISTRATION_SETTLE_S), asked until then or
        the loop's `deadline`. An instance gone, or one that never says so (an earlier release),
        has nothing to wait for."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                found = await peers.describe(
                    service_socket, min(peers.PEER_TIMEOUT_S, max(0.0, deadline - loop.time()))
                )
            except peers.Legacy:
                return True
            if found is None or not found.settling:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(peers.POLL_S)

    async def newer(self) -> Optional[str]:
        """The name of a live instance of our driver that started after us (it keeps the CDI spec)."""
        found = await peers.newer(self._identity, self.candidates(), resolve=self.service_socket)
        return found.identity.name if found else None

    async def keeping_slice(self, serving: bool) -> Optional[str]:
        """The name of the instance that keeps the ResourceSlice instead of us, if any: the newest
        serving one. A successor that is not serving never takes the slice from a serving
        predecessor, whose slice would otherwise lose its devices (peers.outranking)."""
        found = await peers.outranking(self._identity, serving, self.candidates(), resolve=self.service_socket)
        return found.identity.name if found else None
