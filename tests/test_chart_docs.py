"""The chart's values are documented: every value has its default in values.yaml, its rule in
values.schema.json and its row in docs/deploy.md's table (one table, issue 31: 1)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml

from hyperlight_agent import config, contracts
from tests.e2e.cluster import versions
from tests.releases import packaging_module
from tests.test_docs import ROOT

CHART = os.path.join(ROOT, "deploy", "helm", "hyperlight-agent")


def values() -> dict[str, Any]:
    with open(os.path.join(CHART, "values.yaml")) as f:
        loaded: dict[str, Any] = yaml.safe_load(f)
    return loaded


def schema() -> dict[str, Any]:
    with open(os.path.join(CHART, "values.schema.json")) as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded


def values_table() -> list[str]:
    """The first cell of each row of docs/deploy.md's values table."""
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        text = f.read()
    table = text.split("| value | default | meaning |", 1)[1].split("\n\n", 1)[0]
    return [line.split("|")[1] for line in table.splitlines()[2:]]


def test_every_value_has_a_default_and_a_rule() -> None:
    """values.schema.json refuses unknown keys (additionalProperties: false), so a value without
    a rule could not be set, and a rule without a default would be undocumented."""
    rules = schema()
    assert rules["additionalProperties"] is False
    assert set(values()) == set(rules["properties"]) - {"global"}


# Values whose keys are Kubernetes' own (a map of labels, an affinity, a strategy): the table
# names the value, not each key.
FREE_FORM = {"nodeSelector", "affinity", "podAnnotations", "podLabels", "podSecurityContext", "updateStrategy"}


def test_every_value_is_in_the_table() -> None:
    """Each value, and each key of a value that is a group of settings (metrics.podMonitor...),
    has its row: `a.b` names a.b; a following `.c` in the same cell names a.c."""
    named: set[str] = set()
    for cell in values_table():
        first = ""
        for name in re.findall(r"`([A-Za-z][A-Za-z.]*|\.[A-Za-z.]+)`", cell):
            if name.startswith("."):
                path = first.rsplit(".", 1)[0] + name
            else:
                path = first = name
            parts = path.split(".")
            named.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    wanted = set()
    for key, value in values().items():
        wanted.add(key)
        if isinstance(value, dict) and key not in FREE_FORM:
            wanted.update(f"{key}.{child}" for child in value)
    missing = sorted(wanted - named)
    assert not missing, f"docs/deploy.md's values table lacks {missing}"


def test_the_schemas_agent_names_are_the_settings_tables() -> None:
    """extraEnv took any HYPERLIGHT_* name, which the agent then refused at start (issue 50: 6):
    the schema's list is the one the settings table gives, as packaging/chart_env.py writes it."""
    chart_env = packaging_module("chart_env")
    names = schema()["definitions"]["agentEnvName"]["enum"]
    assert names == chart_env.names(), "run `python packaging/chart_env.py` to write the list again"
    assert names == sorted({s.env for s in config.SETTINGS if s.env.startswith("HYPERLIGHT_")} | {config.CONFIG_ENV})
    assert "HYPERLIGHT_CHECK_INTERVAL" in names and "DEVICE_COUNT" not in names
    # Only a HYPERLIGHT_* name is held to the list (the agent ignores the others).
    item = schema()["properties"]["extraEnv"]["items"]
    assert item["if"] == {"properties": {"name": {"pattern": "^HYPERLIGHT_"}}}
    assert item["then"] == {"properties": {"name": {"$ref": "#/definitions/agentEnvName"}}}
    with open(os.path.join(CHART, "values.schema.json")) as f:
        text = f.read()
    assert chart_env.render(text) == text


def deploy_guide() -> str:
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        return f.read()


def section(text: str, heading: str) -> str:
    """The text under a `## heading` up to the next heading of that level."""
    return text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]


def test_the_slice_holds_one_shared_device_where_the_api_keeps_it_as_the_guide_says() -> None:
    """deploy.md said every node's slice holds `draDevices` devices, while the chart's default
    (`draSharedDevice: auto`) publishes one shared device where the API server keeps
    allowMultipleAllocations (issue 50: 8). The sentence names both cases with the defaults the
    chart and the agent have; tests/test_dra_slices.py and test_dra_side.py run both cases."""
    dra = section(deploy_guide(), "Dynamic Resource Allocation")
    sentence = " ".join(dra.split("Each labelled node's slice holds", 1)[1].split(". ", 1)[0].split())
    assert sentence.startswith("one device, named for the hypervisor (`kvm` or `mshv`), that every claim shares")
    assert values()["draSharedDevice"] == config.BY_KEY["dra_shared_device"].default == "auto"
    assert "`draSharedDevice: auto`, the default" in sentence and "`draSharedDevice: off`" in sentence
    assert values()["draDevices"] == config.BY_KEY["dra_devices"].default == contracts.RESOURCE_SLICE_MAX_DEVICES
    assert schema()["properties"]["draDevices"]["maximum"] == contracts.RESOURCE_SLICE_MAX_DEVICES
    assert f"`draDevices` identical devices ({contracts.RESOURCE_SLICE_MAX_DEVICES} by default and at most" in sentence
    assert f"{contracts.RESOURCE_SLICE_MAX_TAINTED_DEVICES} while they carry a taint" in sentence


