"""Committing a file we own: never replacing anything that appeared or changed meanwhile, and
exact meaning bytes, mode and owner. Interleavings are forced, not hoped for."""

from __future__ import annotations

import os
import stat
from typing import Callable

import pytest

from hyperlight_agent import contracts
from hyperlight_agent.files import atomic, cdi

SPEC = cdi.Spec("kvm", "/dev/kvm", 65534, 65534)
WANTED = SPEC.wanted(None)


def plant_during_write(monkeypatch: pytest.MonkeyPatch, plant: Callable[[], None]) -> None:
    """Run plant() after our temp file is written and before it is committed."""
    real_fill = atomic._fill

    def fill_then_plant(fd: int, data: bytes) -> None:
        real_fill(fd, data)
        plant()

    monkeypatch.setattr(atomic, "_fill", fill_then_plant)


@pytest.mark.parametrize("obstruction", ["symlink", "directory", "regular file"])
def test_creating_a_missing_spec_never_replaces_what_appeared_meanwhile(
    tmp: str, monkeypatch: pytest.MonkeyPatch, obstruction: str
) -> None:
    path = cdi.spec_path(tmp)
    target = os.path.join(tmp, "sentinel.json")
    with open(target, "wb") as sentinel:
        sentinel.write(b"{}")

    def plant() -> None:
        if obstruction == "symlink":
            os.symlink(target, path)
        elif obstruction == "directory":
            os.mkdir(path)
        else:
            with open(path, "wb") as f:
                f.write(b"another writer")

    plant_during_write(monkeypatch, plant)
    with pytest.raises(cdi.CdiError, match="appeared while we were writing it"):
        cdi.reconcile(tmp, SPEC)
    st = os.lstat(path)
    assert {"symlink": stat.S_ISLNK, "directory": stat.S_ISDIR, "regular file": stat.S_ISREG}[obstruction](st.st_mode)
    if obstruction == "regular file":
        with open(path, "rb") as f:
            assert f.read() == b"another writer"
    assert sorted(os.listdir(tmp)) == ["hyperlight.json", "sentinel.json"], "no temp file left"


@pytest.mark.parametrize("obstruction", ["symlink", "directory"])
def test_replacing_a_drifted_spec_never_replaces_an_obstruction_planted_meanwhile(
    tmp: str, monkeypatch: pytest.MonkeyPatch, obstruction: str
) -> None:
    path = cdi.spec_path(tmp)
    with open(path, "wb") as f:
        f.write(b"{stale")

    def plant() -> None:
        os.unlink(path)
        if obstruction == "symlink":
            os.symlink("/etc/passwd", path)
        else:
            os.mkdir(path)

    plant_during_write(monkeypatch, plant)
    with pytest.raises(cdi.CdiError, match="changed while we were writing it"):
        cdi.reconcile(tmp, SPEC)
    if obstruction == "symlink":
        assert os.readlink(path) == "/etc/passwd", "the symlink is back in place, untouched"
    else:
        assert os.path.isdir(path) and not os.path.islink(path)
    assert os.listdir(tmp) == ["hyperlight.json"], "no temp file left"


def test_a_drifted_spec_replaced_by_another_regular_file_meanwhile_is_left_alone(
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = cdi.spec_path(tmp)
    with open(path, "wb") as f:
        f.write(b"{stale")

    def plant() -> None:
        with open(path + ".new", "wb") as f:
            f.write(b"their edit")
        os.rename(path + ".new", path)

    plant_during_write(monkeypatch, plant)
    with pytest.raises(cdi.CdiError, match="changed while we were writing it"):
        cdi.reconcile(tmp, SPEC)
    with open(path, "rb") as theirs:
        assert theirs.read() == b"their edit"
    monkeypatch.undo()
    assert cdi.reconcile(tmp, SPEC), "the next check repairs it"
    with open(path, "rb") as repaired:
        assert repaired.read() == WANTED


@pytest.mark.parametrize("drift", ["chmod 600", "chmod 666", pytest.param("chown 1234:1234", marks=pytest.mark.root)])
def test_mode_and_owner_are_part_of_exact(tmp: str, drift: str) -> None:
    path = cdi.spec_path(tmp)
    assert cdi.reconcile(tmp, SPEC)
    if drift.startswith("chmod"):
        os.chmod(path, int(drift.split()[1], 8))
    else:
        os.chown(path, 1234, 1234)
    problem = cdi.inspect(tmp, SPEC)
    assert problem is not None and "mode" in problem and "owner" in problem, problem
    assert cdi.reconcile(tmp, SPEC)
    st = os.stat(path)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (cdi.SPEC_MODE, os.geteuid(), os.getegid())
    assert cdi.inspect(tmp, SPEC) is None


def test_umask_does_not_decide_the_mode(tmp: str) -> None:
    old = os.umask(0o077)
    try:
        cdi.reconcile(tmp, SPEC)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(cdi.spec_path(tmp)).st_mode) == cdi.SPEC_MODE


def test_without_renameat2_flags_link_still_never_replaces(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Filesystems without RENAME_NOREPLACE: link(2) gives the same create-only-if-absent."""
    import errno

    def unsupported(src: str, dst: str, flags: int) -> None:
        raise OSError(errno.EINVAL, "not supported")

    real_fill = atomic._fill
    monkeypatch.setattr(atomic, "_rename2", unsupported)
    path = cdi.spec_path(tmp)
    plant_during_write(monkeypatch, lambda: os.symlink("/etc/passwd", path))
    with pytest.raises(cdi.CdiError, match="appeared"):
        cdi.reconcile(tmp, SPEC)
    assert os.readlink(path) == "/etc/passwd"
    os.unlink(path)
    monkeypatch.setattr(atomic, "_fill", real_fill)
    assert cdi.reconcile(tmp, SPEC)
    assert os.listdir(tmp) == [contracts.CDI_SPEC_FILE]
