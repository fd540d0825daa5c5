"""The agent's two modes, one row each, and the gRPC health service names both serve.

The main plugin advertises shared hypervisor slots and owns the CDI spec; the bootstrap mode
(`--device-access`) grants the raw device once, to the main plugin's own pod, and never opens it.
Everything that differs between them is a column here.
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


PLUGIN = Mode("plugin", contracts.RESOURCE_HYPERVISOR, contracts.PLUGIN_SOCKET, None, None,
              workload_env=True, inventory_only=False)
# Two slots: the device plugin's running pod and, during a surge update or a replacement after a
# delete, its successor (both hold the device until the handover; see handover.py).
DEVICE_ACCESS = Mode("device-access", contracts.RESOURCE_DEVICE_ACCESS, contracts.DEVICE_ACCESS_SOCKET, 2,
                     config.ALLOCATION_DEVICE_SPEC, workload_env=False, inventory_only=True)


def of(device_access: bool) -> Mode:
    return DEVICE_ACCESS if device_access else PLUGIN


# gRPC health service names (grpc.health.v1) for the exec probes: readiness is the overall
# service "", liveness our own name.
HEALTH_SERVICES = {"liveness": "liveness", "readiness": ""}
