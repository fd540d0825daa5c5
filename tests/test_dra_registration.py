"""One instance's DRA servers (dra/registration.py) driven as the kubelet drives them: the strict
stand-in (standin/dra_kubelet.py) watches a registry directory and registers our instances over real
unix sockets; two instances beside each other share the record; a stop deregisters before it ends;
only our own sockets are removed. (What the service answers is test_dra_service.py's.)"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, Awaitable, Callable, ClassVar, Optional, Union

import grpc
import pytest

from hyperlight_agent import contracts, transport
from hyperlight_agent.device.observation import Observation
from hyperlight_agent.dra import api, registration
from hyperlight_agent.dra import pluginregistration_pb2 as reg
from hyperlight_agent.dra.prepared import Prepared
from hyperlight_agent.dra.registration import DriverServers, Graces
from hyperlight_agent.dra.service import Service
from hyperlight_agent.dra.types import AllocatedDevice, ClaimError
from hyperlight_agent.transport import NotServing
from standin.dra_kubelet import CONNECTION_CLOSING, CallFailed, Claim, DraKubeletStandin, RegistrationRefused
from tests.conftest import until

DRIVER = contracts.DRA_DRIVER
DEREGISTER_WHOLE_S = registration.DEREGISTER_GRACE_S  # as imported, before any test shortens it
HEALTHY = Observation(healthy=True, reason="", hypervisor="kvm")
CDI_KVM = "hyperlight.dev/hypervisor=kvm"
CLAIM = Claim(namespace="ns", name="c1", uid="uid-1")


class FakeClaims:
    """The API's view of claims: uid → allocation results, or the ClaimError reading it raises."""

    def __init__(self) -> None:
        self.claims: dict[str, Union[list[AllocatedDevice], ClaimError]] = {}
        self.reads = 0

    async def allocation(self, namespace: str, name: str, uid: str) -> list[AllocatedDevice]:
        self.reads += 1
        found = self.claims.get(uid)
        if found is None:
            raise ClaimError(f"claim {namespace}/{name} not found")
        if isinstance(found, ClaimError):
            raise found
        return found


def ours(device: str = "kvm-0", request: str = "hv", share_id: Optional[str] = None) -> AllocatedDevice:
    return AllocatedDevice(request=request, driver=DRIVER, pool="node1", device=device, share_id=share_id)


class Node:
    """Temp directories standing for the kubelet's, and the agent instances started on them."""

    def __init__(self, tmp: str, claims: FakeClaims) -> None:
        self.registry = os.path.join(tmp, "plugins_registry")
        self.plugins = os.path.join(tmp, "plugins")
        self.data = os.path.join(tmp, "data")
        os.mkdir(self.registry)
        self.claims = claims
        self.observation = HEALTHY
        self.started: list[DriverServers] = []

    def registrar(self, instance: str, observe: Optional[Callable[[], Any]] = None) -> DriverServers:
        service = Service(DRIVER, self.claims, observe or (lambda: self.observation), Prepared(self.data))
        registrar = DriverServers(service, DRIVER, instance, self.registry, self.plugins, graces=Graces(deregister_s=0))
        self.started.append(registrar)
        return registrar

    async def start(self, instance: str) -> DriverServers:
        registrar = self.registrar(instance)
        await registrar.start()
        return registrar


def run(
    tmp: str,
    body: Callable[[Node, DraKubeletStandin], Awaitable[None]],
    known_versions: tuple[str, ...] = (contracts.DRA_VERSION_V1, contracts.DRA_VERSION_V1BETA1),
) -> None:
    async def main() -> None:
        node = Node(tmp, FakeClaims())
        try:
            async with DraKubeletStandin(node.registry, known_versions=known_versions) as kubelet:
                await body(node, kubelet)
        finally:
            for registrar in node.started:
                await registrar.close()

    asyncio.run(main())


async def registered(kubelet: DraKubeletStandin, registrar: DriverServers, count: int = 1) -> None:
    await until(
        lambda: registrar.registered and len(kubelet.instances.get(DRIVER, [])) >= count,
        what="the kubelet registering the instance",
    )


