"""The agent as a Type=notify unit under real systemd (PID 1 in systemd-nspawn), talking to the
kubelet stand-in on the host through a bind-mounted device-plugin directory."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from hyperlight_agent import contracts
from standin.kubelet import KubeletStandin, StandinThread
from tests import nspawn
from tests.conftest import make_node, wait_for

pytestmark = pytest.mark.system
UNIT = "hyperlight-agent.service"
R = contracts.RESOURCE_HYPERVISOR


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> str:
    return nspawn.stage(str(tmp_path_factory.mktemp("stage")))


def boot(tmp: str, staged: str, unit: str) -> nspawn.Guest:
    """A guest with a made-for-the-test /dev/kvm (10:232), the agent's files bound in from the
    staged tree, and the host's temp kubelet directory as the device-plugin directory."""
    os.makedirs(os.path.join(tmp, "kubelet"), exist_ok=True)
    kvm = os.path.join(tmp, "kvm")
    if not os.path.exists(kvm):
        make_node(kvm, 10, 232)
    binds = [f"{kvm}:/dev/kvm", f"{tmp}/kubelet:/var/lib/kubelet/device-plugins",
             f"{staged}/usr/lib/hyperlight-agent:/usr/lib/hyperlight-agent",
             f"{staged}/usr/bin/hyperlight-agent:/usr/bin/hyperlight-agent",
             f"{unit}:/etc/systemd/system/{UNIT}",
             f"{staged}/usr/share/man/man8/hyperlight-agent.8.gz:/usr/share/man/man8/hyperlight-agent.8.gz",
             f"{staged}/usr/lib/tmpfiles.d/hyperlight-agent.conf:/etc/tmpfiles.d/hyperlight-agent.conf"]
    return nspawn.Guest(nspawn.rootfs(), binds)


@pytest.fixture
def guest(tmp: str, staged: str) -> Iterator[nspawn.Guest]:
    with boot(tmp, staged, os.path.join(staged, "lib", "systemd", "system", UNIT)) as g:
        yield g


def slots(k: KubeletStandin) -> int:
    p = k.plugins.get(R)
    return p.healthy if p else 0


@pytest.mark.root
def test_notify_unit_is_active_only_when_ready(guest: nspawn.Guest, tmp: str) -> None:
    guest.run("systemctl", "start", "--no-block", UNIT)
    wait_for(lambda: "waiting for kubelet at /var/lib/kubelet/device-plugins/kubelet.sock" in guest.status(UNIT),
             30, "the waiting STATUS")
    assert guest.is_active(UNIT) == "activating", "no kubelet yet: not ready"

    with StandinThread(os.path.join(tmp, "kubelet")) as kubelet:
        kubelet.wait_until(lambda k: slots(k) == 2000, 30, "registration from inside the guest")
        wait_for(lambda: guest.is_active(UNIT) == "active", 15, "READY=1 to make the unit active")
        wait_for(lambda: "Status: \"ready: kvm, 2000 slots, 1 stream\"" in guest.status(UNIT), 10)

        # The kubelet's stream goes away: systemctl status says so, and the agent registers again
        # (the kubelet never dials back by itself). It registers again at once, so this kubelet
        # holds back the next stream for a moment to let the status be seen.
        kubelet.run(lambda k: setattr(k, "open_streams", False))
        kubelet.call(kubelet.kubelet.drop_stream(R))
        wait_for(lambda: "waiting for the kubelet's ListAndWatch stream" in guest.status(UNIT), 10)
        assert "the kubelet's ListAndWatch stream ended; serving and registering again" in guest.run(
            "journalctl", "-u", UNIT, "--no-pager").stdout
        kubelet.run(lambda k: setattr(k, "open_streams", True))
        kubelet.wait_until(lambda k: slots(k) == 2000 and len(k.register_calls) >= 3, 15, "registered again")
        wait_for(lambda: "Status: \"ready: kvm, 2000 slots, 1 stream\"" in guest.status(UNIT), 10)

        # systemctl restart: active again; the kubelet's zero-healthy window is short.
        old = kubelet.kubelet.plugins[R]
        guest.run("systemctl", "restart", UNIT)
        kubelet.wait_until(lambda k: k.plugins[R] is not old and slots(k) == 2000, 30, "registered after restart")
        wait_for(lambda: guest.is_active(UNIT) == "active", 15, "active again")
        new = kubelet.kubelet.plugins[R]
        assert old.stream_ended_at is not None
        healthy_at = next(t for t, devices in new.lists if devices and devices[0][1] == contracts.HEALTHY)
        print(f"systemctl restart: zero-healthy window {(healthy_at - old.stream_ended_at) * 1000:.0f} ms")

        # The journal has our structured fields (python3-systemd is in the guest).
        entries = [json.loads(line) for line in guest.run(
            "journalctl", "-u", UNIT, "-o", "json", "--no-pager").stdout.splitlines()]
        ours = [e for e in entries if e.get("SYSLOG_IDENTIFIER") == "hyperlight-agent"]
        assert ours and ours[-1].get("RESOURCE") == R
        assert ours[-1].get("CDI_PATH") == "/var/run/cdi/hyperlight.json"
        healthy = [e for e in ours if e.get("MESSAGE") == "device healthy: kvm"]
        assert len(healthy) == 2, "one per agent process (the restart started a new one)"
        assert all((e.get("HYPERVISOR"), e.get("DEVICE_PATH")) == ("kvm", "/dev/kvm") for e in healthy)

        guest.run("systemctl", "stop", UNIT)
        assert guest.is_active(UNIT) == "inactive"
        assert not os.path.exists(os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET))


@pytest.mark.root
def test_device_rules_are_enforced(tmp: str, staged: str) -> None:
    """Without the DeviceAllow lines, DevicePolicy=closed keeps the agent from the device."""
    with open(os.path.join(staged, "lib", "systemd", "system", UNIT)) as f:
        text = f.read()
    closed = os.path.join(tmp, "closed.service")
    with open(closed, "w") as f:
        f.write("".join(line for line in text.splitlines(keepends=True) if not line.startswith("DeviceAllow=")))
    with boot(tmp, staged, closed) as guest:
        guest.run("systemctl", "start", "--no-block", UNIT)
        wait_for(lambda: "cannot open read/write: Operation not permitted" in guest.status(UNIT), 30,
                 "the device to be refused by the cgroup device rules")


@pytest.mark.root
def test_unit_verifies_inside_a_system_that_has_the_agent(guest: nspawn.Guest) -> None:
    result = guest.run("systemd-analyze", "verify", f"/etc/systemd/system/{UNIT}", check=False)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


def test_unit_passes_systemd_analyze(staged: str) -> None:
    unit = os.path.join(staged, "lib", "systemd", "system", UNIT)
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=15", unit],
                            capture_output=True, text=True, timeout=60, check=False)
    score = result.stdout.strip().splitlines()[-1]
    print(score)
    assert result.returncode == 0, score
