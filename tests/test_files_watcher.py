"""inotify turned into wake-ups, in-process: the names asked for, the directory itself coming
and going, a filesystem mounted over it (seen through the mount table), and no timer while
everything is watched."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
from asyncinotify import Mask

from hyperlight_agent.files import watcher
from tests.conftest import until


def test_only_the_names_asked_for_wake_us(tmp: str) -> None:
    seen: list[str] = []
    w = watcher.DirectoryWatcher()
    w.watch(tmp, seen.append, {"kubelet.sock", "hyperlight.sock"})

    async def run() -> None:
        task = asyncio.ensure_future(w.run())
        await until(lambda: seen == [""])  # watching: "anything may have happened"
        open(os.path.join(tmp, "other.sock"), "w").close()
        open(os.path.join(tmp, "kubelet.sock"), "w").close()
        os.unlink(os.path.join(tmp, "kubelet.sock"))
        await until(lambda: seen.count("kubelet.sock") == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert "other.sock" not in seen, "events arrive in order: the other name came first and was not passed on"


async def test_a_directory_that_goes_and_comes_back_is_watched_again(tmp: str) -> None:
    directory = os.path.join(tmp, "cdi")
    seen: list[str] = []
    w = watcher.DirectoryWatcher()
    w.watch(directory, seen.append)

    task = asyncio.ensure_future(w.run())
    await asyncio.sleep(0)
    assert seen == [], "no directory yet: nothing to say"
    os.mkdir(directory)
    await until(lambda: "" in seen)  # found within the retry interval
    shutil.rmtree(directory)
    await until(lambda: seen.count("") >= 2)  # gone: the kernel says so
    os.mkdir(directory)
    count = len(seen)
    await until(lambda: len(seen) > count)  # back: watched anew
    open(os.path.join(directory, "hyperlight.json"), "w").close()
    await until(lambda: "hyperlight.json" in seen)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_a_cancel_with_an_event_pending_leaves_no_callback_behind(tmp: str) -> None:
    """A SIGTERM early in startup cancelled the watcher while inotify had an event ready: the
    read callback then ran on the closed inotify and asyncio logged a traceback (issue 19,
    item 8)."""
    errors: list[dict[str, object]] = []
    w = watcher.DirectoryWatcher()
    seen: list[str] = []
    w.watch(tmp, seen.append)

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        task = asyncio.ensure_future(w.run())
        await until(lambda: seen == [""])
        open(os.path.join(tmp, "new"), "w").close()  # an event is queued now...
        task.cancel()  # ...and the watcher is told to stop before it reads it
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert errors == []


def test_no_timer_runs_while_every_directory_is_watched(tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle means asleep: with the mount table polled and every directory watched, nothing looks
    at the directories on a timer (it once did every second)."""
    monkeypatch.setattr(watcher, "RETRY_S", 0.001)
    looks: list[int] = []
    moved = watcher.DirectoryWatcher._moved

    def counted(self: watcher.DirectoryWatcher, watching: dict[str, Any]) -> list[str]:
        looks.append(len(watching))
        return moved(self, watching)

    monkeypatch.setattr(watcher.DirectoryWatcher, "_moved", counted)
    seen: list[str] = []
    w = watcher.DirectoryWatcher()
    w.watch(tmp, seen.append)

    async def run() -> None:
        task = asyncio.ensure_future(w.run())
        await until(lambda: seen == [""])
        assert w.watching(tmp)
        # Twenty events, each awaited: far longer than many timer periods of 1 ms.
        for i in range(20):
            open(os.path.join(tmp, f"f{i}"), "w").close()
            await until(lambda i=i: f"f{i}" in seen)  # type: ignore[misc]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not w.watching(tmp), "a stopped watcher watches nothing"

    asyncio.run(run())
    assert looks == [0], "one look at the start (nothing watched yet), none after"


