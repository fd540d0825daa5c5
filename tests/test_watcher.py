"""inotify turned into wake-ups, in-process: the names asked for, the directory itself coming
and going, and nothing else."""

from __future__ import annotations

import asyncio
import os
import shutil

from hyperlight_agent.node import watcher
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


def test_a_directory_that_goes_and_comes_back_is_watched_again(tmp: str) -> None:
    directory = os.path.join(tmp, "cdi")
    seen: list[str] = []
    w = watcher.DirectoryWatcher()
    w.watch(directory, seen.append)

    async def run() -> None:
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

    asyncio.run(run())


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
