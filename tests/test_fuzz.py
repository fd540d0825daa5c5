"""Property-based fuzzing of every pure input surface: settings (flags, environment, TOML file),
device IDs and Allocate, CDI spec inspection and repair, the probe helper's request parser.

Fixed seeds (the conftest profile derandomizes) and bounded budgets, scaled up by
HYPERLIGHT_FUZZ_SCALE. Most examples carry a batch of inputs; each input is counted in the
session summary ("fuzzed inputs").
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any, Callable, NoReturn, Optional

import grpc
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hyperlight_agent import cli, config, contracts
from hyperlight_agent.device import helper_process
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.deviceplugin.servicer import DevicePluginServicer, Profile, device_ids
from hyperlight_agent.dra import names
from hyperlight_agent.files import cdi
from tests.conftest import count_inputs, fuzz_budget, read_bytes

# A settings error is one line, names the setting, and quotes the value briefly.
MAX_ERROR_CHARS = 400
# A refused RPC's details: quoted IDs are cut at 40 characters, escapes can make those longer.
MAX_DETAILS_CHARS = 500


# Characters that break parsers and log lines, spliced in by text mutations.
SPICE = (
    "\n",
    "\r",
    "\0",
    "\x1e",
    "\x85",
    "\u2028",
    "-",
    "0",
    "9",
    "\u0663",
    "\u00b2",
    "\U000e0041",
    " ",
    "kvm",
    "/",
    "..",
    "=",
    "'",
    '"',
    "\\",
    "{",
    "[",
    "1" * 70,
)


def mutate_text(rng: random.Random, text: str) -> str:
    """One random edit of text: splice in a SPICE string, delete, duplicate or cut a span."""
    i = rng.randrange(len(text) + 1)
    j = min(len(text), i + rng.randrange(1, 8))
    kind = rng.randrange(5)
    if kind == 0:
        return text[:i] + rng.choice(SPICE) + text[i:]
    if kind == 1:
        return text[:i] + text[j:]
    if kind == 2:
        return text[:j] + text[i:j] * rng.randrange(2, 50) + text[j:]
    if kind == 3:
        return text[:i]
    return text[:i] + chr(rng.choice([rng.randrange(32, 127), rng.randrange(0, 0x110000)]) % 0xD800) + text[j:]


def variants(seed: int, text: str, n: int) -> list[str]:
    """text and n mutants of it (1–3 edits each), reproducible from seed."""
    rng = random.Random(seed)
    out = [text]
    for _ in range(n):
        mutant = text
        for _ in range(rng.randrange(1, 4)):
            mutant = mutate_text(rng, mutant)
        out.append(mutant)
    return out


SEEDS = st.integers(0, 2**32 - 1)


def one_line(message: str, limit: int) -> None:
    assert message, "an empty error message"
    assert len(message) <= limit, f"{len(message)} characters: {message[:200]!r}…"
    assert message.splitlines() == [message], f"not one line: {message!r}"


# --- settings -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch() -> Iterator[str]:
    """A module-wide temp dir on tmpfs where there is one (fsync is cheap there)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="hl-fuzz-", dir=base)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def missing_default(scratch: str) -> str:
    return os.path.join(scratch, "no-such-dir", "agent.toml")


SMALL_INTS = st.one_of(st.integers(-3, 3), st.integers(0, 200_000), st.integers(2**32 - 3, 2**32 + 3))
BIG_INTS = st.one_of(
    st.integers(), st.integers(-(10**40), 10**40), st.integers(0, 4000).map(lambda n: int("9" * n) if n else 0)
)
NUMBER_TEXT = st.one_of(
    SMALL_INTS.map(str),
    BIG_INTS.map(str),
    st.floats().map(repr),
    st.from_regex(r"\s?[+-]?[0-9\u0660-\u0669\u00b2]{0,25}(\.[0-9]*)?([eE][+-]?[0-9]{1,4})?\s?", fullmatch=True),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "0x10", "1_000", "0.1", "86400", "86400.0001", "0.09999"]),
    st.integers(0, 6000).map(lambda n: "1" * n),
)
PATH_TEXT = st.one_of(
    st.text(max_size=40).map(lambda t: "/" + t),
    st.text(max_size=40),
    st.from_regex(r"(/[a-z.]{0,6}){1,6}/?", fullmatch=True),
    st.integers(0, 5000).map(lambda n: "/" + "d" * n),
    st.sampled_from(["/", "//x", "/a/../b", "/a\0b", "/a\nb", "relative", "", " /x"]),
)
WORD_TEXT = st.one_of(
    st.sampled_from([*config.ALLOCATION_MODES, *config.LOG_LEVELS, "BOTH", "Debug", "cdi ", "", "none"]),
    st.text(max_size=12),
)
ADDRESS_TEXT = st.one_of(
    st.builds(
        lambda h, p: f"{h}:{p}",
        st.sampled_from(["127.0.0.1", "[::1]", "::1", "localhost", "a.b", "-x", "[zz]", "", "a" * 70]),
        st.one_of(st.integers(-1, 70_000).map(str), st.text(max_size=6)),
    ),
    st.text(max_size=30),
)
ANY_TEXT = st.one_of(st.text(max_size=80), st.integers(0, 20_000).map(lambda n: "x\n" * n))
BY_KIND = {
    "device_count": NUMBER_TEXT,
    "device_uid": NUMBER_TEXT,
    "device_gid": NUMBER_TEXT,
    "check_interval_seconds": NUMBER_TEXT,
    "allocation": WORD_TEXT,
    "log_level": WORD_TEXT,
    "metrics_address": ADDRESS_TEXT,
}


