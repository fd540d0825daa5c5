"""Other instances of ours on the node (peers.py): their identities order by start, then name; and
`Server`, a gRPC server standing for a peer (Describe, gRPC health, a device plugin's or a DRA
driver's registration) for the files whose modules look for peers: the device plugin's handover
(test_deviceplugin_handover.py), the DRA side's (test_dra_side.py) and the in-place upgrade
(test_host_upgrade.py)."""

from __future__ import annotations

import os
import socket
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hyperlight_agent import contracts, peers, transport
from hyperlight_agent.deviceplugin import api as dp_api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.dra import api as dra_api
from hyperlight_agent.dra import pluginregistration_pb2 as reg

RESOURCE = contracts.RESOURCE_HYPERVISOR
DRIVER = contracts.DRA_DRIVER


class Server:
    """A gRPC server on a unix socket with the services a test gives it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]

    def with_health(self) -> Server:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        return self

    def with_describe(self, identity: peers.Identity, ready: bool = True) -> Server:
        self.server.add_generic_rpc_handlers([peers.describe_handler(identity, lambda: ready)])
        return self

    def with_device_plugin(self) -> Server:
        class Options:
            async def GetDevicePluginOptions(self, request: Any, context: Any) -> pb.DevicePluginOptions:
                return pb.DevicePluginOptions()

        methods = {"GetDevicePluginOptions": dp_api.DEVICE_PLUGIN_METHODS["GetDevicePluginOptions"]}
        self.server.add_generic_rpc_handlers([transport.handler(dp_api.DEVICE_PLUGIN_SERVICE, methods, Options())])
        return self

    def with_registration(self, name: str, endpoint: str) -> Server:
        class Registration:
            async def GetInfo(self, request: Any, context: Any) -> reg.PluginInfo:
                return reg.PluginInfo(
                    type=contracts.DRA_PLUGIN_TYPE,
                    name=name,
                    endpoint=endpoint,
                    supported_versions=[contracts.DRA_VERSION_V1],
                )

            async def NotifyRegistrationStatus(self, request: Any, context: Any) -> reg.RegistrationStatusResponse:
                return reg.RegistrationStatusResponse()

        self.server.add_generic_rpc_handlers([dra_api.registration_handler(Registration())])
        return self

    async def start(self) -> Server:
        assert self.server.add_insecure_port(f"unix://{self.path}")
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    async def stop(self) -> None:
        await self.server.stop(0)


def silent_sockets(directory: str, names: list[str]) -> list[socket.socket]:
    """Sockets that accept connections (the kernel's backlog) and never answer a byte."""
    found = []
    for name in names:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(os.path.join(directory, name))
        s.listen(64)
        found.append(s)
    return found


def test_identities_order_by_start_then_name() -> None:
    a = peers.Identity("a", "dra", DRIVER, started=10, pid=1)
    b = peers.Identity("b", "dra", DRIVER, started=20, pid=2)
    assert b.is_newer_than(a) and not a.is_newer_than(b)
    assert peers.Identity("b", "dra", DRIVER, 10, 1).is_newer_than(a)  # a tie: the name decides
    assert a.same_kind(b) and not a.same_kind(peers.Identity("c", "deviceplugin", RESOURCE, 30, 3))
