"""The container image, built and run for real. No registry is reachable, so `make image` builds
it from a Debian 13 base debootstrapped here (`make image-base`, cached under build/), with the
wheels prepared on the host; then both DaemonSets run from it as deploy/ runs them — every
setting read from the rendered manifests, none restated — against the kubelet stand-in."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hyperlight_agent import contracts, modes
from hyperlight_agent.files import cdi
from standin.kubelet import StandinThread
from tests.conftest import assert_ships_the_agent_only, wait_for
from tests.locks import shared_build_tree
from tests.podman import Podman
from tests.test_deploy import DEPLOY, documents, render
from tests.test_docs import ROOT

pytestmark = pytest.mark.system

BASE = "localhost/hyperlight-agent-base:trixie"
IMAGE = "localhost/hyperlight-agent:test"


def containerfile() -> str:
    with open(os.path.join(ROOT, "Containerfile")) as f:
        return f.read()


def test_containerfile_shape() -> None:
    text = containerfile()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and re.search(r"@sha256:[0-9a-f]{64}$", base.group(1)), "the default base must be pinned by digest"
    # Its Python is the one the image's wheels are for (the Makefile's IMAGE_PYTHON), which has a lock.
    with open(os.path.join(ROOT, "Makefile")) as f:
        python = re.search(r"^IMAGE_PYTHON \?= (\S+)$", f.read(), re.M)
    assert python and f"/python:{python.group(1)}-slim-" in base.group(1), base.group(1)
    assert os.path.exists(os.path.join(ROOT, "pins", f"runtime-py{python.group(1)}.txt"))
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE_IMAGE}", "scratch"]
    assert "--no-index" in text, "nothing inside the build may need the network"
    assert re.search(r"^USER 65532:65532$", text, re.M)
    assert 'ENTRYPOINT ["hyperlight-agent"]' in text


def test_build_context_is_only_the_prepared_wheels() -> None:
    with open(os.path.join(ROOT, ".containerignore")) as f:
        rules = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert rules == ["*", "!build/image-wheels"]
    assert os.readlink(os.path.join(ROOT, ".dockerignore")) == ".containerignore"


@pytest.fixture(scope="module")
def engine() -> Iterator[Podman]:
    directory = tempfile.mkdtemp(prefix="hl-img-")
    podman = Podman(directory)
    try:
        yield podman
    finally:
        podman.close()
        subprocess.run(["rm", "-rf", directory], check=False)


@pytest.fixture(scope="module")
def image(engine: Podman) -> dict[str, Any]:
    """`make image-base` and `make image`, exactly as an operator runs them, into our storage."""
    env = {**engine.env, "MAKEFLAGS": ""}
    engine_cmd = " ".join(engine.argv)
    for target in (["image-base"], ["image", f"BASE_IMAGE={BASE}", f"IMAGE={IMAGE}"]):
        with shared_build_tree():
            made = subprocess.run(
                ["make", "-s", "-C", ROOT, *target, f"ENGINE={engine_cmd}"],
                capture_output=True,
                text=True,
                env=env,
                timeout=1800,
                check=False,
            )
        assert made.returncode == 0, made.stdout + made.stderr
    printed = re.search(r"^id: (sha256:[0-9a-f]{64}) \((\d+) MB\)$", made.stdout, re.M)
    assert printed, made.stdout
    (inspected,) = json.loads(engine("image", "inspect", IMAGE).stdout)
    assert inspected["Id"] == printed.group(1).removeprefix("sha256:")
    return dict(inspected)


def test_make_image_says_what_is_missing_in_one_line(tmp: str) -> None:
    """A fresh machine without a container engine: one line, naming what to install."""
    bin_dir = os.path.join(tmp, "bin")
    os.mkdir(bin_dir)
    for tool in ("sh", "dirname", "sed", "ls", "cat"):  # what build.sh needs, but no engine
        os.symlink(shutil.which(tool) or tool, os.path.join(bin_dir, tool))
    made = subprocess.run(
        ["sh", os.path.join(ROOT, "deploy", "image", "build.sh")],
        capture_output=True,
        text=True,
        env={"PATH": bin_dir, "HOME": tmp},
        timeout=60,
        check=False,
    )
    assert made.returncode == 1
    assert made.stderr == "make image: needs podman or docker (e.g. apt-get install podman)\n"


def test_image_labels_and_contents(engine: Podman, image: dict[str, Any]) -> None:
    labels = image["Config"]["Labels"]
    assert labels["org.opencontainers.image.source"] == "https://github.com/hyperlight-dev/hyperlight-agent"
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", labels["org.opencontainers.image.revision"])
    assert labels["org.opencontainers.image.base.name"] == BASE
    assert image["Config"]["User"] == "65532:65532"
    assert len(image["RootFS"]["Layers"]) == 1, "one flat layer: what the build removed is gone"
    # No installers in the runtime image, and the agent's bytecode compiled at build time.
    script = (
        "import importlib.util as u, os, sys\n"
        "print([m for m in ('pip', 'setuptools', 'wheel', 'ensurepip') if u.find_spec(m)])\n"
        "import hyperlight_agent.cli as c\n"
        "print(os.path.exists(u.cache_from_source(c.__file__)), os.path.exists('/wheels'))\n"
        "print(sorted(os.path.join(d, n) for d, _, ns in os.walk(os.path.dirname(os.path.dirname(c.__file__)))\n"
        "             for n in ns))\n"
    )
    ran = engine("run", "--rm", "--network", "none", "--read-only", "--entrypoint", "python3", IMAGE, "-c", script)
    assert ran.stdout.split("\n")[:2] == ["[]", "True False"], ran.stdout + ran.stderr
    assert_ships_the_agent_only(ast.literal_eval(ran.stdout.split("\n")[2]))


# ---- both DaemonSets, run as deploy/ runs them -------------------------------------------------


def daemonsets() -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d for d in documents(render(os.path.join(DEPLOY, "base"))) if d["kind"] == "DaemonSet"
    }


def run_args(ds: dict[str, Any], name: str, host_paths: dict[str, str]) -> list[str]:
    """`podman run` arguments for the DaemonSet's one container, read from its manifest. Every
    hostPath must have a stand-in in host_paths (the test fails on a new one); a request for
    hyperlight.dev/device-access becomes --device /dev/kvm, as the bootstrap's Allocate grants."""
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pod_sc, sc = pod["securityContext"], container["securityContext"]
    user, group = sc.get("runAsUser", pod_sc["runAsUser"]), sc.get("runAsGroup", pod_sc["runAsGroup"])
    args = [
        "--name",
        name,
        "--detach",
        "--user",
        f"{user}:{group}",
        "--network",
        "none",
        "--stop-timeout",
        str(pod["terminationGracePeriodSeconds"]),
    ]
    assert sc["privileged"] is False and pod["hostNetwork"] is False
    if sc["readOnlyRootFilesystem"]:
        args.append("--read-only")
    assert sc["capabilities"] == {"drop": ["ALL"]}
    args.append("--cap-drop=ALL")
    if sc["allowPrivilegeEscalation"] is False:
        args += ["--security-opt", "no-new-privileges"]
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}  # podman's default profile
    for var in container.get("env", []):
        if "valueFrom" in var:  # the downward API: only the pod's name is used, and it is unique
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, var
            args += ["--env", f"{var['name']}={name}"]
        else:
            args += ["--env", f"{var['name']}={var['value']}"]
    limits = container["resources"]["limits"]
    args += ["--memory", limits["memory"].replace("Mi", "m")]
    if limits.get(contracts.RESOURCE_DEVICE_ACCESS):
        args += ["--device", "/dev/kvm"]
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        host = host_paths[volumes[mount["name"]]]
        args += ["--volume", f"{host}:{mount['mountPath']}" + (":ro" if mount.get("readOnly") else "")]
    return [*args, IMAGE, *container.get("args", [])]