def setting_text(key: str) -> st.SearchStrategy[str]:
    return st.one_of(BY_KIND.get(key, PATH_TEXT), ANY_TEXT)


# Settings checked after all are read (a directory's room for our socket names): their errors name
# the setting, whichever source gave it.
CHECKED_TOGETHER = ("kubelet_dir", "dra_registry_dir", "dra_plugins_dir")


def assert_in_range(s: config.Settings) -> None:
    """Every value within the range its setting documents."""
    assert type(s.device_count) is int and 1 <= s.device_count <= config.MAX_DEVICE_COUNT
    for n in (s.device_uid, s.device_gid):
        assert type(n) is int and 0 <= n <= config.UINT32_MAX
    for key in ("host_device_dir", "device_dir", "kubelet_dir", "cdi_dir", "nfd_features_dir"):
        path = getattr(s, key)
        if path is None and config.BY_KEY[key].default is None:
            continue
        assert isinstance(path, str) and path.startswith("/") and "\0" not in path, (key, path)
        assert path == os.path.normpath(path)
        assert len(path.encode("utf-8", "surrogateescape")) <= config.PATH_MAX
    socket_bytes = len(s.kubelet_dir.encode("utf-8", "surrogateescape")) + 1 + config.longest_socket_name(s.instance)
    assert socket_bytes <= contracts.UNIX_PATH_MAX
    for key, below, shortest in names.SHORTEST_NAMES:
        directory = os.path.join(getattr(s, key), below) if below else getattr(s, key)
        assert len(directory.encode("utf-8", "surrogateescape")) + 1 + shortest <= contracts.UNIX_PATH_MAX
    assert isinstance(s.check_interval_seconds, (int, float)) and math.isfinite(s.check_interval_seconds)
    assert 0.1 <= s.check_interval_seconds <= 86400
    assert s.allocation in config.ALLOCATION_MODES and s.log_level in config.LOG_LEVELS
    if s.metrics_address is not None:
        host, _, port = s.metrics_address.rpartition(":")
        assert host and 0 < int(port) < 65536


def names_one_of(message: str, names: set[str]) -> None:
    assert any(name in message for name in names), f"names none of {sorted(names)}: {message!r}"


def all_names(keys: Any) -> set[str]:
    return {n for k in keys for n in (config.BY_KEY[k].flag, config.BY_KEY[k].env, k)}


SETTING_VALUES = st.dictionaries(st.sampled_from([s.key for s in config.SETTINGS]), st.just(None), max_size=5).flatmap(
    lambda d: st.fixed_dictionaries({k: setting_text(k) for k in d})
)


def mutated(seed: int, values: dict[str, str], n: int) -> list[dict[str, str]]:
    """values, then n copies with every value mutated (see variants)."""
    each = {key: variants(seed + i, value, n) for i, (key, value) in enumerate(values.items())}
    return [{key: each[key][k] for key in values} for k in range(n + 1)]


@settings(max_examples=fuzz_budget(400))
@given(
    seed=SEEDS,
    values=SETTING_VALUES,
    equals=st.booleans(),
    extra=st.lists(
        st.one_of(
            st.text(max_size=30).filter(lambda t: not t.startswith("-")),
            st.sampled_from(["--no-such-flag", "-x", "--device-count", "--", "-", "--device-count=", "--config"]),
        ),
        max_size=2,
    ),
)
def test_fuzz_flags_give_settings_in_range_or_one_line_naming_the_flag(
    scratch: str, seed: int, values: dict[str, str], equals: bool, extra: list[str]
) -> None:
    for each in mutated(seed, values, 5):
        check_flags(scratch, each, equals, extra)


def check_flags(scratch: str, values: dict[str, str], equals: bool, extra: list[str]) -> None:
    count_inputs("settings: flags")
    argv = []
    for key, value in values.items():
        flag = config.BY_KEY[key].flag
        argv += [f"{flag}={value}"] if equals or value.startswith("-") else [flag, value]
    argv += extra
    try:
        s = config.load(cli.build_parser().parse_args(argv), {}, default_file_path=missing_default(scratch))
    except config.ConfigError as exc:
        one_line(str(exc), MAX_ERROR_CHARS)
        # argparse's own errors name the offending argument; ours name the setting.
        if "unrecognized arguments" not in str(exc):  # argparse's: it names the argument itself
            names_one_of(str(exc), all_names(config.BY_KEY) | {"--config", "config file"})
    else:
        assert_in_range(s)
        for key, value in values.items():
            if not any(e.startswith("-") for e in extra):  # a later flag would win
                assert getattr(s, key) == config.BY_KEY[key].parse(value), "the flag's value is the one used"


ENV_VALUES = st.dictionaries(st.sampled_from([s.key for s in config.SETTINGS]), st.just(None), max_size=5).flatmap(
    lambda d: st.fixed_dictionaries({k: setting_text(k).filter(lambda v: "\0" not in v) for k in d})
)


