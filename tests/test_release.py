"""`make release`: everything a release publishes, in dist/<version>/, signed; the chart's default
image is the release's image by digest; each artefact carries exactly its lock in pins/, which its
SBOM lists; and a second build of the same commit has the same dependency set."""

from __future__ import annotations

import datetime
import email.utils
import glob
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
from typing import Any

import pytest
import yaml
from packaging.utils import canonicalize_name

from tests import hyperlight
from tests.e2e.tools import tool
from tests.locks import shared_build_tree
from tests.releases import (
    CURRENT,
    DEBS,
    EXAMPLE_REPOSITORY,
    IMAGE_REPOSITORY,
    RPMS,
    TARGETS,
    image_python,
    manifest,
)
from tests.test_docs import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

pytestmark = pytest.mark.system

PLACEHOLDER = b"sha256:" + b"0" * 64
# Every artefact with Python dependencies: each target's package, and the image.
KINDS = (*(t.tag for t in TARGETS), "image")


def lock(kind: str) -> dict[str, tuple[str, set[str]]]:
    """The lock an artefact installs: canonical name → (version, sha256 hashes)."""
    path = os.path.join(ROOT, manifest_locks()[kind])
    entries: dict[str, tuple[str, set[str]]] = {}
    name = ""
    with open(path) as f:
        for line in f:
            if match := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
                name = canonicalize_name(match.group(1))
                entries[name] = (match.group(2), set())
            elif match := re.match(r"^\s+--hash=sha256:([0-9a-f]{64})", line):
                entries[name][1].add(match.group(1))
    return entries


def manifest_locks() -> dict[str, str]:
    """Each artefact's lock: its target's Python's, the image's Python's."""
    return {
        **{t.tag: f"pins/runtime-py{t.python}.txt" for t in TARGETS},
        "image": f"pins/runtime-py{image_python()}.txt",
    }


def files(release: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, n), release): os.path.getsize(os.path.join(d, n))
        for d, _, names in os.walk(release)
        for n in names
    }


def vendored(release: str, kind: str) -> dict[str, str]:
    """Every file of the artefact's Python tree (path below the tree → sha256), bytecode aside."""
    m = manifest(release)
    found: dict[str, str] = {}
    if kind == "image":
        _, every = oci_image(os.path.join(release, m["image"]["archive"]))
        top = "opt/hyperlight-agent/"
        found = {path.removeprefix(top): digest for path, digest in every.items() if path.startswith(top)}
    else:
        with tempfile.TemporaryDirectory() as scratch:
            package = os.path.join(release, m["packages"][kind])
            if package.endswith(".deb"):
                subprocess.run(["dpkg-deb", "-x", package, scratch], check=True, timeout=120)
            else:
                with subprocess.Popen(["rpm2cpio", package], stdout=subprocess.PIPE) as rpm2cpio:
                    subprocess.run(
                        ["cpio", "-idm", "--quiet"], stdin=rpm2cpio.stdout, cwd=scratch, check=True, timeout=120
                    )
            lib = os.path.join(scratch, "usr", "lib", "hyperlight-agent")
            for directory, _, names in os.walk(lib):
                for name in names:
                    path = os.path.join(directory, name)
                    with open(path, "rb") as f:
                        found[os.path.relpath(path, lib)] = hashlib.sha256(f.read()).hexdigest()
    return {path: digest for path, digest in found.items() if "__pycache__" not in path and not path.startswith("bin/")}


def oci_image(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """An OCI archive's one image: its configuration, and every regular file of its layers (path →
    sha256)."""
    found: dict[str, str] = {}
    with tarfile.open(path) as archive:

        def blob(digest: str) -> bytes:
            member = archive.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert member is not None
            return member.read()

        (entry,) = json.loads(blob_index(archive))["manifests"]
        image = json.loads(blob(entry["digest"]))
        for layer in image["layers"]:
            with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(layer["digest"])))) as tree:
                for member in tree.getmembers():
                    if member.isfile():
                        data = tree.extractfile(member)
                        assert data is not None
                        found[member.name] = hashlib.sha256(data.read()).hexdigest()
        config: dict[str, Any] = json.loads(blob(image["config"]["digest"]))
    return config, found


def blob_index(archive: tarfile.TarFile) -> bytes:
    member = archive.extractfile("index.json")
    assert member is not None
    return member.read()


def distributions(tree: dict[str, str]) -> dict[str, str]:
    """canonical name → version, from the tree's *.dist-info directories."""
    found: dict[str, str] = {}
    for path in tree:
        top = path.split("/", 1)[0]
        if top.endswith(".dist-info"):
            name, version = top.removesuffix(".dist-info").rsplit("-", 1)
            found[canonicalize_name(name)] = version
    return found


