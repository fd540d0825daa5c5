"""The development tools and judges are pinned exactly, in pins/, and the pins follow pyproject.toml:
an unchanged tree keeps its ruff, mypy and pytest verdicts until `make pin-tools` moves them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.test_docs import ROOT

PINS = os.path.join(ROOT, "pins")


def pins(name: str) -> dict[str, str]:
    """Canonical name → pinned version, from pins/<name>; every line that is not a comment is `name==version`."""
    found: dict[str, str] = {}
    with open(os.path.join(PINS, name)) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", line.strip())
            assert match, f"pins/{name}: not an exact pin: {line.strip()!r}"
            key = canonicalize_name(match.group(1))
            assert key not in found, f"pins/{name}: {key} pinned twice"
            found[key] = match.group(2)
    return found


def extra_requirements() -> list[Requirement]:
    # The extra as pip sees it (the installed project's metadata), not re-parsed from the toml.
    return [
        Requirement(r.split(";")[0])
        for r in importlib.metadata.requires("hyperlight-agent") or []
        if re.search(r"""extra\s*==\s*["']test["']""", r)
    ]


def test_every_tool_of_the_test_extra_is_pinned_within_its_range() -> None:
    # A package the DRA client needs too (anyio) keeps its one pin in pins/dra.txt.
    shared = {canonicalize_name(r.name) for r in extra_requirements()} & set(pins("dra.txt"))
    assert shared <= {"anyio"}
    pinned = {**pins("dev.txt"), **{k: v for k, v in pins("dra.txt").items() if k in shared}}
    extra = extra_requirements()
    assert {canonicalize_name(r.name) for r in extra} == set(pinned)
    for requirement in extra:
        version = pinned[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(version, prereleases=True), f"{requirement}: pinned {version}"


def test_the_venv_runs_the_pinned_tools() -> None:
    # Otherwise the verdicts are some other version's (a venv made before the pins moved).
    for name, version in pins("dev.txt").items():
        assert importlib.metadata.version(name) == version, f"{name}: `make` reinstalls from pins/dev.txt"


def test_the_judges_are_pinned_and_installed_from_the_pins() -> None:
    assert set(pins("judges.txt")) == {"checkov", "kubernetes-validate"}
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    assert "pip install -q -r pins/judges.txt" in makefile
    assert "-e '.[test]' -c pins/dev.txt" in makefile


def test_pin_tools_writes_what_a_venv_has_installed() -> None:
    # `make pin-tools` renders pins/dev.txt from a fresh venv; from this venv it renders the file as it is.
    spec = importlib.util.spec_from_file_location("pins_update", os.path.join(PINS, "update.py"))
    assert spec and spec.loader
    update = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(update)
    path = os.path.join(PINS, "dev.txt")
    with open(path) as f:
        assert (
            update.render(path, sys.executable, update.dev_tools(update.names(os.path.join(PINS, "dra.txt"))))
            == f.read()
        )


def test_the_dra_client_is_pinned_within_its_range_and_installed() -> None:
    pinned = pins("dra.txt")
    assert not set(pinned) & set(pins("dev.txt")), "one pin per package"
    lightkube = next(
        Requirement(r) for r in importlib.metadata.requires("hyperlight-agent") or [] if r.startswith("lightkube")
    )
    assert lightkube.specifier.contains(pinned["lightkube"])
    for name, version in pinned.items():
        assert importlib.metadata.version(name) == version, f"{name}: `make` reinstalls from pins/dra.txt"
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert "-c pins/dev.txt -c pins/dra.txt" in f.read()


def hashed_lock(name: str) -> dict[str, list[tuple[str, list[str]]]]:
    """pins/<name> as uv writes a hashed lock: canonical name → [(version, sha256 hashes)], one entry
    per marker (a universal lock may hold a package twice, for different Pythons)."""
    found: dict[str, list[tuple[str, list[str]]]] = {}
    current: list[str] = []
    with open(os.path.join(PINS, name)) as f:
        for line in f:
            if match := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ ;]+)( ; [^\\]+)? \\$", line):
                current = []
                found.setdefault(canonicalize_name(match.group(1)), []).append((match.group(2), current))
            elif match := re.match(r"^    --hash=sha256:([0-9a-f]{64})( \\)?$", line):
                current.append(match.group(1))
            else:
                assert line.startswith(("#", "    #")), f"pins/{name}: not a hashed lock line: {line!r}"
    return found


def test_the_build_and_release_tools_are_locked_with_every_hash_and_installed_by_them() -> None:
    """What runs in a release build (the build backend, uv, cyclonedx-bom and their dependencies) is
    installed from a complete hashed lock with --require-hashes (pip then refuses anything unpinned)."""
    for name in ("build.txt", "release.txt"):
        lock = hashed_lock(name)
        assert lock, name
        for package, entries in lock.items():
            for version, hashes in entries:
                assert hashes, f"pins/{name}: {package}=={version} has no hash"
    with open(os.path.join(PINS, "release.in")) as f:
        tools = [Requirement(line.strip()) for line in f if line.strip() and not line.startswith("#")]
    assert {canonicalize_name(t.name) for t in tools} == {"cyclonedx-bom", "uv"}
    release = hashed_lock("release.txt")
    for tool in tools:
        (pinned,) = tool.specifier
        assert pinned.operator == "==", f"pins/release.in: {tool} is not an exact pin"
        assert [v for v, _ in release[canonicalize_name(tool.name)]] == [pinned.version]
    assert len(release) > len(tools), "their dependencies are locked too"
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        (backend,) = [Requirement(r) for r in tomllib.load(f)["build-system"]["requires"]]
    for version, _ in hashed_lock("build.txt")[canonicalize_name(backend.name)]:
        assert backend.specifier.contains(version), f"pins/build.txt: {backend.name} {version} outside {backend}"
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    for name in ("build.txt", "release.txt"):
        assert f"--require-hashes -r pins/{name}" in makefile, name
    with open(os.path.join(ROOT, "packaging", "wheels.sh")) as f:
        wheels = f.read()
    builds = [line for line in wheels.splitlines() if " -m pip wheel " in line]
    assert len(builds) == 2 and all("--no-build-isolation" in b for b in builds), builds
