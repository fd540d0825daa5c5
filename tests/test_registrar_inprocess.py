"""The registrar's lifecycle in-process against the kubelet stand-in, for the fast loop: no
kubelet yet, a kubelet that refuses, hangs or never streams, a kubelet restart, and what may sit
at our socket path. (tests/test_registration.py holds the finer points of socket identity.)"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, Awaitable, Callable

import grpc

from hyperlight_agent import contracts
from hyperlight_agent.backoff import Backoff
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.deviceplugin import api, registration
from hyperlight_agent.deviceplugin.registration import Registrar
from hyperlight_agent.deviceplugin.servicer import DevicePluginServicer, Endpoint, Profile
from standin.kubelet import KubeletStandin
from tests.conftest import until
from tests.fakes import FakeChecker

R = contracts.RESOURCE_HYPERVISOR


def fast_backoff() -> Backoff:
    return Backoff(initial=0.01, cap=0.05)


def registrar(kubelet_dir: str, **kw: Any) -> Registrar:
    state = SharedObservation()
    state.publish(Observation(True, "", "kvm"))
    servicer = DevicePluginServicer(Profile(R, contracts.PLUGIN_SOCKET, 2, "cdi"), state,
                                    FakeChecker())  # type: ignore[arg-type]

    def configure(server: grpc.aio.Server, on_stream: Callable[[int, object], None]) -> Callable[[], None]:
        endpoint = Endpoint(servicer, on_stream)
        server.add_generic_rpc_handlers([api.device_plugin_handler(endpoint)])
        return endpoint.close

    kw.setdefault("backoff", fast_backoff())
    kw.setdefault("loss_backoff", fast_backoff())
    return Registrar(kubelet_dir, contracts.PLUGIN_SOCKET, R, configure, **kw)


def run(tmp: str, body: Callable[[KubeletStandin, Registrar], Awaitable[None]], start_kubelet: bool = True,
        **kw: Any) -> None:
    async def main() -> None:
        kubelet = KubeletStandin(os.path.join(tmp, "kubelet"))
        os.makedirs(kubelet.directory, exist_ok=True)
        if start_kubelet:
            await kubelet.start()
        reg = registrar(kubelet.directory, **kw)
        task = asyncio.ensure_future(reg.run())
        try:
            await body(kubelet, reg)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await reg.stop()
            await kubelet.stop()
        assert not os.path.exists(reg.socket_path), "our socket is removed on stop"

    asyncio.run(main())


def streamed(kubelet: KubeletStandin, reg: Registrar) -> bool:
    plugin = kubelet.plugins.get(R)
    return reg.state == registration.State.STREAMED and plugin is not None and plugin.stream_open


def test_no_kubelet_yet_waits_then_registers_as_soon_as_one_appears(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: reg.last_error, what="a failed attempt")
        assert reg.state == registration.State.WAITING and not reg.registered
        assert reg.last_error == f"no kubelet socket at {kubelet.socket_path}"
        await kubelet.start()
        reg.wake()  # as the kubelet directory's watcher does (agent.py)
        await until(lambda: streamed(kubelet, reg), what="registered and streamed")
        assert reg.registrations == 1 and reg.last_error == "" and reg.registered

    # A backoff far longer than the test's deadline: only the new kubelet.sock can end it.
    run(tmp, body, start_kubelet=False, backoff=Backoff(initial=60, cap=60))


def test_a_regular_file_at_kubelet_sock_is_said_for_what_it_is(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        with open(kubelet.socket_path, "w"):
            pass
        await until(lambda: "is a regular file" in reg.last_error, what="the reason")
        assert reg.last_error == f"{kubelet.socket_path} is a regular file, not the kubelet's socket"
        assert os.path.isfile(kubelet.socket_path), "never removed: it is the kubelet's path"

    run(tmp, body, start_kubelet=False)


def test_a_kubelet_that_rejects_us_is_retried_with_backoff(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: len(kubelet.register_calls) >= 3, what="retries")
        assert reg.state == registration.State.WAITING
        assert reg.last_error == f"Register with {kubelet.socket_path}: INTERNAL: stand-in rejects registrations"
        kubelet.mode = "normal"
        await until(lambda: streamed(kubelet, reg), what="registered once accepted")

    async def rejecting(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.mode = "reject"
        await kubelet.start()
        await body(kubelet, reg)

    run(tmp, rejecting, start_kubelet=False)


def test_nothing_is_served_while_backing_off(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.mode = "reject"
        await kubelet.start()
        await until(lambda: kubelet.register_calls and reg.state == registration.State.WAITING and reg.last_error
                    and not os.path.exists(reg.socket_path), what="our socket gone after the refusal")
        assert len(kubelet.register_calls) == 1, "a 30 s backoff: no second attempt yet"

    run(tmp, body, start_kubelet=False, backoff=Backoff(initial=30, cap=30))


def test_a_hung_register_is_bounded_by_its_deadline(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.mode = "hang"
        await kubelet.start()
        await until(lambda: "DEADLINE_EXCEEDED" in reg.last_error, what="the deadline")
        kubelet.mode = "normal"
        kubelet.release()
        await until(lambda: streamed(kubelet, reg), what="registered after the hang")

    run(tmp, body, start_kubelet=False, register_timeout=0.2)


def test_no_stream_after_register_is_a_lost_registration(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.open_streams = False
        await kubelet.start()
        await until(lambda: reg.state == registration.State.LOST, what="lost")
        assert reg.last_error == "no ListAndWatch stream within 0.2 s of registering"
        kubelet.open_streams = True
        await until(lambda: streamed(kubelet, reg), what="streamed after registering again")
        assert reg.streams_lost >= 1 and len(kubelet.register_calls) >= 2

    run(tmp, body, start_kubelet=False, stream_open_timeout=0.2)


def test_a_kubelet_restart_registers_again_at_once(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: streamed(kubelet, reg), what="streamed")
        await kubelet.restart()
        reg.wake()  # as the agent's watcher does when the new kubelet.sock appears
        await until(lambda: streamed(kubelet, reg) and reg.kubelet_restarts == 1,
                    what="registered with the new kubelet")
        assert reg.registrations == 2 and os.path.exists(reg.socket_path)

    run(tmp, body, loss_backoff=Backoff(initial=30, cap=30))  # a restart must not wait for a backoff


def test_a_dropped_stream_registers_again(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: streamed(kubelet, reg), what="streamed")
        await kubelet.drop_stream(R)
        await until(lambda: reg.streams_lost == 1 and streamed(kubelet, reg), what="streamed again")
        assert reg.registrations == 2 and reg.kubelet_restarts == 0

    run(tmp, body)


def test_a_file_at_our_socket_path_is_never_replaced(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: "is not a socket" in reg.last_error, what="the refusal")
        assert reg.last_error == f"{reg.socket_path} exists and is not a socket; not replacing it"
        with open(reg.socket_path) as f:
            assert f.read() == "not ours"
        os.unlink(reg.socket_path)
        await until(lambda: streamed(kubelet, reg), what="served once the path is free")

    os.makedirs(os.path.join(tmp, "kubelet"))
    with open(os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET), "w") as f:
        f.write("not ours")
    run(tmp, body)


def test_a_stale_socket_at_our_path_is_replaced(tmp: str) -> None:
    path = os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET)
    os.makedirs(os.path.dirname(path))
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(path)  # bound, never listening, closed: nothing answers there
    stale_inode = os.lstat(path).st_ino

    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: streamed(kubelet, reg), what="served over the stale socket")
        assert os.lstat(reg.socket_path).st_ino != stale_inode

    run(tmp, body)

