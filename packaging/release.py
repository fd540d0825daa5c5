"""`make release`: one complete, signed release in DIST/VERSION/, everything a release publishes.

    python packaging/release.py        (the Makefile passes its settings in the environment)

What it holds (names for version 0.1.0), a package per row of packaging/targets:
    hyperlight-agent_0.1.0+deb12_amd64.deb              Debian 12 (Python 3.11); +deb13, +ubuntu22.04, +ubuntu24.04
    hyperlight-agent-0.1.0-1.el9.x86_64.rpm             EL9 (Python 3.9), signed with rpmsign; .el10, .azl3
    apt/                                                signed apt repository (reprepro), one pool, a suite per
                                                        Debian/Ubuntu target: dists/<codename>/InRelease
    yum/<tag>/x86_64/                                   a signed yum repository per RPM target (createrepo_c):
                                                        repodata/repomd.xml.asc
    hyperlight-agent-0.1.0.oci.tar                      the image, an OCI archive
    hyperlight-example-0.1.0.oci.tar                    the Hyperlight example (deploy/examples/hyperlight) as an
                                                        image, an OCI archive: what `helm test` runs by default
    hyperlight-agent-0.1.0.tgz                          the Helm chart; its default image is the archive's, and
                                                        its tests.workloadImage the example's, by digest
    <artefact>.cdx.json                                 a CycloneDX SBOM per artefact: exactly its lock in pins/
                                                        (the example's: its two Cargo.lock files)
    hyperlight-agent.asc                                the public key of every signature above
    release.json                                        what publish needs: version, commit, image digest, files
    SHA256SUMS, SHA256SUMS.asc                          every file's hash, signed

Settings (environment): VERSION, DIST (default dist), GIT_COMMIT, SOURCE_DATE_EPOCH, ENGINE and
BASE_IMAGE (as for `make image`), IMAGE_PYTHON (the image's Python: which lock its SBOM lists),
TARGETS (tags of packaging/targets, space-separated: a release of those only; unset: every row),
IMAGE_REPOSITORY (default ghcr.io/hyperlight-dev/hyperlight-agent), GNUPGHOME and RELEASE_GPG_KEY
(the signing key; without one, a key made for this build only, said loudly: such a release is for
testing, never for publishing), HELM, CYCLONEDX (tool paths).
Any failure is one line naming what failed; a release half-built is removed.

Why: docs/decisions/releases.md.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from typing import Optional

from targets import BY_TAG, TARGETS, Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_REPOSITORY = "ghcr.io/hyperlight-dev/hyperlight-agent"
CHART = os.path.join(ROOT, "deploy", "helm", "hyperlight-agent")
# The Hyperlight example: built by its build.sh from its locks, into an image beside the agent's.
EXAMPLE = os.path.join(ROOT, "deploy", "examples", "hyperlight")
EXAMPLE_NAME = "hyperlight-example"
EXAMPLE_LOCKS = ("deploy/examples/hyperlight/host/Cargo.lock", "deploy/examples/hyperlight/guest/Cargo.lock")
RELEASE_TOOLS = os.path.join(ROOT, "build", "release-tools", "bin")
# The placeholder the development manifests (the kustomize base) carry; never in a release.
PLACEHOLDER = "sha256:" + "0" * 64
APT_COMPONENT = "main"
# How long apt trusts the repository's signed Release (its Valid-Until): a mirror or proxy frozen
# at an old release is refused after this. The release workflow's `resign` job re-dates and
# re-signs the published Release weekly (`make resign`), well within it.
APT_VALID_DAYS = 30
PUBLIC_KEY = "hyperlight-agent.asc"
SUMS = "SHA256SUMS"
VERSION_RE = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+")


class ReleaseError(Exception):
    """One line saying what failed."""


def run(*argv: str, cwd: Optional[str] = None, env: Optional[dict[str, str]] = None, what: Optional[str] = None) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [""]
        raise ReleaseError(f"{what or argv[0]}: exit {done.returncode}: {tail[0]}")
    return done.stdout


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_version() -> str:
    with open(os.path.join(ROOT, "hyperlight_agent", "__init__.py")) as f:
        match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    assert match
    return match.group(1)


def tags_at_head() -> list[str]:
    return subprocess.run(
        ["git", "tag", "--points-at", "HEAD", "--list", "v[0-9]*"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()


def check_version(version: str, tags: list[str]) -> None:
    """X.Y.Z, and a commit tagged vA.B.C (tags: its release tags) is released as A.B.C only."""
    if not VERSION_RE.fullmatch(version):
        raise ReleaseError(f"VERSION {version!r}: not MAJOR.MINOR.PATCH")
    if tags and f"v{version}" not in tags:
        raise ReleaseError(f"VERSION {version}: this commit is tagged {', '.join(tags)}; release it as that")


class Signer:
    """The OpenPGP key that signs the repositories, the RPMs and SHA256SUMS."""

    def __init__(self, work: str) -> None:
        self.env = dict(os.environ)
        self.key = os.environ.get("RELEASE_GPG_KEY", "")
        if not self.key:
            # No key given: one made for this build, so that `make release` works anywhere; its
            # signatures prove nothing to anyone else, and release.json says so.
            home = os.path.join(work, "gnupg")
            os.makedirs(home, mode=0o700)
            self.env["GNUPGHOME"] = home
            run(
                "gpg",
                "--batch",
                "--passphrase",
                "",
                "--quick-gen-key",
                "hyperlight-agent release (made for one build, not for publishing)",
                "rsa3072",
                "sign",
                "never",
                env=self.env,
                what="gpg --quick-gen-key",
            )
            self.key = (
                run("gpg", "--batch", "--list-secret-keys", "--with-colons", env=self.env)
                .split("fpr:::::::::", 1)[1]
                .split(":", 1)[0]
            )
            print(
                "make release: WARNING: no RELEASE_GPG_KEY: signed with a key made for this build only "
                "(for testing; never publish it)",
                file=sys.stderr,
            )
            self.ephemeral = True
        else:
            self.ephemeral = False
        self.fingerprint = run(
            "gpg",
            "--batch",
            "--with-colons",
            "--list-secret-keys",
            self.key,
            env=self.env,
            what=f"gpg: secret key {self.key}",
        ).split("fpr:::::::::", 1)[1][:40]

    def gpg(self, *args: str) -> str:
        return run(
            "gpg",
            "--batch",
            "--yes",
            "--pinentry-mode",
            "loopback",
            "--passphrase",
            "",
            "--local-user",
            self.fingerprint,
            *args,
            env=self.env,
            what=f"gpg {args[0]}",
        )

    def detach(self, path: str) -> str:
        self.gpg("--armor", "--detach-sign", "--output", path + ".asc", path)
        return path + ".asc"

    def export(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(run("gpg", "--batch", "--armor", "--export", self.fingerprint, env=self.env))

    def sign_rpm(self, path: str) -> None:
        # Debian's rpm names gpg2, which Debian no longer ships under that name.
        run(
            "rpmsign",
            "--addsign",
            "--define",
            f"__gpg {shutil.which('gpg') or 'gpg'}",
            "--define",
            f"_gpg_name {self.fingerprint}",
            "--define",
            f"_gpg_path {self.env.get('GNUPGHOME', os.path.expanduser('~/.gnupg'))}",
            "--define",
            "_gpg_sign_cmd_extra_args --pinentry-mode loopback --passphrase ''",
            path,
            env=self.env,
            what=f"rpmsign {os.path.basename(path)}",
        )


def make(*args: str, jobs: int = 1) -> None:
    targets = " ".join(a for a in args if "=" not in a)
    run("make", "-s", "-C", ROOT, f"-j{jobs}", "-O", *args, what=f"make {targets}")


def build_packages(version: str, out: str, signer: Signer, targets: tuple[Target, ...]) -> dict[str, str]:
    """Every target's package (tag → path), copied out of build/ at once (the next build replaces
    them); the RPMs signed."""
    tags = f"TARGETS={' '.join(t.tag for t in targets)}"
    formats = [fmt for fmt in ("deb", "rpm") if any(t.format == fmt for t in targets)]
    # Every row's package at once, as many at a time as there are CPUs: most of a release's time.
    make(*formats, f"VERSION={version}", tags, jobs=os.cpu_count() or 1)
    found = {}
    for target in targets:
        built = "deb" if target.format == "deb" else os.path.join("rpm", "top", "RPMS", "x86_64")
        path = os.path.join(ROOT, "build", built, target.package(version))
        if not os.path.exists(path):
            raise ReleaseError(f"make {target.format} built no {target.package(version)}")
        found[target.tag] = shutil.copy2(path, out)
        if target.format == "rpm":
            signer.sign_rpm(found[target.tag])
    return found


def apt_repository(
    out: str, packages: dict[str, str], signer: Signer, work: str, targets: tuple[Target, ...]
) -> list[str]:
    """reprepro's pool (one, every suite's packages) and dists (a suite per Debian and Ubuntu
    target, named by its codename), each Release signed: InRelease and Release.gpg. The suites."""
    base = os.path.join(work, "reprepro")
    os.makedirs(os.path.join(base, "conf"))
    debs = [t for t in targets if t.format == "deb"]
    with open(os.path.join(base, "conf", "distributions"), "w") as f:
        f.write(
            "\n".join(
                f"Origin: hyperlight-agent\nLabel: hyperlight-agent\nCodename: {t.suite}\n"
                f"Architectures: amd64\nComponents: {APT_COMPONENT}\n"
                f"Description: hyperlight-agent for {t.label}\nSignWith: {signer.fingerprint}\n"
                f"ValidFor: {APT_VALID_DAYS}d\n"
                for t in debs
            )
        )
    for target in debs:
        run(
            "reprepro",
            "--basedir",
            base,
            "--outdir",
            os.path.join(out, "apt"),
            "includedeb",
            target.suite,
            packages[target.tag],
            env=signer.env,
            what=f"reprepro includedeb {target.suite}",
        )
    return [t.suite for t in debs]


def yum_repositories(
    out: str, packages: dict[str, str], signer: Signer, epoch: str, targets: tuple[Target, ...]
) -> list[str]:
    """One repository per RPM target (createrepo_c), repomd.xml signed (repo_gpgcheck); their
    directories under yum/."""
    rpms = [t for t in targets if t.format == "rpm"]
    for target in rpms:
        repo = os.path.join(out, "yum", target.suite, "x86_64")
        os.makedirs(os.path.join(repo, "Packages"))
        shutil.copy2(packages[target.tag], os.path.join(repo, "Packages"))
        run(
            "createrepo_c",
            "--quiet",
            "--revision",
            epoch,
            "--set-timestamp-to-revision",
            repo,
            what=f"createrepo_c {target.suite}",
        )
        signer.detach(os.path.join(repo, "repodata", "repomd.xml"))
    return [t.suite for t in rpms]


def engine() -> list[str]:
    return (os.environ.get("ENGINE") or "podman").split()


def image_archive(version: str, out: str, repository: str) -> tuple[str, str]:
    """`make image` as this version, saved as an OCI archive; (path, manifest digest)."""
    image = f"{repository}:{version}"
    make(
        "image",
        f"VERSION={version}",
        f"IMAGE={image}",
        f"ENGINE={' '.join(engine())}",
        f"BASE_IMAGE={os.environ.get('BASE_IMAGE', '')}",
    )
    return saved(image, os.path.join(out, f"hyperlight-agent-{version}.oci.tar"))


def example_repository(repository: str) -> str:
    """The example's image beside the agent's (…/hyperlight-agent → …/hyperlight-example)."""
    return f"{repository.rsplit('/', 1)[0]}/{EXAMPLE_NAME}" if "/" in repository else EXAMPLE_NAME


def example_archive(version: str, out: str, repository: str, epoch: str, work: str) -> tuple[str, str]:
    """The Hyperlight example built from its locks (its build.sh) into an image as its
    Containerfile says, saved as an OCI archive; (path, manifest digest). Its times are
    SOURCE_DATE_EPOCH's: a second build of the commit has the same digest."""
    built = os.path.join(work, "example")
    run(os.path.join(EXAMPLE, "build.sh"), built, what="the Hyperlight example's build.sh")
    image = f"{repository}:{version}"
    run(
        *engine(),
        "build",
        "--quiet",
        f"--timestamp={epoch}",
        "-f",
        os.path.join(EXAMPLE, "Containerfile"),
        "-t",
        image,
        built,
        what="building the Hyperlight example's image",
    )
    return saved(image, os.path.join(out, f"{EXAMPLE_NAME}-{version}.oci.tar"))