@settings(max_examples=fuzz_budget(400))
@given(seed=SEEDS, values=ENV_VALUES)
def test_fuzz_environment_gives_settings_in_range_or_one_line_naming_the_variable(
    scratch: str, seed: int, values: dict[str, str]
) -> None:
    for each in mutated(seed, values, 5):
        check_environment(scratch, {k: v.replace("\0", "") for k, v in each.items()})


def check_environment(scratch: str, values: dict[str, str]) -> None:
    count_inputs("settings: environment")
    environ = {config.BY_KEY[k].env: v for k, v in values.items()}
    try:
        s = config.load(cli.build_parser().parse_args([]), environ, default_file_path=missing_default(scratch))
    except config.ConfigError as exc:
        one_line(str(exc), MAX_ERROR_CHARS)
        names_one_of(str(exc), {config.BY_KEY[k].env for k in values} | set(CHECKED_TOGETHER))
        return
    assert_in_range(s)
    for key, value in values.items():
        setting = config.BY_KEY[key]
        if value != "" and not setting.lenient_env:
            assert getattr(s, key) == setting.parse(value)


def toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid TOML basic string (escapes included)


TOML_VALUE = st.one_of(
    SMALL_INTS.map(str),
    BIG_INTS.map(str),
    NUMBER_TEXT.map(toml_string),
    PATH_TEXT.map(toml_string),
    WORD_TEXT.map(toml_string),
    ADDRESS_TEXT.map(toml_string),
    st.floats().map(lambda f: "nan" if math.isnan(f) else ("inf" if f > 0 else "-inf") if math.isinf(f) else repr(f)),
    st.sampled_from(
        [
            "true",
            "false",
            "[]",
            "{}",
            "1979-05-27T07:32:00Z",
            "07:32:00",
            "0x7f",
            "0o17",
            "1e400",
            "'literal'",
            "'''multi\nline'''",
            '"\\ud800"',
            "[1, [2, [3]]]",
            "{a = 1}",
            "inf",
            "-nan",
        ]
    ),
    st.integers(0, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(0, 3000).map(lambda n: "{a=" * n + "1" + "}" * n),
)
TOML_LINE = st.one_of(
    st.builds(lambda k, v: f"{k} = {v}", st.sampled_from([s.key for s in config.SETTINGS]), TOML_VALUE),
    st.builds(lambda k, v: f"{k} = {v}", st.text(max_size=10), TOML_VALUE),
    st.sampled_from(["[table]", "[[array]]", "# comment", "", "device_count", "= 3", "a.b.c = 1"]),
)


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, byte) edits: 0 flip a bit, 1 insert, 2 delete, 3 truncate."""
    out = bytearray(data)
    for kind, position, value in edits:
        if not out and kind != 1:
            continue
        i = position % (len(out) + (kind == 1))
        if kind == 0:
            out[i] ^= 1 << (value % 8)
        elif kind == 1:
            out.insert(i, value)
        elif kind == 2:
            del out[i]
        else:
            del out[i:]
    return bytes(out)


EDITS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6)
TOML_BYTES = st.one_of(
    st.lists(TOML_LINE, max_size=8).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass")),
    st.builds(
        mutate, st.lists(TOML_LINE, max_size=6).map(lambda ls: "\n".join(ls).encode("utf-8", "surrogatepass")), EDITS
    ),
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"check_interval_seconds = 1" + b"0" * 400,
            b"device_count = 3 # \xff\n",
            b"\xef\xbb\xbfdevice_count = 3\n",
            b"device_count = 3\0\n",
            b"a = " + b"[" * 5000 + b"]" * 5000,
            b"device_count = " + b"7" * 5000,
        ]
    ),
)


@settings(max_examples=fuzz_budget(700))
@given(seed=SEEDS, data=TOML_BYTES)
def test_fuzz_toml_file_gives_settings_in_range_or_one_line_naming_the_key(
    scratch: str, seed: int, data: bytes
) -> None:
    rng = random.Random(seed)
    for k in range(8):
        edits = [(rng.randrange(4), rng.randrange(1 << 20), rng.randrange(256)) for _ in range(rng.randrange(1, 4))]
        check_toml(scratch, mutate(data, edits) if k else data)


def check_toml(scratch: str, data: bytes) -> None:
    count_inputs("settings: TOML file")
    path = os.path.join(scratch, "agent.toml")
    with open(path, "wb") as f:
        f.write(data)
    try:
        s = config.load(
            cli.build_parser().parse_args(["--config", path]), {}, default_file_path=missing_default(scratch)
        )
    except config.ConfigError as exc:
        one_line(str(exc), MAX_ERROR_CHARS)
        message = str(exc)
        assert (
            message.startswith(f"config file {path}: ")
            or any(message.startswith(f"{key} in {path} = ") for key in config.BY_KEY)
            or message.startswith(tuple(f"{key} = " for key in CHECKED_TOGETHER))
        ), message
        return
    assert_in_range(s)
    assert s.config_file == path


CONFIG_NAMES = st.one_of(
    st.text(max_size=30).map(lambda t: t.replace("/", "_")),
    st.integers(0, 5000).map(lambda n: "n" * n),
    st.sampled_from(["a\nb", "x\r", "\x85", ""]),
)


@settings(max_examples=fuzz_budget(200))
@given(name=CONFIG_NAMES, kind=st.sampled_from(["missing", "file", "dir", "fifo"]), via_env=st.booleans())
def test_fuzz_config_file_paths_give_one_line(scratch: str, name: str, kind: str, via_env: bool) -> None:
    """The file's own path is echoed in errors: newlines and length must not reach the line."""
    count_inputs("settings: config paths")
    directory = tempfile.mkdtemp(dir=scratch)
    path = os.path.join(directory, name) if name else directory + "/"
    try:
        try:
            if kind == "file":
                with open(path, "wb") as f:
                    f.write(b"device_count = 0\n")
            elif kind == "dir":
                os.mkdir(path)
            elif kind == "fifo":
                os.mkfifo(path)
        except (OSError, ValueError):
            pass  # e.g. a name too long for the filesystem, or with a NUL: it is simply missing
        argv, environ = ([], {config.CONFIG_ENV: path}) if via_env else (["--config", path], {})
        try:
            assert_in_range(
                config.load(cli.build_parser().parse_args(argv), environ, default_file_path=missing_default(scratch))
            )
        except config.ConfigError as exc:
            one_line(str(exc), MAX_ERROR_CHARS)
            names_one_of(str(exc), {"config file", "device_count in"})
    finally:
        shutil.rmtree(directory, ignore_errors=True)


