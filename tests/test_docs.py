"""The docs are contracts: docs/settings.md's table and --help come from the same table; the pages
link to what exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hyperlight_agent import cli, config
from tests.releases import packaging_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_readme_opens_with_the_two_commands() -> None:
    opening = read("README.md").split("\n## ")[0]
    assert "make run" in opening
    assert "make test" in opening


def test_ci_runs_the_readme_test_command() -> None:
    # The fast loop first, with every capability dropped (it must need no root), then exactly
    # the README's test command.
    lines = [line for line in read(".ci/run").splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert lines == [
        "make .venv/.installed",
        "setpriv --inh-caps=-all --ambient-caps=-all --bounding-set=-all -- make check",
        "make test",
    ]


def test_the_settings_page_is_the_settings_table() -> None:
    """README's table moved to docs/settings.md (issue 50: 10), written there by
    packaging/settings_doc.py from config.SETTINGS: the page holds exactly what it writes."""
    page = read("docs/settings.md")
    table = re.search(r"<!-- settings-table.*?-->\n(.*?)\n<!-- end settings-table -->", page, re.S)
    assert table, "docs/settings.md has no settings table"
    assert table.group(1).strip() == config.settings_table()
    assert packaging_module("settings_doc").render(page) == page, "run `python packaging/settings_doc.py`"
    assert "settings-table" not in read("README.md"), "one table, on its own page"


def test_help_lists_every_setting_with_env_and_default() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hyperlight_agent", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={**os.environ, "COLUMNS": "1000"},
    ).stdout
    flags = set(re.findall(r"(--[a-z][a-z-]+)", out))
    documented = {s.flag for s in config.SETTINGS} | {"--config"}
    assert documented <= flags
    for s in config.SETTINGS:
        assert f"env {s.env_text}; toml {s.key}; default {s.default_text}" in out
    # The settings' flags are in the settings page's table, the other options on the agent's page.
    pages = read("docs/settings.md") + read("docs/agent.md")
    for flag in flags - {"--help"}:
        assert flag in pages, f"{flag} is in --help but not in docs/settings.md or docs/agent.md"


def test_the_tier_table_is_the_suites_own_collection() -> None:
    """docs/testing.md's tests by tier are what pytest collects now, in the tiers conftest.py gives
    (a new module, or a test moved to another tier, changes it: `python -m tests.tier_index --write`)."""
    from tests.test_conftest import inner_env
    from tests.tier_index import BEGIN, END

    page = read("docs/testing.md")
    now = subprocess.run(
        [sys.executable, "-m", "tests.tier_index"],
        cwd=ROOT,
        env=inner_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert now.startswith("| module |") and "| all |" in now
    assert page[page.index(BEGIN) + len(BEGIN) : page.index(END)].strip() == now.strip(), (
        "run `python -m tests.tier_index --write`"
    )


def test_the_modules_page_is_what_the_modules_say_of_themselves() -> None:
    """docs/modules.md's table is written by packaging/modules_doc.py from each module's docstring,
    in its layer: the page holds exactly what it writes, every module of the package in it."""
    page = read("docs/modules.md")
    assert packaging_module("modules_doc").render(page) == page, "run `python packaging/modules_doc.py`"
    package = os.path.join(ROOT, "hyperlight_agent")
    modules = {
        os.path.relpath(os.path.join(d, n), package)[: -len(".py")]
        for d, _, names in os.walk(package)
        for n in names
        if n.endswith(".py") and not n.startswith("__") and not n.endswith("_pb2.py")
    }
    assert modules and not [m for m in sorted(modules) if f"| `{m}` |" not in page]
    assert "(docs/modules.md)" in read("ARCHITECTURE.md")


def test_parser_description_matches_readme_summary() -> None:
    """What --help says the agent is, README's "What it is" says too: the same devices, resource
    and spec file."""
    summary = read("README.md").split("## What it is", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"/dev/\w+|hyperlight\.dev/[\w-]+|hyperlight\.json", cli.DESCRIPTION))
    assert named == {"/dev/mshv", "/dev/kvm", "hyperlight.dev/hypervisor", "hyperlight.json"}
    missing = [name for name in sorted(named) if name not in summary]
    assert not missing, f"README's summary does not mention {missing}"


# The pages a reader moves between: README, ARCHITECTURE and the guides under docs/.
GUIDES = sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
DECISIONS_INDEX = os.path.join("docs", "decisions", "README.md")
DECISIONS = sorted(
    os.path.join("docs", "decisions", n)
    for n in os.listdir(os.path.join(ROOT, "docs", "decisions"))
    if n.endswith(".md") and n != "README.md"
)
PAGES = ["README.md", "ARCHITECTURE.md", "SECURITY.md", "BENCHMARKS.md", *GUIDES, DECISIONS_INDEX, *DECISIONS]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", read(page), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def links(page: str) -> list[tuple[str, str]]:
    """Each relative Markdown link of a page (outside code blocks), as (file relative to ROOT, anchor)."""
    text = re.sub(r"^```.*?^```", "", read(page), flags=re.S | re.M)
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        found.append((os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page, anchor))
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_link_between_the_pages_lands(page: str) -> None:
    """Pages moved (README's settings and testing, ARCHITECTURE's decisions: issue 50: 10): a link
    names a file that exists and, with an anchor, one of its headings."""
    broken = []
    for path, anchor in links(page):
        if not os.path.exists(os.path.join(ROOT, path)):
            broken.append(f"{path} (no such file)")
        elif anchor and (not path.endswith(".md") or anchor not in anchors(path)):
            broken.append(f"{path}#{anchor}")
    assert not broken, f"{page}: {broken}"


def source_files() -> list[str]:
    """The tree's text files a pointer into the docs can be in: code, scripts, manifests, docs."""
    found = [os.path.join(ROOT, n) for n in os.listdir(ROOT) if n.endswith(".md")]
    for top in ("hyperlight_agent", "packaging", "standin", "tests", "bench", "deploy", "systemd", "docs"):
        for directory, _, names in os.walk(os.path.join(ROOT, top)):
            kept = (n for n in names if n.endswith((".py", ".md", ".yaml", ".service", ".sh")) or "." not in n)
            found += [os.path.join(directory, n) for n in kept]
    return found