def saved(image: str, path: str) -> tuple[str, str]:
    """The image saved as an OCI archive at `path`; (path, its manifest's digest)."""
    run(*engine(), "save", "--quiet", "--format", "oci-archive", "-o", path, image, what=f"saving {image}")
    with tarfile.open(path) as archive:
        member = archive.extractfile("index.json")
        assert member is not None
        (manifest,) = json.load(member)["manifests"]
    return path, str(manifest["digest"])


def chart_package(version: str, out: str, repository: str, digest: str, workload: str, work: str) -> str:
    """The chart as this version, whose default image is this release's, by digest, and whose
    `helm test` runs `workload` (the example's image, by digest)."""
    chart = os.path.join(work, "chart", "hyperlight-agent")
    shutil.copytree(CHART, chart)
    for name, edits in (
        ("Chart.yaml", [(r"^version: .*$", f"version: {version}"), (r"^appVersion: .*$", f'appVersion: "{version}"')]),
        (
            "values.yaml",
            [
                (r"^  repository: .*$", f"  repository: {repository}"),
                # The chart's own image: what runs unless a user sets image.digest or image.tag.
                (r"^  releaseDigest: .*$", f'  releaseDigest: "{digest}"'),
                (r"^  digest: .*$", '  digest: ""'),
                (r"^  tag: .*$", '  tag: ""'),
                (r"^  workloadImage: .*$", f'  workloadImage: "{workload}"'),
            ],
        ),
    ):
        path = os.path.join(chart, name)
        with open(path) as f:
            text = f.read()
        for pattern, replacement in edits:
            text, n = re.subn(pattern, replacement, text, count=1, flags=re.M)
            if n != 1:
                raise ReleaseError(f"{name}: no line matching {pattern!r} to set")
        with open(path, "w") as f:
            f.write(text)
    helm = os.environ.get("HELM") or os.path.join(ROOT, "build", "tools", "helm")
    run(helm, "lint", "--strict", chart, what="helm lint --strict")
    run(helm, "package", chart, "--destination", out, what="helm package")
    return os.path.join(out, f"hyperlight-agent-{version}.tgz")


