"""`--check` (diagnose.py): it needs no temporary directory, runs the checks of the mode the agent
runs (the mode's row: the device-access mode only lstats), finds the mode's kubelet directories,
and every FAIL line is followed by what to do (issue 36: 1, 4)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from hyperlight_agent import cli, config, diagnose, modes, parts
from hyperlight_agent.config import Settings
from hyperlight_agent.device.checker import Checker
from hyperlight_agent.device.observation import Cause, Observation, SharedObservation
from tests.conftest import HOST_KVM, REPO, run_agent
from tests.fakes import FakeHelper, device_dir, files_as_devices


def no_temp_dir(*args: Any, **kwargs: Any) -> Any:
    raise FileNotFoundError(2, "No usable temporary directory found in ['/tmp', '/var/tmp', '/usr/tmp', '/']")


def test_the_runtime_check_needs_no_temporary_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod's root filesystem is read-only and none of the chart's pods mounts /tmp: the runtime
    check binds its gRPC server on an abstract unix socket instead of a file in a temp dir."""
    for name in ("gettempdir", "mkdtemp", "mkstemp", "TemporaryDirectory", "NamedTemporaryFile"):
        monkeypatch.setattr(tempfile, name, no_temp_dir)
    assert diagnose.runtime() == (True, "ok   runtime: the agent imports and its gRPC server binds a unix socket")


class RefusingHelper(FakeHelper):
    """The device-access mode must never open the device: any probe fails the test."""

    async def run(self, request: Any) -> Any:
        raise AssertionError(f"the device-access mode probed {request}")


def kubelet(tmp: str) -> str:
    path = os.path.join(tmp, "kubelet")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.mark.skipif(not os.path.exists(HOST_KVM), reason="needs hardware this machine lacks: /dev/kvm")
def test_the_device_access_mode_only_lists_the_device(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diagnose, "ProbeHelper", RefusingHelper)
    settings = Settings.defaults(device_dir="/dev", kubelet_dir=kubelet(tmp), cdi_dir=os.path.join(tmp, "cdi"))
    ok, lines = diagnose.diagnose(settings, modes.DEVICE_ACCESS)
    assert ok, lines
    assert "ok   device node: a character device, listed with lstat, not opened (the device-access mode)" in lines
    assert not any("probe" in line or "CDI spec" in line for line in lines), lines
    assert f"ok   kubelet_dir: {tmp}/kubelet" in lines


