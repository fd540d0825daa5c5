"""In-cluster manifests: every overlay renders with kubectl kustomize, passes checkov with no
failed check and kubernetes-validate --strict, and keeps the base's security context; the
workload example and the kind cluster config fit the defaults.

Why: docs/decisions/one-source-of-truth-for-manifests.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

import pytest
import yaml

from hyperlight_agent import contracts
from hyperlight_agent.agent import SHUTDOWN_MARGIN_S
from hyperlight_agent.device.helper import CLOSE_BOUND_S
from hyperlight_agent.deviceplugin.side import DevicePluginSide
from hyperlight_agent.dra.side import DraSide
from tests.e2e.tools import tool
from tests.test_docs import ROOT

# The most an agent's stop takes after its handover, whichever its side (agent.shutdown_bound_s).
SHUTDOWN_BOUND_S = max(DevicePluginSide.close_bound_s, DraSide.close_bound_s) + CLOSE_BOUND_S + SHUTDOWN_MARGIN_S

# Rendered by kubectl/helm and judged by checkov and kubernetes-validate (build/tools, build/judges).
pytestmark = pytest.mark.judge

DEPLOY = os.path.join(ROOT, "deploy")
JUDGES = os.path.join(ROOT, "build", "judges", "bin")
OVERLAYS = sorted(os.listdir(os.path.join(DEPLOY, "overlays")))
WORKLOAD = os.path.join(DEPLOY, "examples", "workload.yaml")
DRA_WORKLOAD = os.path.join(DEPLOY, "examples", "dra-workload.yaml")


# The development tree's placeholder, and the digest the tests render in its place (what
# `kustomize edit set image` in an overlay, or a release's chart, would name).
PLACEHOLDER = "sha256:" + "0" * 64
TEST_DIGEST = "sha256:" + "1" * 64


def kustomize(path: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("kubectl"), "kustomize", path], capture_output=True, text=True, check=check, timeout=60)


def render(path: str) -> str:
    """The kustomization at `path` (in deploy/) as a user renders it after naming the image: in a
    copy of deploy/ whose DaemonSets and overlays' images: entries name TEST_DIGEST (the overlays
    refuse to build while they name the placeholder: test_an_overlay_naming_the_placeholder_...)."""
    with tempfile.TemporaryDirectory(prefix="hl-deploy-") as copy:
        shutil.copytree(DEPLOY, copy, dirs_exist_ok=True)
        for directory, _, names in os.walk(copy):
            for name in names:
                target = os.path.join(directory, name)
                if not name.endswith(".yaml") or name == "image-check.yaml":
                    continue
                with open(target) as f:
                    text = f.read()
                if name == "kustomization.yaml":  # its images: entry, as `kustomize edit set image` sets it
                    text = text.replace(f"digest: {PLACEHOLDER}", f"digest: {TEST_DIGEST}")
                elif "kind: DaemonSet" in text:
                    text = text.replace(PLACEHOLDER, TEST_DIGEST)
                with open(target, "w") as f:
                    f.write(text)
        return kustomize(os.path.join(copy, os.path.relpath(path, DEPLOY))).stdout


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
    return checkov_many([directory])


def checkov_many(directories: list[str]) -> dict[str, Any]:
    totals = {"passed": 0, "failed": 0}
    for directory in directories:
        summary = _checkov(directory)
        totals = {key: totals[key] + summary[key] for key in totals}
    return totals


def _checkov(directory: str) -> dict[str, Any]:
    result = subprocess.run(
        [
            judge("checkov"),
            "-d",
            directory,
            "--framework",
            "kubernetes",
            "--skip-download",
            "--quiet",
            "--compact",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = json.loads(result.stdout)
    # One framework's report is an object; nothing to judge gives the bare summary.
    summaries = [report] if isinstance(report, dict) else report
    return {key: sum(r.get("summary", r)[key] for r in summaries) for key in ("passed", "failed")}


def test_overlays_exist() -> None:
    assert OVERLAYS == ["aks-kvm", "aks-mshv", "dra", "kind"]


@pytest.mark.parametrize("overlay", ["aks-kvm", "aks-mshv", "dra"])
def test_an_overlay_naming_the_placeholder_digest_fails_to_build_in_one_line(overlay: str) -> None:
    """README's `kubectl apply -k deploy/overlays/aks-kvm` from a checkout ran the unpullable
    placeholder (ImagePullBackOff on every node): it fails at build now, naming what to set."""
    done = kustomize(os.path.join(DEPLOY, "overlays", overlay), check=False)
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"error: multiple matches for selector ImageDigest.[noVer].[noGrp]/{PLACEHOLDER}.[noNs]:"
        "metadata.annotations.set-images-digest-with-kustomize-edit-set-image"
    )
    images = {
        c["image"]
        for d in documents(render(os.path.join(DEPLOY, "overlays", overlay)))
        if d["kind"] == "DaemonSet"
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"ghcr.io/hyperlight-dev/hyperlight-agent@{TEST_DIGEST}"}


def test_checkov_passes_the_sources() -> None:
    # The chart's templates are not manifests until rendered (tests/test_helm.py judges those), and
    # The other overlays and components hold only patches: each overlay's rendering is judged below.
    sources = [os.path.join(DEPLOY, d) for d in ("base", "examples", os.path.join("components", "dra"))]
    summary = checkov_many(sources)
    assert summary["failed"] == 0, summary
    assert summary["passed"] > 100


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_checkov_passes_every_rendering(rendered: dict[str, str], overlay: str) -> None:
    summary = checkov(rendered[overlay])
    assert summary["failed"] == 0, summary


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_kubernetes_validate_strict(rendered: dict[str, str], overlay: str) -> None:
    result = subprocess.run(
        [judge("kubernetes-validate"), "--strict", os.path.join(rendered[overlay], "all.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    with open(os.path.join(rendered[overlay], "all.yaml")) as f:
        assert result.stdout.count("passed for resource") == len(documents(f.read()))


# The names' prefix in each overlay: the AKS pools' are their own, so both fit in one cluster.
PREFIX = {"aks-kvm": "hl-kvm", "aks-mshv": "hl-mshv"}


def _daemonsets(text: str, prefix: str = "hyperlight") -> dict[str, dict[str, Any]]:
    """The DaemonSets by name, less the overlay's name prefix: hyperlight-device-plugin for
    hl-kvm-device-plugin."""
    return {
        "hyperlight" + d["metadata"]["name"].removeprefix(prefix): d
        for d in documents(text)
        if d["kind"] == "DaemonSet"
    }


SECURE_CONTAINER = {
    "privileged": False,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_security_context_is_fixed_in_the_base(overlay: str) -> None:
    path = os.path.join(DEPLOY, overlay) if overlay == "base" else os.path.join(DEPLOY, "overlays", overlay)
    sets = _daemonsets(render(path), PREFIX.get(overlay, "hyperlight"))
    kubelet_side = "hyperlight-dra-driver" if overlay == "dra" else "hyperlight-device-plugin"
    assert set(sets) == {"hyperlight-device-access", kubelet_side}
    for name, ds in sets.items():
        pod = ds["spec"]["template"]["spec"]
        # Only the DRA driver talks to the API server (its ResourceSlice, the claims it prepares).
        assert pod["automountServiceAccountToken"] is (name == "hyperlight-dra-driver")
        assert pod["priorityClassName"] == "system-node-critical"
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        (container,) = pod["containers"]
        assert container["securityContext"] == SECURE_CONTAINER
        assert container["terminationMessagePath"] == "/run/termination-log"
        assert "@sha256:" in container["image"] or overlay == "kind"  # kind loads by tag
        assert pod["nodeSelector"]["hyperlight.dev/enabled"] == "true", "never on nodes without a hypervisor"
        # A surge update: each agent named for its pod, serving on until its successor is ready,
        # and the kubelet's grace outlasting that wait plus the agent's own bounded stop.
        assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        env = {e["name"]: e for e in container["env"]}
        assert env["HYPERLIGHT_INSTANCE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        handover = float(env["HYPERLIGHT_HANDOVER_SECONDS"]["value"])
        assert handover > 0
        assert pod["terminationGracePeriodSeconds"] >= handover + SHUTDOWN_BOUND_S
        assert ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "hyperlight"
        # The kubelet's probes are HTTP GETs the agent answers itself: no process per probe.
        for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
            assert container[probe]["httpGet"] == {"path": path, "port": "probes"}
        assert {"name": "probes", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
        assert env["HYPERLIGHT_PROBE_ADDRESS"]["value"] == "0.0.0.0:8081"
        # `kubectl exec POD -- hyperlight-agent --check` knows the pod's mode from its environment.
        assert (
            env["HYPERLIGHT_MODE"]["value"]
            == {
                "hyperlight-device-access": "device-access",
                "hyperlight-device-plugin": "plugin",
                "hyperlight-dra-driver": "dra",
            }[name]
        )
        for mount in container["volumeMounts"]:
            if mount["name"] == "host-dev":
                assert mount["mountPath"] == "/host-dev" and mount["readOnly"] is True
    bootstrap = sets["hyperlight-device-access"]["spec"]["template"]["spec"]["containers"][0]
    assert bootstrap["args"] == ["--device-access"]
    main = sets[kubelet_side]["spec"]["template"]["spec"]["containers"][0]
    assert main["resources"]["limits"]["hyperlight.dev/device-access"] == "1"
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["HOST_DEVICE_DIR"] == "/host-dev"
    if overlay == "dra":
        assert main["args"] == ["--dra"]
        assert env["NODE_NAME"] is None  # from the downward API: spec.nodeName
        return
    # NFD's feature directory is opt-in: nothing is made on nodes without NFD (issue 36: 6).
    assert "HYPERLIGHT_NFD_FEATURES_DIR" not in env
    assert not [v for v in sets[kubelet_side]["spec"]["template"]["spec"]["volumes"] if "feature" in str(v)]
    assert int(env["DEVICE_COUNT"]) > 0
    assert env["HYPERLIGHT_ALLOCATION"] == "both", "the default that works on every runtime"


def test_overlays_change_only_what_varies() -> None:
    base = _daemonsets(render(os.path.join(DEPLOY, "base")))
    for overlay in OVERLAYS:
        sets = _daemonsets(render(os.path.join(DEPLOY, "overlays", overlay)), PREFIX.get(overlay, "hyperlight"))
        assert "hyperlight-device-access" in sets, overlay
        for name, ds in sets.items():
            if name not in base:
                continue  # a component's own DaemonSet (components/dra): nothing to compare it with
            b, o = base[name]["spec"]["template"]["spec"], ds["spec"]["template"]["spec"]
            assert o["securityContext"] == b["securityContext"]
            assert o["volumes"] == b["volumes"]
            assert o["containers"][0]["volumeMounts"] == b["containers"][0]["volumeMounts"]
            assert o["containers"][0]["securityContext"] == b["containers"][0]["securityContext"]


@pytest.mark.parametrize(
    ("overlay", "count", "metrics"),
    [("base", "2000", False), ("kind", "100", False), ("aks-kvm", "5000", True), ("aks-mshv", "2000", True)],
)
def test_overlay_settings(overlay: str, count: str, metrics: bool) -> None:
    path = os.path.join(DEPLOY, overlay) if overlay == "base" else os.path.join(DEPLOY, "overlays", overlay)
    main = _daemonsets(render(path), PREFIX.get(overlay, "hyperlight"))["hyperlight-device-plugin"]["spec"]["template"][
        "spec"
    ]["containers"][0]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert (env["DEVICE_COUNT"], env["DEVICE_UID"], env["DEVICE_GID"]) == (count, "65534", "65534")
    assert ("HYPERLIGHT_METRICS_ADDRESS" in env) == metrics
    policy = next(d for d in documents(render(path)) if d["kind"] == "NetworkPolicy")
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/part-of": "hyperlight"}}
    if metrics:
        assert sorted(p["containerPort"] for p in main["ports"]) == [8081, 9464]
        # Only the scraper docs/deploy.md names, only on the metrics port.
        (rule,) = policy["spec"]["ingress"]
        assert rule["from"] == [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            }
        ]
        assert rule["ports"] == [{"protocol": "TCP", "port": 9464}]
    else:
        # The kubelet's probes come from the node, which a NetworkPolicy always lets through.
        assert "ingress" not in policy["spec"] and [p["name"] for p in main["ports"]] == ["probes"]


def test_overlays_patch_by_name_never_by_list_index() -> None:
    """A JSON patch path with a list index (`/env/1/value`) silently hits another entry when the
    base changes; appending (`/-`) is fine."""
    for directory, _, files in os.walk(DEPLOY):
        for name in files:
            if name.endswith(".yaml") and "helm" not in directory:
                with open(os.path.join(directory, name)) as f:
                    text = f.read()
                assert not re.search(r"path: \S*/[0-9]+(/|$)", text, re.M), os.path.join(directory, name)


def test_workload_example_matches_the_defaults() -> None:
    with open(WORKLOAD) as f:
        (deployment,) = [d for d in documents(f.read()) if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    base = _daemonsets(render(os.path.join(DEPLOY, "base")))["hyperlight-device-plugin"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in base["containers"][0]["env"]}
    assert pod["nodeSelector"] == {"hyperlight.dev/enabled": "true"}
    assert {"key": "hyperlight.dev/hypervisor", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # The device node is DEVICE_UID:DEVICE_GID 0660 (CDI): the workload runs as exactly that.
    assert (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"])) == (
        env["DEVICE_UID"],
        env["DEVICE_GID"],
    )
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["hyperlight.dev/hypervisor"] == "1"
    assert "hyperlight.dev/device-access" not in container["resources"]["limits"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_dra_workload_example_asks_for_the_device_class_and_matches_the_defaults() -> None:
    with open(DRA_WORKLOAD) as f:
        docs = documents(f.read())
    (template,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    with open(os.path.join(DEPLOY, "components", "dra", "deviceclass.yaml")) as f:
        (device_class,) = documents(f.read())
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == device_class["metadata"]["name"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": "hypervisor", "resourceClaimTemplateName": template["metadata"]["name"]}]
    (container,) = pod["containers"]
    assert container["resources"]["claims"] == [{"name": "hypervisor"}]
    driver = _daemonsets(render(os.path.join(DEPLOY, "overlays", "dra")))["hyperlight-dra-driver"]
    env = {e["name"]: e.get("value") for e in driver["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"])) == (
        env["DEVICE_UID"],
        env["DEVICE_GID"],
    )


def test_dra_names_come_from_one_home() -> None:
    """The DeviceClass, its CEL selector and the driver's plugin directory are the names the agent
    uses (contracts.py); the chart renders the same objects (tests/test_helm.py)."""
    docs = documents(render(os.path.join(DEPLOY, "overlays", "dra")))
    (device_class,) = [d for d in docs if d["kind"] == "DeviceClass"]
    assert device_class["metadata"]["name"] == contracts.DRA_DEVICE_CLASS
    assert device_class["spec"]["selectors"] == [{"cel": {"expression": f'device.driver == "{contracts.DRA_DRIVER}"'}}]
    driver = _daemonsets(render(os.path.join(DEPLOY, "overlays", "dra")))["hyperlight-dra-driver"]
    paths = {v["hostPath"]["path"] for v in driver["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    assert f"{contracts.DRA_PLUGINS_DIR}/{contracts.DRA_DRIVER}" in paths
    with open(DRA_WORKLOAD) as f:
        assert f'device.attributes["{contracts.DRA_DRIVER}"]' in f.read()


@pytest.mark.parametrize("example", [WORKLOAD, DRA_WORKLOAD], ids=os.path.basename)
def test_an_example_applies_on_a_fresh_cluster_as_written(example: str) -> None:
    """The example named a namespace it did not create (issue 36: 6): each makes every namespace
    its objects are in, at the restricted Pod Security level they meet."""
    with open(example) as f:
        docs = documents(f.read())
    made = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Namespace"}
    used = {d["metadata"]["namespace"] for d in docs if "namespace" in d["metadata"]}
    assert used and used <= set(made), used - set(made)
    assert all(n["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted" for n in made.values())
    assert docs[0]["kind"] == "Namespace", "made before what is in it"


@pytest.mark.parametrize("example", [WORKLOAD, DRA_WORKLOAD], ids=os.path.basename)
@pytest.mark.parametrize("judge_name", ["checkov", "kubernetes-validate"])
def test_workload_examples_pass_the_judges(tmp_path: Any, judge_name: str, example: str) -> None:
    if judge_name == "checkov":
        directory = tmp_path / "workload"
        directory.mkdir()
        shutil.copy(example, directory)
        summary = checkov(str(directory))
        assert summary["failed"] == 0 and summary["passed"] > 50, summary
    else:
        result = subprocess.run(
            [judge("kubernetes-validate"), "--strict", example],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0 and "passed for resource" in result.stdout, result.stdout + result.stderr


def test_kind_config_enables_cdi_and_labels_the_node() -> None:
    with open(os.path.join(DEPLOY, "kind", "cluster.yaml")) as f:
        config = yaml.safe_load(f)
    assert (config["kind"], config["apiVersion"]) == ("Cluster", "kind.x-k8s.io/v1alpha4")
    for node in config["nodes"]:
        assert node["labels"]["hyperlight.dev/enabled"] == "true"
    patches = "\n".join(config["containerdConfigPatches"])
    assert re.search(r"enable_cdi = true", patches) and "/var/run/cdi" in patches
