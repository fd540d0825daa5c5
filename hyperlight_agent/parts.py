"""The translation of the settings and the mode into what each part of the agent is built from:
the checker's CheckTarget, and the kubelet side for the mode's protocol with its target (the
device plugin's DevicePluginTarget, the DRA side's DraTarget). On a reload the agent builds the
targets again from the new settings, so no part reads Settings itself; the agent reads only what
it acts on (the directories it watches, the check interval, the handover time).

A kubelet protocol is an entry in SIDES: its target from the settings, and its side's class.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any, Callable

from hyperlight_agent import modes
from hyperlight_agent.config import Settings
from hyperlight_agent.contracts import instance_socket_name
from hyperlight_agent.device.checker import CheckTarget

if TYPE_CHECKING:
    # grpc comes with the sides' modules: `--check` (diagnose.py) uses this module to report
    # whether grpc imports at all, so it must load without them.
    from hyperlight_agent.deviceplugin.servicer import Profile
    from hyperlight_agent.deviceplugin.side import DevicePluginTarget
    from hyperlight_agent.dra.side import DraTarget
    from hyperlight_agent.kubelet_side import KubeletSide, Shared


def check_target(settings: Settings, mode: modes.Mode, read_only: bool = False) -> CheckTarget:
    """Where the checker looks and what the CDI spec must say; `read_only` for --check."""
    return CheckTarget(
        settings.device_dir,
        settings.host_device_dir,
        settings.cdi_dir,
        settings.device_uid,
        settings.device_gid,
        inventory_only=mode.inventory_only,
        read_only=read_only,
    )


def profile(settings: Settings, mode: modes.Mode) -> Profile:
    """What the device plugin advertises: the mode's fixed columns win over the settings."""
    from hyperlight_agent.deviceplugin.servicer import Profile

    return Profile(
        mode.resource,
        instance_socket_name(mode.socket, settings.instance),
        mode.slots if mode.slots is not None else settings.device_count,
        mode.allocation or settings.allocation,
        workload_env=mode.workload_env,
    )


def device_plugin_target(settings: Settings, mode: modes.Mode) -> DevicePluginTarget:
    from hyperlight_agent.deviceplugin.side import DevicePluginTarget

    return DevicePluginTarget(settings.kubelet_dir, mode.socket, profile(settings, mode))


def dra_target(settings: Settings, mode: modes.Mode) -> DraTarget:
    """Without node_name, the host name as the kubelet registers it (lower case)."""
    from hyperlight_agent.dra.side import DraTarget

    return DraTarget(
        settings.node_name or socket.gethostname().lower(),
        modes.dra_instance(settings.instance),
        settings.dra_devices,
        settings.kubeconfig,
        settings.dra_registry_dir,
        settings.dra_plugins_dir,
        mode.resource,
        shared=settings.dra_shared_device == "auto",
        evict_after_s=settings.dra_evict_after_seconds,
    )


def _device_plugin_side(target: Any, shared: Shared) -> KubeletSide:
    from hyperlight_agent.deviceplugin.side import DevicePluginSide

    return DevicePluginSide(target, shared)


def _dra_side(target: Any, shared: Shared) -> KubeletSide:
    from hyperlight_agent.dra.side import DraSide  # the DRA mode's modules only in that mode

    return DraSide(target, shared)


# protocol → (its target from the settings, its side from the target)
SIDES: dict[modes.Protocol, tuple[Callable[[Settings, modes.Mode], Any], Callable[[Any, Shared], KubeletSide]]] = {
    modes.Protocol.DEVICE_PLUGIN: (device_plugin_target, _device_plugin_side),
    modes.Protocol.DRA: (dra_target, _dra_side),
}


def side_target(settings: Settings, mode: modes.Mode) -> Any:
    """The mode's kubelet side's target (built again on a reload)."""
    return SIDES[mode.protocol][0](settings, mode)


def kubelet_side(settings: Settings, mode: modes.Mode, shared: Shared) -> KubeletSide:
    target, side = SIDES[mode.protocol]
    return side(target(settings, mode), shared)
