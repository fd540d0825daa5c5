"""Shared fixtures: short temp dirs, the kubelet stand-in, a real agent process, and guards
that the host's /dev/kvm and process table are left exactly as found."""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Generator, Iterator
from typing import Any, Callable, Optional, Sequence

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # stand-in restarts make grpc log GOAWAYs at INFO
from standin import procs
from standin.kubelet import StandinThread

# The suite's own switches, moved out of the HYPERLIGHT_ names at once (also before pytest-xdist
# starts its workers, which read them here under their new names): the agents the tests start
# inherit this environment and refuse every HYPERLIGHT_* variable that is not a setting.
SUITE_SWITCHES = ("HYPERLIGHT_FUZZ_SCALE", "HYPERLIGHT_TEST_NEIGHBOUR")
for _name in SUITE_SWITCHES:
    if _name in os.environ:
        os.environ["PYTEST_" + _name] = os.environ.pop(_name)


def switch(name: str, default: str = "") -> str:
    """A suite switch's value (SUITE_SWITCHES), given as HYPERLIGHT_..."""
    return os.environ.get("PYTEST_" + name, default)


HOST_KVM = "/dev/kvm"

# Property and fuzz tests: fixed seeds (the same inputs on every run), no example database in
# the work tree, no per-example deadline (the machine is shared), budgets set per test and
# multiplied by HYPERLIGHT_FUZZ_SCALE (e.g. 10) for a longer search.
settings.register_profile(
    "hyperlight",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
settings.load_profile("hyperlight")
# A fraction (`make check` uses 0.1) shortens the search; every surface still gets some inputs.
FUZZ_SCALE = max(0.01, float(switch("HYPERLIGHT_FUZZ_SCALE", "1") or "1"))
# Inputs each fuzzed surface was given in this session, for the summary at the end.
FUZZ_INPUTS: dict[str, int] = {}


def fuzz_budget(examples: int) -> int:
    return max(1, int(examples * FUZZ_SCALE))


def count_inputs(surface: str, n: int = 1) -> None:
    FUZZ_INPUTS[surface] = FUZZ_INPUTS.get(surface, 0) + n


# The real-cluster tests' images (tests/e2e/oci.py builds them): the workload's and the pod sandbox's.
E2E_WORKLOAD_IMAGE = "localhost/hyperlight-e2e/workload:1"


@pytest.fixture(scope="session")
def images() -> Iterator[dict[str, str]]:
    """The workload's (the Hyperlight example's files among its tools) and the pod sandbox's
    images, as archives containerd imports (the agent's and the example's own image, `helm
    test`'s, come from the registry, as the releases published them), for every real cluster of
    the session (tests/test_e2e*.py)."""
    from tests import hyperlight
    from tests.e2e.oci import pause_image, workload_image

    example = hyperlight.example()
    files = {hyperlight.HOST_IN_IMAGE: example.host, hyperlight.GUEST_IN_IMAGE: example.guest}
    directory = tempfile.mkdtemp(prefix="hl-e2e-img-")
    try:
        yield {
            "pause": pause_image(directory, "localhost/hyperlight-e2e/pause:1"),
            "workload": workload_image(directory, E2E_WORKLOAD_IMAGE, files),
        }
    finally:
        subprocess.run(["rm", "-rf", directory], check=False)


# Figures the real-cluster tests measured in this session (tests/test_e2e.py records them).
E2E_FIGURES: dict[str, Any] = {}


# What is left of the session once pytest has said its last line: a thread or process a test
# left behind keeps the interpreter from exiting, and CI would only see its budget run out. So
# after this long every thread's stack is printed and the run fails (status 1), naming it.
EXIT_GRACE_S = 120


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # not in an xdist worker, which idles until the end
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)


# Where the session's time went, by tier (each test's setup, call and teardown), and by process
# (pytest-xdist's workers), printed at its end with the background builds' times (make test's phases).
TIER_TIMES: dict[str, float] = {}
WORKER_TIMES: dict[str, float] = {}
# Each worker's units of work in time: (worker, lane) → [start, end, busy] in seconds since the
# session began, as the controller receives the reports.
LANE_SPANS: dict[tuple[str, str], list[float]] = {}
SESSION_START = time.monotonic()


