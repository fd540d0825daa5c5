"""`--check`: is this node able to serve Hyperlight? One device check exactly as the agent runs
it (detect, bounded probe in the helper, host identity), except that the CDI spec is inspected,
not repaired: nothing is changed. Prints a short report."""

from __future__ import annotations

import asyncio
from typing import Optional

from . import cdi, hypervisors, modes
from .checker import Checker, target_for
from .config import Settings
from .helper import ProbeHelper
from .observation import Observation, SharedObservation

# What the probe proved, per hypervisor.
PROVED = {"kvm": "empty VM created and closed", "mshv": "partition created and closed"}


def diagnose(settings: Settings) -> tuple[bool, list[str]]:
    observation, cdi_note = asyncio.run(_check(settings))
    if observation.hypervisor is None:
        return False, [f"FAIL device: {observation.reason}"]
    hypervisor = hypervisors.BY_NAME[observation.hypervisor]
    device = hypervisor.device_path(settings.device_dir)
    host = hypervisor.device_path(settings.host_device_dir) if settings.host_device_dir else None
    lines = [f"ok   device: {hypervisor.name} at {device}" + (f" (host node {host})" if host else "")]
    if not observation.healthy:
        return False, [*lines, f"FAIL probe: {observation.reason}"]
    lines.append(f"ok   probe: {PROVED.get(hypervisor.name, 'passed')}")
    if cdi_note is None:
        lines.append(f"ok   CDI spec: {cdi.spec_path(settings.cdi_dir)} is exact")
    else:
        # The agent repairs this when it runs; the node can serve once it does.
        lines.append(f"note CDI spec: {cdi_note} (the running agent repairs it)")
    return True, lines


async def _check(settings: Settings) -> tuple[Observation, Optional[str]]:
    helper = ProbeHelper()
    checker = Checker(target_for(settings, modes.PLUGIN, read_only=True), helper, SharedObservation())
    try:
        return await checker.check(), checker.cdi_note
    finally:
        await helper.close()
