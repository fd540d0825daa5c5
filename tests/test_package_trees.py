"""Every target's package (packaging/targets: Debian 12 and 13, Ubuntu 22.04 and 24.04, EL9 and 10,
Azure Linux 3), as `make deb` and `make rpm` build it: its vendored tree, extracted, run by the
target's own Python version (pyenv's 3.9 to 3.13), and fitting that Python's ABI and markers.
Where a real userland can be had (Debian 12 and 13), the packages are also installed under systemd
(tests/test_deb.py, tests/test_apt_repository.py)."""

from __future__ import annotations

import glob
import os
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
from tests.conftest import wait_for
from tests.releases import TARGETS
from tests.trees import bytecode, check, clean_env, extract, launcher, pyenv_python

pytestmark = pytest.mark.system
PYTHON = {t.tag: t.python for t in TARGETS}
R = contracts.RESOURCE_HYPERVISOR


@pytest.fixture
def kubelet(tmp: str) -> Iterator[StandinThread]:
    with StandinThread(os.path.join(tmp, "kubelet")) as standin:
        yield standin


@pytest.mark.parametrize("tag", [t.tag for t in TARGETS])
def test_the_tree_runs_under_the_target_python(
    host_packages: dict[str, str], tag: str, tmp: str, kvm_dir: str, kubelet: StandinThread
) -> None:
    """--version, --check (its probe of the device included), the DRA mode's API client, and the
    agent registered with the stand-in answering Allocate, by the target's own Python."""
    tree = extract(host_packages[tag], os.path.join(tmp, "tree"))
    python = pyenv_python(PYTHON[tag])
    run = [*launcher(tree, python), "--config", "/dev/null"]
    version = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=60, check=True)
    assert version.stdout.startswith("hyperlight-agent ")
    checked = check(launcher(tree, python), kvm_dir, tmp)
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
        kubelet.wait_until(lambda k: k.allocatable() == 3, 30, f"3 healthy slots from the {tag} tree")
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


@pytest.mark.parametrize("tag", [t.tag for t in TARGETS])
def test_vendored_tree_fits_the_target_python(host_packages: dict[str, str], tag: str, tmp: str) -> None:
    """Besides running it: extension modules built for the target's ABI, and every vendored
    distribution's requirements met by the vendored versions under the target's markers."""
    lib = os.path.join(extract(host_packages[tag], tmp), "usr", "lib", "hyperlight-agent")
    abi = "cpython-" + PYTHON[tag].replace(".", "")
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
        "python_version": PYTHON[tag],
        "python_full_version": PYTHON[tag] + ".0",
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
