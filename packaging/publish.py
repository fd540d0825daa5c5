"""`make publish`: put a release built by `make release` where users install it from.

    python packaging/publish.py        (the Makefile passes its settings in the environment)

1. The release is checked first: SHA256SUMS matches every file and its signature is good.
2. The image archive is pushed unchanged (skopeo, --preserve-digests) to REGISTRY/hyperlight-agent
   as VERSION, and the registry must then serve the digest the chart names.
3. The chart is pushed to oci://REGISTRY/charts (helm push): `helm install oci://REGISTRY/charts/
   hyperlight-agent --version VERSION`.
4. The image is signed with cosign and its SBOM attached as a CycloneDX attestation, both by
   digest. COSIGN_KEY (a cosign key file; COSIGN_PASSWORD its password): signed with that key and
   no transparency log (the tests: a key pair per run, no Sigstore reachable). Unset: keyless, the
   release pipeline's way — cosign takes the CI's OIDC identity (GitHub Actions' `id-token: write`),
   Fulcio certifies it and Rekor logs the signature; verify with --certificate-identity.
5. SITE, when set: the signed apt and yum repositories and the public key, copied there for a
   static web host (`deb [signed-by=…] SITE_URL/apt bookworm main`, `baseurl=SITE_URL/yum/el9/$basearch`).

Settings (environment): VERSION, DIST, REGISTRY (required, e.g. ghcr.io/hyperlight-dev),
INSECURE_REGISTRY=1 (plain HTTP: a registry on this machine), COSIGN_KEY, SITE, HELM, COSIGN.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "build", "tools")
IMAGE_NAME = "hyperlight-agent"
CHARTS = "charts"


class PublishError(Exception):
    """One line saying what failed."""


def run(*argv: str, what: Optional[str] = None, env: Optional[dict[str, str]] = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [""]
        raise PublishError(f"{what or argv[0]}: exit {done.returncode}: {tail[0]}")
    return done.stdout


def verify_release(out: str) -> dict[str, object]:
    """SHA256SUMS holds every file with its hash, signed by the key the release carries."""
    sums = os.path.join(out, "SHA256SUMS")
    if not os.path.exists(sums):
        raise PublishError(f"{out}: no release here (make release VERSION=...)")
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "GNUPGHOME": home}
        run(
            "gpg",
            "--batch",
            "--quiet",
            "--import",
            os.path.join(out, "hyperlight-agent.asc"),
            env=env,
            what="gpg --import",
        )
        run("gpg", "--batch", "--verify", sums + ".asc", sums, env=env, what="SHA256SUMS signature")
    listed = set()
    with open(sums) as f:
        for line in f:
            digest, name = line.rstrip("\n").split("  ", 1)
            listed.add(name)
            h = hashlib.sha256()
            with open(os.path.join(out, name), "rb") as g:
                for block in iter(lambda: g.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() != digest:
                raise PublishError(f"{name}: its SHA-256 is not the one SHA256SUMS lists")
    present = {os.path.relpath(os.path.join(d, n), out) for d, _, ns in os.walk(out) for n in ns}
    unlisted = sorted(present - listed - {"SHA256SUMS", "SHA256SUMS.asc"})
    if unlisted:
        raise PublishError(f"{unlisted[0]}: in the release but not in SHA256SUMS")
    with open(os.path.join(out, "release.json")) as f:
        manifest: dict[str, object] = json.load(f)
    return manifest


def publish() -> None:
    version = os.environ.get("VERSION", "")
    out = os.path.join(os.path.abspath(os.environ.get("DIST") or os.path.join(ROOT, "dist")), version)
    registry = os.environ.get("REGISTRY", "").rstrip("/")
    if not registry:
        raise PublishError("REGISTRY is not set (e.g. make publish REGISTRY=ghcr.io/hyperlight-dev)")
    insecure = os.environ.get("INSECURE_REGISTRY", "") not in ("", "0")
    helm = os.environ.get("HELM") or os.path.join(TOOLS, "helm")
    cosign = os.environ.get("COSIGN") or os.path.join(TOOLS, "cosign")
    manifest = verify_release(out)
    image = manifest["image"]
    assert isinstance(image, dict)
    digest = str(image["digest"])
    repository = f"{registry}/{IMAGE_NAME}"
    if repository != image["repository"]:
        print(
            f"make publish: the chart names {image['repository']}; {repository} serves only as its mirror",
            file=sys.stderr,
        )

    # The archive as it is: its manifest (and so its digest) unchanged.
    tls = ["--dest-tls-verify=false"] if insecure else []
    archive = os.path.join(out, str(image["archive"]))
    run(
        "skopeo",
        "copy",
        "--quiet",
        "--preserve-digests",
        *tls,
        f"oci-archive:{archive}",
        f"docker://{repository}:{version}",
        what="skopeo copy (the image)",
    )
    served = run(
        "skopeo",
        "inspect",
        "--format",
        "{{.Digest}}",
        *(["--tls-verify=false"] if insecure else []),
        f"docker://{repository}:{version}",
        what="skopeo inspect (the pushed image)",
    ).strip()
    if served != digest:
        raise PublishError(f"{repository}:{version} is {served}, not the chart's {digest}")

    plain = ["--plain-http"] if insecure else []
    run(
        helm,
        "push",
        os.path.join(out, str(manifest["chart"])),
        f"oci://{registry}/{CHARTS}",
        *plain,
        what="helm push (the chart)",
    )

    key = os.environ.get("COSIGN_KEY", "")
    signing = ["--key", key, "--tlog-upload=false", "--use-signing-config=false"] if key else []
    http = ["--allow-http-registry", "--allow-insecure-registry"] if insecure else []
    reference = f"{repository}@{digest}"
    run(cosign, "sign", "--yes", *signing, *http, reference, what="cosign sign")
    sboms = manifest["sboms"]
    assert isinstance(sboms, dict)
    run(
        cosign,
        "attest",
        "--yes",
        *signing,
        *http,
        "--type",
        "cyclonedx",
        "--predicate",
        os.path.join(out, str(sboms["image"])),
        reference,
        what="cosign attest (the SBOM)",
    )

    site = os.environ.get("SITE", "")
    if site:
        os.makedirs(site, exist_ok=True)
        # Dated now, not when built: web servers and apt's If-Modified-Since go by these dates.
        for name in ("apt", "yum"):
            shutil.rmtree(os.path.join(site, name), ignore_errors=True)
            shutil.copytree(os.path.join(out, name), os.path.join(site, name), copy_function=shutil.copy)
        shutil.copy(os.path.join(out, "hyperlight-agent.asc"), site)
    print(
        f"published {version}: {reference}, oci://{registry}/{CHARTS}/hyperlight-agent --version {version}"
        + (f", repositories in {site}" if site else "")
    )


def main() -> int:
    try:
        publish()
    except PublishError as exc:
        print(f"make publish: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
