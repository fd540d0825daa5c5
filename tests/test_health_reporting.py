"""Health as the outside sees it, told truthfully: the gRPC health service, the exec probes,
sd_notify and --check."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from hyperlight_agent import __version__, contracts, modes
from standin.kubelet import StandinThread
from tests.conftest import StartAgent, make_node, run_agent, wait_for

R = contracts.RESOURCE_HYPERVISOR


def probe(tmp: str, which: str, *extra: str) -> tuple[int, str]:
    result = run_agent(
        "--kubelet-dir",
        os.path.join(tmp, "kubelet"),
        f"--health-check={which}",
        *extra,
    )
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout + result.stderr
    return result.returncode, lines[0]


def test_probes_in_every_state(kubelet: StandinThread, start_agent: StartAgent, tmp: str, kvm_dir: str) -> None:
    # Not registered: the kubelet hangs Register, so the agent serves but is not ready.
    kubelet.run(lambda k: setattr(k, "mode", "hang"))
    kubelet.run(lambda k: setattr(k, "open_streams", False))
    start_agent("--device-count", "2", "--device-dir", kvm_dir)
    kubelet.wait_until(lambda k: k.register_calls, 15)
    assert probe(tmp, "liveness") == (0, f"liveness: SERVING ({tmp}/kubelet/hyperlight.sock)")
    code, line = probe(tmp, "readiness")
    assert (code, line.split(" (")[0]) == (1, "readiness: NOT_SERVING")

    # Registered, but no ListAndWatch stream: still not ready.
    kubelet.run(lambda k: setattr(k, "mode", "normal"))
    kubelet.run(lambda k: k.release())
    kubelet.wait_until(lambda k: k.plugins.get(R), 15, "registration")
    assert probe(tmp, "readiness")[0] == 1

    # Ready once the kubelet watches.
    kubelet.run(lambda k: setattr(k, "open_streams", True))
    kubelet.call(kubelet.kubelet.restart())
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    wait_for(lambda: probe(tmp, "readiness")[0] == 0, 10, "readiness")

    # Unhealthy device: live, not ready.
    node = os.path.join(kvm_dir, "kvm")
    os.unlink(node)
    make_node(node, 1, 3)
    kubelet.wait_until(lambda k: k.allocatable() == 0, 10)
    wait_for(lambda: probe(tmp, "readiness")[0] == 1, 10, "not ready when unhealthy")
    assert probe(tmp, "liveness")[0] == 0
    os.unlink(node)
    make_node(node, 10, 232)
    wait_for(lambda: probe(tmp, "readiness")[0] == 0, 10, "ready again")

    # The kubelet's stream ends: not ready until a new one opens (the agent registers again at
    # once; this kubelet then opens no stream for a while).
    kubelet.run(lambda k: setattr(k, "open_streams", False))
    kubelet.call(kubelet.kubelet.drop_stream(R))
    wait_for(lambda: probe(tmp, "readiness")[0] == 1, 10, "not ready without a stream")
    kubelet.run(lambda k: setattr(k, "open_streams", True))
    wait_for(lambda: probe(tmp, "readiness")[0] == 0, 15, "ready with a stream again")


def test_device_access_probe_uses_its_own_socket(
    kubelet: StandinThread, start_agent: StartAgent, tmp: str, kvm_dir: str
) -> None:
    start_agent("--device-access", "--device-dir", kvm_dir)
    kubelet.wait_until(
        lambda k: (
            k.plugins.get(contracts.RESOURCE_DEVICE_ACCESS)
            and k.allocatable(contracts.RESOURCE_DEVICE_ACCESS) == modes.DEVICE_ACCESS.slots
        ),
        15,
    )
    wait_for(lambda: probe(tmp, "readiness", "--device-access")[0] == 0, 10)
    assert "hyperlight-access.sock" in probe(tmp, "liveness", "--device-access")[1]
    assert probe(tmp, "liveness")[1].startswith("liveness: not serving: no socket")


def test_a_named_instance_is_probed_at_its_own_socket(
    kubelet: StandinThread, start_agent: StartAgent, tmp: str, kvm_dir: str
) -> None:
    """In a pod the agent serves hyperlight.<pod>.sock: the exec probe, with the same settings,
    checks that socket, not another agent's."""
    start_agent("--device-dir", kvm_dir, "--device-count", "2", "--instance", "pod-a")
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    wait_for(lambda: probe(tmp, "readiness", "--instance", "pod-a")[0] == 0, 10)
    assert "hyperlight.pod-a.sock" in probe(tmp, "liveness", "--instance", "pod-a")[1]
    assert probe(tmp, "liveness", "--instance", "pod-b")[1].startswith("liveness: not serving: no socket")
    assert probe(tmp, "liveness")[1].startswith("liveness: not serving: no socket")


