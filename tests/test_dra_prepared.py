"""The record of prepared claims: survives a restart, is shared by instances, never crashes on a
bad file and never replaces what is not ours."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from hyperlight_agent.dra import prepared
from hyperlight_agent.dra.prepared import Prepared, PreparedClaim, PreparedDevice, PreparedError

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
        tmp: str, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
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
    with pytest.raises(PreparedError, match=f"cannot write {path}"):
        asyncio.run(record.record("u1", CLAIM))
    assert os.path.islink(path)
    with open(target) as f:
        assert f.read() == "{}"


def test_encode_and_decode_round_trip() -> None:
    claims = {"u1": CLAIM, "u2": PreparedClaim("ns", "d", (PreparedDevice("r", "p", "d", (), None),))}
    assert prepared.decode(prepared.encode(claims)) == claims
    assert prepared.encode(claims) == prepared.encode(dict(reversed(list(claims.items()))))
