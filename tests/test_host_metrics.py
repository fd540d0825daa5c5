"""The optional Prometheus endpoint: off by default; when on, it tells what happened."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import urllib.request
from typing import NamedTuple

import grpc
import pytest

from hyperlight_agent import contracts, modes, parts
from standin.kubelet import StandinThread
from tests.conftest import StartAgent, wait_for
from tests.test_docs import ROOT

R = contracts.RESOURCE_HYPERVISOR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        body: bytes = response.read()
        return body.decode()


def test_metrics_count_what_happened(kubelet: StandinThread, start_agent: StartAgent) -> None:
    address = f"127.0.0.1:{free_port()}"
    start_agent("--device-count", "2", "--metrics-address", address)
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    kubelet.call(kubelet.kubelet.allocate(R, ["kvm-0"]))
    with pytest.raises(grpc.aio.AioRpcError):
        kubelet.call(kubelet.kubelet.raw_allocate(R, ["kvm-9"]))
    kubelet.call(kubelet.kubelet.restart())
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    text = wait_for(
        lambda: (t := scrape(address)) and "hyperlight_kubelet_restarts_total 1.0" in t and t,
        10,
        "the restart to be counted",
    )
    for line in (
        "hyperlight_device_healthy 1.0",
        'hyperlight_allocations_total{outcome="ok"} 1.0',
        'hyperlight_allocations_total{outcome="invalid"} 1.0',
        "hyperlight_registrations_total 2.0",
        "hyperlight_listandwatch_streams 1.0",
        "hyperlight_cdi_repairs_total 0.0",  # the first write is no repair (issue 36: 5)
        "hyperlight_probe_helper_timeouts_total 0.0",
    ):
        assert line in text, line
    assert 'hyperlight_checks_total{result="ok"}' in text
    assert "hyperlight_check_duration_seconds_bucket" in text


def test_metrics_are_off_by_default(kubelet: StandinThread, start_agent: StartAgent) -> None:
    agent = start_agent("--device-count", "1")
    kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
    assert agent.stop() == 0
    assert "metrics on" not in agent.log


def test_metrics_count_failures_by_cause_and_helper_timeouts(
    kubelet: StandinThread, start_agent: StartAgent, kvm_dir: str
) -> None:
    address = f"127.0.0.1:{free_port()}"
    agent = start_agent(
        "--device-count", "1", "--device-dir", kvm_dir, "--metrics-address", address, "--check-interval", "1"
    )
    kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
    (helper,) = agent.helpers()
    os.kill(helper, signal.SIGSTOP)  # the next check times out and kills it
    wait_for(lambda: "hyperlight_probe_helper_timeouts_total 1.0" in scrape(address), 10, "a helper timeout")
    text = scrape(address)
    assert 'hyperlight_check_failures_total{cause="probe"} 1.0' in text
    kubelet.wait_until(lambda k: k.allocatable() == 1, 10, "recovery with a new helper")
    os.unlink(os.path.join(kvm_dir, "kvm"))
    wait_for(lambda: 'hyperlight_device_unhealthy_cause{cause="no-device"} 1.0' in scrape(address), 10)
    assert "hyperlight_device_healthy 0.0" in scrape(address)


def accept_queue(port: int) -> int:
    """Connections waiting in the kernel for the listener on 127.0.0.1:port to accept them."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # LISTEN
                return int(fields[4].split(":")[1], 16)
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


FD_LIMIT = 128


