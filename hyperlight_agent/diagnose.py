"""`--check`: can this node serve Hyperlight in the mode the agent runs? First whether the agent
itself can run here, then one device check exactly as the agent of that mode runs it (the plugin
and DRA modes: detect, bounded probe in the helper, host identity; the device-access mode: lstat
only), the kubelet's directories the mode serves in, and, for a mode that talks to the API, its
credentials and permissions. The CDI spec is inspected, not repaired: nothing is changed, and
nothing is written (no temporary directory is needed: a pod's root is read-only). Prints a short
report; each FAIL line is followed by a hint saying what to do.

What differs between the modes is read from their rows (modes.py: `inventory_only`,
`kubelet_dirs`) and their protocol's (parts.ROWS: `preflight`, the API's checks for DRA).

Why: docs/decisions/check-is-the-operators.md.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import stat
from typing import Mapping, Optional

from hyperlight_agent import modes, parts
from hyperlight_agent.config import BY_KEY, Settings
from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.checker import Checker
from hyperlight_agent.device.helper import ProbeHelper
from hyperlight_agent.device.observation import Cause, Observation, SharedObservation
from hyperlight_agent.files import cdi
from hyperlight_agent.parts import Lines
from hyperlight_agent.text import cause

# What to do when one of the kubelet's directories is missing, per setting.
DIRECTORY_FIXES = {
    "kubelet_dir": "the kubelet makes it when it starts: is a kubelet running on this node? In a pod, the "
    "hostPath mount of /var/lib/kubelet/device-plugins; on a host, set kubelet_dir to the kubelet's "
    "device-plugin directory",
    "dra_registry_dir": "the kubelet makes it when it starts: is a kubelet running on this node, with its root "
    "at {root}? Otherwise set dra_registry_dir (the chart: kubeletRootDir) to <its --root-dir>/plugins_registry",
    "dra_plugins_dir": "the kubelet makes it when it starts: is a kubelet running on this node, with its root "
    "at {root}? Otherwise set dra_plugins_dir (the chart: kubeletRootDir) to <its --root-dir>/plugins",
}


def runtime() -> tuple[bool, str]:
    """Can the agent itself start here? A tree built for another Python passes every node check
    and then dies importing grpc's extension module, so import what the daemon imports and bind
    a gRPC server on a unix socket: an abstract one, which needs no directory (a pod's root
    filesystem is read-only, and none of our pods mounts a writable /tmp)."""

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
        asyncio.run(bind(f"unix-abstract:hyperlight-check-{os.getpid()}-{secrets.token_hex(4)}"))
    except Exception as exc:
        return False, f"FAIL runtime: gRPC server cannot bind a unix socket: {type(exc).__name__}: {exc}"
    return True, "ok   runtime: the agent imports and its gRPC server binds a unix socket"


RUNTIME_HINT = (
    "hint install the agent built for this machine's Python (the .deb for Debian, the .rpm for EL9 or Azure "
    "Linux 3) or run the image; a copied tree from another Python cannot load grpc"
)


CDI_HINT = (
    "hint the agent owns only hyperlight.json in cdi_dir, and never follows a symlink there or replaces what "
    "is not its file: set cdi_dir (HYPERLIGHT_CDI_DIR, --cdi-dir) to the real directory the runtime reads, or "
    "move what is in the way (a missing directory is fine: the agent makes it)"
)


def diagnose(
    settings: Settings,
    mode: modes.Mode = modes.PLUGIN,
    environ: Optional[Mapping[str, str]] = None,
    device_only: bool = False,
) -> tuple[bool, list[str]]:
    """Every line of the report, and whether the node can serve. Each part is said even when an
    earlier one fails: they are separate problems. `device_only` (`--check=device`): the runtime
    and the device alone, as a workload's container can check them (`helm test`)."""
    runtime_ok, runtime_line = runtime()
    lines = [runtime_line] + ([] if runtime_ok else [RUNTIME_HINT])
    settings_ok = not settings.ignored
    lines += ignored_settings(settings)
    device_ok, device_lines = _device(settings, mode)
    lines += device_lines
    if device_only:
        return settings_ok and runtime_ok and device_ok, lines
    found = directories(settings, mode.kubelet_dirs)
    preflight = parts.row(mode).preflight
    if preflight is not None:
        found += preflight(settings, mode, environ or {})
    lines += [line for _, line in found]
    return settings_ok and runtime_ok and device_ok and all(good for good, _ in found), lines


def ignored_settings(settings: Settings) -> list[str]:
    """The original plugin's variables the agent ignores for a bad value (it only warns, as the
    original did): the node runs on another value than the one given, so the check fails."""
    lines = []
    for text in settings.ignored:
        name = text.split("=", 1)[0]
        lines += [
            f"FAIL {text}",
            f"hint set {name} to a valid value or unset it: the agent warns and runs on another value; "
            "a later release will refuse it",
        ]
    return lines


