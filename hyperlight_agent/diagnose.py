"""`--check`: is this node able to serve Hyperlight? Detects, probes (bounded, in the helper),
checks host identity and the CDI spec, changes nothing, and prints a short report."""

from __future__ import annotations

import asyncio

from . import cdi, hypervisors
from .config import Settings
from .helper import ProbeHelper, ProbeRequest, ProbeResult


def diagnose(settings: Settings) -> tuple[bool, list[str]]:
    lines: list[str] = []
    hypervisor = hypervisors.detect(settings.device_dir)
    if hypervisor is None:
        names = ", ".join(h.device_path(settings.device_dir) for h in hypervisors.HYPERVISORS)
        return False, [f"FAIL device: none of {names} exists"]
    device = hypervisor.device_path(settings.device_dir)
    host = hypervisor.device_path(settings.host_device_dir) if settings.host_device_dir else None
    lines.append(f"ok   device: {hypervisor.name} at {device}" + (f" (host node {host})" if host else ""))

    async def probe() -> ProbeResult:
        helper = ProbeHelper()
        try:
            return await helper.run(ProbeRequest(hypervisor.name, device, host))
        finally:
            await helper.close()

    result = asyncio.run(probe())
    ok = result.ok
    check = "empty VM created" if hypervisor.name == "kvm" else "partition created"
    lines.append(f"ok   probe: {check} and closed" if ok else f"FAIL probe: {result.reason}")
    wanted = cdi.render(hypervisor.name, hypervisor.container_path, settings.device_uid, settings.device_gid)
    problem = cdi.inspect(settings.cdi_dir, wanted)
    if problem is None:
        lines.append(f"ok   CDI spec: {cdi.spec_path(settings.cdi_dir)} is exact")
    else:
        # The agent repairs this when it runs; the node can serve once it does.
        lines.append(f"note CDI spec: {problem} (the running agent repairs it)")
    return ok, lines
