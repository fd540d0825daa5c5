"""The record of prepared claims: claim uid → the claim's namespace and name and the devices we
answered with, kept as one JSON file so that a prepared claim gets the same answer after an agent
restart, and from any agent instance on the node.

    Prepared("/var/lib/kubelet/plugins/hyperlight.dev")
      → prepared.json   {"claims": {"<uid>": {"namespace", "name", "devices": [...]}}}
      → prepared.lock   flock(2)ed by each writer, so two instances (a rolling update) never
                        lose each other's change (read-modify-write under the lock)

Why keep one at all: the kubelet sends only a claim's namespace, name and uid, calls Prepare again
for a claim it already prepared (after its own restart) and calls Unprepare after the claim may
be gone from the API; and Prepare and Unprepare of one claim may reach different instances.

The file is replaced atomically (node.atomic), so a reader never needs the lock. A file we
cannot read or parse is reported once, with its path, and treated as empty (never a crash): the
kubelet asks again for what it needs, and the next change writes a good file.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from typing import Any, NamedTuple, Optional

from hyperlight_agent.node import atomic

log = logging.getLogger(__name__)

RECORD_FILE = "prepared.json"
LOCK_FILE = "prepared.lock"
TEMP_PREFIX = ".prepared.json."
FILE_MODE = 0o600
# Far above any real record (a claim is ~300 bytes, a node has at most hundreds): a bigger file
# is not ours to parse.
MAX_FILE_BYTES = 16 << 20
# Another instance holds the lock for one small write (milliseconds); we poll rather than block
# the event loop in flock(2), and give up after this long.
LOCK_TIMEOUT_S = 5.0
LOCK_POLL_S = 0.005


class PreparedDevice(NamedTuple):
    request: str
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: Optional[str] = None


class PreparedClaim(NamedTuple):
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]


class PreparedError(Exception):
    """The record could not be changed (the message names the path and the cause)."""


def encode(claims: dict[str, PreparedClaim]) -> bytes:
    """The file's bytes: sorted, one claim per key, so equal records are equal files."""
    doc = {"claims": {uid: {"namespace": c.namespace, "name": c.name,
                            "devices": [{"request": d.request, "pool": d.pool, "device": d.device,
                                         "cdi_device_ids": list(d.cdi_device_ids), "share_id": d.share_id}
                                        for d in c.devices]}
                      for uid, c in claims.items()}}
    return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()


def decode(data: bytes) -> dict[str, PreparedClaim]:
    """Parse the file's bytes; ValueError (naming what is wrong) for anything but our format."""
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    doc = json.loads(data.decode())
    claims = _field(doc, "claims", dict, "the file")
    found = {}
    for uid, entry in claims.items():
        devices = tuple(
            PreparedDevice(request=_field(d, "request", str, uid), pool=_field(d, "pool", str, uid),
                           device=_field(d, "device", str, uid),
                           cdi_device_ids=tuple(_strings(_field(d, "cdi_device_ids", list, uid), uid)),
                           share_id=_field(d, "share_id", (str, type(None)), uid))
            for d in _field(entry, "devices", list, uid))
        found[uid] = PreparedClaim(namespace=_field(entry, "namespace", str, uid),
                                   name=_field(entry, "name", str, uid), devices=devices)
    return found


def _field(doc: Any, key: str, kind: Any, where: str) -> Any:
    if not isinstance(doc, dict) or not isinstance(doc.get(key), kind):
        raise ValueError(f"{where}: {key!r} is missing or of the wrong type")
    return doc[key]


def _strings(values: list[Any], where: str) -> list[str]:
    if not all(isinstance(v, str) for v in values):
        raise ValueError(f"{where}: cdi_device_ids holds a non-string")
    return values


class Prepared:
    """The record in `directory` (created when first written). Reads are lock-free and always
    current; record() and forget() serialize with every other instance through the lock file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, RECORD_FILE)
        self.lock_path = os.path.join(directory, LOCK_FILE)
        # Our own writers; flock(2) orders us against other processes. Made on first use: an
        # asyncio.Lock made outside the loop belongs to another loop under Python 3.9.
        self._local: Optional[asyncio.Lock] = None
        self._reported: Optional[str] = None  # the unreadable-file error last logged
        claims = self.claims()
        log.info("prepared claims: %d in %s", len(claims), self.path)

    def claims(self) -> dict[str, PreparedClaim]:
        """Every prepared claim, read from the file now ({} if it is missing or unreadable)."""
        return self._read()[0]

    def get(self, uid: str) -> Optional[PreparedClaim]:
        return self.claims().get(uid)

    async def record(self, uid: str, claim: PreparedClaim) -> None:
        """Remember claim uid as prepared with these devices. Raises PreparedError."""
        await self._change(uid, claim)

    async def forget(self, uid: str) -> bool:
        """Forget claim uid; False if it was not recorded. Raises PreparedError."""
        return await self._change(uid, None)

    async def _change(self, uid: str, claim: Optional[PreparedClaim]) -> bool:
        if self._local is None:
            self._local = asyncio.Lock()
        async with self._local:
            fd = await self._lock()
            try:
                claims, current = self._read()
                if claim is None:
                    if claims.pop(uid, None) is None:
                        return False
                elif claims.get(uid) == claim:
                    return True
                else:
                    claims[uid] = claim
                try:
                    os.makedirs(self.directory, mode=0o755, exist_ok=True)
                    atomic.write(self.directory, RECORD_FILE, encode(claims), TEMP_PREFIX, mode=FILE_MODE,
                                 replace=current.identity if current is not None else None)
                except (OSError, atomic.Refused) as exc:
                    raise PreparedError(f"cannot write {self.path}: {_why(exc)}") from exc
                return True
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    async def _lock(self) -> int:
        """Our descriptor of the lock file, exclusively flock(2)ed."""
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
            atomic.remove_temps(self.directory, TEMP_PREFIX)  # a crash mid-write leaves one
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise PreparedError(f"cannot open {self.lock_path}: {_why(exc)}") from exc
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                    os.close(fd)
                    raise PreparedError(f"cannot lock {self.lock_path}: {_why(exc)}") from exc
                await asyncio.sleep(LOCK_POLL_S)
                continue
            return fd

    def _read(self) -> tuple[dict[str, PreparedClaim], Optional[atomic.Current]]:
        """The claims and the file they came from (None: no file). Unreadable → {} and one log line."""
        current: Optional[atomic.Current] = None
        try:
            current = atomic.read_regular(self.path, MAX_FILE_BYTES + 1)
            if current is None:
                return {}, None
            claims = decode(current.data)
        except (OSError, atomic.Refused, ValueError) as exc:
            problem = f"cannot read prepared claims from {self.path}: {_why(exc)}; treating it as empty"
            if problem != self._reported:
                log.error("%s", problem)
                self._reported = problem
            # A file we refused (a symlink, a directory) must not be replaced either.
            return {}, None if isinstance(exc, atomic.Refused) else current
        if self._reported is not None:
            log.info("prepared claims readable again in %s", self.path)
            self._reported = None
        return claims, current


def _why(exc: BaseException) -> str:
    """One line: the OS's words for an OSError, else the message."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    with contextlib.suppress(Exception):
        return str(exc).splitlines()[0][:300]
    return type(exc).__name__