BAD_TOML_FOR_A_RUN = st.one_of(
    st.builds(
        lambda k, v: f"{k} = {v}\n".encode("utf-8", "surrogatepass"),
        st.sampled_from([s.key for s in config.SETTINGS]),
        TOML_VALUE,
    ),
    st.binary(max_size=60),
)


@settings(max_examples=fuzz_budget(6))
@given(data=BAD_TOML_FOR_A_RUN, flag=st.sampled_from([None, *config.SETTINGS]), value=ANY_TEXT)
def test_fuzz_bad_settings_stop_the_real_agent_with_exit_2_and_one_line(
    scratch: str, data: bytes, flag: Optional[config.Setting], value: str
) -> None:
    """The whole program: exit 2, one stderr line, and nothing written (the CDI dir stays absent)."""
    value = value.replace("\0", "")
    directory = tempfile.mkdtemp(dir=scratch)
    path = os.path.join(directory, "agent.toml")
    with open(path, "wb") as f:
        f.write(data)
    argv = [
        "--config",
        path,
        "--kubelet-dir",
        os.path.join(directory, "kubelet"),
        "--cdi-dir",
        os.path.join(directory, "cdi"),
        "--device-dir",
        os.path.join(directory, "dev"),
    ]
    if flag is not None and flag.key not in ("cdi_dir", "kubelet_dir", "device_dir"):
        argv.append(f"{flag.flag}={value}")
    try:
        try:
            config.load(cli.build_parser().parse_args(argv), {}, default_file_path=missing_default(scratch))
        except config.ConfigError:
            pass
        else:
            assume(False)  # only bad settings are worth a process
        count_inputs("settings: agent runs")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPERLIGHT_", "DEVICE_", "HOST_DEVICE"))}
        result = subprocess.run(
            [sys.executable, "-m", "hyperlight_agent", *argv], env=env, capture_output=True, timeout=60, check=False
        )
        stderr = result.stderr.decode("utf-8", "replace")
        assert result.returncode == 2, stderr
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("hyperlight-agent: error: "), stderr
        assert len(lines[0]) <= MAX_ERROR_CHARS + 30
        assert sorted(os.listdir(directory)) == ["agent.toml"], "nothing may be written"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --- device IDs and the DevicePlugin methods, in-process ----------------------------------------


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)

    def time_remaining(self) -> Optional[float]:
        return None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        callback(self)


class FixedChecker:
    """A checker whose every check returns the given observation at once."""

    def __init__(self, observation: Observation) -> None:
        self.observation = observation

    async def check(self, timeout: Optional[float] = None) -> Observation:
        return self.observation


