"""`--dra --check` (dra/preflight.py): the plugin directories, the credentials, the API server and
each permission the driver needs, one FAIL line naming what is wrong (issue 29: 5)."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest
import yaml

from hyperlight_agent import diagnose, modes
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
    assert [line for _, line in found][1:] == [
        "ok   API server: answers, and serves resource.k8s.io/v1",
        *(f"ok   permission: {verb} {resource}.resource.k8s.io" for verb, resource in preflight.NEEDED),
    ]
    assert diagnose.directories(settings(tmp), modes.DRA.kubelet_dirs) == [
        (True, f"ok   dra_registry_dir: {tmp}/plugins_registry"),
        (True, f"ok   dra_plugins_dir: {tmp}/plugins"),
    ]


def test_a_missing_permission_is_a_fail_line_naming_it_and_the_fix(tmp: str) -> None:
    found = against_fake(tmp, lambda fake: fake.denied.add(("delete", "resourceslices")))
    fails = [line for ok, line in found if not ok]
    assert fails == [
        "FAIL permission: cannot delete resourceslices.resource.k8s.io",
        "hint bind the driver's account to the chart's ClusterRole hyperlight-dra-driver (the chart does, for "
        "serviceAccount.name), which grants it",
    ]


def forbidden(fake: FakeApiServer) -> None:
    fake.stuck["list"] = (
        403,
        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403},
    )


def test_a_forbidden_list_is_no_proof_that_resource_k8s_io_v1_is_served(tmp: str) -> None:
    """A 403 comes from the authorizer before the route is looked up (issue 35): whether v1 is
    served is asked of the discovery document."""

    def old_server(fake: FakeApiServer) -> None:
        forbidden(fake)
        fake.serves_v1 = False

    found = against_fake(tmp, old_server)
    assert found[1:] == [
        (False, "FAIL API server: does not serve resource.k8s.io/v1"),
        (False, preflight.VERSION_HINT),
    ]
    found = against_fake(tmp, forbidden)
    assert found[1] == (True, "ok   API server: answers, and serves resource.k8s.io/v1")


def test_no_kubeconfig_and_not_in_a_cluster_is_one_fail_line_naming_the_settings(tmp: str) -> None:
    found = asyncio.run(preflight.api(None, "node1", {}))
    assert found == [
        (
            False,
            "FAIL API credentials: no kubeconfig setting and not in a cluster "
            "(KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT unset)",
        ),
        (False, preflight.CREDENTIALS_HINT),
    ]
    assert "kubeconfig (HYPERLIGHT_KUBECONFIG, --kubeconfig)" in preflight.CREDENTIALS_HINT


def test_an_unreachable_api_server_is_one_fail_line(tmp: str) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found = asyncio.run(preflight.api(kubeconfig(tmp, f"http://127.0.0.1:{port}"), "node1", {}))
    assert found[0][0] and not found[1][0], found
    assert found[1][1].startswith("FAIL API server: list resourceslices.resource.k8s.io: API server unreachable: ")
    assert found[2:] == [(False, preflight.SERVER_HINT)]


@pytest.mark.parametrize("key", ["dra_registry_dir", "dra_plugins_dir"])
def test_a_missing_plugin_directory_is_a_fail_line_naming_the_setting(tmp: str, key: str) -> None:
    found = diagnose.directories(settings(tmp, **{key: os.path.join(tmp, "elsewhere")}), modes.DRA.kubelet_dirs)
    assert (False, f"FAIL {key}: {tmp}/elsewhere: No such file or directory") in found
    (hint,) = [line for _, line in found if line.startswith("hint")]
    assert f"set {key} (the chart: kubeletRootDir)" in hint and "/var/lib/kubelet?" in hint


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
