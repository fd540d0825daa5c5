"""The one translation of the settings and the mode into what each part of the agent needs.

The checker gets a CheckTarget, the device plugin a Profile, the DRA driver a DraTarget. On a
reload the agent builds them again from the new settings, so no part reads Settings itself.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from hyperlight_agent import modes
from hyperlight_agent.config import Settings
from hyperlight_agent.contracts import instance_socket_name
from hyperlight_agent.device.checker import CheckTarget

if TYPE_CHECKING:
    # grpc comes with the device plugin's modules: `--check` (diagnose.py) uses this module to
    # report whether grpc imports at all, so it must load without it.
    from hyperlight_agent.deviceplugin.servicer import Profile


def check_target(settings: Settings, mode: modes.Mode, read_only: bool = False) -> CheckTarget:
    """Where the checker looks and what the CDI spec must say; `read_only` for --check."""
    return CheckTarget(settings.device_dir, settings.host_device_dir, settings.cdi_dir,
                       settings.device_uid, settings.device_gid, inventory_only=mode.inventory_only,
                       read_only=read_only)


def profile(settings: Settings, mode: modes.Mode) -> Profile:
    """What the device plugin advertises: the mode's fixed columns win over the settings."""
    from hyperlight_agent.deviceplugin.servicer import Profile

    return Profile(mode.resource, instance_socket_name(mode.socket, settings.instance),
                   mode.slots if mode.slots is not None else settings.device_count,
                   mode.allocation or settings.allocation, workload_env=mode.workload_env)


@dataclass(frozen=True)
class DraTarget:
    """Who the DRA driver is and where it talks: its node, its instance (its sockets' names), the
    devices it publishes, the API credentials and the kubelet's plugin directories."""

    node_name: str
    instance: str
    devices: int
    kubeconfig: Optional[str]
    registry_dir: str
    plugins_dir: str


def dra_target(settings: Settings) -> DraTarget:
    """Without node_name, the host name as the kubelet registers it (lower case)."""
    return DraTarget(settings.node_name or socket.gethostname().lower(),
                     settings.instance or modes.DRA_DEFAULT_INSTANCE, settings.dra_devices,
                     settings.kubeconfig, settings.dra_registry_dir, settings.dra_plugins_dir)
