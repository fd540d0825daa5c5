"""The format of the record of prepared claims (dra/prepared.py keeps the file): its bytes, read
and written, and every version of it read as the latest. No I/O and no clock (the caller passes
the time), standard library only.

    {"version": 2, "claims": {"<uid>": {"namespace", "name", "preparedAt": <unix seconds>,
                                        "bootId": <the kernel's boot id>,
                                        "devices": [{"request", "pool", "device",
                                                     "cdi_device_ids": [...], "share_id"}]}}}

Versions: two releases share the file during a rolling update, so a writer keeps every field it
does not know (the file's and each claim's) and never lowers the version. A file of an older
version is brought to VERSION by every step of UPGRADES from its own (version 1: no "version", no
preparedAt, read as prepared now). A version this release does not know is read for what it knows
and kept whole otherwise. bootId came within version 2, so an entry may lack it (of no boot).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

# The first release's file: no "version" field (read as this one), and no preparedAt.
VERSION_1 = 1
# What this release writes: each entry says when it was prepared (and, optionally, its boot).
VERSION = 2
# Far above any real record (a claim is ~300 bytes): a bigger file is not ours to parse.
MAX_FILE_BYTES = 16 << 20
# Our format nests 6 levels (file, claims, entry, devices, device, cdi_device_ids); a newer
# release's fields get room beyond. A deeper file is not ours: refused before it reaches
# json.dumps, which, like json.loads, recurses once per level and fails near the interpreter's
# recursion limit (where exactly depends on the caller's stack).
MAX_DEPTH = 64


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


@dataclass
class Record:
    """The file's content: the claims we understand, and everything as it was read (kept whole
    when written back: fields a newer release added, claims whose entries we cannot read)."""

    claims: dict[str, PreparedClaim] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=lambda: {"version": VERSION, "claims": {}})
    boots: dict[str, str] = field(default_factory=dict)  # uid → the boot it was written in ("" unknown)


def encode_claim(claim: PreparedClaim, prepared_at: float, boot_id: str = "") -> dict[str, Any]:
    return {
        "namespace": claim.namespace,
        "name": claim.name,
        "preparedAt": round(prepared_at, 3),
        "bootId": boot_id,
        "devices": [
            {
                "request": d.request,
                "pool": d.pool,
                "device": d.device,
                "cdi_device_ids": list(d.cdi_device_ids),
                "share_id": d.share_id,
            }
            for d in claim.devices
        ],
    }


def encode(raw: dict[str, Any]) -> bytes:
    """The file's bytes: compact (not sorted: sorting a large record costs the loop's thread)."""
    return (json.dumps(raw, separators=(",", ":")) + "\n").encode()


def decode(data: bytes, now: float) -> Record:
    """Parse the file's bytes, brought to VERSION; ValueError (naming what is wrong) for anything
    but our format, whatever the bytes: any JSON of any size, depth and types. A claim whose entry
    we cannot read stays in `raw` (a newer release's shape) but not in `claims`."""
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(data.decode())
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    if nested_deeper(doc, MAX_DEPTH):
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if not isinstance(doc, dict):
        raise ValueError("the file is not a JSON object")
    version = doc.get("version", VERSION_1)
    if not isinstance(version, int) or version < VERSION_1:
        raise ValueError(f"'version' {version!r} is not a version")
    entries = _field(doc, "claims", dict, "the file")
    to_latest(doc, version, now)
    claims, boots = {}, {}
    for uid, entry in entries.items():
        try:
            claims[uid] = _claim(uid, entry)
        except ValueError:
            if version <= VERSION:
                raise  # our own format, broken: the file is unreadable
            continue  # a newer release's entry: kept as it is, not answered from
        if prepared_at(entry) is None:
            _stamp(entry, now)  # expiry counts from somewhere: this read, as for version 1's entries
        boot = entry.get("bootId")
        boots[uid] = boot if isinstance(boot, str) else ""
    return Record(claims, doc, boots)


def prepared_at(entry: Any) -> Optional[float]:
    """When an entry says its claim was prepared (None: it does not say, or is no entry of ours,
    or says no time a float holds: an integer of 400 digits, inf, nan).

    >>> prepared_at({"preparedAt": 10**400}) is None, prepared_at({"preparedAt": 5})
    (True, 5.0)
    """
    value = entry.get("preparedAt") if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        at = float(value)
    except OverflowError:
        return None
    return at if math.isfinite(at) else None


def nested_deeper(doc: Any, limit: int) -> bool:
    """Whether a parsed document nests lists and objects more than `limit` levels deep (counted
    level by level, not recursively: this must hold for any depth json.loads returns).

    >>> nested_deeper({"a": [[1]]}, 3), nested_deeper({"a": [[1]]}, 2)
    (False, True)
    """
    level = [doc] if isinstance(doc, (dict, list)) else []
    for _ in range(limit):
        inner: list[Any] = []
        for value in level:
            inner.extend(value.values() if isinstance(value, dict) else value)
        level = [v for v in inner if isinstance(v, (dict, list))]
        if not level:
            return False
    return True


def _stamp(entry: dict[str, Any], now: float) -> None:
    entry["preparedAt"] = round(now, 3)


def _version_1_to_2(doc: dict[str, Any], now: float) -> None:
    # Version 1 kept no times: counting each entry from its first read after the upgrade lets
    # expiry (the store's) drop it only a full lifetime later, never at once.
    for entry in doc["claims"].values():
        if isinstance(entry, dict):
            _stamp(entry, now)


# Each older version's step to the next one; a new version adds its predecessor's row here.
UPGRADES: dict[int, Callable[[dict[str, Any], float], None]] = {VERSION_1: _version_1_to_2}


def to_latest(doc: dict[str, Any], version: int, now: float) -> None:
    """Bring a parsed file of `version` to VERSION in place, through every step from its own. A
    newer release's file keeps its version and its content: we never lower either."""
    for older in range(version, VERSION):
        UPGRADES[older](doc, now)
    doc["version"] = max(version, VERSION)


def _claim(uid: str, entry: Any) -> PreparedClaim:
    devices = tuple(
        PreparedDevice(
            request=_field(d, "request", str, uid),
            pool=_field(d, "pool", str, uid),
            device=_field(d, "device", str, uid),
            cdi_device_ids=tuple(_strings(_field(d, "cdi_device_ids", list, uid), uid)),
            share_id=_field(d, "share_id", (str, type(None)), uid),
        )
        for d in _field(entry, "devices", list, uid)
    )
    return PreparedClaim(
        namespace=_field(entry, "namespace", str, uid), name=_field(entry, "name", str, uid), devices=devices
    )


def _field(doc: Any, key: str, kind: Any, where: str) -> Any:
    if not isinstance(doc, dict) or not isinstance(doc.get(key), kind):
        raise ValueError(f"{where}: {key!r} is missing or of the wrong type")
    value = doc[key]
    if isinstance(value, str) and not _text(value):
        raise ValueError(f"{where}: {key!r} is not UTF-8 text")
    return value


def _strings(values: list[Any], where: str) -> list[str]:
    if not all(isinstance(v, str) and _text(v) for v in values):
        raise ValueError(f"{where}: cdi_device_ids holds something but UTF-8 text")
    return values


def _text(value: str) -> bool:
    """Whether a string is UTF-8 text: a JSON escape such as "\\ud800" parses to a lone surrogate, which
    no gRPC answer can carry (protobuf refuses them as it encodes the Prepare's answer).

    >>> _text("kvm-0"), _text(chr(0xD800))
    (True, False)
    """
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True
