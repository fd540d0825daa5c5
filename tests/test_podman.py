"""A real CDI consumer: podman 4.3 resolves the agent-written spec (the agent's from the source
tree, and the .deb's under systemd), creates the node with our owner and mode, and a non-root
process in the container creates a VM and runs a Hyperlight guest through it."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from hyperlight_agent import contracts
from hyperlight_agent.files import cdi
from standin.kubelet import StandinThread
from tests import hyperlight, nspawn
from tests.conftest import StartAgent, make_node, wait_for
from tests.e2e import hostwide
from tests.podman import Podman, system_cdi_lock
from tests.test_deb import UNIT, apt
from tests.test_docs import ROOT

pytestmark = pytest.mark.system


@pytest.fixture
def podman(tmp: str) -> Iterator[Podman]:
    """podman with private storage under tmp, and an image holding kvmcheck and the Hyperlight
    example (its host program and guest)."""
    rootfs = os.path.join(tmp, "rootfs")
    os.makedirs(os.path.join(rootfs, "dev"))
    example = hyperlight.example()
    shutil.copy2(example.host, rootfs + hyperlight.HOST_IN_IMAGE)
    shutil.copy2(example.guest, rootfs + hyperlight.GUEST_IN_IMAGE)
    subprocess.run(
        [
            "gcc",
            "-static",
            "-O2",
            "-o",
            os.path.join(rootfs, "kvmcheck"),
            os.path.join(ROOT, "tests", "data", "kvmcheck.c"),
        ],
        check=True,
        timeout=120,
    )
    engine = Podman(tmp)
    try:
        with subprocess.Popen(["tar", "-C", rootfs, "-cf", "-", "."], stdout=subprocess.PIPE) as tar:
            subprocess.run(
                [*engine.argv, "import", "-", "localhost/kvmcheck:1"],
                stdin=tar.stdout,
                check=True,
                env=engine.env,
                timeout=120,
                capture_output=True,
            )
        yield engine
    finally:
        engine.close()


@pytest.fixture
def system_cdi_dir() -> Iterator[str]:
    """/var/run/cdi is where podman 4.3 looks: hold the machine-wide lock while our spec is there,
    and restore exactly what was there before. The directory, if the host lacks it, is made and
    removed as a real cluster's nodes' is (tests/e2e/hostwide.py): never while a node of a cluster
    running beside us has it bound, nor while we have."""
    with system_cdi_lock():
        try:
            with hostwide.Claim():
                hostwide.make_mountpoints([contracts.CDI_DIR])
                yield from _system_cdi_dir()
        finally:
            hostwide.remove_mountpoints()


def _system_cdi_dir() -> Iterator[str]:
    directory = contracts.CDI_DIR
    path = cdi.spec_path(directory)
    before = None
    if os.path.lexists(path):
        with open(path, "rb") as f:
            before = f.read()
    others = set(os.listdir(directory))
    yield directory
    if before is None:
        if os.path.lexists(path):
            os.unlink(path)
    else:
        with open(path, "wb") as f:
            f.write(before)
    # Only what could be ours: another agent on this machine may add or remove its own specs here.
    after = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    strays = {n for n in after - others if n.startswith("hyperlight") and n != contracts.CDI_SPEC_FILE}
    assert not strays, f"left in {directory}: {sorted(strays)}"


def run(podman: Podman, user: str, command: str = "/kvmcheck") -> subprocess.CompletedProcess[str]:
    return podman(
        "run",
        "--rm",
        "--network",
        "none",  # no network set up for a container that needs none (and none to race another's)
        "--user",
        user,
        "--device",
        "hyperlight.dev/hypervisor=kvm",
        "localhost/kvmcheck:1",
        command,
        check=False,
    )


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="this machine has no /dev/kvm")
def test_podman_resolves_our_spec_and_a_non_root_user_creates_a_vm(
    podman: Podman, system_cdi_dir: str, kubelet: StandinThread, start_agent: StartAgent
) -> None:
    start_agent("--device-count", "2", "--cdi-dir", system_cdi_dir)
    kubelet.wait_until(lambda k: k.allocatable(contracts.RESOURCE_HYPERVISOR) == 2, 15)
    response = kubelet.call(kubelet.kubelet.allocate(contracts.RESOURCE_HYPERVISOR, ["kvm-0"]))
    assert response.container_responses[0].cdi_devices[0].name == "hyperlight.dev/hypervisor=kvm"

    ok = run(podman, "65534:65534")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "uid=65534 node=660 owner=65534:65534 env=kvm api=12 vm=created" in ok.stdout
    # The real client, under podman's default seccomp profile: a Hyperlight sandbox runs the guest.
    sandbox = run(podman, "65534:65534", hyperlight.HOST_IN_IMAGE)
    assert sandbox.returncode == 0 and hyperlight.ANSWER in sandbox.stdout, sandbox.stdout + sandbox.stderr

    # Neither the owner nor in the group: the 0660 mode keeps it out.
    refused = run(podman, "12345:12345")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "open: Permission denied" in refused.stdout
    # And Hyperlight says so itself: its own error, exit 1.
    refused = run(podman, "12345:12345", hyperlight.HOST_IN_IMAGE)
    assert refused.returncode == 1 and hyperlight.NO_HYPERVISOR in refused.stderr, refused.stdout + refused.stderr


@pytest.mark.root
@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="this machine has no /dev/kvm")
def test_podman_runs_the_hyperlight_guest_with_the_spec_the_debs_agent_wrote(
    podman: Podman, system_cdi_dir: str, host_packages: dict[str, str], tmp: str
) -> None:
    """A host, end to end: the release's .deb installed on a clean Debian 12 and run by its
    systemd (the guest's /run/cdi is this machine's, held under the system CDI lock) writes the
    spec, and podman here resolves it: the Hyperlight guest answers as 65534."""
    deb = host_packages["deb12"]
    root = os.path.join(tmp, "root")
    subprocess.run(["cp", "-a", "--reflink=auto", nspawn.rootfs(), root], check=True, timeout=300)
    apt(root, "install", "/root/agent.deb", binds=(f"{deb}:/root/agent.deb",))
    os.makedirs(os.path.join(tmp, "kubelet"))
    kvm = make_node(os.path.join(tmp, "kvm"), 10, 232)
    binds = [f"{kvm}:/dev/kvm", f"{tmp}/kubelet:/var/lib/kubelet/device-plugins", f"{system_cdi_dir}:/run/cdi"]
    with nspawn.Guest(root, binds, ephemeral=False) as guest, StandinThread(os.path.join(tmp, "kubelet")) as kubelet:
        kubelet.wait_until(lambda k: k.allocatable(contracts.RESOURCE_HYPERVISOR) == 2000, 60)
        wait_for(lambda: guest.is_active(UNIT) == "active", 30, "the .deb's agent active")
        response = kubelet.call(kubelet.kubelet.allocate(contracts.RESOURCE_HYPERVISOR, ["kvm-0"]))
        assert response.container_responses[0].cdi_devices[0].name == "hyperlight.dev/hypervisor=kvm"
        assert os.path.exists(cdi.spec_path(system_cdi_dir))

        said = run(podman, "65534:65534", hyperlight.HOST_IN_IMAGE)
        assert said.returncode == 0 and hyperlight.ANSWER in said.stdout, said.stdout + said.stderr
        guest.run("systemctl", "stop", UNIT)
