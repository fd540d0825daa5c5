"""The RPMs for EL9 (Python 3.9) and Azure Linux 3 (Python 3.12): built with rpmbuild, judged by
rpmlint in `make rpm`, and checked here for what the target hosts rely on."""

from __future__ import annotations

import glob
import os
import subprocess
from email.parser import Parser

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests import nspawn

pytestmark = pytest.mark.system
TARGETS = {"el9": "3.9", "azl3": "3.12"}


@pytest.fixture(scope="module")
def rpms() -> dict[str, str]:
    subprocess.run(["make", "-s", "rpm"], cwd=nspawn.ROOT, check=True, timeout=900, capture_output=True)
    found = {}
    for dist in TARGETS:
        (path,) = glob.glob(os.path.join(nspawn.ROOT, "build", "rpm", "top", "RPMS", "x86_64",
                                         f"hyperlight-agent-*.{dist}.x86_64.rpm"))
        found[dist] = path
    return found


def query(rpm: str, *args: str) -> str:
    return subprocess.run(["rpm", "-qp", *args, rpm], capture_output=True, text=True, check=True, timeout=60).stdout


@pytest.mark.parametrize("dist", list(TARGETS))
def test_rpm_layout_config_and_scriptlets(rpms: dict[str, str], dist: str) -> None:
    rpm = rpms[dist]
    files = query(rpm, "--list").split()
    for path in ("/usr/bin/hyperlight-agent", "/usr/lib/systemd/system/hyperlight-agent.service",
                 "/usr/lib/tmpfiles.d/hyperlight-agent.conf", "/usr/share/man/man8/hyperlight-agent.8.gz",
                 "/etc/hyperlight-agent/agent.toml"):
        assert path in files, path
    flags = query(rpm, "--qf", "[%{FILEFLAGS:fflags} %{FILENAMES}\n]")
    assert "cn /etc/hyperlight-agent/agent.toml" in flags, "agent.toml must be %config(noreplace)"
    scripts = query(rpm, "--scripts")
    assert "systemctl --no-reload preset hyperlight-agent.service" in scripts
    assert "systemctl --no-reload disable --now hyperlight-agent.service" in scripts
    assert "try-restart hyperlight-agent.service" in scripts
    assert f"python(abi) = {TARGETS[dist]}" in query(rpm, "--requires")


@pytest.mark.parametrize("dist", list(TARGETS))
def test_vendored_tree_fits_the_target_python(rpms: dict[str, str], dist: str, tmp: str) -> None:
    """No interpreter for 3.9 or 3.12 exists on this Debian 12 machine to import with, so check
    what import depends on: extension modules built for the target's ABI, and every vendored
    distribution's requirements met by the vendored versions under the target's markers."""
    with subprocess.Popen(["rpm2cpio", rpms[dist]], stdout=subprocess.PIPE) as rpm2cpio:
        subprocess.run(["cpio", "-idm", "--quiet"], stdin=rpm2cpio.stdout, cwd=tmp, check=True, timeout=120)
    lib = os.path.join(tmp, "usr", "lib", "hyperlight-agent")
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
    environment = {"python_version": TARGETS[dist], "python_full_version": TARGETS[dist] + ".0",
                   "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    for requirement in requirements:
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        name = requirement.name.lower().replace("_", "-")
        assert name in versions, f"{requirement} is not vendored"
        assert requirement.specifier.contains(versions[name], prereleases=True), f"{requirement}: {versions[name]}"
    assert {"grpcio", "protobuf", "grpcio-health-checking", "hyperlight-agent"} <= set(versions)
