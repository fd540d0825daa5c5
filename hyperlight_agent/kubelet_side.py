"""What the agent needs of a kubelet protocol, and what it gives one: the seam between the
agent's own parts (the device check, the observation, the watcher, readiness, sd_notify, metrics)
and one way of offering the device to the kubelet.

    side = parts.kubelet_side(settings, mode, wiring, series)   # DevicePluginSide or DraSide
    await side.run()           until cancelled: serve, register, stay registered
    side.begin_stop()          the stop's first moment (the kubelet must see it at once)
    await side.close()         bounded by side.close_bound_s
    side.snapshot(obs, checked).ready() / .status()
    await side.succession.hand_over(t)   if it offers Succession: on a stop, serve on until a
                               successor of ours is ready (hand_over_on_stop: only when ready)

The side is given only what it asks of the agent (Wiring, each collaborator typed by a Protocol
of this module or a callback), and reports what it did to its protocol's own outcomes, made by its
row from the agent's metric registry (Series).

A third protocol is its name in modes.KubeletProtocol, one class implementing KubeletSide and one row of
parts.ROWS, which carries everything else the agent asks of a protocol (tests/test_parts.py runs a
toy one through the agent).

Why: docs/decisions/one-side-per-mode.md and docs/decisions/readiness-is-derived.md.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    TypeVar,
    runtime_checkable,
)

from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.identity import Description, Identity

if TYPE_CHECKING:
    import grpc  # the sides' modules load it; this one need not

log = logging.getLogger(__name__)

# A side's target: what parts.py builds from the settings for it (DevicePluginTarget, DraTarget).
Target_contra = TypeVar("Target_contra", contravariant=True)


class Snapshot(Protocol):
    """What readiness depends on, for one side, with readiness and the one-line status as pure
    functions of it. The same answer feeds sd_notify (READY=1, STATUS=), the gRPC health service
    the exec probes ask, Describe (peers.py) and the log; tests call them directly."""

    @property
    def slots(self) -> int:
        """What the side offers the kubelet while ready: slots, or the ResourceSlice's devices."""
        ...

    def ready(self) -> bool: ...

    def status(self) -> str: ...


class Checks(Protocol):
    """A fresh device check (device/checker.py's Checker)."""

    async def check(self, timeout: Optional[float] = None) -> Observation: ...


class Watches(Protocol):
    """Directories watched for wake-ups (files/watcher.py's DirectoryWatcher)."""

    def watch(self, directory: str, callback: Callable[[str], None], names: Optional[set[str]] = None) -> None:
        """Call callback(name) when an entry in directory changes (only `names` if given)."""
        ...

    def watching(self, directory: str) -> bool:
        """Whether `directory` has a live watch now."""
        ...


@dataclass(frozen=True)
class Family:
    """One metric family a part counts into, declared as data: its type ("counter", "gauge" or
    "histogram"), name, help, label names, the label values served at 0 from the start (a series
    born at 1 has no increase() for an alert to see), and a histogram's buckets."""

    kind: str
    name: str
    doc: str
    labels: Sequence[str] = ()
    at_zero: Sequence[Sequence[str]] = ()
    buckets: Sequence[float] = ()


class Series(Protocol):
    """Where a kubelet protocol makes the metric series it counts, in the agent's registry
    (host/metrics.py's Families): make() returns the family's series, or one that ignores every
    call while metrics are off. A protocol's row makes its outcomes from these
    (parts.ProtocolRow.outcomes), so the agent's metrics know no protocol."""

    def make(self, family: Family) -> Any: ...


@dataclass(frozen=True)
class Wiring:
    """What the agent gives its kubelet side: its collaborators, wired in once, each typed by what
    the side asks of it. (Not "shared": that word is the DRA slice's one shared device's.)"""

    observation: SharedObservation  # the device check's result, versioned and broadcast
    checker: Checks  # check(timeout=...): a fresh device check
    identity: Identity  # who we are to other instances of ours on the node
    serve_ours: Callable[[grpc.aio.Server], None]  # adds the health service and Describe to a server
    watcher: Watches  # the side adds its directories' watches
    on_change: Callable[[], None]  # readiness or status may have changed
    environ: Mapping[str, str]  # the process environment (the entry point's)
    # The agent an in-place upgrade replaces with us, while it lives (host/successor.py): None
    # once it has gone, and for every agent not started by an in-place upgrade.
    predecessor: Callable[[], Optional[int]] = lambda: None
    # Whether an in-place upgrade of ours is under way (its child may register: we do not).
    upgrading: Callable[[], bool] = lambda: False