def sbom(version: str, lock: str, path: str, epoch: str, work: str) -> None:
    """CycloneDX from the lock itself: the SBOM lists exactly what the lock installs."""
    project = os.path.join(work, f"pyproject-{os.path.basename(path)}.toml")
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read().replace('dynamic = ["version"]', f'version = "{version}"', 1)
    with open(project, "w") as f:
        f.write(text)
    tool = os.environ.get("CYCLONEDX") or os.path.join(RELEASE_TOOLS, "cyclonedx-py")
    run(
        tool,
        "requirements",
        "--output-reproducible",
        "--of",
        "JSON",
        "--pyproject",
        project,
        "-o",
        path,
        os.path.join(ROOT, "pins", f"runtime-py{lock}.txt"),
        env={**os.environ, "SOURCE_DATE_EPOCH": epoch},
        what=f"cyclonedx-py for {os.path.basename(path)}",
    )


def example_sbom(version: str, path: str, epoch: str) -> None:
    """CycloneDX from the example's Cargo.lock files (packaging/cargo_sbom.py, in the release
    tools' venv: cyclonedx-python-lib)."""
    run(
        os.path.join(RELEASE_TOOLS, "python"),
        os.path.join(ROOT, "packaging", "cargo_sbom.py"),
        EXAMPLE_NAME,
        version,
        path,
        *(os.path.join(ROOT, lock) for lock in EXAMPLE_LOCKS),
        env={**os.environ, "SOURCE_DATE_EPOCH": epoch},
        what=f"cargo_sbom.py for {os.path.basename(path)}",
    )