def test_idle_connections_to_the_metrics_port_never_cost_a_slot(
    kubelet: StandinThread, start_agent: StartAgent, tmp: str
) -> None:
    """Three times the descriptor limit in half-sent requests: the metrics server caps its
    connections, so the device check, Allocate and the kubelet's stream never run short, and a
    scrape still gets through (issue 19, item 1)."""
    address = f"127.0.0.1:{free_port()}"
    port = int(address.rsplit(":", 1)[1])
    agent = start_agent("--device-count", "2", "--metrics-address", address, prefix=["prlimit", f"--nofile={FD_LIMIT}"])
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    wait_for(lambda: "hyperlight_device_healthy 1.0" in scrape(address), 10, "metrics served")
    idle: list[socket.socket] = []
    timeouts = 0
    try:
        while len(idle) < 3 * FD_LIMIT and timeouts < 3:
            client = socket.socket()
            idle.append(client)
            client.settimeout(3)
            try:
                client.connect(("127.0.0.1", port))
                client.send(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            except TimeoutError:
                timeouts += 1  # the agent takes no more connections (it ran out of descriptors)
            except OSError:
                pass  # evicted already
        # Whatever the agent will take from its backlog, it has taken, or it has run out.
        wait_for(lambda: accept_queue(port) == 0 or fds(agent.proc.pid) >= FD_LIMIT - 2, 20, "the flood accepted")
        for _ in range(10):
            assert kubelet.call(kubelet.kubelet.allocate(R, ["kvm-0"])).container_responses
        assert kubelet.kubelet.allocatable() == 2
        assert fds(agent.proc.pid) < FD_LIMIT // 2
        assert "hyperlight_device_healthy 1.0" in scrape(address)
    finally:
        for client in idle:
            client.close()
    assert kubelet.run(lambda k: all(h == "Healthy" for _, devices in k.plugins[R].lists for _, h in devices[:1]))
    assert agent.stop() == 0
    assert "Too many open files" not in agent.log


def test_garbage_to_the_metrics_port_is_answered_without_a_traceback(
    kubelet: StandinThread, start_agent: StartAgent
) -> None:
    address = f"127.0.0.1:{free_port()}"
    port = int(address.rsplit(":", 1)[1])
    agent = start_agent("--device-count", "1", "--metrics-address", address)
    kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
    wait_for(lambda: "hyperlight_device_healthy" in scrape(address), 10, "metrics served")
    answers = {}
    for name, request in {
        "garbage": b"\x00\xff\x16\x03\x01 junk\r\n\r\n",
        "not http": b"HELLO\r\n\r\n",
        "post": b"POST /metrics HTTP/1.1\r\n\r\n",
        "elsewhere": b"GET /x HTTP/1.1\r\n\r\n",
        "health": b"GET /healthz HTTP/1.1\r\n\r\n",  # answered, not 404 (issue 36: 5)
        "too long": b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n",
    }.items():
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            with contextlib.suppress(OSError):
                client.sendall(request)
            try:
                answers[name] = client.recv(64).split(b"\r\n", 1)[0]
            except OSError:
                answers[name] = b""
    assert answers == {
        "garbage": b"HTTP/1.1 400 Bad Request",
        "not http": b"HTTP/1.1 400 Bad Request",
        "post": b"HTTP/1.1 405 Method Not Allowed",
        "elsewhere": b"HTTP/1.1 404 Not Found",
        "health": b"HTTP/1.1 200 OK",
        "too long": b"",
    }
    assert "hyperlight_device_healthy 1.0" in scrape(address)
    assert agent.stop() == 0
    assert "Traceback" not in agent.log and len(agent.log.splitlines()) < 30, agent.log


def test_a_metrics_address_in_use_is_said_and_retried(kubelet: StandinThread, start_agent: StartAgent) -> None:
    """Metrics are optional; the slots are not: the agent serves the kubelet, says which setting
    cannot be served and why, and binds once the port is free (issue 19, item 12)."""
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        address = f"127.0.0.1:{squatter.getsockname()[1]}"
        agent = start_agent("--device-count", "1", "--metrics-address", address)
        kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
        wait_for(lambda: f"metrics_address {address}: cannot listen: Address already in use" in agent.log, 10)
    wait_for(lambda: "hyperlight_device_healthy 1.0" in scrape_or_empty(address), 40, "metrics once the port is free")
    assert agent.proc.poll() is None
    assert agent.stop() == 0


def scrape_or_empty(address: str) -> str:
    try:
        return scrape(address)
    except OSError:
        return ""


class Row(NamedTuple):
    kind: str
    labels: dict[str, tuple[str, ...]]  # label name → the fixed values documented (() when not fixed)
    modes: set[str]


MODE_NAMES = ("plugin", "device-access", "dra")


def documented() -> dict[str, Row]:
    """docs/metrics.md's table: series → its type, labels (with their fixed values) and modes."""
    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        text = f.read().split("\n## Alerts")[0]  # the series' table, not the alerts'
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| `")]
    table = {}
    for cells in rows:
        labels: dict[str, tuple[str, ...]] = {}
        for part in cells[2].split(";"):
            name, _, values = part.partition(":")
            for label in re.findall(r"`([a-z_]+)`", name):
                words = tuple(re.findall(r"`([^`]+)`", values))
                fixed = bool(words) and re.fullmatch(r"\s*(`[^`]+`,?\s*)+", values) is not None
                labels[label] = words if fixed else ()
        modes = set(MODE_NAMES) if cells[3].strip() == "all" else {m.strip() for m in cells[3].split(",")}
        table[cells[0].strip().strip("`")] = Row(cells[1].strip(), labels, modes)
    return table


def exposition(mode: modes.Mode) -> dict[str, tuple[str, set[tuple[tuple[str, str], ...]]]]:
    """What an agent of `mode` serves at its start: family → (type, the label sets of its series)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hyperlight_agent.host.metrics import Metrics

    metrics = Metrics(True, {"version": "0", "commit": "x", "mode": mode.name}, cdi=not mode.inventory_only)
    parts.row(mode).outcomes(metrics.families)  # the mode's protocol's own series, as the agent makes them
    text = generate_latest(metrics.registry).decode()
    served = {}
    for family in text_string_to_metric_families(text):
        # The text format has no info type: an Info is a gauge ending in _info, always 1.
        kind = "gauge (info)" if family.type == "gauge" and family.name.endswith("_info") else family.type
        series = {
            tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            for sample in family.samples
            if not sample.name.endswith(("_sum", "_count"))
        }
        served[family.name + ("_total" if family.type == "counter" else "")] = (kind, series)
    return served


@pytest.mark.parametrize("mode", modes.MODES, ids=lambda m: m.name)
def test_the_exposition_is_docs_metrics_md(mode: modes.Mode) -> None:
    """docs/metrics.md lists exactly what an agent of each mode serves: its families and their
    types; each labelled series with fixed values served at 0 from the start, every value the table
    names (issue 36: 5); nothing undocumented (no `_created`)."""
    docs = {name: row for name, row in documented().items() if mode.name in row.modes}
    served = exposition(mode)
    assert {name: row.kind for name, row in docs.items()} == {name: kind for name, (kind, _) in served.items()}
    assert not any(name.endswith("_created") for name in served)
    for name, (_, series) in served.items():
        labels = docs[name].labels
        if name == "hyperlight_build_info":
            assert series == {(("commit", "x"), ("mode", mode.name), ("version", "0"))}
            continue
        if not labels:
            assert series == {()}, name
            continue
        if not all(labels.values()):
            assert series == set(), f"{name}: its values are not known at start"
            continue
        every = {tuple(sorted(zip(labels, combo))) for combo in itertools.product(*labels.values())}
        assert series == every, name


def test_build_info_and_process_series_are_served(tmp: str) -> None:
    from prometheus_client import generate_latest

    from hyperlight_agent.host.metrics import Metrics

    metrics = Metrics(True, {"version": "9.9.9", "commit": "abc", "mode": "dra"})
    parts.row(modes.DRA).outcomes(metrics.families)
    text = generate_latest(metrics.registry).decode()
    assert 'hyperlight_build_info{commit="abc",mode="dra",version="9.9.9"} 1.0' in text
    assert "process_resident_memory_bytes " in text and "process_start_time_seconds " in text
    # DRA claim outcomes start at 0, so that increase() sees the first failed claim.
    assert 'hyperlight_dra_claims_total{operation="prepare",result="error"} 0.0' in text


def test_device_info_follows_the_device_and_repairs_count_only_rewrites() -> None:
    """hyperlight_device_info names the device found; the first write of the CDI spec is no
    repair, a write after the spec was right is (issue 36: 5)."""
    from prometheus_client import generate_latest

    from hyperlight_agent.device.observation import Cause, Observation
    from hyperlight_agent.host.metrics import Metrics

    metrics = Metrics(True, {"mode": "plugin"}, device_dir="/host-dev")
    metrics.check_done(Observation(False, "no device", None, Cause.NO_DEVICE), 0.01, False)
    metrics.check_done(Observation(True, "", "kvm"), 0.01, True)  # the first write
    text = generate_latest(metrics.registry).decode()
    assert 'hyperlight_device_info{hypervisor="kvm",path="/host-dev/kvm"} 1.0' in text
    assert "hyperlight_cdi_repairs_total 0.0" in text
    assert 'hyperlight_check_failures_total{cause="no-device"} 1.0' in text
    assert 'hyperlight_device_unhealthy_cause{cause="no-device"} 0.0' in text
    metrics.check_done(Observation(True, "", "kvm"), 0.01, True)  # someone changed it
    metrics.check_done(Observation(False, "gone", None, Cause.NO_DEVICE), 0.01, False)
    text = generate_latest(metrics.registry).decode()
    assert "hyperlight_cdi_repairs_total 1.0" in text
    assert "hyperlight_device_info{" not in text
    assert 'hyperlight_device_unhealthy_cause{cause="no-device"} 1.0' in text
