"""The record of prepared claims: survives a restart, is shared by instances, never crashes on a
bad file and never replaces what is not ours."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import pytest

from hyperlight_agent.dra import prepared, prepared_format
from hyperlight_agent.dra.prepared import Prepared, PreparedError
from hyperlight_agent.dra.prepared_format import PreparedClaim, PreparedDevice

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
