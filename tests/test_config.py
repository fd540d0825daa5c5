"""Settings: precedence, leniency kept for the original's environment variables, and every
bad-input path exiting 2 with one line that names the setting and the value."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from hyperlight_agent import cli, config, modes, parts
from hyperlight_agent.host import journal
from tests.conftest import run_agent

# Where the default file would be: never the host's real /etc path, which exists on a node where
# the package is installed.
MISSING_DEFAULT = os.path.join(tempfile.gettempdir(), f"hl-no-such-dir-{os.getpid()}", "agent.toml")


def load(argv: list[str], env: dict[str, str]) -> config.Settings:
    return config.load(cli.build_parser().parse_args(argv), env, default_file_path=MISSING_DEFAULT)


# What an eviction debounce its checks cannot fill is refused with (config.load).
EVICT_REFUSAL = "dra_evict_after_seconds = 30 with check_interval_seconds = 300: "


def write(tmp: str, text: str) -> str:
    path = os.path.join(tmp, "agent.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def test_defaults_match_the_documented_table(tmp: str) -> None:
    s = load(["--config", write(tmp, "")], {})
    assert (s.device_count, s.device_uid, s.device_gid) == (2000, 65534, 65534)
    assert s.host_device_dir is None
    assert (s.device_dir, s.cdi_dir) == ("/dev", "/var/run/cdi")
    assert s.kubelet_dir == "/var/lib/kubelet/device-plugins"
    assert (s.check_interval_seconds, s.allocation, s.log_level) == (30, "both", "info")


def test_flag_beats_env_beats_file_beats_default(tmp: str) -> None:
    path = write(tmp, "device_count = 10\ndevice_uid = 11\ndevice_gid = 12\n")
    s = load(["--config", path, "--device-count", "30"], {"DEVICE_COUNT": "20", "DEVICE_UID": "21"})
    assert (s.device_count, s.device_uid, s.device_gid) == (30, 21, 12)
    assert s.config_file == path


def test_config_file_from_environment(tmp: str) -> None:
    path = write(tmp, 'allocation = "both"\n')
    assert load([], {"HYPERLIGHT_CONFIG": path}).allocation == "both"


def test_every_setting_is_one_field_of_settings_and_one_row_of_the_table() -> None:
    """The table (SETTINGS) and the dataclass name the same settings: a setting added to one and
    not the other would be neither parsed nor documented, or parsed into nothing."""
    kept = {f.name for f in dataclasses.fields(config.Settings)} - {"config_file", "sources", "ignored"}
    assert kept == set(config.BY_KEY)


def test_missing_default_file_is_fine() -> None:
    # A missing default file is no error: the agent starts on defaults.
    assert not os.path.exists(MISSING_DEFAULT)
    assert load([], {}).config_file is None


@pytest.mark.parametrize("variable", ["DEVICE_COUNT", "DEVICE_UID", "DEVICE_GID"])
@pytest.mark.parametrize("value", ["abc", "-1", "4294967296", "1.5"])
def test_invalid_original_env_keeps_default_with_warning(
    variable: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    s = load([], {variable: value})
    key = variable.lower()
    assert getattr(s, key) == config.BY_KEY[key].default
    assert f"{variable}={value!r}" in caplog.text


def test_variables_that_are_ours_but_no_setting_are_accepted() -> None:
    """The workload variables CDI sets (`helm test` runs --check in a workload's container), the
    in-place upgrade's, the image's commit, and the kubelet's service links for a Service whose
    name starts with hyperlight- (not a setting, and not a typo)."""
    ours = {
        "HYPERLIGHT_HYPERVISOR": "kvm",
        "HYPERLIGHT_DEVICE_PATH": "/dev/kvm",
        "HYPERLIGHT_AGENT_PREDECESSOR": "1",
        "HYPERLIGHT_AGENT_COMMIT": "abc",
        "HYPERLIGHT_METRICS_SERVICE_HOST": "10.0.0.1",
        "HYPERLIGHT_METRICS_SERVICE_PORT": "9464",
        "HYPERLIGHT_METRICS_SERVICE_PORT_METRICS": "9464",
        "HYPERLIGHT_METRICS_PORT": "tcp://10.0.0.1:9464",
        "HYPERLIGHT_METRICS_PORT_9464_TCP": "tcp://10.0.0.1:9464",
        "HYPERLIGHT_METRICS_PORT_9464_TCP_PROTO": "tcp",
        "HYPERLIGHT_METRICS_PORT_9464_TCP_ADDR": "10.0.0.1",
    }
    assert load([], ours).device_count == 2000
    with pytest.raises(config.ConfigError, match="HYPERLIGHT_METRICS_ADRESS='x': unknown setting"):
        load([], {"HYPERLIGHT_METRICS_ADRESS": "x"})


def test_the_mode_is_a_setting_and_its_flags_are_short_for_it(tmp: str) -> None:
    assert load([], {}).mode == "plugin"
    assert load([], {"HYPERLIGHT_MODE": "dra"}).mode == "dra"
    assert load(["--config", write(tmp, 'mode = "device-access"\n')], {}).mode == "device-access"
    args = cli.build_parser().parse_args(["--device-access"])
    cli._mode_flags(args)
    assert config.load(args, {"HYPERLIGHT_MODE": "dra"}, default_file_path=MISSING_DEFAULT).mode == "device-access"


def test_uid_gid_are_unsigned_32_bit() -> None:
    s = load([], {"DEVICE_UID": "4294967295", "DEVICE_GID": "0"})
    assert (s.device_uid, s.device_gid) == (2**32 - 1, 0)


@pytest.mark.parametrize(
    ("argv", "env", "toml", "expected"),
    [
        (["--device-count", "0"], {}, "", "--device-count = '0'"),
        (["--device-count", "-5"], {}, "", "--device-count = '-5'"),
        (["--device-count", "100001"], {}, "", "--device-count = '100001'"),
        (["--device-uid", "x"], {}, "", "--device-uid = 'x'"),
        (["--allocation", "magic"], {}, "", "--allocation = 'magic'"),
        (["--check-interval", "0"], {}, "", "--check-interval = '0'"),
        (["--cdi-dir", "relative/dir"], {}, "", "--cdi-dir = 'relative/dir'"),
        (["--no-such-flag"], {}, "", "--no-such-flag"),
        ([], {"HYPERLIGHT_ALLOCATION": "nope"}, "", "HYPERLIGHT_ALLOCATION='nope'"),
        ([], {"HYPERLIGHT_CHECK_INTERVAL": "soon"}, "", "HYPERLIGHT_CHECK_INTERVAL='soon'"),
        ([], {"HYPERLIGHT_KUBELET_DIR": "kubelet"}, "", "HYPERLIGHT_KUBELET_DIR='kubelet'"),
        # The prefixed names of the original's variables: invalid is an error, as for every
        # HYPERLIGHT_* name; the two names of one setting must agree (issue 50: 5).
        ([], {"HYPERLIGHT_DEVICE_COUNT": "100001"}, "", "HYPERLIGHT_DEVICE_COUNT='100001': must be an integer"),
        ([], {"HYPERLIGHT_DEVICE_UID": "x"}, "", "HYPERLIGHT_DEVICE_UID='x': must be"),
        ([], {"HYPERLIGHT_HOST_DEVICE_DIR": "dev"}, "", "HYPERLIGHT_HOST_DEVICE_DIR='dev': must be"),
        ([], {"HYPERLIGHT_NODE_NAME": "Node_1"}, "", "HYPERLIGHT_NODE_NAME='Node_1': must be"),
        ([], {"NODE_NAME": "Node_1"}, "", "NODE_NAME='Node_1': must be"),
        (
            [],
            {"DEVICE_COUNT": "8", "HYPERLIGHT_DEVICE_COUNT": "7"},
            "",
            "DEVICE_COUNT='8' and HYPERLIGHT_DEVICE_COUNT='7': two names of device_count with different values",
        ),
        ([], {"DEVICE_COUNT": "0", "HYPERLIGHT_DEVICE_COUNT": "0"}, "", "HYPERLIGHT_DEVICE_COUNT='0': must"),
        ([], {}, "device_count = 0\n", "device_count in"),
        ([], {}, 'device_count = "5"\n', "device_count in"),
        ([], {}, "device_count = true\n", "device_count in"),
        ([], {}, 'check_interval_seconds = "30"\n', "check_interval_seconds in"),
        ([], {}, "device_cont = 5\n", "unknown setting 'device_cont' (did you mean device_count?)"),
        # A typo in the environment is refused like one in TOML (issue 36: 4), with the near name.
        (
            [],
            {"HYPERLIGHT_DEVCE_COUNT": "5"},
            "",
            "HYPERLIGHT_DEVCE_COUNT='5': unknown setting (did you mean HYPERLIGHT_DEVICE_COUNT?)",
        ),
        ([], {"HYPERLIGHT_CHECK_INTERVAL_S": "5"}, "", "(did you mean HYPERLIGHT_CHECK_INTERVAL?)"),
        (["--devce-count", "5"], {}, "", "unrecognized arguments: --devce-count 5 (did you mean --device-count?)"),
        ([], {}, "device_count = \n", "invalid TOML"),
        # Caught before anything starts (they used to fail after startup, or with a traceback):
        (["--metrics-address", "not a host:9464"], {}, "", "--metrics-address = 'not a host:9464'"),
        (["--metrics-address", "127.0.0.1:99999"], {}, "", "--metrics-address = '127.0.0.1:99999'"),
        # The valid range is named (issue 50: 9).
        (["--metrics-address", "0.0.0.0:70000"], {}, "", "'0.0.0.0:70000': the port must be from 1 to 65535"),
        ([], {"HYPERLIGHT_PROBE_ADDRESS": "[::]:0"}, "", "'[::]:0': the port must be from 1 to 65535"),
        (["--kubelet-dir", "/" + "k" * 90], {}, "", "kubelet_dir = '/kkk"),
        ([], {"WATCHDOG_USEC": "3\u00b2"}, "", "WATCHDOG_USEC='3\u00b2'"),
        ([], {"HYPERLIGHT_CHECK_INTERVAL": "\u0661\u0660"}, "", "HYPERLIGHT_CHECK_INTERVAL="),
        (["--device-count", "\u0663"], {}, "", "--device-count = '\u0663'"),
        ([], {}, "device_count = " + "1" * 5000 + "\n", "invalid TOML"),
        ([], {}, "a = " + "[" * 5000 + "]" * 5000 + "\n", "invalid TOML: nested too deeply"),
        (["--device-uid", "1" * 5000], {}, "", "characters): must be"),
        # An eviction debounce its checks cannot fill (issue 47, 2), from each source and mixed.
        (["--check-interval", "300", "--dra-evict-after", "30"], {}, "", EVICT_REFUSAL),
        ([], {"HYPERLIGHT_CHECK_INTERVAL": "300", "HYPERLIGHT_DRA_EVICT_AFTER": "30"}, "", EVICT_REFUSAL),
        ([], {}, "check_interval_seconds = 300\ndra_evict_after_seconds = 30\n", EVICT_REFUSAL),
        (["--dra-evict-after", "30"], {}, "check_interval_seconds = 300\n", EVICT_REFUSAL),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp: str, argv: list[str], env: dict[str, str], toml: str, expected: str
) -> None:
    cdi_dir = os.path.join(tmp, "cdi")
    full_env = {**os.environ, **env, "HYPERLIGHT_CDI_DIR": cdi_dir}
    result = subprocess.run(
        [sys.executable, "-m", "hyperlight_agent", "--config", write(tmp, toml), *argv],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hyperlight-agent: error: ")
    assert expected in lines[0]
    assert not os.path.exists(cdi_dir), "nothing may be written before the settings are valid"


def test_explicit_missing_config_file_exits_2(tmp: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hyperlight_agent", "--config", os.path.join(tmp, "nope.toml")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "nope.toml: does not exist" in result.stderr


def test_unreadable_config_file_exits_2(tmp: str) -> None:
    path = os.path.join(tmp, "dir.toml")
    os.mkdir(path)  # reading a directory fails even as root
    result = subprocess.run(
        [sys.executable, "-m", "hyperlight_agent", "--config", path],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("hyperlight-agent: error: config file ") and "dir.toml: not a regular file" in line


def test_config_file_that_is_not_utf8_exits_2(tmp: str) -> None:
    path = os.path.join(tmp, "latin1.toml")
    with open(path, "wb") as f:
        f.write(b"# caf\xe9\ndevice_count = 3\n")
    result = subprocess.run(
        [sys.executable, "-m", "hyperlight_agent", "--config", path],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "latin1.toml: invalid TOML" in result.stderr


@pytest.mark.parametrize(
    ("argv", "toml", "expected"),
    [
        # Found by tests/test_fuzz.py: a float() overflow escaped as a traceback...
        ([], "check_interval_seconds = 1" + "0" * 400 + "\n", "check_interval_seconds in"),
        # ...and arguments, the config file's own path and kubelet_dir were echoed raw and whole.
        (["x\x1ey" * 1000], "", "unrecognized arguments: x\\x1ey"),
        (["--kubelet-dir", "/" + "k" * 4000], "", "kubelet_dir = '/kkk"),
        (["--config", "PATH\nwith a newline" + "n" * 4000], "", "\\nwith a newline"),
    ],
)
def test_every_error_is_one_bounded_line(tmp: str, argv: list[str], toml: str, expected: str) -> None:
    path = write(tmp, toml)
    argv = [a.replace("PATH", path) for a in argv]
    with pytest.raises(config.ConfigError) as info:
        load(["--config", path, *argv], {})
    message = str(info.value)
    assert expected in message and len(message) <= 400 and message.splitlines() == [message], message


# Issue 26, 20: a DRA directory too long for our sockets is a configuration error naming it, held
# to the names dra/registration.py gives.
@pytest.mark.parametrize("key", ["dra_registry_dir", "dra_plugins_dir"])
def test_a_dra_directory_too_long_for_our_sockets_is_refused_by_name(key: str) -> None:
    from hyperlight_agent import contracts
    from hyperlight_agent.dra import names, registration

    below = "" if key == "dra_registry_dir" else "/" + contracts.DRA_DRIVER
    shortest = {k: n for k, _, n in parts.row(modes.DRA).shortest_names}[key]
    room = contracts.UNIX_PATH_MAX - 1 - shortest - len(below)
    longest = "/" + "d" * (room - 1)
    flag = "--" + key.replace("_", "-")
    settings = load(["--config", "/dev/null", flag, longest, "--instance", "x" * 20], {})
    # At the limit the registrar still finds names that fit, private names included.
    registrar = registration.DriverServers(
        object(), contracts.DRA_DRIVER, settings.instance or "", settings.dra_registry_dir, settings.dra_plugins_dir
    )
    for path in (registrar.registration_socket, registrar.service_socket):
        private = os.path.join(os.path.dirname(path), f"{names.PRIVATE_PREFIX}{contracts.PID_MAX}.{'0' * 8}")
        assert len(os.fsencode(path)) <= contracts.UNIX_PATH_MAX and len(private) <= contracts.UNIX_PATH_MAX
    with pytest.raises(config.ConfigError, match=f"^{key} = '/ddd.*: socket paths in it would be at least 108 bytes"):
        load(["--config", "/dev/null", flag, longest + "d"], {})
    done = run_agent(
        "--dra",
        flag,
        longest + "d",
        "--health-check",
        "readiness",
    )
    assert done.returncode == 2 and done.stderr.startswith(f"hyperlight-agent: error: {key} = "), done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_legacy_variable_is_ignored_in_one_line_saying_what_is_used_and_what_will_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The original plugin's variables keep their leniency, said in one line (issue 31: 7)."""
    caplog.set_level(logging.WARNING, "hyperlight_agent")
    settings = load([], {"DEVICE_COUNT": "lots"})
    assert settings.device_count == 2000
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "ignoring DEVICE_COUNT='lots' (must be an integer from 1 to 100000); using the default 2000 "
        "instead; a later release will refuse it and not start"
    )


