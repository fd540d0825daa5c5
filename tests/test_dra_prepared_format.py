"""The format of the record of prepared claims: what it encodes decodes to the same claims, and a
file of any version, older or newer, is read as the latest without losing what it holds (the
rolling-update cases go through the store, whose writes must keep it)."""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any

import pytest

from hyperlight_agent.dra import prepared, prepared_format
from hyperlight_agent.dra.prepared import Prepared
from hyperlight_agent.dra.prepared_format import PreparedClaim, PreparedDevice
from tests.test_dra_prepared import CLAIM

V1_ENTRY = {
    "namespace": "ns",
    "name": "c",
    "devices": [{"request": "hv", "pool": "node1", "device": "kvm-0", "cdi_device_ids": ["x"], "share_id": None}],
}


def test_encode_and_decode_round_trip() -> None:
    claims = {"u1": CLAIM, "u2": PreparedClaim("ns", "d", (PreparedDevice("r", "p", "d", (), None),))}
    raw = {
        "version": prepared_format.VERSION,
        "claims": {uid: prepared_format.encode_claim(c, 1000.0) for uid, c in claims.items()},
    }
    assert prepared_format.decode(prepared_format.encode(raw), 2000.0).claims == claims
    assert json.loads(prepared_format.encode(raw)) == raw


# Issue 30, 3: two releases share the file during a rolling update.
def test_a_newer_release_s_fields_and_entries_survive_our_writes(tmp: str) -> None:
    path = os.path.join(tmp, prepared.RECORD_FILE)
    newer: dict[str, Any] = {
        "version": 3,
        "shards": ["a"],
        "claims": {
            "u-new": {"namespace": "ns", "name": "n", "preparedAt": 1e12, "devices": [], "owner": "pod-b"},
            "u-shape": {"namespace": "ns", "name": "m", "preparedAt": 1e12, "resources": {"kvm": 1}},
        },
    }
    with open(path, "w") as f:
        json.dump(newer, f)
    record = Prepared(tmp, clock=lambda: 1e12 + 10)
    assert record.get("u-new") == PreparedClaim("ns", "n", ()) and record.get("u-shape") is None
    asyncio.run(record.record("u1", CLAIM))
    with open(path) as f:
        written = json.load(f)
    assert written["version"] == 3 and written["shards"] == ["a"], "never lowered, unknown fields kept"
    assert written["claims"]["u-new"]["owner"] == "pod-b" and written["claims"]["u-shape"] == newer["claims"]["u-shape"]
    assert set(written["claims"]) == {"u-new", "u-shape", "u1"}


def test_a_file_of_version_1_is_migrated_on_the_next_write(tmp: str) -> None:
    path = os.path.join(tmp, prepared.RECORD_FILE)
    v1 = {
        "claims": {
            "u-old": {
                "namespace": "ns",
                "name": "c",
                "devices": [
                    {"request": "hv", "pool": "node1", "device": "kvm-0", "cdi_device_ids": ["x"], "share_id": None}
                ],
            }
        }
    }
    with open(path, "w") as f:
        json.dump(v1, f)
    record = Prepared(tmp, clock=lambda: 5000.0)
    assert record.get("u-old") == PreparedClaim("ns", "c", (PreparedDevice("hv", "node1", "kvm-0", ("x",), None),))
    asyncio.run(record.record("u1", CLAIM))
    with open(path) as f:
        written = json.load(f)
    assert written["version"] == prepared_format.VERSION and written["claims"]["u-old"]["preparedAt"] == 5000.0


def test_every_older_version_has_its_step_to_the_latest() -> None:
    assert sorted(prepared_format.UPGRADES) == list(range(prepared_format.VERSION_1, prepared_format.VERSION))


def test_a_version_1_file_is_read_as_the_latest_prepared_at_its_first_read() -> None:
    record = prepared_format.decode(json.dumps({"claims": {"u": V1_ENTRY}}).encode(), 5000.0004)
    assert record.boots == {"u": ""}, "a release before bootId: of no boot"
    # Written back as it was read, with the time and the version it lacked added last.
    devices = json.dumps(V1_ENTRY["devices"], separators=(",", ":"))
    assert (
        prepared_format.encode(record.raw)
        == (
            f'{{"claims":{{"u":{{"namespace":"ns","name":"c","devices":{devices},"preparedAt":5000.0}}}},"version":{prepared_format.VERSION}}}\n'
        ).encode()
    )


@pytest.mark.parametrize("version", [0, -1, "2", 1.5, None])
def test_anything_but_a_version_is_refused_by_name(version: object) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(f"'version' {version!r} is not a version") + "$"):
        prepared_format.decode(json.dumps({"version": version, "claims": {}}).encode(), 0.0)
