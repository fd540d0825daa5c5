"""`--check`: is this node able to serve Hyperlight? First whether the agent itself can run here,
then one device check exactly as the agent runs it (detect, bounded probe in the helper, host
identity), except that the CDI spec is inspected, not repaired: nothing is changed. Prints a
short report."""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Mapping, Optional

from hyperlight_agent import modes, parts
from hyperlight_agent.config import Settings
from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.checker import Checker
from hyperlight_agent.device.helper import ProbeHelper
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.files import cdi


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
        from hyperlight_agent import agent  # noqa: F401 - the daemon's whole import graph, grpc's extension first
    except Exception as exc:
        return False, f"FAIL runtime: cannot import the agent: {type(exc).__name__}: {exc}"

    try:
        from hyperlight_agent import transport  # grpc's: only once the agent imported

        with tempfile.TemporaryDirectory(prefix="hyperlight-check-") as tmp:
            asyncio.run(bind(transport.unix_target(os.path.join(tmp, "check.sock"))))
    except Exception as exc:
        return False, f"FAIL runtime: gRPC server cannot bind a unix socket: {type(exc).__name__}: {exc}"
    return True, "ok   runtime: the agent imports and its gRPC server binds a unix socket"


def diagnose(
    settings: Settings, mode: modes.Mode = modes.PLUGIN, environ: Optional[Mapping[str, str]] = None
) -> tuple[bool, list[str]]:
    """The device's lines and, in the DRA mode, the API's and the kubelet's directories' (each
    said even when the device fails: they are separate problems)."""
    ok, lines = _device(settings)
    if mode.protocol is modes.Protocol.DRA:
        from hyperlight_agent.dra import preflight

        node = parts.dra_target(settings, mode).node_name
        found = [
            *preflight.directories(
                {"dra_registry_dir": settings.dra_registry_dir, "dra_plugins_dir": settings.dra_plugins_dir}
            ),
            *asyncio.run(preflight.api(settings.kubeconfig, node, environ or {})),
        ]
        lines += [line for _, line in found]
        ok = ok and all(good for good, _ in found)
    return ok, lines


def _device(settings: Settings) -> tuple[bool, list[str]]:
    runtime_ok, runtime_line = runtime()
    observation, cdi_note = asyncio.run(_check(settings))
    lines = [runtime_line]
    if observation.hypervisor is None:
        hints = [f"hint {h.missing_hint}" for h in hypervisors.HYPERVISORS]
        if settings.host_device_dir is None and settings.device_dir != "/dev":
            hints.append(
                f"hint in a container, {settings.device_dir} must be the host's /dev mounted in "
                "(device_dir, host_device_dir)"
            )
        return False, [*lines, f"FAIL device: {observation.reason}", *hints]
    hypervisor = hypervisors.BY_NAME[observation.hypervisor]
    device = hypervisor.device_path(settings.device_dir)
    host = hypervisor.device_path(settings.host_device_dir) if settings.host_device_dir else None
    lines.append(f"ok   device: {hypervisor.name} at {device}" + (f" (host node {host})" if host else ""))
    if not observation.healthy:
        return False, [*lines, f"FAIL probe: {observation.reason}", *_probe_hints(observation.reason)]
    lines.append(f"ok   probe: {hypervisor.proved}")
    if cdi_note is None:
        lines.append(f"ok   CDI spec: {cdi.spec_path(settings.cdi_dir)} is exact")
    else:
        # The agent repairs this when it runs; the node can serve once it does.
        lines.append(f"note CDI spec: {cdi_note} (the running agent repairs it)")
    return runtime_ok, lines


async def _check(settings: Settings) -> tuple[Observation, Optional[str]]:
    helper = ProbeHelper()
    checker = Checker(parts.check_target(settings, modes.PLUGIN, read_only=True), helper, SharedObservation())
    try:
        return await checker.check(), checker.cdi_note
    finally:
        await helper.close()


def _probe_hints(reason: str) -> list[str]:
    """What usually makes a present device fail its probe, from the kernel's words."""
    if "Permission denied" in reason or "Operation not permitted" in reason:
        return [
            "hint the agent cannot open the device for read and write: run it as root, or give it the "
            "device's group (ls -l the node); in a container, a device cgroup rule or seccomp may refuse it"
        ]
    if "KVM_CREATE_VM failed" in reason:
        return [
            "hint the kernel refused a VM: another hypervisor may hold the CPU's virtualisation (VirtualBox, "
            "an older VMware), or nested virtualisation is off for this VM"
        ]
    if "MSHV_CREATE_PARTITION failed" in reason:
        return [
            "hint the Microsoft Hypervisor refused a partition: is this the root partition, with enough memory free?"
        ]
    return []