def test_make_release_holds_everything_a_release_publishes(release_builder: Any, release_current: str) -> None:
    listed = files(release_current)
    print(f"\nmake release VERSION={CURRENT}: {len(listed)} files, {sum(listed.values())} bytes")
    for path, size in sorted(listed.items()):
        print(f"{size:>12}  {path}")
    m = manifest(release_current)
    v = CURRENT
    expected = {
        *(t.package(v) for t in TARGETS),
        f"hyperlight-agent-{v}.oci.tar",
        f"hyperlight-example-{v}.oci.tar",
        f"hyperlight-agent-{v}.tgz",
        "hyperlight-agent.asc",
        "release.json",
        "SHA256SUMS",
        "SHA256SUMS.asc",
        # One pool, a suite per Debian and Ubuntu release; a repository per RPM distribution.
        *(f"apt/dists/{t.suite}/{name}" for t in DEBS for name in ("InRelease", "Release", "Release.gpg")),
        *(f"apt/pool/main/h/hyperlight-agent/{t.package(v)}" for t in DEBS),
        *(f"yum/{t.suite}/x86_64/repodata/repomd.xml{s}" for t in RPMS for s in ("", ".asc")),
        *(f"yum/{t.suite}/x86_64/Packages/{t.package(v)}" for t in RPMS),
    }
    assert expected <= set(listed), sorted(expected - set(listed))
    assert m["packages"] == {t.tag: t.package(v) for t in TARGETS}
    assert set(m["sboms"]) == {*KINDS, "example"}
    for kind in m["sboms"]:
        assert m["sboms"][kind] in listed
    assert m["version"] == v and m["image"]["repository"] == IMAGE_REPOSITORY
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", m["image"]["digest"])
    assert m["signing_key_ephemeral"] is False
    # make release says where each suite and repository is.
    assert m["repositories"] == {"apt": [t.suite for t in DEBS], "yum": [t.suite for t in RPMS]}
    said = release_builder.outputs[v]
    assert f"apt suites: {' '.join(t.suite for t in DEBS)} (apt/dists/<suite>/InRelease)\n" in said, said
    assert f"yum repositories: {' '.join(t.suite for t in RPMS)} (yum/<name>/x86_64/repodata/repomd.xml.asc)\n" in said


@pytest.mark.parametrize("suite", [t.suite for t in DEBS])
def test_the_apt_release_expires_and_says_when(release_current: str, suite: str) -> None:
    """Valid-Until: apt refuses the repository's metadata after it, so a mirror frozen at an old
    release (withholding a fix) is noticed; the published copy is re-signed before then."""
    with open(os.path.join(release_current, "apt", "dists", suite, "Release")) as f:
        fields = dict(line.split(": ", 1) for line in f.read().splitlines() if re.match(r"^[A-Z][\w-]*: ", line))
    date = email.utils.parsedate_to_datetime(fields["Date"])
    assert email.utils.parsedate_to_datetime(fields["Valid-Until"]) - date == datetime.timedelta(days=30)
    assert fields["Codename"] == suite


