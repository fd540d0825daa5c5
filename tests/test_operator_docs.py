"""The operators' guides (docs/operations.md, docs/troubleshooting.md): every command block says
whether a test runs it, and a test it names exists; the alerts' pointers into the troubleshooting
guide name its sections."""

from __future__ import annotations

import os
import re

import pytest

from tests.test_docs import ROOT

GUIDES = ["docs/operations.md", "docs/troubleshooting.md"]
MARKER = re.compile(r"<!-- (illustrative|run by: (tests/\w+\.py)::(\w+)) -->\n```sh\n")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


@pytest.mark.parametrize("guide", GUIDES)
def test_every_command_block_says_whether_a_test_runs_it(guide: str) -> None:
    text = read(guide)
    blocks = text.count("```sh\n")
    marked = MARKER.findall(text)
    assert blocks > 0 and len(marked) == blocks, f"{guide}: {blocks - len(marked)} command blocks without a marker"
    for _, path, name in marked:
        if path:
            assert re.search(rf"^def {name}\(", read(path), re.M), f"{guide} names {path}::{name}, which does not exist"


def test_the_alerts_point_at_sections_of_the_troubleshooting_guide() -> None:
    sections = set(re.findall(r"^## (.+)$", read("docs/troubleshooting.md"), re.M))
    rules = read("deploy/helm/hyperlight-agent/templates/prometheusrule.yaml")
    named = re.findall(r'docs/troubleshooting\.md: \\?"([^"\\]+)\\?"', rules)
    assert named and set(named) <= sections, set(named) - sections
