"""The record of prepared claims: claim uid → the claim's namespace and name and the devices we
answered with, kept as one JSON file so that a prepared claim gets the same answer after an agent
restart, and from any agent instance on the node.

    Prepared("/var/lib/kubelet/plugins/hypervisor.hyperlight.dev")
      → prepared.json   {"version": …, "claims": {"<uid>": …}}: the format, its versions and
                        their migration are dra/prepared_format.py's
      → prepared.lock   flock(2)ed by each writer, so two instances (a rolling update) never
                        lose each other's change (read-modify-write under the lock)

Why keep one at all: the kubelet sends only a claim's namespace, name and uid, calls Prepare again
for a claim it already prepared (after its own restart) and calls Unprepare after the claim may
be gone from the API; and Prepare and Unprepare of one claim may reach different instances.

Boots: the kubelet's plugin directory outlives a reboot, the CDI spec (in /run) does not, and after
one the kubelet prepares its pods' claims again before our first check has written the spec. So an
entry says in which boot it was written (the kernel's boot id, the host's in every container), and
an entry of another boot, or of none (written by a release before this field), is no answer by
itself: the service checks the device again (which writes the spec) and records it anew
(`this_boot`).

Versions: two releases share the file during a rolling update. The format reads any version as
the latest and keeps what it does not know; the store writes that back with its own changes only,
so a writer never drops another release's fields or lowers the version.

What it costs: the parsed file is kept and parsed again only when the file changed (another
instance wrote it); a change is one read-modify-write of the whole file under the lock, done in a
thread (waits.in_thread) so that a large record never stalls the event loop, and one per kubelet
request however many claims it names. Entries leave when their claim is unprepared, and also when
they are older than ENTRY_TTL_S or beyond MAX_ENTRIES (oldest first): the kubelet unprepares what
it prepared, but a kubelet that lost its own state never will. Dropping an entry only costs an API
read if the kubelet asks for that claim again.

The file is replaced atomically (files.atomic), so a reader never needs the lock. A file we cannot
read or parse (any JSON of any size, depth or types that is not our format: prepared_format.decode)
is reported once, with its path, and treated as empty (never a crash): the kubelet asks again for
what it needs, and the next change writes a good file. A symlink or anything but a
regular file at its path is refused, never followed or replaced.

Why: docs/decisions/the-record-of-prepared-claims.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from typing import Any, Callable, Optional

from hyperlight_agent import contracts, waits
from hyperlight_agent.dra import prepared_format
from hyperlight_agent.dra.prepared_format import PreparedClaim, Record
from hyperlight_agent.files import atomic
from hyperlight_agent.text import cause

log = logging.getLogger(__name__)

RECORD_FILE = "prepared.json"
LOCK_FILE = "prepared.lock"
TEMP_PREFIX = ".prepared.json."
FILE_MODE = 0o600
# A node prepares at most a few hundred claims at once (its pods: the kubelet's maxPods is 110 by
# default, rarely above 1000); beyond these the oldest go. Every change rewrites the file while
# holding the interpreter's lock for part of it, so this also bounds what one change costs the loop.
MAX_ENTRIES = 4096
ENTRY_TTL_S = 7 * 24 * 3600.0
# Another instance holds the lock for one small write (milliseconds). One wait per kubelet request
# (however many claims it names), well below the kubelet's 45 s per call; polled, not blocking.
LOCK_TIMEOUT_S = 5.0
LOCK_POLL_S = 0.005


class PreparedError(Exception):
    """The record could not be changed (the message names the path and the cause)."""


def read_boot_id(path: str = contracts.BOOT_ID_FILE) -> str:
    """This boot's id ("" when it cannot be read: then no entry counts as written in this boot)."""
    try:
        with open(path) as f:
            return f.read(64).strip()
    except OSError as exc:
        log.warning("cannot read the boot id from %s: %s; every prepared claim will be checked again", path, cause(exc))
        return ""