def run_now(coro: Any) -> Any:
    """Run a coroutine that never really waits (fakes only), without an event loop's cost."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the coroutine waited")


SLOT_COUNTS = (1, 2, 3, 7, 2000, config.MAX_DEVICE_COUNT)
VALID_IDS = {n: set(device_ids("kvm", n)) for n in SLOT_COUNTS}
DEVICE_ID = st.one_of(
    st.integers(0, config.MAX_DEVICE_COUNT + 5).map(lambda n: f"kvm-{n}"),
    st.from_regex(r"(kvm|mshv|KVM|kv|[a-z]{0,4})-?[0-9\u0660\u00b2]{0,70}\s?", fullmatch=True),
    st.builds(lambda z, n: f"kvm-{'0' * z}{n}", st.integers(1, 3), st.integers(0, 9)),
    st.text(max_size=70),
    st.text(alphabet=st.characters(min_codepoint=0xE0000, max_codepoint=0xE007F), max_size=64),
    st.integers(0, 2000).map(lambda n: "kvm-" + "1" * n),
    st.sampled_from(["", "kvm-", "-0", "kvm-0\n", "kvm--1", "kvm-+1", "kvm-1_0", "kvm-0 ", " kvm-0", "kvm-1e3"]),
)


def servicer(
    slots: int, allocation: str = "both", healthy: bool = True, hypervisor: Optional[str] = "kvm"
) -> DevicePluginServicer:
    observation = Observation(healthy, "" if healthy else "fuzz says no", hypervisor)
    return DevicePluginServicer(
        Profile(contracts.RESOURCE_HYPERVISOR, "x.sock", slots, allocation),
        SharedObservation(),
        FixedChecker(observation),  # type: ignore[arg-type]
    )


@settings(max_examples=fuzz_budget(400))
@given(seed=SEEDS, slots=st.sampled_from(SLOT_COUNTS), ids=st.lists(DEVICE_ID, min_size=1, max_size=20))
def test_fuzz_device_ids_valid_accepted_anything_else_a_short_quoted_problem(
    seed: int, slots: int, ids: list[str]
) -> None:
    ids = [v for i, device_id in enumerate(ids) for v in variants(seed + i, device_id, 24)]
    count_inputs("device IDs", len(ids))
    s = servicer(slots)
    for device_id in ids:
        problem = s._id_problem(device_id, "kvm")
        if device_id in VALID_IDS[slots]:
            assert problem is None, (device_id, problem)
        else:
            assert problem is not None, f"{device_id!r} accepted with {slots} slots"
            assert problem.startswith(("malformed device ID ", "unknown device ID ")), problem
            # The ID's start is named (its escapes cut at twice the quote's length).
            assert repr(device_id[:40])[:80] in problem
            one_line(problem, MAX_DETAILS_CHARS)


CONTAINERS = st.lists(st.lists(DEVICE_ID, max_size=4), max_size=4)


@settings(max_examples=fuzz_budget(400))
@given(
    seed=SEEDS,
    slots=st.sampled_from(SLOT_COUNTS),
    batch=st.lists(CONTAINERS, min_size=1, max_size=6),
    allocation=st.sampled_from(config.ALLOCATION_MODES),
    healthy=st.booleans(),
)
def test_fuzz_allocate_answers_or_aborts_with_a_precise_code(
    seed: int, slots: int, batch: list[list[list[str]]], allocation: str, healthy: bool
) -> None:
    rng = random.Random(seed)
    batch += [[[mutate_text(rng, i) for i in ids] for ids in containers] for containers in batch for _ in range(4)]
    count_inputs("Allocate (in-process)", len(batch))
    s = servicer(slots, allocation, healthy)
    for containers in batch:
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
        )
        valid = (
            containers
            and all(containers)
            and sum(map(len, containers)) <= slots
            and all(i in VALID_IDS[slots] for ids in containers for i in ids)
        )
        refused: Optional[Aborted]
        try:
            response = run_now(s.Allocate(request, Context()))
        except Aborted as exc:
            refused = exc
        else:
            refused = None
        if refused is not None:
            one_line(refused.details, MAX_DETAILS_CHARS)
            if not containers or not healthy:
                assert refused.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE)
            else:
                assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and not valid, (containers, refused)
            continue
        assert healthy and valid, f"accepted {containers} with {slots} slots"
        assert len(response.container_responses) == len(containers)
        for answer in response.container_responses:
            assert bool(answer.cdi_devices) == (allocation != "device-spec")
            assert bool(answer.devices) == (allocation != "cdi")


PREFERRED = st.lists(
    st.tuples(
        st.lists(DEVICE_ID, max_size=6),
        st.lists(DEVICE_ID, max_size=3),
        st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 10),
    ),
    max_size=4,
)


@settings(max_examples=fuzz_budget(300))
@given(batch=st.lists(PREFERRED, min_size=1, max_size=4))
def test_fuzz_preferred_allocation_honours_must_include_and_the_size(
    batch: list[list[tuple[list[str], list[str], int]]],
) -> None:
    count_inputs("GetPreferredAllocation (in-process)", len(batch))
    s = servicer(4)
    for containers in batch:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=a, must_include_deviceIDs=m, allocation_size=n
                )
                for a, m, n in containers
            ]
        )
        response = run_now(s.GetPreferredAllocation(request, Context()))
        assert len(response.container_responses) == len(containers)
        for (available, must, size), answer in zip(containers, response.container_responses):
            chosen = list(answer.deviceIDs)
            assert len(chosen) == len(set(chosen)), "no ID twice"
            assert chosen[: len(set(must))] == list(dict.fromkeys(must))
            assert set(chosen) <= set(available) | set(must)
            assert len(chosen) <= max(size, len(set(must)))


@settings(max_examples=fuzz_budget(200))
@given(raw=st.lists(st.binary(max_size=64), min_size=1, max_size=20))
def test_fuzz_wire_bytes_parse_or_fail_cleanly_for_every_request_type(raw: list[bytes]) -> None:
    """What grpc's deserializers see: FromString either parses or raises DecodeError."""
    from google.protobuf.message import DecodeError

    from hyperlight_agent.deviceplugin import api

    count_inputs("request bytes (FromString)", len(raw) * len(api.DEVICE_PLUGIN_METHODS))
    for request_type, _, _ in api.DEVICE_PLUGIN_METHODS.values():
        for data in raw:
            with contextlib.suppress(DecodeError):
                request_type.FromString(data)


# --- the CDI spec: inspection and repair ------------------------------------------------------

