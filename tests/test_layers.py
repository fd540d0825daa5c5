"""Module boundaries beside what `lint-imports` checks (pyproject.toml's [tool.importlinter]: the
layers, the protocols' independence, what the files and the device may not know): every module is
in one of its layers, no import cycle (also none hidden in a function), the leaves import nothing
of ours, package inits import nothing, and every module imports on its own. And every module has
its test file, named by one pattern (TESTS)."""

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

from tests.test_docs import ROOT

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


# --- tests by module ------------------------------------------------------------------------------
# A module's tests live in tests/test_<its path below the package, "/" as "_">.py: test_agent.py for
# agent.py, test_device_checker.py for device/checker.py, test_dra_service.py for dra/service.py.
# The files for behaviour across modules (the agent as a process, the faults, the packages...) are
# named for what they test, never like a module's file. The generated message code (*_pb2) is
# protoc's, held to proto/ by test_proto.py; __init__ and __main__ are not in MODULES.
TESTS = os.path.join(ROOT, "tests")
TESTED_MODULES = [m for m in MODULES if not m.endswith("_pb2")]

# The few modules tested through other modules' files, each with the reason and where.
TESTED_ELSEWHERE = {
    "contracts": (
        ("test_deploy.py", "test_one_home.py", "test_device_hypervisors.py"),
        "names and numbers other parties own, no behaviour: each held to its owner where a test can see one",
    ),
    "kubelet_side": (("test_parts.py",), "the seam's types only: test_parts.py runs a toy side through it"),
    "deviceplugin.side": (("test_agent.py",), "the device plugin side runs as the agent's, in-process"),
    "dra.types": (("test_dra_claims.py", "test_dra_service.py"), "types only: its reader and its user"),
    "host.successor": (
        ("test_host_upgrade.py",),
        "one behaviour with host/upgrade.py, the in-place upgrade, tested whole under the service manager",
    ),
}

# Test files named like a subpackage module's (test_<subpackage>_<name>.py, or a subpackage
# module's bare name) that test across modules, and what.
ACROSS_MODULES = {
    "test_device_access.py": "the --device-access mode through the agent's parts",
    "test_handover.py": "two whole agents handing the kubelet over (the device plugin side, its handover, peers)",
}


def file_of(module: str) -> str:
    """The module's test file's name: "dra.service" → test_dra_service.py."""
    return "test_" + module.replace(".", "_") + ".py"


def _tests_exist(name: str) -> bool:
    return os.path.isfile(os.path.join(TESTS, name))


def _holds_a_test(name: str) -> bool:
    with open(os.path.join(TESTS, name)) as f:
        return re.search(r"^(async )?def test_", f.read(), flags=re.MULTILINE) is not None


def test_every_module_has_its_test_file() -> None:
    missing = [
        f"{m}: tests/{file_of(m)}" for m in TESTED_MODULES if m not in TESTED_ELSEWHERE and not _tests_exist(file_of(m))
    ]
    assert not missing, "modules without their test file (or a reason in TESTED_ELSEWHERE): " + ", ".join(missing)
    empty = [file_of(m) for m in TESTED_MODULES if m not in TESTED_ELSEWHERE and not _holds_a_test(file_of(m))]
    assert not empty, f"test files holding no test of their module: {empty}"


def test_a_module_tested_elsewhere_is_one_without_a_file_of_its_own() -> None:
    for module, (files, why) in TESTED_ELSEWHERE.items():
        assert module in TESTED_MODULES, f"{module}: no such module"
        assert not _tests_exist(file_of(module)), f"{module} has {file_of(module)} now: drop it from TESTED_ELSEWHERE"
        assert why and all(_tests_exist(f) for f in files), f"{module}: {files} must exist"


def test_test_files_follow_the_one_pattern() -> None:
    """A file named test_<subpackage>_<name>.py is the module <subpackage>/<name>.py's, and no file
    is named for a subpackage module's bare name (test_registration.py: which registration?)."""
    bare = {m.split(".", 1)[1] for m in MODULES if "." in m} - set(MODULES)
    wrong = []
    for name in sorted(os.listdir(TESTS)):
        if not (name.startswith("test_") and name.endswith(".py")) or name in ACROSS_MODULES:
            continue
        stem = name[len("test_") : -len(".py")]
        sub = next((s for s in SUBPACKAGES if stem.startswith(s + "_")), None)
        if sub is not None and f"{sub}.{stem[len(sub) + 1 :]}" not in MODULES:
            wrong.append(f"{name}: no module {sub}/{stem[len(sub) + 1 :]}.py")
        if stem in bare:
            wrong.append(f"{name}: a subpackage module's bare name; its file is test_<subpackage>_{stem}.py")
    assert not wrong, wrong
    assert all(_tests_exist(name) for name in ACROSS_MODULES)
