"""The container image. No engine here can pull a base image, so check the Containerfile's
shape, and run its install steps (wheel → clean environment) and the result's --help and --check."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.test_docs import ROOT

pytestmark = pytest.mark.system


def containerfile() -> str:
    with open(os.path.join(ROOT, "Containerfile")) as f:
        return f.read()


def test_multi_stage_pinned_non_root_default() -> None:
    text = containerfile()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.search(r"@sha256:[0-9a-f]{64}$", base.group(1)), "base image must be pinned by digest"
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]
    assert re.search(r"^COPY --from=build /opt/hyperlight-agent /opt/hyperlight-agent$", text, re.M)
    assert re.search(r"^USER 65532:65532$", text, re.M)
    assert "HYPERLIGHT_AGENT_COMMIT=${GIT_COMMIT}" in text
    assert 'ENTRYPOINT ["hyperlight-agent"]' in text


def test_the_image_install_steps_give_a_working_agent(tmp: str) -> None:
    """The Containerfile's steps: build the wheel, install it with its dependencies into one
    directory, compile; then run it from that directory alone, as the runtime stage does."""
    wheels, target = os.path.join(tmp, "wheels"), os.path.join(tmp, "opt")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", wheels, ROOT],
                   check=True, timeout=600)
    (wheel,) = os.listdir(wheels)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--target", target,
                    os.path.join(wheels, wheel)], check=True, timeout=600)
    subprocess.run([sys.executable, "-m", "compileall", "-q", target], check=True, timeout=600)
    env = {"PATH": f"{target}/bin:/usr/bin:/bin", "PYTHONPATH": target, "PYTHONDONTWRITEBYTECODE": "1",
           "HYPERLIGHT_AGENT_COMMIT": "0123abc"}
    # A clean interpreter with empty site-packages, as in the image: everything must come from target.
    clean = os.path.join(tmp, "clean")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", clean], check=True, timeout=120)
    python = os.path.join(clean, "bin", "python")
    run = [python, "-s", os.path.join(target, "bin", "hyperlight-agent")]
    helped = subprocess.run([*run, "--help"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert helped.returncode == 0 and "--device-access" in helped.stdout, helped.stderr
    checked = subprocess.run([*run, "--check", "--config", "/dev/null", "--cdi-dir", os.path.join(tmp, "cdi")],
                             env=env, capture_output=True, text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "this node can serve Hyperlight" in checked.stdout
    import_paths = subprocess.run([python, "-s", "-c", "import grpc, hyperlight_agent; print(grpc.__file__)"],
                                  env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    assert import_paths.startswith(target), "dependencies must come from the image's directory"