SPEC = cdi.Spec("kvm", "/dev/kvm", 65534, 65534)
WANTED = SPEC.wanted(None)
NEAR_TEMP_NAMES = st.one_of(
    st.builds(
        lambda pid, hx, tail: f".hyperlight.json.hlagent-{pid}-{hx}{tail}",
        st.integers(0, 99999),
        st.from_regex(r"[0-9a-fA-Fz]{10,13}", fullmatch=True),
        st.sampled_from([".tmp", ".tmp~", "", ".TMP"]),
    ),
    st.sampled_from(
        [
            ".hyperlight.json.x.tmp",
            ".hyperlight.json.hlagent-1-zz.tmp",
            "hyperlight.json.tmp",
            ".hyperlight.json.hlagent--abcdefabcdef.tmp",
            ".hyperlight.json.hlagent-1-abcdefabcdef.tmp.x",
        ]
    ),
)
NEIGHBOUR_NAMES = st.one_of(
    NEAR_TEMP_NAMES,
    st.sampled_from(["vendor.json", "nvidia.yaml", "hyperlight.yaml", "Hyperlight.json", "hyperlight.json.bak", "sub"]),
    st.text(st.characters(codec="utf-8", exclude_characters="/\0"), min_size=1, max_size=20),
).filter(lambda n: n not in (".", "..", contracts.CDI_SPEC_FILE))
KINDS = ("missing", "regular", "regular", "regular", "symlink", "dir", "fifo", "socket", "null device", "hardlink")


def ours_temp(name: str) -> bool:
    """Exactly our temp pattern: <prefix>hlagent-<digits>-<12 lowercase hex><suffix>."""
    prefix, suffix = contracts.CDI_TEMP_PREFIX + "hlagent-", contracts.CDI_TEMP_SUFFIX
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return False
    pid, sep, token = name[len(prefix) : len(name) - len(suffix)].partition("-")
    return bool(
        sep and pid.isascii() and pid.isdigit() and len(token) == 12 and all(c in "0123456789abcdef" for c in token)
    )


def snapshot(directory: str) -> dict[str, Any]:
    """Everything observable about a directory's entries, recursively, without following links."""
    out: dict[str, Any] = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        st_ = os.lstat(path)
        entry: tuple[Any, ...] = (
            stat.S_IFMT(st_.st_mode),
            stat.S_IMODE(st_.st_mode),
            st_.st_uid,
            st_.st_gid,
            st_.st_ino,
            st_.st_mtime_ns,
        )
        if stat.S_ISLNK(st_.st_mode):
            entry += (os.readlink(path),)
        elif stat.S_ISREG(st_.st_mode):
            with open(path, "rb") as f:
                entry += (f.read(),)
        elif stat.S_ISDIR(st_.st_mode):
            entry += (snapshot(path),)
        out[name] = entry
    return out


SPEC_BYTES = st.one_of(
    st.binary(max_size=300),
    st.just(WANTED),
    st.builds(mutate, st.just(WANTED), EDITS),
    st.just(WANTED + b" "),
    st.just(WANTED[:-1]),
    st.integers(0, 200_000).map(lambda n: b"{" * n),
)
PLANT = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(KINDS),
        "data": SPEC_BYTES,
        "mode": st.integers(0, 0o7777),
        "owner": st.sampled_from([None, (1234, 1234), (0, 1234), (1234, 0)]),
        "link": st.sampled_from(
            ["vendor.json", "missing.json", "sub", "/etc/passwd", "canonical.json", "hyperlight.json"]
        ),
        "neighbours": st.lists(
            st.tuples(NEIGHBOUR_NAMES, st.sampled_from(["file", "link", "dir"]), st.booleans()),
            max_size=4,
            unique_by=lambda t: t[0],
        ),
    }
)


def plant(directory: str, p: dict[str, Any]) -> None:  # noqa: PLR0912 - one branch per kind of thing
    """Populate a CDI dir: neighbours first, then whatever p["kind"] says at our path."""
    with open(os.path.join(directory, "vendor.json"), "wb") as f:
        f.write(b'{"cdiVersion": "0.5.0", "kind": "vendor.com/gpu", "devices": []}\n')
    with open(os.path.join(directory, "canonical.json"), "wb") as f:
        f.write(WANTED)
    for name, kind, old in p["neighbours"]:
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            continue
        try:
            if kind == "file":
                with open(path, "wb") as f:
                    f.write(b"theirs")
            elif kind == "link":
                os.symlink("vendor.json", path)
            else:
                os.mkdir(path)
            if old:  # old enough to count as abandoned, were it ours
                os.utime(path, (1, 1), follow_symlinks=False)
        except OSError:
            continue  # e.g. a name longer than the filesystem allows
    path = cdi.spec_path(directory)
    kind = p["kind"]
    if kind == "regular":
        with open(path, "wb") as f:
            f.write(p["data"])
        os.chmod(path, p["mode"])
        if p["owner"]:
            os.chown(path, *p["owner"])
    elif kind == "symlink":
        os.symlink(p["link"], path)
    elif kind == "dir":
        os.mkdir(path)
        with open(os.path.join(path, "inner.json"), "wb") as f:
            f.write(WANTED)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        import socket

        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
    elif kind == "null device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "hardlink":
        os.link(os.path.join(directory, "vendor.json" if p["data"] != WANTED else "canonical.json"), path)


def exact(directory: str) -> bool:
    path = cdi.spec_path(directory)
    st_ = os.lstat(path)
    with open(path, "rb") as f:
        data = f.read()
    return (
        stat.S_ISREG(st_.st_mode)
        and data == WANTED
        and stat.S_IMODE(st_.st_mode) == cdi.SPEC_MODE
        and (st_.st_uid, st_.st_gid) == (os.geteuid(), os.getegid())
    )


