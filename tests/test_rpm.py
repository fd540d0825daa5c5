"""The RPMs for each RPM target (packaging/targets: EL9, EL10, Azure Linux 3), as built by `make
rpm` (rpmlint included): their metadata, an install into a scratch root with rpm itself, their
scriptlets, and a tree run by the wrong Python failing its check (each tree run by its own Python:
tests/test_package_trees.py).

What a Debian machine cannot prove (dependency resolution against the distributions' own
packages, the scriptlets against their systemd) is listed in docs/hosts.md."""

from __future__ import annotations

import glob
import os
import re
import subprocess

import pytest

from hyperlight_agent import contracts
from tests.conftest import assert_ships_the_agent_only
from tests.releases import RPMS
from tests.trees import bytecode, check, extract, launcher, pyenv_python

pytestmark = pytest.mark.system
# Each RPM target (packaging/targets) and its Python.
TARGETS = {t.tag: t.python for t in RPMS}
R = contracts.RESOURCE_HYPERVISOR
CONFIG = "/etc/hyperlight-agent/agent.toml"


@pytest.fixture(scope="module")
def rpms(host_packages: dict[str, str]) -> dict[str, str]:
    return {dist: host_packages[dist] for dist in TARGETS}


def query(rpm: str, *args: str) -> str:
    return subprocess.run(["rpm", "-qp", *args, rpm], capture_output=True, text=True, check=True, timeout=60).stdout


def needed(tree: str) -> set[str]:
    """Sonames the extension modules under tree link against, minus those bundled in tree."""
    objects = [
        p
        for p in glob.glob(os.path.join(tree, "usr", "lib", "hyperlight-agent", "**", "*.so*"), recursive=True)
        if os.path.isfile(p)
    ]
    assert objects
    out = subprocess.run(["readelf", "-d", *objects], capture_output=True, text=True, check=True, timeout=60).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)) - {os.path.basename(p) for p in objects}