# --- registration --------------------------------------------------------------------------------


@pytest.mark.usefixtures("quick_deregistration")
def test_the_stops_waits_are_the_constants_as_they_are_when_the_servers_are_made(tmp: str) -> None:
    """Every DRA agent's stop waits these; the tests' quick_deregistration shortens them by the
    module's constants, so a default bound at import would make each test's stop 1.5 s (one did)."""
    servers = DriverServers(object(), DRIVER, "a", tmp, tmp)
    quick = Graces(registration.CALLS_DRAIN_S, registration.DEREGISTER_GRACE_S, transport.STOP_GRACE_S)
    assert servers.graces == Graces() == quick and quick.deregister_s < DEREGISTER_WHOLE_S
    assert DriverServers(object(), DRIVER, "a", tmp, tmp, graces=Graces(1, 2, 3)).graces.stop_s == 3


def test_registers_and_the_kubelet_chooses_v1(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        registrar = await node.start("pod-a")
        await registered(kubelet, registrar)
        [instance] = kubelet.instances[DRIVER]
        assert instance.version == contracts.DRA_VERSION_V1
        assert instance.endpoint == registrar.service_socket == os.path.join(node.plugins, DRIVER, "dra-pod-a.sock")
        assert registrar.registration_socket == os.path.join(node.registry, f"{DRIVER}-pod-a-reg.sock")
        assert registrar.error == "" and registrar.notifications == 1

    run(tmp, body)


def test_a_kubelet_knowing_only_v1beta1_chooses_it(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        node.claims.claims[CLAIM.uid] = [ours(share_id="share-1")]
        registrar = await node.start("pod-a")
        await registered(kubelet, registrar)
        assert kubelet.instances[DRIVER][0].version == contracts.DRA_VERSION_V1BETA1
        entries = await kubelet.prepare(DRIVER, [CLAIM])
        [device] = entries[CLAIM.uid].devices
        assert (device.device_name, list(device.cdi_device_ids)) == ("kvm-0", [CDI_KVM])
        assert "share_id" not in device.DESCRIPTOR.fields_by_name

    run(tmp, body, known_versions=(contracts.DRA_VERSION_V1BETA1,))


def test_a_kubelet_knowing_none_of_our_versions_refuses_and_says_why(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        registrar = await node.start("pod-a")
        await until(lambda: registrar.notifications >= 1, what="the kubelet's verdict")
        assert not registrar.registered
        assert registrar.error.startswith("none of services supported by the plugin")
        assert DRIVER not in kubelet.instances

    run(tmp, body, known_versions=("v1alpha4.DRAPlugin",))


def test_the_same_endpoint_twice_is_refused(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        registrar = await node.start("pod-a")
        await registered(kubelet, registrar)
        with pytest.raises(RegistrationRefused, match="already registered"):
            await kubelet.register(registrar.registration_socket)
        assert not registrar.registered  # the kubelet told us; our state follows its last word

    run(tmp, body)


@pytest.mark.parametrize(
    ("notify_fails", "keeps"), [(False, False), (True, True), (True, False)], ids=["told", "failed-1.35", "failed-1.37"]
)
def test_the_kubelet_registers_a_plugin_before_it_tells_it_and_a_failed_telling_takes_it_back(
    tmp: str, notify_fails: bool, keeps: bool
) -> None:
    """The stand-in's order is operation_generator.go's: RegisterPlugin, then
    NotifyRegistrationStatus, so a plugin told it is registered may be called at once; after a
    failed notify (recorded) 1.35 keeps the plugin, 1.36 on take it back (and try again later)."""

    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        kubelet.keeps_failed_notify = keeps
        known_when_told: list[bool] = []

        class Plugin:
            async def GetInfo(self, request: Any, context: Any) -> reg.PluginInfo:
                return reg.PluginInfo(
                    type=contracts.DRA_PLUGIN_TYPE,
                    name=DRIVER,
                    endpoint=os.path.join(tmp, "dra.sock"),
                    supported_versions=[contracts.DRA_VERSION_V1],
                )

            async def NotifyRegistrationStatus(self, request: Any, context: Any) -> reg.RegistrationStatusResponse:
                known_when_told.append(request.plugin_registered and bool(kubelet.instances.get(DRIVER)))
                if notify_fails:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
                return reg.RegistrationStatusResponse()

        path = os.path.join(tmp, "elsewhere-reg.sock")  # outside the registry: registered by hand
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([api.registration_handler(Plugin())])
        server.add_insecure_port(transport.unix_target(path))
        await server.start()
        try:
            if notify_fails and not keeps:
                with pytest.raises(grpc.RpcError):
                    await kubelet.register(path)
            else:
                instance = await kubelet.register(path)
        finally:
            await server.stop(0)
        assert known_when_told == [True]
        assert kubelet.instances.get(DRIVER, []) == ([] if notify_fails and not keeps else [instance])
        assert [p for p, _ in kubelet.notify_failed] == ([path] if notify_fails else [])

    run(tmp, body)


def test_the_service_is_served_before_the_registration_socket_appears(tmp: str) -> None:
    async def main() -> None:
        node = Node(tmp, FakeClaims())
        registrar = node.registrar("pod-a")
        seen: list[bool] = []
        serve = registration.serve_at

        async def spy(path: str, handlers: Any, setting: str, configure: Any = None) -> Any:
            if path == registrar.registration_socket:
                seen.append(os.path.exists(registrar.service_socket) and _accepts(registrar.service_socket))
            return await serve(path, handlers, setting, configure)

        registration.serve_at = spy
        try:
            await registrar.start()
        finally:
            registration.serve_at = serve
            await registrar.close()
        assert seen == [True]

    asyncio.run(main())


def _accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
        except OSError:
            return False
        return True


# --- two instances (rolling update) ------------------------------------------------------------------


def test_two_instances_register_beside_each_other_and_share_the_record(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        node.claims.claims[CLAIM.uid] = [ours()]
        old = await node.start("pod-old")
        await registered(kubelet, old)
        answer = await kubelet.prepare(DRIVER, [CLAIM])
        new = await node.start("pod-new")
        await registered(kubelet, new, count=2)
        assert {i.endpoint for i in kubelet.instances[DRIVER]} == {old.service_socket, new.service_socket}
        # The newest connected instance takes the calls (once the kubelet's connection to it is up).
        await until(lambda: kubelet.instance(DRIVER).endpoint == new.service_socket, what="the new one connected")
        reads = node.claims.reads
        assert await kubelet.prepare(DRIVER, [CLAIM]) == answer  # from the record the old one wrote
        assert node.claims.reads == reads
        await new.close()
        await until(lambda: len(kubelet.instances[DRIVER]) == 1, what="the new instance deregistered")
        assert kubelet.instance(DRIVER).endpoint == old.service_socket
        assert (await kubelet.unprepare(DRIVER, [CLAIM]))[CLAIM.uid].error == ""
        assert Prepared(node.data).claims() == {}

    run(tmp, body)


# --- our sockets and nobody else's ---------------------------------------------------------------------


def test_close_removes_our_sockets_and_deregisters(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        registrar = await node.start("pod-a")
        await registered(kubelet, registrar)
        await registrar.close()
        assert not os.path.lexists(registrar.registration_socket)
        assert not os.path.lexists(registrar.service_socket)
        assert not registrar.registered and not registrar.serving
        await until(lambda: DRIVER not in kubelet.instances, what="deregistration")
        assert [n for n in os.listdir(node.registry) if n.startswith(".")] == []  # no private socket left

    run(tmp, body)


def test_claims_are_answered_until_the_kubelet_has_deregistered_us(tmp: str) -> None:
    """Between our registration socket going and the kubelet's reconciler noticing, the kubelet
    may still send us a claim: it is answered, not refused with "Server shutdown"."""

    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        service = Service(DRIVER, node.claims, lambda: node.observation, Prepared(node.data))
        registrar = DriverServers(
            service, DRIVER, "pod-a", node.registry, node.plugins, graces=Graces(deregister_s=1.0)
        )
        await registrar.start()
        await registered(kubelet, registrar)
        closing = asyncio.ensure_future(registrar.close())
        await until(lambda: not os.path.lexists(registrar.registration_socket), what="the registration socket gone")
        _, messages = api.VERSIONS[contracts.DRA_VERSION_V1]
        async with grpc.aio.insecure_channel(transport.unix_target(registrar.service_socket)) as channel:
            stub = api.dra_stub(channel, contracts.DRA_VERSION_V1)
            answer = await stub.NodePrepareResources(
                messages.NodePrepareResourcesRequest(claims=[messages.Claim(namespace="ns", uid="u-1", name="c")]),
                timeout=5,
            )
        assert answer.claims["u-1"].error == "claim ns/c not found"
        assert not closing.done(), "answered while still closing"
        await closing
        assert not os.path.lexists(registrar.service_socket)

    run(tmp, body)


@pytest.mark.parametrize("answers", [True, False])
def test_a_stop_deregisters_only_once_the_calls_in_flight_ended_or_the_drain_passed(tmp: str, answers: bool) -> None:
    """The kubelet cancels the calls it has in flight with an instance as it deregisters it (its
    connection closes: "grpc: the client connection is closing", a pod's Prepare failed so on the
    1.34 kubelet during a rolling update). So a stop keeps the registration socket until the calls
    in flight ended, at most calls_drain_s: an answer that comes is delivered; one that never comes
    does not hold the stop."""
    reading, answer = asyncio.Event(), asyncio.Event()

    class Slow(FakeClaims):
        async def allocation(self, namespace: str, name: str, uid: str) -> list[AllocatedDevice]:
            reading.set()
            await answer.wait()
            return [ours()]

    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        service = Service(DRIVER, Slow(), lambda: node.observation, Prepared(node.data))
        # The drain bounds a call that never ends (answers=False); one that is answered must not
        # race it on a loaded machine, so there the drain is far longer than any answer takes.
        drain = 60 if answers else 2
        registrar = DriverServers(
            service, DRIVER, "pod-a", node.registry, node.plugins, graces=Graces(deregister_s=0, calls_drain_s=drain)
        )
        node.started.append(registrar)
        await registrar.start()
        await registered(kubelet, registrar)
        prepare = asyncio.ensure_future(kubelet.prepare(DRIVER, [CLAIM]))
        await until(reading.is_set, what="the Prepare in flight")
        closing = asyncio.ensure_future(registrar.close())
        await until(lambda: not registrar.serving and service.calls.in_flight == 1, what="the close begun")
        assert os.path.lexists(registrar.registration_socket) and kubelet.instances.get(DRIVER)
        if answers:
            answer.set()
            (device,) = (await prepare)[CLAIM.uid].devices
            assert list(device.cdi_device_ids) == [CDI_KVM]
            await closing
        else:
            await asyncio.wait_for(closing, 5)  # the drain's 2 s, not the call's forever
            await asyncio.wait([prepare], timeout=5)
            # Failed with the kubelet's connection, closed as it deregistered us.
            assert prepare.done() and not prepare.cancelled()
            assert CONNECTION_CLOSING in str(prepare.exception()), prepare.exception()
        assert not os.path.lexists(registrar.registration_socket)

    run(tmp, body)


def test_a_foreign_file_at_our_path_is_left_alone(tmp: str) -> None:
    async def main() -> None:
        node = Node(tmp, FakeClaims())
        registrar = node.registrar("pod-a")
        with open(registrar.registration_socket, "w") as f:
            f.write("someone else's")
        with pytest.raises(NotServing, match="exists and is not a socket"):
            await registrar.start()
        with open(registrar.registration_socket) as f:
            assert f.read() == "someone else's"
        assert not os.path.lexists(registrar.service_socket)  # nothing of ours left behind
        assert registrar.error

        # Started, then our socket replaced by someone else's file: close leaves that file.
        os.unlink(registrar.registration_socket)
        await registrar.start()
        os.unlink(registrar.service_socket)
        with open(registrar.service_socket, "w") as f:
            f.write("theirs")
        await registrar.close()
        with open(registrar.service_socket) as f:
            assert f.read() == "theirs"
        assert not os.path.lexists(registrar.registration_socket)

    asyncio.run(main())


def test_a_live_socket_at_our_path_is_not_taken_over_but_a_stale_one_is(tmp: str) -> None:
    async def main() -> None:
        node = Node(tmp, FakeClaims())
        first = await node.start("pod-a")
        second = node.registrar("pod-a")
        with pytest.raises(NotServing, match="another agent is serving it; not taking it over"):
            await second.start()
        assert os.path.exists(first.service_socket) and _accepts(first.service_socket)
        await first.close()
        # A stale socket (an earlier run of this instance, killed): replaced.
        with socket.socket(socket.AF_UNIX) as stale:
            stale.bind(first.registration_socket)
        await second.start()
        assert _accepts(second.registration_socket)
        await second.close()

    asyncio.run(main())


def test_standin_rejects_an_answer_missing_a_claim() -> None:
    from standin.dra_kubelet import _entries

    class Response:
        claims: ClassVar[dict[str, object]] = {"a": object()}

    with pytest.raises(CallFailed, match="skipped 1"):
        _entries("NodePrepareResources", [Claim("n", "a", "a"), Claim("n", "b", "b")], Response())
    with pytest.raises(CallFailed, match="unknown claim"):
        _entries("NodePrepareResources", [], Response())


# Issue 26, 18: a symlink at our directory below the plugins directory is refused, not written through.
def test_a_symlinked_driver_directory_is_refused_and_nothing_is_written_through(tmp: str) -> None:
    async def body(node: Node, kubelet: DraKubeletStandin) -> None:
        elsewhere = os.path.join(tmp, "elsewhere")
        os.makedirs(elsewhere)
        os.makedirs(node.plugins)
        os.symlink(elsewhere, os.path.join(node.plugins, DRIVER))
        with pytest.raises(NotServing, match=f"^{node.plugins}/{DRIVER} is a symlink; refusing to follow it"):
            await node.start("a")
        assert os.listdir(elsewhere) == [] and os.listdir(node.registry) == []

    run(tmp, body)


async def test_standin_tries_a_failed_registration_again_after_the_kubelets_backoff(tmp: str) -> None:
    """The kubelet's plugin manager retries a registration that failed while the socket is there
    (its reconciler every second, its operation executor backing off from 0.5 s): a GetInfo past
    its deadline once is asked again with no new event, and no sooner than that."""
    from standin.dra_kubelet import RETRY_INITIAL_S

    loop = asyncio.get_running_loop()
    registry = os.path.join(tmp, "registry")
    os.makedirs(registry)
    asked: list[float] = []

    class LateOnce:
        async def GetInfo(self, request: Any, context: Any) -> reg.PluginInfo:
            asked.append(loop.time())
            if len(asked) == 1:
                await asyncio.Event().wait()  # never answers: the kubelet's deadline ends the call
            return reg.PluginInfo(
                type=contracts.DRA_PLUGIN_TYPE,
                name=DRIVER,
                endpoint=os.path.join(tmp, "service.sock"),
                supported_versions=[contracts.DRA_VERSION_V1],
            )

        async def NotifyRegistrationStatus(self, request: Any, context: Any) -> reg.RegistrationStatusResponse:
            return reg.RegistrationStatusResponse()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([api.registration_handler(LateOnce())])
    assert server.add_insecure_port(transport.unix_target(os.path.join(registry, "late-reg.sock")))
    await server.start()
    try:
        async with DraKubeletStandin(registry) as kubelet:
            await until(lambda: DRIVER in kubelet.instances, what="registered on the retry")
            assert len(kubelet.refused) == 1 and kubelet.refused[0][1].startswith("dial/GetInfo/notify failed"), (
                kubelet.refused
            )
        assert len(asked) == 2 and asked[1] - asked[0] >= contracts.DRA_GET_INFO_TIMEOUT_S + RETRY_INITIAL_S
    finally:
        await server.stop(0)
