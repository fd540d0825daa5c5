"""Small OCI images for the e2e nodes, made without a registry or a container engine: the pod
sandbox (a static pause binary) and the workload (busybox for the example's `sh` probes, kvmcheck,
which opens /dev/kvm and creates a VM, and the Hyperlight example's host program and guest).
Written as an OCI image layout in a tar archive that `ctr images import` names from its
io.containerd.image.name annotation."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
BUSYBOX = "/bin/busybox"  # Debian's busybox-static


def compile_static(source: str, output: str) -> str:
    subprocess.run(
        ["gcc", "-static", "-O2", "-o", output, os.path.join(DATA, source)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return output


def _blob(layout: tarfile.TarFile, data: bytes) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    layout.addfile(info, io.BytesIO(data))
    return {"digest": f"sha256:{digest}", "size": len(data)}


def write_image(
    archive: str,
    name: str,
    files: dict[str, str],
    links: dict[str, str],
    entrypoint: list[str],
) -> str:
    """An image whose one layer holds `files` (path in image → host file, mode kept) and
    `links` (path → symlink target)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as layer:
        for directory in sorted({os.path.dirname(p).lstrip("/") for p in (*files, *links)} - {""}):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            layer.addfile(info)
        for path, source in sorted(files.items()):
            layer.add(source, arcname=path.lstrip("/"), recursive=False)
        for path, target in sorted(links.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.type, info.linkname = tarfile.SYMTYPE, target
            layer.addfile(info)
    diff_id = "sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()
    compressed = gzip.compress(raw.getvalue(), mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"]},
    }
    with tarfile.open(archive, "w") as layout:
        layer_desc = _blob(layout, compressed)
        config_desc = _blob(layout, json.dumps(config).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer_desc}],
        }
        manifest_desc = _blob(layout, json.dumps(manifest).encode())
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    **manifest_desc,
                    "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name},
                }
            ],
        }
        for member, content in (("oci-layout", {"imageLayoutVersion": "1.0.0"}), ("index.json", index)):
            data = json.dumps(content).encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            layout.addfile(info, io.BytesIO(data))
    return archive


def pause_image(directory: str, name: str) -> str:
    binary = compile_static("pause.c", os.path.join(directory, "pause"))
    return write_image(os.path.join(directory, "pause.tar"), name, {"/pause": binary}, {}, ["/pause"])


def workload_image(directory: str, name: str, extra: dict[str, str]) -> str:
    """`extra`: more files (path in image → host file), e.g. the Hyperlight example's."""
    binary = compile_static("kvmcheck.c", os.path.join(directory, "kvmcheck"))
    links = {f"/bin/{tool}": "busybox" for tool in ("sh", "test", "sleep", "cat", "env", "ls", "stat")}
    return write_image(
        os.path.join(directory, "workload.tar"),
        name,
        {"/bin/busybox": BUSYBOX, "/kvmcheck": binary, **extra},
        links,
        ["/bin/sh"],
    )
