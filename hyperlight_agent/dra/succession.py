"""The DRA side's succession (kubelet_side.Succession): how an instance of our driver gives way to
another on this node without a gap (a surge update's new pod, a deleted pod's replacement, an
in-place upgrade's child), and how it holds back beside one. The other instances are found and
asked by dra/instances.py; this module decides what their answers mean for us.

    succession = DraSuccession(instances, registrar, service_calls, observation, look_again)
    await succession.hand_over(timeout)    serve on until a successor is ready and settled, and
                                           the kubelet is done with us; its socket
    await succession.may_register()        returns once registering would not fail every claim
    succession.serving()                   registered, the device healthy: all but the slice
    await succession.slice_keeper()        another instance keeping the slice instead of us
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from hyperlight_agent import peers, transport
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.dra.instances import Instances
from hyperlight_agent.dra.registration import DriverServers
from hyperlight_agent.identity import Description

log = logging.getLogger(__name__)


class DraSuccession:
    def __init__(
        self,
        instances: Instances,
        registrar: DriverServers,
        calls: transport.Calls,
        observation: SharedObservation,
        look_again: Callable[[], None],
    ) -> None:
        """`calls`: the DRAPlugin service's; look_again(): the slice is ours to keep again."""
        self.instances = instances
        self._registrar = registrar
        self._calls = calls
        self._observation = observation
        self._look_again = look_again

    async def hand_over(
        self,
        timeout: float,
        pid: Optional[int] = None,
        require_ready: bool = True,
        seen: Optional[Callable[[Description], None]] = None,
    ) -> Optional[str]:
        """On a stop: serve on until another instance of our driver on this node is registered
        and ready (a surge update, or a deleted pod's replacement), at most `timeout` seconds. The
        kubelet calls the newest connected instance, so from then on new claims go there; a call it
        sent us just before may still be on its way, and deregistering closes the kubelet's
        connection to us (dra_plugin_manager.go, remove: conn.Close()), failing it ("the client
        connection is closing"; the pod waits for the kubelet's retry). So we wait until no call
        is in flight and none arrived for transport.QUIET_S: calls are concurrent here, so nothing
        proves it sooner. Before that, until the successor's registration has settled (within
        `timeout`): the kubelet may still take it back (registration.REGISTRATION_SETTLE_S).
        Returns the successor's socket."""
        if not self._registrar.serving:
            return None
        deadline = asyncio.get_running_loop().time() + timeout
        successor = await self.instances.successor(timeout, pid=pid, require_ready=require_ready, seen=seen)
        if successor:
            if not await self.instances.settled(successor, deadline):
                log.info("%s was registered too recently to be sure the kubelet keeps it", successor)
            calls = self._calls
            why = await transport.until_quiet(lambda: calls.in_flight, lambda: calls.received)
            log.info("the kubelet is done with us: %s", why)
        return successor

    def after_failed_hand_over(self, successor_registered: bool) -> None:
        """The kubelet calls the newest connected instance, and a stopped one is deregistered: it
        calls us again by itself. The ResourceSlice is looked at again (ours to keep again)."""
        self._look_again()

    def registration_in_flight(self) -> bool:
        """The DRA registration is a socket the kubelet finds: nothing of ours is on its way."""
        return False

    async def newer_instance(self) -> Optional[str]:
        """The name of a live instance of our driver on this node that started after us, if any:
        it keeps the CDI spec (peers.py)."""
        return await self.instances.newer()

    def serving(self) -> bool:
        """Registered with the kubelet and the device healthy: all but the slice (which only a
        serving instance may take from another: slice_keeper)."""
        observation = self._observation
        return self._registrar.registered and observation.version > 0 and observation.current.healthy

    async def slice_keeper(self) -> Optional[str]:
        """The name of a live instance of our driver on this node that keeps the ResourceSlice
        instead of us, if any (dra/instances.py; serving: registered, the device healthy)."""
        return await self.instances.keeping_slice(self.serving())

    async def may_register(self) -> None:
        """Returns when we may register: our registration socket makes us the newest instance,
        which the kubelet calls; with our device unhealthy beside a ready instance of ours (a
        successor whose check fails) every claim would fail, so it waits for a healthy device or
        for that instance to go. Alone, we register before the first check has completed: the
        kubelet's health stream then shows claims prepared before our start as Unknown, not as
        nothing, and a Prepare waits for a check anyway."""
        await peers.hold(self._hold_reason, self._observation, _said, first_check=False)

    async def _hold_reason(self, observation: Observation) -> str:
        if observation.healthy:
            return ""
        ready = await self.instances.successor(peers.PEER_TIMEOUT_S, leaving_too=True)  # it serves the kubelet
        return f"not registering while the device is unhealthy: {ready} serves the kubelet" if ready else ""


def _said(reason: str) -> None:
    if reason:
        log.info("%s", reason)
