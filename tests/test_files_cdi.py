"""The CDI spec we own: exact bytes, every kind of drift repaired atomically, everything that
is not ours left alone, and failures reported with the path and the cause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

import pytest

from hyperlight_agent import contracts
from hyperlight_agent.files import atomic, cdi
from tests.conftest import json_readers, read_bytes

SPEC = cdi.Spec("kvm", "/dev/kvm", 65534, 65534)
WANTED = SPEC.wanted(None)


def spec() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(WANTED)
    return loaded


def test_spec_content() -> None:
    s = spec()
    assert s["cdiVersion"] == "0.3.0"  # the minimum our content needs; podman 4.3 ignores 0.6.0
    assert s["kind"] == "hyperlight.dev/hypervisor"
    (device,) = s["devices"]
    assert device["name"] == "kvm"
    (node,) = device["containerEdits"]["deviceNodes"]
    assert node == {"path": "/dev/kvm", "type": "c", "permissions": "rw", "fileMode": 0o660, "uid": 65534, "gid": 65534}
    assert device["containerEdits"]["env"] == ["HYPERLIGHT_HYPERVISOR=kvm", "HYPERLIGHT_DEVICE_PATH=/dev/kvm"]
    assert set(device["containerEdits"]) == {"env", "deviceNodes"}


def test_spec_bytes_are_canonical() -> None:
    assert cdi.render("kvm", "/dev/kvm", 65534, 65534) == WANTED
    assert WANTED.endswith(b"}\n")
    assert cdi.render("mshv", "/dev/mshv", 1, 2) != WANTED
    assert cdi.device_name("mshv") == "hyperlight.dev/hypervisor=mshv"


def test_devices_the_spec_lists_are_kept_and_nothing_else() -> None:
    both = cdi.Spec("kvm", "/dev/kvm", 65534, 65534, others=(("kvm", "/dev/kvm"), ("mshv", "/dev/mshv")))
    assert both.wanted(None) == WANTED
    assert both.wanted(cdi.render("mshv", "/dev/mshv", 1, 1)) == cdi.render(
        "kvm", "/dev/kvm", 65534, 65534, kept=[("mshv", "/dev/mshv")]
    )
    # A name no row of ours has is never carried over, nor is a name from a file too big to be ours.
    assert both.wanted(cdi.render("gpu", "/dev/gpu", 1, 1)) == WANTED
    huge = cdi.render("mshv", "/dev/mshv", 1, 1)[:-2] + b" " * cdi.MAX_SPEC_BYTES + b"}\n"
    assert cdi.listed_devices(huge) == set() and both.wanted(huge) == WANTED
    assert cdi.listed_devices(b'{"kind": "other/kind", "devices": [{"name": "mshv"}]}') == set()


def test_a_check_reads_the_spec_once(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The names to keep and the comparison come from the same read: a spec changing between two
    reads could otherwise be compared against bytes derived from its predecessor."""
    with open(cdi.spec_path(tmp), "wb") as f:
        f.write(cdi.render("mshv", "/dev/mshv", 1, 1))
    reads: list[str] = []
    real = atomic.read_regular

    def counted(path: str, limit: int) -> Any:
        reads.append(path)
        return real(path, limit)

    monkeypatch.setattr(atomic, "read_regular", counted)
    both = cdi.Spec("kvm", "/dev/kvm", 65534, 65534, others=(("mshv", "/dev/mshv"),))
    assert cdi.reconcile(tmp, both) and reads == [cdi.spec_path(tmp)]
    assert cdi.inspect(tmp, both) is None and len(reads) == 2
    assert cdi.listed_devices(read_bytes(cdi.spec_path(tmp)) or b"") == {"kvm", "mshv"}


def _edit(change: Callable[[dict[str, Any]], None]) -> bytes:
    s = spec()
    change(s)
    return json.dumps(s, indent=2).encode()


DRIFT = {
    "missing": None,
    "empty": b"",
    "malformed": b'{"cdiVersion": "0.3.0", "kind": ',
    "not json at all": b"\x00\xff garbage",
    "reformatted": json.dumps(spec()).encode(),
    "newer version": _edit(lambda s: s.update(cdiVersion="0.6.0")),
    "wrong kind": _edit(lambda s: s.update(kind="example.com/other")),
    "wrong name": _edit(lambda s: s["devices"][0].update(name="mshv")),
    "wrong path": _edit(lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(path="/dev/x")),
    "wrong uid": _edit(lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(uid=0)),
    "wrong gid": _edit(lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(gid=0)),
    "wrong mode": _edit(lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(fileMode=0o666)),
    "no mode": _edit(lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].pop("fileMode")),
    "wrong permissions": _edit(lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(permissions="rwm")),
    "wrong env": _edit(lambda s: s["devices"][0]["containerEdits"].update(env=["HYPERLIGHT_HYPERVISOR=mshv"])),
    "extra edits": _edit(
        lambda s: s["devices"][0]["containerEdits"].update(mounts=[{"hostPath": "/", "containerPath": "/host"}])
    ),
    "extra device": _edit(lambda s: s["devices"].append({"name": "extra", "containerEdits": {"env": ["A=b"]}})),
}