def directories(settings: Settings, keys: tuple[str, ...]) -> Lines:
    """Each of the mode's kubelet directories exists as a directory (read only: stat)."""
    found: Lines = []
    for key in keys:
        path = getattr(settings, key)
        fix = DIRECTORY_FIXES[key].format(root=os.path.dirname(BY_KEY["dra_registry_dir"].default))
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            found += [(False, f"FAIL {key}: {path}: {cause(exc)}"), (False, f"hint {fix}")]
            continue
        if not stat.S_ISDIR(mode):
            found += [(False, f"FAIL {key}: {path} is not a directory"), (False, f"hint {fix}")]
        else:
            found.append((True, f"ok   {key}: {path}"))
    return found


def _device(settings: Settings, mode: modes.Mode) -> tuple[bool, list[str]]:
    for key in ("device_dir", "host_device_dir"):
        path = getattr(settings, key)
        if path is not None and not os.path.isdir(path):
            setting = BY_KEY[key]
            return False, [
                f"FAIL {key}: {path} does not exist",
                f"hint set {key} ({setting.env}, {setting.flag}) to where the host's /dev is: /dev on a host; in a "
                "pod, the mount of the host's /dev (the chart mounts it at /host-dev)",
            ]
    observation, cdi_note = asyncio.run(_check(settings, mode))
    if observation.hypervisor is None:
        hints = [f"hint {h.missing_hint}" for h in hypervisors.HYPERVISORS]
        if settings.host_device_dir is None and settings.device_dir != "/dev":
            hints.append(
                f"hint in a container, {settings.device_dir} must be the host's /dev mounted in "
                "(device_dir, host_device_dir)"
            )
        return False, [f"FAIL device: {observation.reason}", *hints]
    hypervisor = hypervisors.BY_NAME[observation.hypervisor]
    device = hypervisor.device_path(settings.device_dir)
    host = hypervisor.device_path(settings.host_device_dir) if settings.host_device_dir else None
    lines = [f"ok   device: {hypervisor.name} at {device}" + (f" (host node {host})" if host else "")]
    if mode.inventory_only:
        if not observation.healthy:
            return False, [
                *lines,
                f"FAIL device node: {observation.reason}",
                "hint the node must be the host's character device: mount the host's /dev (read-only is enough) "
                "and set device_dir to it",
            ]
        lines.append(f"ok   device node: a character device, listed with lstat, not opened (the {mode.name} mode)")
        return True, lines
    if not observation.healthy and observation.cause is not Cause.CDI:
        return False, [*lines, f"FAIL probe: {observation.reason}", *_probe_hints(observation.reason)]
    lines.append(f"ok   probe: {hypervisor.proved}")  # the spec is looked at only after a passing probe
    spec_ok, spec_lines = _spec(settings, observation, cdi_note)
    return spec_ok, [*lines, *spec_lines]


def _spec(settings: Settings, observation: Observation, cdi_note: Optional[str]) -> tuple[bool, list[str]]:
    """The CDI spec's line(s), after a passing probe."""
    if not observation.healthy:
        # What the running agent refuses or cannot do at the spec's place (cdi.present): its check
        # fails the same way, and it serves nothing for as long as that stays.
        return False, [f"FAIL CDI spec: {observation.reason}", CDI_HINT]
    if cdi_note is None:
        return True, [f"ok   CDI spec: {cdi.spec_path(settings.cdi_dir)} is exact"]
    # The agent repairs this when it runs; the node can serve once it does.
    return True, [f"note CDI spec: {cdi_note} (the running agent repairs it)"]


async def _check(settings: Settings, mode: modes.Mode) -> tuple[Observation, Optional[str]]:
    helper = ProbeHelper()
    checker = Checker(parts.check_target(settings, mode, read_only=True), helper, SharedObservation())
    try:
        return await checker.check(), checker.cdi_note
    finally:
        await helper.close()


def _probe_hints(reason: str) -> list[str]:
    """What usually makes a present device fail its probe, from the kernel's words."""
    if "Permission denied" in reason or "Operation not permitted" in reason:
        return [
            "hint the agent cannot open the device for read and write: run it as root, or give it the "
            "device's group (ls -l the node); in a container, a device cgroup rule or seccomp may refuse it "
            "(the chart's device plugin and DRA driver get it from the device-access DaemonSet: is that pod "
            "Ready on this node?)"
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
    return [
        "hint the node at the device's path is not a working hypervisor device: compare it with the host's "
        "(ls -l /dev/kvm /dev/mshv; a bind mount or a stale node in a container)"
    ]
