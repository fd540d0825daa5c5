"""What the real clusters and the other tests running at once on one host share (two pytest
workers, another checkout's run): the nodes' subnets, the standard paths they mount over, and the
host's cores while a figure is measured under load.

A cluster claims its subnets with a lock it holds for its life (flock: the kernel releases it when
the process ends, however it ends), since its nodes' bridges, whose routes would show the subnets
taken, appear only with their first pod. A standard path (/var/lib/kubelet, /run/cdi, …) that the
host lacks is made by the first user that needs it (a cluster's node, a podman test binding
/run/cdi into a guest) and listed in a registry beside the locks; it is removed only when no user
holds a claim: removing a directory detaches the mounts on it in every other mount namespace, so
a node of another running cluster would lose its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import IO, Optional

LOCK_DIR = "/run/lock"
PREFIX = "hyperlight-e2e"


def _path(lock_dir: str, name: str) -> str:
    return os.path.join(lock_dir, f"{PREFIX}-{name}")


@contextlib.contextmanager
def _registry_lock(lock_dir: str) -> Iterator[None]:
    os.makedirs(lock_dir, exist_ok=True)
    with open(_path(lock_dir, "host.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _try_lock(path: str) -> Optional[IO[str]]:
    """The file at path, locked exclusively, or None when someone holds it (this process too,
    through another open file)."""
    f = open(path, "a")  # noqa: SIM115  # the lock lasts as long as this file stays open
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


class SubnetClaim:
    """The first of the candidate bases (those no route takes) that no other cluster claims, held
    until release()."""

    def __init__(self, candidates: Iterable[int], lock_dir: str = LOCK_DIR) -> None:
        os.makedirs(lock_dir, exist_ok=True)
        self._held: Optional[IO[str]] = None
        for base in candidates:
            self._held = _try_lock(_path(lock_dir, f"subnets-{base}.lock"))
            if self._held is not None:
                self.base = base
                return
        raise RuntimeError(f"no free subnets: every candidate is routed or claimed ({lock_dir}/{PREFIX}-subnets-*)")

    def release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None


class LoadWindow:
    """A window measured under load (a pod every fraction of a second through a handover, an
    upgrade, a kubelet restart), held until release() against every other on this host, whichever
    worker or run opens it; waited_s is how long it waited for one.

    Such a figure (no pod rejected, no prepare failed) holds when the agent's successor starts
    within the handover time (handoverSeconds, 30 s). Two clusters' loads at once kept both cores
    busy, and a successor's pod took 37 s to start: the old agent had stopped waiting, and a DRA
    prepare failed "not registered" (issue 46, ci39). One window at a time, the figure measures the
    agent, not how busy the host was; the clusters' other work still runs side by side."""

    # This process's open window (its lock file) and how many hold it: a window opened inside
    # another in one process is the same window, never a wait on itself.
    _open: Optional[IO[str]] = None
    _holders = 0

    def __init__(self, lock_dir: str = LOCK_DIR) -> None:
        started = time.monotonic()
        if LoadWindow._open is None:
            os.makedirs(lock_dir, exist_ok=True)
            held = open(_path(lock_dir, "load-window.lock"), "a")  # noqa: SIM115  # held until the last release
            fcntl.flock(held, fcntl.LOCK_EX)
            LoadWindow._open = held
        LoadWindow._holders += 1
        self._holding = True
        self.waited_s = time.monotonic() - started

    def release(self) -> None:
        if not self._holding:
            return
        self._holding = False
        LoadWindow._holders -= 1
        if LoadWindow._holders == 0 and LoadWindow._open is not None:
            LoadWindow._open.close()
            LoadWindow._open = None


class Claim:
    """A user of the standard paths that is no cluster (a podman test's /run/cdi), held until
    release(); its lock file goes with it."""

    def __init__(self, lock_dir: str = LOCK_DIR) -> None:
        os.makedirs(lock_dir, exist_ok=True)
        self._path = _path(lock_dir, f"user-{uuid.uuid4().hex}.lock")
        self._held = _try_lock(self._path)

    def release(self) -> None:
        if self._held is not None:
            os.unlink(self._path)
            self._held.close()
            self._held = None

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _claimed(lock_dir: str) -> bool:
    """Whether any user (a cluster's subnets, another's Claim) holds a claim now."""
    for name in os.listdir(lock_dir):
        if name.startswith((f"{PREFIX}-subnets-", f"{PREFIX}-user-")) and name.endswith(".lock"):
            try:  # read-only: a released user's file is gone, and must not be made again
                fd = os.open(os.path.join(lock_dir, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            finally:
                os.close(fd)
    return False


def _registry(lock_dir: str) -> list[str]:
    try:
        with open(_path(lock_dir, "mountpoints.json")) as f:
            return list(json.load(f))
    except FileNotFoundError:
        return []


def _write_registry(lock_dir: str, paths: list[str]) -> None:
    path = _path(lock_dir, "mountpoints.json")
    if not paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with open(path + ".tmp", "w") as f:
        json.dump(sorted(set(paths)), f)
    os.replace(path + ".tmp", path)


def make_mountpoints(targets: Iterable[str], lock_dir: str = LOCK_DIR) -> None:
    """Each of targets the host lacks, made and listed (by a user that holds its claim)."""
    with _registry_lock(lock_dir):
        made = [os.path.realpath(t) for t in targets if not os.path.exists(t)]
        for target in made:
            os.makedirs(target)
        if made:
            _write_registry(lock_dir, _registry(lock_dir) + made)


def remove_mountpoints(also: Iterable[str] = (), lock_dir: str = LOCK_DIR) -> list[str]:
    """Once no user holds a claim: every listed mountpoint (and `also`: a killed run's, from its
    state file) removed, deepest first; else they stay listed for the last one out. Returns what
    is left listed."""
    with _registry_lock(lock_dir):
        listed = sorted(set(_registry(lock_dir)) | {os.path.realpath(p) for p in also}, key=len, reverse=True)
        if _claimed(lock_dir):
            _write_registry(lock_dir, listed)
            return listed
        for path in listed:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        _write_registry(lock_dir, [])
        return []