def test_without_the_mount_table_the_directories_are_looked_at_every_second(
    tmp: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where /proc/self/mountinfo cannot be polled (here: a regular file, which epoll refuses),
    the watcher says so once and falls back to comparing each directory on a timer. A symlink
    retargeted raises no event in the directory we watch through it: only that look sees it."""
    plain = os.path.join(tmp, "mountinfo")
    open(plain, "w").close()
    monkeypatch.setattr(watcher, "MOUNTINFO", plain)
    monkeypatch.setattr(watcher, "RETRY_S", 0.01)
    for name in ("a", "b"):
        os.mkdir(os.path.join(tmp, name))
    link = os.path.join(tmp, "link")
    os.symlink("a", link)
    seen: list[str] = []
    w = watcher.DirectoryWatcher()
    w.watch(link, seen.append)

    async def run() -> None:
        task = asyncio.ensure_future(w.run())
        await until(lambda: seen == [""])
        os.symlink("b", link + ".new")
        os.rename(link + ".new", link)
        await until(lambda: seen.count("") == 2)  # watched anew, and said so
        open(os.path.join(tmp, "b", "spec"), "w").close()
        await until(lambda: "spec" in seen)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger=watcher.__name__):
        asyncio.run(run())
    said = [r.getMessage() for r in caplog.records if "mount changes" in r.getMessage()]
    assert len(said) == 1 and "every 0.01 s" in said[0], said
    assert any("another directory now" in r.getMessage() for r in caplog.records)


# Run in a private mount namespace (unshare): a watcher on `directory` with a timer that never
# fires, a tmpfs mounted over it, then a file created in the tmpfs. Prints what the callback saw.
# The start of both scripts: a watcher whose timer never fires (only the mount table can tell
# it anything), what its callback saw, and a wait on a condition with a deadline.
IN_PRIVATE_MOUNTS = """
import asyncio, os, subprocess, sys
from hyperlight_agent.files import watcher
watcher.RETRY_S = 3600.0
directory = sys.argv[1]
seen = []
async def until(condition):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not condition():
        assert loop.time() < deadline, seen
        await asyncio.sleep(0.005)
"""
MOUNT_OVER = (
    IN_PRIVATE_MOUNTS
    + """
async def main():
    w = watcher.DirectoryWatcher()
    w.watch(directory, seen.append)
    task = asyncio.ensure_future(w.run())
    await until(lambda: seen == [""])
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", directory], check=True)
    await until(lambda: seen == ["", ""])
    open(os.path.join(directory, "on-tmpfs"), "w").close()
    await until(lambda: "on-tmpfs" in seen)
    subprocess.run(["umount", directory], check=True)
    await until(lambda: seen.count("") >= 3)  # the original directory is watched again
    open(os.path.join(directory, "underneath"), "w").close()
    await until(lambda: "underneath" in seen)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
asyncio.run(main())
print(seen)
"""
)


@pytest.mark.root
def test_a_filesystem_mounted_over_a_directory_is_seen_through_the_mount_table(tmp: str) -> None:
    """A mount over a watched directory raises no inotify event, and the timer here never fires:
    the mount table's change is what makes the watcher watch the new filesystem (and the old
    directory again after the unmount)."""
    directory = os.path.join(tmp, "cdi")
    os.mkdir(directory)
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", MOUNT_OVER, directory],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "on-tmpfs" in done.stdout and "underneath" in done.stdout
    assert os.listdir(directory) == ["underneath"], "the tmpfs and its file stayed in the private namespace"


# Run in a private mount namespace: /dev/null bound over an entry of a watched directory, then
# unbound. Neither raises an inotify event; the mount table's change names the entry.
MOUNT_ON_ENTRY = (
    IN_PRIVATE_MOUNTS
    + """
async def main():
    w = watcher.DirectoryWatcher()
    w.watch(directory, seen.append, {"kvm"})
    task = asyncio.ensure_future(w.run())
    await until(lambda: seen == [""])
    subprocess.run(["mount", "--bind", "/dev/null", os.path.join(directory, "kvm")], check=True)
    await until(lambda: seen == ["", "kvm"])
    subprocess.run(["mount", "--bind", "/dev/null", os.path.join(directory, "other")], check=True)
    subprocess.run(["umount", os.path.join(directory, "kvm")], check=True)
    await until(lambda: seen == ["", "kvm", "kvm"])
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
asyncio.run(main())
print(seen)
"""
)


@pytest.mark.root
def test_a_mount_over_an_entry_is_a_change_of_that_entry(tmp: str) -> None:
    """/dev/null bound over /dev/kvm changes what the device node is without any inotify event:
    the mount table's change is reported for that entry (and only the names asked for)."""
    directory = os.path.join(tmp, "dev")
    os.mkdir(directory)
    for name in ("kvm", "other"):
        open(os.path.join(directory, name), "w").close()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", MOUNT_ON_ENTRY, directory],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['', 'kvm', 'kvm']"