@pytest.mark.root
@settings(max_examples=fuzz_budget(600))
@given(p=PLANT)
def test_fuzz_cdi_inspect_refuses_where_reconcile_does_and_changes_nothing(scratch: str, p: dict[str, Any]) -> None:
    """`--check`'s inspection raises exactly the refusal the running agent's repair meets (issue 47,
    4: it used to pass over it as a note), and otherwise says what a repair would change."""
    count_inputs("CDI inspect")
    directory = tempfile.mkdtemp(dir=scratch)
    try:
        plant(directory, p)
        before = snapshot(directory)
        refusal = ""
        try:
            problem = cdi.inspect(directory, SPEC)
        except cdi.CdiError as exc:
            problem, refusal = None, str(exc)
        if refusal:
            assert snapshot(directory) == before
            one_line(refusal, 300 + len(directory))
            with pytest.raises(cdi.CdiError) as repaired:
                cdi.reconcile(directory, SPEC)
            assert str(repaired.value) == refusal
            return
        assert problem is None or (isinstance(problem, str) and problem)
        if problem is not None:
            one_line(problem, 300 + len(directory))
        assert snapshot(directory) == before
        assert (problem is None) == (
            os.path.lexists(cdi.spec_path(directory))
            and not os.path.islink(cdi.spec_path(directory))
            and os.path.isfile(cdi.spec_path(directory))
            and exact(directory)
        )
        if problem is None:
            assert cdi.listed_devices(read_bytes(cdi.spec_path(directory)) or b"") == {"kvm"}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.root
@settings(max_examples=fuzz_budget(600))
@given(p=PLANT)
def test_fuzz_cdi_reconcile_leaves_exactly_ours_or_the_obstruction_and_nothing_else(
    scratch: str, p: dict[str, Any]
) -> None:
    count_inputs("CDI reconcile")
    directory = tempfile.mkdtemp(dir=scratch)
    try:
        plant(directory, p)
        before = snapshot(directory)
        obstruction = before.get(contracts.CDI_SPEC_FILE)
        try:
            cdi.reconcile(directory, SPEC)
        except cdi.CdiError as exc:
            refusal: Optional[str] = str(exc)
        else:
            refusal = None
        if refusal is not None:
            one_line(refusal, 300 + len(directory))
            assert obstruction is not None and not stat.S_ISREG(obstruction[0]), f"refused a regular file: {refusal}"
            after = snapshot(directory)
            assert after == {
                k: v for k, v in before.items() if not (ours_temp(k) and stat.S_ISREG(v[0]) and v[5] < 2e9)
            }, "nothing else changed"
        else:
            assert exact(directory)
            assert cdi.inspect(directory, SPEC) is None
            after = snapshot(directory)
            del after[contracts.CDI_SPEC_FILE]
            # Only an abandoned temp file of exactly our pattern may go; everything else stays as it was.
            kept = {
                k: v
                for k, v in before.items()
                if k != contracts.CDI_SPEC_FILE and not (ours_temp(k) and stat.S_ISREG(v[0]) and v[5] < 2e9)
            }
            assert after == kept, "only our own spec (and our abandoned temp files) may change"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --- the probe helper's requests ----------------------------------------------------------------