def scriptlets(rpm: str) -> dict[str, str]:
    """`rpm -qp --scripts` split into {"postinstall": body, ...}."""
    parts = re.split(r"^(\w+) scriptlet \(using /bin/sh\):\n", query(rpm, "--scripts"), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("dist", list(TARGETS))
def test_rpm_layout_config_and_scriptlets(rpms: dict[str, str], dist: str, tmp: str) -> None:
    rpm = rpms[dist]
    files = query(rpm, "--list").split()
    for path in (
        "/usr/bin/hyperlight-agent",
        "/usr/lib/systemd/system/hyperlight-agent.service",
        "/usr/lib/tmpfiles.d/hyperlight-agent.conf",
        "/usr/share/man/man8/hyperlight-agent.8.gz",
        CONFIG,
    ):
        assert path in files, path
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")], "bytecode is never shipped"
    assert_ships_the_agent_only(files)
    flags = query(rpm, "--qf", "[%{FILEFLAGS:fflags} %{FILENAMES}\n]")
    assert f"cn {CONFIG}" in flags, "agent.toml must be %config(noreplace)"
    assert f"python(abi) = {TARGETS[dist]}" in query(rpm, "--requires")

    # Each scriptlet parses, and run with stand-ins for systemctl, systemd-tmpfiles and the agent's
    # --upgrade-in-place it makes exactly the calls %systemd_post / %systemd_preun would, and on
    # upgrade replaces a running agent in place (restarting one that cannot hand over).
    scripts = scriptlets(rpm)
    assert set(scripts) == {"postinstall", "preuninstall", "postuninstall", "posttrans"}
    bin_dir = os.path.join(tmp, "bin")
    os.mkdir(bin_dir)
    log = os.path.join(tmp, "calls")
    # (python3 and find too: the scriptlets compile and clean the host's tree, which is not ours here.)
    behaviour = {
        "systemctl": 'case "$1" in is-active) exit "$FAKE_ACTIVE";; show) echo 4242;; esac\n',
        "hyperlight-agent": 'exit "$FAKE_UPGRADE"\n',
    }
    for tool in ("systemctl", "systemd-tmpfiles", "python3", "find", "hyperlight-agent"):
        with open(os.path.join(bin_dir, tool), "w") as f:
            f.write(f'#!/bin/sh\necho "{tool} $*" >> {log}\n{behaviour.get(tool, "")}')
        os.chmod(os.path.join(bin_dir, tool), 0o755)  # noqa: S103 - a command on PATH must be executable

    booted = os.path.join(tmp, "run-systemd")  # /run/systemd/system: systemd runs
    os.mkdir(booted)

    def run(name: str, arg: str, active: int = 3, upgrade: int = 0, systemd: str = booted) -> list[str]:
        body = scripts[name].replace("/run/systemd/system", systemd)
        subprocess.run(["sh", "-n", "-c", body], check=True, timeout=10)
        if os.path.exists(log):
            os.unlink(log)
        subprocess.run(
            ["sh", "-e", "-c", body, name, arg],
            check=True,
            timeout=10,
            capture_output=True,
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_ACTIVE": str(active), "FAKE_UPGRADE": str(upgrade)},
        )
        if not os.path.exists(log):
            return []
        with open(log) as f:
            return f.read().splitlines()

    unit = "hyperlight-agent.service"
    compile_tree = "python3 -m compileall -q /usr/lib/hyperlight-agent"
    assert run("postinstall", "1") == [
        compile_tree,
        f"systemctl --no-reload preset {unit}",
        "systemd-tmpfiles --create hyperlight-agent.conf",
    ]
    assert run("postinstall", "2") == [compile_tree], "an upgrade compiles, and keeps the admin's enablement"
    clean_tree = "find /usr/lib/hyperlight-agent -name __pycache__ -type d -prune -exec rm -rf {} +"
    assert run("preuninstall", "0") == [f"systemctl --no-reload disable --now {unit}", clean_tree]
    assert run("preuninstall", "1") == [], "an upgrade's old preun must not remove the new bytecode"
    assert run("postuninstall", "1") == ["systemctl daemon-reload"], "no restart: %posttrans upgrades in place"
    assert run("postuninstall", "0") == ["systemctl daemon-reload"]
    in_place = [
        "systemctl daemon-reload",
        f"systemctl is-active --quiet {unit}",
        f"systemctl show -P MainPID {unit}",
        "hyperlight-agent --upgrade-in-place 4242",
    ]
    assert run("posttrans", "0", active=0) == in_place
    assert run("posttrans", "0", active=0, upgrade=1) == in_place, "a failed upgrade leaves the old agent serving"
    assert run("posttrans", "0", active=0, upgrade=3) == [*in_place, f"systemctl --no-block restart {unit}"]
    assert run("posttrans", "0", active=3) == [
        "systemctl daemon-reload",
        f"systemctl is-active --quiet {unit}",
        f"systemctl --no-block try-restart {unit}",
    ]
    # An offline root (an image build): nothing to upgrade or restart, whatever systemctl says
    # (test_packaging_files.py runs it with the real one, offline).
    assert run("posttrans", "0", active=0, upgrade=2, systemd=os.path.join(tmp, "absent")) == []


@pytest.mark.parametrize("dist", list(TARGETS))
def test_rpm_requires_every_library_its_extension_modules_link(rpms: dict[str, str], dist: str, tmp: str) -> None:
    """AutoReqProv is off, so a library missing from Requires is a host where grpc cannot load."""
    libraries = needed(extract(rpms[dist], tmp))
    assert "libstdc++.so.6" in libraries, "grpcio's extension module is C++"
    requires = set(query(rpms[dist], "--requires").split("\n"))
    missing = {f"{soname}()(64bit)" for soname in libraries} - requires
    assert not missing, f"not declared in Requires: {sorted(missing)}"


@pytest.mark.parametrize("dist", list(TARGETS))
def test_rpm_installs_into_a_scratch_root(rpms: dict[str, str], dist: str, tmp: str) -> None:
    """rpm itself lays the package out. --nodeps: the scratch root has no EL9/Azure Linux packages
    (glibc, libstdc++, python3, systemd) to satisfy Requires with; --noscripts: it has no shell or
    systemctl to run them with (the scriptlets are run with stand-ins above)."""
    root = os.path.join(tmp, "root")
    rpm = ["rpm", "--root", root, "--dbpath", "/var/lib/rpm"]
    subprocess.run([*rpm, "--initdb"], check=True, timeout=60)
    subprocess.run([*rpm, "-i", "--nodeps", "--noscripts", rpms[dist]], check=True, timeout=120)
    listed = subprocess.run(
        [*rpm, "-ql", "hyperlight-agent"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert listed == query(rpms[dist], "--list").split()
    for path in listed:
        assert os.path.lexists(root + path), path
    assert os.stat(root + "/usr/bin/hyperlight-agent").st_mode & 0o777 == 0o755
    verify = subprocess.run(
        [*rpm, "-V", "--nodeps", "hyperlight-agent"], capture_output=True, text=True, timeout=60, check=False
    )
    assert verify.returncode == 0, verify.stdout

    # noreplace: an edited agent.toml survives reinstalling, and is kept as .rpmsave on erase.
    with open(root + CONFIG, "a") as f:
        f.write("device_count = 7\n")
    subprocess.run([*rpm, "-U", "--replacepkgs", "--nodeps", "--noscripts", rpms[dist]], check=True, timeout=120)
    with open(root + CONFIG) as f:
        assert f.read().endswith("device_count = 7\n")
    subprocess.run([*rpm, "-e", "--nodeps", "--noscripts", "hyperlight-agent"], check=True, timeout=120)
    left = [p for p in listed if os.path.lexists(root + p) and not os.path.isdir(root + p)]
    assert left == [], left
    assert os.path.exists(root + CONFIG + ".rpmsave")
    assert not os.path.exists(root + "/usr/lib/hyperlight-agent")


def test_rpm_tree_under_another_python_fails_the_check(rpms: dict[str, str], tmp: str, kvm_dir: str) -> None:
    """The EL9 tree (3.9) run by 3.12: every node check passes, but the agent could not start."""
    tree = extract(rpms["el9"], os.path.join(tmp, "tree"))
    checked = check(launcher(tree, pyenv_python("3.12")), kvm_dir, tmp)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    (line,) = [x for x in checked.stdout.splitlines() if x.startswith("FAIL runtime:")]
    print(line)
    assert "cannot import name 'cygrpc'" in line
    assert "ok   probe:" in checked.stdout, "the node itself is fine"
    assert checked.stdout.rstrip().endswith("this node cannot serve Hyperlight")
    assert bytecode(tree) == []
