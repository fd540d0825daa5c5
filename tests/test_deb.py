"""The .deb on a clean Debian 12 under real systemd: install without PyPI, activating until the
kubelet answers, active after, reload, remove and purge."""

from __future__ import annotations

import glob
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from hyperlight_agent import contracts
from hyperlight_agent.standin import KubeletStandin, StandinThread
from tests import nspawn
from tests.conftest import make_node, wait_for

pytestmark = pytest.mark.system
UNIT = "hyperlight-agent.service"
R = contracts.RESOURCE_HYPERVISOR


@pytest.fixture(scope="module")
def deb() -> str:
    """Build the package exactly as `make deb` does (lintian included)."""
    subprocess.run(["make", "-s", "deb"], cwd=nspawn.ROOT, check=True, timeout=900, capture_output=True)
    (path,) = glob.glob(os.path.join(nspawn.ROOT, "build", "deb", "hyperlight-agent_*.deb"))
    return path


def apt(root: str, *args: str, binds: tuple[str, ...] = ()) -> None:
    result = nspawn.pipe(root, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y", "-q", *args, binds=binds)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def guest(tmp: str, deb: str) -> Iterator[nspawn.Guest]:
    """A clean Debian 12 where the .deb was installed with only Debian's archive reachable: its
    dependencies (procps, python3-systemd) are removed first so apt must fetch them from there."""
    root = os.path.join(tmp, "root")
    subprocess.run(["cp", "-a", "--reflink=auto", nspawn.rootfs(), root], check=True, timeout=300)
    apt(root, "purge", "procps", "python3-systemd")
    apt(root, "update")
    apt(root, "install", "/root/agent.deb", binds=(f"{deb}:/root/agent.deb",))
    os.makedirs(os.path.join(tmp, "kubelet"))
    kvm = make_node(os.path.join(tmp, "kvm"), 10, 232)
    binds = [f"{kvm}:/dev/kvm", f"{tmp}/kubelet:/var/lib/kubelet/device-plugins", f"{deb}:/root/agent.deb"]
    with nspawn.Guest(root, binds, ephemeral=False) as g:
        yield g


def slots(k: KubeletStandin) -> int:
    p = k.plugins.get(R)
    return p.healthy if p else 0


def install(guest: nspawn.Guest) -> None:
    # --private-network: nothing can be downloaded; everything must come from the package.
    result = guest.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-q",
                       "/root/agent.deb", check=False, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_install_run_reload_remove_purge(guest: nspawn.Guest, tmp: str) -> None:
    # Installed before boot (fixture): enabled, so the boot started it.
    assert guest.run("dpkg-query", "-W", "-f=${Status}", "procps", "python3-systemd").stdout.count(
        "install ok installed") == 2
    assert guest.run("systemctl", "is-enabled", UNIT).stdout.strip() == "enabled"
    wait_for(lambda: "waiting for kubelet at" in guest.status(UNIT), 30, "the waiting STATUS")
    assert guest.is_active(UNIT) == "activating"
    # The boot is not held up: multi-user.target was reached while we wait for a kubelet.
    assert guest.is_active("multi-user.target") == "active"

    with StandinThread(os.path.join(tmp, "kubelet")) as kubelet:
        kubelet.wait_until(lambda k: slots(k) == 2000, 30)
        wait_for(lambda: guest.is_active(UNIT) == "active", 15)
        assert 'Status: "ready: kvm, 2000 slots, 1 stream"' in guest.status(UNIT)
        spec = guest.run("cat", "/run/cdi/hyperlight.json").stdout
        assert '"name": "kvm"' in spec

        # systemctl reload applies a changed device_count.
        guest.run("sh", "-c", "echo 'device_count = 7' >> /etc/hyperlight-agent/agent.toml")
        guest.run("systemctl", "reload", UNIT)
        kubelet.wait_until(lambda k: slots(k) == 7, 15, "7 slots after reload")

        # Remove: stopped, no socket, no process, none of its files; config and the CDI directory stay.
        owned = guest.run("dpkg-query", "-L", "hyperlight-agent").stdout.split()
        conffiles = {"/etc/hyperlight-agent/agent.toml"}
        guest.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "remove", "-y", "-q", "hyperlight-agent")
        # Files and file symlinks only: directories such as /lib (a symlink under usrmerge) are shared.
        left = guest.run("sh", "-c", 'for f in "$@"; do [ -d "$f" ] || { [ -e "$f" ] || [ -L "$f" ]; } && '
                         '[ ! -d "$f" ] && echo "$f"; done; true', "sh", *owned).stdout.split()
        assert set(left) <= conffiles, f"files left behind: {sorted(set(left) - conffiles)[:5]}"
        assert guest.is_active(UNIT) in ("inactive", "unknown")
        assert not os.path.exists(os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET))
        assert guest.run("pgrep", "-f", "hyperlight", check=False).returncode == 1, "a process was left"
        assert guest.run("test", "-e", "/usr/lib/hyperlight-agent", check=False).returncode == 1
        assert "device_count = 7" in guest.run("cat", "/etc/hyperlight-agent/agent.toml").stdout
        assert guest.run("test", "-d", "/run/cdi", check=False).returncode == 0

        # Purge removes the configuration, nothing else.
        guest.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "purge", "-y", "-q", "hyperlight-agent")
        assert guest.run("test", "-e", "/etc/hyperlight-agent", check=False).returncode == 1
        assert guest.run("test", "-d", "/run/cdi", check=False).returncode == 0

        # Install again with the kubelet already there: the figure for install → active.
        started = time.monotonic()
        install(guest)
        wait_for(lambda: guest.is_active(UNIT) == "active", 30)
        print(f"apt-get install → active: {time.monotonic() - started:.2f} s")
        kubelet.wait_until(lambda k: slots(k) == 2000, 15)