@pytest.mark.parametrize("case", list(DRIFT))
def test_drift_is_repaired_exactly(tmp: str, case: str) -> None:
    path = cdi.spec_path(tmp)
    content = DRIFT[case]
    if content is not None:
        with open(path, "wb") as f:
            f.write(content)
    assert cdi.inspect(tmp, SPEC) is not None
    assert cdi.reconcile(tmp, SPEC) is True
    with open(path, "rb") as f:
        assert f.read() == WANTED
    assert oct(os.stat(path).st_mode & 0o777) == oct(cdi.SPEC_MODE)
    assert cdi.inspect(tmp, SPEC) is None
    assert cdi.reconcile(tmp, SPEC) is False  # exact: nothing written
    assert os.listdir(tmp) == [contracts.CDI_SPEC_FILE], "no temp file may be left"


def test_exact_spec_is_not_rewritten(tmp: str) -> None:
    cdi.reconcile(tmp, SPEC)
    before = os.stat(cdi.spec_path(tmp))
    assert cdi.reconcile(tmp, SPEC) is False
    after = os.stat(cdi.spec_path(tmp))
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_missing_directory_is_created(tmp: str) -> None:
    cdi_dir = os.path.join(tmp, "var", "run", "cdi")
    assert cdi.reconcile(cdi_dir, SPEC)
    assert os.path.isfile(cdi.spec_path(cdi_dir))


def test_symlink_at_our_path_is_refused_not_followed(tmp: str) -> None:
    target = os.path.join(tmp, "elsewhere.json")
    with open(target, "wb") as f:
        f.write(b"theirs")
    os.symlink(target, cdi.spec_path(tmp))
    with pytest.raises(cdi.CdiError, match=r"hyperlight.json is a symlink; refusing"):
        cdi.reconcile(tmp, SPEC)
    assert os.path.islink(cdi.spec_path(tmp))
    with open(target, "rb") as f:
        assert f.read() == b"theirs"
    with pytest.raises(cdi.CdiError, match=r"hyperlight.json is a symlink; refusing"):
        cdi.inspect(tmp, SPEC)  # `--check` fails where the agent does (issue 47, 4)


def test_a_symlink_at_the_cdi_dir_is_refused_not_followed(tmp: str) -> None:
    """One rule for the directory as for the spec: a symlink is refused, never followed (issue 19,
    item 5). Symlinks above it (/var/run → /run) are the system's layout and stay fine."""
    elsewhere = os.path.join(tmp, "elsewhere")
    os.mkdir(elsewhere)
    os.symlink(elsewhere, os.path.join(tmp, "cdi"))
    cdi_dir = os.path.join(tmp, "cdi")
    with pytest.raises(cdi.CdiError, match=r"cdi \(cdi_dir\) is a symlink; refusing to follow it"):
        cdi.reconcile(cdi_dir, SPEC)
    assert os.listdir(elsewhere) == []
    with pytest.raises(cdi.CdiError, match=r"cdi \(cdi_dir\) is a symlink; refusing to follow it"):
        cdi.inspect(cdi_dir, SPEC)
    os.symlink(tmp, os.path.join(tmp, "run"))
    assert cdi.reconcile(os.path.join(tmp, "run", "real"), SPEC)


def test_dangling_symlink_is_refused(tmp: str) -> None:
    os.symlink("/nonexistent/spec.json", cdi.spec_path(tmp))
    with pytest.raises(cdi.CdiError, match="symlink"):
        cdi.reconcile(tmp, SPEC)
    assert os.path.islink(cdi.spec_path(tmp))


def test_directory_at_our_path_is_refused_not_deleted(tmp: str) -> None:
    os.mkdir(cdi.spec_path(tmp))
    with open(os.path.join(cdi.spec_path(tmp), "inside"), "w") as f:
        f.write("x")
    with pytest.raises(cdi.CdiError, match="is a directory; refusing"):
        cdi.reconcile(tmp, SPEC)
    assert os.path.isfile(os.path.join(cdi.spec_path(tmp), "inside"))


def test_fifo_at_our_path_is_refused_without_hanging(tmp: str) -> None:
    os.mkfifo(cdi.spec_path(tmp))
    with pytest.raises(cdi.CdiError, match="not a regular file"):
        cdi.reconcile(tmp, SPEC)