def expire(raw: dict[str, Any], now: float) -> list[str]:
    """Drop entries older than ENTRY_TTL_S, then the oldest beyond MAX_ENTRIES; the uids dropped."""
    entries: dict[str, Any] = raw["claims"]
    ttl, limit = ENTRY_TTL_S, MAX_ENTRIES

    def when(uid: str) -> float:
        at = prepared_format.prepared_at(entries[uid])
        return now if at is None else at

    gone = [uid for uid in entries if now - when(uid) > ttl]
    for uid in gone:
        del entries[uid]
    if len(entries) > limit:
        extra = sorted(entries, key=when)[: len(entries) - limit]
        for uid in extra:
            del entries[uid]
        gone += extra
    return gone


class Prepared:
    """The record in `directory` (created when first written). Reads are lock-free and always
    current; change() serializes with every other instance through the lock file."""

    def __init__(self, directory: str, clock: Callable[[], float] = time.time, boot_id: Optional[str] = None) -> None:
        self.directory = directory
        self.path = os.path.join(directory, RECORD_FILE)
        self.lock_path = os.path.join(directory, LOCK_FILE)
        self._clock = clock
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        # Our own writers; flock(2) orders us against other processes. Made on first use: an
        # asyncio.Lock made outside the loop belongs to another loop under Python 3.9.
        self._local: Optional[asyncio.Lock] = None
        self._reported: Optional[str] = None  # the unreadable-file error last logged
        # The last parse, and the file it came from: (device, inode, size, mtime) → Record.
        self._cache: Optional[tuple[tuple[int, int, int, int], Record]] = None
        record, _ = self._read()
        log.info("prepared claims: %d in %s", len(record.claims), self.path)

    def claims(self) -> dict[str, PreparedClaim]:
        """Every prepared claim, as the file says now ({} if it is missing or unreadable)."""
        return self._read()[0].claims

    def get(self, uid: str) -> Optional[PreparedClaim]:
        return self.claims().get(uid)

    def this_boot(self, uid: str) -> bool:
        """Whether claim uid was recorded in this boot (else its answer needs a fresh check)."""
        return bool(self.boot_id) and self._read()[0].boots.get(uid) == self.boot_id

    async def record(self, uid: str, claim: PreparedClaim) -> None:
        """Remember claim uid as prepared with these devices. Raises PreparedError."""
        await self.change({uid: claim}, ())

    async def forget(self, uid: str) -> bool:
        """Forget claim uid; False if it was not recorded. Raises PreparedError."""
        return uid in await self.change({}, (uid,))

    async def change(self, add: dict[str, PreparedClaim], remove: tuple[str, ...]) -> set[str]:
        """Record `add` and forget `remove` in one read-modify-write under the lock (one wait
        for it, bounded by LOCK_TIMEOUT_S, whatever the number of claims). Returns the uids of
        `remove` that were recorded. Raises PreparedError naming the path (and the lock's holder)."""
        if self._local is None:
            self._local = asyncio.Lock()
        async with self._local:
            fd = await self._lock()
            try:
                return await waits.in_thread(lambda: self._rewrite(add, remove), "prepared-claims")
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    def _rewrite(self, add: dict[str, PreparedClaim], remove: tuple[str, ...]) -> set[str]:
        """Under the lock, in a thread: read, change, expire, write if anything changed."""
        record, current = self._read(refuse=True)
        # The cached parse stays what the file says: a new mapping of claims (its entries are
        # replaced, never changed in place).
        raw = {**record.raw, "claims": dict(record.raw["claims"])}
        now = self._clock()
        removed = {uid for uid in remove if raw["claims"].pop(uid, None) is not None}
        added = {
            uid
            for uid, claim in add.items()
            if record.claims.get(uid) != claim
            or record.boots.get(uid) != self.boot_id
            or not isinstance(raw["claims"].get(uid), dict)
        }
        for uid in added:
            raw["claims"][uid] = prepared_format.encode_claim(add[uid], now, self.boot_id)
        expired = expire(raw, now)
        if expired:
            log.info(
                "prepared claims: %d entries expired (older than %g days, or beyond %d)",
                len(expired),
                ENTRY_TTL_S / 86400,
                MAX_ENTRIES,
            )
        if not (removed or added or expired):
            return removed
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
            atomic.write(
                self.directory,
                RECORD_FILE,
                prepared_format.encode(raw),
                TEMP_PREFIX,
                mode=FILE_MODE,
                replace=current.identity if current is not None else None,
            )
        except (OSError, atomic.Refused) as exc:
            raise PreparedError(f"cannot write {self.path}: {cause(exc)}") from exc
        # What we wrote is what the next read would parse: keep it rather than parse it again.
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            claims = {uid: c for uid, c in {**record.claims, **add}.items() if uid in raw["claims"]}
            boots = {uid: b for uid, b in {**record.boots, **dict.fromkeys(add, self.boot_id)}.items() if uid in claims}
            self._cache = ((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), Record(claims, raw, boots))
        return removed

    async def _lock(self) -> int:
        """Our descriptor of the lock file, exclusively flock(2)ed."""
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
            atomic.remove_temps(self.directory, TEMP_PREFIX)  # a crash mid-write leaves one
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise PreparedError(f"cannot open {self.lock_path}: {cause(exc)}") from exc
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                    holder = _holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else ""
                    os.close(fd)
                    why = f"held by {holder} for over {LOCK_TIMEOUT_S:g} s" if holder else cause(exc)
                    raise PreparedError(f"cannot lock {self.lock_path}: {why}") from exc
                await asyncio.sleep(LOCK_POLL_S)
                continue
            return fd

    def _read(self, refuse: bool = False) -> tuple[Record, Optional[atomic.Current]]:
        """The record and the file it came from (None: no file). Unreadable → empty and one log
        line; with `refuse`, a file that is not ours to replace (a symlink) raises PreparedError."""
        current: Optional[atomic.Current] = None
        try:
            cached = self._unchanged()
            if cached is not None:
                return cached
            current = atomic.read_regular(self.path, prepared_format.MAX_FILE_BYTES + 1)
            if current is None:
                return Record(), None
            key = (current.st.st_dev, current.st.st_ino, current.st.st_size, current.st.st_mtime_ns)
            record = prepared_format.decode(current.data, self._clock())
        except atomic.Refused as exc:
            problem = f"{self.path} is not a regular file (a symlink?); refusing to follow or replace it"
            self._report(problem)
            if refuse:
                raise PreparedError(problem) from exc
            return Record(), None
        except (OSError, ValueError) as exc:
            self._report(f"cannot read prepared claims from {self.path}: {cause(exc)}; treating it as empty")
            return Record(), current
        self._cache = (key, record)
        if self._reported is not None:
            log.info("prepared claims readable again in %s", self.path)
            self._reported = None
        return record, current

    def _unchanged(self) -> Optional[tuple[Record, atomic.Current]]:
        """The cached record, if the file is still the one it was parsed from (no read at all:
        a large record is neither read nor parsed again)."""
        if self._cache is None:
            return None
        try:
            st = os.lstat(self.path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self._cache[0]:
            return None
        return self._cache[1], atomic.Current(b"", st)  # its bytes are the cached record's

    def _report(self, problem: str) -> None:
        if problem != self._reported:
            log.error("%s", problem)
            self._reported = problem


def _holder(fd: int) -> str:
    """Who holds the flock on the file open at fd, from /proc/locks ("" if not found): "pid 42
    (hyperlight-agent)"."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's line has "->" in field 2.
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted and fields[4].isdigit():
            pid = int(fields[4])
            name = ""
            with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            return f"pid {pid}" + (f" ({name})" if name else "") if pid else "a process in another PID namespace"
    return ""
