"""`make publish`: put a release built by `make release` where users install it from.

    python packaging/publish.py        (the Makefile passes its settings in the environment)

1. The release is checked first, and refused unless: release.json does not say it was signed
   with a key made for that build only (`signing_key_ephemeral`: a test build); SHA256SUMS.asc is a
   good signature made by the project's release key, named by RELEASE_GPG_FINGERPRINT (configured
   where the publishing runs, never taken from the release: a release re-signed with any other
   key, the one it carries included, is refused); the public key the release carries (what users
   import) is that key and only that; SHA256SUMS lists every file with its hash.
2. The image archives are pushed unchanged (skopeo, --preserve-digests) as VERSION, the agent's to
   REGISTRY/hyperlight-agent and the Hyperlight example's to REGISTRY/hyperlight-example, and the
   registry must then serve the digests the chart names.
3. The chart is pushed to oci://REGISTRY/charts (helm push): `helm install oci://REGISTRY/charts/
   hyperlight-agent --version VERSION`; the registry must then serve the release's chart package
   as the chart's one layer (its SHA-256 is in SHA256SUMS).
4. The images and the chart are signed with cosign by digest (the chart decides which image digests
   users run), and each image's SBOM attached as a CycloneDX attestation. COSIGN_KEY (a cosign
   key file; COSIGN_PASSWORD its password): signed with that key and no transparency log (the
   tests: a key pair per run, no Sigstore reachable). Unset: keyless, the release pipeline's
   way — cosign takes the CI's OIDC identity (GitHub Actions' `id-token: write`), Fulcio
   certifies it and Rekor logs the signature; verify with --certificate-identity.
5. SITE, when set: the signed apt and yum repositories and the public key, copied there for a
   static web host (`deb [signed-by=…] SITE_URL/apt CODENAME main`, `baseurl=SITE_URL/yum/el9/$basearch`).

Settings (environment): VERSION, DIST, REGISTRY (required, e.g. ghcr.io/hyperlight-dev),
RELEASE_GPG_FINGERPRINT (required: the release key's full fingerprint, 40 hex digits),
INSECURE_REGISTRY=1 (plain HTTP: a registry on this machine), COSIGN_KEY, SITE, HELM, COSIGN.
A setting missing or malformed exits 2; any other failure 1, with one line saying what failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Optional

from release import sha256

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "build", "tools")
IMAGE_NAME = "hyperlight-agent"
EXAMPLE_NAME = "hyperlight-example"
CHARTS = "charts"


FINGERPRINT_RE = re.compile(r"[0-9A-F]{40}")
# gpg --status-fd keywords of a signature that is not a good one (doc/DETAILS in GnuPG).
NOT_GOOD = ("BADSIG", "ERRSIG", "EXPSIG", "EXPKEYSIG", "REVKEYSIG", "NO_PUBKEY")


class PublishError(Exception):
    """One line saying what failed."""


class ConfigError(PublishError):
    """A setting missing or malformed: exit 2."""


def run(*argv: str, what: Optional[str] = None, env: Optional[dict[str, str]] = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [""]
        raise PublishError(f"{what or argv[0]}: exit {done.returncode}: {tail[0]}")
    return done.stdout


def release_fingerprint(value: str) -> str:
    """RELEASE_GPG_FINGERPRINT as gpg prints it: 40 hex digits, upper case (spaces allowed between)."""
    if not value:
        raise ConfigError(
            "RELEASE_GPG_FINGERPRINT is not set: the fingerprint of the project's release key, which "
            "must have signed SHA256SUMS (e.g. RELEASE_GPG_FINGERPRINT=$(gpg --list-keys --with-colons KEY))"
        )
    fingerprint = value.replace(" ", "").upper()
    if not FINGERPRINT_RE.fullmatch(fingerprint):
        raise ConfigError(f"RELEASE_GPG_FINGERPRINT {value!r}: not a full OpenPGP v4 fingerprint (40 hex digits)")
    return fingerprint


def signers(status: str, signature: str = "SHA256SUMS.asc") -> list[str]:
    """The primary-key fingerprints of the good signatures in `gpg --status-fd` output; any signature
    that is not good (bad, unverifiable, expired or revoked key) is an error naming `signature`."""
    found = []
    for line in status.splitlines():
        words = line.split()
        if len(words) < 2 or words[0] != "[GNUPG:]":
            continue
        if words[1] in NOT_GOOD:
            raise PublishError(f"{signature}: {words[1]} {' '.join(words[2:3])}: not a good signature")
        if words[1] == "VALIDSIG":
            # VALIDSIG <signing key fpr> <date> <timestamp> <expiry> <version> <reserved> <pk algo>
            # <hash algo> <class> <primary key fpr>: the key users hold is the primary one.
            found.append(words[-1] if len(words) >= 12 else words[2])
    return found


def key_fingerprints(listing: str) -> list[str]:
    """The primary keys' fingerprints in `gpg --show-keys --with-colons` output."""
    fingerprints, primary = [], False
    for line in listing.splitlines():
        fields = line.split(":")
        if fields[0] == "pub":
            primary = True
        elif fields[0] == "fpr" and primary:
            fingerprints.append(fields[9])
            primary = False
        elif fields[0] == "sub":
            primary = False
    return fingerprints