def test_a_listen_address_without_a_host_is_every_address() -> None:
    """`:9464` as Go and Prometheus read it (issue 50: 9): every address of the host."""
    s = load(["--metrics-address", ":9464"], {"HYPERLIGHT_PROBE_ADDRESS": ":8081"})
    assert (s.metrics_address, s.probe_address) == (":9464", ":8081")
    with pytest.raises(config.ConfigError, match="port must be from 1 to 65535"):
        load(["--metrics-address", ":65536"], {})
    with pytest.raises(config.ConfigError, match="must be HOST:PORT or :PORT"):
        load(["--metrics-address", "9464"], {})


def test_every_setting_has_a_prefixed_name_beside_the_originals(tmp: str) -> None:
    """`HYPERLIGHT_DEVICE_COUNT` was refused as unknown (issue 50: 5): each of the five unprefixed
    names has its HYPERLIGHT_* twin; both set and equal is fine."""
    unprefixed = [s for s in config.SETTINGS if not s.env.startswith(config.ENV_PREFIX)]
    assert {s.env for s in unprefixed} == {"DEVICE_COUNT", "DEVICE_UID", "DEVICE_GID", "HOST_DEVICE_DIR", "NODE_NAME"}
    given = {
        "HYPERLIGHT_DEVICE_COUNT": "7",
        "HYPERLIGHT_DEVICE_UID": "1000",
        "HYPERLIGHT_DEVICE_GID": "1001",
        "HYPERLIGHT_HOST_DEVICE_DIR": "/host-dev",
        "HYPERLIGHT_NODE_NAME": "node-1",
    }
    s = load([], given)
    assert (s.device_count, s.device_uid, s.device_gid, s.host_device_dir, s.node_name) == (
        7,
        1000,
        1001,
        "/host-dev",
        "node-1",
    )
    assert dict(s.sources)["device_count"] == "environment HYPERLIGHT_DEVICE_COUNT"
    assert load([], {"DEVICE_COUNT": "7", "HYPERLIGHT_DEVICE_COUNT": "7"}).device_count == 7
    # A flag and the file beat either name, as for every setting.
    assert load(["--device-count", "9"], given).device_count == 9
    assert load(["--config", write(tmp, "device_count = 11\n")], {"DEVICE_UID": "5"}).device_count == 11


