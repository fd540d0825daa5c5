"""The registrar in-process, against the stand-in on the same event loop: what it does at each
step of the lifecycle, observed directly."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from typing import Awaitable, Callable

import grpc
import pytest

from hyperlight_agent import api, contracts, registration
from hyperlight_agent import deviceplugin_pb2 as pb
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

    def configure(server: grpc.aio.Server, on_stream: Callable[[int, object], None]) -> Callable[[], None]:
        def counted(delta: int, stream: object) -> None:
            if on_stream_seen:
                on_stream_seen(delta)
            on_stream(delta, stream)

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
        registrar._on_stream(old_generation, -1, object())
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


def healthy(kubelet: KubeletStandin) -> int:
    p = kubelet.plugins.get(R)
    return p.healthy if p else 0


def test_another_clients_stream_never_hides_the_loss_of_the_kubelets(tmp: str) -> None:
    """A monitoring sidecar or an operator's grpcurl holds a ListAndWatch stream of its own: when
    the kubelet's stream ends, we still register again at once (issue 19, item 2)."""

    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir, loss_backoff=Backoff(initial=0.01, rand=lambda: 1.0))
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.STREAMED)
        target = api.unix_target(os.path.join(kdir, contracts.PLUGIN_SOCKET))
        async with grpc.aio.insecure_channel(target) as channel:
            observer = api.device_plugin_stub(channel).ListAndWatch(pb.Empty())
            assert len((await observer.read()).devices) == 2  # its stream is open
            assert registrar.streams == 2
            await kubelet.drop_stream(R)
            await until(lambda: len(kubelet.register_calls) == 2 and healthy(kubelet) == 2,
                        what="registered again although another client's stream is open")
        assert registrar.streams_lost == 1 and registrar.kubelet_restarts == 0
        assert registrar.state == registration.STREAMED
        await shut_down(task, registrar)

    run(tmp, body)


def touch_metadata(path: str, change: str) -> None:
    st = os.lstat(path)
    if change == "chmod":
        os.chmod(path, 0o600 if stat.S_IMODE(st.st_mode) != 0o600 else 0o644)
    elif change == "touch":
        os.utime(path)
    elif change == "chown":
        os.chown(path, st.st_uid, st.st_gid)  # a no-op chown still changes the ctime
    else:
        os.link(path, path + ".link")
        os.unlink(path + ".link")
    assert os.lstat(path).st_ctime_ns != st.st_ctime_ns or change == "touch"


@pytest.mark.parametrize("change", ["chmod", "touch", "chown", "hard link"])
@pytest.mark.parametrize("which", [contracts.PLUGIN_SOCKET, contracts.KUBELET_SOCKET])
def test_a_metadata_change_is_no_kubelet_restart(tmp: str, which: str, change: str) -> None:
    """restorecon, backup tools and hardening scripts touch sockets: only a different file at the
    path is a restart, never a changed one (issue 19, item 3)."""

    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir, loss_backoff=Backoff(initial=0.01, rand=lambda: 1.0))
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.STREAMED)
        touch_metadata(os.path.join(kdir, which), change)
        registrar.wake()  # as the watcher does on the ATTRIB event
        # Then something the registrar must act on: had the change looked like a restart, it
        # would have been acted on first.
        await kubelet.drop_stream(R)
        await until(lambda: registrar.streams_lost == 1 and registrar.state == registration.STREAMED)
        assert registrar.kubelet_restarts == 0
        assert len(kubelet.register_calls) == 2
        await shut_down(task, registrar)

    run(tmp, body)


def test_our_socket_replaced_by_a_live_one_is_no_kubelet_restart(tmp: str, caplog: pytest.LogCaptureFixture) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.STREAMED)
        path = os.path.join(kdir, contracts.PLUGIN_SOCKET)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
            other.bind(path + ".other")
            other.listen(1)
            os.rename(path + ".other", path)
            registrar.wake()
            with pytest.raises(AlreadyServed, match=f"{path}: another agent is serving it"):
                await task
            await registrar.stop()
            assert os.path.exists(path), "the other agent's socket stays"
        assert registrar.kubelet_restarts == 0
        assert "kubelet restart detected" not in caplog.text
        assert f"{path} is no longer our socket" in caplog.text

    caplog.set_level("INFO")
    run(tmp, body)
