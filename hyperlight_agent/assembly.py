"""The agent's parts, built from the settings and the mode and wired to each other, as one bundle
(agent.py composes them): how we are seen (the face, with its metrics), who we are to other
instances of ours, the directory watcher, the observation every part reads, the probe helper and
the checker, the NFD labels keeper, and the kubelet side of the mode's protocol.

A completed check is counted in the metrics, names the hypervisor in the labels keeper's file and
changes the agent's status; the CDI spec is the newest instance's to keep, which the side's
succession (if it offers one) finds. Every socket of ours serves the health service and Describe
(peers.py: the side's word, then the agent's). What the parts ask of the agent as a whole (its
status and readiness, its stop, its upgrades) comes in as AgentHooks.

    built = assemble(settings, mode, notifier, environ, hooks)
    built.side, built.checker, built.face, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional

import grpc

from hyperlight_agent import modes, parts, peers
from hyperlight_agent.config import Settings
from hyperlight_agent.device.checker import Checker
from hyperlight_agent.device.helper import ProbeHelper
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.files import labels
from hyperlight_agent.files.watcher import DirectoryWatcher
from hyperlight_agent.host.face import Face
from hyperlight_agent.host.notify import Notifier
from hyperlight_agent.identity import Identity
from hyperlight_agent.kubelet_side import KubeletSide, Wiring, succession


@dataclass(frozen=True)
class AgentHooks:
    """What the parts call on the agent as a whole."""

    status_changed: Callable[[], None]  # readiness or status may have changed
    ready: Callable[[], bool]
    described: Callable[[], Mapping[str, Any]]  # what Describe says beyond the side's word
    predecessor: Callable[[], Optional[int]]  # the pid of the agent an in-place upgrade replaces
    upgrading: Callable[[], bool]  # an in-place upgrade of ours is under way


class Assembly(NamedTuple):
    face: Face
    identity: Identity
    watcher: DirectoryWatcher
    observation: SharedObservation
    helper: ProbeHelper
    checker: Checker
    labels: Optional[labels.Keeper]
    side: KubeletSide[Any]


def assemble(
    settings: Settings, mode: modes.Mode, notifier: Notifier, environ: Mapping[str, str], hooks: AgentHooks
) -> Assembly:
    """Every part, built and wired; each watch registered with the watcher by its owner."""
    face = parts.face(settings, mode, notifier, environ)
    me = Identity.of(settings.instance or "", mode.protocol, mode.resource)
    watcher = DirectoryWatcher()
    observation = SharedObservation()
    helper = ProbeHelper(on_timeout=face.metrics.helper_timeouts.inc)
    features_dir = parts.features_dir(settings, mode)
    keeper = labels.Keeper(features_dir) if features_dir else None
    if keeper is not None:
        keeper.watch(watcher)
    side: Optional[KubeletSide[Any]] = None  # built below: the checker and the side need each other

    def checked(found: Observation, seconds: float, repaired: bool) -> None:
        face.metrics.check_done(found, seconds, repaired)
        if keeper is not None:
            keeper.sync(found.hypervisor)
        hooks.status_changed()

    checker = Checker(
        parts.check_target(settings, mode),
        helper,
        observation,
        on_result=checked,
        keeper=lambda: _newer_instance(side),
        interval_s=settings.check_interval_seconds,
    )
    checker.watch(watcher)

    def serve_ours(server: grpc.aio.Server) -> None:
        """The health service and Describe (peers.py), on every socket of ours."""
        described = lambda: {**(side.described() if side is not None else {}), **hooks.described()}  # noqa: E731
        face.serve_ours(server, peers.describe_handler(me, hooks.ready, described))

    wiring = Wiring(
        observation=observation,
        checker=checker,
        identity=me,
        serve_ours=serve_ours,
        watcher=watcher,
        on_change=hooks.status_changed,
        environ=environ,
        predecessor=hooks.predecessor,
        upgrading=hooks.upgrading,
    )
    side = parts.kubelet_side(settings, mode, wiring, face.metrics.families)
    return Assembly(face, me, watcher, observation, helper, checker, keeper, side)


async def _newer_instance(side: Optional[KubeletSide[Any]]) -> Optional[str]:
    """A live instance of ours for the same resource on this node that started after us: the CDI
    spec is its to keep (peers.py). A side that cannot be succeeded has none."""
    offered = succession(side) if side is not None else None
    return await offered.newer_instance() if offered is not None else None
