"""The device plugin protocol as the agent's kubelet side: the servicer (ListAndWatch, Allocate)
on a server the registrar keeps registered and streamed, the handover to a successor, and what
readiness needs of it. Everything here exists only in the device plugin modes.

    DevicePluginSide(DevicePluginTarget(kubelet_dir, profile), wiring, DevicePluginOutcomes(series))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import grpc

from hyperlight_agent import contracts, peers, transport
from hyperlight_agent.device.observation import Observation
from hyperlight_agent.deviceplugin import api, handover
from hyperlight_agent.deviceplugin.outcomes import DevicePluginOutcomes
from hyperlight_agent.deviceplugin.registration import Registrar
from hyperlight_agent.deviceplugin.registration_state import State
from hyperlight_agent.deviceplugin.servicer import DevicePluginServicer, Endpoint, Profile
from hyperlight_agent.identity import Description
from hyperlight_agent.kubelet_side import Succession, Wiring, count

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DevicePluginTarget:
    """Where the device plugin talks and what it advertises (parts.side_target)."""

    kubelet_dir: str
    base_socket: str  # the mode's socket without an instance: hyperlight.sock (its peers' names)
    profile: Profile


@dataclass(frozen=True)
class DevicePluginSnapshot:
    """What the device plugin side's readiness depends on."""

    observation: Observation
    checked: bool  # a device check has completed
    registration: State
    registration_error: str
    kubelet_socket: str
    current_streams: int  # open ListAndWatch streams on the server the kubelet registered
    slots: int
    held: str = ""  # why our Register is held back ("" when it is not)

    def ready(self) -> bool:
        """Registered, the kubelet's stream open, and the last device check passed."""
        return (
            self.registration is State.STREAMED
            and self.current_streams > 0
            and self.checked
            and self.observation.healthy
        )

    def status(self) -> str:  # noqa: PLR0911 - one return per state reads best
        """What the agent is doing or waiting for.

        >>> from hyperlight_agent.device.observation import Observation
        >>> ok = Observation(True, "", "kvm")
        >>> DevicePluginSnapshot(ok, True, State.STREAMED, "", "/k/kubelet.sock", 1, 2).status()
        'ready: kvm, 2 slots, 1 stream'
        """
        obs = self.observation
        if self.checked and not obs.healthy:
            return f"unhealthy: {obs.reason}"
        if self.held:
            return self.held
        if self.registration is State.LOST:
            return f"{self.registration_error}; registering again"
        if self.registration is State.WAITING:
            if self.registration_error:
                return f"waiting for kubelet at {self.kubelet_socket}: {self.registration_error}"
            return f"waiting for kubelet at {self.kubelet_socket}"
        if not self.checked:
            return "checking the device"
        if self.registration is State.REGISTERED or self.current_streams == 0:
            return "registered; waiting for the kubelet's ListAndWatch stream"
        return f"ready: {obs.hypervisor}, {count(self.slots, 'slot')}, {count(self.current_streams, 'stream')}"


