"""In-place upgrades (host/successor.py, host/upgrade.py) under the service-manager stand-in
(standin/manager.py: systemd's notify rules for NotifyAccess=main, a subreaper like PID 1) and the
kubelet stand-in: `--upgrade-in-place PID` hands the kubelet and the unit to the code installed
now without a moment unserved; a child that fails leaves the old agent serving."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Coroutine, Iterator, Optional

import anyio
import pytest

from hyperlight_agent import __version__, contracts, peers
from hyperlight_agent.host import upgrade
from hyperlight_agent.identity import Identity, boottime_ns
from standin import kubelet as standin
from standin import procs
from standin.kubelet import KubeletStandin, StandinThread
from tests.conftest import AGENT_ARGV, START_S, run_agent, wait_for
from tests.test_peers import Server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R = contracts.RESOURCE_HYPERVISOR
# What the package installs as /usr/bin/hyperlight-agent, in short: a file the agent is started
# from, so that a test can change "the installed code" under a running agent.
LAUNCHER = """\
from hyperlight_agent.__main__ import main
main()
"""


class Unit:
    """The agent as a systemd unit's main process, under the service-manager stand-in."""

    def __init__(self, tmp: str, *args: str, launcher: str = LAUNCHER) -> None:
        self.tmp = tmp
        self.events_path = os.path.join(tmp, "events.jsonl")
        self.launcher = os.path.join(tmp, "launcher.py")
        self.install(launcher)
        self.args = [
            "--config",
            "/dev/null",
            "--kubelet-dir",
            os.path.join(tmp, "kubelet"),
            "--cdi-dir",
            os.path.join(tmp, "cdi"),
            *args,
        ]
        self.log_path = os.path.join(tmp, "unit.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPERLIGHT_", "NOTIFY_", "WATCHDOG_"))}
        env["PYTHONPATH"] = ROOT
        self.env = env
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "standin.manager",
                self.events_path,
                os.path.join(tmp, "notify"),
                "--",
                sys.executable,
                self.launcher,
                *self.args,
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def install(self, text: str) -> None:
        """Replace the launcher (the "installed code") atomically, as a package manager does."""
        with open(self.launcher + ".new", "w") as f:
            f.write(text)
        os.replace(self.launcher + ".new", self.launcher)

    def events(self) -> list[dict[str, Any]]:
        try:
            with open(self.events_path) as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    @property
    def main(self) -> int:
        mains = [e["pid"] for e in self.events() if e["event"] == "main"]
        return mains[-1] if mains else 0

    def accepted(self) -> list[tuple[int, str]]:
        return [
            (e["pid"], line) for e in self.events() if e["event"] == "notify" and e["accepted"] for line in e["lines"]
        ]

    def rejected(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == "notify" and not e["accepted"]]

    def exited(self, pid: int) -> bool:
        return any(e["event"] == "exit" and e["pid"] == pid for e in self.events())

    def wait_ready(self) -> None:
        wait_for(lambda: any(line == "READY=1" for _, line in self.accepted()), 20, "READY=1 from the main process")

    def upgrade(self, pid: Optional[int] = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hyperlight_agent", *self.args, "--upgrade-in-place", str(pid or self.main)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )

    def processes(self) -> list[int]:
        """The manager's children: the unit's processes (orphans below it are reparented to it)."""
        return procs.children(self.proc.pid, mark="")

    @property
    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            self._log.close()

    def kill(self) -> None:
        pids = self.processes() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        # Still running the unit's code (its launcher in the command line; a reused PID does not).
        for pid in procs.alive(pids, mark=self.launcher):
            os.kill(pid, signal.SIGKILL)
        self._log.close()


@pytest.fixture
def unit(tmp: str, kvm_dir: str) -> Iterator[Any]:
    made: list[Unit] = []

    def start(*args: str, launcher: str = LAUNCHER) -> Unit:
        made.append(Unit(tmp, "--device-dir", kvm_dir, *args, launcher=launcher))
        return made[-1]

    yield start
    for u in made:
        u.kill()


def zeros_since(k: KubeletStandin, since: float) -> list[float]:
    return [at for at, counts in k.timeline if at >= since and counts.get(R, 0) == 0]


def served_by(k: KubeletStandin) -> str:
    p = k.plugins.get(R)
    return p.endpoint if p is not None else ""


def sockets(tmp: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(tmp, "kubelet")) if n.endswith(".sock"))


