"""Files the packages ship that are generated from the code: they must not drift from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

import pytest

from hyperlight_agent import cli, config
from tests.test_docs import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_shipped_agent_toml_is_the_generated_one() -> None:
    with open(os.path.join(ROOT, "packaging", "agent.toml")) as f:
        assert f.read() == config.default_file(), (
            "run: python -c 'from hyperlight_agent import config; "
            'print(config.default_file(), end="")\' > packaging/agent.toml'
        )


def test_shipped_agent_toml_documents_every_setting_with_its_default(tmp: str) -> None:
    text = config.default_file()
    assert tomllib.loads(text) == {}, "everything is commented out: defaults apply"
    uncommented = "\n".join(line[1:] for line in text.splitlines() if re.match(r"#[a-z_]+ = ", line))
    values = tomllib.loads(uncommented)
    assert set(values) == set(config.BY_KEY)
    for key, value in values.items():
        default = config.BY_KEY[key].default
        if default is not None:
            assert value == default, key
    path = os.path.join(tmp, "agent.toml")
    with open(path, "w") as f:
        f.write(uncommented)
    settings = config.load(cli.build_parser().parse_args(["--config", path]), {})
    assert settings.device_count == 2000 and settings.host_device_dir == "/host-dev"


def test_man_page_is_generated_from_the_parser() -> None:
    page = subprocess.run(
        [sys.executable, os.path.join(ROOT, "packaging", "manpage.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert page.startswith(".TH HYPERLIGHT-AGENT 8")
    for action in cli.build_parser()._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert flag.replace("-", "\\-") in page, flag
    for s in config.SETTINGS:
        assert s.env.replace("-", "\\-") in page
    lint = subprocess.run(
        ["man", "--warnings", "-l", "-"],
        input=page,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "MANWIDTH": "80"},
    )
    assert lint.returncode == 0 and not lint.stderr.strip(), lint.stderr


def test_package_builds_install_build_dependencies_only() -> None:
    """`make deb`/`make rpm` on a fresh machine: what they would install, read from make's own plan."""

    def plan(*targets: str) -> str:
        return subprocess.run(
            ["make", "-n", "--always-make", *targets], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout

    packaging = plan("deb", "rpm")
    for build_dependency in ("debhelper", "lintian", "rpmlint", "binutils", "python3-venv"):
        assert build_dependency in packaging, build_dependency
    for test_only in ("podman", "debootstrap", "systemd-container", "gcc", "protobuf-compiler", "[test]"):
        assert test_only not in packaging, f"`make deb`/`make rpm` would install {test_only}"
    testing = plan("test")
    for needed in ("podman", "debootstrap", "debhelper", "rpmlint", "cpio", "[test]"):
        assert needed in testing, needed


def test_the_unit_allows_exactly_the_table_s_devices() -> None:
    """A hypervisor is one row (device/hypervisors.py): the unit's device rules follow the table,
    so a new row cannot be probed under a unit that forbids its node (DevicePolicy=closed)."""
    from hyperlight_agent.device import hypervisors

    with open(os.path.join(ROOT, "systemd", "hyperlight-agent.service")) as f:
        allowed = re.findall(r"^DeviceAllow=(\S+) (\S+)$", f.read(), re.MULTILINE)
    by_path = {path for path, access in allowed if not path.startswith("/dev/char/") and access == "rw"}
    assert by_path == {h.container_path for h in hypervisors.HYPERVISORS}
    # KVM's fixed number (10:232) is named too, so a kvm module loaded after the unit started is allowed.
    assert ("/dev/char/10:232", "rw") in allowed


def test_the_deployments_name_every_row_of_the_table() -> None:
    """The bootstrap DaemonSet inventories the table's nodes under /host-dev, and the DeviceClass
    documents the attributes: both say which nodes, so both follow the table."""
    from hyperlight_agent.device import hypervisors

    nodes = "{" + ",".join(h.node for h in hypervisors.HYPERVISORS) + "}"
    for path in ("deploy/base/device-access.yaml", "deploy/helm/hyperlight-agent/templates/device-access.yaml"):
        with open(os.path.join(ROOT, path)) as f:
            assert f"/host-dev/{nodes}" in f.read(), path
    for path in ("deploy/components/dra/deviceclass.yaml", "deploy/helm/hyperlight-agent/templates/deviceclass.yaml"):
        with open(os.path.join(ROOT, path)) as f:
            named = re.search(r"hypervisor \(([^)]*)\)", f.read())
        assert named and set(re.findall(r'"(\w+)"', named.group(1))) == set(hypervisors.BY_NAME), path


def run_postinst(tmp: str, *args: str, policy: dict[str, int], upgrade: int = 0) -> list[str]:
    """packaging/debian/postinst run with stand-ins for systemctl, deb-systemd-helper, policy-rc.d
    and the agent (its absolute paths pointed into tmp); the commands it ran, in order."""
    bin_dir = os.path.join(tmp, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    os.makedirs(os.path.join(tmp, "run-systemd"), exist_ok=True)
    log = os.path.join(tmp, "calls")
    behaviour = {
        # The unit is active, its main process 4242.
        "systemctl": 'case "$1" in show) echo 4242;; esac\n',
        "hyperlight-agent": f"exit {upgrade}\n",
        "policy-rc.d": 'case "$2" in '
        + " ".join(f"{action}) exit {rc};;" for action, rc in policy.items())
        + " esac\nexit 0\n",
    }
    for tool in ("systemctl", "deb-systemd-helper", "python3", "hyperlight-agent", "policy-rc.d"):
        with open(os.path.join(bin_dir, tool), "w") as f:
            f.write(f'#!/bin/sh\necho "{tool} $*" >> {log}\n{behaviour.get(tool, "")}')
        os.chmod(os.path.join(bin_dir, tool), 0o755)  # noqa: S103 - a command on PATH must be executable
    with open(os.path.join(ROOT, "packaging", "debian", "postinst")) as f:
        script = (
            f.read()
            .replace("#DEBHELPER#", "")
            .replace("/usr/sbin/policy-rc.d", os.path.join(bin_dir, "policy-rc.d"))
            .replace("/run/systemd/system", os.path.join(tmp, "run-systemd"))
            .replace("/usr/bin/python3", os.path.join(bin_dir, "python3"))
        )
    if os.path.exists(log):
        os.unlink(log)
    subprocess.run(
        ["sh", "-e", "-c", script, "postinst", *args],
        check=True,
        timeout=30,
        capture_output=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )
    with open(log) as f:
        return [line for line in f.read().splitlines() if not line.startswith("python3 ")]


UNIT = "hyperlight-agent.service"


def test_postinst_asks_policy_rc_d_about_the_restart_it_makes(tmp: str) -> None:
    """An agent too old to hand over (exit 3) is restarted, and policy-rc.d is asked about
    "restart" first: its 101 for restart holds even where reload is allowed."""
    upgrade = [
        f"policy-rc.d {UNIT} reload",
        f"systemctl is-active --quiet {UNIT}",
        f"systemctl show -P MainPID {UNIT}",
        "hyperlight-agent --upgrade-in-place 4242",
    ]
    calls = run_postinst(tmp, "configure", "0.1.0", policy={"reload": 0, "restart": 101}, upgrade=3)
    assert sorted(calls) == sorted([*upgrade, f"policy-rc.d {UNIT} restart"]), calls
    calls = run_postinst(tmp, "configure", "0.1.0", policy={"reload": 0, "restart": 104}, upgrade=3)
    assert calls[-2:] == [f"policy-rc.d {UNIT} restart", f"systemctl --no-block restart {UNIT}"], calls
    # Handed over in place: nothing restarted, restart not even asked about.
    calls = run_postinst(tmp, "configure", "0.1.0", policy={"reload": 0, "restart": 0}, upgrade=0)
    assert sorted(calls) == sorted(upgrade), calls
    # Reload forbidden: no upgrade in place, no restart.
    calls = run_postinst(tmp, "configure", "0.1.0", policy={"reload": 101, "restart": 0}, upgrade=3)
    assert "hyperlight-agent --upgrade-in-place 4242" not in calls
    assert f"systemctl --no-block restart {UNIT}" not in calls


def stand_in_setuptools(directory: str, marker: str) -> str:
    """A wheel claiming to be setuptools 80.99.0 (inside pyproject.toml's build-system range, above
    every real 80.x) whose build backend, when run, leaves `marker` and fails: what an index or
    mirror could serve to a build that fetches its backend unpinned."""
    name = "setuptools-80.99.0"
    files = {
        "setuptools/__init__.py": "",
        "setuptools/build_meta.py": f"open({marker!r}, 'w').close()\nraise SystemExit('the stand-in backend ran')\n",
        f"{name}.dist-info/METADATA": "Metadata-Version: 2.1\nName: setuptools\nVersion: 80.99.0\n",
        f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = os.path.join(directory, f"{name}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
        wheel.writestr(f"{name}.dist-info/RECORD", "".join(f"{m},,\n" for m in [*files, f"{name}.dist-info/RECORD"]))
    return path


@pytest.mark.system
def test_shipped_wheels_are_built_by_the_hashed_build_environment_only(tmp: str) -> None:
    """packaging/wheels.sh with a stand-in setuptools on offer (PIP_FIND_LINKS): the agent's wheel
    and sdnotify's are built by build/venv's setuptools (pins/build.txt, by hash); the stand-in never
    runs. Under pip's build isolation it was fetched and run."""
    subprocess.run(["make", "-s", "build/venv/.installed"], cwd=ROOT, check=True, timeout=600, capture_output=True)
    links = os.path.join(tmp, "links")
    os.makedirs(links)
    marker = os.path.join(tmp, "stand-in-ran")
    stand_in_setuptools(links, marker)
    out = os.path.join(tmp, "wheels")
    done = subprocess.run(
        [os.path.join(ROOT, "packaging", "wheels.sh"), out, "3.11"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "PYTHON": os.path.join(ROOT, "build", "venv", "bin", "python"), "PIP_FIND_LINKS": links},
    )
    assert not os.path.exists(marker), "the stand-in build backend ran"
    assert done.returncode == 0, done.stderr
    built = sorted(n for n in os.listdir(out) if n.startswith(("hyperlight_agent-", "sdnotify-")))
    assert [n.split("-")[0] for n in built] == ["hyperlight_agent", "sdnotify"], built


def test_wheels_refuse_a_python_that_is_not_the_build_environment(tmp: str) -> None:
    """Without build/venv's setuptools (here: this venv's, whatever it is, or none), nothing is built."""
    with open(os.path.join(ROOT, "pins", "build.txt")) as f:
        locked = re.search(r"^setuptools==([^ ;]+)", f.read(), re.M)
    assert locked
    python = os.path.join(tmp, "python")
    with open(python, "w") as f:
        f.write(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # -S: no site-packages, so no setuptools
    os.chmod(python, 0o755)  # noqa: S103 - run as PYTHON
    done = subprocess.run(
        [os.path.join(ROOT, "packaging", "wheels.sh"), os.path.join(tmp, "out"), "3.11"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHON": python},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"wheels.sh: {python} has setuptools none, not pins/build.txt's {locked.group(1)}: "
        "PYTHON must be the build environment (make build/venv/.installed)\n"
    )
    assert not os.path.exists(os.path.join(tmp, "out"))
