"""Module boundaries beside what `lint-imports` checks (pyproject.toml's [tool.importlinter]: the
layers, the protocols' independence, what the files and the device may not know): every module is
in one of its layers, no import cycle (also none hidden in a function), the leaves import nothing
of ours, package inits import nothing, and every module imports on its own."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

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
                base = node.module[len("hyperlight_agent.") :]
                for alias in node.names:
                    name = f"{base}.{alias.name}" if base else alias.name
                    found.add(name if name in MODULES else base)
        elif isinstance(node, ast.Import):
            prefix = "hyperlight_agent."
            found.update(a.name[len(prefix) :] for a in node.names if a.name.startswith(prefix))
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
    """The import-linter layers contract's layers, highest first, as module names below the package."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (layered,) = [c for c in contracts if c["type"] == "layers"]
    return [
        {m.strip().removeprefix("hyperlight_agent.") for m in re.split(r"[|:]", layer)} for layer in layered["layers"]
    ]


def test_every_module_is_in_one_layer_of_the_import_contract() -> None:
    named = [m for layer in layers() for m in layer if m != "__main__"]
    assert sorted(named) == MODULES, "each module in exactly one layer of pyproject.toml's import contract"


def test_architecture_module_table_names_every_module() -> None:
    table = re.findall(r"^\| `([\w./]+)\.py` \|", read("ARCHITECTURE.md"), flags=re.MULTILINE)
    assert sorted(t.replace("/", ".") for t in table) == MODULES


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_subpackage_init_is_import_free(subpackage: str) -> None:
    """The probe helper imports `device` with the standard library only; every package init stays
    free of imports, so importing one module never loads its neighbours."""
    with open(os.path.join(PACKAGE, subpackage, "__init__.py")) as f:
        tree = ast.parse(f.read())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_what_the_probe_helper_loads_is_ours_only_so_far() -> None:
    assert imports_of("contracts") == set()
    assert imports_of("text") == set()
    assert imports_of("backoff") == set()
    assert imports_of("device.kernel") == {"text"}
    assert imports_of("device.hypervisors") == {"text", "device.kernel"}
    assert imports_of("device.helper_process") == {"text", "device.kernel", "device.hypervisors"}


IMPORT_EACH_ALONE = """
import importlib, sys
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n == "hyperlight_agent" or n.startswith("hyperlight_agent.")]:
        del sys.modules[name]  # ours afresh each time; third-party modules may stay loaded
    importlib.import_module("hyperlight_agent." + module)
"""


def test_each_module_imports_alone() -> None:
    """Every module imports with none of ours loaded before it (one interpreter: ours are dropped
    from sys.modules between imports), so none relies on another having been imported first."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_ALONE, *MODULES],
        cwd=ROOT,
        timeout=120,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _modules_imported(path: str) -> set[str]:
    found: set[str] = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


# The real-component harness (tests/e2e: the cluster, certificates, the fleet of publishers) is
# shared by the e2e tests and the fleet benchmark; it is no test and holds no fixture.
HARNESS = "tests.e2e"


@pytest.mark.parametrize(
    ("tree", "forbidden", "allowed"),
    [
        ("hyperlight_agent", {"tests", "standin", "bench"}, ()),
        ("standin", {"tests", "bench"}, ()),
        ("bench", {"tests"}, (HARNESS,)),
        (os.path.join("tests", "e2e"), {"tests", "bench"}, (HARNESS,)),
    ],
)
def test_development_trees_stand_on_their_own(tree: str, forbidden: set[str], allowed: tuple[str, ...]) -> None:
    """The shipped package needs none of the development trees; the stand-ins, the benchmarks and
    the real-component harness need no test module (a test's rename or fixture must never break
    `make run` or `make bench`)."""
    for directory, _, files in os.walk(os.path.join(ROOT, tree)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                wrong = {
                    m
                    for m in _modules_imported(path)
                    if m.split(".")[0] in forbidden and not any(m == a or m.startswith(a + ".") for a in allowed)
                }
                assert not wrong, f"{os.path.relpath(path, ROOT)} imports {sorted(wrong)}"