LANE_SHOWN_S = 60  # the units phases() places in time: the rest is noise beside them


def tier(item: pytest.Item) -> str:
    if item.get_closest_marker("e2e"):
        return "real clusters (e2e)"
    if "release_builder" in getattr(item, "fixturenames", ()):
        return "releases and what is installed from them"
    for marker in ("judge", "system", "root"):
        if item.get_closest_marker(marker):
            return {"judge": "manifest judges", "system": "system", "root": "root"}[marker]
    return "fast (make check's)"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each phase of a test, in the process that reports (the controller, with workers)."""
    named = dict(report.user_properties)
    if "tier" in named:
        name = str(named["tier"])
        TIER_TIMES[name] = TIER_TIMES.get(name, 0.0) + report.duration
        worker = getattr(getattr(report, "node", None), "gateway", None)
        name = worker.id if worker is not None else "the session"
        WORKER_TIMES[name] = WORKER_TIMES.get(name, 0.0) + report.duration
        now = time.monotonic() - SESSION_START
        span = LANE_SPANS.setdefault((name, str(named.get("lane", "?"))), [now - report.duration, now, 0.0])
        span[1], span[2] = now, span[2] + report.duration


def phases(terminalreporter: Any) -> None:
    from tests import hyperlight
    from tests.e2e import tools

    terminalreporter.section("phases")
    for log in ("build/tools.log", "build/e2e/components.log", hyperlight.LOG):
        try:
            with open(os.path.join(REPO, log)) as f:
                ready = [line.strip() for line in f if " ready in " in line]
        except OSError:
            ready = []
        waited = tools.WAITED.get(log)
        said = f"; the tests waited {waited:.0f} s for it" if waited is not None else ""
        terminalreporter.write_line(f"{log}: {ready[-1] if ready else 'no build in the background'}{said}")
    for name, seconds in sorted(TIER_TIMES.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{name}: {seconds:.0f} s")
    for name, seconds in sorted(WORKER_TIMES.items()):
        terminalreporter.write_line(f"busy, {name}: {seconds:.0f} s")
    # When each worker ran its longer units (a unit's span beyond its busy time: waiting between
    # its tests' reports, e.g. for another worker's build of the releases).
    for (worker, lane_name), (start, end, busy) in sorted(LANE_SPANS.items(), key=lambda kv: (kv[0][0], kv[1][0])):
        if end - start >= LANE_SHOWN_S:
            terminalreporter.write_line(f"{worker}, {lane_name}: {start:.0f}–{end:.0f} s (busy {busy:.0f} s)")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIER_TIMES and not hasattr(terminalreporter.config, "workerinput"):
        phases(terminalreporter)
    if E2E_FIGURES:
        terminalreporter.section("real-cluster figures")
        for key, value in sorted(E2E_FIGURES.items()):
            terminalreporter.write_line(f"{key}: {value}")
    if not FUZZ_INPUTS:
        return
    terminalreporter.section("fuzzed inputs")
    for surface, n in sorted(FUZZ_INPUTS.items()):
        terminalreporter.write_line(f"{surface}: {n}")
    terminalreporter.write_line(f"total: {sum(FUZZ_INPUTS.values())} (HYPERLIGHT_FUZZ_SCALE={FUZZ_SCALE})")


# Fixtures that need root: device nodes made with mknod, an agent probing the host's /dev/kvm. A
# test using one is marked `root`; every other test that needs root (mknod, chown, a mount
# namespace) says so itself with @pytest.mark.root. (`make check` runs without capabilities, so a
# test that needs root and says nothing fails there.)
# The agent's command line without a settings file, as the tests run it.
AGENT_ARGV = (sys.executable, "-m", "hyperlight_agent", "--config", "/dev/null")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_agent(
    *args: str, timeout: float = 30, env: Optional[dict[str, str]] = None
) -> subprocess.CompletedProcess[str]:
    """The agent's CLI run to its end (`--check`, `--health-check`, `--upgrade-in-place`, a refused
    setting) from the repository's root: its exit code and its output as text."""
    return subprocess.run(
        [*AGENT_ARGV, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


ROOT_FIXTURES = {"kvm_dir", "start_agent", "node"}


# Around every other implementation, so before pytest-xdist's worker reads the groups (below) into
# the tests' ids. (With pytest 9.2 xdist 3.8's loadgroup writes a field pytest no longer reads, so
# the groups never reach the scheduler: pytest-dev/pytest-xdist#1386; pyproject.toml keeps pytest
# below 9.2 and tests/test_conftest.py runs these lanes in real workers.)
@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Generator[None, None, None]:
    _order_and_lanes(config, items)
    yield


def _order_and_lanes(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if ROOT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.root)
        item.user_properties.append(("tier", tier(item)))
        item.user_properties.append(("lane", lane(item)))

    # Alone (one process), the real-cluster tests run last: the whole clusters of the other minors
    # (test_e2e_versions.py) first, each ending with its module, then the session's cluster.
    # `make test` builds their components in the background meanwhile (each cluster waits for
    # that build); before them, the tests that drive the tools (tests/e2e/tools.py: the releases,
    # the manifests' judges), whose build also runs in the background meanwhile. The order is
    # otherwise unchanged.
    def place(item: pytest.Item) -> tuple[bool, bool, bool]:
        e2e = item.get_closest_marker("e2e") is not None
        return e2e, e2e and item.path.name != "test_e2e_versions.py", uses_tools(item)

    items.sort(key=place)
    # (In a worker, xdist has set `dist` to "no" and kept the choice in `loadgroup`: the groups
    # are read there, from each worker's own collection.)
    if not (config.getoption("dist", "no") == "loadgroup" or getattr(config.option, "loadgroup", False)):
        return
    # Side by side (`make test`: two workers, --dist loadgroup): every module is a unit of work
    # (its fixtures made once) for whichever worker is free, the biggest first (xdist's order by
    # tests per unit). The session's cluster (test_e2e.py, and the fleet's control plane) is one
    # unit; each other minor's whole cluster is a unit of its own, so that either worker may run it
    # beside the session's cluster (tests/e2e/hostwide.py: what clusters at once claim).
    # Every cluster waits for the releases as any test does (made once for every worker: releases.py).
    for item in items:
        item.add_marker(pytest.mark.xdist_group(lane(item)))
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


def lane(item: pytest.Item) -> str:
    """The unit of work a test belongs to in `make test`'s two workers (pytest-xdist's group)."""
    if not item.get_closest_marker("e2e"):
        return item.path.name
    row = getattr(getattr(item, "callspec", None), "params", {}).get("whole")
    return f"whole cluster 1.{row.minor}" if row is not None else "clusters"


def uses_tools(item: pytest.Item) -> bool:
    """Whether a test drives build/tools: a release's (made and published with them), a judge's
    (helm, kubectl, promtool) or a real cluster's (helm). A test this misses still gets its tool
    (tests/e2e/tools.py waits for the build); it only waits sooner."""
    marked = any(item.get_closest_marker(m) for m in ("judge", "e2e"))
    return marked or "release_builder" in getattr(item, "fixturenames", ())


# The deadline of a wait that holds a start: an agent's first readiness (its imports, its probe
# helper, its first registration and, in the DRA mode, the API client's first import) or a
# process's. A start is quick on a quiet machine and many times slower beside two lanes of tests
# and a Go build (make check's workers under a load of 15 missed the former 10 s): a wait's
# deadline only says when to give up, never how fast the start must be (bench/ measures that).
START_S = 60.0


def wait_for(
    condition: Callable[[], Any], timeout: float = 10, what: str = "condition", interval: float = 0.005
) -> Any:
    """Poll condition() until truthy or the deadline passes; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def until(condition: Callable[[], Any], timeout: float = 10, what: str = "condition") -> None:
    """wait_for for code on an event loop: poll condition() between the loop's other work."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not condition():
        assert loop.time() < started + timeout, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.005)


def read_bytes(path: str) -> Optional[bytes]:
    """A file's bytes, or None if there is no regular file there."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError):
        return None


# Run in other processes: read a JSON file until `stop` exists; say "reading" after the first read,
# then at the end print reads and unparsable reads.
JSON_READER = """
import json, os, sys
path, stop = sys.argv[1], sys.argv[2]
reads = bad = 0
while not os.path.exists(stop):
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except FileNotFoundError:
        continue
    reads += 1
    try:
        json.loads(data)
    except ValueError:
        bad += 1
    if reads == 1:
        print("reading", flush=True)
print(reads, bad)
"""


def json_readers(path: str, stop: str, count: int = 2) -> list[subprocess.Popen[str]]:
    """`count` JSON_READER processes on `path`, each past its first read: writes that follow are
    read concurrently (a reader still starting would see none of them)."""
    readers = [
        subprocess.Popen([sys.executable, "-c", JSON_READER, path, stop], stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    for reader in readers:
        assert reader.stdout is not None and reader.stdout.readline() == "reading\n", "a reader started"
    return readers


def kvm_metadata() -> Optional[tuple[int, int, int, int]]:
    try:
        st = os.stat(HOST_KVM)
    except OSError:
        return None
    return (st.st_uid, st.st_gid, st.st_mode, st.st_rdev)


@pytest.fixture(scope="session", autouse=True)
def host_kvm_untouched() -> Iterator[None]:
    """The whole suite must leave the real /dev/kvm's owner, mode and device number alone."""
    before = kvm_metadata()
    yield
    assert kvm_metadata() == before, f"{HOST_KVM} metadata changed during the test suite"


NEIGHBOUR_ENV = "HYPERLIGHT_TEST_NEIGHBOUR"


@pytest.fixture(scope="session", autouse=True)
def neighbour_agent() -> Iterator[None]:
    """With HYPERLIGHT_TEST_NEIGHBOUR=1 (`make test` sets it): another agent, run from a copy of
    the package with its own kubelet stand-in and probe helper, for the whole session. The suite
    must pass beside it (tests observe only what they created), and it must come through alive."""
    if switch(NEIGHBOUR_ENV) != "1":
        yield
        return
    top = tempfile.mkdtemp(prefix="hl-neighbour-")
    shutil.copytree(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hyperlight_agent"),
        os.path.join(top, "copy", "hyperlight_agent"),
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    standin = StandinThread(os.path.join(top, "kubelet"))
    log = open(os.path.join(top, "agent.log"), "wb")  # noqa: SIM115 - closed below
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPERLIGHT_", "DEVICE_", "NOTIFY_SOCKET"))}
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hyperlight_agent",
            "--config",
            "/dev/null",
            "--device-count",
            "3",
            "--kubelet-dir",
            os.path.join(top, "kubelet"),
            "--cdi-dir",
            os.path.join(top, "cdi"),
        ],
        cwd=os.path.join(top, "copy"),
        env={**env, "PYTHONPATH": os.path.join(top, "copy")},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        standin.wait_until(lambda k: k.allocatable() == 3, 30, "the neighbour agent to be Healthy")
        assert procs.children(agent.pid), "the neighbour runs its own probe helper"
        yield
        assert agent.poll() is None, "the neighbour agent did not survive the suite"
        assert procs.terminate(agent) == 0
    finally:
        procs.reap(agent)
        log.close()
        standin.close()
        shutil.rmtree(top, ignore_errors=True)


class LoopOfATest(asyncio.SelectorEventLoop):
    """Each test's loop. grpc.aio keeps one completion queue per process and hands each
    completion to the loop its call or server was made on, from whichever loop reads the queue
    next; a completion that comes after its test's loop closed (seen with four workers under
    coverage, 2 runs in 13) would raise "Event loop is closed" in a later test's loop, failing a
    test that never made the call. Such a completion has nobody left to wake: it is dropped. Every
    other callback on a closed loop still raises."""

    def call_soon_threadsafe(  # type: ignore[override]  # typeshed's is generic over the args
        self, callback: Callable[..., object], *args: Any, context: Optional[contextvars.Context] = None
    ) -> asyncio.Handle:
        if self.is_closed() and getattr(callback, "__qualname__", "") == GRPC_COMPLETION:
            dropped = asyncio.Handle(callback, args, self, context)
            dropped.cancel()
            return dropped
        return super().call_soon_threadsafe(callback, *args, context=context)


# grpc.aio's callback for a completion whose loop is not the one reading the queue
# (grpc/_cython/_cygrpc/aio/completion_queue.pyx.pxi).
GRPC_COMPLETION = "_handle_callback_wrapper"


class LoopOfATestPolicy(asyncio.DefaultEventLoopPolicy):  # type: ignore[misc,valid-type]
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return LoopOfATest()


# Both anyio's runner and asyncio.run() make their loops through the policy.
asyncio.set_event_loop_policy(LoopOfATestPolicy())


@pytest.fixture
def anyio_backend() -> str:
    """Coroutine tests run on asyncio, the agent's loop (anyio's plugin, pyproject.toml). With no
    async fixture of a wider scope holding it, anyio's runner, and so its loop, lives for one
    test only, as asyncio.run() gave each test before: grpc.aio objects bind to a loop."""
    return "asyncio"


@pytest.fixture
def helpers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every agent built in the test gets a FakeHelper (listed here) instead of a helper process,
    and a regular file at a row's path counts as its node (tests/fakes.py)."""
    from hyperlight_agent import assembly as assembly_module
    from tests.fakes import FakeHelper, files_as_devices

    made: list[FakeHelper] = []

    def fake(**kw: Any) -> FakeHelper:
        made.append(FakeHelper(**kw))
        return made[-1]

    monkeypatch.setattr(assembly_module, "ProbeHelper", fake)
    files_as_devices(monkeypatch)
    return made


@pytest.fixture
def quick_deregistration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DRA agent's close waits DEREGISTER_GRACE_S for the kubelet's plugin manager (a 1 s
    reconciler) to deregister it; the DRA stand-in does so at once. (test_dra_registration holds
    the wait itself.)"""
    from hyperlight_agent.dra import registration

    monkeypatch.setattr(registration, "DEREGISTER_GRACE_S", 0.05)
    monkeypatch.setattr(registration, "CALLS_DRAIN_S", 0.5)  # (its own test: test_dra_registration)
    # The stand-in's notify fails only when a test asks it to (test_handover holds the wait itself).
    monkeypatch.setattr(registration, "REGISTRATION_SETTLE_S", 0.2)


@pytest.fixture
def tmp() -> Iterator[str]:
    """A short temp dir: unix socket paths must stay under 108 bytes."""
    path = tempfile.mkdtemp(prefix="hl-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(tmp: str) -> Iterator[StandinThread]:
    with StandinThread(os.path.join(tmp, "kubelet")) as standin:
        yield standin


def make_node(path: str, major: int, minor: int) -> str:
    os.mknod(path, 0o600 | 0o020000, os.makedev(major, minor))
    return path


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: str, b: str) -> None:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE): an agent repairing a path the
    moment it goes missing never finds it missing, so an unlink-then-create race cannot occur."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2 exchange with {b}: {os.strerror(err)}", a)


@pytest.fixture
def kvm_dir(tmp: str) -> str:
    """A device dir holding a node with the real KVM's numbers (10:232): probes really work."""
    path = os.path.join(tmp, "dev")
    os.mkdir(path)
    make_node(os.path.join(path, "kvm"), 10, 232)
    return path


class AgentProcess:
    """The real agent as a child process, with its stderr kept for assertions."""

    def __init__(self, tmp: str, *args: str, env: Optional[dict[str, str]] = None, prefix: Sequence[str] = ()) -> None:
        self.log_path = os.path.join(tmp, f"agent-{time.monotonic_ns()}.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPERLIGHT_", "DEVICE_"))}
        full_env.pop("HOST_DEVICE_DIR", None)
        full_env.pop("NOTIFY_SOCKET", None)
        full_env.update(env or {})
        # prefix: a wrapper that execs the agent (the PID stays the agent's), e.g. unshare.
        try:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "hyperlight_agent", "--config", "/dev/null", *args],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=full_env,
            )
        except BaseException:
            # Not started, so never stopped: the log is closed here, not by the collector in
            # whichever test comes next (an unraisable-exception warning failing that test).
            self._log.close()
            raise
        # Helpers seen as this agent's children before it was told to stop: after it is gone
        # they are orphans (no longer its children), and must still exit.
        self.last_helpers: list[int] = []

    def helpers(self) -> list[int]:
        """This agent's probe helpers (its children), none of any other agent's."""
        found = procs.children(self.proc.pid) if self.proc.poll() is None else []
        if found:
            self.last_helpers = sorted(set(self.last_helpers) | set(found))
        return found

    def helpers_left(self) -> list[int]:
        """Helpers this agent ever showed that are still running."""
        return procs.alive(self.last_helpers)

    @property
    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def status(self) -> str:
        """The last status line the agent logged ("" before its first)."""
        said = [line.split(": status: ", 1)[1] for line in self.log.splitlines() if ": status: " in line]
        return said[-1] if said else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.helpers()
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.helpers()
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


