"""The packages' vendored trees, extracted as the package managers lay them out and run by the
target's own Python version (pyenv's interpreters): what the tests of every target share."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
from packaging.version import Version


def extract(package: str, dest: str) -> str:
    """The package's files under dest, as dpkg-deb -x or rpm2cpio | cpio -idm lay them out."""
    os.makedirs(dest, exist_ok=True)
    if package.endswith(".deb"):
        subprocess.run(["dpkg-deb", "-x", package, dest], check=True, timeout=120)
        return dest
    with subprocess.Popen(["rpm2cpio", package], stdout=subprocess.PIPE) as rpm2cpio:
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
            f"no Python {version} under {root}/versions: the package trees are tested with the target's "
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


def clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HYPERLIGHT_", "DEVICE_", "NOTIFY_SOCKET", "HOST_DEVICE_DIR"))
    }


def check(run: list[str], kvm_dir: str, tmp: str) -> subprocess.CompletedProcess[str]:
    """`hyperlight-agent --check` of a tree (its launcher and interpreter: run) against kvm_dir."""
    flags = ["--device-dir", kvm_dir, "--cdi-dir", os.path.join(tmp, "cdi"), "--kubelet-dir", tmp]
    return subprocess.run(
        [*run, "--config", "/dev/null", "--check", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=clean_env(),
    )