def placeholders(out: str) -> list[str]:
    """Files holding the development placeholder digest, the chart package's contents included."""
    found = []
    for directory, _, names in os.walk(out):
        for name in names:
            path = os.path.join(directory, name)
            if path.endswith(".tgz"):
                with tarfile.open(path) as chart:
                    for member in chart.getmembers():
                        f = chart.extractfile(member)
                        if f is not None and PLACEHOLDER.encode() in f.read():
                            found.append(f"{path}:{member.name}")
            elif not path.endswith(".tar"):  # the image holds no chart or manifest
                with open(path, "rb") as f:
                    if PLACEHOLDER.encode() in f.read():
                        found.append(path)
    return found


def refuse_placeholders(out: str) -> None:
    found = placeholders(out)
    if found:
        raise ReleaseError(f"the placeholder digest is in {found[0]}")


def checksums(out: str) -> str:
    """SHA256SUMS of every file (sha256sum -c format, paths relative to the release)."""
    lines = []
    for directory, _, names in sorted(os.walk(out)):
        for name in sorted(names):
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, out)
            if rel not in (SUMS, SUMS + ".asc"):
                lines.append(f"{sha256(path)}  {rel}\n")
    path = os.path.join(out, SUMS)
    with open(path, "w") as f:
        f.writelines(lines)
    return path


