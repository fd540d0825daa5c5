"""The .deb on a clean Debian 12 under real systemd: install without PyPI, activating until the
kubelet answers, active after, reload, remove and purge."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator

import pytest

from hyperlight_agent import contracts
from standin.kubelet import StandinThread
from tests import nspawn
from tests.conftest import assert_ships_the_agent_only, make_node, wait_for
from tests.releases import CURRENT, next_version

pytestmark = pytest.mark.system
UNIT = "hyperlight-agent.service"
R = contracts.RESOURCE_HYPERVISOR


@pytest.fixture(scope="module")
def deb(host_packages: dict[str, str]) -> str:
    """The Debian 12 package (its userland is the one the guests boot)."""
    return host_packages["deb12"]


def apt(root: str, *args: str, binds: tuple[str, ...] = ()) -> None:
    result = nspawn.pipe(root, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y", "-q", *args, binds=binds)
    assert result.returncode == 0, result.stdout + result.stderr


def test_deb_ships_the_agent_only(deb: str) -> None:
    listing = subprocess.run(["dpkg-deb", "-c", deb], capture_output=True, text=True, check=True, timeout=60)
    assert_ships_the_agent_only([line.split()[-1] for line in listing.stdout.splitlines()])


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


def install(guest: nspawn.Guest) -> None:
    # --private-network: nothing can be downloaded; everything must come from the package.
    result = guest.run(
        "env",
        "DEBIAN_FRONTEND=noninteractive",
        "apt-get",
        "install",
        "-y",
        "-q",
        "/root/agent.deb",
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.root
def test_install_run_reload_remove_purge(guest: nspawn.Guest, tmp: str) -> None:
    # Installed before boot (fixture): enabled, so the boot started it.
    assert (
        guest.run("dpkg-query", "-W", "-f=${Status}", "procps", "python3-systemd").stdout.count("install ok installed")
        == 2
    )
    assert guest.run("systemctl", "is-enabled", UNIT).stdout.strip() == "enabled"
    wait_for(lambda: "waiting for kubelet at" in guest.status(UNIT), 30, "the waiting STATUS")
    assert guest.is_active(UNIT) == "activating"
    # The boot is not held up: multi-user.target was reached while we wait for a kubelet.
    assert guest.is_active("multi-user.target") == "active"

    with StandinThread(os.path.join(tmp, "kubelet")) as kubelet:
        kubelet.wait_until(lambda k: k.allocatable() == 2000, 30)
        wait_for(lambda: guest.is_active(UNIT) == "active", 15)
        assert 'Status: "ready: kvm, 2000 slots, 1 stream; version ' in guest.status(UNIT)
        spec = guest.run("cat", "/run/cdi/hyperlight.json").stdout
        assert '"name": "kvm"' in spec

        # systemctl reload applies a changed device_count (in place: a new process).
        guest.run("sh", "-c", "echo 'device_count = 7' >> /etc/hyperlight-agent/agent.toml")
        guest.run("systemctl", "reload", UNIT)
        kubelet.wait_until(lambda k: k.allocatable() == 7, 15, "7 slots after reload")
        assert our_sockets(tmp) != [contracts.PLUGIN_SOCKET], "the reload's new process serves its own socket"

        # Remove: stopped, no socket, no process, none of its files; config and the CDI directory stay.
        owned = guest.run("dpkg-query", "-L", "hyperlight-agent").stdout.split()
        conffiles = {"/etc/hyperlight-agent/agent.toml"}
        guest.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "remove", "-y", "-q", "hyperlight-agent")
        # Files and file symlinks only: directories such as /lib (a symlink under usrmerge) are shared.
        left = guest.run(
            "sh",
            "-c",
            'for f in "$@"; do [ -d "$f" ] || { [ -e "$f" ] || [ -L "$f" ]; } && '
            '[ ! -d "$f" ] && echo "$f"; done; true',
            "sh",
            *owned,
        ).stdout.split()
        assert set(left) <= conffiles, f"files left behind: {sorted(set(left) - conffiles)[:5]}"
        assert guest.is_active(UNIT) in ("inactive", "unknown")
        assert our_sockets(tmp) == []
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
        kubelet.wait_until(lambda k: k.allocatable() == 2000, 15)


# After release N's package (the one `deb` is), as a next release would be.
NEXT_VERSION = next_version(CURRENT)


@pytest.fixture(scope="module")
def deb_next(deb: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Version N+1 for the upgrade: the package `make deb` built, with its version bumped in the
    control file and in the agent itself (so the running code says which version it is)."""
    work = str(tmp_path_factory.mktemp("next"))
    tree = os.path.join(work, "tree")
    subprocess.run(["dpkg-deb", "-R", deb, tree], check=True, timeout=120)
    current = subprocess.run(
        ["dpkg-deb", "-f", deb, "Version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    module = "usr/lib/hyperlight-agent/hyperlight_agent/__init__.py"
    for name, old, new in (
        ("DEBIAN/control", f"Version: {current}\n", f"Version: {NEXT_VERSION}\n"),
        # The package's version carries its target's tag (0.1.0+deb12); the agent's is upstream's.
        (module, f'__version__ = "{current.split("+")[0]}"', f'__version__ = "{NEXT_VERSION}"'),
    ):
        path = os.path.join(tree, name)
        with open(path) as f:
            text = f.read()
        assert old in text, (name, old)
        with open(path, "w") as f:
            f.write(text.replace(old, new))
    digest = subprocess.run(["md5sum", module], cwd=tree, capture_output=True, text=True, check=True, timeout=30).stdout
    with open(os.path.join(tree, "DEBIAN", "md5sums")) as f:
        sums = [line for line in f.read().splitlines() if not line.endswith(f"  {module}")]
    with open(os.path.join(tree, "DEBIAN", "md5sums"), "w") as f:
        f.write("\n".join([*sums, digest.strip()]) + "\n")
    path = os.path.join(work, f"hyperlight-agent_{NEXT_VERSION}_amd64.deb")
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-b", tree, path], check=True, timeout=300, stdout=subprocess.DEVNULL
    )
    return path


@pytest.fixture
def bare_guest(tmp: str, deb: str, deb_next: str) -> Iterator[nspawn.Guest]:
    """A clean Debian 12 (with the package's dependencies, nothing of ours), booted, with both
    versions of the package at hand and the host's kubelet directory bind-mounted."""
    root = os.path.join(tmp, "root")
    subprocess.run(["cp", "-a", "--reflink=auto", nspawn.rootfs(), root], check=True, timeout=300)
    os.makedirs(os.path.join(tmp, "kubelet"))
    kvm = make_node(os.path.join(tmp, "kvm"), 10, 232)
    binds = [
        f"{kvm}:/dev/kvm",
        f"{tmp}/kubelet:/var/lib/kubelet/device-plugins",
        f"{deb}:/root/agent-n.deb",
        f"{deb_next}:/root/agent-n1.deb",
    ]
    with nspawn.Guest(root, binds, ephemeral=False) as g:
        yield g


# Paths that changed between the two listings here, none of them ours (the test prints them).
NOT_OURS = (
    "/var/log/apt/",
    "/var/log/journal/",
    "/run/log/",  # apt's history and the journal: logs, not state
    "/var/cache/apt/",  # apt's package caches
    "/var/cache/man/",  # man-db's index (its trigger ran when our man page came and went)
    "/var/lib/apt/",  # apt's extended_states (auto-installed marks) and list bookkeeping
    "/run/agetty.reload",  # agetty's reload flag, touched by the console getty
    "/run/systemd/ask-password-block",  # systemd 257's password agents' tty marker (systemctl makes it)
    # systemd 257 gives each running service a credentials directory: the console's getty, which
    # systemd starts again whenever the console is closed, has it or not at any moment.
    "/run/credentials/console-getty.service",
    "/var/cache/debconf/",  # debconf's temporary files (Debian 13's debconf leaves tmp.ci)
)
# Documented to stay after purge (docs/hosts.md): /run/cdi, which several CDI producers
# share (created by our tmpfiles entry if missing), and the CDI spec the agent kept on shutdown.
DOCUMENTED = ("/run/cdi", "/run/cdi/hyperlight.json")


def our_sockets(tmp: str) -> list[str]:
    """The agent's sockets in the kubelet directory (hyperlight.sock, or an in-place upgrade's)."""
    return sorted(
        n
        for n in os.listdir(os.path.join(tmp, "kubelet"))
        if contracts.is_instance_socket_name(n, contracts.PLUGIN_SOCKET)
    )


def agent_starts(guest: nspawn.Guest) -> list[str]:
    """The versions the unit's processes announced at start, in order (from the journal)."""
    out = guest.run("journalctl", "-u", UNIT, "-o", "cat", "--no-pager").stdout
    return re.findall(r"starting hyperlight-agent (\S+) \(commit ", out)


def apt_get(guest: nspawn.Guest, *args: str) -> subprocess.CompletedProcess[str]:
    # stdin is /dev/null: a conffile prompt would fail the command instead of waiting for an answer.
    return guest.run(
        "sh",
        "-c",
        'DEBIAN_FRONTEND=noninteractive apt-get -y -q "$@" </dev/null',
        "sh",
        *args,
        check=False,
        timeout=300,
    )


def lib_listing(guest: nspawn.Guest) -> str:
    """Every path under the private tree with its size and mtime."""
    return guest.run("find", "/usr/lib/hyperlight-agent", "-printf", "%p %s %T@\\n").stdout


@pytest.mark.root
def test_upgrade_keeps_the_edited_config_hands_over_in_place_and_purge_leaves_nothing(
    bare_guest: nspawn.Guest, tmp: str
) -> None:
    guest = bare_guest
    guest.settle()  # the boot's last jobs run after multi-user.target: their files come and go
    before = guest.listing()
    with StandinThread(os.path.join(tmp, "kubelet")) as kubelet:
        kubelet.run(lambda k: setattr(k, "flavor", "1.37"))
        result = apt_get(guest, "install", "/root/agent-n.deb")
        assert result.returncode == 0, result.stdout + result.stderr
        kubelet.wait_until(lambda k: k.allocatable() == 2000, 30, "version N registered")
        old = guest.run("hyperlight-agent", "--version").stdout.strip()
        assert old != f"hyperlight-agent {NEXT_VERSION}"
        # The tree is compiled once, at install (faster starts); then the commands of the original
        # report, as root, and the running agent write nothing more into /usr/lib.
        compiled = guest.run("find", "/usr/lib/hyperlight-agent", "-name", "*.pyc").stdout.split()
        assert any("hyperlight_agent/__pycache__/agent." in p for p in compiled), "compiled at install"
        tree = lib_listing(guest)
        assert guest.run("hyperlight-agent", "--check", check=False).returncode == 0
        wait_for(
            lambda: guest.run("hyperlight-agent", "--health-check=readiness", check=False).returncode == 0,
            15,
            "readiness",
        )
        assert lib_listing(guest) == tree, "running the agent wrote into /usr/lib"

        guest.run("sh", "-c", "echo 'device_count = 7' >> /etc/hyperlight-agent/agent.toml")
        guest.run("systemctl", "reload", UNIT)
        kubelet.wait_until(lambda k: k.allocatable() == 7, 15, "7 slots after reload")
        assert agent_starts(guest) == [old.split()[-1]] * 2, "the reload started the installed code anew"

        # Upgrade while the kubelet watches: the new version takes over in place, the kubelet
        # never counts zero slots.
        since, pid = time.monotonic(), guest.run("systemctl", "show", "-P", "MainPID", UNIT).stdout.strip()
        result = apt_get(guest, "install", "/root/agent-n1.deb")
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"pid {pid} handed over to pid " in result.stdout, result.stdout
        assert [at for at, counts in kubelet.kubelet.timeline if at >= since and counts.get(R, 0) == 0] == []
        assert "device_count = 7" in guest.run("cat", "/etc/hyperlight-agent/agent.toml").stdout
        assert guest.run("hyperlight-agent", "--version").stdout.strip() == f"hyperlight-agent {NEXT_VERSION}"
        assert guest.is_active(UNIT) == "active"
        assert f"; version {NEXT_VERSION}" in guest.status(UNIT)
        assert agent_starts(guest) == [old.split()[-1]] * 2 + [NEXT_VERSION], "one new process, the new code"
        assert guest.run("systemctl", "show", "-P", "NRestarts", UNIT).stdout.strip() == "0"

        result = apt_get(guest, "remove", "hyperlight-agent")
        assert result.returncode == 0, result.stdout + result.stderr
        wait_for(lambda: our_sockets(tmp) == [], 10, "the plugin socket to go")
        result = apt_get(guest, "purge", "hyperlight-agent")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "not empty" not in result.stdout + result.stderr
    guest.settle()
    after = guest.listing()
    ignored = sorted(p for p in before ^ after if p.startswith(NOT_OURS) or p in DOCUMENTED)
    print(f"install → upgrade → purge: {len(ignored)} paths changed that are not ours: {ignored}")
    changed = sorted(p for p in before ^ after if not p.startswith(NOT_OURS) and p not in DOCUMENTED)
    assert changed == [], f"install → upgrade → purge changed: {changed[:20]}"
    assert guest.run("pgrep", "-f", "hyperlight", check=False).returncode == 1, "a process was left"
