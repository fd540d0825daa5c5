"""The registrar in-process, against the stand-in on the same event loop: what it does at each
step of the lifecycle, observed directly."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
from typing import Awaitable, Callable

import grpc
import pytest

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.backoff import Backoff
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.deviceplugin import api, registration
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.deviceplugin.registration import AlreadyServed, Registrar
from hyperlight_agent.deviceplugin.servicer import DevicePluginServicer, Endpoint, Profile
from hyperlight_agent.files import atomic, sockets
from hyperlight_agent.files.watcher import DirectoryWatcher
from standin.kubelet import KubeletStandin
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
        await until(lambda: registrar.state == registration.State.STREAMED)
        await shut_down(task, registrar)
        assert not os.path.exists(socket_path)

    run(tmp, body)
    assert seen == [(+1, True), (-1, True)]


def test_streams_of_a_replaced_server_change_nothing(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.State.STREAMED)
        old_generation = registrar._generation - 1  # a server we no longer run
        registrar._on_stream(old_generation, -1, object())
        assert (registrar.state, registrar.current_streams) == (registration.State.STREAMED, 1)
        await shut_down(task, registrar)

    run(tmp, body)


def test_a_kubelet_that_keeps_dropping_streams_backs_us_off(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        losses = Backoff(initial=0.01, rand=lambda: 1.0)
        registrar = make(kdir, loss_backoff=losses)
        task = asyncio.ensure_future(registrar.run())
        for n in range(1, 4):
            await until(lambda: registrar.state == registration.State.STREAMED)
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



def test_another_clients_stream_never_hides_the_loss_of_the_kubelets(tmp: str) -> None:
    """A monitoring sidecar or an operator's grpcurl holds a ListAndWatch stream of its own: when
    the kubelet's stream ends, we still register again at once (issue 19, item 2)."""

    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir, loss_backoff=Backoff(initial=0.01, rand=lambda: 1.0))
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.State.STREAMED)
        target = transport.unix_target(os.path.join(kdir, contracts.PLUGIN_SOCKET))
        async with grpc.aio.insecure_channel(target) as channel:
            observer = api.device_plugin_stub(channel).ListAndWatch(pb.Empty())
            assert len((await observer.read()).devices) == 2  # its stream is open
            assert registrar.current_streams == 2
            await kubelet.drop_stream(R)
            await until(lambda: len(kubelet.register_calls) == 2 and kubelet.allocatable() == 2,
                        what="registered again although another client's stream is open")
        assert registrar.streams_lost == 1 and registrar.kubelet_restarts == 0
        assert registrar.state == registration.State.STREAMED
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
        await until(lambda: registrar.state == registration.State.STREAMED)
        touch_metadata(os.path.join(kdir, which), change)
        registrar.wake()  # as the watcher does on the ATTRIB event
        # Then something the registrar must act on: had the change looked like a restart, it
        # would have been acted on first.
        await kubelet.drop_stream(R)
        await until(lambda: registrar.streams_lost == 1 and registrar.state == registration.State.STREAMED)
        assert registrar.kubelet_restarts == 0
        assert len(kubelet.register_calls) == 2
        await shut_down(task, registrar)

    run(tmp, body)


def test_our_socket_replaced_by_a_live_one_is_no_kubelet_restart(tmp: str, caplog: pytest.LogCaptureFixture) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.State.STREAMED)
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


def test_a_stale_socket_that_vanishes_before_the_exchange_is_a_changed_path(
        tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between probing a stale socket and swapping ours in, it is unlinked (the kubelet's startup
    cleanup): we look again and serve, never exit (issue 19, item 6)."""

    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        path = os.path.join(kdir, contracts.PLUGIN_SOCKET)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
            stale.bind(path)  # closed without listening: stale

        def probe_then_vanish(probed: str) -> bool:
            os.unlink(probed)
            return False

        monkeypatch.setattr(sockets, "is_live", probe_then_vanish)
        registrar = make(kdir)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.State.STREAMED or task.done(), what="streamed")
        assert not task.done(), task.exception()
        await shut_down(task, registrar)

    run(tmp, body)


def test_our_private_socket_removed_before_its_rename_is_served_anew(
        tmp: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The kubelet's startup removes every socket in its directory, our private one too, maybe
    just before we rename it into place: we bind anew, and say which file went."""
    real = atomic.rename_noreplace
    removed: list[str] = []

    def remove_first(src: str, dst: str) -> None:
        if not removed:
            removed.append(src)
            os.unlink(src)
        real(src, dst)

    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        monkeypatch.setattr(atomic, "rename_noreplace", remove_first)
        registrar = make(kdir, backoff=Backoff(initial=0.01, rand=lambda: 1.0))
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.State.STREAMED or task.done(), what="streamed")
        assert not task.done(), task.exception()
        await shut_down(task, registrar)

    caplog.set_level("INFO")
    run(tmp, body)
    assert f"{removed[0]}: our socket was removed before it was put in place" in caplog.text


