"""In-place upgrades under systemd: the installed code started anew beside the running agent, under
an instance name of its own, registered with the kubelet while we still serve, then handed the
kubelet and the unit.

systemd stops a unit's process before it starts the next, so `systemctl restart` always leaves the
kubelet without our device for a moment. An upgrade instead asks the running agent (SIGUSR2, sent
by `hyperlight-agent --upgrade-in-place PID`: the unit's ExecReload= and the package scripts) to
start the code now installed, wait until that process is registered and ready, hand the kubelet
over to it as a pod hands over to its successor in a surge update, make it the unit's main process
(sd_notify MAINPID=) and leave. A child that exits, hangs or is refused before it is ready, or that
systemd could not be told of, is stopped, and we serve on.

The child registers with the kubelet only once we agree (its Describe says `registering`, our
UpgradeRecord says `agreed`): so if the upgrade fails, we know whether the kubelet's endpoint for our
resource may have become the child's, and register again only then (kubelet_side.py,
after_failed_hand_over).

    upgrader = Upgrader(instance, environ, side, notifier, ready=lambda: agent.ready, handed_over=...)
    upgrader.request()           SIGUSR2: refused (said, recorded) or started as a task
    upgrader.predecessor_gone()  the child's side: until the agent it replaced has exited
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import signal
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

from hyperlight_agent import __version__, contracts, waits
from hyperlight_agent.host.notify import Notifier
from hyperlight_agent.identity import Description
from hyperlight_agent.kubelet_side import Succession
from hyperlight_agent.peers import UpgradeState

log = logging.getLogger(__name__)

# A child is given this long to stop on SIGTERM before it is killed.
CHILD_STOP_GRACE_S = 5.0
# The child must be registered and ready within this (it takes about a second); systemd's reload
# job (TimeoutStartSec=60s) waits for the whole upgrade, our shutdown included.
READY_TIMEOUT_S = 30.0
# Our suffix on a child's instance name: "-g" and 8 hex digits (the base before it is kept).
_SUFFIX = re.compile(r"-g[0-9a-f]{8}$")


def child_instance(instance: Optional[str]) -> str:
    """A new instance name beside ours: our name without an earlier suffix of ours, then a fresh one
    (hosts without an instance name use "host").

    >>> child_instance("host-g0123abcd").startswith("host-g") and child_instance(None).startswith("host-g")
    True
    """
    return f"{_base(instance)}-g{secrets.token_hex(4)}"


def _base(instance: Optional[str]) -> str:
    return _SUFFIX.sub("", instance or "host")[:50].rstrip("-.") or "host"


def descends_from(instance: Optional[str], name: str) -> bool:
    """Whether the instance `name` is one child_instance(instance) may have given (after any number
    of upgrades).

    >>> descends_from(None, "host-g0123abcd"), descends_from("web-1", "host-g0123abcd")
    (True, False)
    """
    return _SUFFIX.search(name) is not None and _SUFFIX.sub("", name) == _base(instance)


def command_line(instance: str, cmdline: Optional[Sequence[str]] = None) -> list[str]:
    """How this process was started (/proc/self/cmdline: the interpreter, its options and the
    launcher, so the child runs the code installed now), every --instance replaced by ours."""
    if cmdline is None:
        cmdline = _own_command_line()
    argv: list[str] = []
    skip = False
    for arg in cmdline:
        if skip:
            skip = False
        elif arg == "--instance":
            skip = True
        elif not arg.startswith("--instance="):
            argv.append(arg)
    return [*argv, f"--instance={instance}"]


def _own_command_line() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            parts = f.read().split(b"\0")
    except OSError:
        return [sys.executable, "-m", "hyperlight_agent", *sys.argv[1:]]
    return [os.fsdecode(p) for p in parts[:-1]]  # each argument ends with a NUL


class Child:
    """A started child agent: its pid, whether it has exited, and stopping it.

    Started through `sh` as a grandchild, so that it is never our child: when it becomes the unit's
    main process systemd must be its parent (the service manager reaps it and hears its exit
    directly; a main process that is some other process's child is one systemd warns it may not
    see exit). We follow it through a pidfd, which a recycled pid cannot fool."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._gone = asyncio.Event()
        asyncio.get_running_loop().add_reader(pidfd, self._exited)

    @classmethod
    async def start(cls, argv: Sequence[str], environ: Mapping[str, str]) -> Child:
        """Started with `environ` (NOTIFY_SOCKET and the watchdog's included: once it is the main
        process, systemd hears it) and our stdout and stderr (the journal). Raises OSError."""
        # sh starts the agent in the background, says its pid and leaves: the agent is orphaned at
        # once (reparented to the service manager, or the nearest subreaper). Its stdout goes
        # where our stderr goes (the journal), never into the pipe that carries the pid.
        launcher = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            '"$@" >&2 </dev/null & echo $!',
            "sh",
            *argv,
            env=dict(environ),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
        )
        said, _ = await launcher.communicate()
        if launcher.returncode != 0 or not said.strip().isdigit():
            raise OSError(f"/bin/sh could not start {argv[0]} (status {launcher.returncode})")
        pid = int(said)
        return cls(pid, os.pidfd_open(pid))

    @property
    def running(self) -> bool:
        return not self._gone.is_set()

    async def exited(self) -> None:
        await self._gone.wait()

    def _exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self._gone.set()

    def close(self) -> None:
        """Forget the child (it is the unit's main process now, or gone)."""
        if self._pidfd >= 0:
            if not self._gone.is_set():
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    async def stop(self, grace: float = CHILD_STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after `grace`; gone either way (whoever reaps it)."""
        if self.running:
            self._signal(signal.SIGTERM)
            if not await waits.event(self._gone, grace):
                self._signal(signal.SIGKILL)
                await self._gone.wait()
        self.close()

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signum)


@dataclass
class UpgradeRecord:
    """How this agent's in-place upgrades stand, as Describe tells whoever asked for one."""

    attempts: int = 0
    state: UpgradeState = UpgradeState.IDLE
    why: str = ""
    pid: int = 0  # the child of the last attempt, once started (0: none yet)
    agreed: int = 0  # the child we agreed may register with the kubelet (0: none)

    def said(self) -> dict[str, Any]:
        return {"upgrade": {**asdict(self), "state": self.state.value}}


async def replace_self(
    instance: Optional[str],
    environ: Mapping[str, str],
    hand_over: Callable[[int], Awaitable[Optional[str]]],
    hand_off: Callable[[int], Awaitable[Optional[str]]] = lambda pid: _nothing(),
    started: Callable[[int], None] = lambda pid: None,
    cmdline: Optional[Sequence[str]] = None,
) -> tuple[Optional[int], str]:
    """Start the installed agent as we were started, under a new instance name (`started` is told
    its pid), and hand over to it: (its pid, the socket it serves on) once `hand_over(pid)` found
    it ready and `hand_off(pid)` made it the unit's main process (None; else it says why not), or
    (None, why not) with the child gone again."""
    argv = command_line(child_instance(instance), cmdline)
    try:
        child = await Child.start(argv, {**environ, contracts.PREDECESSOR_ENV: str(os.getpid())})
    except OSError as exc:
        return None, f"cannot start {argv[0]}: {exc}"
    started(child.pid)
    took_over = False
    try:
        handed = asyncio.ensure_future(hand_over(child.pid))
        gone = asyncio.ensure_future(child.exited())
        try:
            await asyncio.wait({handed, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (handed, gone):
                task.cancel()
        if handed.done() and not handed.cancelled() and handed.result() and child.running:
            why = await hand_off(child.pid)
            if why is not None:
                return None, f"the new agent (pid {child.pid}) was ready, but {why}"
            took_over = True
            return child.pid, str(handed.result())
        if not child.running:
            return None, f"the new agent (pid {child.pid}) exited before it was ready"
        return None, f"the new agent (pid {child.pid}) was not ready within {READY_TIMEOUT_S:g} s"
    finally:
        if took_over:
            child.close()
        else:
            await child.stop()


async def _nothing() -> Optional[str]:
    return None


@dataclass(eq=False)
class Upgrader:
    """The agent's in-place upgrades, whole: whether one may start, the child started and handed
    the kubelet (its side's hand_over) and the unit, the agreement that lets the child register,
    the outcome recorded (UpgradeRecord) and said; and, in a child, taking over the unit once the agent
    it replaced has exited. The agent asks only while it runs (not once it stops or hands over)."""

    instance: Optional[str]
    environ: Mapping[str, str]
    side: Optional[Succession]  # None: the side cannot hand over, and every upgrade is refused
    notifier: Notifier
    ready: Callable[[], bool]  # the agent's readiness
    handed_over: Callable[[], None]  # the child has the kubelet and the unit: the agent stops
    on_change: Callable[[], None]  # readiness may now be ours to say (we took over the unit)
    record: UpgradeRecord = field(default_factory=UpgradeRecord)

    def __post_init__(self) -> None:
        # The agent an in-place upgrade replaced with us (0: none), for the upgrade command.
        self.replaced = self.notifier.predecessor or 0
        self._task: Optional[asyncio.Future[None]] = None

    @property
    def upgrading(self) -> bool:
        """Whether an upgrade of ours is under way (its child may register: we do not)."""
        return self.record.state is UpgradeState.RUNNING

    def said(self) -> dict[str, Any]:
        """What Describe says of our upgrades, and of the agent we replaced."""
        return {"replaced": self.replaced, **self.record.said()}

    def request(self) -> None:
        """Replace this process with the code installed now, without a gap (SIGUSR2)."""
        if self.under_way() is not None:
            log.info("in-place upgrade requested: one is already under way")
            return
        if self.side is None:
            self._refuse("this agent's kubelet protocol cannot hand over to a successor")
        elif not self.notifier.under_systemd or self.notifier.predecessor is not None:
            # Only systemd can be told that the new process is the one to watch; and until our
            # predecessor is gone we are not yet the unit's main process.
            why = "not under systemd" if not self.notifier.under_systemd else "still taking over"
            self._refuse(f"in-place upgrades need systemd's notify socket ({why})")
        else:
            self._task = asyncio.ensure_future(self._upgrade(self.side))

    def _refuse(self, why: str) -> None:
        self.record.attempts += 1
        self.record.state, self.record.why = UpgradeState.FAILED, why
        log.warning("in-place upgrade refused: %s", why)

    def under_way(self) -> Optional[asyncio.Future[None]]:
        """The upgrade under way, if any (a stop cancels it with the agent's tasks)."""
        return self._task if self._task is not None and not self._task.done() else None

    async def _upgrade(self, side: Succession) -> None:
        record = self.record
        record.attempts += 1
        record.state, record.why, record.pid, record.agreed = UpgradeState.RUNNING, "", 0, 0
        log.info("in-place upgrade requested: starting the installed agent beside this one")
        self.notifier.reloading("upgrading in place: starting the installed agent")
        # A ready agent waits for a ready child; an unready one has no readiness to keep, and
        # only needs the child serving.
        require_ready = self.ready()

        def started(pid: int) -> None:
            record.pid = pid

        pid, said = await replace_self(
            self.instance,
            self.environ,
            lambda pid: side.hand_over(READY_TIMEOUT_S, pid=pid, require_ready=require_ready, seen=self._seen),
            hand_off=lambda pid: self.notifier.hand_off(pid, f"handed over to pid {pid} in an in-place upgrade"),
            started=started,
        )
        if pid is None:
            registered = record.agreed != 0
            record.state, record.why = UpgradeState.FAILED, said
            log.warning("in-place upgrade failed: %s; this agent (%s) serves on", said, __version__)
            self.notifier.reloaded()
            # The child is gone; if it may have registered, the kubelet's endpoint or device list
            # may be its, not ours.
            side.after_failed_hand_over(registered)
            return
        record.state, record.pid = UpgradeState.DONE, pid
        log.info("in-place upgrade: handed over to pid %d (%s); leaving", pid, said)
        self.handed_over()

    def _seen(self, child: Description) -> None:
        """The child's answers while we wait for it: it asks before it registers."""
        record = self.record
        if (
            child.registering
            and record.state is UpgradeState.RUNNING
            and record.agreed != child.identity.pid
            and self.side is not None
            and not self.side.registration_in_flight()  # the child asks again: ours goes first
        ):
            record.agreed = child.identity.pid
            log.info("in-place upgrade: the new agent (pid %d) may register with the kubelet", record.agreed)

    async def predecessor_gone(self, pid: int) -> None:
        """We are an in-place upgrade's child: once the agent we replace has exited, we are the
        unit's main process and speak for it."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = -1
        if pidfd >= 0:
            gone = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.add_reader(pidfd, gone.set)
            try:
                await gone.wait()
            finally:
                loop.remove_reader(pidfd)
                os.close(pidfd)
        log.info("the agent we replaced (pid %d) has exited: this process speaks for the unit", pid)
        self.notifier.take_over()
        self.on_change()  # READY=1 now if we are ready (it was not ours to say before)
        await asyncio.Event().wait()  # an agent task runs until cancelled
