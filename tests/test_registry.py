"""`make publish` into a real OCI registry (the CNCF distribution registry, built from its pinned Go
module, on this machine): the image pushed unchanged (the digest the chart names), the chart
installable from OCI by --version, the images (the agent's, the Hyperlight example's) signed with
cosign and their SBOMs attached as attestations — and verification failing for an image that is not the signed one."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from typing import Any

import pytest
import yaml

from tests.e2e.tools import tool
from tests.releases import CURRENT, PREVIOUS, Keyring, Published, manifest, resign

pytestmark = pytest.mark.system

INSECURE = ["--allow-http-registry", "--allow-insecure-registry"]


def cosign(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([tool("cosign"), *args], capture_output=True, text=True, timeout=120, check=False)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def verify(published: Published, reference: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return cosign(
        "verify",
        "--key",
        published.cosign_pub,
        "--insecure-ignore-tlog=true",
        *INSECURE,
        *extra,
        reference,
        check=check,
    )


def skopeo(*args: str) -> str:
    return subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=300, check=True).stdout


@pytest.mark.parametrize("version", [PREVIOUS, CURRENT])
def test_the_registry_serves_the_image_the_chart_names(published: Published, version: str) -> None:
    m = manifest(published.releases[version])
    repository = f"{published.host}/hyperlight-dev/hyperlight-agent"
    assert (
        skopeo("inspect", "--tls-verify=false", "--format", "{{.Digest}}", f"docker://{repository}:{version}").strip()
        == m["image"]["digest"]
    )
    chart = subprocess.run(
        [tool("helm"), "show", "values", published.chart(), "--version", version, "--plain-http"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    values = yaml.safe_load(chart)
    image = values["image"]
    assert (image["repository"], image["releaseDigest"], image["digest"], image["tag"]) == (
        "ghcr.io/hyperlight-dev/hyperlight-agent",
        m["image"]["digest"],
        "",
        "",
    )
    # `helm test`'s pods run the release's Hyperlight example, which the registry serves too.
    assert values["tests"]["workloadImage"] == f"ghcr.io/hyperlight-dev/hyperlight-example@{m['example']['digest']}"
    example = f"{published.host}/hyperlight-dev/hyperlight-example"
    assert (
        skopeo("inspect", "--tls-verify=false", "--format", "{{.Digest}}", f"docker://{example}:{version}").strip()
        == m["example"]["digest"]
    )


def test_cosign_verifies_the_release_image_by_digest_and_by_tag(published: Published) -> None:
    reference = published.image(CURRENT)
    claims = json.loads(verify(published, reference).stdout)
    assert {c["critical"]["image"]["docker-manifest-digest"] for c in claims} == {reference.split("@", 1)[1]}
    verify(published, f"{published.host}/hyperlight-dev/hyperlight-agent:{CURRENT}")


def test_cosign_verifies_the_example_image_by_digest(published: Published) -> None:
    reference = published.example(CURRENT)
    claims = json.loads(verify(published, reference).stdout)
    assert {c["critical"]["image"]["docker-manifest-digest"] for c in claims} == {reference.split("@", 1)[1]}


@pytest.mark.parametrize("kind", ["image", "example"])
def test_the_sbom_is_attached_as_a_verified_attestation(published: Published, kind: str) -> None:
    reference = published.image(CURRENT) if kind == "image" else published.example(CURRENT)
    done = cosign(
        "verify-attestation",
        "--key",
        published.cosign_pub,
        "--insecure-ignore-tlog=true",
        *INSECURE,
        "--type",
        "cyclonedx",
        reference,
    )
    statements = [
        json.loads(base64.b64decode(json.loads(line)["payload"])) for line in done.stdout.splitlines() if line.strip()
    ]
    release = published.releases[CURRENT]
    with open(os.path.join(release, manifest(release)["sboms"][kind])) as f:
        sbom = json.load(f)
    # The agent's image differs per release (its version is in it); the example's does not, so
    # N-1's publish attested the same digest with its own SBOM (the same crates, its version).
    same = {manifest(r)[kind]["digest"] for r in published.releases.values()}
    assert len(same) == (2 if kind == "image" else 1)
    assert len(statements) == (1 if kind == "image" else 2)
    assert sbom in [s["predicate"] for s in statements]
    assert {s["subject"][0]["digest"]["sha256"] for s in statements} == {reference.split("sha256:", 1)[1]}


def tampered_archive(release: str, directory: str) -> str:
    """The release's image with one change to its configuration (an environment variable added):
    another manifest, so another digest, that nobody signed."""
    m = manifest(release)
    layout = os.path.join(directory, "layout")
    with tarfile.open(os.path.join(release, m["image"]["archive"])) as archive:
        archive.extractall(layout)  # noqa: S202 (the release's own archive, just built)
    blobs = os.path.join(layout, "blobs", "sha256")

    def read(digest: str) -> dict[str, object]:
        with open(os.path.join(blobs, digest.removeprefix("sha256:"))) as f:
            found: dict[str, object] = json.load(f)
        return found

    def write(value: dict[str, object]) -> tuple[str, int]:
        data = json.dumps(value).encode()
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, digest), "wb") as f:
            f.write(data)
        return f"sha256:{digest}", len(data)

    index = read_index(layout)
    image = read(str(index["manifests"][0]["digest"]))
    config_desc = image["config"]
    assert isinstance(config_desc, dict)
    config = read(config_desc["digest"])
    config["config"]["Env"].append("INJECTED=1")  # type: ignore[index]
    config_desc["digest"], config_desc["size"] = write(config)
    index["manifests"][0]["digest"], index["manifests"][0]["size"] = write(image)
    with open(os.path.join(layout, "index.json"), "w") as f:
        json.dump(index, f)
    return layout


def read_index(layout: str) -> dict[str, list[dict[str, object]]]:
    with open(os.path.join(layout, "index.json")) as f:
        found: dict[str, list[dict[str, object]]] = json.load(f)
    return found


def test_an_unsigned_or_retagged_image_fails_verification(published: Published, tmp: str) -> None:
    release = published.releases[CURRENT]
    layout = tampered_archive(release, tmp)
    unsigned = f"{published.host}/hyperlight-dev/unsigned:{CURRENT}"
    skopeo("copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false", f"oci:{layout}", f"docker://{unsigned}")
    refused = verify(published, unsigned, check=False)
    assert refused.returncode != 0 and "no signatures found" in refused.stderr, refused.stderr

    # The release's tag pointed at the tampered image: verifying the tag now fails; the release's
    # digest still verifies. Then the tag is put back, for the session's other tests.
    tag = f"{published.host}/hyperlight-dev/hyperlight-agent:{CURRENT}"
    skopeo("copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false", f"oci:{layout}", f"docker://{tag}")
    try:
        refused = verify(published, tag, check=False)
        assert refused.returncode != 0 and "no signatures found" in refused.stderr, refused.stderr
        verify(published, published.image(CURRENT))
    finally:
        skopeo(
            "copy",
            "--quiet",
            "--preserve-digests",
            "--dest-tls-verify=false",
            "--src-tls-verify=false",
            f"docker://{published.image(CURRENT)}",
            f"docker://{tag}",
        )
    verify(published, tag)

    # A signed image copied to another repository carries no signature there.
    moved = f"{published.host}/elsewhere/hyperlight-agent:{CURRENT}"
    skopeo(
        "copy",
        "--quiet",
        "--preserve-digests",
        "--dest-tls-verify=false",
        "--src-tls-verify=false",
        f"docker://{published.image(CURRENT)}",
        f"docker://{moved}",
    )
    refused = verify(published, moved, check=False)
    assert refused.returncode != 0 and "no signatures found" in refused.stderr, refused.stderr


def test_another_key_does_not_verify_the_release_image(published: Published, tmp: str) -> None:
    subprocess.run(
        [tool("cosign"), "generate-key-pair"],
        cwd=tmp,
        check=True,
        capture_output=True,
        env={**os.environ, "COSIGN_PASSWORD": ""},
        timeout=60,
    )
    refused = cosign(
        "verify",
        "--key",
        os.path.join(tmp, "cosign.pub"),
        "--insecure-ignore-tlog=true",
        *INSECURE,
        published.image(CURRENT),
        check=False,
    )
    assert refused.returncode != 0, refused.stdout


def test_make_publish_refuses_a_throwaway_key_and_another_key(published: Published, tmp: str) -> None:
    """A release signed with a key made for its build (`make release` without RELEASE_GPG_KEY), and
    one re-signed by another key, are refused by `make publish` before anything is pushed, whatever
    key they carry; the release key is configured, never taken from the release."""
    project = published.builder.keyring
    throwaway = Keyring(os.path.join(tmp, "throwaway"), "ed25519", "throwaway")
    try:
        cases = [
            # (signed by, carried keys, release.json's ephemeral flag, configured fingerprint, refusal)
            (throwaway, [throwaway], True, project.fingerprint, "signed with a key made for that build only"),
            # The fingerprint taken from the release itself: still refused.
            (throwaway, [throwaway], True, throwaway.fingerprint, "signed with a key made for that build only"),
            (
                throwaway,
                [throwaway],
                False,
                project.fingerprint,
                f"SHA256SUMS.asc: signed by {throwaway.fingerprint}, not by the release key {project.fingerprint}",
            ),
            (throwaway, [project], False, project.fingerprint, f"ERRSIG {throwaway.fingerprint[-16:]}"),
        ]
        for n, (signer, carried, ephemeral, fingerprint, refusal) in enumerate(cases):
            dist = os.path.join(tmp, f"dist-{n}")
            release = os.path.join(dist, CURRENT)
            shutil.copytree(published.releases[CURRENT], release)
            resign(release, signer, carried, ephemeral)
            site = os.path.join(tmp, f"site-{n}")
            done = published.publish(release, site, namespace=f"refused{n}", fingerprint=fingerprint, check=False)
            assert done.returncode != 0, (n, done.stdout)
            (line,) = [x for x in done.stderr.splitlines() if x.startswith("make publish: ")]
            assert refusal in line, (n, done.stderr)
            assert not os.path.exists(site), "nothing for the web host"
            assert not [r for r in published.repositories() if r.startswith(f"refused{n}/")], "nothing pushed"
            shutil.rmtree(dist)
        # The same copy re-signed by the release key is published (the refusals were the keys').
        release = os.path.join(tmp, "dist", CURRENT)
        shutil.copytree(published.releases[CURRENT], release)
        resign(release, project, [project], False)
        done = published.publish(release, os.path.join(tmp, "site"), namespace="accepted", check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "accepted/hyperlight-agent" in published.repositories()
    finally:
        throwaway.close()


def chart_manifest(reference: str) -> tuple[str, dict[str, Any]]:
    """The chart's OCI manifest as the registry serves it: (its digest, the manifest)."""
    raw = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{reference}")
    return "sha256:" + hashlib.sha256(raw.encode()).hexdigest(), json.loads(raw)