async def test_a_lost_watch_or_lost_events_call_every_callback_at_once(tmp: str) -> None:
    """What lets the registrar wait with no timer while a directory is watched: when a watch
    ends, its callbacks are called with "" and watching() already says False; when the kernel
    dropped events (queue overflow), every watched directory's callbacks are called with ""."""
    directory = os.path.join(tmp, "kubelet")
    os.mkdir(directory)
    seen: list[tuple[str, bool]] = []
    others: list[str] = []
    w = watcher.DirectoryWatcher()
    w.watch(directory, lambda name: seen.append((name, w.watching(directory))))
    w.watch(tmp, others.append, {"nothing-by-this-name"})

    task = asyncio.ensure_future(w.run())
    await until(lambda: seen == [("", True)] and others == [""])
    overflow = type("Event", (), {"mask": Mask.Q_OVERFLOW, "watch": None, "name": None})()
    w._handle(overflow, set())
    assert seen[-1] == ("", True) and others == ["", ""]
    os.rename(directory, directory + ".old")
    await until(lambda: ("", False) in seen)
    assert not w.watching(directory)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# Run in a private mount namespace: a storm of mounts and unmounts outside every watched directory
# (pod volumes on a busy node) while the table holds a few hundred mounts, then a change that
# matters. The table is read at most every MOUNT_INTERVAL_S, and the change is still seen.
MOUNT_STORM = (
    IN_PRIVATE_MOUNTS
    + """
import ctypes, threading, time
libc = ctypes.CDLL(None, use_errno=True)
outside = os.path.join(os.path.dirname(directory), "volumes")
os.makedirs(os.path.join(outside, "storm"))
for i in range(300):
    os.makedirs(os.path.join(outside, str(i)))
    assert libc.mount(b"tmpfs", os.path.join(outside, str(i)).encode(), b"tmpfs", 0, None) == 0
reads = []
read = watcher._read_mount_points
watcher._read_mount_points = lambda within: reads.append(1) or read(within)
def storm(pairs):
    target = os.path.join(outside, "storm").encode()
    for _ in range(pairs):
        assert libc.mount(b"tmpfs", target, b"tmpfs", 0, None) == 0
        assert libc.umount2(target, 0) == 0
async def main():
    w = watcher.DirectoryWatcher()
    w.watch(directory, seen.append, {"kvm"})
    task = asyncio.ensure_future(w.run())
    await until(lambda: seen == [""])
    before = len(reads)
    started = time.monotonic()
    await asyncio.get_running_loop().run_in_executor(None, storm, 1000)
    lasted = time.monotonic() - started
    storm_reads = len(reads) - before
    subprocess.run(["mount", "--bind", "/dev/null", os.path.join(directory, "kvm")], check=True)
    await until(lambda: seen == ["", "kvm"])
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    print(storm_reads, lasted, watcher.MOUNT_INTERVAL_S)
asyncio.run(main())
"""
)


@pytest.mark.root
def test_a_mount_storm_elsewhere_costs_a_bounded_number_of_reads(tmp: str) -> None:
    """2000 mount changes outside every watched directory: the table is read at most once per
    MOUNT_INTERVAL_S (plus the first at once), not once per change; a mount over a watched entry
    afterwards is still reported."""
    directory = os.path.join(tmp, "dev")
    os.mkdir(directory)
    open(os.path.join(directory, "kvm"), "w").close()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", MOUNT_STORM, directory],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    reads, lasted, interval = done.stdout.split()
    assert int(reads) <= float(lasted) / float(interval) + 2, (reads, lasted)