def test_an_invalid_original_variable_is_ignored_for_the_files_value_and_said_as_ignored(tmp: str) -> None:
    """The one lenient path: the unprefixed original name; the next source applies (the file's
    value, else the default), and the settings say it was ignored (for --check and --print-config)."""
    s = load(["--config", write(tmp, "device_count = 11\n")], {"DEVICE_COUNT": "100001"})
    assert s.device_count == 11 and dict(s.sources)["device_count"] == "file"
    assert s.ignored == (
        "DEVICE_COUNT='100001' (must be an integer from 1 to 100000); using the config file's value instead",
    )
    assert load([], {"DEVICE_UID": "x"}).ignored and not load([], {}).ignored


def test_print_config_says_every_setting_its_value_and_where_it_came_from(tmp: str) -> None:
    """--print-config (issue 50: 7): a TOML line per setting with its source; exit 0, or 2 on an
    invalid configuration as the agent; the lines read back as a file give the same settings."""
    path = write(tmp, 'allocation = "cdi"\n')
    done = run_agent(
        "--config",
        path,
        "--device-uid",
        "7",
        "--print-config",
        env={"HYPERLIGHT_CHECK_INTERVAL": "5", "DEVICE_COUNT": "100001"},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"# config file: {path}"
    assert "device_uid = 7  # flag --device-uid" in lines
    assert "check_interval_seconds = 5.0  # environment HYPERLIGHT_CHECK_INTERVAL" in lines
    assert f'allocation = "cdi"  # file {path}' in lines
    assert "device_count = 2000  # default" in lines
    assert "#metrics_address = unset  # default" in lines
    assert lines[-1].startswith("# ignored: DEVICE_COUNT='100001'")
    keys = [line.split(" ", 1)[0].lstrip("#") for line in lines if not line.startswith("# ")]
    assert keys == [s.key for s in config.SETTINGS]
    again = load(["--config", write(tmp, done.stdout)], {})
    assert again == load(["--config", path, "--device-uid", "7"], {"HYPERLIGHT_CHECK_INTERVAL": "5"})
    bad = run_agent("--config", path, "--print-config", env={"HYPERLIGHT_DEVICE_COUNT": "0"})
    assert bad.returncode == 2 and bad.stderr.startswith("hyperlight-agent: error: HYPERLIGHT_DEVICE_COUNT='0'")
    assert bad.stdout == ""


def test_the_agent_logs_its_configuration_at_debug_on_start(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same lines as --print-config, at log_level debug, before it serves (issue 50: 7)."""
    said: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record)

    async def serve(*args: object) -> None:
        """Stands in for serving: what was logged by then is what matters."""

    setup = journal.setup

    def setup_and_keep(*args: Any, **kw: Any) -> str:
        kind: str = setup(*args, **kw)
        logging.getLogger().addHandler(Keep())  # setup() replaced the root logger's handlers
        return kind

    monkeypatch.setattr(cli, "_serve", serve)
    monkeypatch.setattr(journal, "setup", setup_and_keep)
    try:
        argv = ["--config", "/dev/null", "--log-level", "debug", "--cdi-dir", f"{tmp}/cdi"]
        assert cli.main(argv, {}) == 0
        logged = [r.getMessage() for r in said if r.getMessage().startswith("config: ")]
        assert logged == [f"config: {line}" for line in config.effective(load(argv, {}))]
        assert all(r.levelno == logging.DEBUG for r in said if r.getMessage().startswith("config: "))
        said.clear()
        assert cli.main(argv[:2] + argv[4:], {}) == 0  # at info: not said
        assert not [r for r in said if r.getMessage().startswith("config: ")]
    finally:
        setup("info", {})
