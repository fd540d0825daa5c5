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


def test_every_value_is_in_the_table() -> None:
    named = set()
    for cell in values_table():
        # `a.b`, `.c` (a sibling of the cell's first value), `d`
        for path in re.findall(r"`([A-Za-z.]+)`", cell):
            named.add(path.split(".")[0] if not path.startswith(".") else "")
    missing = sorted(set(values()) - named)
    assert not missing, f"docs/deploy.md's values table lacks {missing}"