@pytest.fixture(scope="module")
def nodes(scratch: str) -> Iterator[str]:
    """A device dir of our own: a working KVM node (10:232), /dev/null's numbers, and non-devices."""
    path = tempfile.mkdtemp(dir=scratch)
    os.mknod(os.path.join(path, "kvm"), 0o600 | stat.S_IFCHR, os.makedev(10, 232))
    os.mknod(os.path.join(path, "null"), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    with open(os.path.join(path, "file"), "wb"):
        pass
    os.mkdir(os.path.join(path, "dir"))
    os.mkfifo(os.path.join(path, "fifo"))
    os.symlink("kvm", os.path.join(path, "link"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


NODE_NAMES = ("kvm", "null", "file", "dir", "fifo", "link", "missing", "dir/", "kvm/", "x" * 300, "../missing")
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
JSON_ANY = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
PATH_VALUE = st.one_of(
    st.sampled_from(NODE_NAMES).map(lambda n: ("node", n)),
    JSON_ANY.map(lambda v: ("raw", v)),
    st.text(max_size=20).map(lambda t: ("raw", "rel/" + t)),
    st.just(("raw", "/a\0b")),
)
REQUEST = st.fixed_dictionaries(
    {
        "hypervisor": st.one_of(st.sampled_from(["kvm", "mshv", "KVM", ""]), JSON_ANY),
        "device": PATH_VALUE,
        "host": st.one_of(st.just(("raw", None)), PATH_VALUE),
    },
    optional={"extra": JSON_ANY},
)


def resolve(nodes: str, value: tuple[str, Any]) -> Any:
    kind, v = value
    return os.path.join(nodes, v) if kind == "node" else v


def safe(nodes: str, request: Any) -> bool:
    """True unless a device path could be opened outside our own node dir: the helper opens
    `device` read/write only when `host` (or `device` itself) is a character device, so any
    absolute string path that is neither in our dir nor obviously harmless is refused."""
    if not isinstance(request, dict):
        return True
    for field in ("device", "host"):
        path = request.get(field)
        if isinstance(path, str) and path.startswith("/") and "\0" not in path:
            real = os.path.normpath(path)
            if not (real == nodes or real.startswith(nodes + os.sep)):
                return False
    return True


def check_reply(line: str) -> dict[str, Any]:
    assert "\n" not in line
    reply = json.loads(line)
    assert isinstance(reply, dict) and set(reply) == {"ok", "reason"}
    assert isinstance(reply["ok"], bool) and isinstance(reply["reason"], str)
    assert reply["ok"] or reply["reason"]
    assert len(reply["reason"]) <= 1000, reply["reason"]
    return reply


@pytest.mark.root
@settings(max_examples=fuzz_budget(300))
@given(requests=st.lists(REQUEST, min_size=1, max_size=6))
def test_fuzz_helper_requests_always_one_json_reply(nodes: str, requests: list[dict[str, Any]]) -> None:
    count_inputs("helper requests (JSON)", len(requests))
    for shape in requests:
        request = {k: resolve(nodes, v) if k in ("device", "host") else v for k, v in shape.items()}
        if not safe(nodes, request):
            continue  # a generated absolute path outside our node dir: never handed to the helper
        reply = check_reply(helper_process.handle_line(json.dumps(request)))
        good = (
            set(request) == {"hypervisor", "device", "host"}
            and request["hypervisor"] == "kvm"
            and request["device"] in (os.path.join(nodes, "kvm"),)
            and request["host"] in (None, os.path.join(nodes, "kvm"))
        )
        assert reply["ok"] == good, (request, reply)


LINE_TEXT = st.one_of(
    st.text(max_size=120),
    st.builds(
        mutate,
        st.sampled_from(
            [
                b'{"hypervisor": "kvm", "device": "/x/kvm", "host": null}',
                b'{"hypervisor": "mshv", "device": "/x/null", "host": "/x/kvm"}',
            ]
        ),
        EDITS,
    ).map(lambda b: b.decode("utf-8", "replace")),
    st.integers(0, 3000).map(lambda n: "[" * n),
    st.integers(0, 3000).map(lambda n: '{"a":' * n),
    st.sampled_from(["", "null", "1e999", "NaN", '"\\ud800"', "[]", "{}", '{"hypervisor":1}', "\x00"]),
)


@pytest.mark.root
@settings(max_examples=fuzz_budget(400))
@given(seed=SEEDS, lines=st.lists(LINE_TEXT, min_size=1, max_size=6))
def test_fuzz_helper_lines_always_one_json_reply(nodes: str, seed: int, lines: list[str]) -> None:
    lines = [v for i, line in enumerate(lines) for v in variants(seed + i, line, 16)]
    count_inputs("helper lines (text)", len(lines))
    for text in lines:
        line = text.replace("/x/", nodes + "/")
        try:
            parsed = json.loads(line)
        except (ValueError, RecursionError):
            parsed = None
        if not safe(nodes, parsed):
            continue  # a path outside our node dir: never opened by a test
        check_reply(helper_process.handle_line(line))


@pytest.mark.root
def test_fuzz_helper_serve_answers_every_line_once(nodes: str) -> None:
    """The loop itself: one reply line per request line, in order, whatever the lines hold."""
    lines = [
        json.dumps({"hypervisor": "kvm", "device": os.path.join(nodes, "kvm"), "host": None}),
        "garbage",
        "",
        "[" * 5000,
        '{"hypervisor": "kvm"}',
        json.dumps({"device": 1}),
    ] * 200
    out = io.StringIO()
    helper_process.serve(io.StringIO("".join(line + "\n" for line in lines)), out)
    ready, *replies = out.getvalue().splitlines()
    assert ready.encode() + b"\n" == helper_process.READY_LINE  # said once, before any request
    assert len(replies) == len(lines)
    assert [check_reply(r)["ok"] for r in replies] == [i % 6 == 0 for i in range(len(lines))]
    count_inputs("helper lines (serve loop)", len(lines))


@pytest.mark.root
def test_fuzz_the_real_helper_process_answers_garbage_line_by_line(nodes: str) -> None:
    """The helper as the agent starts it (python -I -S -B), fed raw bytes: a reply per line."""
    from hyperlight_agent.device.helper import SOURCES, default_argv

    rng = random.Random(11)
    lines = []
    for i in range(fuzz_budget(2000)):
        if i % 10 == 0:
            lines.append(json.dumps({"hypervisor": "kvm", "device": os.path.join(nodes, "kvm"), "host": None}))
        else:
            lines.append(
                "".join(
                    chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)]))
                    for _ in range(rng.randrange(0, 60))
                )
                .replace("\n", " ")
                .replace("\r", " ")
            )
    data = "".join(line + "\n" for line in lines).encode()
    result = subprocess.run(default_argv(), input=SOURCES + data, capture_output=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stderr == b"", result.stderr[-2000:]
    ready, *replies = result.stdout.decode().splitlines()
    assert ready.encode() + b"\n" == helper_process.READY_LINE
    assert len(replies) == len(lines)
    for i, reply in enumerate(replies):
        assert check_reply(reply)["ok"] == (i % 10 == 0)
    count_inputs("helper lines (real process)", len(lines))
