"""Other instances of ours on the node (peers.py), and both handovers built on it: a successor is
an instance of ours for the same resource that says it is ready; sockets that look like one but
are not (another vendor's driver, a bare gRPC health server, a socket that never answers) are
never taken for one, and however many there are, the search ends by its deadline."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, Optional

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hyperlight_agent import contracts, peers, transport
from hyperlight_agent.deviceplugin import api as dp_api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.deviceplugin import handover
from hyperlight_agent.dra import api as dra_api
from hyperlight_agent.dra import pluginregistration_pb2 as reg
from hyperlight_agent.dra.side import DraSide, DraTarget, candidates
from hyperlight_agent.identity import Identity
from tests import fakes

pytestmark = pytest.mark.usefixtures("quick_deregistration")
RESOURCE = contracts.RESOURCE_HYPERVISOR
DRIVER = contracts.DRA_DRIVER


def me(protocol: str = "deviceplugin", resource: str = RESOURCE, instance: str = "old") -> Identity:
    return Identity.of(instance, protocol, resource)


class Server:
    """A gRPC server on a unix socket with the services a test gives it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]

    def with_health(self) -> Server:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        return self

    def with_describe(self, identity: Identity, ready: bool = True) -> Server:
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


def test_candidates_are_sockets_named_like_ours_for_the_same_resource(tmp: str) -> None:
    names = [
        "hyperlight.sock",
        "hyperlight.pod-a.sock",
        "hyperlight.pod-b.sock",
        "hyperlight-access.pod-a.sock",
        "kubelet.sock",
        ".hyperlight.pod-a.sock.12.abcd",
    ]
    sockets = silent_sockets(tmp, names)
    with open(os.path.join(tmp, "hyperlight.file.sock"), "w"):
        pass  # a regular file with a matching name is no candidate
    try:
        found = handover.candidates(tmp, contracts.PLUGIN_SOCKET, "hyperlight.pod-a.sock")
        assert [os.path.basename(p) for p in found] == ["hyperlight.pod-b.sock", "hyperlight.sock"]
        access = handover.candidates(tmp, contracts.DEVICE_ACCESS_SOCKET, "hyperlight-access.pod-b.sock")
        assert [os.path.basename(p) for p in access] == ["hyperlight-access.pod-a.sock"]
    finally:
        for s in sockets:
            s.close()


def test_identities_order_by_start_then_name() -> None:
    a = Identity("a", "dra", DRIVER, started=10, pid=1)
    b = Identity("b", "dra", DRIVER, started=20, pid=2)
    assert b.is_newer_than(a) and not a.is_newer_than(b)
    assert Identity("b", "dra", DRIVER, 10, 1).is_newer_than(a)  # a tie: the name decides
    assert a.same_kind(b) and not a.same_kind(Identity("c", "deviceplugin", RESOURCE, 30, 3))


# 15: a bare gRPC health server at a name like ours, SERVING, is no successor.
async def test_a_health_server_at_a_name_like_ours_is_no_successor(tmp: str) -> None:
    impostor = await Server(os.path.join(tmp, "hyperlight.sidecar.sock")).with_health().start()
    try:
        assert await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 0.5) is None
    finally:
        await impostor.stop()


async def test_a_ready_agent_of_ours_is_the_successor_and_one_for_another_resource_is_not(tmp: str) -> None:
    other = (
        await Server(os.path.join(tmp, "hyperlight.other.sock"))
        .with_describe(me(resource=contracts.RESOURCE_DEVICE_ACCESS, instance="other"))
        .start()
    )
    unready = (
        await Server(os.path.join(tmp, "hyperlight.unready.sock"))
        .with_describe(me(instance="unready"), ready=False)
        .start()
    )
    try:
        assert await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 0.3) is None
        new = await Server(os.path.join(tmp, "hyperlight.new.sock")).with_describe(me(instance="new")).start()
        try:
            found = await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 5)
            assert found == new.path
        finally:
            await new.stop()
    finally:
        await other.stop()
        await unready.stop()


async def test_an_agent_of_an_earlier_release_is_a_successor_when_it_proves_it_is_a_device_plugin(tmp: str) -> None:
    legacy = await Server(os.path.join(tmp, "hyperlight.legacy.sock")).with_health().with_device_plugin().start()
    try:
        found = await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 5)
        assert found == legacy.path
    finally:
        await legacy.stop()


