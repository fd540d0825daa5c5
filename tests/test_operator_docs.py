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
    named = re.findall(r'troubleshooting\.md[:,] \\?"([^"\\]+)\\?"', rules)
    assert named and set(named) <= sections, set(named) - sections
    # The runbook links' anchors are those sections' (GitHub's slugs).
    slugs = {re.sub(r"[^a-z0-9 -]", "", section.lower()).replace(" ", "-") for section in sections}
    anchors = re.findall(r"troubleshooting\.md#([a-z0-9-]+)", rules)
    assert anchors and set(anchors) <= slugs, set(anchors) - slugs


def code_fail_prefixes() -> set[str]:
    """Every "FAIL …:" prefix `--check` can print, from the sources: literal ones, and those
    naming a setting (f"FAIL {key}: …") for each directory setting a mode or the device check
    names."""
    from hyperlight_agent import modes

    sources = ["hyperlight_agent/diagnose.py", "hyperlight_agent/dra/preflight.py"]
    found = set()
    keys = {key for mode in modes.MODES for key in mode.kubelet_dirs} | {"device_dir", "host_device_dir"}
    for path in sources:
        for prefix in re.findall(r'"(FAIL [^":]+):', read(path)):
            found |= {f"FAIL {key}:" for key in keys} if prefix == "FAIL {key}" else {prefix + ":"}
    return found


def test_the_troubleshooting_guides_fail_lines_are_the_codes() -> None:
    """troubleshooting.md told to look for `FAIL api …` while the code prints `FAIL API server:`
    (issue 36: 6): every FAIL line the guide names is one `--check` prints, and the guide's table
    names every one."""
    guide = read("docs/troubleshooting.md")
    named = {m.split(":")[0] + ":" for m in re.findall(r"`(FAIL [^`]+)`", guide)}
    code = code_fail_prefixes()
    assert len(code) >= 10, code
    assert named <= code, named - code
    table = set(re.findall(r"^\| (`FAIL .*?) \|", guide, re.M)[0:])
    in_table = {m + ":" for row in table for m in re.findall(r"`(FAIL [^:`]+):`", row)}
    assert in_table == code, (code - in_table, in_table - code)


def test_every_alert_has_the_runbook_metrics_md_promises() -> None:
    """docs/metrics.md says every alert carries a `runbook_url`; HyperlightDeviceUnusable had none
    (issue 50: 8). Each alert of the chart's rule has one, into a section of the troubleshooting
    guide, and metrics.md's table lists exactly the chart's alerts."""
    rules = read("deploy/helm/hyperlight-agent/templates/prometheusrule.yaml")
    alerts = re.split(r"^\s+- alert: ", rules, flags=re.M)[1:]
    names = [alert.split("\n", 1)[0].strip() for alert in alerts]
    assert len(names) >= 6, names
    slugs = {
        re.sub(r"[^\w\- ]", "", s.lower()).replace(" ", "-")
        for s in re.findall(r"^## (.+)$", read("docs/troubleshooting.md"), re.M)
    }
    for name, alert in zip(names, alerts):
        runbook = re.findall(r'runbook_url: .*"%s/troubleshooting\.md#([\w-]+)"', alert)
        assert len(runbook) == 1 and runbook[0] in slugs, f"{name}: runbook_url {runbook}"
    guide = read("docs/metrics.md").split("## Alerts", 1)[1]
    assert "each with a `runbook_url`" in guide
    assert re.findall(r"^\| `(Hyperlight\w+)` \|", guide, re.M) == names