StartAgent = Callable[..., AgentProcess]


def wait_ready(agent: AgentProcess, timeout: float = 15) -> None:
    """Until the agent says it is ready: the kubelet's count of our slots comes first (its list can
    arrive before its Register's reply reaches the agent), so what depends on the agent being
    ready (a stop's wait for a successor) waits for this."""
    wait_for(lambda: agent.status().startswith("ready: "), timeout, "the agent saying it is ready")


CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
        if report.failed:
            _add_agent_pod_logs(item, report)
    return report


# The chart's namespace in the real clusters (tests/test_e2e.py installs it there).
AGENT_NAMESPACE = "hyperlight-system"


def _add_agent_pod_logs(item: pytest.Item, report: pytest.TestReport) -> None:
    """A failed test on a real cluster shows what our agents' pods wrote (ended ones too): the
    failure alone says only which wait ran out."""
    from tests.e2e.cluster import Cluster

    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, Cluster):
            report.sections.append((f"our agents' pods on {value.directory}", value.pod_logs(AGENT_NAMESPACE)))


@pytest.fixture
def start_agent(tmp: str, request: pytest.FixtureRequest) -> Iterator[StartAgent]:
    """start_agent(*flags, env={...}): runs the agent with temp kubelet and CDI dirs by default.
    A failed test shows each agent's log (its own account of what it saw)."""
    agents: list[AgentProcess] = []

    def start(
        *args: str, env: Optional[dict[str, str]] = None, defaults: bool = True, prefix: Sequence[str] = ()
    ) -> AgentProcess:
        base = ["--kubelet-dir", os.path.join(tmp, "kubelet"), "--cdi-dir", os.path.join(tmp, "cdi")]
        agent = AgentProcess(tmp, *(base if defaults else []), *args, env=env, prefix=prefix)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.kill()
        if request.node.stash.get(CALL_FAILED, False):
            print(f"--- {agent.log_path} ---\n{agent.log}")
    wait_for(lambda: not any(a.helpers_left() for a in agents), 5, "probe helpers to exit after the agent")


