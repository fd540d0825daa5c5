"""Re-reading the settings (reload.py) from a real settings file in a temp dir: what changed is
applied and said, settings that change only on a restart are kept with a warning, an invalid file
is refused with the running settings kept, a reload asked for during a read gets one more read
after it (however many are asked), nothing starts after a stop and a read that ends after it
applies nothing; systemd hears RELOADING=1 first and READY=1 again whatever happens. (The agent
applying a reload to its parts: test_agent.py.)"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Optional

import pytest

from hyperlight_agent import config, waits
from hyperlight_agent.config import Settings
from hyperlight_agent.reload import Reloader
from tests.conftest import until
from tests.fakes import RecordingNotifier
from tests.test_config import load, write


class Node:
    """A settings file, the running settings read from it, and what the reloads applied."""

    def __init__(self, tmp: str, text: str) -> None:
        self.tmp = tmp
        self.path = write(tmp, text)
        self.running = self.read()
        self.applied: list[Settings] = []
        self.refusals = 0
        self.reads = 0
        self.gate: Optional[threading.Event] = None  # set: a read waits for it
        self.reading = threading.Event()  # a read began
        self.notifier = RecordingNotifier()
        self.notifier.ready()  # the unit is active: a reload must end with READY=1 again

    def read(self) -> Settings:
        return load(["--config", self.path], {})

    def reload_read(self) -> Settings:
        """The reloader's read (in its thread): counted; the file read, then held at the gate when
        there is one (a slow read)."""
        self.reads += 1
        settings = self.read()
        self.reading.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test opens the gate"
        return settings

    def apply(self, new: Settings) -> None:
        self.applied.append(new)
        self.running = new

    def refused(self) -> None:
        self.refusals += 1

    def reloader(self, read: bool = True) -> Reloader:
        return Reloader(
            self.reload_read if read else None, lambda: self.running, self.apply, self.notifier, self.refused
        )

    def rewrite(self, text: str) -> None:
        write(self.tmp, text)

    async def held_reload(self, text: str) -> Reloader:
        """A reloader whose reload has read `text` and is held at the gate (a slow read)."""
        self.gate = threading.Event()
        self.rewrite(text)
        reloader = self.reloader()
        reloader.request()
        await until(self.reading.is_set, timeout=10, what="the first read")
        return reloader

    def after_ready(self) -> list[tuple[str, ...]]:
        """The messages since READY=1 was first sent."""
        return self.notifier.messages[1:]


async def finished(reloader: Reloader) -> None:
    await until(lambda: not reloader.busy, timeout=10, what="the reload to end")


async def test_a_reload_applies_what_changed_says_it_and_keeps_restart_only_settings(
    tmp: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hyperlight_agent")
    node = Node(tmp, "device_count = 3\n")
    kubelet_dir = node.running.kubelet_dir
    node.rewrite(f'device_count = 5\ncheck_interval_seconds = 60\nkubelet_dir = "{os.path.join(tmp, "elsewhere")}"\n')
    reloader = node.reloader()
    reloader.request()
    assert reloader.busy
    await finished(reloader)
    [applied] = node.applied
    assert (applied.device_count, applied.check_interval_seconds, applied.kubelet_dir) == (5, 60.0, kubelet_dir)
    assert "reload: kubelet_dir change only on restart; kept" in caplog.text
    assert "reload: device_count 3 → 5; check_interval_seconds 30 → 60.0" in caplog.text
    messages = node.after_ready()
    assert messages[0] == ("RELOADING=1", "STATUS=reloading configuration")
    assert messages[-1][0] == "READY=1" and len(messages) == 2
    assert node.refusals == 0


async def test_an_unchanged_file_applies_the_same_settings_and_says_nothing_changed(
    tmp: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hyperlight_agent")
    node = Node(tmp, "device_count = 3\n")
    reloader = node.reloader()
    reloader.request()
    await finished(reloader)
    assert node.applied == [node.read()]
    assert "reload: no setting changed" in caplog.text


async def test_without_a_file_to_read_a_reload_applies_the_running_settings_again(tmp: str) -> None:
    node = Node(tmp, "device_count = 7\n")
    reloader = node.reloader(read=False)
    reloader.request()
    await finished(reloader)
    assert node.applied == [node.running] and node.applied[0].device_count == 7 and node.reads == 0


async def test_an_invalid_file_is_refused_and_the_running_settings_kept(
    tmp: str, caplog: pytest.LogCaptureFixture
) -> None:
    node = Node(tmp, "device_count = 3\n")
    node.rewrite('device_count = "x"\n')
    reloader = node.reloader()
    reloader.request()
    await finished(reloader)
    assert node.applied == [] and node.running.device_count == 3 and node.refusals == 1
    with pytest.raises(config.ConfigError) as refusal:
        node.read()
    assert f"reload failed, kept running configuration: {refusal.value}" in node.notifier.statuses
    assert "reload failed, keeping the running configuration" in caplog.text
    assert node.after_ready()[-1][0] == "READY=1", "systemd is never left in reloading"
    node.rewrite("device_count = 4\n")  # fixed: the next reload applies it
    reloader.request()
    await finished(reloader)
    assert [s.device_count for s in node.applied] == [4]


async def test_reloads_asked_for_during_a_read_get_one_more_read_after_it(tmp: str) -> None:
    node = Node(tmp, "device_count = 3\n")
    reloader = await node.held_reload("device_count = 4\n")
    node.rewrite("device_count = 2\n")  # changed while the first read waits
    for _ in range(3):
        reloader.request()
    assert node.gate is not None
    node.gate.set()
    await finished(reloader)
    assert node.reads == 2, "three requests during a read make one more read, not three"
    assert [s.device_count for s in node.applied] == [4, 2]
    reloading = [m for m in node.after_ready() if m[0] == "RELOADING=1"]
    assert len(reloading) == 1, "one RELOADING=1 for the reload that read twice"
    assert node.after_ready()[-1][0] == "READY=1"


async def test_no_reload_starts_after_a_stop_and_a_read_ending_after_it_applies_nothing(tmp: str) -> None:
    node = Node(tmp, "device_count = 3\n")
    reloader = await node.held_reload("device_count = 4\n")
    running = reloader.stop()
    assert running is not None
    reloader.request()  # refused: the agent is being taken down
    assert node.gate is not None
    node.gate.set()
    await waits.within(asyncio.shield(running), 10)
    assert node.applied == [] and node.reads == 1
    assert node.after_ready()[-1][0] == "READY=1"
    reloader.request()
    assert not reloader.busy and node.reads == 1