def test_sha256sums_lists_every_file_and_is_signed(release_current: str, tmp: str) -> None:
    env = {**os.environ, "GNUPGHOME": os.path.join(tmp, "gnupg")}
    os.makedirs(env["GNUPGHOME"], mode=0o700)
    subprocess.run(
        ["gpg", "--batch", "--import", os.path.join(release_current, "hyperlight-agent.asc")],
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    verified = subprocess.run(
        ["gpg", "--batch", "--verify", "SHA256SUMS.asc", "SHA256SUMS"],
        cwd=release_current,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert verified.returncode == 0 and "Good signature" in verified.stderr, verified.stderr
    checked = subprocess.run(
        ["sha256sum", "--strict", "-c", "SHA256SUMS"],
        cwd=release_current,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with open(os.path.join(release_current, "SHA256SUMS")) as f:
        listed = {line.split("  ", 1)[1].rstrip("\n") for line in f}
    assert listed == set(files(release_current)) - {"SHA256SUMS", "SHA256SUMS.asc"}
    # And a changed file is caught.
    with open(os.path.join(release_current, "SHA256SUMS")) as f:
        tampered = f.read().replace(manifest(release_current)["chart"], "x" + manifest(release_current)["chart"])
    with open(os.path.join(tmp, "SHA256SUMS"), "w") as f:
        f.write(tampered)
    refused = subprocess.run(
        [
            "gpg",
            "--batch",
            "--verify",
            os.path.join(release_current, "SHA256SUMS.asc"),
            os.path.join(tmp, "SHA256SUMS"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode != 0 and "BAD signature" in refused.stderr, refused.stderr


def test_the_charts_default_image_is_the_release_image_by_digest(release_current: str) -> None:
    m = manifest(release_current)
    with tarfile.open(os.path.join(release_current, m["image"]["archive"])) as archive:
        (entry,) = json.loads(blob_index(archive))["manifests"]
    assert entry["digest"] == m["image"]["digest"]
    chart = os.path.join(release_current, m["chart"])
    with tarfile.open(chart) as package:

        def read(name: str) -> Any:
            member = package.extractfile(f"hyperlight-agent/{name}")
            assert member is not None
            return yaml.safe_load(member)

        assert read("Chart.yaml")["version"] == CURRENT and read("Chart.yaml")["appVersion"] == CURRENT
        # The chart's own image is the release's (releaseDigest); image.digest and image.tag are the
        # user's to set, empty as shipped.
        assert read("values.yaml")["image"] == {
            **read("values.yaml")["image"],
            "repository": IMAGE_REPOSITORY,
            "releaseDigest": entry["digest"],
            "digest": "",
            "tag": "",
        }
    rendered = subprocess.run(
        [tool("helm"), "template", "hyperlight", chart],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    images = {
        c["image"]
        for d in yaml.safe_load_all(rendered)
        if d and d["kind"] == "DaemonSet"
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"{IMAGE_REPOSITORY}@{entry['digest']}"}


def test_the_example_image_is_the_example_built_from_its_locks_and_what_helm_test_runs(release_current: str) -> None:
    """The release's image of the Hyperlight example holds the example's two files and nothing
    else, as this session's build of the same locks made them, runs non-root, and is what the
    chart's `helm test` pods run, by digest."""
    m = manifest(release_current)
    example = m["example"]
    assert example["repository"] == EXAMPLE_REPOSITORY
    path = os.path.join(release_current, example["archive"])
    with tarfile.open(path) as archive:
        (entry,) = json.loads(blob_index(archive))["manifests"]
    assert entry["digest"] == example["digest"]
    config, found = oci_image(path)
    built = hyperlight.example()

    def sha(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    assert found == {"hyperlight-example": sha(built.host), "hyperlight-guest": sha(built.guest)}
    assert config["config"]["User"] == "65534:65534"
    assert config["config"]["Entrypoint"] == [hyperlight.HOST_IN_IMAGE]
    reference = f"{EXAMPLE_REPOSITORY}@{example['digest']}"
    with tarfile.open(os.path.join(release_current, m["chart"])) as package:
        member = package.extractfile("hyperlight-agent/values.yaml")
        assert member is not None
        assert yaml.safe_load(member)["tests"]["workloadImage"] == reference
    rendered = subprocess.run(
        [tool("helm"), "template", "hyperlight", os.path.join(release_current, m["chart"]), "--set", "mode=both"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    tests = [
        d
        for d in yaml.safe_load_all(rendered)
        if d and d["kind"] == "Pod" and d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    assert len(tests) == 2, [d["metadata"]["name"] for d in tests]
    assert {c["image"] for d in tests for c in d["spec"]["containers"]} == {reference}


def test_the_example_sbom_lists_exactly_its_cargo_locks(release_current: str) -> None:
    m = manifest(release_current)
    assert m["example_locks"] == [
        "deploy/examples/hyperlight/host/Cargo.lock",
        "deploy/examples/hyperlight/guest/Cargo.lock",
    ]
    expected: dict[tuple[str, str], set[str]] = {}
    for path in m["example_locks"]:
        with open(os.path.join(ROOT, path), "rb") as f:
            for package in tomllib.load(f)["package"]:
                if "source" in package:
                    expected[(package["name"], package["version"])] = {package["checksum"]}
    with open(os.path.join(release_current, m["sboms"]["example"])) as f:
        bom = json.load(f)
    assert bom["bomFormat"] == "CycloneDX" and "serialNumber" not in bom
    assert (bom["metadata"]["component"]["name"], bom["metadata"]["component"]["version"]) == (
        "hyperlight-example",
        CURRENT,
    )
    listed = {
        (c["name"], c["version"]): {h["content"] for r in c.get("externalReferences", []) for h in r.get("hashes", [])}
        for c in bom["components"]
    }
    assert listed == expected
    assert ("hyperlight-host", "0.18.0") in listed
    # Package URLs percent-encode a version's "+" (toml_edit 0.25.20+spec-1.1.0).
    assert all(
        c["purl"].split("@", 1) == [f"pkg:cargo/{c['name']}", urllib.parse.quote(c["version"], safe=".-_~")]
        for c in bom["components"]
    )
    # The graph starts at the example's own crates: what they depend on directly.
    (root,) = [d for d in bom["dependencies"] if d["ref"] == bom["metadata"]["component"]["bom-ref"]]
    assert "pkg:cargo/hyperlight-host@0.18.0" in root["dependsOn"]


def test_no_placeholder_digest_anywhere_in_a_release(release_current: str) -> None:
    found = []
    for path in files(release_current):
        full = os.path.join(release_current, path)
        if path.endswith((".tgz", ".oci.tar")):
            with tarfile.open(full) as archive:
                for member in archive.getmembers():
                    data = archive.extractfile(member)
                    content = data.read() if data else b""
                    if member.name.startswith("blobs/") and content[:2] == b"\x1f\x8b":
                        content = gzip.decompress(content)
                    if PLACEHOLDER in content:
                        found.append(f"{path}:{member.name}")
        else:
            with open(full, "rb") as f:
                if PLACEHOLDER in f.read():
                    found.append(path)
    assert found == []
    # (The check is real: the kustomize base in the tree has one; a release ships no manifest of it.)
    with open(os.path.join(ROOT, "deploy", "base", "device-plugin.yaml"), "rb") as f:
        assert PLACEHOLDER in f.read()


@pytest.mark.parametrize("kind", KINDS)
def test_each_sbom_lists_exactly_its_lock(release_current: str, kind: str) -> None:
    m = manifest(release_current)
    assert m["locks"][kind] == manifest_locks()[kind]
    with open(os.path.join(release_current, m["sboms"][kind])) as f:
        bom = json.load(f)
    assert bom["bomFormat"] == "CycloneDX"
    assert bom["metadata"]["component"]["name"] == "hyperlight-agent"
    assert bom["metadata"]["component"]["version"] == CURRENT
    listed = {
        canonicalize_name(c["name"]): (
            c["version"],
            {h["content"] for r in c.get("externalReferences", []) for h in r.get("hashes", [])},
        )
        for c in bom["components"]
    }
    assert listed == lock(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_each_artefact_installs_exactly_its_lock(release_current: str, kind: str) -> None:
    installed = distributions(vendored(release_current, kind))
    assert installed.pop("hyperlight-agent") == CURRENT
    assert installed == {name: version for name, (version, _) in lock(kind).items()}


def test_a_second_release_of_the_same_commit_has_the_same_dependency_set(
    release_builder: Any, release_current: str
) -> None:
    # Nothing of the first build reused: its wheels (build/wheels/<version>) are made anew.
    with shared_build_tree():
        shutil.rmtree(os.path.join(ROOT, "build", "wheels", CURRENT), ignore_errors=True)
        again = release_builder.release(CURRENT, dist=os.path.join(release_builder.directory, "dist-again"))
    compared = 0
    for kind in KINDS:
        first, second = vendored(release_current, kind), vendored(again, kind)
        ours = ("hyperlight_agent/", f"hyperlight_agent-{CURRENT}.dist-info/")
        deps_first = {p: d for p, d in first.items() if not p.startswith(ours)}
        deps_second = {p: d for p, d in second.items() if not p.startswith(ours)}
        assert distributions(first) == distributions(second), kind
        assert deps_first == deps_second, f"{kind}: {sorted(set(deps_first.items()) ^ set(deps_second.items()))[:5]}"
        compared += len(deps_first)
        with (
            open(os.path.join(release_current, manifest(release_current)["sboms"][kind])) as f,
            open(os.path.join(again, manifest(again)["sboms"][kind])) as g,
        ):
            assert json.load(f) == json.load(g), kind
    # The example's image and SBOM: the same bytes.
    assert manifest(again)["example"]["digest"] == manifest(release_current)["example"]["digest"]
    with (
        open(os.path.join(release_current, manifest(release_current)["sboms"]["example"])) as f,
        open(os.path.join(again, manifest(again)["sboms"]["example"])) as g,
    ):
        assert f.read() == g.read()
    print(
        f"\ntwo builds of {CURRENT}: {compared} dependency files in {len(KINDS)} artefacts, byte-identical; SBOMs "
        "equal; the example's image the same digest"
    )
    for release in (release_current, again):
        assert not glob.glob(os.path.join(release, "**", "*.partial"), recursive=True)
