"""The device plugin registrar in-process, against the kubelet stand-in on the same event loop: what
it does at each step of the lifecycle, observed directly: no kubelet yet, a kubelet that refuses,
hangs or never streams, a kubelet restart, what may sit at our socket path, and the finer points
of socket identity."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
from typing import Any, Awaitable, Callable

import grpc
import pytest

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.backoff import Backoff
from hyperlight_agent.deviceplugin import api, kubelets
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.deviceplugin.plugin_server import AlreadyServed
from hyperlight_agent.deviceplugin.registration import Registrar
from hyperlight_agent.deviceplugin.registration_state import State
from hyperlight_agent.files import atomic, sockets
from hyperlight_agent.files.watcher import DirectoryWatcher
from standin.kubelet import KubeletStandin
from tests.conftest import until
from tests.fakes import registrar

R = contracts.RESOURCE_HYPERVISOR


def make(kubelet_dir: str, on_stream_seen: Callable[[int], None] | None = None, **kw: object) -> Registrar:
    return registrar(kubelet_dir, on_stream_seen, **kw)  # type: ignore[no-any-return]


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
        await until(lambda: registrar.state == State.STREAMED)
        await shut_down(task, registrar)
        assert not os.path.exists(socket_path)

    run(tmp, body)
    assert seen == [(+1, True), (-1, True)]


def test_streams_of_a_replaced_server_change_nothing(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == State.STREAMED)
        old_generation = registrar._server._generation - 1  # a server we no longer run
        registrar._server._on_stream(old_generation, -1, object())
        assert (registrar.state, registrar.current_streams) == (State.STREAMED, 1)
        await shut_down(task, registrar)

    run(tmp, body)


def test_a_kubelet_that_keeps_dropping_streams_backs_us_off(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        losses = Backoff(initial=0.01, rand=lambda: 1.0)
        registrar = make(kdir, loss_backoff=losses)
        task = asyncio.ensure_future(registrar.run())
        for n in range(1, 4):
            await until(lambda: registrar.state == State.STREAMED)
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
        await until(lambda: registrar.state == State.STREAMED)
        target = transport.unix_target(os.path.join(kdir, contracts.PLUGIN_SOCKET))
        async with grpc.aio.insecure_channel(target) as channel:
            observer = api.device_plugin_stub(channel).ListAndWatch(pb.Empty())
            assert len((await observer.read()).devices) == 2  # its stream is open
            assert registrar.current_streams == 2
            await kubelet.drop_stream(R)
            await until(
                lambda: len(kubelet.register_calls) == 2 and kubelet.allocatable() == 2,
                what="registered again although another client's stream is open",
            )
        assert registrar.streams_lost == 1 and registrar.kubelet_restarts == 0
        assert registrar.state == State.STREAMED
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
        await until(lambda: registrar.state == State.STREAMED)
        touch_metadata(os.path.join(kdir, which), change)
        registrar.wake()  # as the watcher does on the ATTRIB event
        # Then something the registrar must act on: had the change looked like a restart, it
        # would have been acted on first.
        await kubelet.drop_stream(R)
        await until(lambda: registrar.streams_lost == 1 and registrar.state == State.STREAMED)
        assert registrar.kubelet_restarts == 0
        assert len(kubelet.register_calls) == 2
        await shut_down(task, registrar)

    run(tmp, body)


def test_our_socket_replaced_by_a_live_one_is_no_kubelet_restart(tmp: str, caplog: pytest.LogCaptureFixture) -> None:
    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == State.STREAMED)
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
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
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
        await until(lambda: registrar.state == State.STREAMED or task.done(), what="streamed")
        assert not task.done(), task.exception()
        await shut_down(task, registrar)

    run(tmp, body)


def test_our_private_socket_removed_before_its_rename_is_served_anew(
    tmp: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
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
        await until(lambda: registrar.state == State.STREAMED or task.done(), what="streamed")
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

    keep = [
        bound(".hyperlight.sock.42.0a1b2c3d", age=None),  # young: maybe a start in progress
        bound(".hyperlight.sock.43.0a1b2c3d", live=True),  # someone serves it
        bound(".hyperlight.sock.44.0A1B2C3D"),
        bound(".hyperlight.sock.45.0a1b2c3"),  # not our pattern
        bound(".hyperlight-access.sock.46.0a1b2c3d"),
        bound("hyperlight.sock.47.0a1b2c3d"),
    ]
    gone = bound(".hyperlight.sock.48.0a1b2c3d")
    with open(os.path.join(kdir, ".hyperlight.sock.49.0a1b2c3d"), "w"):
        pass  # a regular file: not a socket
    os.utime(os.path.join(kdir, ".hyperlight.sock.49.0a1b2c3d"), (old, old))
    before = set(os.listdir(kdir))

    async def body(kubelet: KubeletStandin, kdir: str) -> None:
        registrar = make(kdir)
        task = asyncio.ensure_future(registrar.run())
        await until(lambda: registrar.state == State.STREAMED)
        await shut_down(task, registrar)

    try:
        run(tmp, body)
    finally:
        for sock in [*keep, gone]:
            sock.close()
    left = set(os.listdir(kdir)) - {contracts.KUBELET_SOCKET, contracts.KUBELET_CHECKPOINT}
    assert left == before - {".hyperlight.sock.48.0a1b2c3d"}


@pytest.mark.parametrize(
    "case", ["missing kubelet dir", "kubelet.sock is a regular file", "kubelet.sock is a directory"]
)
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
        registrar = make(
            kdir,
            backoff=Backoff(initial=0.001, cap=0.002, rand=lambda: 1.0),
            on_change=lambda: errors.append(made[0].last_error),
        )
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
    monkeypatch.setattr(kubelets, "VERIFY_INTERVAL_S", 3600.0)
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
        await until(lambda: registrar.state == State.STREAMED and timeouts[-1] is None)
        os.unlink(os.path.join(kdir, contracts.PLUGIN_SOCKET))  # as a starting kubelet does
        await until(lambda: len(kubelet.register_calls) == 2 and registrar.state == State.STREAMED)
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        registrar.wake()
        await until(lambda: timeouts[-1] == 3600.0)
        await shut_down(task, registrar)

    run(tmp, body)


# --- the lifecycle, start to stop (with_registrar runs the registrar) ---


def fast_backoff() -> Backoff:
    return Backoff(initial=0.01, cap=0.05)


def with_registrar(
    tmp: str, body: Callable[[KubeletStandin, Registrar], Awaitable[None]], start_kubelet: bool = True, **kw: Any
) -> None:
    async def main() -> None:
        kubelet = KubeletStandin(os.path.join(tmp, "kubelet"))
        os.makedirs(kubelet.directory, exist_ok=True)
        if start_kubelet:
            await kubelet.start()
        kw.setdefault("backoff", fast_backoff())
        kw.setdefault("loss_backoff", fast_backoff())
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
    return reg.state == State.STREAMED and plugin is not None and plugin.stream_open


def test_no_kubelet_yet_waits_then_registers_as_soon_as_one_appears(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: reg.last_error, what="a failed attempt")
        assert reg.state == State.WAITING and not reg.registered
        assert reg.last_error == f"no kubelet socket at {kubelet.socket_path}"
        await kubelet.start()
        reg.wake()  # as the kubelet directory's watcher does (agent.py)
        await until(lambda: streamed(kubelet, reg), what="registered and streamed")
        assert reg.registrations == 1 and reg.last_error == "" and reg.registered

    # A backoff far longer than the test's deadline: only the new kubelet.sock can end it.
    with_registrar(tmp, body, start_kubelet=False, backoff=Backoff(initial=60, cap=60))


def test_a_regular_file_at_kubelet_sock_is_said_for_what_it_is(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        with open(kubelet.socket_path, "w"):
            pass
        await until(lambda: "is a regular file" in reg.last_error, what="the reason")
        assert reg.last_error == f"{kubelet.socket_path} is a regular file, not the kubelet's socket"
        assert os.path.isfile(kubelet.socket_path), "never removed: it is the kubelet's path"

    with_registrar(tmp, body, start_kubelet=False)


def test_a_kubelet_that_rejects_us_is_retried_with_backoff(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: len(kubelet.register_calls) >= 3, what="retries")
        assert reg.state == State.WAITING
        assert reg.last_error == f"Register with {kubelet.socket_path}: INTERNAL: stand-in rejects registrations"
        kubelet.mode = "normal"
        await until(lambda: streamed(kubelet, reg), what="registered once accepted")

    async def rejecting(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.mode = "reject"
        await kubelet.start()
        await body(kubelet, reg)

    with_registrar(tmp, rejecting, start_kubelet=False)


def test_nothing_is_served_while_backing_off(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.mode = "reject"
        await kubelet.start()
        await until(
            lambda: (
                kubelet.register_calls
                and reg.state == State.WAITING
                and reg.last_error
                and not os.path.exists(reg.socket_path)
            ),
            what="our socket gone after the refusal",
        )
        assert len(kubelet.register_calls) == 1, "a 30 s backoff: no second attempt yet"

    with_registrar(tmp, body, start_kubelet=False, backoff=Backoff(initial=30, cap=30))


def test_a_hung_register_is_bounded_by_its_deadline(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.mode = "hang"
        await kubelet.start()
        await until(lambda: "DEADLINE_EXCEEDED" in reg.last_error, what="the deadline")
        kubelet.mode = "normal"
        kubelet.release()
        await until(lambda: streamed(kubelet, reg), what="registered after the hang")

    with_registrar(tmp, body, start_kubelet=False, register_timeout=0.2)


def test_streamed_only_once_the_kubelet_has_answered_our_register(tmp: str) -> None:
    """The kubelet starts ListAndWatch before its Register returns, so its stream can open (and
    count our slots) before its reply reaches us. Until the reply we are not streamed (not ready):
    a Register that then fails (its deadline) tears our server down, and a READY=1 said before it
    would be taken back. Tests that wait on the kubelet's count, then act on our readiness, wait
    for ours."""

    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.mode = "late_reply"
        await kubelet.start()
        await until(lambda: kubelet.allocatable(R) > 0, what="the kubelet counting our slots")
        assert reg.state is not State.STREAMED and reg.registering_now, "the Register has no reply yet"
        kubelet.release()
        await until(lambda: streamed(kubelet, reg), what="streamed once the reply came")
        assert reg.registrations == 1

    with_registrar(tmp, body, start_kubelet=False)


def test_no_stream_after_register_is_a_lost_registration(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.open_streams = False
        await kubelet.start()
        await until(lambda: reg.state == State.LOST, what="lost")
        assert reg.last_error == "no ListAndWatch stream within 0.2 s of registering"
        kubelet.open_streams = True
        await until(lambda: streamed(kubelet, reg), what="streamed after registering again")
        assert reg.streams_lost >= 1 and len(kubelet.register_calls) >= 2

    with_registrar(tmp, body, start_kubelet=False, stream_open_timeout=0.2)


def test_a_kubelet_restart_registers_again_at_once(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: streamed(kubelet, reg), what="streamed")
        await kubelet.restart()
        reg.wake()  # as the agent's watcher does when the new kubelet.sock appears
        await until(
            lambda: streamed(kubelet, reg) and reg.kubelet_restarts == 1, what="registered with the new kubelet"
        )
        assert reg.registrations == 2 and os.path.exists(reg.socket_path)

    with_registrar(tmp, body, loss_backoff=Backoff(initial=30, cap=30))  # a restart must not wait for a backoff


def test_a_dropped_stream_registers_again(tmp: str) -> None:
    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: streamed(kubelet, reg), what="streamed")
        await kubelet.drop_stream(R)
        await until(lambda: reg.streams_lost == 1 and streamed(kubelet, reg), what="streamed again")
        assert reg.registrations == 2 and reg.kubelet_restarts == 0

    with_registrar(tmp, body)


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
    with_registrar(tmp, body)


def test_a_stale_socket_at_our_path_is_replaced(tmp: str) -> None:
    path = os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET)
    os.makedirs(os.path.dirname(path))
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(path)  # bound, never listening, closed: nothing answers there
    stale_inode = os.lstat(path).st_ino

    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: streamed(kubelet, reg), what="served over the stale socket")
        assert os.lstat(reg.socket_path).st_ino != stale_inode

    with_registrar(tmp, body)


def test_a_kubelet_restart_seen_before_its_stream_end_registers_at_once(
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher's wake (our socket removed, a new kubelet.sock) may reach us before the old
    stream's end does: that stream was the old kubelet's, gone with it, so there is nothing to
    settle before registering with the new one (issue 30: 8)."""
    monkeypatch.setattr(kubelets, "STREAM_SETTLE_S", 30.0)  # a settle here would time out the test
    held: list[tuple[int, int, object]] = []

    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        await until(lambda: streamed(kubelet, reg), what="streamed")
        on_stream = reg._server._on_stream

        def late(generation: int, delta: int, stream: object) -> None:  # the end arrives late
            if delta < 0 and not reg.kubelet_restarts:
                held.append((generation, delta, stream))
            else:
                on_stream(generation, delta, stream)

        monkeypatch.setattr(reg._server, "_on_stream", late)
        await kubelet.restart()
        reg.wake()  # as the watcher does: our socket removed, a new kubelet.sock
        await until(
            lambda: streamed(kubelet, reg) and reg.kubelet_restarts == 1,
            timeout=5,
            what="registered with the new kubelet",
        )
        assert held, "the old stream's end was still undelivered when the restart was seen"

    with_registrar(tmp, body, loss_backoff=Backoff(initial=30, cap=30))


def test_our_socket_removed_during_register_serves_again_at_once(tmp: str) -> None:
    """A kubelet starting removes every socket in its directory: a Register in flight then dials
    back to nothing and would hang until its deadline. It is given up at once (issue 30: 8)."""

    async def body(kubelet: KubeletStandin, reg: Registrar) -> None:
        kubelet.mode = "hang"
        await kubelet.start()
        await until(lambda: kubelet.register_calls, what="a Register in flight")
        kubelet.mode = "normal"
        os.unlink(reg.socket_path)
        reg.wake()  # as the watcher does
        await until(lambda: streamed(kubelet, reg), timeout=5, what="registered again")
        assert len(kubelet.register_calls) == 2
        assert reg.registrations == 1

    with_registrar(tmp, body, start_kubelet=False, register_timeout=30)
