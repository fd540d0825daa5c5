"""Module boundaries a reader can check: no import cycle (also none hidden in a function), no
module imports one from a higher layer of ARCHITECTURE.md's list, each subpackage imports only what
its docstring says it may, the leaves import nothing of ours, and every module imports on its own in
a fresh interpreter."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from tests.test_docs import ROOT, read

PACKAGE = os.path.join(ROOT, "hyperlight_agent")


def _modules() -> list[str]:
    """Every module of the package by its dotted name below `hyperlight_agent` ("device.kernel")."""
    found = []
    for directory, _, files in os.walk(PACKAGE):
        prefix = os.path.relpath(directory, PACKAGE).replace(os.sep, ".")
        for name in files:
            if name.endswith(".py") and name not in ("__init__.py", "__main__.py"):
                found.append(name[:-3] if prefix == "." else f"{prefix}.{name[:-3]}")
    return sorted(found)


MODULES = _modules()
SUBPACKAGES = sorted({m.split(".")[0] for m in MODULES if "." in m})


def _source(module: str) -> str:
    with open(os.path.join(PACKAGE, *module.split(".")) + ".py") as f:
        return f.read()


def imports_of(module: str) -> set[str]:
    """Our modules that `module` imports anywhere in its source (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(_source(module))):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{module}: our modules import ours absolutely"
            if node.module == "hyperlight_agent" or node.module.startswith("hyperlight_agent."):
                base = node.module[len("hyperlight_agent."):]
                for alias in node.names:
                    name = f"{base}.{alias.name}" if base else alias.name
                    found.add(name if name in MODULES else base)
        elif isinstance(node, ast.Import):
            prefix = "hyperlight_agent."
            found.update(a.name[len(prefix):] for a in node.names if a.name.startswith(prefix))
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
    """ARCHITECTURE.md's layers, lowest first: the bullets between "The modules are in layers" and the
    module table, each naming its modules in backticks."""
    section = read("ARCHITECTURE.md").split("## Modules", 1)[1].split("The modules are in layers", 1)[1]
    section = section.split("| module |", 1)[0]
    bullets = re.split(r"^- ", section, flags=re.MULTILINE)[1:]
    return [set(re.findall(r"`([\w.]+)`", bullet)) for bullet in bullets]


def test_architecture_puts_every_module_in_one_layer() -> None:
    found = layers()
    assert len(found) >= 3
    named = [m for layer in found for m in layer]
    assert sorted(named) == MODULES, "each module in exactly one layer of ARCHITECTURE.md's list"


def test_architecture_module_table_names_every_module() -> None:
    table = re.findall(r"^\| `([\w./]+)\.py` \|", read("ARCHITECTURE.md"), flags=re.MULTILINE)
    assert sorted(t.replace("/", ".") for t in table) == MODULES


def test_no_module_imports_a_higher_layer() -> None:
    level = {m: i for i, layer in enumerate(layers()) for m in layer}
    upward = [f"{m} → {dep}" for m in MODULES for dep in sorted(imports_of(m)) if level[dep] > level[m]]
    assert not upward, f"imports from a higher layer (ARCHITECTURE.md, ## Modules): {upward}"


def allowed(subpackage: str) -> set[str]:
    """What the subpackage's docstring says it may import: top-level modules and subpackages."""
    with open(os.path.join(PACKAGE, subpackage, "__init__.py")) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    line = re.search(r"^May import: (.*)\.$", doc, flags=re.MULTILINE)
    assert line, f"{subpackage}/__init__.py: its docstring says what it owns and ends 'May import: ...'"
    return {name.strip() for name in line.group(1).split(",")}


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_subpackage_imports_only_what_its_docstring_allows(subpackage: str) -> None:
    may = allowed(subpackage) | {subpackage}
    assert may <= set(SUBPACKAGES) | set(MODULES), f"{subpackage} allows unknown names: {may}"
    wrong = [f"{m} → {dep}" for m in MODULES if m.startswith(subpackage + ".")
             for dep in sorted(imports_of(m)) if dep.split(".")[0] not in may and dep not in may]
    assert not wrong, f"{subpackage}/__init__.py does not allow: {wrong}"


def test_subpackages_depend_one_way() -> None:
    """Two subpackages never both allow importing each other."""
    both = [(a, b) for a in SUBPACKAGES for b in SUBPACKAGES if a < b and b in allowed(a) and a in allowed(b)]
    assert not both


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_subpackage_init_is_import_free(subpackage: str) -> None:
    """The probe helper imports `device` with the standard library only; every package init stays
    free of imports, so importing one module never loads its neighbours."""
    with open(os.path.join(PACKAGE, subpackage, "__init__.py")) as f:
        tree = ast.parse(f.read())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_leaves_import_nothing_of_ours_but_contracts() -> None:
    assert imports_of("contracts") == set()
    assert imports_of("text") == set()
    assert imports_of("backoff") == set()
    assert imports_of("device.kernel") == {"contracts", "text"}
    assert imports_of("device.hypervisors") == {"contracts", "device.kernel"}
    assert imports_of("device.helper_process") == {"text", "device.kernel", "device.hypervisors"}


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module: str) -> None:
    subprocess.run([sys.executable, "-c", f"import hyperlight_agent.{module}"], cwd=ROOT, check=True,
                   timeout=60, capture_output=True)


def _top_packages_imported(path: str) -> set[str]:
    found: set[str] = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
    return found


@pytest.mark.parametrize(("tree", "forbidden"), [("hyperlight_agent", {"tests", "standin", "bench"}),
                                             ("standin", {"tests", "bench"}), ("bench", {"tests"})])
def test_development_trees_stand_on_their_own(tree: str, forbidden: set[str]) -> None:
    """The shipped package needs none of the development trees; the stand-ins and the benchmarks
    need no test module (a test's rename or fixture must never break `make run` or `make bench`)."""
    for directory, _, files in os.walk(os.path.join(ROOT, tree)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                wrong = _top_packages_imported(path) & forbidden
                assert not wrong, f"{os.path.relpath(path, ROOT)} imports {sorted(wrong)}"
