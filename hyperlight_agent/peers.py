"""The other instances of our agent on this node, as each instance sees them through the sockets
they serve: who they are, whether one is ready to take over from us, and whether one is newer.

Two instances run side by side during a surge update or the replacement of a deleted pod (and,
under systemd, an in-place upgrade). Their sockets are the only thing they share, so each serves
one small gRPC method beside its kubelet protocol, `Describe`, answering who it is as JSON:

    {"agent": "hyperlight-agent", "version": "0.1.0", "instance": "web-1", "protocol": "dra",
     "resource": "hypervisor.hyperlight.dev", "started": 5123456789, "pid": 42, "ready": true,
     "serving": true, "calls": 17, "registering": false, "replaced": 0, "settling": false,
     "stopping": false, "upgrade": {...}}

`started` is CLOCK_BOOTTIME in nanoseconds at the agent's start: one clock for every container on
the node, never set back. Asking by socket is what makes an answer trustworthy enough: another
vendor's driver, a test tool serving the standard gRPC health service at a name like ours, or a
socket that accepts and never answers is no instance of ours.

- `successor()`: a ready instance of ours for the same resource, to hand the kubelet over to, and
  never one that is stopping itself: two instances stopping at once (a driver pod deleted while
  the one it replaced still hands over) would each hand over to the other and leave the kubelet
  with neither. Each sets `stopping` before it looks, so the later of the two never takes the
  earlier (an earlier release never says `stopping`: beside one, the old way holds). (`leaving_too`:
  any instance serving the kubelet now, for the holds.) All
  candidates are asked at once, each within PEER_TIMEOUT_S and all within the caller's timeout,
  so a hundred silent sockets cost that timeout, not a hundred. An instance of an earlier
  release (no Describe) still counts when it proves its protocol and says it is ready.
- `newer()`: a live instance of ours for the same resource that started after us. The newest
  instance writes what all of them would write (the CDI spec); the others leave it alone rather
  than fight (docs/decisions/whose-spec-and-slice-stand.md).
- `outranking()`: the same for what only a serving instance may write (the ResourceSlice): a
  serving instance outranks one that is not, whatever their age, so a successor that never
  became ready never takes the slice from a ready predecessor.
- `find()`: the instance that is a given process (an in-place upgrade's predecessor or child).

Besides who it is, an instance says how it stands: `ready` (its readiness), `serving` (ready but
for what it shares with its peers: registered with the kubelet and its device healthy), `calls`
(the kubelet's calls it has received: Allocate, NodePrepareResources), `registering` (it waits for
its predecessor's agreement before registering: host/successor.py), `replaced` (the pid of the
agent an in-place upgrade replaced with it), `settling` (a DRA registration the kubelet may still
take back: dra/instances.py waits it out before handing over), `stopping` (its stop has begun) and,
from an agent that can upgrade in place, `upgrade` (host/successor.py's UpgradeRecord).

Why: docs/decisions/an-unready-successor-takes-nothing.md,
docs/decisions/whose-spec-and-slice-stand.md,
docs/decisions/who-is-a-successor.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from dataclasses import asdict
from typing import Any, Awaitable, Callable, Iterable, Mapping, Optional

import grpc

from hyperlight_agent import transport, waits
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.identity import AGENT, Description, Identity

log = logging.getLogger(__name__)

SERVICE = "hyperlight.agent.v1.Instance"
DESCRIBE = f"/{SERVICE}/Describe"
# An instance of ours answers in milliseconds on an idle host; one that does not within this is
# not a successor. 0.5 s was too short on a starved host: a ready successor's answer came late in
# CI (`systemctl reload`) and beside a cold build (a newer instance missed), so the old instance
# kept what was the new one's. A silent socket costs a search this much, and never its deadline.
PEER_TIMEOUT_S = 2.0
# How often the candidates are asked again while waiting for a successor.
POLL_S = 0.1
# At most this many candidates are asked at once (a directory full of sockets is no reason to
# open a hundred channels).
MAX_CONCURRENT = 16
MAX_ANSWER_BYTES = 4096
# While an instance holds its registration back (hold()), it looks again this often; a new device
# check result wakes it at once. Only in that state: an instance that registers never polls.
HOLD_POLL_S = 1.0


class UpgradeState(str, enum.Enum):
    """How an instance's last in-place upgrade stands, as its Describe says it (`upgrade.state`;
    the values are the wire's: peers of other releases read them)."""

    IDLE = "idle"  # none asked for
    RUNNING = "running"  # a child started, not yet handed over to
    DONE = "done"  # the child (`pid`) took over; we are leaving
    FAILED = "failed"  # the child is gone again (`why`); we serve on


def describe_handler(
    identity: Identity, ready: Callable[[], bool], more: Callable[[], Mapping[str, Any]] = dict
) -> grpc.GenericRpcHandler[Any, Any]:
    """The Describe method, for a server that serves one of our sockets (`more`: further fields)."""

    async def describe(request: bytes, context: Any) -> bytes:
        return json.dumps({**asdict(identity), "ready": bool(ready()), **more()}).encode()

    handler = grpc.unary_unary_rpc_method_handler(describe)  # bytes in, bytes out
    return grpc.method_handlers_generic_handler(SERVICE, {"Describe": handler})


