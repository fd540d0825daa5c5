"""One home per fact: a value the code builds or names in one module is not built again beside
it, and the copies that must stay literal (the version in packaging files) are held equal."""

from __future__ import annotations

import ast
import functools
import os
import re
from typing import Optional

import pytest

from hyperlight_agent import __version__, config, transport
from hyperlight_agent.deviceplugin import api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from tests.test_docs import read
from tests.test_layers import MODULES, PACKAGE


@functools.lru_cache(maxsize=1)
def trees() -> dict[str, ast.Module]:
    """Every module's syntax tree, parsed once per session (callers only read them)."""
    found = {}
    for module in MODULES:
        if not module.endswith("_pb2"):
            with open(os.path.join(PACKAGE, *module.split(".")) + ".py") as f:
                found[module] = ast.parse(f.read())
    return found


def homes_of_string(value: str) -> set[str]:
    """The modules holding `value` as a whole string literal."""
    return {
        m
        for m, tree in trees().items()
        if any(isinstance(n, ast.Constant) and n.value == value for n in ast.walk(tree))
    }


# Each copy of the version a packaging file or doc must spell out: file → pattern capturing it.
VERSION_COPIES = {
    "Containerfile": r"^ARG VERSION=(\S+)$",
    "packaging/debian/changelog": r"\Ahyperlight-agent \(([^)]+)\)",
    "packaging/rpm/hyperlight-agent.spec": r"^Version:\s+(\S+)$",
    "deploy/image/build.sh": r"VERSION:-([^}]+)\}",
    "deploy/helm/hyperlight-agent/Chart.yaml": r"^version: (\S+)$",
    "docs/hosts.md": r"hyperlight-agent_([0-9][^_+]*)(?:\+[^_]+)?_amd64\.deb",  # +TAG: the target's (packaging/targets)
}


@pytest.mark.parametrize("path", sorted(VERSION_COPIES))
def test_every_copy_of_the_version_is_the_package_version(path: str) -> None:
    found = re.findall(VERSION_COPIES[path], read(path), re.MULTILINE)
    assert found, f"{path}: no version found"
    assert set(found) == {__version__}, f"{path} says {found}, hyperlight_agent.__version__ is {__version__}"


def test_chart_app_version_is_the_package_version() -> None:
    assert re.findall(r'^appVersion: "([^"]+)"$', read("deploy/helm/hyperlight-agent/Chart.yaml"), re.MULTILINE) == [
        __version__
    ]


def test_device_plugin_options_are_built_only_by_api() -> None:
    builders = {
        m
        for m, tree in trees().items()
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "DevicePluginOptions"
    }
    assert builders == {"deviceplugin.api"}  # Register and GetDevicePluginOptions both send api.plugin_options()
    assert api.plugin_options() == pb.DevicePluginOptions(
        pre_start_required=False, get_preferred_allocation_available=False
    )


def test_the_spec_file_name_lives_in_contracts() -> None:
    assert homes_of_string("hyperlight.json") == {"contracts"}


def test_unix_targets_are_built_by_transport() -> None:
    built = {
        m
        for m, tree in trees().items()
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("unix:")
    }
    assert built == {"transport"}
    assert transport.unix_target("/k/p.sock") == "unix:///k/p.sock"


def test_allocation_modes_are_named_in_config_only() -> None:
    for mode in config.ALLOCATION_MODES:
        if mode != "cdi":  # also a failure cause ("cdi") in checker and observation
            assert homes_of_string(mode) == {"config"}, mode


def _settings_readers() -> set[str]:
    """Modules that read a field of a Settings object by name (`settings.x`, `s.x`, `new.x`...)."""
    fields = {f.key for f in config.SETTINGS}
    return {
        m
        for m, tree in trees().items()
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr in fields
        and isinstance(n.value, ast.Name)
        and n.value.id in ("settings", "s", "new", "running")
    }


