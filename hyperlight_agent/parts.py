"""The translation of the settings and the mode into what each part of the agent is built from: the
checker's CheckTarget, the agent's face with its metrics, the NFD feature file's directory, and
the kubelet side for the mode's protocol with its target (the device plugin's DevicePluginTarget,
the DRA side's DraTarget) and the series it counts in (its outcomes). On a reload the agent builds the targets
again from the new settings, so no part reads Settings itself; the agent reads only what it acts
on (the directories it watches, the check interval, the handover time).

A kubelet protocol is one row of ROWS (ProtocolRow): everything the rest of the agent asks of it,
so that nothing else branches on the protocol. A third protocol is its name in modes.KubeletProtocol, one
class implementing kubelet_side.KubeletSide, and one row here (tests/test_parts.py runs a toy one).
"""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, Optional, TypeVar

from hyperlight_agent import __version__, contracts, identity, modes
from hyperlight_agent.config import Settings
from hyperlight_agent.contracts import instance_socket_name
from hyperlight_agent.device.checker import CheckTarget
from hyperlight_agent.dra import names
from hyperlight_agent.files import sockets

if TYPE_CHECKING:
    # grpc comes with the sides' modules: `--check` (diagnose.py) uses this module to report
    # whether grpc imports at all, so it must load without them.
    from hyperlight_agent.deviceplugin.outcomes import DevicePluginOutcomes
    from hyperlight_agent.deviceplugin.servicer import Profile
    from hyperlight_agent.deviceplugin.side import DevicePluginTarget
    from hyperlight_agent.dra.outcomes import DraOutcomes
    from hyperlight_agent.dra.side import DraTarget
    from hyperlight_agent.host.face import Face
    from hyperlight_agent.host.notify import Notifier
    from hyperlight_agent.kubelet_side import KubeletSide, Series, Wiring


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


def face(settings: Settings, mode: modes.Mode, notifier: Notifier, environ: Mapping[str, str]) -> Face:
    """How the agent is seen (host/face.py), with its metric series: served only when
    metrics_address is set, with the build's labels. The mode's protocol adds its own (its row's
    outcomes)."""
    from hyperlight_agent.host.face import Face  # the agent's only: not for --check
    from hyperlight_agent.host.metrics import Metrics

    metrics = Metrics(
        enabled=settings.metrics_address is not None,
        build={"version": __version__, "commit": identity.commit(environ), "mode": mode.name},
        device_dir=settings.device_dir,
        cdi=not mode.inventory_only,
    )
    return Face(notifier, metrics, settings.metrics_address, settings.probe_address)


def features_dir(settings: Settings, mode: modes.Mode) -> Optional[str]:
    """Where the NFD feature file is kept, if anywhere: the main plugin's only (one writer)."""
    return settings.nfd_features_dir if settings.nfd_features_dir and not mode.inventory_only else None


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


def _device_plugin_outcomes(series: Series) -> DevicePluginOutcomes:
    from hyperlight_agent.deviceplugin.outcomes import DevicePluginOutcomes

    return DevicePluginOutcomes(series)


def _device_plugin_side(
    target: DevicePluginTarget, wiring: Wiring, outcomes: DevicePluginOutcomes
) -> KubeletSide[DevicePluginTarget]:
    from hyperlight_agent.deviceplugin.side import DevicePluginSide

    return DevicePluginSide(target, wiring, outcomes)


def _dra_outcomes(series: Series) -> DraOutcomes:
    from hyperlight_agent.dra.outcomes import DraOutcomes

    return DraOutcomes(series)


def _dra_side(target: DraTarget, wiring: Wiring, outcomes: DraOutcomes) -> KubeletSide[DraTarget]:
    from hyperlight_agent.dra.side import DraSide  # the DRA mode's modules only in that mode

    return DraSide(target, wiring, outcomes)


def _device_plugin_health_socket(settings: Settings, mode: modes.Mode) -> str:
    return os.path.join(settings.kubelet_dir, instance_socket_name(mode.socket, settings.instance))


def _dra_health_socket(settings: Settings, mode: modes.Mode) -> str:
    return names.service_socket(settings.dra_plugins_dir, mode.resource, modes.dra_instance(settings.instance))


