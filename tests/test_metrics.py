"""The optional Prometheus endpoint: off by default; when on, it tells what happened."""

from __future__ import annotations

import os
import signal
import socket
import urllib.request

import grpc
import pytest

from hyperlight_agent import contracts
from hyperlight_agent.standin import KubeletStandin, StandinThread
from tests.conftest import StartAgent, wait_for

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


def slots(k: KubeletStandin) -> int:
    p = k.plugins.get(R)
    return p.healthy if p else 0


def test_metrics_count_what_happened(kubelet: StandinThread, start_agent: StartAgent) -> None:
    address = f"127.0.0.1:{free_port()}"
    start_agent("--device-count", "2", "--metrics-address", address)
    kubelet.wait_until(lambda k: slots(k) == 2, 15)
    kubelet.call(kubelet.kubelet.allocate(R, ["kvm-0"]))
    with pytest.raises(grpc.aio.AioRpcError):
        kubelet.call(kubelet.kubelet.raw_allocate(R, ["kvm-9"]))
    kubelet.call(kubelet.kubelet.restart())
    kubelet.wait_until(lambda k: slots(k) == 2, 15)
    text = wait_for(lambda: (t := scrape(address)) and "hyperlight_kubelet_restarts_total 1.0" in t and t,
                    10, "the restart to be counted")
    for line in ("hyperlight_device_healthy 1.0", 'hyperlight_allocations_total{outcome="ok"} 1.0',
                 'hyperlight_allocations_total{outcome="invalid"} 1.0', "hyperlight_registrations_total 2.0",
                 "hyperlight_listandwatch_streams 1.0", "hyperlight_cdi_repairs_total 1.0",
                 "hyperlight_probe_helper_timeouts_total 0.0"):
        assert line in text, line
    assert 'hyperlight_checks_total{result="ok"}' in text
    assert "hyperlight_check_duration_seconds_bucket" in text


def test_metrics_are_off_by_default(kubelet: StandinThread, start_agent: StartAgent) -> None:
    agent = start_agent("--device-count", "1")
    kubelet.wait_until(lambda k: slots(k) == 1, 15)
    assert agent.stop() == 0
    assert "metrics on" not in agent.log


def test_metrics_count_failures_by_cause_and_helper_timeouts(kubelet: StandinThread, start_agent: StartAgent,
                                                             kvm_dir: str) -> None:
    address = f"127.0.0.1:{free_port()}"
    agent = start_agent("--device-count", "1", "--device-dir", kvm_dir, "--metrics-address", address,
                        "--check-interval", "1")
    kubelet.wait_until(lambda k: slots(k) == 1, 15)
    (helper,) = agent.helpers()
    os.kill(helper, signal.SIGSTOP)  # the next check times out and kills it
    wait_for(lambda: "hyperlight_probe_helper_timeouts_total 1.0" in scrape(address), 10, "a helper timeout")
    text = scrape(address)
    assert 'hyperlight_check_failures_total{cause="probe"} 1.0' in text
    kubelet.wait_until(lambda k: slots(k) == 1, 10, "recovery with a new helper")
    os.unlink(os.path.join(kvm_dir, "kvm"))
    wait_for(lambda: 'hyperlight_device_unhealthy_cause{cause="no-device"} 1.0' in scrape(address), 10)
    assert "hyperlight_device_healthy 0.0" in scrape(address)
