"""Node labels through an NFD local feature file: content, atomic replacement, removal."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys

import pytest

from hyperlight_agent.files import atomic, labels
from hyperlight_agent.files.watcher import DirectoryWatcher
from standin.kubelet import StandinThread
from tests.conftest import StartAgent, exchange, make_node, until, wait_for
from tests.conftest import read_bytes as read


def test_content_is_nfd_name_value_lines() -> None:
    assert labels.render("mshv") == b"hyperlight.dev/enabled=true\nhyperlight.dev/hypervisor=mshv\n"


def test_sync_writes_replaces_and_removes(tmp: str) -> None:
    features = os.path.join(tmp, "features.d")
    path = os.path.join(features, labels.FEATURE_FILE)
    assert labels.sync(features, "kvm")
    assert read(path) == labels.render("kvm")
    inode = os.stat(path).st_ino
    assert not labels.sync(features, "kvm")  # unchanged: not rewritten
    assert os.stat(path).st_ino == inode
    with open(os.path.join(features, "other-vendor"), "w") as f:
        f.write("x=y\n")
    assert labels.sync(features, "mshv")
    assert read(path) == labels.render("mshv")
    assert os.stat(path).st_ino != inode, "replaced by rename, not rewritten in place"
    assert labels.sync(features, None)
    assert read(path) is None
    assert sorted(os.listdir(features)) == ["other-vendor"]


def test_something_else_at_our_path_is_refused_never_replaced(tmp: str) -> None:
    features = os.path.join(tmp, "features.d")
    os.mkdir(features)
    path = os.path.join(features, labels.FEATURE_FILE)
    target = os.path.join(tmp, "theirs")
    with open(target, "w") as f:
        f.write("keep")
    os.symlink(target, path)
    with pytest.raises(atomic.Refused, match="is a symlink"):
        labels.sync(features, "kvm")
    with pytest.raises(atomic.Refused, match="is a symlink"):
        labels.sync(features, None)
    assert os.path.islink(path) and read(target) == b"keep"
    os.unlink(path)
    os.mkfifo(path)  # would block a plain open() forever
    with pytest.raises(atomic.Refused, match="not a regular file"):
        labels.sync(features, "kvm")


def test_readers_never_see_a_partial_file(tmp: str) -> None:
    features = os.path.join(tmp, "features.d")
    labels.sync(features, "kvm")
    path = os.path.join(features, labels.FEATURE_FILE)
    stop = os.path.join(tmp, "stop")
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import os, sys\nbad = reads = 0\n"
                "while not os.path.exists(sys.argv[2]):\n"
                "    data = open(sys.argv[1], 'rb').read()\n    reads += 1\n"
                "    bad += data not in (b'hyperlight.dev/enabled=true\\nhyperlight.dev/hypervisor=kvm\\n',"
                " b'hyperlight.dev/enabled=true\\nhyperlight.dev/hypervisor=mshv\\n')\n"
                "    if reads == 1:\n        print('reading', flush=True)\n"
                "print(reads, bad)\n"
            ),
            path,
            stop,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None and reader.stdout.readline() == "reading\n", "the reader started"
    for i in range(300):
        labels.sync(features, "mshv" if i % 2 == 0 else "kvm")
    open(stop, "w").close()
    reads, bad = map(int, reader.communicate(timeout=30)[0].split())
    assert reads > 0 and bad == 0


def test_agent_labels_follow_the_device(kubelet: StandinThread, start_agent: StartAgent, tmp: str) -> None:
    device_dir = os.path.join(tmp, "dev")
    os.mkdir(device_dir)
    features = os.path.join(tmp, "features.d")
    path = os.path.join(features, labels.FEATURE_FILE)
    start_agent("--device-count", "1", "--device-dir", device_dir, "--nfd-features-dir", features)
    kubelet.wait_until(lambda k: k.plugins.get("hyperlight.dev/hypervisor"), 15)
    make_node(os.path.join(device_dir, "kvm"), 10, 232)
    kubelet.wait_until(lambda k: k.allocatable() == 1, 10)
    wait_for(lambda: read(path) == labels.render("kvm"), 5, "labels for kvm")
    os.unlink(os.path.join(device_dir, "kvm"))
    wait_for(lambda: read(path) is None, 5, "labels removed with the device")


def test_agent_repairs_the_feature_file_like_the_spec(
    kubelet: StandinThread, start_agent: StartAgent, tmp: str
) -> None:
    """Deleted, edited or chmod-ed, the feature file is put right at once (no device check is
    due for an hour); something else at its path is left alone (issue 19, item 10)."""
    features = os.path.join(tmp, "features.d")
    path = os.path.join(features, labels.FEATURE_FILE)
    agent = start_agent("--device-count", "1", "--nfd-features-dir", features, "--check-interval", "3600")
    kubelet.wait_until(lambda k: k.allocatable() == 1, 15)
    wait_for(lambda: read(path) == labels.render("kvm"), 5, "labels for kvm")
    os.unlink(path)
    wait_for(lambda: read(path) == labels.render("kvm"), 5, "the deleted file written again")
    with open(path, "wb") as f:
        f.write(b"hyperlight.dev/enabled=false\n")
    wait_for(lambda: read(path) == labels.render("kvm"), 5, "the edited file repaired")
    os.chmod(path, 0o600)
    wait_for(lambda: stat.S_IMODE(os.stat(path).st_mode) == labels.FILE_MODE, 5, "the mode repaired")
    # A directory takes the file's place in one step (unlink then mkdir would race the agent's
    # repair of the missing file): not ours, so refused and never removed.
    obstacle = os.path.join(tmp, "obstacle")
    os.mkdir(obstacle)
    exchange(obstacle, path)
    wait_for(lambda: "node labels not written" in agent.log, 5)
    assert os.path.isdir(path)
    assert agent.stop() == 0
    said = [line.split(": ", 1)[1] for line in agent.log.splitlines() if "node labels not written" in line]
    assert len(said) == 1, said


async def test_the_keeper_repairs_the_file_it_watches_only_between_its_first_sync_and_close(tmp: str) -> None:
    """Before a check has said which hypervisor there is, a change to the file is no reason to
    write it (nothing to say yet); after close (the agent stops), the file stays as it is."""
    features = os.path.join(tmp, "features.d")
    os.mkdir(features)
    path = os.path.join(features, labels.FEATURE_FILE)
    keeper, watcher = labels.Keeper(features), DirectoryWatcher()
    keeper.watch(watcher)
    seen: list[str] = []
    watcher.watch(features, seen.append, {"marker"})  # the same directory's later events, in order
    watching = asyncio.ensure_future(watcher.run())

    async def settled() -> None:
        """Every event before now handled: a marker made after them has been seen."""
        seen.clear()
        marker = os.path.join(features, "marker")
        with open(marker, "w"):
            pass
        os.unlink(marker)
        await until(lambda: "marker" in seen, what="the marker's event")

    try:
        await until(lambda: watcher.watching(features), what="the feature file's watch")
        with open(path, "wb") as f:
            f.write(b"someone=else\n")
        await settled()
        assert read(path) == b"someone=else\n"
        keeper.sync("kvm")  # the first check's word: the file is put right now, and from now on
        assert read(path) == labels.render("kvm")
        os.unlink(path)
        await until(lambda: read(path) == labels.render("kvm"), what="the deleted file written again")
        keeper.close()
        os.unlink(path)
        with open(path, "wb") as f:
            f.write(b"after=close\n")
        await settled()
        assert read(path) == b"after=close\n"
    finally:
        watching.cancel()