def _device_plugin_instances(settings: Settings, mode: modes.Mode) -> list[str]:
    return sockets.listing(settings.kubelet_dir, lambda name: contracts.is_instance_socket_name(name, mode.socket))


def _dra_instances(settings: Settings, mode: modes.Mode) -> list[str]:
    return sockets.listing(os.path.join(settings.dra_plugins_dir, mode.resource), names.is_service_socket_name)


Lines = list[tuple[bool, str]]


def _dra_preflight(settings: Settings, mode: modes.Mode, environ: Mapping[str, str]) -> Lines:
    from hyperlight_agent.dra import preflight  # its API client only where a mode talks to the API

    return asyncio.run(preflight.api(settings.kubeconfig, dra_target(settings, mode).node_name, environ))


# A row's target: what its side is built from, and built again from on a reload; and its outcomes:
# the metric series it counts what its side did in.
T = TypeVar("T")
Counted = TypeVar("Counted")


@dataclass(frozen=True)
class ProtocolRow(Generic[T, Counted]):
    """One kubelet protocol, whole: what the agent, `--check`, the exec probes and the settings ask
    of it. The callables import the protocol's modules only when called (grpc, the API client), so
    `--check` and `--health-check` load this module without them."""

    # Its side's target from the settings (built again on a reload); its outcomes, made once in the
    # agent's metric registry (served from the start); and its side from both.
    target: Callable[[Settings, modes.Mode], T]
    outcomes: Callable[[Series], Counted]
    side: Callable[[T, Wiring, Counted], KubeletSide[T]]
    # The socket a running agent of a mode serves its health service on (the exec probes ask
    # there), for the instance the settings name.
    health_socket: Callable[[Settings, modes.Mode], str]
    # The sockets an instance of a mode, under any instance name, answers Describe and the health
    # service on (peers.py): what finds the agent when its name is not known.
    instance_sockets: Callable[[Settings, modes.Mode], list[str]]
    # (setting, directory below it, shortest name bound there) for each socket whose name it
    # shortens to fit: config.SOCKET_ROOM takes these as data (a test holds the two equal).
    shortest_names: tuple[tuple[str, str, int], ...] = ()
    # What `--check` asks beyond the device and the kubelet's directories (the API: credentials,
    # server, permissions), one (ok, line) each; None: nothing more.
    preflight: Optional[Callable[[Settings, modes.Mode, Mapping[str, str]], Lines]] = None


# Each row typed by its own target, so that its target and its side are checked to agree; the
# table holds rows of every target.
_DEVICE_PLUGIN: ProtocolRow[DevicePluginTarget, DevicePluginOutcomes] = ProtocolRow(
    device_plugin_target,
    _device_plugin_outcomes,
    _device_plugin_side,
    _device_plugin_health_socket,
    _device_plugin_instances,
)
_DRA: ProtocolRow[DraTarget, DraOutcomes] = ProtocolRow(
    dra_target,
    _dra_outcomes,
    _dra_side,
    _dra_health_socket,
    _dra_instances,
    shortest_names=names.SHORTEST_NAMES,
    preflight=_dra_preflight,
)
ROWS: dict[modes.KubeletProtocol, ProtocolRow[Any, Any]] = {
    modes.KubeletProtocol.DEVICE_PLUGIN: _DEVICE_PLUGIN,
    modes.KubeletProtocol.DRA: _DRA,
}


def row(mode: modes.Mode) -> ProtocolRow[Any, Any]:
    """The row of the protocol the mode speaks."""
    return ROWS[mode.protocol]


def side_target(settings: Settings, mode: modes.Mode) -> Any:
    """The mode's kubelet side's target (built again on a reload), of the kind its row's side
    takes: the rows differ in it, so the table says Any and each row is checked whole."""
    return row(mode).target(settings, mode)


def kubelet_side(settings: Settings, mode: modes.Mode, wiring: Wiring, series: Series) -> KubeletSide[Any]:
    """The mode's side, counting in `series` (the agent's metric registry)."""
    found = row(mode)
    return found.side(found.target(settings, mode), wiring, found.outcomes(series))