# What the kubelet's httpGet probe does, from inside the container's network (podman's `--network
# none` leaves it its loopback): a GET of the path on the port, passed on a 2xx or 3xx answer.
HTTP_GET = """
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])) as answer:
        sys.exit(0 if 200 <= answer.status < 400 else 1)
except Exception as exc:
    sys.exit(f"{sys.argv[1]}: {exc}")
"""


def probe(engine: Podman, name: str, ds: dict[str, Any], which: str) -> subprocess.CompletedProcess[str]:
    """The manifest's probe run against the container as the kubelet runs it (exec or httpGet)."""
    container = ds["spec"]["template"]["spec"]["containers"][0]
    spec = container[f"{which}Probe"]
    timeout = spec["timeoutSeconds"]
    if "exec" in spec:
        argv = [*spec["exec"]["command"]]
    else:
        get = spec["httpGet"]
        port = get["port"]
        if isinstance(port, str):  # a named port of the container
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
        argv = ["python3", "-c", HTTP_GET, f"http://127.0.0.1:{port}{get['path']}", str(timeout)]
    try:
        return engine("exec", name, *argv, check=False, timeout=timeout + 5)
    except subprocess.TimeoutExpired as exc:
        # A probe not answered in time is a failed probe, as the kubelet counts it (podman exec
        # itself can be that slow on a loaded machine): the caller's wait tries again.
        return subprocess.CompletedProcess(exc.cmd, 1, "", f"no answer within {exc.timeout} s")


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="this machine has no /dev/kvm")
def test_both_daemonsets_run_from_the_image(engine: Podman, image: dict[str, Any], tmp: str) -> None:
    sets = daemonsets()
    kubelet_dir, cdi_dir = (os.path.join(tmp, d) for d in ("kubelet", "cdi"))
    os.mkdir(cdi_dir)
    host_paths = {
        "/var/lib/kubelet/device-plugins": kubelet_dir,
        "/var/run/cdi": cdi_dir,
        "/dev": "/dev",
    }
    names = {ds: f"hl-{os.getpid()}-{ds.removeprefix('hyperlight-')}" for ds in sets}
    with StandinThread(kubelet_dir) as kubelet:
        try:
            started = time.monotonic()
            for ds_name, ds in sets.items():
                engine("run", *run_args(ds, names[ds_name], host_paths))
            kubelet.wait_until(
                lambda k: k.allocatable(contracts.RESOURCE_DEVICE_ACCESS) == modes.DEVICE_ACCESS.slots, 60
            )
            plugin = sets["hyperlight-device-plugin"]
            env = {e["name"]: e.get("value") for e in plugin["spec"]["template"]["spec"]["containers"][0]["env"]}
            count = int(env["DEVICE_COUNT"])
            kubelet.wait_until(lambda k: k.allocatable(contracts.RESOURCE_HYPERVISOR) == count, 60)
            # The image's start-up figure (BENCHMARKS.md): both containers started → both resources advertised.
            print(f"\nimage on {BASE}: podman run of both → both registered: {time.monotonic() - started:.2f} s")

            # The manifests' probes pass against the containers.
            for ds_name, ds in sets.items():
                for which in ("liveness", "readiness"):
                    wait_for(
                        lambda ds_name=ds_name, ds=ds, which=which: (  # type: ignore[misc]
                            probe(engine, names[ds_name], ds, which).returncode == 0
                        ),
                        30,
                        f"the {which} probe of {ds_name} to pass",
                    )

            # The CDI spec is exact: bytes, mode, owner.
            wanted = cdi.render("kvm", "/dev/kvm", int(env["DEVICE_UID"]), int(env["DEVICE_GID"]))
            path = cdi.spec_path(cdi_dir)
            with open(path, "rb") as f:
                assert f.read() == wanted
            st = os.stat(path)
            assert (st.st_mode & 0o777, st.st_uid) == (cdi.SPEC_MODE, 0)
            assert os.listdir(cdi_dir) == [contracts.CDI_SPEC_FILE]

            # Allocate, in the manifests' mode (both: the CDI name, the DeviceSpec and the env).
            assert env["HYPERLIGHT_ALLOCATION"] == "both"
            response = kubelet.call(kubelet.kubelet.allocate(contracts.RESOURCE_HYPERVISOR, ["kvm-0"]))
            (answer,) = response.container_responses
            assert [d.name for d in answer.cdi_devices] == ["hyperlight.dev/hypervisor=kvm"]
            assert [(d.container_path, d.host_path, d.permissions) for d in answer.devices] == [
                ("/dev/kvm", "/dev/kvm", "rw")
            ]
            assert dict(answer.envs) == {"HYPERLIGHT_HYPERVISOR": "kvm", "HYPERLIGHT_DEVICE_PATH": "/dev/kvm"}
            granted = kubelet.call(
                kubelet.kubelet.allocate(
                    contracts.RESOURCE_DEVICE_ACCESS,
                    [kubelet.run(lambda k: k.plugins[contracts.RESOURCE_DEVICE_ACCESS].devices[0][0])],
                )
            )
            assert [d.host_path for d in granted.container_responses[0].devices] == ["/dev/kvm"]

            # A clean stop within the pod's termination grace: exit status 0, socket removed.
            for ds_name, ds in sets.items():
                grace = ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                started = time.monotonic()
                stopped = engine("stop", "--time", str(grace), names[ds_name], check=False, timeout=grace + 30)
                elapsed = time.monotonic() - started
                assert stopped.returncode == 0, stopped.stderr
                assert elapsed < grace, f"{ds_name} took {elapsed:.1f} s to stop (grace {grace} s)"
                state = json.loads(engine("inspect", names[ds_name]).stdout)[0]["State"]
                assert state["ExitCode"] == 0, engine("logs", names[ds_name], check=False).stderr
            # (Each waited out its handover first: no successor was started here.)
            left = os.listdir(kubelet_dir)
            assert not [n for n in left if "hyperlight" in n], left
        finally:
            for name in names.values():
                engine("rm", "-f", "-t", "0", name, check=False)
