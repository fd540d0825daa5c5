"""The CDI spec we own (`<cdi_dir>/hyperlight.json`): its exact bytes, and atomic repair.

We own that one file and nothing else in the directory. Repair writes a temp file whose name
CDI runtimes ignore (they read only *.json and *.yaml), fsyncs it, renames it over the target
and fsyncs the directory, so a reader sees the complete old file or the complete new one.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from . import atomic, contracts

SPEC_MODE = 0o644  # runtimes (often not root) must read it
DEVICE_FILE_MODE = 0o660  # the node in containers: owner and group only (podman's default is 0666)


class CdiError(Exception):
    """The spec could not be verified or repaired; the message names the path and the cause."""


def render(hypervisor: str, device_path: str, uid: int, gid: int) -> bytes:
    """The canonical spec bytes; "exact" means byte-equal to this.

    >>> b'"name": "kvm"' in render("kvm", "/dev/kvm", 65534, 65534)
    True
    """
    spec = {
        "cdiVersion": contracts.CDI_VERSION,
        "kind": contracts.CDI_KIND,
        "devices": [
            {
                "name": hypervisor,
                "containerEdits": {
                    "env": [
                        f"{contracts.ENV_HYPERVISOR}={hypervisor}",
                        f"{contracts.ENV_DEVICE_PATH}={device_path}",
                    ],
                    "deviceNodes": [
                        {
                            "path": device_path,
                            "type": "c",
                            "permissions": "rw",
                            "fileMode": DEVICE_FILE_MODE,
                            "uid": uid,
                            "gid": gid,
                        }
                    ],
                },
            }
        ],
    }
    return (json.dumps(spec, indent=2) + "\n").encode()


def device_name(hypervisor: str) -> str:
    """The fully qualified CDI device name Allocate returns: hyperlight.dev/hypervisor=kvm."""
    return f"{contracts.CDI_KIND}={hypervisor}"


def spec_path(cdi_dir: str) -> str:
    return os.path.join(cdi_dir, contracts.CDI_SPEC_FILE)


def inspect(cdi_dir: str, wanted: bytes) -> Optional[str]:
    """What is wrong with the spec, without changing anything; None when it is exact."""
    path = spec_path(cdi_dir)
    try:
        current = _read_owned(path, wanted)
    except CdiError as exc:
        return str(exc)
    if current is None:
        return f"{path} is missing"
    if current != wanted:
        return f"{path} differs from the expected spec"
    return None


def reconcile(cdi_dir: str, wanted: bytes) -> bool:
    """Make the spec exactly `wanted`. True if it had to be written. Raises CdiError."""
    path = spec_path(cdi_dir)
    atomic.remove_temps(cdi_dir, contracts.CDI_TEMP_PREFIX, contracts.CDI_TEMP_SUFFIX)
    if _read_owned(path, wanted) == wanted:
        return False
    try:
        os.makedirs(cdi_dir, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise CdiError(f"{cdi_dir}: cannot create CDI directory: {exc.strerror or exc}") from exc
    try:
        atomic.write(cdi_dir, contracts.CDI_SPEC_FILE, wanted, contracts.CDI_TEMP_PREFIX,
                     contracts.CDI_TEMP_SUFFIX, SPEC_MODE)
    except OSError as exc:
        raise CdiError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    return True


def _read_owned(path: str, wanted: bytes) -> Optional[bytes]:
    """The spec's bytes (at most one more than `wanted`: a longer file differs anyway), or None."""
    try:
        return atomic.read_regular(path, len(wanted) + 1)
    except atomic.Refused as exc:
        raise CdiError(str(exc)) from exc
    except OSError as exc:
        raise CdiError(f"{path}: cannot read: {exc.strerror or exc}") from exc