def release() -> str:
    version = os.environ.get("VERSION") or tree_version()
    check_version(version, tags_at_head())
    targets = chosen_targets(os.environ.get("TARGETS", ""))
    repository = os.environ.get("IMAGE_REPOSITORY") or IMAGE_REPOSITORY
    epoch = os.environ.get("SOURCE_DATE_EPOCH") or run("git", "log", "-1", "--format=%ct", cwd=ROOT).strip()
    dist = os.path.abspath(os.environ.get("DIST") or os.path.join(ROOT, "dist"))
    out = os.path.join(dist, version)
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    work = tempfile.mkdtemp(prefix="hl-release-")
    try:
        signer = Signer(work)
        packages = build_packages(version, partial, signer, targets)
        suites = apt_repository(partial, packages, signer, work, targets)
        yums = yum_repositories(partial, packages, signer, epoch, targets)
        archive, digest = image_archive(version, partial, repository)
        examples = example_repository(repository)
        example, example_digest = example_archive(version, partial, examples, epoch, work)
        chart = chart_package(version, partial, repository, digest, f"{examples}@{example_digest}", work)
        artefacts = {**packages, "image": archive}
        # Which lock each artefact's Python dependencies come from (its target's Python).
        locks = {**{t.tag: t.python for t in targets}, "image": image_python()}
        sboms = {kind: path + ".cdx.json" for kind, path in artefacts.items()}
        # One cyclonedx-py process per artefact, side by side (each seconds of start-up alone).
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            for done in [pool.submit(sbom, version, locks[k], sboms[k], epoch, work) for k in artefacts]:
                done.result()
        sboms["example"] = example + ".cdx.json"
        example_sbom(version, sboms["example"], epoch)
        signer.export(os.path.join(partial, PUBLIC_KEY))
        manifest = {
            "version": version,
            "commit": os.environ.get("GIT_COMMIT", "unknown"),
            "source_date_epoch": int(epoch),
            "image": {"repository": repository, "digest": digest, "archive": os.path.basename(archive)},
            "example": {"repository": examples, "digest": example_digest, "archive": os.path.basename(example)},
            "chart": os.path.basename(chart),
            "packages": {kind: os.path.basename(path) for kind, path in packages.items()},
            "sboms": {kind: os.path.basename(path) for kind, path in sboms.items()},
            "locks": {kind: f"pins/runtime-py{locks[kind]}.txt" for kind in artefacts},
            "example_locks": list(EXAMPLE_LOCKS),
            "repositories": {"apt": suites, "yum": yums},
            "signing_key": signer.fingerprint,
            "signing_key_ephemeral": signer.ephemeral,
        }
        with open(os.path.join(partial, "release.json"), "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
        refuse_placeholders(partial)
        signer.detach(checksums(partial))
        shutil.rmtree(out, ignore_errors=True)
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        # The agent gpg started for a key made here ends with the build.
        subprocess.run(
            ["gpgconf", "--homedir", os.path.join(work, "gnupg"), "--kill", "gpg-agent"],
            check=False,
            capture_output=True,
        )
        shutil.rmtree(work, ignore_errors=True)
    return out


def chosen_targets(tags: str) -> tuple[Target, ...]:
    """The rows TARGETS names (space-separated tags), in the table's order; none named: all."""
    unknown = [tag for tag in tags.split() if tag not in BY_TAG]
    if unknown:
        raise ReleaseError(f"TARGETS {tags!r}: no row {unknown[0]!r} in packaging/targets")
    return tuple(t for t in TARGETS if t.tag in tags.split()) if tags.split() else TARGETS


def image_python() -> str:
    """The image's Python (the Makefile's IMAGE_PYTHON, X.Y): which lock the image installs."""
    python = os.environ.get("IMAGE_PYTHON", "")
    if not re.fullmatch(r"3\.[0-9]+", python):
        raise ReleaseError(f"IMAGE_PYTHON {python!r}: not the image's Python as X.Y (make release sets it)")
    return python


def listing(out: str) -> str:
    rows = []
    for directory, _, names in sorted(os.walk(out)):
        for name in sorted(names):
            path = os.path.join(directory, name)
            rows.append(f"{os.path.getsize(path):>12}  {os.path.relpath(path, out)}")
    return "\n".join(rows)


def main() -> int:
    try:
        out = release()
    except ReleaseError as exc:
        print(f"make release: {exc}", file=sys.stderr)
        return 1
    with open(os.path.join(out, "release.json")) as f:
        manifest = json.load(f)
    print(f"release {manifest['version']} in {out}:")
    print(listing(out))
    print(f"apt suites: {' '.join(manifest['repositories']['apt'])} (apt/dists/<suite>/InRelease)")
    print(f"yum repositories: {' '.join(manifest['repositories']['yum'])} (yum/<name>/x86_64/repodata/repomd.xml.asc)")
    print(f"image: {manifest['image']['repository']}@{manifest['image']['digest']}")
    print(f"example image (helm test's): {manifest['example']['repository']}@{manifest['example']['digest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
