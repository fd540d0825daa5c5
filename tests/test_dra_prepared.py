"""The record of prepared claims: survives a restart, is shared by instances, never crashes on a
bad file and never replaces what is not ours."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperlight_agent.dra import prepared, prepared_format
from hyperlight_agent.dra.prepared import Prepared, PreparedError
from hyperlight_agent.dra.prepared_format import PreparedClaim, PreparedDevice
from tests.conftest import count_inputs, fuzz_budget

CLAIM = PreparedClaim("ns", "c", (PreparedDevice("hv", "node1", "kvm-0", ("hyperlight.dev/hypervisor=kvm",), "s"),))


def test_recorded_claims_are_read_by_a_new_record(tmp: str) -> None:
    async def main() -> None:
        first = Prepared(tmp)
        await first.record("u1", CLAIM)
        assert Prepared(tmp).get("u1") == CLAIM
        assert await Prepared(tmp).forget("u1")
        assert first.claims() == {}
        assert not await first.forget("u1")

    asyncio.run(main())
    assert oct(os.stat(os.path.join(tmp, prepared.RECORD_FILE)).st_mode & 0o777) == oct(prepared.FILE_MODE)


def test_concurrent_writers_of_two_instances_lose_nothing(tmp: str) -> None:
    async def main() -> None:
        a, b = Prepared(tmp), Prepared(tmp)
        await asyncio.gather(*(r.record(f"u{i}", CLAIM) for i in range(20) for r in ([a] if i % 2 else [b])))
        assert sorted(a.claims()) == sorted(f"u{i}" for i in range(20))

    asyncio.run(main())


def test_a_held_lock_delays_the_writer_not_the_loop(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    monkeypatch.setattr(prepared, "LOCK_TIMEOUT_S", 0.05)
    os.makedirs(tmp, exist_ok=True)
    holder = os.open(os.path.join(tmp, prepared.LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another instance mid-write (a separate open file description)
    try:
        with pytest.raises(PreparedError, match=f"cannot lock {tmp}/prepared.lock"):
            asyncio.run(Prepared(tmp).record("u1", CLAIM))
    finally:
        os.close(holder)


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"claims": {"u": {"name": 1}}}', b"\xff\xfe"])
def test_a_corrupt_file_is_reported_with_its_path_and_read_as_empty(
    tmp: str, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = os.path.join(tmp, prepared.RECORD_FILE)
    with open(path, "wb") as f:
        f.write(content)
    with caplog.at_level(logging.ERROR):
        record = Prepared(tmp)
    assert record.claims() == {}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(f"cannot read prepared claims from {path}: ")
    assert errors[0].endswith("treating it as empty") and "\n" not in errors[0]
    asyncio.run(record.record("u1", CLAIM))  # the next change writes a good file
    assert Prepared(tmp).get("u1") == CLAIM


def test_a_symlink_at_the_record_path_is_neither_followed_nor_replaced(tmp: str) -> None:
    target = os.path.join(tmp, "elsewhere")
    with open(target, "w") as f:
        f.write("{}")
    path = os.path.join(tmp, prepared.RECORD_FILE)
    os.symlink(target, path)
    record = Prepared(tmp)
    assert record.claims() == {}
    with pytest.raises(PreparedError, match=f"^{path} is not a regular file \\(a symlink\\?\\); refusing to follow"):
        asyncio.run(record.record("u1", CLAIM))
    assert os.path.islink(path)
    with open(target) as f:
        assert f.read() == "{}"


# Issue 26, 19: entries of claims no longer prepared go, and the file work is off the loop.
def test_old_entries_expire_and_the_oldest_go_beyond_the_limit(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1_000_000.0]
    record = Prepared(tmp, clock=lambda: now[0])
    asyncio.run(record.change({f"old{i}": CLAIM for i in range(3)}, ()))
    now[0] += prepared.ENTRY_TTL_S + 1
    monkeypatch.setattr(prepared, "MAX_ENTRIES", 4)
    for i in range(6):
        now[0] += 1
        asyncio.run(record.record(f"new{i}", CLAIM))
    assert sorted(record.claims()) == ["new2", "new3", "new4", "new5"]


def test_the_file_is_written_in_a_thread_not_on_the_loop(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from hyperlight_agent.files import atomic

    threads: list[str] = []
    write = atomic.write

    def recording(*args: object, **kw: object) -> None:
        threads.append(threading.current_thread().name)
        write(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(atomic, "write", recording)
    asyncio.run(Prepared(tmp).record("u1", CLAIM))
    assert threads == ["prepared-claims"]


def test_an_unchanged_file_is_parsed_once(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(Prepared(tmp).change({f"u{i}": CLAIM for i in range(50)}, ()))
    parses = []
    decode = prepared_format.decode

    def counted(data: bytes, now: float) -> prepared_format.Record:
        parses.append(1)
        return decode(data, now)

    monkeypatch.setattr(prepared_format, "decode", counted)
    record = Prepared(tmp)
    for _ in range(20):
        assert len(record.claims()) == 50
    asyncio.run(record.record("u-new", CLAIM))  # our own write does not make it parse again
    assert len(record.claims()) == 51 and len(parses) == 1


def test_each_entry_says_the_boot_it_was_written_in(tmp: str) -> None:
    """An entry of another boot, or of none (a release before the field), is not this boot's; a
    claim recorded again is this boot's from then on."""

    async def main() -> None:
        before = Prepared(tmp, boot_id="boot-1")
        await before.record("u1", CLAIM)
        with open(before.path) as f:
            assert json.load(f)["claims"]["u1"]["bootId"] == "boot-1"
        assert before.this_boot("u1")
        after = Prepared(tmp, boot_id="boot-2")
        assert after.get("u1") == CLAIM and not after.this_boot("u1")
        await after.record("u1", CLAIM)  # the same claim, written again for this boot
        assert after.this_boot("u1") and not Prepared(tmp, boot_id="boot-1").this_boot("u1")
        with open(after.path) as f:
            doc = json.load(f)
        del doc["claims"]["u1"]["bootId"]
        with open(after.path, "w") as f:
            json.dump(doc, f)
        assert not Prepared(tmp, boot_id="boot-2").this_boot("u1")

    asyncio.run(main())


