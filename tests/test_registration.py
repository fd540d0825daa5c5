"""The registrar in-process, against the stand-in on the same event loop: what it does at each
step of the lifecycle, observed directly."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Awaitable, Callable

import grpc
import pytest

from hyperlight_agent import api, contracts, registration
from hyperlight_agent.observation import Observation, SharedObservation
from hyperlight_agent.registration import AlreadyServed, Backoff, Registrar
from hyperlight_agent.servicer import DevicePluginServicer, Endpoint, Profile
from hyperlight_agent.standin import KubeletStandin
from tests.conftest import until

R = contracts.RESOURCE_HYPERVISOR



def make(kubelet_dir: str, on_stream_seen: Callable[[int], None] | None = None,
         **kw: object) -> Registrar:
    state = SharedObservation()
    state.publish(Observation(True, "", "kvm"))
    servicer = DevicePluginServicer(Profile(R, contracts.PLUGIN_SOCKET, 2, "cdi"), state, None)  # type: ignore[arg-type]

    def configure(server: grpc.aio.Server, on_stream: Callable[[int], None]) -> Callable[[], None]:
        def counted(delta: int) -> None:
            if on_stream_seen:
                on_stream_seen(delta)
            on_stream(delta)

        endpoint = Endpoint(servicer, counted)
        server.add_generic_rpc_handlers([api.device_plugin_handler(endpoint)])
        return endpoint.close

    return Registrar(kubelet_dir, contracts.PLUGIN_SOCKET, R, configure, **kw)  # type: ignore[arg-type]


def run(tmp: str, body: Callable[[KubeletStandin, str], Awaitable[None]]) -> None:
    async def main() -> None:
        kubelet = KubeletStandin(os.path.join(tmp, "kubelet"))
        await kubelet.start()
        try:
            await body(kubelet, kubelet.directory)
        finally:
            await kubelet.stop()

    asyncio.run(main())


async def shut_down(task: asyncio.Task[None], registrar: Registrar) -> None:
    """As the agent's close(): cancel the registrar's loop, then stop serving."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await registrar.stop()


def test_stop_ends_the_stream_while_the_socket_is_still_there(tmp: str) -> None:
    """The kubelet must see the stream end before (not after) our socket disappears."""
    seen: list[tuple[int, bool]] = []

    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        socket_path = os.path.join(kdir, contracts.PLUGIN_SOCKET)
        registrar = make(kdir, lambda delta: seen.append((delta, os.path.exists(socket_path))))
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.STREAMED)
        await shut_down(task, registrar)
        assert not os.path.exists(socket_path)

    run(tmp, body)
    assert seen == [(+1, True), (-1, True)]


def test_streams_of_a_replaced_server_change_nothing(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.STREAMED)
        old_generation = registrar._generation - 1  # a server we no longer run
        registrar._on_stream(old_generation, -1)
        assert (registrar.state, registrar.streams) == (registration.STREAMED, 1)
        await shut_down(task, registrar)

    run(tmp, body)


def test_a_kubelet_that_keeps_dropping_streams_backs_us_off(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        losses = Backoff(initial=0.01, rand=lambda: 1.0)
        registrar = make(kdir, loss_backoff=losses)
        task = asyncio.ensure_future(registrar.run())
        for n in range(1, 4):
            await until(lambda: registrar.state == registration.STREAMED)
            await kubelet.drop_stream(R)
            await until(lambda n=n: registrar.streams_lost == n)  # type: ignore[misc]
        assert losses.attempt == 3, "each loss waits longer than the last"
        assert len(kubelet.register_calls) in (3, 4)
        await shut_down(task, registrar)

    run(tmp, body)


def test_a_live_socket_at_our_path_is_another_agents(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        path = os.path.join(kdir, contracts.PLUGIN_SOCKET)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
            other.bind(path)
            other.listen(1)
            inode = os.lstat(path).st_ino
            registrar = make(kdir)
            with pytest.raises(AlreadyServed, match=f"{path}: another agent is serving it"):
                await registrar.run()
            await registrar.stop()
            assert os.lstat(path).st_ino == inode
            assert [n for n in os.listdir(kdir) if n.startswith(".")] == [], "our private socket is gone"

    run(tmp, body)
