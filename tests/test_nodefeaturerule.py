"""The chart's optional NodeFeatureRule (issue 31: 2), rendered and validated against NFD's own
CRD schema (tests/data/nfd, vendored from node-feature-discovery) as strictly as the API server
validates a create with fieldValidation=Strict (kubectl's default): unknown fields refused. No
NFD is installed here: render and validate is the path taken, not a cluster install (the e2e
cluster does not run NFD). Which nodes the rules label is NFD's evaluation of them over sets of
loaded modules."""

from __future__ import annotations

import copy
import os
from typing import Any

import jsonschema
import pytest
import yaml

from hyperlight_agent.device import hypervisors
from tests.test_deploy import documents
from tests.test_docs import ROOT
from tests.test_helm import template

# helm (build/tools).
pytestmark = pytest.mark.judge

CRD = os.path.join(ROOT, "tests", "data", "nfd", "nodefeaturerule-crd.yaml")


def crd() -> dict[str, Any]:
    with open(CRD) as f:
        loaded: dict[str, Any] = yaml.safe_load(f)
    return loaded


def strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused, as strict field validation refuses them: an
    object that lists its properties takes no others."""
    if isinstance(schema, dict):
        out = {key: strict(value) for key, value in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def validator() -> jsonschema.Draft7Validator:
    (version,) = crd()["spec"]["versions"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    # metadata is the API server's ObjectMeta, which the CRD leaves open: only what a manifest sets.
    schema["properties"]["metadata"] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name"],
        "properties": {
            "name": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    return jsonschema.Draft7Validator(schema)


def rendered_rule() -> dict[str, Any]:
    (rule,) = [
        d for d in documents(template("--set", "nodeFeatureRule.enabled=true").stdout) if d["kind"] == "NodeFeatureRule"
    ]
    return rule


def test_off_by_default() -> None:
    assert not [d for d in documents(template().stdout) if d["kind"] == "NodeFeatureRule"]


def test_the_rule_is_valid_for_nfds_crd() -> None:
    definition, rule = crd(), rendered_rule()
    (version,) = definition["spec"]["versions"]
    assert rule["apiVersion"] == f"{definition['spec']['group']}/{version['name']}" and version["served"]
    assert rule["kind"] == definition["spec"]["names"]["kind"]
    assert definition["spec"]["scope"] == "Cluster" and "namespace" not in rule["metadata"]
    errors = [e.message for e in validator().iter_errors(rule)]
    assert not errors, errors


@pytest.mark.parametrize(
    ("path", "bad", "said"),
    [
        (
            ("spec", "rules", 0, "matchAny", 0, "matchFeatures", 0, "matchExpressions", "kvm_intel", "op"),
            "Exist",
            "'Exist' is not one of",
        ),
        (("spec", "rules", 0, "lables"), {"a": "b"}, "'lables' was unexpected"),
        (
            ("spec", "rules", 1, "matchAny", 0, "matchFeatures", 0, "matchExpressions", "mshv_root", "value"),
            "x",
            "'x' is not of type",
        ),
    ],
)
def test_the_validation_refuses_what_the_api_server_would(path: tuple[Any, ...], bad: Any, said: str) -> None:
    rule = copy.deepcopy(rendered_rule())
    target = rule
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = bad
    messages = [e.message for e in validator().iter_errors(rule)]
    assert any(said in m for m in messages), messages


def test_labelled_nodes_are_the_ones_the_agents_select() -> None:
    """Every label a rule sets is one the chart's default nodeSelector asks for, or the
    hypervisor's name from the agent's own table; each hypervisor of the table has its rule."""
    values = yaml.safe_load(template("--show-only", "templates/device-plugin.yaml").stdout)
    selector = values["spec"]["template"]["spec"]["nodeSelector"]
    rules = rendered_rule()["spec"]["rules"]
    names = {h.name for h in hypervisors.HYPERVISORS}
    assert {r["labels"]["hyperlight.dev/hypervisor"] for r in rules} == names
    for rule in rules:
        assert rule["labels"]["hyperlight.dev/enabled"] == selector["hyperlight.dev/enabled"]
    # The agent prefers mshv where both exist: NFD applies rules in order, the last one wins.
    assert rules[-1]["labels"]["hyperlight.dev/hypervisor"] == hypervisors.HYPERVISORS[0].name == "mshv"


def matches(rule: dict[str, Any], modules: set[str]) -> bool:
    """NFD's evaluation of the rules this chart writes, against kernel.loadedmodule (the names in
    /proc/modules): Exists over it, all of a matchFeatures list, any of matchAny."""

    def all_of(terms: list[dict[str, Any]]) -> bool:
        for term in terms:
            assert term["feature"] == "kernel.loadedmodule"
            assert all(e == {"op": "Exists"} for e in term["matchExpressions"].values())
            if not set(term["matchExpressions"]) <= modules:
                return False
        return True

    return all_of(rule.get("matchFeatures", [])) and any(all_of(a["matchFeatures"]) for a in rule["matchAny"])


def labels(rules: list[dict[str, Any]], modules: set[str]) -> dict[str, str]:
    """The node labels NFD derives: each matching rule's, in order (a later one's win)."""
    out: dict[str, str] = {}
    for rule in rules:
        if matches(rule, modules):
            out.update(rule["labels"])
    return out


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        ({"kvm", "kvm_intel", "irqbypass"}, "kvm"),  # Intel VT-x: kvm_intel loaded
        ({"kvm", "kvm_amd", "ccp"}, "kvm"),  # AMD-V
        ({"kvm"}, None),  # only the core: its vendor module failed to load, there is no /dev/kvm
        ({"mshv_root", "mshv_vtl"}, "mshv"),
        ({"mshv_root", "kvm_intel"}, "mshv"),  # both: the agent prefers /dev/mshv, and so do the labels
        ({"hv_vmbus", "hv_netvsc"}, None),  # a Hyper-V guest without nested virtualisation
        (set(), None),  # KVM built into the kernel, as on this test machine: the rule cannot see it
    ],
)
def test_which_nodes_the_rules_label(modules: set[str], expected: str) -> None:
    got = labels(rendered_rule()["spec"]["rules"], modules)
    if expected is None:
        assert got == {}
    else:
        assert got == {"hyperlight.dev/enabled": "true", "hyperlight.dev/hypervisor": expected}


def test_more_modules_where_a_kernel_has_others() -> None:
    rule = documents(
        template(
            "--set",
            "nodeFeatureRule.enabled=true",
            "--set",
            "nodeFeatureRule.modules.kvm={kvm_intel,kvm_amd,kvm_pvm}",
            "--set",
            "nodeFeatureRule.modules.mshv=null",
        ).stdout
    )
    (rendered,) = [d for d in rule if d["kind"] == "NodeFeatureRule"]
    assert not [e.message for e in validator().iter_errors(rendered)]
    assert labels(rendered["spec"]["rules"], {"kvm", "kvm_pvm"})["hyperlight.dev/hypervisor"] == "kvm"
    assert labels(rendered["spec"]["rules"], {"mshv_root"}) == {}
    empty = template(
        "--set",
        "nodeFeatureRule.enabled=true",
        "--set",
        "nodeFeatureRule.modules.kvm=null",
        "--set",
        "nodeFeatureRule.modules.mshv=null",
        check=False,
    )
    assert empty.returncode != 0 and "nodeFeatureRule.modules: both lists are empty" in empty.stderr