def running(pid: int) -> bool:
    """Whether the process is there and not a zombie (exited, not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def upgrade_once(u: Unit, kubelet: StandinThread) -> int:
    """One in-place upgrade, checked: the new main process serves, the old one is gone."""
    old = u.main
    result = u.upgrade()
    assert result.returncode == 0, (result.stdout, result.stderr, u.log)
    new = u.main
    assert new != old
    assert f"pid {old} handed over to pid {new} (hyperlight-agent {__version__}) and left" in result.stdout
    # Left: it has exited (a zombie until the service manager's stand-in reaps it, which happens
    # on that process's own time and records it in the events a moment later).
    assert not running(old), "the old agent has left by the time the command returns"
    wait_for(lambda: u.exited(old), START_S, "the stand-in's record of the old agent's exit")
    kubelet.wait_until(
        lambda k: served_by(k).startswith("hyperlight.host-g") and k.allocatable() == 3,
        15,
        "the new agent serving the kubelet",
    )
    return new


def test_an_in_place_upgrade_hands_the_kubelet_and_the_unit_to_the_installed_code(
    unit: Any, kubelet: StandinThread, tmp: str
) -> None:
    kubelet.run(lambda k: setattr(k, "flavor", "1.37"))
    u = unit("--device-count", "3")
    u.wait_ready()
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15)
    assert served_by(kubelet.kubelet) == "hyperlight.sock"
    first, since = u.main, time.monotonic()
    new = upgrade_once(u, kubelet)
    if zeros_since(kubelet.kubelet, since):
        print(kubelet.kubelet.timeline, since)
        print(u.log)
        for e in u.events():
            print(e)
    assert zeros_since(kubelet.kubelet, since) == [], "the kubelet never counted zero slots"
    assert u.rejected() == [], "nothing was said to the manager by a process that was not main"
    assert not any(e["event"] == "alien" for e in u.events()), "the new main process is the manager's child"
    said = u.accepted()
    assert (first, f"MAINPID={new}") in said
    wait_for(
        lambda: any(pid == new and line.startswith("STATUS=") for pid, line in u.accepted()),
        10,
        "the new main process speaks once its predecessor is gone",
    )
    last_status = [line for pid, line in u.accepted() if line.startswith("STATUS=")][-1]
    assert last_status.endswith(f"; version {__version__}"), last_status
    assert u.processes() == [new]
    assert sockets(tmp) == sorted(["kubelet.sock", served_by(kubelet.kubelet)])
    # The renamed instance still answers the exec probe without --instance.
    probe = subprocess.run(
        [sys.executable, "-m", "hyperlight_agent", *u.args, "--health-check=readiness"],
        cwd=ROOT,
        env=u.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert probe.returncode == 0 and served_by(kubelet.kubelet) in probe.stdout, probe.stdout
    assert u.stop() == 0, u.log
    assert not any(e["event"] == "left" for e in u.events()), "a stop leaves no process for the manager to kill"


def test_ten_upgrades_in_a_row_leave_one_agent_and_no_stray_socket(unit: Any, kubelet: StandinThread, tmp: str) -> None:
    kubelet.run(lambda k: setattr(k, "flavor", "1.37"))
    u = unit("--device-count", "3")
    u.wait_ready()
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15)
    since, mains = time.monotonic(), [u.main]
    for _ in range(10):
        mains.append(upgrade_once(u, kubelet))
    assert len(set(mains)) == 11
    assert zeros_since(kubelet.kubelet, since) == []
    assert u.rejected() == []
    assert u.processes() == [mains[-1]]
    assert sockets(tmp) == sorted(["kubelet.sock", served_by(kubelet.kubelet)])
    assert kubelet.call(kubelet.kubelet.allocate(R, ["kvm-0"])).container_responses
    assert u.stop() == 0, u.log


@pytest.mark.parametrize(
    "installed",
    [
        pytest.param("import sys\nsys.exit(1)\n", id="crashes"),
        pytest.param("import sys\nsys.argv.append('--device-count=nope')\n" + LAUNCHER, id="refuses-its-config"),
    ],
)
def test_a_new_agent_that_fails_before_it_is_ready_leaves_the_old_one_serving(
    unit: Any, kubelet: StandinThread, tmp: str, installed: str
) -> None:
    kubelet.run(lambda k: setattr(k, "flavor", "1.37"))
    u = unit("--device-count", "3")
    u.wait_ready()
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15)
    old, since = u.main, time.monotonic()
    u.install(installed)
    result = u.upgrade()
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout.startswith(f"in-place upgrade of pid {old} failed: the new agent (pid "), result.stdout
    assert result.stdout.rstrip().endswith("exited before it was ready; it serves on"), result.stdout
    assert u.main == old and u.processes() == [old]
    failed = [line for line in u.log.splitlines() if "in-place upgrade failed" in line]
    assert len(failed) == 1, u.log
    assert zeros_since(kubelet.kubelet, since) == []
    assert served_by(kubelet.kubelet) == "hyperlight.sock"
    assert sockets(tmp) == ["hyperlight.sock", "kubelet.sock"]
    assert "READY=1" in [line for pid, line in u.accepted()[-3:] if pid == old], "the reload is over"
    # The installed code fixed: the next upgrade succeeds.
    u.install(LAUNCHER)
    upgrade_once(u, kubelet)
    assert u.stop() == 0, u.log


async def command_beside(task: Callable[[], Coroutine[Any, Any, None]], pid: int, tmp: str) -> tuple[int, str]:
    """`--upgrade-in-place pid` for the sockets in `tmp` (a process of its own: grpc.aio takes one
    event loop per process, and one in a thread beside the test's failed under load), while
    `task` runs here."""
    argv = [*AGENT_ARGV, "--kubelet-dir", tmp, "--dra-plugins-dir", os.path.join(tmp, "plugins")]
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(task)
        done = await anyio.run_process([*argv, "--upgrade-in-place", str(pid)], cwd=ROOT, check=False)
    return done.returncode, done.stdout.decode().strip()


async def _nothing() -> None:
    pass


def handed_over_to_us(pid: int) -> tuple[int, str]:
    return upgrade.DONE, f"pid {pid} handed over to pid {os.getpid()} (hyperlight-agent {__version__}) and left"


async def test_a_successor_that_answers_only_after_the_old_agent_left_is_waited_for(tmp: str) -> None:
    """A kubelet before 1.37 ends the new agent's stream when the old one's ends, and the new agent
    then serves its socket anew: for a moment after the old agent has left nothing answers. The
    command asks again rather than call the upgrade failed (it did, under load: the .deb's
    `systemctl reload` failed in CI while the new agent served on)."""
    old_agent = await anyio.open_process(["sleep", "60"])  # SIGUSR2 ends it: the old agent leaving
    old = Identity("", "deviceplugin", R, boottime_ns(), old_agent.pid)
    server = Server(os.path.join(tmp, contracts.PLUGIN_SOCKET))
    server.server.add_generic_rpc_handlers(
        [peers.describe_handler(old, lambda: True, lambda: {"upgrade": {"attempts": 0, "state": "idle"}})]
    )
    await server.start()
    successor = Server(os.path.join(tmp, "hyperlight.host-g0123abcd.sock"))

    async def take_over_late() -> None:
        await old_agent.wait()  # the old agent has left (and is reaped)
        await server.stop()
        await anyio.sleep(2 * peers.PEER_TIMEOUT_S)  # between two sockets, longer than one answer's bound
        new = Identity("host-g0123abcd", "deviceplugin", R, boottime_ns(), os.getpid())
        await successor.with_describe(new).start()

    try:
        assert await command_beside(take_over_late, old_agent.pid, tmp) == handed_over_to_us(old_agent.pid)
    finally:
        if old_agent.returncode is None:
            old_agent.kill()
        await old_agent.wait()
        await successor.stop()


async def test_a_second_command_joins_the_upgrade_under_way_and_says_its_outcome(tmp: str) -> None:
    """Issue 35, 4: the package script's --upgrade-in-place overlapped an admin's `systemctl reload`;
    the second command found the upgrade running, waited for a new agent started after *it*, and
    answered 1 ("no new agent answered") for an upgrade that succeeded."""
    old_agent = await anyio.open_process(["sleep", "60"])
    old = Identity("", "deviceplugin", R, boottime_ns(), old_agent.pid)
    # The child the first command's upgrade started: before this command did.
    child = Identity("host-g0123abcd", "deviceplugin", R, boottime_ns(), os.getpid())
    asked = [0]
    following = anyio.Event()

    def record() -> dict[str, Any]:
        asked[0] += 1
        if asked[0] >= 3:  # the command has found the upgrade and follows it
            following.set()
        return {"upgrade": {"attempts": 1, "state": "running", "why": "", "pid": child.pid, "agreed": child.pid}}

    server = Server(os.path.join(tmp, contracts.PLUGIN_SOCKET))
    server.server.add_generic_rpc_handlers([peers.describe_handler(old, lambda: True, record)])
    await server.start()
    successor = Server(os.path.join(tmp, "hyperlight.host-g0123abcd.sock"))
    await successor.with_describe(child).start()

    async def hand_over_and_leave() -> None:
        await following.wait()
        old_agent.terminate()  # the old agent leaves, as the upgrade it runs completes
        await old_agent.wait()
        await server.stop()

    try:
        assert await command_beside(hand_over_and_leave, old_agent.pid, tmp) == handed_over_to_us(old_agent.pid)
        assert old_agent.returncode == -signal.SIGTERM, "the command sent no signal of its own (SIGUSR2 ends sleep)"
    finally:
        if old_agent.returncode is None:
            old_agent.kill()
        await old_agent.wait()
        await successor.stop()


async def test_a_second_command_joining_an_upgrade_that_fails_says_so(tmp: str) -> None:
    old_agent = await anyio.open_process(["sleep", "60"])
    old = Identity("", "deviceplugin", R, boottime_ns(), old_agent.pid)
    state = {"attempts": 1, "state": "running", "why": "", "pid": 7, "agreed": 0}
    asked = [0]

    def record() -> dict[str, Any]:
        asked[0] += 1
        if asked[0] >= 3:
            state.update(state="failed", why="the new agent (pid 7) exited before it was ready")
        return {"upgrade": dict(state)}

    server = Server(os.path.join(tmp, contracts.PLUGIN_SOCKET))
    server.server.add_generic_rpc_handlers([peers.describe_handler(old, lambda: True, record)])
    await server.start()
    try:
        assert await command_beside(_nothing, old_agent.pid, tmp) == (
            upgrade.FAILED,
            f"in-place upgrade of pid {old_agent.pid} failed: the new agent (pid 7) exited before it was ready; "
            "it serves on",
        )
        assert old_agent.returncode is None
    finally:
        old_agent.kill()
        await old_agent.wait()
        await server.stop()


def test_upgrade_in_place_of_a_process_that_is_no_agent_of_ours_does_nothing(tmp: str) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        result = run_agent(
            "--kubelet-dir",
            tmp,
            "--upgrade-in-place",
            str(sleeper.pid),
        )
        assert result.returncode == 3, result
        assert result.stdout.strip() == f"pid {sleeper.pid}: no hyperlight-agent answers as this process"
        assert sleeper.poll() is None, "no signal was sent"
    finally:
        sleeper.kill()
        sleeper.wait()


# Launchers standing for a next release, each prefixed to LAUNCHER. The old agent gives up on a
# child after READY_TIMEOUT_S (30 s): shortened for the tests that wait it out.
QUICK = "from hyperlight_agent.host import successor\nsuccessor.READY_TIMEOUT_S = 3.0\n"


def device_dir_launcher(path: str) -> str:
    """A release that looks for its device in `path` (a later --device-dir wins)."""
    return f"import sys\nsys.argv.append('--device-dir={path}')\n"


# A release that registers with the kubelet and dies at once after (its Register returned).
DIES_AFTER_REGISTERING = """\
import os
from hyperlight_agent.deviceplugin import registration
_register = registration.Registrar._register
async def register(self):
    await _register(self)
    os._exit(3)
registration.Registrar._register = register
"""


@pytest.mark.parametrize("flavor", standin.FLAVORS)
def test_a_new_agent_whose_device_check_fails_never_takes_the_kubelet(
    unit: Any, kubelet: StandinThread, tmp: str, flavor: str
) -> None:
    """Issue 35, 1, as found: the next release's check fails (here: its device directory is
    empty). It registered at once and listed its slots Unhealthy; once stopped, the kubelet
    counted 0 for good. Now it never registers while the old agent serves."""
    kubelet.run(lambda k: setattr(k, "flavor", flavor))
    u = unit("--device-count", "3", launcher=QUICK + LAUNCHER)
    u.wait_ready()
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15)
    old, since = u.main, time.monotonic()
    empty = os.path.join(tmp, "empty")
    os.makedirs(empty)
    u.install(QUICK + device_dir_launcher(empty) + LAUNCHER)
    result = u.upgrade()
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout.rstrip().endswith("was not ready within 3 s; it serves on"), result.stdout
    wait_for(lambda: u.processes() == [old], 15, "the failed child gone")
    assert [r.endpoint for _, r in kubelet.kubelet.register_calls] == ["hyperlight.sock"]
    assert zeros_since(kubelet.kubelet, since) == [] and kubelet.kubelet.allocatable() == 3
    assert kubelet.call(kubelet.kubelet.allocate(R, ["kvm-0"])).container_responses
    assert u.stop() == 0, u.log


@pytest.mark.parametrize("flavor", standin.FLAVORS)
def test_after_a_child_that_registered_fails_the_old_agent_registers_again(
    unit: Any, kubelet: StandinThread, flavor: str
) -> None:
    """Issue 35, 1: a child that registered (it had the old agent's agreement) and then failed took
    the kubelet's endpoint (1.34: the old agent's client is replaced, and the child's end
    disconnects the newest) or its device list (1.37+): the old agent registers again."""
    kubelet.run(lambda k: setattr(k, "flavor", flavor))
    u = unit("--device-count", "3")
    u.wait_ready()
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15)
    old = u.main
    u.install(DIES_AFTER_REGISTERING + LAUNCHER)
    result = u.upgrade()
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "exited before it was ready; it serves on" in result.stdout, result.stdout
    endpoints = [r.endpoint for _, r in kubelet.kubelet.register_calls]
    assert any(e.startswith("hyperlight.host-g") for e in endpoints), "the child registered"
    kubelet.wait_until(
        lambda k: served_by(k) == "hyperlight.sock" and k.allocatable() == 3 and k.plugins[R].stream_open,
        15,
        "the old agent the kubelet's endpoint again, its slots healthy",
    )
    assert [r.endpoint for _, r in kubelet.kubelet.register_calls][-1] == "hyperlight.sock"
    assert "in-place upgrade: the new agent (pid " in u.log and "may register with the kubelet" in u.log
    assert kubelet.call(kubelet.kubelet.allocate(R, ["kvm-1"])).container_responses
    assert u.main == old and u.stop() == 0, u.log


def test_upgrading_an_activating_agent_leaves_ready_to_the_new_one(unit: Any, kubelet: StandinThread, tmp: str) -> None:
    """Issue 35, 5: the old agent serves but its device is unhealthy (the unit "activating"); the
    hand-off said READY=1 for it, so systemd called the unit active with no agent ready."""
    kubelet.run(lambda k: setattr(k, "flavor", "1.37"))
    empty = os.path.join(tmp, "empty")
    os.makedirs(empty)
    u = unit("--device-count", "3", launcher=device_dir_launcher(empty) + LAUNCHER)
    wait_for(lambda: any(line.startswith("STATUS=unhealthy") for _, line in u.accepted()), 20, "unhealthy")
    old = u.main
    u.install(LAUNCHER)  # the next release finds the device
    result = u.upgrade()
    assert result.returncode == 0, (result.stdout, result.stderr, u.log)
    new = u.main
    assert (old, f"MAINPID={new}") in u.accepted()
    assert "READY=1" not in [line for pid, line in u.accepted() if pid == old], u.accepted()
    u.wait_ready()  # from the new main process, once it is ready
    assert [pid for pid, line in u.accepted() if line == "READY=1"] == [new]
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15, "the new agent's slots")
    assert u.stop() == 0, u.log


def test_a_hand_off_systemd_does_not_take_fails_the_upgrade(unit: Any, kubelet: StandinThread, tmp: str) -> None:
    """Issue 35, 3: with systemd's notify queue full the hand-off was dropped (sdnotify swallows the
    error), the old agent left, and systemd stopped the unit with the new agent in it. Now the
    old agent serves on and the command says why."""
    kubelet.run(lambda k: setattr(k, "flavor", "1.37"))
    u = unit("--device-count", "3")
    u.wait_ready()
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15)
    old = u.main
    os.kill(u.proc.pid, signal.SIGSTOP)  # systemd busy: it reads no notify message for now
    try:
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        filler.connect(os.path.join(tmp, "notify"))
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                filler.send(b"STATUS=filler")
        filler.close()
        result = u.upgrade()
    finally:
        os.kill(u.proc.pid, signal.SIGCONT)
    assert result.returncode == 1, (result.stdout, result.stderr, u.log)
    assert "was ready, but systemd's notify socket took no message within 5 s (its queue is full); it serves on" in (
        result.stdout
    ), result.stdout
    wait_for(lambda: u.processes() == [old], 15, "the child stopped, the old agent alone")
    assert u.main == old
    kubelet.wait_until(
        lambda k: served_by(k) == "hyperlight.sock" and k.allocatable() == 3, 15, "the old agent serving the kubelet"
    )
    assert u.stop() == 0, u.log


def test_two_upgrades_at_once_both_say_the_outcome(unit: Any, kubelet: StandinThread, tmp: str) -> None:
    """Issue 35, 4: the package script's command and an admin's reload at the same moment."""
    kubelet.run(lambda k: setattr(k, "flavor", "1.37"))
    u = unit("--device-count", "3")
    u.wait_ready()
    kubelet.wait_until(lambda k: k.allocatable() == 3, 15)
    old = u.main
    argv = [sys.executable, "-m", "hyperlight_agent", *u.args, "--upgrade-in-place", str(old)]

    def command() -> subprocess.Popen[str]:
        return subprocess.Popen(argv, cwd=ROOT, env=u.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    commands = [command()]
    wait_for(
        lambda: any(n.startswith("hyperlight.host-g") for n in sockets(tmp)), 30, "the first command's child serving"
    )
    commands.append(command())  # the second finds that upgrade running
    outcomes = [(c.wait(90), c.communicate()[0]) for c in commands]
    new = u.main
    assert new != old
    for code, said in outcomes:
        assert code == 0 and f"handed over to pid {new} (hyperlight-agent {__version__})" in said, outcomes
    # A third, later still: the upgrade is over and the old agent gone.
    late = subprocess.run(argv, cwd=ROOT, env=u.env, capture_output=True, text=True, timeout=90, check=False)
    assert (late.returncode, late.stdout.strip()) == (
        0,
        f"pid {old} had already handed over to pid {new} (hyperlight-agent {__version__})",
    ), late
    assert u.stop() == 0, u.log


def test_an_agent_not_under_systemd_refuses_to_upgrade_in_place(
    kubelet: StandinThread, start_agent: Any, kvm_dir: str, tmp: str
) -> None:
    agent = start_agent("--device-dir", kvm_dir, "--device-count", "2")
    kubelet.wait_until(lambda k: k.allocatable() == 2, 15)
    result = run_agent(
        "--kubelet-dir",
        os.path.join(tmp, "kubelet"),
        "--upgrade-in-place",
        str(agent.proc.pid),
    )
    assert result.returncode == 1, result
    assert "in-place upgrades need systemd's notify socket (not under systemd); it serves on" in result.stdout
    assert agent.proc.poll() is None and kubelet.kubelet.allocatable() == 2
    assert agent.stop() == 0


def test_a_child_that_never_becomes_ready_is_stopped(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """replace_self with a child that hangs: after the hand-over's bound it is stopped, and the
    answer says why."""
    import asyncio

    from hyperlight_agent.host import successor

    async def never(pid: int) -> Optional[str]:
        await asyncio.sleep(0.3)
        return None

    async def run() -> tuple[Optional[int], str, list[int]]:
        seen: list[int] = []

        async def hand_over(pid: int) -> Optional[str]:
            seen.append(pid)
            return await never(pid)

        pid, why = await successor.replace_self(
            None, dict(os.environ), hand_over, cmdline=["sh", "-c", "exec sleep 600"]
        )
        return pid, why, seen

    pid, why, seen = asyncio.run(run())
    assert pid is None and len(seen) == 1
    assert why == f"the new agent (pid {seen[0]}) was not ready within {successor.READY_TIMEOUT_S:g} s"
    wait_for(lambda: not procs.alive(seen, mark="sleep"), 10, "the child gone (reaped by whoever adopted it)")