def test_unrelated_files_are_untouched_and_only_our_abandoned_temps_removed(tmp: str) -> None:
    others = {
        "other-vendor.json": b'{"cdiVersion":"0.5.0"}',
        "hyperlight.yaml": b"not ours",
        "hyperlight.json.bak": b"someone's backup",
        "notes.txt": b"keep",
        # Temp-looking names that are not of our pattern: someone else's.
        f"{contracts.CDI_TEMP_PREFIX}deadbeef{contracts.CDI_TEMP_SUFFIX}": b"{theirs",
        f"{contracts.CDI_TEMP_PREFIX}hlagent-1-xyz{contracts.CDI_TEMP_SUFFIX}": b"{theirs",
    }
    ours = f"{contracts.CDI_TEMP_PREFIX}hlagent-4242-0123456789ab{contracts.CDI_TEMP_SUFFIX}"
    young = f"{contracts.CDI_TEMP_PREFIX}hlagent-4243-0123456789ab{contracts.CDI_TEMP_SUFFIX}"
    for name, data in {**others, ours: b"{half", young: b"{in progress"}.items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
    old = time.time() - atomic.ABANDONED_AFTER_S - 1
    for name in [*others, ours]:
        os.utime(os.path.join(tmp, name), (old, old))
    before = {n: os.stat(os.path.join(tmp, n)) for n in others}
    cdi.reconcile(tmp, SPEC)
    assert not os.path.exists(os.path.join(tmp, ours)), "an abandoned temp file of ours is removed"
    assert os.path.exists(os.path.join(tmp, young)), "a write in progress (young) is left alone"
    for name, data in others.items():
        path = os.path.join(tmp, name)
        with open(path, "rb") as f:
            assert f.read() == data
        assert os.stat(path).st_mtime_ns == before[name].st_mtime_ns


def test_temp_files_are_invisible_to_cdi_runtimes(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real_fill = atomic._fill

    def spy(fd: int, data: bytes) -> None:
        seen.extend(n for n in os.listdir(tmp) if n != contracts.CDI_SPEC_FILE)
        real_fill(fd, data)

    monkeypatch.setattr(atomic, "_fill", spy)
    assert cdi.reconcile(tmp, SPEC)
    (temp,) = seen
    assert temp.startswith(".") and not temp.endswith((".json", ".yaml")), temp
    assert os.listdir(tmp) == [contracts.CDI_SPEC_FILE]


RO_SCRIPT = """
import sys
from hyperlight_agent.files import cdi
try:
    cdi.reconcile(sys.argv[1], cdi.Spec("kvm", "/dev/kvm", 65534, 65534))
except cdi.CdiError as exc:
    print(exc)
    sys.exit(3)
"""


def run_read_only(cdi_dir: str) -> subprocess.CompletedProcess[str]:
    """Reconcile inside a private mount namespace where cdi_dir is a read-only bind mount."""
    shell = f'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && exec "{sys.executable}" -c "$2" "$1"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, "sh", cdi_dir, RO_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


@pytest.mark.root
def test_read_only_directory_fails_clearly_then_recovers(tmp: str) -> None:
    """As root, permissions don't stop us: a read-only mount does. No skipping for root."""
    result = run_read_only(tmp)
    assert result.returncode == 3, result.stderr
    assert "hyperlight.json: cannot write" in result.stdout
    assert "Read-only file system" in result.stdout
    assert os.listdir(tmp) == []
    # Outside that namespace the directory is writable again: the next repair succeeds.
    assert cdi.reconcile(tmp, SPEC)


@pytest.mark.root
def test_read_only_directory_with_exact_spec_is_fine(tmp: str) -> None:
    cdi.reconcile(tmp, SPEC)
    result = run_read_only(tmp)
    assert result.returncode == 0, result.stdout + result.stderr


def test_concurrent_readers_never_see_a_partial_file(tmp: str) -> None:
    cdi_dir = os.path.join(tmp, "cdi")
    cdi.reconcile(cdi_dir, SPEC)
    stop = os.path.join(tmp, "stop")
    readers = json_readers(cdi.spec_path(cdi_dir), stop)
    other = cdi.Spec("kvm", "/dev/kvm", 1000, 1000)
    try:
        for i in range(1000):
            # Alternate two complete specs; every reconcile replaces the file atomically.
            assert cdi.reconcile(cdi_dir, other if i % 2 == 0 else SPEC)
    finally:
        open(stop, "w").close()
    total_reads = total_bad = 0
    for reader in readers:
        out, _ = reader.communicate(timeout=30)
        reads, bad = map(int, out.split())
        total_reads += reads
        total_bad += bad
    print(f"concurrent reads during 1000 repairs: {total_reads}, partial or unparsable: {total_bad}")
    assert total_reads > 0
    assert total_bad == 0