def test_only_our_abandoned_private_sockets_are_swept(tmp: str) -> None:
    """A crash between bind and rename leaves .hyperlight.sock.<pid>.<hex>: removed by the rules
    for CDI temp files (our exact pattern, a socket we own, older than a minute), and only if
    nothing answers on it (issue 19, item 6)."""
    kdir = os.path.join(tmp, "kubelet")
    os.makedirs(kdir)
    old = time.time() - 2 * atomic.ABANDONED_AFTER_S

    def bound(name: str, age: float | None = old, live: bool = False) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(os.path.join(kdir, name))
        if live:
            sock.listen(1)
        if age is not None:
            os.utime(os.path.join(kdir, name), (age, age))
        return sock

    keep = [bound(".hyperlight.sock.42.0a1b2c3d", age=None),  # young: maybe a start in progress
            bound(".hyperlight.sock.43.0a1b2c3d", live=True),  # someone serves it
            bound(".hyperlight.sock.44.0A1B2C3D"), bound(".hyperlight.sock.45.0a1b2c3"),  # not our pattern
            bound(".hyperlight-access.sock.46.0a1b2c3d"), bound("hyperlight.sock.47.0a1b2c3d")]
    gone = bound(".hyperlight.sock.48.0a1b2c3d")
    with open(os.path.join(kdir, ".hyperlight.sock.49.0a1b2c3d"), "w"):
        pass  # a regular file: not a socket
    os.utime(os.path.join(kdir, ".hyperlight.sock.49.0a1b2c3d"), (old, old))
    before = set(os.listdir(kdir))

    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.State.STREAMED)
        await shut_down(task, registrar)

    try:
        run(tmp, body)
    finally:
        for sock in [*keep, gone]:
            sock.close()
    left = set(os.listdir(kdir)) - {contracts.KUBELET_SOCKET, contracts.KUBELET_CHECKPOINT}
    assert left == before - {".hyperlight.sock.48.0a1b2c3d"}


@pytest.mark.parametrize("case", ["missing kubelet dir", "kubelet.sock is a regular file",
                                  "kubelet.sock is a directory"])
def test_why_we_cannot_register_is_one_stable_line_naming_the_path_and_cause(tmp: str, case: str) -> None:
    """Not "cannot listen on …/.hyperlight.sock.<pid>.<hex>" (a new name at every retry) with the
    cause only in grpc's own log, nor "no kubelet socket" for a file that is there (issue 19,
    item 12)."""
    kdir = os.path.join(tmp, "kubelet")
    kubelet_sock = os.path.join(kdir, contracts.KUBELET_SOCKET)
    if case != "missing kubelet dir":
        os.mkdir(kdir)
        if case.endswith("regular file"):
            open(kubelet_sock, "w").close()
        else:
            os.mkdir(kubelet_sock)
    expected = {
        "missing kubelet dir": f"cannot listen in {kdir} (kubelet_dir): the directory does not exist "
                               "(no kubelet installed or started yet?)",
        "kubelet.sock is a regular file": f"{kubelet_sock} is a regular file, not the kubelet's socket",
        "kubelet.sock is a directory": f"{kubelet_sock} is a directory, not the kubelet's socket",
    }[case]
    errors: list[str] = []

    async def main() -> None:
        made: list[Registrar] = []
        registrar = make(kdir, backoff=Backoff(initial=0.001, cap=0.002, rand=lambda: 1.0),
                         on_change=lambda: errors.append(made[0].last_error))
        made.append(registrar)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: len(errors) >= 3, what="three attempts")
        await shut_down(task, registrar)

    asyncio.run(main())
    assert set(errors) == {expected}


def test_a_watched_kubelet_dir_wakes_us_with_no_timer(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the watcher holds a watch on kubelet_dir, the registrar waits for its wake-ups with
    no timeout (the re-check timer here is an hour: only the event can act); once the directory
    is not watched, it re-checks on the timer again."""
    monkeypatch.setattr(registration, "VERIFY_INTERVAL_S", 3600.0)
    timeouts: list[float | None] = []
    event = waits.event

    async def recorded(flag: asyncio.Event, timeout: float | None) -> bool:
        timeouts.append(timeout)
        return await event(flag, timeout)

    monkeypatch.setattr(waits, "event", recorded)

    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        w = DirectoryWatcher()
        registrar = make(kdir, watched=lambda: w.watching(kdir))
        w.watch(kdir, lambda name: registrar.wake(), {contracts.KUBELET_SOCKET, contracts.PLUGIN_SOCKET})
        watching = asyncio.ensure_future(w.run())
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == registration.State.STREAMED and timeouts[-1] is None)
        os.unlink(os.path.join(kdir, contracts.PLUGIN_SOCKET))  # as a starting kubelet does
        await until(lambda: len(kubelet.register_calls) == 2 and registrar.state == registration.State.STREAMED)
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        registrar.wake()
        await until(lambda: timeouts[-1] == 3600.0)
        await shut_down(task, registrar)

    run(tmp, body)
