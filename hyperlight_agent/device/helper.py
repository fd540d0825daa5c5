"""The probe helper, seen from the agent: one long-lived child process, bounded per request.

A fresh process per check costs ~13 ms here against a ~0.4 ms probe, so the helper lives on
and answers requests over a pipe. When a request misses its deadline the helper is killed
(the only way to abandon an ioctl stuck in the kernel) and replaced on the next check. At most
one helper exists at any time: a killed helper that has not been reaped blocks new checks,
which fail fast with "previous probe has not exited" instead of accumulating processes.

A helper runs the agent's own code, not whatever is installed when it starts: the agent reads
the sources of the helper's modules once, as it starts (`SOURCES`), and hands them to every
helper it starts, first thing on its stdin. A package upgrade replaces the files under a
running agent, and one that fails leaves the old agent serving on: a helper it started later
(after a kill, a crash) would otherwise have run the newer tree's probe for the older agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import importlib.abc
import json
import logging
import os
import signal
import sys
from typing import Callable, NamedTuple, Optional, Sequence

from hyperlight_agent import waits
from hyperlight_agent.device.helper_process import READY_LINE
from hyperlight_agent.text import cause

log = logging.getLogger(__name__)

PROBE_DEADLINE_S = 2.0
# A fresh helper says READY once its interpreter has started and imported the probes; that start
# gets this long, separately from the probe's deadline. On a loaded node an interpreter's start
# can take seconds, and counting it against the device made a successor's first check fail (its
# first list to the kubelet then all unhealthy: the node counted no device for 0.6 s).
HELPER_START_S = 10.0
# Closing: the helper gets this long to exit on EOF, then is killed and reaped within its deadline.
CLOSE_EOF_WAIT_S = 0.5
CLOSE_BOUND_S = CLOSE_EOF_WAIT_S + PROBE_DEADLINE_S


class ProbeRequest(NamedTuple):
    """One check for the helper: open `device`, confirm it is the host's node, run the row's probe."""

    hypervisor: str
    device: str
    host: Optional[str] = None  # where the host's own node is visible; None: `device` is


class ProbeResult(NamedTuple):
    ok: bool
    reason: str = ""
    # The helper itself failed (stalled, killed, died, garbled): says nothing about the device.
    helper_fault: bool = False
    # The agent is out of file descriptors, processes or memory (it could not even start or talk
    # to a helper): says nothing about the device either.
    exhausted: bool = False


# errnos that mean "this process is out of resources", not "the helper or the device failed".
EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM)
# Every helper's command line contains this, so `ps` shows what the child is (tests find
# their own helpers by it and by parent PID).
HELPER_MARK = "from hyperlight_agent.device.helper_process import serve"
# What the helper runs: helper_process and the modules of ours it imports (the standard library
# besides), packages first. A module missing here fails the helper's start with an ImportError.
HELPER_MODULES = (
    "hyperlight_agent",
    "hyperlight_agent.text",
    "hyperlight_agent.device",
    "hyperlight_agent.device.kernel",
    "hyperlight_agent.device.hypervisors",
    "hyperlight_agent.device.helper_process",
)
# The helper's first act: read one JSON line {module: [is_package, source]} from stdin, import our
# modules from it alone (nothing of ours is on its path), then serve.
_BOOTSTRAP = (
    "import sys, json; from importlib.machinery import ModuleSpec; "
    "S = json.loads(sys.stdin.buffer.readline())\n"
    "class F:\n"
    " def find_spec(n, path=None, target=None): return ModuleSpec(n, F, is_package=S[n][0]) if n in S else None\n"
    " def create_module(spec): return None\n"
    " def exec_module(m): exec(compile(S[m.__name__][1], '<agent ' + m.__name__ + '>', 'exec'), m.__dict__)\n"
    "sys.meta_path.insert(0, F)\n"
    f"{HELPER_MARK}; serve()"
)


def read_sources() -> bytes:
    """The sources of HELPER_MODULES as this process finds them now, as the helper's first line."""
    found = {}
    for name in HELPER_MODULES:
        module = importlib.import_module(name)
        loader = module.__spec__.loader if module.__spec__ else None
        source = loader.get_source(name) if isinstance(loader, importlib.abc.InspectLoader) else None
        if source is None:
            raise ImportError(f"the probe helper's module {name} has no source to hand over", name=name)
        found[name] = [hasattr(module, "__path__"), source]
    return json.dumps(found).encode() + b"\n"


# Read as the agent starts (it imports this module then): the code the agent runs.
SOURCES = read_sources()


def default_argv() -> list[str]:
    """`python -I -S -B`: no site-packages, so the helper cannot import grpc even by accident,
    and no bytecode written next to the modules (a package's files belong to its manager). Its
    stdin must start with SOURCES."""
    return [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP]


