"""Readiness and the one-line status, as pure functions of the agent's state.

The same answer feeds sd_notify (READY=1, STATUS=), the gRPC health service the exec probes ask,
and the log; tests call these directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from hyperlight_agent.device.observation import Observation
from hyperlight_agent.deviceplugin import registration


@dataclass(frozen=True)
class Snapshot:
    """What readiness depends on."""

    observation: Observation
    checked: bool  # a device check has completed
    registration: registration.State
    registration_error: str
    kubelet_socket: str
    current_streams: int  # open ListAndWatch streams on the server the kubelet registered
    slots: int


@dataclass(frozen=True)
class DraSnapshot:
    """What readiness depends on in the DRA mode."""

    observation: Observation
    checked: bool
    registered: bool  # the kubelet's plugin watcher said so
    registration_error: str
    registration_socket: str
    published: bool  # the API server's ResourceSlice equals what the last check says
    slice_error: str
    devices: int


def ready(s: Union[Snapshot, DraSnapshot]) -> bool:
    """Registered (device plugin: the kubelet's stream open; DRA: the ResourceSlice published), and
    the last device check passed."""
    if isinstance(s, DraSnapshot):
        return s.registered and s.published and s.checked and s.observation.healthy
    return s.registration == registration.STREAMED and s.current_streams > 0 and s.checked and s.observation.healthy


def dra_status(s: DraSnapshot) -> str:  # noqa: PLR0911 - one return per state reads best
    """What the DRA driver is doing or waiting for.

    >>> from hyperlight_agent.device.observation import Observation
    >>> dra_status(DraSnapshot(Observation(True, "", "kvm"), True, True, "", "/r/x-reg.sock", True, "", 128))
    'ready: kvm, 128 devices in the ResourceSlice'
    """
    obs = s.observation
    if s.checked and not obs.healthy:
        return f"unhealthy: {obs.reason}" + (f"; ResourceSlice: {s.slice_error}" if s.slice_error else "")
    if not s.registered:
        if s.registration_error:
            return f"not registered with the kubelet ({s.registration_socket}): {s.registration_error}"
        return f"waiting for the kubelet's plugin watcher to register {s.registration_socket}"
    if not s.checked:
        return "checking the device"
    if not s.published:
        if s.slice_error:
            return f"ResourceSlice not published: {s.slice_error}"
        return "publishing the ResourceSlice"
    return f"ready: {obs.hypervisor}, {s.devices} device{'s' if s.devices != 1 else ''} in the ResourceSlice"


def status(s: Union[Snapshot, DraSnapshot]) -> str:  # noqa: PLR0911 - one return per state reads best
    """What the agent is doing or waiting for.

    >>> from hyperlight_agent.device.observation import Observation
    >>> status(Snapshot(Observation(True, "", "kvm"), True, "streamed", "", "/k/kubelet.sock", 1, 2))
    'ready: kvm, 2 slots, 1 stream'
    """
    if isinstance(s, DraSnapshot):
        return dra_status(s)
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
    if s.registration == registration.REGISTERED or s.current_streams == 0:
        return "registered; waiting for the kubelet's ListAndWatch stream"
    return (f"ready: {obs.hypervisor}, {s.slots} slot{'s' if s.slots != 1 else ''}, "
            f"{s.current_streams} stream{'s' if s.current_streams != 1 else ''}")
