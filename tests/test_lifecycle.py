"""Registration lifecycle against a stand-in as strict as the real kubelet: a lost stream is
registered again, shutdown ends the stream before the socket goes, nobody else's socket is
ever deleted, and signals at any moment stop the agent cleanly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import stat
import time

import grpc
import pytest

from hyperlight_agent import contracts
from hyperlight_agent.deviceplugin import registration
from standin import kubelet as standin
from standin.kubelet import KubeletStandin, NotAllocatable, Plugin, StandinThread
from tests.conftest import StartAgent, wait_for

# Real agents on real device nodes (mknod) and the host's /dev/kvm.
pytestmark = pytest.mark.root

R = contracts.RESOURCE_HYPERVISOR


def plugin(k: KubeletStandin) -> Plugin | None:
    return k.plugins.get(R)



def socket_identity(path: str) -> tuple[int, int]:
    st = os.lstat(path)
    assert stat.S_ISSOCK(st.st_mode)
    return (st.st_dev, st.st_ino)


@pytest.mark.parametrize("flavor", standin.FLAVORS)
def test_stream_dropped_by_the_kubelet_is_registered_again(kubelet: StandinThread, start_agent: StartAgent,
                                                            flavor: str) -> None:
    kubelet.run(lambda k: setattr(k, "flavor", flavor))
    start_agent("--device-count", "3")
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15)
    seconds = []
    for _ in range(3):
        first = plugin(kubelet.kubelet)
        calls = len(kubelet.kubelet.register_calls)
        kubelet.call(kubelet.kubelet.drop_stream(R))
        started = time.monotonic()
        assert kubelet.kubelet.allocatable() == 0, "a dropped stream leaves nothing allocatable"
        kubelet.wait_until(lambda k, first=first: plugin(k) is not first and k.allocatable() == 3, 5,  # type: ignore[misc]
                           "Healthy again")
        seconds.append(time.monotonic() - started)
        assert len(kubelet.kubelet.register_calls) == calls + 1
    print(f"stream dropped → Healthy again: {', '.join(f'{s * 1000:.0f} ms' for s in seconds)}")
    assert kubelet.call(kubelet.kubelet.allocate(R, ["kvm-2"])).container_responses


def test_no_stream_after_register_is_registered_again(kubelet: StandinThread, start_agent: StartAgent) -> None:
    kubelet.run(lambda k: setattr(k, "open_streams", False))
    agent = start_agent("--device-count", "2")
    kubelet.wait_until(lambda k: k.plugins.get(R), 15, "the first registration")
    kubelet.run(lambda k: setattr(k, "open_streams", True))
    kubelet.wait_until(lambda k: k.allocatable() == 2, registration.STREAM_OPEN_TIMEOUT_S + 5,
                       "a second Register, this time streamed")
    assert len(kubelet.kubelet.register_calls) == 2
    wait_for(lambda: "no ListAndWatch stream within" in agent.log, 5)


@pytest.mark.parametrize("flavor", standin.FLAVORS)
def test_old_stream_ends_before_the_next_register(kubelet: StandinThread, start_agent: StartAgent, tmp: str,
                                                  flavor: str) -> None:
    """Our socket deleted under a live stream (no kubelet restart): the agent serves anew. The old
    stream must end before the new Register, or the kubelet disconnects the new registration
    (1.34) or refuses a Register at a socket path still connected (1.35+)."""
    kubelet.run(lambda k: setattr(k, "flavor", flavor))
    start_agent("--device-count", "2")
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    old = plugin(kubelet.kubelet)
    assert old is not None
    os.unlink(os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET))
    kubelet.wait_until(lambda k: plugin(k) is not old and k.allocatable() == 2, 10, "registered again")
    new = plugin(kubelet.kubelet)
    assert new is not None and old.stream_ended_at is not None
    register_at = kubelet.kubelet.register_calls[-1][0]
    assert old.stream_ended_at < register_at, "the old stream must end before the new Register"
    assert len(kubelet.kubelet.register_calls) == 2 and not new.stopped
    assert kubelet.call(kubelet.kubelet.allocate(R, ["kvm-0"])).container_responses


def test_shutdown_ends_the_stream_and_removes_the_socket(kubelet: StandinThread, start_agent: StartAgent,
                                                         tmp: str) -> None:
    """(The order — stream first, then socket — is checked in-process in test_registration.py.)"""
    agent = start_agent("--device-count", "2")
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    p = plugin(kubelet.kubelet)
    assert p is not None
    assert agent.stop() == 0
    kubelet.wait_until(lambda k: not p.stream_open, 5)
    assert not os.path.exists(os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET))
    with pytest.raises(NotAllocatable):
        kubelet.call(kubelet.kubelet.allocate(R, ["kvm-0"]))


def test_two_agents_on_one_directory_one_serves(kubelet: StandinThread, start_agent: StartAgent, tmp: str) -> None:
    first = start_agent("--device-count", "2")
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    path = os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET)
    before = socket_identity(path)
    second = start_agent("--device-count", "2")
    assert second.proc.wait(15) == 1
    assert f"{path}: another agent is serving it" in second.log
    assert socket_identity(path) == before, "the survivor's socket is untouched"
    assert len(kubelet.kubelet.register_calls) == 1, "the resource never flapped"
    assert kubelet.kubelet.allocatable() == 2
    assert first.proc.poll() is None
    assert first.stop() == 0


def test_a_foreign_live_socket_is_never_unlinked(kubelet: StandinThread, start_agent: StartAgent, tmp: str) -> None:
    path = os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as foreign:
        foreign.bind(path)
        foreign.listen(1)
        before = socket_identity(path)
        agent = start_agent("--device-count", "2")
        assert agent.proc.wait(15) == 1
        assert "another agent is serving it" in agent.log
        assert socket_identity(path) == before
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)  # still the foreign server's, still answering
    assert not kubelet.kubelet.register_calls


def test_a_stale_socket_is_replaced(kubelet: StandinThread, start_agent: StartAgent, tmp: str) -> None:
    path = os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays; nothing listens
    before = socket_identity(path)
    agent = start_agent("--device-count", "2")
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    assert socket_identity(path) != before
    assert agent.stop() == 0
    assert nothing_left(tmp) == []


def nothing_left(tmp: str) -> list[str]:
    """Files of ours left in the kubelet directory (the stand-in's own are expected)."""
    ours = set(os.listdir(os.path.join(tmp, "kubelet"))) - {contracts.KUBELET_SOCKET, contracts.KUBELET_CHECKPOINT}
    return sorted(ours)


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for sig (the SigCgt mask in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_in_the_first_moments(kubelet: StandinThread, start_agent: StartAgent, tmp: str, sig: int) -> None:
    """A signal during startup: TERM/INT stop cleanly (exit 0), HUP is harmless. Our handlers are
    the first thing our code installs (before that only the interpreter's own start-up, a few
    tens of ms, runs); the signal lands at once after, or a little later, during imports."""
    for delay in (0.0, 0.02, 0.1):
        agent = start_agent("--device-count", "1")
        wait_for(lambda a=agent: catches(a.proc.pid, signal.SIGTERM), 10, "the early handlers")  # type: ignore[misc]
        time.sleep(delay)  # not synchronisation: lands somewhere in startup, wherever it is
        agent.proc.send_signal(sig)
        if sig == signal.SIGHUP:
            kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
            assert agent.stop() == 0
        else:
            assert agent.proc.wait(10) == 0, agent.log
        wait_for(lambda: not nothing_left(tmp), 5, "no socket left")
        wait_for(lambda a=agent: not a.helpers_left(), 5, "no helper left")  # type: ignore[misc]


def test_sigterm_during_a_hung_register(kubelet: StandinThread, start_agent: StartAgent, tmp: str) -> None:
    kubelet.run(lambda k: setattr(k, "mode", "hang"))
    agent = start_agent("--device-count", "1")
    kubelet.wait_until(lambda k: k.register_calls, 15)
    started = time.monotonic()
    assert agent.stop() == 0
    print(f"stop during a hung Register: {(time.monotonic() - started) * 1000:.0f} ms")
    assert not nothing_left(tmp)


def test_sigterm_during_a_stalled_check(kubelet: StandinThread, start_agent: StartAgent, tmp: str) -> None:
    agent = start_agent("--device-count", "1")
    kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
    (helper,) = agent.helpers()
    os.kill(helper, signal.SIGSTOP)  # the next check hangs in the helper for its 2 s deadline
    allocate = asyncio.run_coroutine_threadsafe(kubelet.kubelet.raw_allocate(R, ["kvm-0"]), kubelet.loop)
    time.sleep(0.3)  # not synchronisation: lands anywhere inside the 2 s stall
    assert agent.stop() == 0
    # Answered, or cut off by the stop (the stand-in closes its connection when the stream ends,
    # as the kubelet does, which cancels the call): never left hanging.
    with contextlib.suppress(grpc.aio.AioRpcError, concurrent.futures.CancelledError):
        allocate.result(10)
    assert not nothing_left(tmp)
    wait_for(lambda: not agent.helpers_left(), 5, "the stalled helper is killed and reaped")


def test_stalled_helper_is_rechecked_promptly(kubelet: StandinThread, start_agent: StartAgent, tmp: str) -> None:
    """A stalled helper makes one check fail; the next one follows at once, not an interval later."""
    agent = start_agent("--device-count", "1", "--check-interval", "3600")
    kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
    (helper,) = agent.helpers()
    os.kill(helper, signal.SIGSTOP)
    with open(os.path.join(tmp, "cdi", contracts.CDI_SPEC_FILE), "wb") as f:
        f.write(b"{")  # inotify asks for a check, which stalls in the helper and times out
    kubelet.wait_until(lambda k: k.allocatable() == 0, 10, "Unhealthy after the helper missed its deadline")
    kubelet.wait_until(lambda k: k.allocatable() == 1, 10, "Healthy again without waiting an hour")
    assert helper not in agent.helpers()


def zero_after_healthy(k: KubeletStandin, since: float) -> list[float]:
    """Moments after `since` at which the stand-in counted no allocatable slot of R."""
    return [at for at, counts in k.timeline if at >= since and counts.get(R, 0) == 0]


@pytest.mark.parametrize("flavor", standin.FLAVORS)
def test_handover_to_a_successor(kubelet: StandinThread, start_agent: StartAgent, tmp: str, flavor: str) -> None:
    """A surge update: the successor registers under its own socket beside the running agent;
    the running agent, stopped, serves on until the successor is ready, then ends its stream.
    1.35+ never counts zero slots; 1.34 disconnects the successor once and it registers again
    at once (kubernetes issue 121994)."""
    kubelet.run(lambda k: setattr(k, "flavor", flavor))
    old = start_agent("--device-count", "3", "--instance", "agent-old", "--handover-seconds", "30")
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15, "the first agent serving")
    new = start_agent("--device-count", "3", "--instance", "agent-new", "--handover-seconds", "0.5")
    kubelet.wait_until(lambda k: plugin(k) is not None and plugin(k).endpoint == "hyperlight.agent-new.sock"  # type: ignore[union-attr]
                       and k.allocatable() == 3, 15, "the successor registered beside it")
    since = time.monotonic()
    assert zero_after_healthy(kubelet.kubelet, since) == []
    assert old.stop(timeout=10) == 0, old.log
    assert "handing over to " + os.path.join(tmp, "kubelet", "hyperlight.agent-new.sock") in old.log
    assert not os.path.exists(os.path.join(tmp, "kubelet", "hyperlight.agent-old.sock"))
    kubelet.wait_until(lambda k: k.allocatable() == 3 and plugin(k).endpoint == "hyperlight.agent-new.sock",  # type: ignore[union-attr]
                       10, "the successor serving alone")
    zeros = zero_after_healthy(kubelet.kubelet, since)
    registers = [r.endpoint for _, r in kubelet.kubelet.register_calls]
    if flavor == "1.35":
        assert zeros == [], "the kubelet never counted zero slots"
        assert registers == ["hyperlight.agent-old.sock", "hyperlight.agent-new.sock"]
    else:
        assert registers == ["hyperlight.agent-old.sock", "hyperlight.agent-new.sock", "hyperlight.agent-new.sock"]
        back = next(at for at, counts in kubelet.kubelet.timeline if at > zeros[0] and counts.get(R) == 3)
        print(f"1.34 handover: zero slots for {(back - zeros[0]) * 1000:.1f} ms")
    assert kubelet.call(kubelet.kubelet.allocate(R, ["kvm-0"])).container_responses
    assert new.stop() == 0


def test_handover_without_a_successor_stops_after_the_bound(kubelet: StandinThread, start_agent: StartAgent) -> None:
    agent = start_agent("--device-count", "2", "--instance", "alone", "--handover-seconds", "0.5")
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    p = plugin(kubelet.kubelet)
    assert p is not None
    assert agent.stop(timeout=10) == 0
    assert "no successor within 0.5 s" in agent.log
    assert p.stream_ended_at is not None


def test_a_successor_that_is_not_ready_is_not_handed_over_to(kubelet: StandinThread, start_agent: StartAgent,
                                                             tmp: str) -> None:
    """A peer socket that answers but is not ready (no kubelet stream) is no successor."""
    agent = start_agent("--device-count", "2", "--instance", "one", "--handover-seconds", "0.5")
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    kubelet.run(lambda k: setattr(k, "mode", "reject"))  # the second agent never gets registered
    second = start_agent("--device-count", "2", "--instance", "two")
    wait_for(lambda: "registration failed" in second.log, 15, "the second agent's Register refused")
    assert agent.stop(timeout=10) == 0
    assert "no successor within 0.5 s" in agent.log
    second.stop()


def test_a_kubelet_that_is_down_a_while_is_served_anew_when_it_returns(kubelet: StandinThread,
                                                                        start_agent: StartAgent) -> None:
    """The stream ends because the kubelet stops; registering again on the same server fails
    while it is down, and when it comes back (having removed every socket) the agent must serve
    anew, not register the server whose socket is gone (the kubelet would fail to dial it)."""
    agent = start_agent("--device-count", "2")
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    kubelet.call(kubelet.kubelet.stop())
    wait_for(lambda: "registration failed" in agent.log, 10, "a Register while the kubelet is down")
    calls = len(kubelet.kubelet.register_calls)
    kubelet.call(kubelet.kubelet.restart())
    kubelet.wait_until(lambda k: k.allocatable() == 2, 5, "served and registered anew")
    assert len(kubelet.kubelet.register_calls) == calls + 1, "one Register, to a socket that exists"