# 8: however many sockets never answer, the search ends by its deadline.
async def test_the_successor_search_ends_by_its_deadline_whatever_the_sockets_do(tmp: str) -> None:
    """100 sockets that never answer, each worth PEER_TIMEOUT_S (0.5 s): asked one after another
    they took 50 s; the search ends by its deadline (1 s here)."""
    sockets = silent_sockets(tmp, [f"hyperlight.silent-{i}.sock" for i in range(100)])
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        found = await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 1)
        lasted = loop.time() - started
    finally:
        for s in sockets:
            s.close()
    assert found is None and lasted < 1 + peers.PEER_TIMEOUT_S, lasted


# --- the DRA side: registration sockets, GetInfo, then Describe on the service socket ---


def dra_driver(tmp: str, instance: str = "old") -> DraSide:
    registry, plugins = os.path.join(tmp, "registry"), os.path.join(tmp, "plugins")
    os.makedirs(registry, exist_ok=True)
    return DraSide(
        DraTarget("node1", instance, 4, None, registry, plugins),
        fakes.wiring(identity=Identity.of(instance, "dra", DRIVER)),
    )


async def registered_driver(tmp: str, name: str, sock: str, identity: Optional[Identity]) -> list[Server]:
    """A DRA driver's registration socket naming `name`, and its service socket (health SERVING,
    Describe when an identity is given)."""
    endpoint = os.path.join(tmp, f"{sock}-service.sock")
    service = Server(endpoint).with_health()
    if identity is not None:
        service.with_describe(identity)
    registration = Server(os.path.join(tmp, "registry", f"{sock}-reg.sock")).with_registration(name, endpoint)
    return [await service.start(), await registration.start()]


# 9: another vendor's DRA driver in the registry is no successor.
async def test_a_foreign_dra_driver_is_no_successor(tmp: str) -> None:
    driver = dra_driver(tmp)
    await driver.registrar.start()
    servers = await registered_driver(tmp, "gpu.other-vendor.example", "dra-0a1b2c", None)
    servers += await registered_driver(
        tmp, "gpu.other-vendor.example", "dra-3d4e5f", Identity.of("x", "dra", "gpu.other-vendor.example")
    )
    try:
        assert len(candidates(driver._registry_dir, DRIVER, driver.registrar.registration_socket)) == 2
        assert await driver.hand_over(0.5) is None
        ours = await registered_driver(tmp, DRIVER, f"{DRIVER}-new", Identity.of("new", "dra", DRIVER))
        servers += ours
        assert await driver.hand_over(5) == ours[0].path
    finally:
        for server in servers:
            await server.stop()
        await driver.close()


async def test_the_dra_successor_search_ends_by_its_deadline_whatever_the_sockets_do(tmp: str) -> None:
    driver = dra_driver(tmp)
    await driver.registrar.start()
    sockets = silent_sockets(os.path.join(tmp, "registry"), [f"{DRIVER}-silent-{i}-reg.sock" for i in range(100)])
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        assert await driver.hand_over(1) is None
        assert loop.time() - started < 1 + peers.PEER_TIMEOUT_S
    finally:
        for s in sockets:
            s.close()
        await driver.close()


async def test_a_newer_live_instance_is_found_and_an_older_one_is_not(tmp: str) -> None:
    older = Identity.of("older", "dra", DRIVER)
    driver = dra_driver(tmp, "middle")
    await driver.registrar.start()
    servers = await registered_driver(tmp, DRIVER, f"{DRIVER}-older", older)
    try:
        assert await driver.newer_instance() is None
        servers += await registered_driver(tmp, DRIVER, f"{DRIVER}-newest", Identity.of("newest", "dra", DRIVER))
        assert await driver.newer_instance() == "newest"
    finally:
        for server in servers:
            await server.stop()
        await driver.close()


async def test_the_kubelet_is_done_with_us_once_quiet_or_proven_and_calls_in_flight_get_a_bound() -> None:
    """transport.until_quiet: calls in flight finish first; then `quiet` seconds without a call,
    or a proof sooner; a call that never ends is given up after quiet + grace."""
    loop = asyncio.get_running_loop()
    in_flight, received = [2], [2]

    async def finish() -> None:
        await asyncio.sleep(0.02)
        in_flight[0] = 0

    task = asyncio.ensure_future(finish())
    started = loop.time()
    assert await transport.until_quiet(lambda: in_flight[0], lambda: received[0], quiet=0.2) == "no call for 0.2 s"
    assert loop.time() - started >= 0.2
    await task
    proven = await transport.until_quiet(lambda: 0, lambda: 0, lambda: _said("proven"), quiet=60)
    assert proven == "proven"
    stuck = await transport.until_quiet(lambda: 1, lambda: 1, quiet=0.05, grace=0.05)
    assert stuck == "1 call(s) still in flight after 0.1 s"


async def _said(why: str) -> Optional[str]:
    return why
