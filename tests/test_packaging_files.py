"""Files the packages ship that are generated from the code: they must not drift from it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from hyperlight_agent import cli, config
from tests.locks import shared_build_tree
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


def spec_section(name: str) -> str:
    """The body of a section of the .rpm's spec (packaging/rpm), e.g. "posttrans": the scriptlet as
    rpm runs it (these use no macros)."""
    with open(os.path.join(ROOT, "packaging", "rpm", "hyperlight-agent.spec")) as f:
        found = re.search(rf"^%{name}\n(.*?)^%(?:files|changelog|pre\w*|post\w*)$", f.read(), re.M | re.S)
    assert found, f"no %{name} in the spec"
    return found.group(1)


@pytest.mark.system  # the real systemctl
@pytest.mark.parametrize("package", ["rpm", "deb"])
def test_an_upgrade_in_an_offline_root_neither_upgrades_nor_reports_a_failure(tmp: str, package: str) -> None:
    """In an image build (mock, dnf --installroot, kiwi; debootstrap) no systemd runs, and systemctl
    ignores is-active and show and exits 0 ("Running in chroot, ignoring command"): the .rpm's
    %posttrans took the agent for running, ran `hyperlight-agent --upgrade-in-place ""` (exit 2)
    and said the upgrade failed (issue 47: 5). Both packages ask /run/systemd/system first; run
    here with the real systemctl in its offline mode and no /run/systemd/system in the root."""
    systemctl = shutil.which("systemctl")
    assert systemctl, "systemctl (systemd) is a test dependency"
    offline = {"SYSTEMD_OFFLINE": "1"}
    said = subprocess.run(
        [systemctl, "is-active", UNIT], env=offline, capture_output=True, text=True, timeout=30, check=False
    )
    assert said.returncode == 0 and "ignoring command" in said.stderr, "the premise: offline, is-active says yes"
    bin_dir = os.path.join(tmp, "bin")
    os.mkdir(bin_dir)
    log = os.path.join(tmp, "calls")
    # The agent as it answers an empty PID; the others are the host's, not ours to run.
    stand_ins = {"hyperlight-agent": "exit 2", "python3": "", "deb-systemd-helper": "", "policy-rc.d": ""}
    for tool, then in stand_ins.items():
        with open(os.path.join(bin_dir, tool), "w") as f:
            f.write(f'#!/bin/sh\necho "{tool} $*" >> {log}\n{then}\n')
        os.chmod(os.path.join(bin_dir, tool), 0o755)  # noqa: S103 - a command on PATH must be executable
    absent = os.path.join(tmp, "root", "run", "systemd", "system")  # the image's /run: no systemd
    if package == "rpm":
        script, args = spec_section("posttrans"), ["posttrans", "0"]
    else:
        with open(os.path.join(ROOT, "packaging", "debian", "postinst")) as f:
            script, args = f.read().replace("#DEBHELPER#", ""), ["postinst", "configure", "0.1.0"]
    script = (
        script.replace("/run/systemd/system", absent)
        .replace("/usr/sbin/policy-rc.d", os.path.join(bin_dir, "policy-rc.d"))
        .replace("/usr/bin/python3", os.path.join(bin_dir, "python3"))
    )
    ran = subprocess.run(
        ["sh", "-e", "-c", script, *args],
        env={**offline, "PATH": f"{bin_dir}:{os.path.dirname(systemctl)}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    calls = []
    if os.path.exists(log):
        with open(log) as f:
            calls = [line for line in f.read().splitlines() if not line.startswith("python3 ")]
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout + ran.stderr == "", "no systemctl asked (it says it ignores), no failure reported"
    assert not [c for c in calls if c.startswith("hyperlight-agent")], calls


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
    with shared_build_tree():
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


UNIT_FILE = os.path.join(ROOT, "systemd", "hyperlight-agent.service")


def unit_values(directive: str, text: str) -> list[str]:
    """Every value of a directive in a unit or drop-in, split into words, `-` prefixes dropped."""
    found: list[str] = []
    for value in re.findall(rf"^{directive}=(.*)$", text, re.M):
        found += [word.lstrip("-") for word in value.split()]
    return found


def hosts_block(marker: str) -> str:
    """The ```ini block after `<!-- MARKER -->` in docs/hosts.md, as written there."""
    with open(os.path.join(ROOT, "docs", "hosts.md")) as f:
        text = f.read()
    return text.split(f"<!-- {marker} -->", 1)[1].split("```ini\n", 1)[1].split("```", 1)[0]


def test_agent_toml_says_where_the_unit_lets_the_agent_write() -> None:
    """The unit allowed writes to the default kubelet and CDI directories only, while agent.toml
    offered others without saying a drop-in is needed (issue 50: 8): beside each directory the
    agent writes, agent.toml says so; the unit's ReadWritePaths are exactly those defaults; and
    docs/hosts.md's drop-ins cover the written directories the unit leaves out."""
    from hyperlight_agent import modes

    written = {key for mode in modes.MODES for key in mode.kubelet_dirs} | {"cdi_dir", "nfd_features_dir"}
    assert set(config.WRITTEN_DIRS) == written
    with open(UNIT_FILE) as f:
        allowed = unit_values("ReadWritePaths", f.read())
    # /var/run is the system's link to /run.
    defaults = [config.BY_KEY[k].default.replace("/var/run/", "/run/") for k in ("kubelet_dir", "cdi_dir")]
    assert allowed == defaults
    blocks = re.split(r"\n\n", config.default_file())
    for key in config.WRITTEN_DIRS:
        (block,) = [b for b in blocks if re.search(rf"^#{key} = ", b, re.M)]
        assert config.UNIT_DROP_IN_NOTE in block, key
    dropped_in = unit_values("ReadWritePaths", hosts_block("dra-drop-in") + hosts_block("write-drop-in"))
    for key in config.WRITTEN_DIRS:
        path = config.BY_KEY[key].default or config.UNSET_EXAMPLES[key]
        assert path.replace("/var/run/", "/run/") in allowed + dropped_in, key
    with open(os.path.join(ROOT, "docs", "hosts.md")) as f:
        section = f.read().split("## What the unit lets the agent write", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{key}`" in section for key in config.WRITTEN_DIRS)


def test_the_metrics_drop_in_says_it_keeps_a_remote_prometheus_out() -> None:
    """The metrics drop-in's IPAddressAllow=localhost kept a Prometheus on another machine out
    without saying so (issue 50: 8): the drop-in, its comment, the guide's text and the unit's
    comment say it."""
    drop_in = hosts_block("metrics-drop-in")
    assert unit_values("IPAddressAllow", drop_in) == ["localhost"]
    assert unit_values("RestrictAddressFamilies", drop_in) == ["AF_UNIX", "AF_INET", "AF_INET6"]
    assert "another machine" in "".join(line for line in drop_in.splitlines() if line.startswith("#"))
    with open(UNIT_FILE) as f:
        unit = f.read()
    assert unit_values("IPAddressDeny", unit) == ["any"] and unit_values("PrivateNetwork", unit) == ["yes"]
    network = unit.split("# Network:", 1)[1].split("\n\n", 1)[0]
    assert "IPAddressAllow=localhost" in network and "another machine" in network
    with open(os.path.join(ROOT, "docs", "hosts.md")) as f:
        prose = " ".join(f.read().split("<!-- metrics-drop-in -->", 1)[0].rstrip().rsplit("\n\n", 1)[-1].split())
    assert "**a Prometheus on another machine cannot**" in prose
