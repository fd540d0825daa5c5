"""The agent's three modes, one row each, and the gRPC health service names all serve.

The main plugin advertises shared hypervisor slots and owns the CDI spec; the bootstrap mode
(`--device-access`) grants the raw device once, to each of our own pods that needs it, and never
opens it; the DRA mode (`--dra`) owns the same CDI spec and offers the device through Dynamic
Resource Allocation instead of slots. Everything that differs between them is a column here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from hyperlight_agent import config, contracts


class Mode(NamedTuple):
    name: str
    resource: str
    socket: str
    # Fixed slot count and allocation; None: the settings decide.
    slots: Optional[int]
    allocation: Optional[str]
    # A DeviceSpec comes with the workload environment the CDI spec sets.
    workload_env: bool
    # lstat only: never open the device, never write CDI or node labels.
    inventory_only: bool
    # Which kubelet protocol serves the device: "deviceplugin" or "dra".
    protocol: str = "deviceplugin"


PLUGIN = Mode("plugin", contracts.RESOURCE_HYPERVISOR, contracts.PLUGIN_SOCKET, None, None,
              workload_env=True, inventory_only=False)
# Four slots: the device plugin's and the DRA driver's running pods (the chart's mode "both") and,
# during a surge update or a replacement after a delete, each one's successor (both hold the
# device until the handover; see handover.py).
DEVICE_ACCESS = Mode("device-access", contracts.RESOURCE_DEVICE_ACCESS, contracts.DEVICE_ACCESS_SOCKET, 4,
                     config.ALLOCATION_DEVICE_SPEC, workload_env=False, inventory_only=True)
# Devices come from the dra_devices setting; a claim always gets the CDI device (the runtime applies
# it, so no DeviceSpec and no environment of ours).
DRA = Mode("dra", contracts.DRA_DRIVER, "", None, config.ALLOCATION_CDI, workload_env=False,
           inventory_only=False, protocol="dra")


# The DRA mode's instance name without the instance setting (its sockets always carry one).
DRA_DEFAULT_INSTANCE = "agent"


def of(device_access: bool, dra: bool = False) -> Mode:
    if device_access and dra:
        raise ValueError("--device-access and --dra are different modes: choose one")
    return DRA if dra else DEVICE_ACCESS if device_access else PLUGIN


# gRPC health service names (grpc.health.v1) for the exec probes: readiness is the overall
# service "", liveness our own name.
HEALTH_SERVICES = {"liveness": "liveness", "readiness": ""}