def test_each_decision_has_a_page_listed_in_order_and_named_by_what_it_governs() -> None:
    """ARCHITECTURE.md keeps the code's shape and links docs/decisions/, one page per record, each
    listed in its README in order under its own title; every page is named by a file it governs
    (a module's docstring, a script's or a manifest's comment), and every such pointer lands."""
    assert "(docs/decisions/README.md)" in read("ARCHITECTURE.md").split("## Decisions, and why", 1)[1]
    listed = re.findall(r"^- \[(.+)\]\(([\w-]+\.md)\)$", read(DECISIONS_INDEX), re.M)
    assert sorted(page for _, page in listed) == sorted(os.path.basename(p) for p in DECISIONS)
    for title, page in listed:
        assert read(os.path.join("docs", "decisions", page)).startswith(f"# {title}\n\n"), page
    named: set[str] = set()
    for path in source_files():
        if not path.startswith(os.path.join(ROOT, "docs", "decisions", "")):
            with open(path, errors="replace") as f:
                named |= set(re.findall(r"docs/decisions/([\w-]+\.md)", f.read()))
    pages = {page for _, page in listed}
    assert not named - pages - {"README.md"}, f"pointers to no decision page: {sorted(named - pages)}"
    governed = {page for page in pages if any(page in n for n in named)}
    assert pages == governed, f"decision pages no file names: {sorted(pages - governed)}"


def test_readme_and_architecture_stay_short_enough_to_read() -> None:
    """README was 49 KB and ARCHITECTURE.md 94 KB (issue 50: 10), then 30 KB (issue 51): README says
    what it is, how to install it, what is supported and where to read on; ARCHITECTURE.md the
    picture, the seams and the rules (the modules' list and the decisions on pages of their own)."""
    assert len(read("README.md").encode()) < 20_000
    assert len(read("ARCHITECTURE.md").encode()) <= 15_000


HANDOVER = "docs/deploy.md#upgrades-and-restarts-no-pod-notices"


def test_the_hand_over_gap_is_measured_in_one_place_and_linked_from_the_others() -> None:
    """README said 0–5 of 26–107 pods, deploy.md 0–7 of 30–60 (issue 50: 8): the operators' pages
    give the pods a hand-over gap rejected in one place, deploy.md's upgrades section, and the
    pages that mention the gap link there. (docs/decisions/ records history, not a claim.)"""
    figure = re.compile(r"\d+(?:–\d+)? of \d+(?:–\d+)? pods")
    where = {page: figure.findall(read(page)) for page in ["README.md", *GUIDES]}
    assert {page: found for page, found in where.items() if found} == {"docs/deploy.md": ["0–11 of 15–107 pods"]}
    upgrades = read("docs/deploy.md").split("## Upgrades and restarts: no pod notices", 1)[1].split("\n## ", 1)[0]
    assert "0–11 of 15–107 pods" in " ".join(upgrades.split())
    assert f"]({HANDOVER})" in read("README.md").split("## Support matrix", 1)[1]
    for page in ("docs/hosts.md", "docs/operations.md"):
        assert "](deploy.md#upgrades-and-restarts-no-pod-notices)" in read(page), page
