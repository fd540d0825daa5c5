"""`--check`: is this node able to serve Hyperlight? Detects, probes (bounded, in the helper),
checks host identity and the CDI spec, changes nothing, and prints a short report."""

from __future__ import annotations

import asyncio
import os
import tempfile

from . import cdi, hypervisors
from .config import Settings
from .helper import ProbeHelper


def runtime() -> tuple[bool, str]:
    """Can the agent itself start here? A tree built for another Python passes every node check
    and then dies importing grpc's extension module, so import what the daemon imports and bind
    a gRPC server on a unix socket in a temp directory."""

    async def bind(address: str) -> None:
        import grpc

        server = grpc.aio.server()
        if not server.add_insecure_port(address):  # older grpcio returns 0 instead of raising
            raise OSError(f"cannot bind {address}")
        await server.start()
        await server.stop(None)

    try:
        from . import agent  # noqa: F401 - the daemon's whole import graph, grpc's extension first
    except Exception as exc:
        return False, f"FAIL runtime: cannot import the agent: {type(exc).__name__}: {exc}"
    try:
        with tempfile.TemporaryDirectory(prefix="hyperlight-check-") as tmp:
            asyncio.run(bind(f"unix:{os.path.join(tmp, 'check.sock')}"))
    except Exception as exc:
        return False, f"FAIL runtime: gRPC server cannot bind a unix socket: {type(exc).__name__}: {exc}"
    return True, "ok   runtime: the agent imports and its gRPC server binds a unix socket"


def diagnose(settings: Settings) -> tuple[bool, list[str]]:
    runtime_ok, runtime_line = runtime()
    lines = [runtime_line]
    hypervisor = hypervisors.detect(settings.device_dir)
    if hypervisor is None:
        names = ", ".join(h.device_path(settings.device_dir) for h in hypervisors.HYPERVISORS)
        return False, [*lines, f"FAIL device: none of {names} exists"]
    device = hypervisor.device_path(settings.device_dir)
    host = hypervisor.device_path(settings.host_device_dir) if settings.host_device_dir else None
    lines.append(f"ok   device: {hypervisor.name} at {device}" + (f" (host node {host})" if host else ""))

    async def probe() -> dict[str, object]:
        helper = ProbeHelper()
        try:
            return await helper.run({"hypervisor": hypervisor.name, "device": device, "host": host})
        finally:
            await helper.close()

    reply = asyncio.run(probe())
    ok = bool(reply.get("ok"))
    check = "empty VM created" if hypervisor.name == "kvm" else "partition created"
    lines.append(f"ok   probe: {check} and closed" if ok else f"FAIL probe: {reply.get('reason')}")
    wanted = cdi.render(hypervisor.name, hypervisor.container_path, settings.device_uid, settings.device_gid)
    problem = cdi.inspect(settings.cdi_dir, wanted)
    if problem is None:
        lines.append(f"ok   CDI spec: {cdi.spec_path(settings.cdi_dir)} is exact")
    else:
        # The agent repairs this when it runs; the node can serve once it does.
        lines.append(f"note CDI spec: {problem} (the running agent repairs it)")
    return ok and runtime_ok, lines
