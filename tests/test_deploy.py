"""In-cluster manifests: every overlay renders with kubectl kustomize, passes checkov with no
failed check and kubernetes-validate --strict, and keeps the base's security context."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.test_docs import ROOT

DEPLOY = os.path.join(ROOT, "deploy")
JUDGES = os.path.join(ROOT, "build", "judges", "bin")
OVERLAYS = sorted(os.listdir(os.path.join(DEPLOY, "overlays")))


def render(path: str) -> str:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing (it is on these machines' image)"
    return subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def judge(name: str) -> str:
    path = os.path.join(JUDGES, name)
    assert os.path.exists(path), f"{name} is missing: `make test` installs it into build/judges"
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for overlay in ["base", *OVERLAYS]:
        directory = tmp_path_factory.mktemp(overlay)
        path = os.path.join(DEPLOY, overlay) if overlay == "base" else os.path.join(DEPLOY, "overlays", overlay)
        with open(os.path.join(directory, "all.yaml"), "w") as f:
            f.write(render(path))
        out[overlay] = str(directory)
    return out


def checkov(directory: str) -> dict[str, Any]:
    result = subprocess.run([judge("checkov"), "-d", directory, "--framework", "kubernetes", "--skip-download",
                             "--quiet", "--compact", "-o", "json"], capture_output=True, text=True, timeout=300,
                            check=False)
    report = json.loads(result.stdout)
    summary: dict[str, Any] = report["summary"] if isinstance(report, dict) else report[0]["summary"]
    return summary


def test_overlays_exist() -> None:
    assert OVERLAYS == ["aks-kvm", "aks-mshv", "kind"]


def test_checkov_passes_the_sources() -> None:
    summary = checkov(DEPLOY)
    assert summary["failed"] == 0, summary
    assert summary["passed"] > 100


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_checkov_passes_every_rendering(rendered: dict[str, str], overlay: str) -> None:
    summary = checkov(rendered[overlay])
    assert summary["failed"] == 0, summary


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_kubernetes_validate_strict(rendered: dict[str, str], overlay: str) -> None:
    result = subprocess.run([judge("kubernetes-validate"), "--strict", os.path.join(rendered[overlay], "all.yaml")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed for resource") == 4


def _daemonsets(text: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents(text) if d["kind"] == "DaemonSet"}


SECURE_CONTAINER = {
    "privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "runAsNonRoot": False, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_security_context_is_fixed_in_the_base(overlay: str) -> None:
    path = os.path.join(DEPLOY, overlay) if overlay == "base" else os.path.join(DEPLOY, "overlays", overlay)
    sets = _daemonsets(render(path))
    assert set(sets) == {"hyperlight-device-access", "hyperlight-device-plugin"}
    for ds in sets.values():
        pod = ds["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["priorityClassName"] == "system-node-critical"
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        (container,) = pod["containers"]
        assert container["securityContext"] == SECURE_CONTAINER
        assert container["terminationMessagePath"] == "/run/termination-log"
        assert "@sha256:" in container["image"]
        for probe, which in (("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
            assert f"--health-check={which}" in container[probe]["exec"]["command"]
        for mount in container["volumeMounts"]:
            if mount["name"] == "host-dev":
                assert mount["mountPath"] == "/host-dev" and mount["readOnly"] is True
    bootstrap = sets["hyperlight-device-access"]["spec"]["template"]["spec"]["containers"][0]
    assert bootstrap["args"] == ["--device-access"]
    assert "--device-access" in bootstrap["livenessProbe"]["exec"]["command"]
    main = sets["hyperlight-device-plugin"]["spec"]["template"]["spec"]["containers"][0]
    assert main["resources"]["limits"]["hyperlight.dev/device-access"] == "1"
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["HOST_DEVICE_DIR"] == "/host-dev"
    assert env["HYPERLIGHT_NFD_FEATURES_DIR"] == "/etc/kubernetes/node-feature-discovery/features.d"
    assert int(env["DEVICE_COUNT"]) > 0


def test_overlays_change_only_what_varies() -> None:
    base = _daemonsets(render(os.path.join(DEPLOY, "base")))
    for overlay in OVERLAYS:
        sets = _daemonsets(render(os.path.join(DEPLOY, "overlays", overlay)))
        for name, ds in sets.items():
            b, o = base[name]["spec"]["template"]["spec"], ds["spec"]["template"]["spec"]
            assert o["securityContext"] == b["securityContext"]
            assert o["volumes"] == b["volumes"]
            assert o["containers"][0]["volumeMounts"] == b["containers"][0]["volumeMounts"]
            assert o["containers"][0]["securityContext"] == b["containers"][0]["securityContext"]


@pytest.mark.parametrize(("overlay", "count", "metrics"), [
    ("base", "2000", False), ("kind", "100", False), ("aks-kvm", "5000", True), ("aks-mshv", "2000", True)])
def test_overlay_settings(overlay: str, count: str, metrics: bool) -> None:
    path = os.path.join(DEPLOY, overlay) if overlay == "base" else os.path.join(DEPLOY, "overlays", overlay)
    main = _daemonsets(render(path))["hyperlight-device-plugin"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert (env["DEVICE_COUNT"], env["DEVICE_UID"], env["DEVICE_GID"]) == (count, "65534", "65534")
    assert ("HYPERLIGHT_METRICS_ADDRESS" in env) == metrics