def test_the_guide_names_containerd_2_as_tested() -> None:
    """deploy.md said containerd 2.x was "not measured" while the e2e cluster runs containerd 2.2.9
    and README's matrix says so (issue 50: 8)."""
    runtimes = section(deploy_guide(), "Container runtimes and CDI")
    containerd = versions()["containerd"].lstrip("v")
    assert containerd.startswith("2.")
    (bullet,) = [line for line in runtimes.splitlines() if line.startswith("- **containerd 2.x**")]
    assert "Not measured" not in bullet and f"containerd {containerd}" in runtimes.split("- **containerd 1.7**")[0]
    assert not re.search(r"Not measured[^.]*containerd 2", runtimes), "containerd 2 is measured"
    assert f"containerd {containerd}" in section(deploy_guide(), "Tested Kubernetes and containerd")


def memory_limit(resources: dict[str, Any]) -> str:
    return str(resources["devicePlugin"]["limits"]["memory"])


def test_the_memory_figures_are_the_charts() -> None:
    """deploy.md said 128 Mi "(160 Mi with metrics)" while `metrics.enabled` renders 128 Mi (issue
    50: 8): the guide's figures are values.yaml's, and 160 Mi is what the values files and the
    kustomize component that turn metrics on set (test_helm.py renders metrics.enabled alone)."""
    guide = deploy_guide()
    ours = values()["resources"]
    parts = ("devicePlugin", "draDriver", "deviceAccess")
    row = "requests {}; limits CPU {}".format(
        ", ".join(f"{ours[p]['requests']['cpu']}/{ours[p]['requests']['memory']}" for p in parts),
        ", ".join(f"{ours[p]['limits']['cpu']} and {ours[p]['limits']['memory']}" for p in parts),
    )
    assert f"| {row} (bursts" in guide
    prose = " ".join(guide.split("Tolerations: `CriticalAddonsOnly`", 1)[1].split("\n\n", 1)[0].split())
    plugin = ours["devicePlugin"]
    assert f"{plugin['requests']['cpu']} and {plugin['requests']['memory'][:-2]} Mi requested" in prose
    assert f"a {memory_limit(ours)[:-2]} Mi limit" in prose
    (raised,) = re.findall(r"raise that limit to (\d+) Mi", prose)
    for name in ("aks-kvm", "aks-mshv"):
        with open(os.path.join(ROOT, "deploy", "helm", "values", f"{name}.yaml")) as f:
            assert memory_limit(yaml.safe_load(f)["resources"]) == f"{raised}Mi", name
    with open(os.path.join(ROOT, "deploy", "components", "metrics", "kustomization.yaml")) as f:
        assert f"memory: {raised}Mi" in f.read()
    assert "`metrics.enabled` alone leaves `resources` as they are" in prose


def test_the_nfd_feature_file_is_said_to_be_off_by_default() -> None:
    """deploy.md said "The plugin writes" the NFD feature file, which is off unless nfd.featuresDir
    is set (issue 50: 8)."""
    assert values()["nfd"]["featuresDir"] == "" and config.BY_KEY["nfd_features_dir"].default is None
    labels = " ".join(section(deploy_guide(), "Node labels").split())
    assert labels.startswith(
        'The agent\'s own feature file is off by default (`nfd.featuresDir: ""`). With `nfd.featuresDir` set'
    )
    assert labels.index("With `nfd.featuresDir` set") < labels.index("the plugin writes")


def test_the_chart_and_kustomize_claim_names_the_test_that_checks_it() -> None:
    """deploy.md said the chart with no values renders exactly the kustomize base; a chart from a
    checkout renders its own image (issue 50: 8): the claim is a release's chart's, and names the
    test that renders both and compares them."""
    install = " ".join(section(deploy_guide(), "Install").split("###", 1)[0].split())
    assert "a release's chart (its image digest set) with no values renders exactly the kustomize base" in install
    (name,) = re.findall(r"`tests/test_helm\.py::(\w+)`", install)
    with open(os.path.join(ROOT, "tests", "test_helm.py")) as f:
        assert re.search(rf"^def {name}\(", f.read(), re.M)