class DevicePluginSide:
    close_bound_s = transport.STOP_GRACE_S  # our streams end at once; calls in flight get the grace

    def __init__(self, target: DevicePluginTarget, wiring: Wiring, outcomes: DevicePluginOutcomes) -> None:
        self._wiring = wiring
        self._outcomes = outcomes
        self.succession: Succession = self  # its handover is the registrar's and the servicer's own
        self.kubelet_dir = target.kubelet_dir
        self._base_socket = target.base_socket
        self.profile = target.profile
        self.servicer = DevicePluginServicer(
            self.profile,
            wiring.observation,
            wiring.checker,
            on_streams_changed=outcomes.streams_open,
            on_allocate=outcomes.allocated,
        )
        self.registrar = Registrar(
            target.kubelet_dir,
            self.profile.socket,
            self.profile.resource,
            self._configure,
            on_change=self._on_registrar,
            watched=lambda: wiring.watcher.watching(target.kubelet_dir),
            may_register=self._may_register,
        )
        self.held = ""  # why our Register is held back (the status says it)
        self.registering = False  # waiting for the predecessor's agreement (Describe says it)
        registrar = self.registrar
        wiring.watcher.watch(
            target.kubelet_dir, lambda name: registrar.wake(), {contracts.KUBELET_SOCKET, self.profile.socket}
        )

    def describe(self) -> str:
        return f"resource {self.profile.resource}, socket {self.registrar.socket_path}, {self.profile.slots} slot(s)"

    async def run(self) -> None:
        await self.registrar.run()

    async def hand_over(
        self,
        timeout: float,
        pid: Optional[int] = None,
        require_ready: bool = True,
        seen: Optional[Callable[[Description], None]] = None,
    ) -> Optional[str]:
        successor = await handover.wait_for_successor(
            self._wiring.identity,
            self.kubelet_dir,
            self._base_socket,
            self.profile.socket,
            timeout,
            pid=pid,
            require_ready=require_ready,
            seen=seen,
        )
        if successor:
            # Its registration made the kubelet send new Allocates there; ours must be over, and
            # none still on its way to us, before our stream ends (the kubelet then closes our
            # connection, failing whatever is on it).
            why = await handover.released(
                lambda: self.servicer.calls.in_flight,
                lambda: self.servicer.calls.received,
                lambda: handover.calls_of(successor),
            )
            log.info("the kubelet is done with us: %s", why)
        return successor

    def after_failed_hand_over(self, successor_registered: bool) -> None:
        """A handover that failed: the kubelet's endpoint and device list must be ours again. A
        successor that registered took the endpoint (1.34 keeps one client per resource, and the
        successor's end disconnected it) or listed its devices last (1.37+ keep the last list any
        endpoint sent): register again. Otherwise nothing changed; list once more anyway."""
        if successor_registered:
            self.registrar.renew()
        else:
            self._wiring.observation.republish()

    def described(self) -> Mapping[str, Any]:
        """What Describe adds for this side (peers.py)."""
        observation = self._wiring.observation
        return {
            "serving": self.snapshot(observation.current, observation.version > 0).ready(),
            "calls": self.servicer.calls.received,
            "registering": self.registering,
        }

    async def _may_register(self) -> None:
        """Returns when we may register. A Register makes us the kubelet's endpoint for the
        resource, and our list its device list: with our device unhealthy beside a ready instance
        of ours (a successor whose device check fails), that would take the node's devices from
        the kubelet, so we hold it until our device is healthy or that instance is gone. An
        in-place upgrade's child also waits for its predecessor to agree (host/successor.py), so
        that the predecessor knows, if the upgrade fails, whether the kubelet's endpoint is still
        its own."""
        try:
            await peers.hold(
                lambda observation: self._hold_reason(observation.healthy),
                self._wiring.observation,
                self._held,
                # The predecessor agrees within its own poll: ask as often as it asks us.
                lambda: peers.POLL_S if self.registering else peers.HOLD_POLL_S,
            )
        finally:
            self.registering = False

    def _held(self, reason: str) -> None:
        if reason:
            log.info("%s", reason)
        self.held = reason
        self._wiring.on_change()

    async def _hold_reason(self, healthy: bool) -> str:
        """Why we may not register now ("" when we may). Asked last, after every await: during an
        in-place upgrade of ours the child registers (with our agreement), and if it fails we
        register again (after_failed_hand_over); a Register of ours racing the child's could
        leave the kubelet with our list and, once we leave, with none."""
        reason = await self._hold_reason_now(healthy)
        if not reason and self._wiring.upgrading():
            return "not registering during our in-place upgrade: the new agent registers"
        return reason

    def registration_in_flight(self) -> bool:
        return self.registrar.registering_now

    async def _hold_reason_now(self, healthy: bool) -> str:
        me = self._wiring.identity
        if not healthy:
            serving = await handover.wait_for_successor(
                me, self.kubelet_dir, self._base_socket, self.profile.socket, peers.PEER_TIMEOUT_S, leaving_too=True
            )
            if serving is not None:
                return f"not registering while the device is unhealthy: {serving} serves the kubelet"
        predecessor = self._wiring.predecessor()
        if predecessor is None:
            return ""
        found = await peers.find(
            predecessor, handover.candidates(self.kubelet_dir, self._base_socket, self.profile.socket)
        )
        if found is not None:
            record = found.upgrade
            if record is None or "agreed" not in record:
                return ""  # a release before the agreement: it does not wait for us to ask
            # An unready predecessor hands over without waiting for us to ask: we are its "done".
            handed_to_us = record.get("state") == peers.UpgradeState.DONE and record.get("pid") == me.pid
            if record.get("agreed") == me.pid or handed_to_us:
                return ""
        # Not found: it is leaving (then predecessor() becomes None), or too busy to answer.
        self.registering = True
        return f"waiting for the agent we replace (pid {predecessor}) to agree before registering"

    def begin_stop(self) -> None:
        self.registrar.end_streams()

    async def close(self) -> None:
        await self.registrar.stop(grace=transport.STOP_GRACE_S)

    def snapshot(self, observation: Observation, checked: bool) -> DevicePluginSnapshot:
        r = self.registrar
        return DevicePluginSnapshot(
            observation,
            checked,
            r.state,
            r.last_error,
            r.kubelet_socket,
            r.current_streams,
            self.profile.slots,
            self.held,
        )

    async def newer_instance(self) -> Optional[str]:
        found = await peers.newer(
            self._wiring.identity, handover.candidates(self.kubelet_dir, self._base_socket, self.profile.socket)
        )
        return found.identity.name if found else None

    def reconfigure(self, target: DevicePluginTarget) -> None:
        self.profile = target.profile
        self.servicer.profile = target.profile
        self._wiring.observation.republish()  # streams resend the list (the slot count may have changed)

    def _configure(self, server: grpc.aio.Server, on_stream: Callable[[int, object], None]) -> Callable[[], None]:
        endpoint = Endpoint(self.servicer, on_stream)
        server.add_generic_rpc_handlers([api.device_plugin_handler(endpoint)])
        self._wiring.serve_ours(server)
        return endpoint.close

    def _on_registrar(self) -> None:
        r = self.registrar
        self._outcomes.registrar_totals(r.registrations, r.kubelet_restarts, r.streams_lost)
        self._wiring.on_change()
