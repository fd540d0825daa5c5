"""The CDI spec we own (`<cdi_dir>/hyperlight.json`): its exact bytes, and atomic repair.

We own that one file and nothing else in the directory. Repair writes a temp file whose name
CDI runtimes ignore (they read only *.json and *.yaml), fsyncs it, renames it over the target
and fsyncs the directory, so a reader sees the complete old file or the complete new one.

Why: docs/decisions/cdi-exact-bytes.md.
"""

from __future__ import annotations

import errno as errnos
import json
import logging
import os
import stat
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from hyperlight_agent import contracts
from hyperlight_agent.files import atomic
from hyperlight_agent.files.watcher import CONTENT, NAMES, DirectoryWatcher
from hyperlight_agent.text import cause

log = logging.getLogger(__name__)

# Larger than any spec we write; a bigger file at our path is not ours to learn names from.
MAX_SPEC_BYTES = 64 * 1024
SPEC_MODE = 0o644  # runtimes (often not root) must read it
DEVICE_FILE_MODE = 0o660  # the node in containers: owner and group only (podman's default is 0666)


# The agent is out of descriptors or memory: says nothing about the spec or the directory.
EXHAUSTED = (errnos.EMFILE, errnos.ENFILE, errnos.ENOMEM)


class CdiError(Exception):
    """The spec could not be verified or repaired; the message names the path and the cause.

    `errno` is set when a system call failed (ENOSPC, EROFS, EIO, ...): such a cause can go away
    without any event in the directory, so it is worth retrying. A refusal (something that is not
    our file at our path) has none: its removal raises an event.
    """

    def __init__(self, message: str, errno: Optional[int] = None) -> None:
        super().__init__(message)
        self.errno = errno

    @property
    def exhausted(self) -> bool:
        return self.errno in EXHAUSTED


def render(hypervisor: str, device_path: str, uid: int, gid: int, kept: Sequence[tuple[str, str]] = ()) -> bytes:
    """The canonical spec bytes; "exact" means byte-equal to this (and SPEC_MODE, owned by us).

    `kept` are (name, device path) of devices an earlier spec listed: a name handed out in an
    Allocate is replayed by the kubelet when a container restarts, so it must keep resolving
    even after the node's hypervisor changed.

    >>> b'"name": "kvm"' in render("kvm", "/dev/kvm", 65534, 65534)
    True
    """
    devices = sorted({(hypervisor, device_path), *kept})
    spec = {
        "cdiVersion": contracts.CDI_VERSION,
        "kind": contracts.CDI_KIND,
        "devices": [
            {
                "name": name,
                "containerEdits": {
                    "env": [
                        f"{contracts.ENV_HYPERVISOR}={name}",
                        f"{contracts.ENV_DEVICE_PATH}={path}",
                    ],
                    "deviceNodes": [
                        {
                            "path": path,
                            "type": "c",
                            "permissions": "rw",
                            "fileMode": DEVICE_FILE_MODE,
                            "uid": uid,
                            "gid": gid,
                        }
                    ],
                },
            }
            for name, path in devices
        ],
    }
    return (json.dumps(spec, indent=2) + "\n").encode()


@dataclass(frozen=True)
class Spec:
    """What the spec must say, given what it says now: the device that passed its check, plus
    each of `others` the spec lists already (a name handed out in an Allocate is replayed by the
    kubelet when a container restarts, so it keeps resolving after the node's hypervisor changed).
    """

    name: str
    device_path: str
    uid: int
    gid: int
    others: tuple[tuple[str, str], ...] = ()  # (name, device path) of every device we may list

    def wanted(self, current: Optional[bytes]) -> bytes:
        """The exact bytes, given the spec's current content (None: there is none)."""
        listed = listed_devices(current) if current is not None else set()
        kept = [(n, p) for n, p in self.others if n in listed and n != self.name]
        return render(self.name, self.device_path, self.uid, self.gid, kept)


def listed_devices(spec: bytes) -> set[str]:
    """Device names a spec lists (empty when it is junk, not ours, or too large to be ours).

    >>> sorted(listed_devices(render("kvm", "/dev/kvm", 0, 0, kept=[("mshv", "/dev/mshv")])))
    ['kvm', 'mshv']
    """
    if len(spec) > MAX_SPEC_BYTES:
        return set()
    try:
        parsed = json.loads(spec)
    except (ValueError, RecursionError):
        return set()
    if not isinstance(parsed, dict) or parsed.get("kind") != contracts.CDI_KIND:
        return set()
    devices = parsed.get("devices")
    if not isinstance(devices, list):
        return set()
    return {d["name"] for d in devices if isinstance(d, dict) and isinstance(d.get("name"), str)}


def device_name(hypervisor: str) -> str:
    """The fully qualified CDI device name Allocate returns: hyperlight.dev/hypervisor=kvm."""
    return f"{contracts.CDI_KIND}={hypervisor}"


def spec_path(cdi_dir: str) -> str:
    return os.path.join(cdi_dir, contracts.CDI_SPEC_FILE)