def test_the_plugin_mode_probes_and_inspects_the_spec(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    helper = FakeHelper()
    monkeypatch.setattr(diagnose, "ProbeHelper", lambda: helper)
    files_as_devices(monkeypatch)
    settings = Settings.defaults(
        device_dir=device_dir(tmp, "kvm"), kubelet_dir=kubelet(tmp), cdi_dir=os.path.join(tmp, "cdi")
    )
    ok, lines = diagnose.diagnose(settings, modes.PLUGIN)
    assert ok, lines
    assert [r.hypervisor for r in helper.requests] == ["kvm"]
    assert "ok   probe: empty VM created and closed" in lines
    assert f"note CDI spec: {tmp}/cdi/hyperlight.json is missing (the running agent repairs it)" in lines
    assert not os.path.exists(os.path.join(tmp, "cdi")), "--check changes nothing"


def spec_obstacle(tmp: str, kind: str) -> str:
    """A cdi_dir the running agent refuses to serve from (its check fails for as long as it stays);
    the path given as cdi_dir."""
    cdi_dir, real = os.path.join(tmp, "cdi"), os.path.join(tmp, "real-cdi")
    if kind == "cdi_dir a symlink to a directory":
        os.makedirs(real)
        os.symlink(real, cdi_dir)
    elif kind == "cdi_dir a dangling symlink":
        os.symlink(os.path.join(tmp, "gone"), cdi_dir)
    elif kind == "cdi_dir a regular file":
        with open(cdi_dir, "w"):
            pass
    elif kind == "the spec a symlink":
        os.makedirs(cdi_dir)
        with open(real, "w"):
            pass
        os.symlink(real, os.path.join(cdi_dir, "hyperlight.json"))
    else:
        assert kind == "the spec a directory"
        os.makedirs(os.path.join(cdi_dir, "hyperlight.json"))
    return cdi_dir


SPEC_OBSTACLES = (
    "cdi_dir a symlink to a directory",
    "cdi_dir a dangling symlink",
    "cdi_dir a regular file",
    "the spec a symlink",
    "the spec a directory",
)


# Issue 47, 4: `--check` said "note CDI spec: ... (the running agent repairs it)" and "this node
# can serve Hyperlight" where the agent refuses the spec's place and serves nothing.
@pytest.mark.parametrize("kind", SPEC_OBSTACLES)
def test_check_fails_where_the_agent_refuses_the_spec_s_place(
    tmp: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setattr(diagnose, "ProbeHelper", FakeHelper)
    files_as_devices(monkeypatch)
    cdi_dir = spec_obstacle(tmp, kind)
    settings = Settings.defaults(device_dir=device_dir(tmp, "kvm"), kubelet_dir=kubelet(tmp), cdi_dir=cdi_dir)
    before = sorted(os.listdir(tmp))

    # What the running agent's own check says of the same settings: unusable, and why.
    async def agent_check() -> Observation:
        helper: Any = FakeHelper()
        return await Checker(parts.check_target(settings, modes.PLUGIN), helper, SharedObservation()).check()

    refused = asyncio.run(agent_check())
    assert not refused.healthy and refused.cause is Cause.CDI and cdi_dir in refused.reason
    assert "refusing" in refused.reason or "cannot read" in refused.reason, refused.reason
    assert sorted(os.listdir(tmp)) == before and os.path.lexists(cdi_dir), "the agent left it in place"

    ok, lines = diagnose.diagnose(settings, modes.PLUGIN)
    assert not ok, lines
    ((fail, hint),) = failures(lines)
    assert fail == f"FAIL CDI spec: {refused.reason}", lines
    assert hint.startswith("hint "), lines
    assert "ok   probe: empty VM created and closed" in lines
    assert not any(line.startswith("note CDI spec") for line in lines), lines


# The command itself, in a process of its own (its entry point sets up logging and signals): the
# probe helper a fake that passes, a regular file counting as the device node.
FAKE_DEVICE_CLI = """
import os, sys
from hyperlight_agent import cli, diagnose
from hyperlight_agent.device import hypervisors
from tests.fakes import FakeHelper
diagnose.ProbeHelper = FakeHelper
hypervisors.present = lambda d: [h for h in hypervisors.HYPERVISORS if os.path.isfile(h.device_path(d))]
sys.exit(cli.main(sys.argv[1:]))
"""


def test_check_exits_1_where_the_agent_refuses_the_spec_s_place(tmp: str) -> None:
    """FAIL, "cannot serve", exit 1 as for its other failures."""
    cdi_dir = spec_obstacle(tmp, "cdi_dir a symlink to a directory")
    args = ["--config", "/dev/null", "--check", "--device-dir", device_dir(tmp, "kvm"), "--kubelet-dir", kubelet(tmp)]
    done = subprocess.run(
        [sys.executable, "-c", FAKE_DEVICE_CLI, *args, "--cdi-dir", cdi_dir],
        cwd=REPO,
        env={"PATH": os.environ["PATH"], "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"FAIL CDI spec: {cdi_dir} (cdi_dir) is a symlink; refusing to follow it" in done.stdout
    assert done.stdout.splitlines()[-1] == "this node cannot serve Hyperlight"


def failures(lines: list[str]) -> list[tuple[str, str]]:
    """Each FAIL line with the line after it."""
    return [
        (line, lines[i + 1] if i + 1 < len(lines) else "") for i, line in enumerate(lines) if line.startswith("FAIL")
    ]


@pytest.mark.parametrize("mode", [modes.PLUGIN, modes.DEVICE_ACCESS], ids=lambda m: m.name)
def test_a_missing_kubelet_directory_fails_with_its_own_line(
    tmp: str, monkeypatch: pytest.MonkeyPatch, mode: modes.Mode
) -> None:
    """No kubelet on the node: `--check` said "this node can serve Hyperlight" while the agent
    looped on a missing directory (issue 36: 1)."""
    monkeypatch.setattr(diagnose, "ProbeHelper", FakeHelper)
    files_as_devices(monkeypatch)
    missing = os.path.join(tmp, "no-kubelet")
    settings = Settings.defaults(device_dir=device_dir(tmp, "kvm"), kubelet_dir=missing, cdi_dir=tmp)
    found = diagnose.directories(settings, mode.kubelet_dirs)
    assert found[0] == (False, f"FAIL kubelet_dir: {missing}: No such file or directory")
    assert found[1][1].startswith("hint the kubelet makes it when it starts: is a kubelet running on this node?")


def test_a_missing_device_directory_is_said_as_such_with_the_setting_to_fix(tmp: str) -> None:
    settings = Settings.defaults(device_dir=os.path.join(tmp, "nonexistent"), kubelet_dir=kubelet(tmp), cdi_dir=tmp)
    ok, lines = diagnose.diagnose(settings, modes.PLUGIN)
    assert not ok
    ((fail, hint),) = failures(lines)
    assert fail == f"FAIL device_dir: {tmp}/nonexistent does not exist"
    assert hint.startswith("hint set device_dir (HYPERLIGHT_DEVICE_DIR, --device-dir) to where the host's /dev is")
    assert not any("modprobe" in line for line in lines), "no module hints for a directory that is not there"


def test_every_fail_line_is_followed_by_what_to_do(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperlight_agent.device.helper import ProbeResult

    helper = FakeHelper({"kvm": ProbeResult(False, "KVM_CREATE_VM failed: Device or resource busy")})
    monkeypatch.setattr(diagnose, "ProbeHelper", lambda: helper)
    files_as_devices(monkeypatch)
    broken = [
        Settings.defaults(device_dir=device_dir(tmp, "kvm"), kubelet_dir=os.path.join(tmp, "none"), cdi_dir=tmp),
        Settings.defaults(device_dir=tmp, kubelet_dir=kubelet(tmp), cdi_dir=tmp),  # no device in it
        Settings.defaults(device_dir=device_dir(tmp), host_device_dir=os.path.join(tmp, "gone"), cdi_dir=tmp),
        Settings.defaults(
            device_dir=device_dir(tmp, "kvm"),
            dra_registry_dir=os.path.join(tmp, "none"),
            dra_plugins_dir=os.path.join(tmp, "none"),
            node_name="n",
        ),
    ]
    seen = set()
    for settings, mode in zip(broken, (modes.PLUGIN, modes.PLUGIN, modes.PLUGIN, modes.DRA)):
        ok, lines = diagnose.diagnose(settings, mode, {})
        assert not ok, lines
        for fail, after in failures(lines):
            assert after.startswith("hint "), (fail, lines)
            seen.add(fail.split(":")[0])
    assert seen >= {
        "FAIL kubelet_dir",
        "FAIL probe",
        "FAIL device",
        "FAIL host_device_dir",
        "FAIL dra_registry_dir",
        "FAIL dra_plugins_dir",
        "FAIL API credentials",
    }


def test_check_follows_the_mode_setting_from_the_environment(tmp: str) -> None:
    """In a pod, `kubectl exec POD -- hyperlight-agent --check` has the container's environment,
    not its arguments: HYPERLIGHT_MODE, which the chart sets, says which mode's checks to run."""
    env = {"PATH": os.environ["PATH"], "HYPERLIGHT_MODE": "dra", "HYPERLIGHT_DEVICE_DIR": tmp}
    result = run_agent("--check", "--dra-registry-dir", os.path.join(tmp, "none"), env=env)
    assert result.returncode == 1
    assert f"FAIL dra_registry_dir: {tmp}/none: No such file or directory" in result.stdout
    assert "FAIL API credentials" in result.stdout
    result = run_agent("--check", "--device-access", "--kubelet-dir", tmp, env=env)  # the flag wins
    assert f"ok   kubelet_dir: {tmp}" in result.stdout and "API" not in result.stdout, result.stdout


def test_mode_flags_and_the_mode_setting_never_disagree() -> None:
    result = run_agent("--check", "--dra", "--mode", "plugin")
    assert result.returncode == 2
    assert result.stderr.strip() == "hyperlight-agent: error: --mode 'plugin' and --dra: different modes, choose one"


@pytest.mark.root
@pytest.mark.skipif(not os.path.exists(HOST_KVM), reason="needs hardware this machine lacks: /dev/kvm")
def test_check_passes_with_a_read_only_root_and_no_writable_temp_dir(tmp: str) -> None:
    """As in the chart's pods: /tmp, /var/tmp and the working directory read-only, no TMPDIR; the
    real device probed. Before, this failed with `FAIL runtime: … No usable temporary directory`."""
    kubelet_dir = kubelet(tmp)
    script = (
        "set -e; for d in /tmp /var/tmp " + REPO + "; do mount --bind -o ro $d $d 2>/dev/null || "
        "{ mount --bind $d $d; mount -o remount,bind,ro $d; }; done; "
        f"exec {sys.executable} -m hyperlight_agent --config /dev/null --check --kubelet-dir {kubelet_dir} "
        f"--cdi-dir {tmp}/cdi"
    )
    env = {"PATH": os.environ["PATH"], "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "this node can serve Hyperlight"


def test_an_ignored_original_variable_fails_the_check(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`DEVICE_COUNT=100001` only warns, as the original plugin did; `--check` passed on it
    (issue 50: 5). The node would run on another value than the one given: FAIL, with a hint."""
    helper = FakeHelper()
    monkeypatch.setattr(diagnose, "ProbeHelper", lambda: helper)
    files_as_devices(monkeypatch)
    args = ["--device-dir", device_dir(tmp, "kvm"), "--kubelet-dir", kubelet(tmp), "--cdi-dir", f"{tmp}/cdi"]
    parsed = cli.build_parser().parse_args(["--config", "/dev/null", *args])
    assert diagnose.diagnose(config.load(parsed, {}), modes.PLUGIN)[0], "passes without it"
    settings = config.load(parsed, {"DEVICE_COUNT": "100001"})
    ok, lines = diagnose.diagnose(settings, modes.PLUGIN)
    assert not ok
    [(fail, hint)] = failures(lines)
    assert fail.startswith("FAIL DEVICE_COUNT='100001' (must be an integer from 1 to 100000); using the default 2000")
    assert hint.startswith("hint set DEVICE_COUNT to a valid value or unset it")
