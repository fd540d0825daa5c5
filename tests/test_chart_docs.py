"""The chart's values are documented: every value has its default in values.yaml, its rule in
values.schema.json and its row in docs/deploy.md's table (one table, issue 31: 1)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml

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
