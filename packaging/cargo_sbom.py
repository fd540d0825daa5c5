"""A CycloneDX SBOM of Rust crates from their Cargo.lock files: what `make release` says the
Hyperlight example's image is built from (its host program's lock and its guest's).

    build/release-tools/bin/python packaging/cargo_sbom.py NAME VERSION OUT LOCK...

Every crate a lock takes from a registry is a component (its package URL, and the SHA-256 of the
.crate file the lock pins, as cyclonedx-py gives a Python lock's); a crate in both locks at one
version is one component; the crates of the example itself (no source) are the SBOM's subject,
NAME at VERSION. The SBOM carries no serial number, and SOURCE_DATE_EPOCH as its time: a second
build of the same commit writes the same bytes. Runs in the release tools' venv, which has
cyclonedx-python-lib (pins/release.txt)."""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the release tools' lock has tomli for these
    import tomli as tomllib

from cyclonedx.model import ExternalReference, ExternalReferenceType, HashAlgorithm, HashType, XsUri
from cyclonedx.model.bom import Bom
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.output import make_outputter
from cyclonedx.schema import OutputFormat, SchemaVersion
from packageurl import PackageURL

CRATES_IO = "registry+https://github.com/rust-lang/crates.io-index"
# Where crates.io serves the .crate file a lock's checksum is the SHA-256 of.
DOWNLOAD = "https://crates.io/api/v1/crates/{name}/{version}/download"


class LockError(Exception):
    """One line naming the lock and what is wrong with it."""


class Lock:
    """A Cargo.lock's registry crates ((name, version) → the .crate's SHA-256), what each depends
    on, and what the workspace's own crates depend on."""

    def __init__(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                packages: list[dict[str, Any]] = tomllib.load(f).get("package", [])
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise LockError(f"{path}: {exc}") from exc
        versions: dict[str, list[str]] = {}
        for package in packages:
            versions.setdefault(str(package["name"]), []).append(str(package["version"]))
        self.crates: dict[tuple[str, str], str] = {}
        self.depends: dict[tuple[str, str], set[tuple[str, str]]] = {}
        self.direct: set[tuple[str, str]] = set()
        for package in packages:
            key = (str(package["name"]), str(package["version"]))
            # A dependency is "name" when the lock has one version of it, else "name version".
            wanted = set()
            for entry in package.get("dependencies", []):
                crate, _, at = str(entry).partition(" ")
                wanted.add((crate, at.split(" ")[0] if at else versions[crate][0]))
            source = package.get("source")
            if source is None:  # a crate of the workspace itself
                self.direct |= wanted
                continue
            if source != CRATES_IO or "checksum" not in package:
                raise LockError(f"{path}: {key[0]} {key[1]} is from {source}, not crates.io")
            self.crates[key] = str(package["checksum"])
            self.depends[key] = wanted


def bom(name: str, version: str, paths: list[str], epoch: int) -> str:
    locks = [Lock(path) for path in paths]
    document = Bom()
    document.serial_number = None  # type: ignore[assignment]  # random per run: none, for the same bytes
    document.metadata.timestamp = datetime.datetime.fromtimestamp(epoch, tz=datetime.timezone.utc)
    subject = Component(name=name, version=version, type=ComponentType.APPLICATION, bom_ref=f"{name}@{version}")
    document.metadata.component = subject
    components: dict[tuple[str, str], Component] = {}
    for key, checksum in sorted({k: v for lock in locks for k, v in lock.crates.items()}.items()):
        purl = PackageURL(type="cargo", name=key[0], version=key[1])
        components[key] = Component(
            name=key[0],
            version=key[1],
            purl=purl,
            bom_ref=purl.to_string(),
            external_references=[
                ExternalReference(
                    type=ExternalReferenceType.DISTRIBUTION,
                    url=XsUri(DOWNLOAD.format(name=key[0], version=key[1])),
                    hashes=[HashType(alg=HashAlgorithm.SHA_256, content=checksum)],
                )
            ],
        )
        document.components.add(components[key])
    for lock in locks:
        document.register_dependency(subject, [components[k] for k in sorted(lock.direct)])
        for key, wanted in lock.depends.items():
            document.register_dependency(components[key], [components[k] for k in sorted(wanted)])
    return str(make_outputter(document, OutputFormat.JSON, SchemaVersion.V1_6).output_as_string(indent=2))


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print("usage: cargo_sbom.py NAME VERSION OUT LOCK...", file=sys.stderr)
        return 2
    name, version, out, *locks = argv
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    if not epoch.isdigit():
        print(f"cargo_sbom.py: SOURCE_DATE_EPOCH {epoch!r}: not a time in seconds", file=sys.stderr)
        return 2
    try:
        text = bom(name, version, locks, int(epoch))
    except LockError as exc:
        print(f"cargo_sbom.py: {exc}", file=sys.stderr)
        return 1
    partial = out + ".partial"
    with open(partial, "w") as f:
        f.write(text + "\n")
    os.replace(partial, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