class ProbeHelper:
    """Runs probe requests in the helper process, one at a time, each within `deadline`."""

    def __init__(
        self,
        argv: Optional[Sequence[str]] = None,
        deadline: float = PROBE_DEADLINE_S,
        kill: Callable[[int, int], None] = os.kill,
        on_timeout: Optional[Callable[[], None]] = None,
        sources: bytes = SOURCES,
    ) -> None:
        self._argv = list(argv) if argv is not None else default_argv()
        # A helper of another command line (a test's) is not ours to hand sources to.
        self._preamble = sources if argv is None else b""
        self.deadline = deadline
        self._kill = kill  # a parameter so tests can simulate a helper stuck in the kernel
        self._on_timeout = on_timeout
        self._proc: Optional[asyncio.subprocess.Process] = None
        # A killed helper whose exit we have not yet seen, and the task that reaps it.
        self._dying: Optional[asyncio.subprocess.Process] = None
        self._reaper: Optional[asyncio.Future[int]] = None
        self._stuck = False
        self._lock = asyncio.Lock()
        self.started = 0  # helper processes started so far (benchmarks and tests read this)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    @property
    def dying_pid(self) -> Optional[int]:
        return self._dying.pid if self._dying else None

    async def run(self, request: ProbeRequest) -> ProbeResult:
        """Send one request; the helper's result, or a helper_fault result on any failure.

        A helper that died (killed while idle, crashed, garbled its reply) is replaced and the
        request sent once more before a failure is returned: its death says nothing about the
        device. A missed deadline is not retried (the device itself may hang the probe)."""
        async with self._lock:
            result, retry = await self._attempt(request)
            if retry:
                log.info("%s; asking a fresh helper", result.reason)
                result, _ = await self._attempt(request)
            return result

    async def _attempt(self, request: ProbeRequest) -> tuple[ProbeResult, bool]:  # noqa: PLR0911 - one per outcome
        """One request to the helper: (result, whether the failure is the helper's death)."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.deadline
        if self._dying is not None:
            # The first check after a kill spends its budget waiting for the exit; once
            # that has failed, later checks fail at once until the helper is reaped.
            budget = 0.0 if self._stuck else give_up_at - loop.time()
            if not await self._reap(budget):
                self._stuck = True
                return _failure(f"previous probe has not exited (pid {self._dying.pid})"), False
            self._stuck = False
        try:
            proc, fresh = await self._ensure_started()
            if fresh:  # its start was not the probe's: the request gets a whole deadline
                give_up_at = loop.time() + self.deadline
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(request._asdict()).encode() + b"\n")
            await proc.stdin.drain()
            line = await waits.within(proc.stdout.readline(), give_up_at - loop.time())
        except _NotStarted as exc:
            self._abandon()
            return _failure(str(exc)), False
        except asyncio.TimeoutError:
            self._abandon()
            if self._on_timeout:
                self._on_timeout()
            return _failure(f"probe did not finish within {self.deadline:g} s (helper killed)"), False
        except asyncio.CancelledError:
            # Our caller went away mid-request: the reply would pair with the next request.
            self._abandon()
            raise
        except OSError as exc:
            self._abandon()
            if exc.errno in EXHAUSTED:
                return ProbeResult(
                    False, f"cannot run the probe helper: {cause(exc)}", helper_fault=True, exhausted=True
                ), False
            return _failure(f"probe helper failed: {exc}"), True
        if not line:
            self._abandon()
            return _failure("probe helper exited unexpectedly"), True
        try:
            reply = json.loads(line)
            return ProbeResult(bool(reply["ok"]), str(reply["reason"])), False
        except (ValueError, TypeError, KeyError):
            self._abandon()
            return _failure(f"probe helper sent a malformed reply: {line[:80]!r}"), True

    async def close(self) -> None:
        """Stop the helper (EOF on its stdin, then kill) and reap everything."""
        async with self._lock:
            proc = self._proc
            if proc is not None and proc.returncode is None and proc.stdin is not None:
                proc.stdin.close()
                with contextlib.suppress(asyncio.TimeoutError):
                    await waits.within(proc.wait(), CLOSE_EOF_WAIT_S)
            self._abandon()
            await self._reap(self.deadline)

    async def _ensure_started(self) -> tuple[asyncio.subprocess.Process, bool]:
        """The running helper, started (and READY) if need be; whether it was started now.
        Raises _NotStarted."""
        if self._proc is not None and self._proc.returncode is None:
            return self._proc, False
        self._proc = await asyncio.create_subprocess_exec(
            *self._argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            close_fds=True,
        )
        self.started += 1
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            if self._preamble:
                self._proc.stdin.write(self._preamble)
                await self._proc.stdin.drain()
            said = await waits.within(self._proc.stdout.readline(), HELPER_START_S)
        except asyncio.TimeoutError:
            raise _NotStarted(f"probe helper did not start within {HELPER_START_S:g} s (killed)") from None
        if said != READY_LINE:
            raise _NotStarted(
                "probe helper exited unexpectedly"
                if not said
                else f"probe helper sent {said[:80]!r} instead of saying it was ready"
            )
        return self._proc, True

    def _abandon(self) -> None:
        """Kill the current helper and start reaping it in the background."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._kill(proc.pid, signal.SIGKILL)
        self._dying = proc
        self._reaper = asyncio.ensure_future(proc.wait())

    async def _reap(self, budget: float) -> bool:
        """Wait up to budget seconds for the killed helper to exit; True once it has."""
        if self._dying is None or self._reaper is None:
            return True
        if not self._reaper.done():
            try:
                await waits.within(asyncio.shield(self._reaper), max(budget, 0.0))
            except asyncio.TimeoutError:
                if not self._stuck:
                    log.warning("probe helper pid %d has not exited after SIGKILL", self._dying.pid)
                return False
        self._dying = None
        self._reaper = None
        return True


class _NotStarted(Exception):
    """A fresh helper did not say READY in time (a failure of the helper, not of the device)."""


def _failure(reason: str) -> ProbeResult:
    return ProbeResult(False, reason, helper_fault=True)
