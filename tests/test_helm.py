"""The Helm chart: lint clean, its schema refuses bad values with a message naming the value,
every rendering passes checkov and kubernetes-validate --strict, and it renders the same
objects as the kustomize base and overlays (one source of truth, checked both ways)."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any, Optional

import pytest
import yaml

from hyperlight_agent import __version__
from tests.test_deploy import DEPLOY, OVERLAYS, checkov, documents, judge, render, tool

# Rendered by kubectl/helm and judged by checkov and kubernetes-validate (build/tools, build/judges).
pytestmark = pytest.mark.judge

CHART = os.path.join(DEPLOY, "helm", "hyperlight-agent")
VALUES = os.path.join(DEPLOY, "helm", "values")
NAMESPACE = "hyperlight-system"
# Labels only Helm can know (release, chart version); everything else must match the base.
HELM_ONLY_LABELS = {"app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "helm.sh/chart"}
MONITORS = ["--set", "metrics.enabled=true", "--set", "metrics.podMonitor.enabled=true",
            "--set", "metrics.serviceMonitor.enabled=true"]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120, check=check)


def template(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return helm("template", "hyperlight", CHART, "--namespace", NAMESPACE, *args, check=check)


def values_file(overlay: str) -> list[str]:
    return [] if overlay == "base" else ["-f", os.path.join(VALUES, f"{overlay}.yaml")]


def test_lint_strict_is_clean() -> None:
    result = helm("lint", "--strict", CHART, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


def test_chart_version_is_the_agents() -> None:
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        text = f.read()
    assert re.search(rf"^version: {re.escape(__version__)}$", text, re.M)
    assert re.search(rf'^appVersion: "{re.escape(__version__)}"$', text, re.M)


def test_values_files_match_the_overlays() -> None:
    assert sorted(f.removesuffix(".yaml") for f in os.listdir(VALUES)) == OVERLAYS


@pytest.mark.parametrize(("setting", "message"), [
    ("deviceCount=-1", "at '/deviceCount': minimum: got -1, want 1"),
    ("deviceCount=100001", "at '/deviceCount': maximum: got 100,001, want 100,000"),
    ("allocation=cdi-only", "at '/allocation': value must be one of 'both', 'cdi', 'device-spec'"),
    ("deviceUid=-5", "at '/deviceUid': minimum: got -5, want 0"),
    ("image.digest=sha256:abc", "at '/image/digest'"),
    ("metrics.port=70000", "at '/metrics/port': maximum"),
    ("devicecount=5", "additional properties 'devicecount' not allowed"),
    ("mode=deviceplugin", "at '/mode': value must be one of 'devicePlugin', 'dra', 'both'"),
    ("draDevices=129", "at '/draDevices': maximum: got 129, want 128"),
])
def test_schema_refuses_bad_values_with_a_clear_message(setting: str, message: str) -> None:
    result = template("--set", setting, check=False)
    assert result.returncode != 0, f"{setting} was accepted"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


def test_schema_wants_a_digest_or_a_tag() -> None:
    result = template("--set", "image.digest=", check=False)
    assert result.returncode != 0 and "at '/image'" in result.stderr, result.stderr
    tagged = template("--set", "image.digest=", "--set", "image.tag=dev").stdout
    images = {c["image"] for d in documents(tagged) if d["kind"] == "DaemonSet"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"ghcr.io/hyperlight-dev/hyperlight-agent:dev"}


@pytest.fixture(scope="module")
def renderings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each rendering in a directory of its own (checkov judges a directory)."""
    out = {}
    for name, args in [*((o, values_file(o)) for o in ["base", *OVERLAYS]), ("monitors", MONITORS)]:
        directory = tmp_path_factory.mktemp(f"helm-{name}")
        with open(directory / "all.yaml", "w") as f:
            f.write(template(*args).stdout)
        out[name] = str(directory)
    return out


@pytest.mark.parametrize("name", ["base", *OVERLAYS, "monitors"])
def test_checkov_passes_every_rendering(renderings: dict[str, str], name: str) -> None:
    summary = checkov(renderings[name])
    assert summary["failed"] == 0, summary
    assert summary["passed"] > 100, summary


@pytest.mark.parametrize("name", ["base", *OVERLAYS, "monitors"])
def test_kubernetes_validate_strict(renderings: dict[str, str], name: str) -> None:
    path = os.path.join(renderings[name], "all.yaml")
    with open(path) as f:
        docs = documents(f.read())
    # PodMonitor and ServiceMonitor are prometheus-operator CRDs: no schema to validate against,
    # so they are judged by shape here and the core objects strictly.
    core = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    core_path = os.path.join(renderings[name], "core.yaml.txt")
    with open(core_path, "w") as f:
        yaml.safe_dump_all(core, f)
    result = subprocess.run([judge("kubernetes-validate"), "--strict", core_path], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed for resource") == len(core)
    monitors = {d["kind"]: d for d in docs if d not in core}
    if name == "monitors":
        assert set(monitors) == {"PodMonitor", "ServiceMonitor"}
        assert monitors["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        assert monitors["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "metrics"
        service = next(d for d in core if d["kind"] == "Service")
        assert service["spec"]["selector"] == monitors["PodMonitor"]["spec"]["selector"]["matchLabels"]
    else:
        assert not monitors


def _normal(value: Any, key: Optional[str] = None) -> Any:
    """Order-free form: named lists (containers, env, volumes, mounts, ports) become dicts by name."""
    if isinstance(value, dict):
        out = {k: _normal(v, k) for k, v in value.items()}
        if key == "labels":
            out = {k: v for k, v in out.items() if k not in HELM_ONLY_LABELS}
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
        return {v["name"]: _normal(v) for v in value}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _objects(text: str) -> dict[tuple[str, str], Any]:
    return {(d["kind"], d["metadata"]["name"]): _normal(d) for d in documents(text)}


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_chart_and_kustomize_render_the_same_objects(overlay: str) -> None:
    """The chart with the overlay's values file (or none, for the base) gives exactly the
    kustomize rendering's objects, but the Namespace (Helm installs into one: docs/deploy.md)."""
    path = os.path.join(DEPLOY, overlay) if overlay == "base" else os.path.join(DEPLOY, "overlays", overlay)
    kustomized = _objects(render(path))
    assert kustomized.pop(("Namespace", NAMESPACE))
    charted = _objects(template(*values_file(overlay)).stdout)
    assert sorted(charted) == sorted(kustomized)
    for key, obj in kustomized.items():
        assert charted[key] == obj, f"{overlay}: {key} differs"