class NotifySocket:
    """What systemd's end of NOTIFY_SOCKET would receive."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []

    def drain(self) -> list[str]:
        while True:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                break
            self.messages.append((time.monotonic(), data.decode()))
        return [m for _, m in self.messages]

    def lines(self) -> list[str]:
        return [line for m in self.drain() for line in m.split("\n")]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp: str) -> Iterator[NotifySocket]:
    ns = NotifySocket(os.path.join(tmp, "notify"))
    yield ns
    ns.close()


def test_sd_notify_sequence(tmp: str, start_agent: StartAgent, notify_socket: NotifySocket, kvm_dir: str) -> None:
    config = os.path.join(tmp, "agent.toml")
    with open(config, "w") as f:
        f.write("device_count = 3\n")
    agent = start_agent(
        "--config",
        config,
        "--device-dir",
        kvm_dir,
        env={"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "200000"},
    )
    wait_for(lambda: any(line.startswith("STATUS=waiting for kubelet at ") for line in notify_socket.lines()), 10)
    wait_for(lambda: notify_socket.lines().count("WATCHDOG=1") >= 3, 10, "watchdog pings at WATCHDOG_USEC/2")
    assert any(line.startswith("EXTEND_TIMEOUT_USEC=") for line in notify_socket.lines()), (
        "until ready, pings also extend systemd's start timeout"
    )
    assert "READY=1" not in notify_socket.lines(), "no kubelet yet: not ready"
    # A reload while still activating must not send READY=1 (it would make the unit active).
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "RELOADING=1" in notify_socket.lines(), 10)
    wait_for(lambda: "reloading configuration" in agent.log, 10)
    assert "READY=1" not in notify_socket.lines()

    with StandinThread(os.path.join(tmp, "kubelet")) as kubelet:
        kubelet.wait_until(lambda k: k.allocatable() == 3, 15)
        wait_for(lambda: "READY=1" in notify_socket.lines(), 10, "READY=1")
        ready_message = next(m for m in notify_socket.drain() if "READY=1" in m)
        assert "STATUS=ready: kvm, 3 slots, 1 stream" in ready_message
        assert notify_socket.lines().count("READY=1") == 1

        # SIGHUP applies a changed file between RELOADING=1 and READY=1.
        with open(config, "w") as f:
            f.write("device_count = 5\n")
        agent.proc.send_signal(signal.SIGHUP)
        kubelet.wait_until(lambda k: k.allocatable() == 5, 10, "5 slots after reload")
        lines = notify_socket.lines()
        last_reload = len(lines) - 1 - lines[::-1].index("RELOADING=1")
        assert "READY=1" in lines[last_reload:], "a reload of a ready agent ends with READY=1"

        # Settings naming what is watched or served change only on restart.
        with open(config, "w") as f:
            f.write(f'device_count = 5\nnfd_features_dir = "{tmp}/elsewhere"\n')
        agent.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "nfd_features_dir change only on restart" in agent.log, 10)

        # An invalid file is refused: the running settings stay, and STATUS says why.
        with open(config, "w") as f:
            f.write("device_count = 0\n")
        before = len(notify_socket.lines())
        agent.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any(line.startswith("STATUS=reload failed") for line in notify_socket.lines()[before:]), 10)
        assert "device_count in" in agent.log and "reload failed" in agent.log
        assert kubelet.kubelet.allocatable() == 5
        assert agent.stop() == 0
    assert "STOPPING=1" in notify_socket.lines()


def test_without_notify_socket_nothing_is_sent_and_nothing_fails(
    kubelet: StandinThread, start_agent: StartAgent
) -> None:
    agent = start_agent("--device-count", "1")
    kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
    assert agent.stop() == 0
    assert "ERROR" not in agent.log and "Traceback" not in agent.log


def test_check_reports_a_usable_node(tmp: str, kvm_dir: str) -> None:
    cdi_dir = os.path.join(tmp, "cdi")
    result = run_agent(
        "--check",
        "--device-dir",
        kvm_dir,
        "--cdi-dir",
        cdi_dir,
        "--kubelet-dir",
        tmp,  # the kubelet's directory is checked too: one is there
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok   runtime: the agent imports and its gRPC server binds a unix socket" in result.stdout
    assert f"ok   device: kvm at {kvm_dir}/kvm" in result.stdout
    assert "ok   probe: empty VM created and closed" in result.stdout
    assert "note CDI spec:" in result.stdout
    assert f"ok   kubelet_dir: {tmp}" in result.stdout
    assert not os.path.exists(cdi_dir), "--check changes nothing"


@pytest.mark.root
def test_check_reports_an_unusable_node(tmp: str) -> None:
    dev = os.path.join(tmp, "dev")
    os.mkdir(dev)
    make_node(os.path.join(dev, "kvm"), 1, 3)
    result = run_agent("--check", "--device-dir", dev, "--kubelet-dir", tmp)
    assert result.returncode == 1
    assert "FAIL probe:" in result.stdout and "KVM_GET_API_VERSION failed" in result.stdout
    os.unlink(os.path.join(dev, "kvm"))
    result = run_agent("--check", "--device-dir", dev, "--kubelet-dir", tmp)
    assert result.returncode == 1 and "FAIL device: no hypervisor device in" in result.stdout
    assert result.stderr == "", "the report is the output; no log lines besides it"
    lines = result.stdout.splitlines()
    hints = [line for line in lines if line.startswith("hint ")]
    assert hints[0].startswith("hint /dev/mshv: ") and hints[1].startswith("hint /dev/kvm: "), hints
    assert "modprobe kvm_intel or kvm_amd" in hints[1] and "nested virtualisation" in hints[1]
    assert hints[2:] == [f"hint in a container, {dev} must be the host's /dev mounted in (device_dir, host_device_dir)"]


def test_check_hints_name_the_usual_causes_of_a_failed_probe() -> None:
    from hyperlight_agent.diagnose import _probe_hints

    assert "run it as root" in _probe_hints("cannot open /dev/kvm: Permission denied")[0]
    assert "nested virtualisation" in _probe_hints("KVM_CREATE_VM failed: Device or resource busy")[0]
    # Every failed probe says what to do, also for words the table does not know.
    assert "not a working hypervisor device" in _probe_hints("something else")[0]


def test_a_notify_reader_that_never_reads_cannot_wedge_the_agent(
    kubelet: StandinThread, start_agent: StartAgent, tmp: str
) -> None:
    path = os.path.join(tmp, "deaf")
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deaf.bind(path)  # the queue fills after a few datagrams; sends would then block
    try:
        agent = start_agent("--device-count", "1", env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})
        kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
        started = time.monotonic()
        assert agent.stop(timeout=10) == 0
        assert time.monotonic() - started < 5
    finally:
        deaf.close()


def test_no_ready_while_unhealthy_and_status_says_why(
    tmp: str, start_agent: StartAgent, notify_socket: NotifySocket
) -> None:
    cdi_dir = os.path.join(tmp, "cdi")
    os.mkdir(cdi_dir)
    os.symlink("/etc/hostname", os.path.join(cdi_dir, "hyperlight.json"))
    agent = start_agent("--device-count", "2", env={"NOTIFY_SOCKET": notify_socket.path})
    with StandinThread(os.path.join(tmp, "kubelet")) as kubelet:
        # Registered, streamed, but unhealthy: never READY=1.
        kubelet.wait_until(lambda k: k.plugins.get(R) and k.plugins[R].stream_open and k.plugins[R].lists, 15)
        wanted = (
            f"STATUS=unhealthy: {cdi_dir}/hyperlight.json is a symlink; refusing to follow or replace it"
            f"; version {__version__}"
        )
        wait_for(lambda: wanted in notify_socket.lines(), 10, "the unhealthy STATUS")
        assert "READY=1" not in notify_socket.lines()
        os.unlink(os.path.join(cdi_dir, "hyperlight.json"))
        kubelet.wait_until(lambda k: k.allocatable() == 2, 10)
        wait_for(lambda: "READY=1" in notify_socket.lines(), 10, "READY=1 once healthy")
        assert agent.stop() == 0


def test_the_diagnosis_loads_without_grpc() -> None:
    """`--check` reports a grpc that cannot be imported (a tree built for another Python) as a
    FAIL line, so nothing it imports before that point may import grpc itself."""
    code = (
        "import sys\nfrom hyperlight_agent import diagnose, parts\n"
        "print('GRPC', sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True).stdout
    assert "GRPC []" in out, out