def test_settings_become_parts_in_parts_only() -> None:
    """The device and protocol parts never see Settings: parts.py translates, the composition reads
    what it wires itself (agent and assembly: intervals, the instance's name), config owns the table,
    the entry points (cli, diagnose) read what they act on, and a mode names the socket its exec
    probe asks."""
    composition = {"parts", "agent", "assembly"}
    assert _settings_readers() <= {*composition, "config", "cli", "diagnose", "modes"}, _settings_readers()
    takers = {
        m
        for m, tree in trees().items()
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        and n.module == "hyperlight_agent.config"
        and any(a.name == "Settings" for a in n.names)
    }
    assert takers <= {*composition, "reload", "cli", "diagnose"}, takers


def _constant_names(module: str) -> set[str]:
    return {
        t.id
        for n in ast.walk(trees()[module])
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name) and t.id.isupper()
    }


def test_probe_names_only_the_device_probe() -> None:
    """ "Probe" is the kernel-level part of the device check, run in the helper; the exec health
    probe's RPC and the socket liveness test have names of their own."""
    named = {m for m in trees() if any("PROBE" in c for c in _constant_names(m))}
    # (device.observation: Cause.PROBE, a failed probe)
    assert named <= {"device.helper", "device.helper_process", "device.kernel", "device.observation"}, named


def _instance_attributes(module: str, cls: str) -> set[str]:
    """The attributes a class's __init__ sets on self."""
    (node,) = [n for n in trees()[module].body if isinstance(n, ast.ClassDef) and n.name == cls]
    (init,) = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    return {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_one_name_per_stream_count() -> None:
    """Open streams on every server (the servicer, the metric) and on the registered server (the
    registrar's plugin server, readiness) are two counts with two names."""
    from hyperlight_agent.deviceplugin.side import DevicePluginSnapshot

    assert "current_streams" in DevicePluginSnapshot.__dataclass_fields__
    servicer = _instance_attributes("deviceplugin.servicer", "DevicePluginServicer")
    registrar = _instance_attributes("deviceplugin.plugin_server", "PluginServer")
    assert "open_streams" in servicer and "current_streams" not in servicer
    assert "current_streams" in registrar and "open_streams" not in registrar
    assert "streams" not in servicer | registrar


def test_only_the_entry_point_reads_the_process_environment() -> None:
    """cli.main(argv, environ) hands its environ to everything (settings, journal, sd_notify, the
    commit line, the DRA client's in-cluster address), so a caller's environ is the whole truth."""
    readers = {
        m
        for m, tree in trees().items()
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr in ("environ", "getenv")
        and isinstance(n.value, ast.Name)
        and n.value.id == "os"
    }
    assert readers == {"cli"}, readers


def test_servers_are_put_in_place_and_stopped_by_transport_only() -> None:
    """One home for serving at a socket path and for the stop grace: no protocol builds its own
    grpc server, renames its own socket into place or defines its own stop grace."""
    builders = {
        m
        for m, tree in trees().items()
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and ast.unparse(n.func) in ("grpc.aio.server", "sockets.put_in_place")
        and m != "diagnose"
    }  # --check binds a throwaway server to prove grpc loads
    assert builders <= {"transport"}, builders
    graces = {m for m in trees() if "STOP_GRACE_S" in _constant_names(m)}
    assert graces == {"transport"}, graces


def test_no_constant_is_another_constant_under_a_second_name() -> None:
    """One name per value: a module-level constant that only repeats another (X = contracts.Y)
    gives one fact two names; use the one."""
    aliases = [
        f"{m}: {t.id} = {ast.unparse(n.value)}"
        for m, tree in trees().items()
        for n in tree.body
        if isinstance(n, ast.Assign)
        and (
            (isinstance(n.value, ast.Name) and n.value.id.isupper())
            or (isinstance(n.value, ast.Attribute) and n.value.attr.isupper())
        )
        for t in n.targets
        if isinstance(t, ast.Name) and t.id.isupper()
    ]
    assert not aliases, aliases


def test_only_the_modes_and_the_protocol_rows_name_a_protocol() -> None:
    """What differs by kubelet protocol is its row (parts.ROWS): a module naming KubeletProtocol.DRA
    or KubeletProtocol.DEVICE_PLUGIN elsewhere branches on it (ARCHITECTURE.md, one kubelet side per mode)."""
    namers = {
        module
        for module, tree in trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in {"DRA", "DEVICE_PLUGIN"}
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "KubeletProtocol")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "KubeletProtocol")
        )
    }
    assert namers == {"modes", "parts"}, namers


