"""Module boundaries a reader can check: no import cycle (also none hidden in a function), the
leaves import nothing of ours, and every module imports on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.test_docs import ROOT

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


def test_leaves_import_nothing_of_ours_but_contracts() -> None:
    assert imports_of("contracts") == set()
    assert imports_of("kernel") == {"contracts"}
    assert imports_of("hypervisors") == {"kernel"}
    assert imports_of("helper_main") == {"kernel", "hypervisors"}


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module: str) -> None:
    subprocess.run([sys.executable, "-c", f"import hyperlight_agent.{module}"], cwd=ROOT, check=True,
                   timeout=60, capture_output=True)
