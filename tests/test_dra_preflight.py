"""`--dra --check` (dra/preflight.py): the plugin directories, the credentials, the API server and
each permission the driver needs, one FAIL line naming what is wrong (issue 29: 5)."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest
import yaml

from hyperlight_agent.config import Settings
from hyperlight_agent.dra import preflight
from standin.apiserver import FakeApiServer, kubeconfig
from tests.conftest import run_agent
from tests.test_docs import ROOT


def settings(tmp: str, **kw: Any) -> Settings:
    registry, plugins = os.path.join(tmp, "plugins_registry"), os.path.join(tmp, "plugins")
    os.makedirs(registry, exist_ok=True)
    os.makedirs(plugins, exist_ok=True)
    return Settings.defaults(**{"dra_registry_dir": registry, "dra_plugins_dir": plugins, "node_name": "node1", **kw})


def dirs(s: Settings) -> dict[str, str]:
    return {"dra_registry_dir": s.dra_registry_dir, "dra_plugins_dir": s.dra_plugins_dir}


def against_fake(tmp: str, setup: Any = None) -> list[tuple[bool, str]]:
    async def main() -> list[tuple[bool, str]]:
        fake = FakeApiServer()
        url = await fake.start()
        if setup:
            setup(fake)
        try:
            return await preflight.api(kubeconfig(tmp, url), "node1", {})
        finally:
            await fake.stop()

    return asyncio.run(main())


def test_everything_the_driver_needs_is_ok(tmp: str) -> None:
    found = against_fake(tmp)
    assert all(ok for ok, _ in found), found
    assert [line for _, line in found][2:] == [
        f"ok   permission: {verb} {resource}.resource.k8s.io" for verb, resource in preflight.NEEDED
    ]
    assert preflight.directories(dirs(settings(tmp))) == [
        (True, f"ok   dra_registry_dir: {tmp}/plugins_registry"),
        (True, f"ok   dra_plugins_dir: {tmp}/plugins"),
    ]


def test_a_missing_permission_is_a_fail_line_naming_it(tmp: str) -> None:
    found = against_fake(tmp, lambda fake: fake.denied.add(("delete", "resourceslices")))
    fails = [line for ok, line in found if not ok]
    assert fails == [
        "FAIL permission: cannot delete resourceslices.resource.k8s.io (the ClusterRole "
        "hyperlight-dra-driver grants it)"
    ]


def test_no_kubeconfig_and_not_in_a_cluster_is_one_fail_line(tmp: str) -> None:
    found = asyncio.run(preflight.api(None, "node1", {}))
    assert found == [
        (
            False,
            "FAIL API credentials: no kubeconfig setting and not in a cluster "
            "(KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT unset)",
        )
    ]


def test_an_unreachable_api_server_is_one_fail_line(tmp: str) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found = asyncio.run(preflight.api(kubeconfig(tmp, f"http://127.0.0.1:{port}"), "node1", {}))
    assert found[0][0] and not found[1][0], found
    assert found[1][1].startswith("FAIL API server: list resourceslices.resource.k8s.io: API server unreachable: ")
    assert len(found) == 2


@pytest.mark.parametrize("key", ["dra_registry_dir", "dra_plugins_dir"])
def test_a_missing_plugin_directory_is_a_fail_line_naming_the_setting(tmp: str, key: str) -> None:
    found = preflight.directories(dirs(settings(tmp, **{key: os.path.join(tmp, "elsewhere")})))
    assert (
        False,
        f"FAIL {key}: {tmp}/elsewhere: No such file or directory (is the kubelet's root directory "
        f"/var/lib/kubelet? set {key})",
    ) in found


def test_the_chart_grants_exactly_what_the_check_asks(tmp: str) -> None:
    with open(os.path.join(ROOT, "deploy", "helm", "hyperlight-agent", "templates", "dra-rbac.yaml")) as f:
        text = "\n".join(line for line in f if "{{" not in line)
    (role,) = [d for d in yaml.safe_load_all(text) if d and d.get("kind") == "ClusterRole"]
    granted = {(verb, resource) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert set(preflight.NEEDED) <= granted
    assert granted - set(preflight.NEEDED) <= {("get", "resourceslices")}, "nothing the driver does not use"


def test_dra_check_from_the_command_line_says_what_fails(tmp: str) -> None:
    """No kubeconfig and no cluster, a missing plugin directory: FAIL lines, exit 1."""
    result = run_agent(
        "--dra",
        "--check",
        "--device-dir",
        tmp,
        "--dra-registry-dir",
        tmp,
        "--dra-plugins-dir",
        os.path.join(tmp, "none"),
        "--node-name",
        "node1",
        timeout=60,
        env={"PATH": os.environ["PATH"]},
    )
    assert result.returncode == 1, result
    lines = result.stdout.splitlines()
    assert f"ok   dra_registry_dir: {tmp}" in lines, lines
    assert any(line.startswith(f"FAIL dra_plugins_dir: {tmp}/none: No such file or directory") for line in lines)
    assert (
        "FAIL API credentials: no kubeconfig setting and not in a cluster (KUBERNETES_SERVICE_HOST and "
        "KUBERNETES_SERVICE_PORT unset)" in lines
    )
    assert lines[-1] == "this node cannot serve Hyperlight"