def test_shared_names_only_the_shared_device() -> None:
    """ "Shared" is the DRA slice's one shared device, a flag wherever it is passed or kept (but for
    its setting); what the agent gives a kubelet side is its Wiring (ARCHITECTURE.md, Words)."""
    classes = {
        n.name
        for tree in trees().values()
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and "Shared" in n.name
    }
    assert classes == {"SharedObservation"}, classes
    not_flags = [
        f"{m}: {name}: {ast.unparse(annotation) if annotation else None}"
        for m, tree in trees().items()
        for name, annotation in _named_annotations(tree)
        if "shared" in name
        and name != "dra_shared_device"  # the setting: "auto" or "off"
        and (annotation is None or ast.unparse(annotation) != "bool")
    ]
    assert not not_flags, not_flags
    kept = {
        t.attr
        for tree in trees().values()
        for n in ast.walk(tree)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Attribute) and "shared" in t.attr
    }
    assert kept <= {"shared", "_shared_device", "_keeps_shared"}, kept


def _named_annotations(tree: ast.Module) -> list[tuple[str, Optional[ast.expr]]]:
    """Every argument and annotated class field of a module, with its annotation."""
    found: list[tuple[str, Optional[ast.expr]]] = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [(a.arg, a.annotation) for a in [*n.args.args, *n.args.kwonlyargs]]
        elif isinstance(n, ast.ClassDef):
            found += [
                (f.target.id, f.annotation)
                for f in n.body
                if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
            ]
    return found


def test_one_name_per_dra_device_count() -> None:
    """The identical devices the settings ask for (dra_devices) and the devices the slice offers now
    (one while shared) are two counts with two names."""
    from hyperlight_agent.dra.side import DraTarget
    from hyperlight_agent.dra.slices import SlicePublisher

    assert "identical_devices" in DraTarget.__dataclass_fields__ and "devices" not in DraTarget.__dataclass_fields__
    for module, cls in (("dra.side", "DraSide"), ("dra.slices", "SlicePublisher")):
        attributes = _instance_attributes(module, cls)
        assert "identical_devices" in attributes and not {"devices", "count"} & attributes, (cls, attributes)
    assert isinstance(SlicePublisher.published_devices, property)


def test_hand_over_names_what_it_requires_of_the_successor() -> None:
    """`require_ready` in every handover, as in peers.successor: not `ready`, which is our own."""
    import inspect

    from hyperlight_agent import kubelet_side, peers
    from hyperlight_agent.deviceplugin import handover
    from hyperlight_agent.deviceplugin.side import DevicePluginSide
    from hyperlight_agent.dra.succession import DraSuccession

    for waits_for_successor in (
        kubelet_side.Succession.hand_over,
        DevicePluginSide.hand_over,
        DraSuccession.hand_over,
        handover.wait_for_successor,
        peers.successor,
    ):
        parameters = inspect.signature(waits_for_successor).parameters
        assert "require_ready" in parameters and "ready" not in parameters, waits_for_successor


def test_one_class_per_name() -> None:
    """A class name means one thing in the package (and none shadows the typing name a module of
    ours also uses): two Registrars, a mode's Protocol beside typing.Protocol, read wrong."""
    homes: dict[str, list[str]] = {}
    for module, tree in trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                homes.setdefault(node.name, []).append(module)
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}
    assert not {"Protocol", "NamedTuple", "Enum", "Optional", "Any"} & set(homes)