def verify_release(out: str, fingerprint: str) -> dict[str, object]:
    """The release's checks (the module's docstring, step 1); release.json's content."""
    sums = os.path.join(out, "SHA256SUMS")
    if not os.path.exists(sums):
        raise PublishError(f"{out}: no release here (make release VERSION=...)")
    with open(os.path.join(out, "release.json")) as f:
        manifest: dict[str, object] = json.load(f)
    # Said first and plainly: publishing a test build is the likely mistake (nothing of it is
    # trusted yet; it can only refuse).
    if manifest.get("signing_key_ephemeral") is not False:
        raise PublishError(
            f"{out}: signed with a key made for that build only (release.json: signing_key_ephemeral: "
            f"{json.dumps(manifest.get('signing_key_ephemeral'))}); build it with RELEASE_GPG_KEY, the release key"
        )
    key = os.path.join(out, "hyperlight-agent.asc")
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "GNUPGHOME": home}
        run("gpg", "--batch", "--quiet", "--import", key, env=env, what="gpg --import (hyperlight-agent.asc)")
        done = subprocess.run(
            ["gpg", "--batch", "--status-fd", "1", "--verify", sums + ".asc", sums],
            capture_output=True,
            text=True,
            check=False,
            env=env,
        )
        found = signers(done.stdout)
        if done.returncode != 0 or not found:
            tail = done.stderr.strip().splitlines()[-1:] or [""]
            raise PublishError(f"SHA256SUMS signature: exit {done.returncode}: {tail[0]}")
        others = sorted(set(found) - {fingerprint})
        if others:
            raise PublishError(f"SHA256SUMS.asc: signed by {others[0]}, not by the release key {fingerprint}")
        # What users import to trust the repositories: the release key, and no other beside it.
        carried = key_fingerprints(
            run("gpg", "--batch", "--with-colons", "--show-keys", key, env=env, what="gpg --show-keys")
        )
        if carried != [fingerprint]:
            raise PublishError(
                f"hyperlight-agent.asc: holds {', '.join(carried)}, not only the release key {fingerprint}"
            )
    listed = set()
    with open(sums) as f:
        for line in f:
            digest, name = line.rstrip("\n").split("  ", 1)
            listed.add(name)
            if sha256(os.path.join(out, name)) != digest:
                raise PublishError(f"{name}: its SHA-256 is not the one SHA256SUMS lists")
    present = {os.path.relpath(os.path.join(d, n), out) for d, _, ns in os.walk(out) for n in ns}
    unlisted = sorted(present - listed - {"SHA256SUMS", "SHA256SUMS.asc"})
    if unlisted:
        raise PublishError(f"{unlisted[0]}: in the release but not in SHA256SUMS")
    if str(manifest.get("signing_key", "")).upper() != fingerprint:
        raise PublishError(
            f"release.json: signing_key {manifest.get('signing_key')!r}, not the release key {fingerprint}"
        )
    return manifest


class Registries:
    """skopeo's and helm's flags for the registry (plain HTTP with INSECURE_REGISTRY), and pushing
    an image archive there."""

    def __init__(self, insecure: bool) -> None:
        self.tls = ["--tls-verify=false"] if insecure else []
        self.plain = ["--plain-http"] if insecure else []
        self._dest_tls = ["--dest-tls-verify=false"] if insecure else []

    def push(self, archive: str, repository: str, version: str, digest: str) -> str:
        """The archive as it is (its manifest, so its digest, unchanged) as repository:version;
        repository@digest once the registry serves that digest there."""
        name = os.path.basename(archive)
        run(
            "skopeo",
            "copy",
            "--quiet",
            "--preserve-digests",
            *self._dest_tls,
            f"oci-archive:{archive}",
            f"docker://{repository}:{version}",
            what=f"skopeo copy ({name})",
        )
        served = run(
            "skopeo",
            "inspect",
            "--format",
            "{{.Digest}}",
            *self.tls,
            f"docker://{repository}:{version}",
            what=f"skopeo inspect ({repository}:{version})",
        ).strip()
        if served != digest:
            raise PublishError(f"{repository}:{version} is {served}, not the chart's {digest}")
        return f"{repository}@{digest}"