class KubeletSide(Protocol[Target_contra]):
    # How long close() may take at most (its stop grace and any wait the kubelet needs).
    close_bound_s: float

    def describe(self) -> str:
        """What the start line says of this side: its resource or driver, socket and slots."""
        ...

    async def run(self) -> None:
        """Serve the kubelet until cancelled; raises only what must end the agent."""
        ...

    def described(self) -> Mapping[str, Any]:
        """What Describe says of this side: `serving`, `calls` and the like (peers.py)."""
        ...

    def begin_stop(self) -> None:
        """The first moment of a stop: what the kubelet must see at once (a stream's end)."""
        ...

    async def close(self) -> None:
        """Stop serving and remove our sockets, within close_bound_s."""
        ...

    def snapshot(self, observation: Observation, checked: bool) -> Snapshot:
        """This side's readiness inputs, with the device's last observation."""
        ...

    def reconfigure(self, target: Target_contra) -> None:
        """A reload's new target, of the kind the side was built from (parts.side_target);
        restart-only settings are unchanged."""
        ...


@runtime_checkable
class Succession(Protocol):
    """What a side may add, to be succeeded by another instance of ours without a gap (a surge
    update's new pod, an in-place upgrade's child): handing the kubelet over, and yielding the CDI
    spec to a newer instance. A side without it (a row may omit it) stops at once on a stop, keeps
    the CDI spec whoever else runs, and refuses in-place upgrades."""

    async def hand_over(
        self,
        timeout: float,
        pid: Optional[int] = None,
        require_ready: bool = True,
        seen: Optional[Callable[[Description], None]] = None,
    ) -> Optional[str]:
        """Serve on until a successor instance of ours is ready (without `require_ready`: answers), at
        most `timeout` s (with `pid`, only that process counts, and `seen` gets each of its
        answers), and the kubelet is done with us; its socket."""
        ...

    def after_failed_hand_over(self, successor_registered: bool) -> None:
        """The successor we handed over to was stopped: make the kubelet's view ours again."""
        ...

    def registration_in_flight(self) -> bool:
        """Whether a registration of ours is on its way to the kubelet (an in-place upgrade then
        does not yet agree that its child registers)."""
        ...

    async def newer_instance(self) -> Optional[str]:
        """A live instance of ours for the same resource that started after us (peers.py)."""
        ...


def succession(side: KubeletSide[Any]) -> Optional[Succession]:
    """The side's succession, if it offers one (as its `succession`)."""
    offered = getattr(side, "succession", None)
    return offered if isinstance(offered, Succession) else None


async def hand_over_on_stop(
    side: Optional[Succession], timeout: float, ready: bool, stopped_again: Optional[asyncio.Event] = None
) -> None:
    """A stop's first part, with handover_seconds (`timeout`) set: the side serves on until a
    successor of ours is ready and the kubelet is done with us (its hand_over), at most `timeout`,
    or until `stopped_again` is set (a second SIGTERM: whoever sent it wants us gone now; an
    uninstall has no successor to wait for). Only a ready agent has something to hand over. An
    unready one is also one the DaemonSet controller replaces only after it is gone (it surges
    for available pods only): waiting for a successor would only delay the replacement by
    handover_seconds. A side without succession (`side` None) has no successor to wait for."""
    if side is None or timeout <= 0 or not ready or (stopped_again is not None and stopped_again.is_set()):
        return
    log.info("stop requested: serving until a successor is ready (up to %g s; stop again to stop now)", timeout)
    handing_over = asyncio.ensure_future(side.hand_over(timeout))
    again = asyncio.ensure_future(stopped_again.wait()) if stopped_again is not None else None
    try:
        await asyncio.wait([handing_over, *([again] if again else [])], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if again is not None:
            again.cancel()
        cut_short = not handing_over.done()
        if cut_short:
            handing_over.cancel()
            await asyncio.gather(handing_over, return_exceptions=True)
    if cut_short:
        log.info("stopped again: not waiting for a successor")
        return
    successor = handing_over.result()
    if successor:
        log.info("handing over to %s", successor)
    else:
        log.info("no successor within %g s", timeout)


def count(n: int, word: str) -> str:
    """3 slots, 1 stream: for status lines."""
    return f"{n} {word}{'s' if n != 1 else ''}"