def test_an_unreadable_boot_id_makes_no_entry_this_boots(tmp: str, caplog: pytest.LogCaptureFixture) -> None:
    missing = os.path.join(tmp, "no-boot-id")
    assert prepared.read_boot_id(missing) == ""
    assert f"cannot read the boot id from {missing}" in caplog.text

    async def main() -> None:
        record = Prepared(tmp, boot_id="")
        await record.record("u1", CLAIM)
        assert not record.this_boot("u1")

    asyncio.run(main())
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert prepared.read_boot_id() == f.read().strip() != ""


# Issue 47, 1: any well-formed JSON at the record's path, whatever its size, depth and types, is
# reported once and read as empty; the next change writes a good file. Never a crash at start.
def valid_document() -> dict[str, Any]:
    return {
        "version": prepared_format.VERSION,
        "claims": {"u0": prepared_format.encode_claim(CLAIM, 1000.0, "boot-1")},
    }


def places(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a parsed document: the document itself, each value, each list item."""
    yield path
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in children:
        yield from places(value, (*path, key))


def put(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


DEEP = 100_000  # far beyond the interpreter's recursion limit: json.loads raises RecursionError
WRONG_VALUES: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    10**400,  # float() of it raises OverflowError
    -(10**400),
    1.5,
    1e308,
    math.inf,  # written as Infinity, which json.loads reads
    math.nan,
    "",
    "\ud800",  # a lone surrogate: valid JSON, no UTF-8 string
    [],
    {},
    [[["x"]]],
    {"a": {"b": {}}},
)


def write_json(tmp: str, doc: Any) -> str:
    path = os.path.join(tmp, prepared.RECORD_FILE)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def survives(tmp: str, data: bytes) -> dict[str, PreparedClaim]:
    """Start on the file's bytes as the agent does, read it, then record a claim: nothing but
    PreparedError may come out, and what was recorded reads back."""
    path = os.path.join(tmp, prepared.RECORD_FILE)
    with open(path, "wb") as f:
        f.write(data)
    record = Prepared(tmp, clock=lambda: 2000.0, boot_id="boot-1")
    claims = record.claims()
    record.this_boot("u0")
    json.dumps(claims, ensure_ascii=False).encode()  # every string a gRPC answer can carry
    asyncio.run(record.record("u-new", CLAIM))
    assert Prepared(tmp, clock=lambda: 2000.0).get("u-new") == CLAIM
    return claims


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("nested too deep to parse", '{"claims": {"u0": ' + "[" * DEEP + "]" * DEEP + "}}"),
        ("a deep document alone", "[" * DEEP + "]" * DEEP),
        ("deep in a newer release's field", '{"version": 99, "claims": {}, "x": ' + "[" * 500 + "]" * 500 + "}"),
    ],
)
def test_a_record_the_parser_does_not_expect_is_reported_and_survived(
    tmp: str, name: str, data: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        claims = survives(tmp, data.encode())
    path = os.path.join(tmp, prepared.RECORD_FILE)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert claims == {}, name
    assert len(errors) == 1 and errors[0].startswith(f"cannot read prepared claims from {path}: "), errors
    assert errors[0].endswith("treating it as empty") and "\n" not in errors[0] and len(errors[0]) < 400


@pytest.mark.parametrize(
    "when",
    [10**400, -(10**400), math.inf, math.nan, "yesterday", None, True],
    ids=["400 digits", "-400 digits", "inf", "nan", "text", "null", "true"],
)
def test_a_time_no_float_holds_is_read_as_no_time(tmp: str, when: Any) -> None:
    """preparedAt of 400 digits (float() raises OverflowError), or anything but a finite number:
    the claim stays, counted from this read like an entry that says no time."""
    claims = survives(tmp, json.dumps(put(valid_document(), ("claims", "u0", "preparedAt"), when)).encode())
    assert claims == {"u0": CLAIM}
    with open(os.path.join(tmp, prepared.RECORD_FILE)) as f:
        assert json.load(f)["claims"]["u0"]["preparedAt"] == 2000.0


def test_a_wrong_type_anywhere_in_the_record_is_survived(tmp: str) -> None:
    """Every place of a valid record (the document, each field, each list item) holding each kind
    of JSON value in turn: the record starts, reads and writes; a claim is read only when the
    value still fits (a newer release's field, a time read as no time)."""
    cases = 0
    for place in places(valid_document()):
        for value in WRONG_VALUES:
            for name in os.listdir(tmp):
                os.unlink(os.path.join(tmp, name))
            doc = put(valid_document(), place, value)
            claims = survives(tmp, json.dumps(doc).encode())
            assert set(claims) <= {"u0"}, (place, value)
            cases += 1
    count_inputs("prepared record", cases)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**500), max_value=10**500)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=fuzz_budget(300))
@given(
    place=st.integers(min_value=0),
    value=JSON_VALUES,
    depth=st.sampled_from([0, 0, 0, 3, 70, 2000]),
)
def test_any_json_at_any_place_of_the_record_is_survived(place: int, value: Any, depth: int) -> None:
    doc = valid_document()
    spots = list(places(doc))
    doc = put(doc, spots[place % len(spots)], "@here")
    # Nested in `depth` lists, spliced in as text: json.dumps itself cannot write the deepest.
    text = json.dumps(doc).replace('"@here"', "[" * depth + json.dumps(value) + "]" * depth, 1)
    tmp = tempfile.mkdtemp(prefix="hl-")
    try:
        assert set(survives(tmp, text.encode())) <= {"u0"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    count_inputs("prepared record")
