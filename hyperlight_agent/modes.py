"""The agent's three modes, one row each, and the kubelet protocols they speak.

The main plugin advertises shared hypervisor slots and owns the CDI spec; the bootstrap mode
(`--device-access`) grants the raw device once, to each of our own pods that needs it, and never
opens it; the DRA mode (`--dra`) owns the same CDI spec and offers the device through Dynamic
Resource Allocation instead of slots. What differs between them is a column here; what differs
between the protocols (their sides, sockets, extra `--check` steps) is the protocol's row
(parts.ROWS), chosen by the protocol column: nothing here branches on it.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional

from hyperlight_agent import config, contracts


class KubeletProtocol(str, enum.Enum):
    """The kubelet protocol a mode speaks (a str: log lines and Describe show its value); each
    is one row of parts.ROWS."""

    DEVICE_PLUGIN = "deviceplugin"
    DRA = "dra"


class Mode(NamedTuple):
    name: str
    # The device plugin's resource name, or the DRA driver's name.
    resource: str
    # The device plugin's socket (an instance's name is put in it); "" for DRA (names.py).
    socket: str
    # Fixed slot count and allocation; None: the settings decide.
    slots: Optional[int]
    allocation: Optional[str]
    # A DeviceSpec comes with the workload environment the CDI spec sets.
    workload_env: bool
    # lstat only: never open the device, never write CDI or node labels.
    inventory_only: bool
    protocol: KubeletProtocol = KubeletProtocol.DEVICE_PLUGIN
    # The settings naming the kubelet's directories this mode serves in. The kubelet makes them,
    # so `--check` finds each: a missing one means no kubelet here, another kubelet root, or a
    # mount left out of the pod.
    kubelet_dirs: tuple[str, ...] = ("kubelet_dir",)


PLUGIN = Mode(
    "plugin",
    contracts.RESOURCE_HYPERVISOR,
    contracts.PLUGIN_SOCKET,
    None,
    None,
    workload_env=True,
    inventory_only=False,
)
# Four slots: the device plugin's and the DRA driver's running pods (the chart's mode "both") and,
# during a surge update or a replacement after a delete, each one's successor (both hold the
# device until the handover; see deviceplugin/handover.py).
DEVICE_ACCESS = Mode(
    "device-access",
    contracts.RESOURCE_DEVICE_ACCESS,
    contracts.DEVICE_ACCESS_SOCKET,
    4,
    config.ALLOCATION_DEVICE_SPEC,
    workload_env=False,
    inventory_only=True,
)
# Devices come from the dra_devices setting; a claim always gets the CDI device (the runtime applies
# it, so no DeviceSpec and no environment of ours).
DRA = Mode(
    "dra",
    contracts.DRA_DRIVER,
    "",
    None,
    config.ALLOCATION_CDI,
    workload_env=False,
    inventory_only=False,
    protocol=KubeletProtocol.DRA,
    kubelet_dirs=("dra_registry_dir", "dra_plugins_dir"),
)

MODES = (PLUGIN, DEVICE_ACCESS, DRA)
BY_NAME = {m.name: m for m in MODES}  # the mode setting's choices (config.MODE_NAMES; a test holds them equal)


def dra_instance(instance: Optional[str]) -> str:
    """The DRA mode's instance name: its sockets always carry one ("agent" without the setting)."""
    return instance or "agent"


def of(device_access: bool, dra: bool = False) -> Mode:
    if device_access and dra:
        raise ValueError("--device-access and --dra are different modes: choose one")
    return DRA if dra else DEVICE_ACCESS if device_access else PLUGIN


def flagged(device_access: bool, dra: bool) -> Optional[str]:
    """The mode `--device-access` or `--dra` names (short for `--mode`), if either is given."""
    return DEVICE_ACCESS.name if device_access else DRA.name if dra else None