def assert_ships_the_agent_only(paths: list[str]) -> None:
    """A package's file list holds the agent's subpackages and none of the development tools
    (standin/: the kubelet stand-in and the demo)."""
    modules = [p for p in paths if p.endswith(".py")]
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hyperlight_agent")
    every = sorted(
        os.path.relpath(os.path.join(d, f), os.path.dirname(package))
        for d, _, files in os.walk(package)
        for f in files
        if f.endswith(".py")
    )
    assert "hyperlight_agent/dra/side.py" in every
    missing = [m for m in every if not any(p.endswith(m) for p in modules)]
    assert not missing, f"not shipped: {missing}"
    tools = [p for p in modules if "/standin/" in p or p.endswith(("/standin.py", "/demo.py"))]
    assert not tools, f"development tools shipped: {tools}"


# ---- Releases as users get them (tests/releases.py): built, published and served once a session ----


@pytest.fixture(scope="session")
def host_packages(release_current: str) -> dict[str, str]:
    """Each target's package by its tag (packaging/targets): release N's, as `make deb` and `make
    rpm` built them inside `make release` (lintian and rpmlint included; the RPMs then signed)."""
    from tests.releases import manifest

    return {tag: os.path.join(release_current, name) for tag, name in manifest(release_current)["packages"].items()}