def directory_present(cdi_dir: str) -> bool:
    """Whether cdi_dir is a directory (False: nothing is there). Raises CdiError when something
    else is: a symlink at cdi_dir is refused, never followed — writing through it would put the
    spec wherever it points, and its removal would go unseen (inotify watches the target)."""
    try:
        st = os.lstat(cdi_dir)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CdiError(f"{cdi_dir} (cdi_dir): cannot look at it: {cause(exc)}", exc.errno) from exc
    if stat.S_ISLNK(st.st_mode):
        raise CdiError(f"{cdi_dir} (cdi_dir) is a symlink; refusing to follow it (set cdi_dir to the real directory)")
    if not stat.S_ISDIR(st.st_mode):
        raise CdiError(f"{cdi_dir} (cdi_dir) is not a directory; refusing to replace it")
    return True


def watch(watcher: DirectoryWatcher, cdi_dir: str, on_change: Callable[[], None]) -> None:
    """on_change() when our spec's content changes or anything replaces cdi_dir: a symlink there is
    refused, never followed (directory_present), so its removal, or a directory in its place, shows
    only in the parent directory."""
    watcher.watch(cdi_dir, lambda name: on_change(), {contracts.CDI_SPEC_FILE}, mask=CONTENT, follow=False)
    watcher.watch(os.path.dirname(cdi_dir), lambda name: on_change(), {os.path.basename(cdi_dir)}, mask=NAMES)


def present(cdi_dir: str) -> Optional[atomic.Current]:
    """The spec at our path as a repair would replace it (None: nothing is there yet, and a repair
    writes it, making cdi_dir if need be). Raises CdiError where no repair can: something else at
    cdi_dir or at our path (a symlink, a file where the directory belongs: refused, never followed
    or replaced), or a system call failing. The running agent (examine) and `--check` (inspect)
    both ask this, so `--check` fails exactly where the agent would serve nothing."""
    directory_present(cdi_dir)
    return _read_ours(spec_path(cdi_dir))


def inspect(cdi_dir: str, spec: Spec) -> Optional[str]:
    """What a repair would change, without changing anything; None when the spec is exact. Raises
    CdiError where the running agent would not repair but fail (present)."""
    path = spec_path(cdi_dir)
    current = present(cdi_dir)
    if current is None:
        return f"{path} is missing"
    wanted = spec.wanted(current.data)
    if current.data != wanted:
        return f"{path} differs from the expected spec"
    if not atomic.is_exact(current, wanted, SPEC_MODE):
        st = current.st
        return (
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o} and owner {st.st_uid}:{st.st_gid}, "
            f"expected {SPEC_MODE:04o} and {os.geteuid()}:{os.getegid()}"
        )
    return None


@dataclass(frozen=True)
class Plan:
    """What a repair would write over what is there (`current`, None: nothing is), from one read."""

    cdi_dir: str
    current: Optional[atomic.Current]
    wanted: bytes

    def lists(self, name: str) -> bool:
        """Whether the spec there now resolves the CDI device `name` (another writer's spec may)."""
        return self.current is not None and name in listed_devices(self.current.data)


def examine(cdi_dir: str, spec: Spec) -> Optional[Plan]:
    """None when the spec is exactly what `spec` wants (bytes, mode, owner), else what a repair
    would write. The file is read once: the devices it lists and the comparison come from the same
    read. Raises CdiError; abandoned temp files of ours are removed on the way."""
    current = present(cdi_dir)
    for stale in atomic.remove_temps(cdi_dir, contracts.CDI_TEMP_PREFIX, contracts.CDI_TEMP_SUFFIX):
        log.info("removed abandoned temp file %s", stale)
    wanted = spec.wanted(current.data if current is not None else None)
    if atomic.is_exact(current, wanted, SPEC_MODE):
        return None
    return Plan(cdi_dir, current, wanted)


def repair(plan: Plan) -> None:
    """Write plan.wanted, replacing only the file examine() read. Raises CdiError; anything but a
    regular file at our path, even one that appears while we write, is left in place."""
    cdi_dir, path = plan.cdi_dir, spec_path(plan.cdi_dir)
    try:
        os.makedirs(cdi_dir, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise CdiError(f"{cdi_dir}: cannot create CDI directory: {cause(exc)}", exc.errno) from exc
    try:
        atomic.write(
            cdi_dir,
            contracts.CDI_SPEC_FILE,
            plan.wanted,
            contracts.CDI_TEMP_PREFIX,
            contracts.CDI_TEMP_SUFFIX,
            SPEC_MODE,
            replace=plan.current.identity if plan.current is not None else None,
        )
    except atomic.Refused as exc:
        raise CdiError(str(exc)) from exc
    except OSError as exc:
        raise CdiError(f"{path}: cannot write: {cause(exc)}", exc.errno) from exc


def reconcile(cdi_dir: str, spec: Spec) -> bool:
    """Make the spec exactly what `spec` wants: examine, then repair. True if it had to be written."""
    plan = examine(cdi_dir, spec)
    if plan is None:
        return False
    repair(plan)
    return True


def _read_ours(path: str) -> Optional[atomic.Current]:
    """The spec (at most one byte more than any spec we write: a longer file differs anyway and
    is not ours to learn names from), or None."""
    try:
        return atomic.read_regular(path, MAX_SPEC_BYTES + 1)
    except atomic.Refused as exc:
        raise CdiError(str(exc)) from exc
    except OSError as exc:
        raise CdiError(f"{path}: cannot read: {cause(exc)}", exc.errno) from exc