class Legacy(Exception):
    """The server at `target` has no Describe (an earlier release, or not ours at all)."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.target = target


async def describe(path: str, timeout: float) -> Optional[Description]:
    """Ask the instance serving the unix socket at `path`; None when nothing of ours answers.
    Raises Legacy when a server answers without the method."""
    async with grpc.aio.insecure_channel(transport.unix_target(path)) as channel:
        try:
            answer = await channel.unary_unary(DESCRIBE, None, None)(b"", timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise Legacy(path) from None
            return None
    return _parse(answer, path)


def _parse(answer: Any, path: str) -> Optional[Description]:
    if not isinstance(answer, bytes) or len(answer) > MAX_ANSWER_BYTES:
        return None
    try:
        doc = json.loads(answer)
        identity = Identity(
            instance=str(doc["instance"]),
            protocol=str(doc["protocol"]),
            resource=str(doc["resource"]),
            started=int(doc["started"]),
            pid=int(doc["pid"]),
            version=str(doc["version"]),
            agent=str(doc["agent"]),
        )
        upgrade = doc.get("upgrade")
        ready = doc["ready"] is True
        calls = doc.get("calls")
        replaced = doc.get("replaced")
        return Description(
            identity,
            ready,
            path,
            upgrade if isinstance(upgrade, dict) else None,
            serving=doc.get("serving", ready) is True,
            calls=calls if isinstance(calls, int) and not isinstance(calls, bool) else None,
            registering=doc.get("registering") is True,
            replaced=replaced if isinstance(replaced, int) and not isinstance(replaced, bool) else 0,
            settling=doc.get("settling") is True,
            stopping=doc.get("stopping") is True,
        )
    except (ValueError, KeyError, TypeError):
        return None


# A peer of an earlier release: whether it proves its protocol (it is a device plugin, or a DRA
# driver of ours) and its gRPC health says it is ready, within the budget. The protocol side supplies it.
LegacyReady = Callable[[str, float], Awaitable[bool]]
# From a socket found in a directory to the socket its instance answers Describe on (the DRA
# registration socket names the service socket in GetInfo), within the budget; None: not ours.
Resolve = Callable[[str, float], Awaitable[Optional[str]]]


async def _same(path: str, budget: float) -> Optional[str]:
    return path


async def _ask(path: str, budget: float, resolve: Resolve) -> tuple[Optional[str], Optional[Description]]:
    """(the socket the candidate at `path` answers on, what it said there): (None, None) when it is
    nothing of ours; a description of None from one of an earlier release (raises Legacy)."""
    target = await resolve(path, budget)
    if target is None:
        return None, None
    return target, await describe(target, budget)


async def successor(
    me: Identity,
    candidates: Callable[[], Iterable[str]],
    timeout: float,
    resolve: Resolve = _same,
    legacy_ready: Optional[LegacyReady] = None,
    pid: Optional[int] = None,
    require_ready: bool = True,
    seen: Optional[Callable[[Description], None]] = None,
    leaving_too: bool = False,
) -> Optional[str]:
    """The socket of a ready instance of ours for our resource, looked for at most `timeout` s;
    None then. Both kubelet sides hand over through this one step (timeout → deadline →
    candidates → wait): only their candidates, resolve and proof of an earlier release differ.
    `candidates()` lists sockets that may be one (never ours); the socket returned is the one the
    successor answered on (resolved from its candidate). With `pid`, only that process counts (the
    child an in-place upgrade started), and without `require_ready` it need only answer (an
    unready agent has no readiness to hand over); `seen` is given every answer of that process,
    ready or not. One that says it is stopping counts only with `leaving_too`."""

    passed_over: set[str] = set()  # stopping instances said once each

    async def ready(path: str, budget: float) -> Optional[str]:
        try:
            target, found = await _ask(path, budget, resolve)
        except Legacy as legacy:
            ok = pid is None and legacy_ready is not None and await legacy_ready(legacy.target, budget)
            return legacy.target if ok else None
        ours = (
            found is not None
            and (found.ready or not require_ready)
            and me.same_kind(found.identity)
            and found.identity != me
        )
        if ours and found is not None and found.stopping and not leaving_too:
            ours = False
            if found.identity.instance not in passed_over:
                passed_over.add(found.identity.instance)
                log.info("instance %s is stopping too: no successor", found.identity.instance)
        if pid is not None and found is not None and me.same_kind(found.identity) and found.identity.pid == pid:
            if seen is not None:
                seen(found)
        elif pid is not None:
            ours = False
        return target if ours else None

    return await _until(candidates, ready, asyncio.get_running_loop().time() + timeout)


async def newer(
    me: Identity, candidates: Iterable[str], resolve: Resolve = _same, timeout: float = PEER_TIMEOUT_S
) -> Optional[Description]:
    """A live instance of ours for our resource that started after us, if there is one (asked
    once). An earlier release (no Describe) does not yield, so it is not yielded to either."""
    return await _one(candidates, resolve, _is_newer(me), timeout)


async def newer_until(
    me: Identity, candidates: Callable[[], Iterable[str]], deadline: float, resolve: Resolve = _same
) -> Optional[Description]:
    """newer(), looked for until the loop's clock reaches `deadline` (an instance between two
    sockets answers again a moment later)."""
    found: list[Description] = []
    await _until(candidates, _keeping(resolve, _is_newer(me), found), deadline)
    return found[0] if found else None


async def outranking(
    me: Identity, serving: bool, candidates: Iterable[str], resolve: Resolve = _same, timeout: float = PEER_TIMEOUT_S
) -> Optional[Description]:
    """A live instance of ours for our resource that outranks us, we being `serving` or not: one
    that serves when we do not, or, serving alike, one that started after us (asked once).

    Rank is (serving, started, instance, pid): the newest serving instance keeps what only one may
    write, and one that is not serving never takes it from one that is. An earlier release (no
    Describe) neither yields nor is yielded to."""
    rank = (serving, me.started, me.instance, me.pid)

    def outranks(found: Description) -> bool:
        theirs = (found.serving, found.identity.started, found.identity.instance, found.identity.pid)
        return me.same_kind(found.identity) and found.identity != me and theirs > rank

    return await _one(candidates, resolve, outranks, timeout)


async def find(
    pid: int, candidates: Iterable[str], resolve: Resolve = _same, timeout: float = PEER_TIMEOUT_S
) -> Optional[Description]:
    """What the instance of ours that is process `pid` says (asked once), if one answers."""
    return await _one(
        candidates, resolve, lambda found: found.identity.agent == AGENT and found.identity.pid == pid, timeout
    )


async def hold(
    why: Callable[[Observation], Awaitable[str]],
    observation: SharedObservation,
    say: Callable[[str], None],
    poll: Callable[[], float] = lambda: HOLD_POLL_S,
    first_check: bool = True,
) -> None:
    """Returns once `why(observation)` says nothing ("") for a completed device check (or, with
    `first_check` off, for the observation before the first check: an instance alone need not wait
    for it); until then `say(reason)` is told each new reason (and "" at the end, when there was
    one), and the question is asked again on every new check result or after `poll()` seconds.

    What registers us with the kubelet waits here: a Register (device plugin) or a registration
    socket (DRA) makes us the kubelet's choice for the resource, which an instance whose device is
    unhealthy must never take from a ready instance of ours."""
    said = ""
    try:
        while True:
            current = await observation.wait_newer(0) if first_check else observation.current
            version = observation.version
            reason = await why(current)
            if not reason:
                return
            if reason != said:
                said = reason
                say(reason)
            with contextlib.suppress(asyncio.TimeoutError):  # then ask again
                await waits.within(observation.wait_newer(version), poll())
    finally:
        if said:
            say("")


def _is_newer(me: Identity) -> Callable[[Description], bool]:
    return lambda found: me.same_kind(found.identity) and found.identity.is_newer_than(me)


async def _one(
    candidates: Iterable[str], resolve: Resolve, accept: Callable[[Description], bool], timeout: float
) -> Optional[Description]:
    """The first answer `accept` takes among the candidates, asked once within `timeout`."""
    found: list[Description] = []
    await _first(candidates, _keeping(resolve, accept, found), asyncio.get_running_loop().time() + timeout)
    return found[0] if found else None


def _keeping(
    resolve: Resolve, accept: Callable[[Description], bool], kept: list[Description]
) -> Callable[[str, float], Awaitable[Optional[str]]]:
    """The test for _first: an answer `accept` takes, kept in `kept`. An earlier release (no
    Describe) is never taken."""

    async def test(path: str, budget: float) -> Optional[str]:
        try:
            target, found = await _ask(path, budget, resolve)
        except Legacy:
            return None
        if found is not None and accept(found):
            kept.append(found)
            return target
        return None

    return test


async def _until(
    candidates: Callable[[], Iterable[str]], test: Callable[[str, float], Awaitable[Optional[str]]], deadline: float
) -> Optional[str]:
    """_first(), asked again every POLL_S over a fresh list of candidates until `deadline`."""
    loop = asyncio.get_running_loop()
    while True:
        found = await _first(candidates(), test, deadline)
        if found is not None:
            return found
        remaining = deadline - loop.time()
        if remaining <= 0:
            return None
        await asyncio.sleep(min(POLL_S, remaining))


async def _first(
    paths: Iterable[str], test: Callable[[str, float], Awaitable[Optional[str]]], deadline: float
) -> Optional[str]:
    """The first answer (not None) of test(path, budget) for `paths`, asking all at once (at most
    MAX_CONCURRENT at a time), each within PEER_TIMEOUT_S and all before `deadline`."""
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(MAX_CONCURRENT)

    async def one(path: str) -> Optional[str]:
        async with slots:
            budget = min(PEER_TIMEOUT_S, deadline - loop.time())
            if budget <= 0:
                return None
            try:
                return await test(path, budget)
            except (OSError, grpc.RpcError):
                return None

    pending = {asyncio.ensure_future(one(p)) for p in paths}
    try:
        while pending:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.result() is not None:
                    return task.result()
        return None
    finally:
        await waits.cancelled(pending)
