"""Module boundaries a reader can check: no import cycle (also none hidden in a function), no
module imports one from a higher layer of ARCHITECTURE.md's list, the leaves import nothing of ours,
and every module imports on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.test_docs import ROOT, read

PACKAGE = os.path.join(ROOT, "hyperlight_agent")
MODULES = sorted(n[:-3] for n in os.listdir(PACKAGE) if n.endswith(".py") and n not in ("__init__.py", "__main__.py"))


def imports_of(module: str) -> set[str]:
    """Our modules that `module` imports anywhere in its source (functions included)."""
    with open(os.path.join(PACKAGE, module + ".py")) as f:
        tree = ast.parse(f.read())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("hyperlight_agent."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("hyperlight_agent."))
    return found & set(MODULES)


def test_no_import_cycle() -> None:
    graph = {m: imports_of(m) for m in MODULES}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "visiting"
        for dep in sorted(graph[module]):
            if state.get(dep) == "visiting":
                raise AssertionError("import cycle: " + " → ".join([*path, module, dep]))
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [])


def layers() -> list[set[str]]:
    """ARCHITECTURE.md's layers, lowest first: the bullets between "## Modules" and the module table,
    each naming its modules in backticks."""
    section = read("ARCHITECTURE.md").split("## Modules", 1)[1].split("| module |", 1)[0]
    bullets = re.split(r"^- ", section, flags=re.MULTILINE)[1:]
    return [set(re.findall(r"`(\w+)`", bullet)) for bullet in bullets]


def test_architecture_puts_every_module_in_one_layer() -> None:
    found = layers()
    assert len(found) >= 3
    named = [m for layer in found for m in layer]
    assert sorted(named) == MODULES, "each module in exactly one layer of ARCHITECTURE.md's list"


def test_no_module_imports_a_higher_layer() -> None:
    level = {m: i for i, layer in enumerate(layers()) for m in layer}
    upward = [f"{m} → {dep}" for m in MODULES for dep in sorted(imports_of(m)) if level[dep] > level[m]]
    assert not upward, f"imports from a higher layer (ARCHITECTURE.md, ## Modules): {upward}"


def test_leaves_import_nothing_of_ours_but_contracts() -> None:
    assert imports_of("contracts") == set()
    assert imports_of("kernel") == {"contracts"}
    assert imports_of("hypervisors") == {"kernel"}
    assert imports_of("helper_main") == {"kernel", "hypervisors"}


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module: str) -> None:
    subprocess.run([sys.executable, "-c", f"import hyperlight_agent.{module}"], cwd=ROOT, check=True,
                   timeout=60, capture_output=True)
