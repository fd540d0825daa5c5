"""The RPMs for EL9 (Python 3.9) and Azure Linux 3 (Python 3.12), as built by `make rpm` (rpmlint
included): their metadata, an install into a scratch root with rpm itself, their scriptlets, and
the extracted tree run by the target's own Python version (pyenv's interpreters).

What a Debian machine cannot prove (dependency resolution against the distributions' own
packages, the scriptlets against their systemd) is listed in README.md, "On hosts"."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from email.parser import Parser

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from hyperlight_agent import contracts
from hyperlight_agent.device.helper import HELPER_MARK
from standin import procs
from standin.kubelet import StandinThread
from tests import nspawn
from tests.conftest import assert_ships_the_agent_only, wait_for

pytestmark = pytest.mark.system
TARGETS = {"el9": "3.9", "azl3": "3.12"}
R = contracts.RESOURCE_HYPERVISOR
CONFIG = "/etc/hyperlight-agent/agent.toml"


@pytest.fixture(scope="module")
def rpms() -> dict[str, str]:
    subprocess.run(["make", "-s", "rpm"], cwd=nspawn.ROOT, check=True, timeout=900, capture_output=True)
    found = {}
    for dist in TARGETS:
        (path,) = glob.glob(
            os.path.join(nspawn.ROOT, "build", "rpm", "top", "RPMS", "x86_64", f"hyperlight-agent-*.{dist}.x86_64.rpm")
        )
        found[dist] = path
    return found


def query(rpm: str, *args: str) -> str:
    return subprocess.run(["rpm", "-qp", *args, rpm], capture_output=True, text=True, check=True, timeout=60).stdout


def extract(rpm: str, dest: str) -> str:
    """The package's files under dest, as rpm2cpio | cpio -idm lays them out."""
    os.makedirs(dest, exist_ok=True)
    with subprocess.Popen(["rpm2cpio", rpm], stdout=subprocess.PIPE) as rpm2cpio:
        subprocess.run(["cpio", "-idm", "--quiet"], stdin=rpm2cpio.stdout, cwd=dest, check=True, timeout=120)
    return dest


def pyenv_python(version: str) -> str:
    """pyenv's newest CPython `version`.x. A machine without it fails here, saying how to get it."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    if shutil.which("pyenv"):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    found = glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}"))
    found.sort(key=lambda p: Version(p.split(os.sep)[-3]))
    if not found:
        pytest.fail(
            f"no Python {version} under {root}/versions: the RPM trees are tested with the target's "
            f"interpreter; install one with `pyenv install {version}`"
        )
    return found[-1]


def launcher(tree: str, python: str) -> list[str]:
    """The extracted /usr/bin/hyperlight-agent run by `python` with its #! line's own flags."""
    path = os.path.join(tree, "usr", "bin", "hyperlight-agent")
    with open(path) as f:
        interpreter, *flags = f.readline()[2:].split()
    assert interpreter == "/usr/bin/python3"
    return [python, *flags, path]


def bytecode(tree: str) -> list[str]:
    return [
        os.path.join(d, n)
        for d, dirs, files in os.walk(tree)
        for n in dirs + files
        if n == "__pycache__" or n.endswith((".pyc", ".pyo"))
    ]


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

    def run(name: str, arg: str, active: int = 3, upgrade: int = 0) -> list[str]:
        body = scripts[name]
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


@pytest.fixture
def kubelet(tmp: str) -> Iterator[StandinThread]:
    with StandinThread(os.path.join(tmp, "kubelet")) as standin:
        yield standin


def clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HYPERLIGHT_", "DEVICE_", "NOTIFY_SOCKET", "HOST_DEVICE_DIR"))
    }