def publish() -> None:
    version = os.environ.get("VERSION", "")
    out = os.path.join(os.path.abspath(os.environ.get("DIST") or os.path.join(ROOT, "dist")), version)
    registry = os.environ.get("REGISTRY", "").rstrip("/")
    if not registry:
        raise ConfigError("REGISTRY is not set (e.g. make publish REGISTRY=ghcr.io/hyperlight-dev)")
    insecure = os.environ.get("INSECURE_REGISTRY", "") not in ("", "0")
    helm = os.environ.get("HELM") or os.path.join(TOOLS, "helm")
    cosign = os.environ.get("COSIGN") or os.path.join(TOOLS, "cosign")
    fingerprint = release_fingerprint(os.environ.get("RELEASE_GPG_FINGERPRINT", ""))
    manifest = verify_release(out, fingerprint)
    image, example = manifest["image"], manifest["example"]
    assert isinstance(image, dict) and isinstance(example, dict)
    repository = f"{registry}/{IMAGE_NAME}"
    if repository != image["repository"]:
        print(
            f"make publish: the chart names {image['repository']}; {repository} serves only as its mirror",
            file=sys.stderr,
        )
    registries = Registries(insecure)
    reference = registries.push(os.path.join(out, str(image["archive"])), repository, version, str(image["digest"]))
    example_reference = registries.push(
        os.path.join(out, str(example["archive"])), f"{registry}/{EXAMPLE_NAME}", version, str(example["digest"])
    )

    chart_package = os.path.join(out, str(manifest["chart"]))
    run(helm, "push", chart_package, f"oci://{registry}/{CHARTS}", *registries.plain, what="helm push (the chart)")
    chart = f"{registry}/{CHARTS}/{IMAGE_NAME}"
    raw = run(
        "skopeo",
        "inspect",
        "--raw",
        *registries.tls,
        f"docker://{chart}:{version}",
        what="skopeo inspect (the pushed chart)",
    )
    layers = [str(layer.get("digest")) for layer in json.loads(raw).get("layers", [])]
    if layers != [f"sha256:{sha256(chart_package)}"]:
        raise PublishError(f"{chart}:{version} holds {layers}, not the release's chart package")
    chart_digest = "sha256:" + hashlib.sha256(raw.encode()).hexdigest()

    key = os.environ.get("COSIGN_KEY", "")
    signing = ["--key", key, "--tlog-upload=false", "--use-signing-config=false"] if key else []
    http = ["--allow-http-registry", "--allow-insecure-registry"] if insecure else []
    sboms = manifest["sboms"]
    assert isinstance(sboms, dict)
    for what, signed, sbom in (("the image", reference, "image"), ("the example", example_reference, "example")):
        run(cosign, "sign", "--yes", *signing, *http, signed, what=f"cosign sign ({what})")
        run(
            cosign,
            "attest",
            "--yes",
            *signing,
            *http,
            "--type",
            "cyclonedx",
            "--predicate",
            os.path.join(out, str(sboms[sbom])),
            signed,
            what=f"cosign attest ({what}'s SBOM)",
        )
    run(cosign, "sign", "--yes", *signing, *http, f"{chart}@{chart_digest}", what="cosign sign (the chart)")

    site = os.environ.get("SITE", "")
    if site:
        os.makedirs(site, exist_ok=True)
        # Dated now, not when built: web servers and apt's If-Modified-Since go by these dates.
        for name in ("apt", "yum"):
            shutil.rmtree(os.path.join(site, name), ignore_errors=True)
            # (A release of some targets only, `make release TARGETS=…`, may have no repository of a kind.)
            if os.path.isdir(os.path.join(out, name)):
                shutil.copytree(os.path.join(out, name), os.path.join(site, name), copy_function=shutil.copy)
        shutil.copy(os.path.join(out, "hyperlight-agent.asc"), site)
    print(
        f"published {version}: {reference}, {example_reference}, oci://{chart} --version {version} ({chart_digest})"
        + (f", repositories in {site}" if site else "")
    )


def command(name: str, action: Callable[[], None]) -> int:
    """Run `action` as the command `name`: its failure is one line, exit 2 for a setting, else 1."""
    try:
        action()
    except PublishError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    return 0


def main() -> int:
    return command("make publish", publish)


if __name__ == "__main__":
    sys.exit(main())
