"""The docs are contracts: README's settings table and --help come from the same table."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from hyperlight_agent import cli, config

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


def test_readme_settings_table_is_the_real_one() -> None:
    readme = read("README.md")
    table = re.search(r"<!-- settings-table.*?-->\n(.*?)\n<!-- end settings-table -->", readme, re.S)
    assert table, "README has no settings table"
    assert table.group(1).strip() == config.settings_table()


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
        assert f"env {s.env}; toml {s.key}; default {s.default_text}" in out
    readme = read("README.md")
    for flag in flags - {"--help"}:
        assert flag in readme, f"{flag} is in --help but not in README"


def test_architecture_names_every_module() -> None:
    doc = read("ARCHITECTURE.md")
    package = os.path.join(ROOT, "hyperlight_agent")
    modules = {n for n in os.listdir(package) if n.endswith(".py") and not n.startswith("__")}
    missing = [m for m in sorted(modules) if f"`{m}`" not in doc]
    assert not missing, f"ARCHITECTURE.md does not describe {missing}"


def test_parser_description_matches_readme_summary() -> None:
    """What --help says the agent is, README's "What it is" says too: the same devices, resource
    and spec file."""
    summary = read("README.md").split("## What it is", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"/dev/\w+|hyperlight\.dev/[\w-]+|hyperlight\.json", cli.DESCRIPTION))
    assert named == {"/dev/mshv", "/dev/kvm", "hyperlight.dev/hypervisor", "hyperlight.json"}
    missing = [name for name in sorted(named) if name not in summary]
    assert not missing, f"README's summary does not mention {missing}"