@pytest.mark.parametrize("dist", list(TARGETS))
def test_rpm_tree_runs_under_the_target_python(
    rpms: dict[str, str], dist: str, tmp: str, kvm_dir: str, kubelet: StandinThread
) -> None:
    tree = extract(rpms[dist], os.path.join(tmp, "tree"))
    python = pyenv_python(TARGETS[dist])
    run = [*launcher(tree, python), "--config", "/dev/null"]
    version = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=60, check=True)
    assert version.stdout.startswith("hyperlight-agent ")
    checked = subprocess.run(
        [*run, "--check", "--device-dir", kvm_dir, "--cdi-dir", os.path.join(tmp, "cdi"), "--kubelet-dir", tmp],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=clean_env(),
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ok   runtime:" in checked.stdout and "ok   probe:" in checked.stdout
    # The DRA mode's API client (lightkube and what it pulls in, markers evaluated for the target).
    config = os.path.join(tmp, "kubeconfig")
    with open(config, "w") as f:
        f.write(
            '{"apiVersion": "v1", "kind": "Config", "current-context": "c", "clusters": [{"name": "c", '
            '"cluster": {"server": "https://127.0.0.1:1"}}], "users": [{"name": "u", "user": {"token": "t"}}], '
            '"contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}'
        )
    lib = os.path.join(tree, "usr", "lib", "hyperlight-agent")
    code = (
        "import asyncio, sys; sys.path.insert(0, sys.argv[1]); from hyperlight_agent.dra import client; "
        "api = client.connect(sys.argv[2], environ={}); asyncio.run(api.close()); print('client ok')"
    )
    made = subprocess.run(
        [python, "-I", "-B", "-c", code, lib, config],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=clean_env(),
    )
    assert made.stdout.strip() == "client ok", made.stdout + made.stderr

    log_path = os.path.join(tmp, "agent.log")
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(
            [
                *run,
                "--device-dir",
                kvm_dir,
                "--device-count",
                "3",
                "--kubelet-dir",
                os.path.join(tmp, "kubelet"),
                "--cdi-dir",
                os.path.join(tmp, "cdi"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(),
        )
    helpers: list[int] = []
    try:
        kubelet.wait_until(lambda k: k.allocatable() == 3, 30, f"3 healthy slots from the {dist} tree")
        helpers = procs.children(agent.pid, HELPER_MARK)
        assert helpers
        with open(f"/proc/{helpers[0]}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[0].decode() == python and b"-B" in argv, "the helper runs the target Python, writing no bytecode"
        device = kubelet.run(lambda k: k.plugins[R].devices[0][0])
        (response,) = kubelet.call(kubelet.kubelet.allocate(R, [device])).container_responses
        assert [d.name for d in response.cdi_devices] == ["hyperlight.dev/hypervisor=kvm"]
        assert procs.terminate(agent) == 0
    finally:
        procs.reap(agent)
    wait_for(lambda: not procs.alive(helpers), 5, "the probe helper to exit with the agent")
    with open(log_path, errors="replace") as f:
        text = f.read()
    assert "Traceback" not in text, text
    assert bytecode(tree) == [], "nothing may write bytecode into the package's files"


def test_rpm_tree_under_another_python_fails_the_check(rpms: dict[str, str], tmp: str, kvm_dir: str) -> None:
    """The EL9 tree (3.9) run by 3.12: every node check passes, but the agent could not start."""
    tree = extract(rpms["el9"], os.path.join(tmp, "tree"))
    run = launcher(tree, pyenv_python("3.12"))
    checked = subprocess.run(
        [*run, "--config", "/dev/null", "--check", "--device-dir", kvm_dir, "--cdi-dir", os.path.join(tmp, "cdi")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=clean_env(),
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    (line,) = [x for x in checked.stdout.splitlines() if x.startswith("FAIL runtime:")]
    print(line)
    assert "cannot import name 'cygrpc'" in line
    assert "ok   probe:" in checked.stdout, "the node itself is fine"
    assert checked.stdout.rstrip().endswith("this node cannot serve Hyperlight")
    assert bytecode(tree) == []


@pytest.mark.parametrize("dist", list(TARGETS))
def test_vendored_tree_fits_the_target_python(rpms: dict[str, str], dist: str, tmp: str) -> None:
    """Besides running it: extension modules built for the target's ABI, and every vendored
    distribution's requirements met by the vendored versions under the target's markers."""
    lib = os.path.join(extract(rpms[dist], tmp), "usr", "lib", "hyperlight-agent")
    abi = "cpython-" + TARGETS[dist].replace(".", "")
    extensions = glob.glob(os.path.join(lib, "**", "*.so"), recursive=True)
    assert extensions
    assert all(abi in os.path.basename(e) or ".abi3." in e for e in extensions), extensions
    versions, requirements = {}, []
    for metadata in glob.glob(os.path.join(lib, "*.dist-info", "METADATA")):
        with open(metadata) as f:
            message = Parser().parse(f)
        versions[message["Name"].lower().replace("_", "-")] = Version(message["Version"])
        requirements += [Requirement(r) for r in message.get_all("Requires-Dist") or []]
    environment = {
        "python_version": TARGETS[dist],
        "python_full_version": TARGETS[dist] + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "extra": "",
    }
    for requirement in requirements:
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        name = requirement.name.lower().replace("_", "-")
        assert name in versions, f"{requirement} is not vendored"
        assert requirement.specifier.contains(versions[name], prereleases=True), f"{requirement}: {versions[name]}"
    assert {"grpcio", "protobuf", "grpcio-health-checking", "hyperlight-agent"} <= set(versions)