# A run of several processes (pytest-xdist's workers) by its controller's name for it, which
# the workers inherit: what they share on disk is named for it.
SHARED_RUN = "PYTEST_HYPERLIGHT_RUN"


# Set in the controller that chose the run's shared directory: only it removes that directory. A
# pytest this session starts (a test of the harness) inherits SHARED_RUN; its end must not take
# the releases from under the session's workers (it once did: test_deb found no release.json).
OWNS_SHARED_RUN = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        os.environ[SHARED_RUN] = uuid.uuid4().hex[:16]
        config.stash[OWNS_SHARED_RUN] = True


def shared_release_directory(config: pytest.Config) -> Optional[str]:
    """Where the session's workers share their releases: one directory per run, removed by the
    controller at the session's end; None in a session of one process."""
    run = os.environ.get(SHARED_RUN)
    return os.path.join(tempfile.gettempdir(), f"hl-rel-{run}") if run else None


@pytest.fixture(scope="session")
def release_builder(pytestconfig: pytest.Config) -> Iterator[Any]:
    from tests.releases import Builder

    shared = shared_release_directory(pytestconfig)
    builder = Builder(shared or tempfile.mkdtemp(prefix="hl-rel-"))
    try:
        yield builder
    finally:
        if not shared:  # else the controller's, once every worker is done (pytest_sessionfinish)
            builder.close()
            shutil.rmtree(builder.directory, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.e2e import tools

    if hasattr(session.config, "workerinput"):
        # What the controller prints at the end, from each worker (pytest_testnodedown).
        output = session.config.workeroutput  # type: ignore[attr-defined]
        output.update(waited=dict(tools.WAITED), figures=dict(E2E_FIGURES), fuzzed=dict(FUZZ_INPUTS))
        return
    shared = shared_release_directory(session.config)
    if shared and os.path.isdir(shared) and session.config.stash.get(OWNS_SHARED_RUN, False):
        from tests.releases import Builder

        Builder(shared).close()
        shutil.rmtree(shared, ignore_errors=True)


def pytest_testnodedown(node: Any, error: Any) -> None:
    """A worker's end (pytest-xdist, in the controller): what it waited for the builds."""
    from tests.e2e import tools

    output = getattr(node, "workeroutput", {})
    for log, seconds in output.get("waited", {}).items():
        tools.WAITED[log] = max(seconds, tools.WAITED.get(log, 0.0))
    E2E_FIGURES.update(output.get("figures", {}))
    for surface, n in output.get("fuzzed", {}).items():
        count_inputs(surface, n)


@pytest.fixture(scope="session")
def release_previous(release_builder: Any) -> str:
    """`make release` of N-1: this commit as the tree's own version."""
    from tests.releases import PREVIOUS, PREVIOUS_TARGETS

    return str(release_builder.release(PREVIOUS, targets=PREVIOUS_TARGETS))


@pytest.fixture(scope="session")
def release_current(release_builder: Any, release_previous: str) -> str:
    """`make release VERSION=N`: this commit as the next patch version, built after N-1 as a real
    N is (apt refuses a repository whose Release is dated before the one it has: a rollback)."""
    from tests.releases import CURRENT

    return str(release_builder.release(CURRENT))


@pytest.fixture(scope="session")
def published(release_builder: Any, release_previous: str, release_current: str) -> Iterator[Any]:
    """Both releases published with `make publish`: image and chart in a real OCI registry, signed
    with a cosign key pair made for the session; each release's package repositories in a site
    directory of its own, served over HTTP from `served`, a link the tests point at either."""
    from tests.releases import Published

    with Published(release_builder, release_previous, release_current) as found:
        yield found
