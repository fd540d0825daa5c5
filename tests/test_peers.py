"""Other instances of ours on the node (peers.py): their identities order by start, then name;
Describe says who an instance is and how it stands, and nothing else is taken for an answer; a
newer instance, one by pid and one that outranks us are found among the candidates; hold waits
while a reason stands. And
`Server`, a gRPC server standing for a peer (Describe, gRPC health, a device plugin's or a DRA
driver's registration) for the files whose modules look for peers: the device plugin's handover
(test_deviceplugin_handover.py), the DRA side's (test_dra_side.py) and the in-place upgrade
(test_host_upgrade.py)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hyperlight_agent import contracts, peers, transport, waits
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.deviceplugin import api as dp_api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.dra import api as dra_api
from hyperlight_agent.dra import pluginregistration_pb2 as reg
from hyperlight_agent.identity import Description, Identity
from tests.conftest import until

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


def identity(instance: str, started: int, pid: int, resource: str = DRIVER) -> Identity:
    return Identity(instance, "dra", resource, started=started, pid=pid)


async def serve_description(path: str, who: Identity, ready: bool = True, **more: Any) -> Server:
    """A peer answering Describe as `who`, with `more` fields (serving, calls, upgrade...)."""
    server = Server(path)
    server.server.add_generic_rpc_handlers([peers.describe_handler(who, lambda: ready, lambda: more)])
    return await server.start()


async def serve_answer(path: str, answer: bytes) -> Server:
    """A server whose Describe answers these bytes, whatever they are."""

    async def describe(request: bytes, context: Any) -> bytes:
        return answer

    server = Server(path)
    server.server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                peers.SERVICE, {"Describe": grpc.unary_unary_rpc_method_handler(describe)}
            )
        ]
    )
    return await server.start()


async def test_describe_says_who_an_instance_is_and_how_it_stands(tmp: str) -> None:
    who = Identity.of("pod-a", "dra", DRIVER)
    upgrade = {"attempts": 1, "state": "done"}
    server = await serve_description(
        os.path.join(tmp, "a.sock"), who, ready=False, serving=False, calls=17, upgrade=upgrade, replaced=42
    )
    try:
        found = await peers.describe(server.path, 5)
    finally:
        await server.stop()
    assert found == Description(
        who, ready=False, path=server.path, upgrade=upgrade, serving=False, calls=17, registering=False, replaced=42
    )
    stopping = await serve_description(os.path.join(tmp, "b.sock"), who, stopping=True, settling=True)
    try:
        said = await peers.describe(stopping.path, 5)
    finally:
        await stopping.stop()
    assert said is not None and said.stopping and said.settling


async def test_an_earlier_release_says_nothing_of_what_it_did_not_know(tmp: str) -> None:
    """Only the fields of the first Describe: serving is its readiness, calls unknown, no upgrade."""
    who = identity("old", 1, 2)
    fields = {"agent": who.agent, "version": "0.0.9", "instance": "old", "protocol": "dra", "resource": DRIVER}
    answer = {**fields, "started": 1, "pid": 2, "ready": True}
    server = await serve_answer(os.path.join(tmp, "a.sock"), json.dumps(answer).encode())
    try:
        found = await peers.describe(server.path, 5)
    finally:
        await server.stop()
    assert found is not None and found.identity.version == "0.0.9"
    assert (found.ready, found.serving, found.calls, found.upgrade, found.replaced) == (True, True, None, None, 0)


@pytest.mark.parametrize(
    "answer",
    [
        b"not json",
        b'{"agent": "hyperlight-agent"}',  # fields missing
        json.dumps(
            {
                "instance": "a",
                "protocol": "dra",
                "resource": DRIVER,
                "started": "soon",
                "pid": 1,
                "version": "1",
                "agent": "hyperlight-agent",
                "ready": True,
            }
        ).encode(),
        b'{"padding": "' + b"x" * peers.MAX_ANSWER_BYTES + b'"}',  # longer than any answer of ours
    ],
    ids=["not-json", "fields-missing", "not-a-number", "too-long"],
)
async def test_an_answer_that_is_no_description_is_no_instance(tmp: str, answer: bytes) -> None:
    server = await serve_answer(os.path.join(tmp, "a.sock"), answer)
    try:
        assert await peers.describe(server.path, 5) is None
    finally:
        await server.stop()


async def test_a_server_without_describe_is_an_earlier_release_and_a_silent_socket_nothing(tmp: str) -> None:
    health_only = await Server(os.path.join(tmp, "health.sock")).with_health().start()
    [silent] = silent_sockets(tmp, ["silent.sock"])
    try:
        with pytest.raises(peers.Legacy) as legacy:
            await peers.describe(health_only.path, 5)
        assert legacy.value.target == health_only.path
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await peers.describe(os.path.join(tmp, "silent.sock"), 0.2) is None
        assert loop.time() - started < 5
    finally:
        silent.close()
        await health_only.stop()


async def test_a_newer_instance_and_one_by_pid_are_found_among_the_candidates(tmp: str) -> None:
    me = identity("me", started=20, pid=2)
    servers = [
        await serve_description(os.path.join(tmp, "older.sock"), identity("older", 10, 1)),
        await serve_description(os.path.join(tmp, "other.sock"), identity("other", 40, 4, resource="other.example")),
        await serve_description(os.path.join(tmp, "newer.sock"), identity("newer", 30, 3)),
    ]
    try:
        paths = [s.path for s in servers]
        newer = await peers.newer(me, paths)
        assert newer is not None and newer.identity.instance == "newer", "another resource's instance is no peer"
        assert await peers.newer(identity("newest", 50, 5), paths) is None
        by_pid = await peers.find(1, paths)
        assert by_pid is not None and by_pid.identity.instance == "older"
        assert await peers.find(9, paths) is None
    finally:
        for server in servers:
            await server.stop()


async def test_an_instance_that_is_stopping_itself_is_no_successor_but_still_serves_for_a_hold(tmp: str) -> None:
    """Two instances stopping at once would each hand over to the other (a red real-cluster run:
    driver pods deleted one after another left the kubelet with neither); a hold asks who serves
    the kubelet now, which a stopping instance still does."""
    me = identity("me", started=20, pid=2)
    stopping = await serve_description(os.path.join(tmp, "stopping.sock"), identity("leaving", 10, 1), stopping=True)
    try:
        assert await peers.successor(me, lambda: [stopping.path], 0.5) is None
        assert await peers.successor(me, lambda: [stopping.path], 0.5, leaving_too=True) == stopping.path
        staying = await serve_description(os.path.join(tmp, "staying.sock"), identity("staying", 30, 3))
        try:
            assert await peers.successor(me, lambda: [stopping.path, staying.path], 5) == staying.path
        finally:
            await staying.stop()
    finally:
        await stopping.stop()


@pytest.mark.parametrize(
    ("we_serve", "theirs", "outranks"),
    [
        (False, ("older", 10, True), True),  # serving beats not serving, whatever the age
        (True, ("newer", 30, False), False),  # not serving never takes it from one that serves
        (True, ("older", 10, True), False),  # serving alike: the newer one keeps it
        (True, ("newer", 30, True), True),
    ],
)
async def test_outranking_is_serving_first_then_age(
    tmp: str, we_serve: bool, theirs: tuple[str, int, bool], outranks: bool
) -> None:
    name, started, serving = theirs
    server = await serve_description(os.path.join(tmp, "peer.sock"), identity(name, started, 7), serving=serving)
    try:
        found = await peers.outranking(identity("me", 20, 2), we_serve, [server.path])
    finally:
        await server.stop()
    assert (found is not None) == outranks


async def test_hold_waits_while_a_reason_stands_says_each_new_one_and_asks_again_on_a_new_check() -> None:
    observation = SharedObservation()
    reasons = ["a ready instance serves: pod-a", "a ready instance serves: pod-a", "device unhealthy", ""]
    said: list[str] = []
    asked: list[Observation] = []

    async def why(current: Observation) -> str:
        asked.append(current)
        return reasons[len(asked) - 1]

    holding = asyncio.ensure_future(peers.hold(why, observation, said.append, poll=lambda: 60))
    await asyncio.sleep(0)
    assert asked == [], "nothing is asked before the first check completes"
    for n in range(1, 4):
        observation.publish(Observation(healthy=n % 2 == 0, reason="", hypervisor="kvm"))
        await until(lambda n=n: len(asked) == n, what=f"question {n}")  # type: ignore[misc]
        assert not holding.done()
    observation.republish()
    await waits.within(holding, 5)
    assert said == ["a ready instance serves: pod-a", "device unhealthy", ""], "each new reason once, then the end"
