"""The agent as a Type=notify unit under real systemd (PID 1 in systemd-nspawn), talking to the
kubelet stand-in on the host through a bind-mounted device-plugin directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Optional

import pytest

from hyperlight_agent import __version__, contracts
from hyperlight_agent.device.helper import HELPER_MARK
from standin.kubelet import KubeletStandin, StandinThread
from tests import nspawn
from tests.conftest import make_node, wait_for

pytestmark = pytest.mark.system
UNIT = "hyperlight-agent.service"
R = contracts.RESOURCE_HYPERVISOR
READY_STATUS = f'Status: "ready: kvm, 2000 slots, 1 stream; version {__version__}"'


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> str:
    return nspawn.stage(str(tmp_path_factory.mktemp("stage")))


def boot(tmp: str, staged: str, unit: str, tree: Optional[str] = None) -> nspawn.Guest:
    """A guest with a made-for-the-test /dev/kvm (10:232), the agent's files bound in from the
    staged tree (its /usr/lib/hyperlight-agent from `tree` when given), and the host's temp
    kubelet directory as the device-plugin directory."""
    os.makedirs(os.path.join(tmp, "kubelet"), exist_ok=True)
    kvm = os.path.join(tmp, "kvm")
    if not os.path.exists(kvm):
        make_node(kvm, 10, 232)
    binds = [
        f"{kvm}:/dev/kvm",
        f"{tmp}/kubelet:/var/lib/kubelet/device-plugins",
        f"{tree or staged + '/usr/lib/hyperlight-agent'}:/usr/lib/hyperlight-agent",
        f"{staged}/usr/bin/hyperlight-agent:/usr/bin/hyperlight-agent",
        f"{unit}:/etc/systemd/system/{UNIT}",
        f"{staged}/usr/share/man/man8/hyperlight-agent.8.gz:/usr/share/man/man8/hyperlight-agent.8.gz",
        f"{staged}/usr/lib/tmpfiles.d/hyperlight-agent.conf:/etc/tmpfiles.d/hyperlight-agent.conf",
    ]
    return nspawn.Guest(nspawn.rootfs(), binds)


@pytest.fixture
def guest(tmp: str, staged: str) -> Iterator[nspawn.Guest]:
    with boot(tmp, staged, os.path.join(staged, "lib", "systemd", "system", UNIT)) as g:
        yield g


def slots(k: KubeletStandin) -> int:
    return k.allocatable(R)


@pytest.mark.root
def test_notify_unit_is_active_only_when_ready(guest: nspawn.Guest, tmp: str) -> None:
    guest.run("systemctl", "start", "--no-block", UNIT)
    wait_for(
        lambda: "waiting for kubelet at /var/lib/kubelet/device-plugins/kubelet.sock" in guest.status(UNIT),
        30,
        "the waiting STATUS",
    )
    assert guest.is_active(UNIT) == "activating", "no kubelet yet: not ready"

    with StandinThread(os.path.join(tmp, "kubelet")) as kubelet:
        kubelet.wait_until(lambda k: slots(k) == 2000, 30, "registration from inside the guest")
        wait_for(lambda: guest.is_active(UNIT) == "active", 15, "READY=1 to make the unit active")
        wait_for(lambda: READY_STATUS in guest.status(UNIT), 10)

        # The kubelet's stream goes away: systemctl status says so, and the agent registers again
        # (the kubelet never dials back by itself). It registers again at once, so this kubelet
        # holds back the next stream for a moment to let the status be seen.
        kubelet.run(lambda k: setattr(k, "open_streams", False))
        kubelet.call(kubelet.kubelet.drop_stream(R))
        wait_for(lambda: "waiting for the kubelet's ListAndWatch stream" in guest.status(UNIT), 10)
        guest.journal(UNIT, "the kubelet's ListAndWatch stream ended; serving and registering again")
        kubelet.run(lambda k: setattr(k, "open_streams", True))
        kubelet.wait_until(lambda k: slots(k) == 2000 and len(k.register_calls) >= 3, 15, "registered again")
        wait_for(lambda: READY_STATUS in guest.status(UNIT), 10)

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
        entries = [
            json.loads(line)
            for line in guest.run("journalctl", "-u", UNIT, "-o", "json", "--no-pager").stdout.splitlines()
        ]
        ours = [e for e in entries if e.get("SYSLOG_IDENTIFIER") == "hyperlight-agent"]
        assert ours and ours[-1].get("RESOURCE") == R
        assert ours[-1].get("CDI_PATH") == "/var/run/cdi/hyperlight.json"
        healthy = [e for e in ours if e.get("MESSAGE") == "device healthy: kvm"]
        assert len(healthy) == 2, "one per agent process (the restart started a new one)"
        assert all((e.get("HYPERVISOR"), e.get("DEVICE_PATH")) == ("kvm", "/dev/kvm") for e in healthy)

        guest.run("systemctl", "stop", UNIT)
        assert guest.is_active(UNIT) == "inactive"
        assert not os.path.exists(os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET))


def agents(guest: nspawn.Guest) -> list[int]:
    """The unit's agent processes (its cgroup's, probe helpers aside)."""
    procs = guest.run("cat", f"/sys/fs/cgroup/system.slice/{UNIT}/cgroup.procs", check=False).stdout.split()
    found = []
    for pid in procs:
        cmdline = guest.run("cat", f"/proc/{pid}/cmdline", check=False).stdout
        if cmdline and HELPER_MARK not in cmdline:
            found.append(int(pid))
    return found


def main_pid(guest: nspawn.Guest) -> int:
    return int(guest.run("systemctl", "show", "-P", "MainPID", UNIT).stdout.strip())


@pytest.mark.root
def test_reload_upgrades_in_place_and_a_failing_new_agent_leaves_the_old_one_serving(tmp: str, staged: str) -> None:
    """`systemctl reload` (ExecReload=hyperlight-agent --upgrade-in-place $MAINPID) under real
    systemd: the kubelet never counts zero slots, the new process is the unit's main process and
    the watchdog's, one agent is left; a new agent that fails leaves the old one serving and the
    reload failed."""
    tree = os.path.join(tmp, "tree")
    shutil.copytree(os.path.join(staged, "usr", "lib", "hyperlight-agent"), tree, symlinks=True)
    with (
        StandinThread(os.path.join(tmp, "kubelet")) as kubelet,
        boot(tmp, staged, os.path.join(staged, "lib", "systemd", "system", UNIT), tree) as guest,
    ):
        kubelet.run(lambda k: setattr(k, "flavor", "1.37"))
        guest.run("systemctl", "start", "--no-block", UNIT)
        kubelet.wait_until(lambda k: slots(k) == 2000, 30, "registration from inside the guest")
        wait_for(lambda: guest.is_active(UNIT) == "active", 15, "active")
        first, since = main_pid(guest), time.monotonic()

        started = time.monotonic()
        reload = guest.run("systemctl", "reload", UNIT, check=False, timeout=90)
        print(f"systemctl reload (in-place upgrade) took {(time.monotonic() - started) * 1000:.0f} ms")
        assert reload.returncode == 0, (reload.stderr, guest.run("journalctl", "-u", UNIT, "--no-pager").stdout)
        second = main_pid(guest)
        assert second != first and guest.is_active(UNIT) == "active"
        assert agents(guest) == [second]
        journal = guest.journal(UNIT, f"handed over to pid {second}")
        for complaint in ("not our child", "reception only permitted for main PID", "Supervising process"):
            assert complaint not in journal, journal
        wait_for(lambda: READY_STATUS in guest.status(UNIT), 10, "the new process's status line")
        kubelet.wait_until(lambda k: k.plugins[R].endpoint.startswith("hyperlight.host-g"), 10)
        assert [at for at, counts in kubelet.kubelet.timeline if at >= since and counts.get(R, 0) == 0] == []
        assert sorted(os.listdir(os.path.join(tmp, "kubelet"))) == sorted(
            ["kubelet.sock", "kubelet_internal_checkpoint", kubelet.kubelet.plugins[R].endpoint]
        )

        # The code installed next fails at its start: the reload fails, the old agent serves on.
        with open(os.path.join(tree, "hyperlight_agent", "agent.py"), "a") as f:
            f.write("\nraise RuntimeError('broken on purpose')\n")
        since = time.monotonic()
        failed = guest.run("systemctl", "reload", UNIT, check=False, timeout=90)
        assert failed.returncode != 0
        assert main_pid(guest) == second and guest.is_active(UNIT) == "active"
        assert agents(guest) == [second]
        guest.journal(UNIT, "in-place upgrade failed:")
        # The child's last words came on its stderr stream (journal.last_words), our line as a
        # native journal message: journald files the two channels in no fixed order, so each is
        # waited for.
        journal = guest.journal(UNIT, "fatal: broken on purpose")
        assert sum("in-place upgrade failed:" in line for line in journal.splitlines()) == 1, journal
        assert [at for at, counts in kubelet.kubelet.timeline if at >= since and counts.get(R, 0) == 0] == []
        guest.run("systemctl", "stop", UNIT)
        assert agents(guest) == []


def broken_tree(tmp: str, staged: str) -> str:
    """A copy of the installed code whose agent fails at its start (the error is a fatal one)."""
    tree = os.path.join(tmp, "broken")
    shutil.copytree(os.path.join(staged, "usr", "lib", "hyperlight-agent"), tree, symlinks=True)
    with open(os.path.join(tree, "hyperlight_agent", "agent.py"), "a") as f:
        f.write("\nraise RuntimeError('broken on purpose')\n")
    return tree


@pytest.mark.root
def test_a_fatal_error_reaches_the_units_journal_after_the_agent_has_exited(tmp: str, staged: str) -> None:
    """journald files a native message under its sender's unit by reading the sender's /proc when
    it gets to the message; a busy journald gets to an agent's last words after the agent has
    exited. Here journald is paused while the agent fails at its start and exits: `journalctl -u`
    must still say why it failed."""
    with open(os.path.join(staged, "lib", "systemd", "system", UNIT)) as f:
        text = f.read()
    once = os.path.join(tmp, "once.service")
    with open(once, "w") as f:  # one start: a restart's own fatal line would hide a lost first one
        f.write(text.replace("Restart=on-failure", "Restart=no"))
    with boot(tmp, staged, once, broken_tree(tmp, staged)) as guest:
        guest.run("systemctl", "kill", "--signal=SIGSTOP", "systemd-journald.service")
        try:
            guest.run("systemctl", "start", "--no-block", UNIT)
            wait_for(
                lambda: guest.run("systemctl", "show", "-P", "ExecMainStatus", UNIT).stdout.strip() == "1",
                30,
                "the agent to fail at its start",
            )
        finally:
            guest.run("systemctl", "kill", "--signal=SIGCONT", "systemd-journald.service")
        pid = guest.run("systemctl", "show", "-P", "ExecMainPID", UNIT).stdout.strip()
        journal = guest.journal(UNIT, f"[{pid}]: fatal: broken on purpose")
        assert guest.is_active(UNIT) == "failed", journal


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
        wait_for(
            lambda: "cannot open read/write: Operation not permitted" in guest.status(UNIT),
            30,
            "the device to be refused by the cgroup device rules",
        )


@pytest.mark.root
def test_unit_verifies_inside_a_system_that_has_the_agent(guest: nspawn.Guest) -> None:
    result = guest.run("systemd-analyze", "verify", f"/etc/systemd/system/{UNIT}", check=False)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    )


def test_unit_passes_systemd_analyze(staged: str) -> None:
    unit = os.path.join(staged, "lib", "systemd", "system", UNIT)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--threshold=15", unit],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    score = result.stdout.strip().splitlines()[-1]
    print(score)
    assert result.returncode == 0, score