def test_cosign_verifies_the_chart_by_digest_and_it_is_the_release_s(published: Published, tmp: str) -> None:
    """The chart decides which image digest users run, so it is signed as the image is: its OCI
    manifest, by digest, whose one layer is the release's chart package."""
    chart = f"{published.host}/hyperlight-dev/charts/hyperlight-agent"
    release = published.releases[CURRENT]
    digest, served = chart_manifest(f"{chart}:{CURRENT}")
    with open(os.path.join(release, manifest(release)["chart"]), "rb") as f:
        package = "sha256:" + hashlib.sha256(f.read()).hexdigest()
    assert [layer["digest"] for layer in served["layers"]] == [package]
    claims = json.loads(verify(published, f"{chart}@{digest}").stdout)
    assert {c["critical"]["image"]["docker-manifest-digest"] for c in claims} == {digest}
    verify(published, f"{chart}:{CURRENT}")

    # A changed chart (another default image) pushed as the same version elsewhere: nobody signed it.
    layout = os.path.join(tmp, "chart")
    with tarfile.open(os.path.join(release, manifest(release)["chart"])) as package_file:
        package_file.extractall(layout)  # noqa: S202 (the release's own chart, just built)
    values = os.path.join(layout, "hyperlight-agent", "values.yaml")
    with open(values) as f:
        text = f.read()
    with open(values, "w") as f:
        f.write(text.replace(manifest(release)["image"]["digest"], "sha256:" + "1" * 64))
    helm = tool("helm")
    subprocess.run(
        [helm, "package", os.path.join(layout, "hyperlight-agent"), "--destination", tmp],
        check=True,
        capture_output=True,
        timeout=120,
    )
    for source, namespace in ((os.path.join(tmp, f"hyperlight-agent-{CURRENT}.tgz"), "tampered"), (None, "elsewhere")):
        # (None: the release's own chart, copied to another repository: no signature there.)
        subprocess.run(
            [
                helm,
                "push",
                source or os.path.join(release, manifest(release)["chart"]),
                f"oci://{published.host}/{namespace}/charts",
                "--plain-http",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        refused = verify(published, f"{published.host}/{namespace}/charts/hyperlight-agent:{CURRENT}", check=False)
        assert refused.returncode != 0 and "no signatures found" in refused.stderr, refused.stderr
