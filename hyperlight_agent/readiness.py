"""Readiness and the one-line status, as pure functions of the agent's state.

The same answer feeds sd_notify (READY=1, STATUS=), the gRPC health service the exec probes ask,
and the log; tests call these directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperlight_agent.device.observation import Observation
from hyperlight_agent.deviceplugin import registration


@dataclass(frozen=True)
class Snapshot:
    """What readiness depends on."""

    observation: Observation
    checked: bool  # a device check has completed
    registration: str  # registration.WAITING, REGISTERED, STREAMED or LOST
    registration_error: str
    kubelet_socket: str
    streams: int
    slots: int


def ready(s: Snapshot) -> bool:
    """Registered, the kubelet's stream open, and the last device check passed."""
    return s.registration == registration.STREAMED and s.streams > 0 and s.checked and s.observation.healthy


def status(s: Snapshot) -> str:  # noqa: PLR0911 - one return per state reads best
    """What the agent is doing or waiting for.

    >>> from hyperlight_agent.device.observation import Observation
    >>> status(Snapshot(Observation(True, "", "kvm"), True, "streamed", "", "/k/kubelet.sock", 1, 2))
    'ready: kvm, 2 slots, 1 stream'
    """
    obs = s.observation
    if s.checked and not obs.healthy:
        return f"unhealthy: {obs.reason}"
    if s.registration == registration.LOST:
        return f"{s.registration_error}; registering again"
    if s.registration == registration.WAITING:
        if s.registration_error:
            return f"waiting for kubelet at {s.kubelet_socket}: {s.registration_error}"
        return f"waiting for kubelet at {s.kubelet_socket}"
    if not s.checked:
        return "checking the device"
    if s.registration == registration.REGISTERED or s.streams == 0:
        return "registered; waiting for the kubelet's ListAndWatch stream"
    return (f"ready: {obs.hypervisor}, {s.slots} slot{'s' if s.slots != 1 else ''}, "
            f"{s.streams} stream{'s' if s.streams != 1 else ''}")
