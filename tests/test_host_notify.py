"""sd_notify (host/notify.py) against a real datagram socket standing for systemd's: the in-place
upgrade's hand-off is the one message that must arrive, and says so when it cannot (issue 35, 3);
READY=1 is only ever said for an agent that is ready (issue 35, 5)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Iterator

import pytest

from hyperlight_agent import __version__, config, contracts
from hyperlight_agent.device.observation import Observation
from hyperlight_agent.deviceplugin.registration_state import State
from hyperlight_agent.deviceplugin.side import DevicePluginSnapshot
from hyperlight_agent.host.notify import Notifier
from tests.test_docs import read


class Systemd:
    """A notify socket that keeps what it receives until read; `stalled` fills its queue."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)

    def received(self) -> list[list[str]]:
        messages = []
        while True:
            try:
                messages.append(self.sock.recv(65536).decode().split("\n"))
            except BlockingIOError:
                return messages

    def stalled(self) -> None:
        """Its queue full: a reader that stopped reading (a busy or stuck PID 1)."""
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        filler.connect(self.path)
        filler.setblocking(False)
        try:
            while True:
                filler.send(b"STATUS=filler")
        except BlockingIOError:
            pass
        finally:
            filler.close()


MADE: list[Notifier] = []


@pytest.fixture
def systemd(tmp: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Systemd]:
    path = os.path.join(tmp, "notify")
    listener = Systemd(path)
    monkeypatch.setenv(contracts.NOTIFY_SOCKET_ENV, path)  # sdnotify reads the process environment
    try:
        yield listener
    finally:
        while MADE:
            MADE.pop().close()
        listener.sock.close()


def notifier(path: str, **environ: str) -> Notifier:
    MADE.append(Notifier({contracts.NOTIFY_SOCKET_ENV: path, **environ}))
    return MADE[-1]


async def test_the_hand_off_of_an_active_unit_ends_the_reload_with_ready(systemd: Systemd) -> None:
    n = notifier(systemd.path)
    n.ready()
    assert await n.hand_off(42, "handed over") is None
    assert systemd.received()[-1] == ["READY=1", "STATUS=handed over", "MAINPID=42"]
    n.status("anything")
    assert systemd.received() == [], "nothing is said after the hand-off"


async def test_the_hand_off_of_an_activating_unit_says_no_ready(systemd: Systemd) -> None:
    """Issue 35, 5: neither agent is ready; READY=1 is the new one's to say once it is."""
    n = notifier(systemd.path)
    n.status("unhealthy: no hypervisor device")
    assert await n.hand_off(42, "handed over") is None
    assert systemd.received()[-1] == ["STATUS=handed over", "MAINPID=42"]


async def test_a_hand_off_systemd_cannot_take_is_a_failed_one(systemd: Systemd) -> None:
    """Issue 35, 3: the message was dropped on a full queue (sdnotify swallows the error), the old
    agent left anyway, and systemd stopped the unit with the new agent in it."""
    n = notifier(systemd.path)
    n.ready()
    systemd.received()
    systemd.stalled()
    why = await n.hand_off(42, "handed over", timeout=0.2)
    assert why == "systemd's notify socket took no message within 0.2 s (its queue is full)"
    assert not n.handed_off
    systemd.received()  # systemd reads again: we still speak for the unit
    n.status("serving on")
    assert systemd.received() == [[f"STATUS=serving on; version {__version__}"]]


async def test_a_hand_off_waits_for_room_on_the_socket(systemd: Systemd) -> None:
    n = notifier(systemd.path)
    systemd.stalled()
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, systemd.received)  # systemd catches up
    assert await n.hand_off(42, "handed over", timeout=10) is None
    assert systemd.received() == [["STATUS=handed over", "MAINPID=42"]]


async def test_a_hand_off_to_a_socket_that_is_gone_says_why(systemd: Systemd) -> None:
    n = notifier(systemd.path)
    systemd.sock.close()
    why = await n.hand_off(42, "handed over")
    assert why is not None and why.startswith("cannot tell systemd ("), why
    assert not n.handed_off


def test_an_in_place_child_says_ready_only_once_it_speaks_for_the_unit(systemd: Systemd) -> None:
    """Issue 35, 5: the child ready before its predecessor left had its READY=1 dropped (it was
    not the main process yet) and never said it again."""
    n = notifier(systemd.path, **{contracts.PREDECESSOR_ENV: "41"})
    n.ready()
    assert systemd.received() == [] and not n.ready_sent
    n.take_over()
    n.ready()
    said = systemd.received()
    assert said[-1][0] == "READY=1", said


async def test_the_watchdog_clock_restarts_at_the_hand_off_and_at_the_take_over(systemd: Systemd) -> None:
    """The child pings only once its predecessor has exited, on its own tick: without a ping in
    the hand-off and one at the take-over, the unit could go up to two intervals plus the old
    agent's exit without one, past WatchdogSec= (systemd then kills the new main process)."""
    old = notifier(systemd.path, WATCHDOG_USEC="30000000")
    old.ready()
    systemd.received()
    assert await old.hand_off(42, "handed over") is None
    assert systemd.received() == [["READY=1", "WATCHDOG=1", "STATUS=handed over", "MAINPID=42"]]
    child = notifier(systemd.path, WATCHDOG_USEC="30000000", **{contracts.PREDECESSOR_ENV: "41"})
    child.watchdog()
    assert systemd.received() == [], "not the main process yet: silent"
    child.take_over()
    assert systemd.received() == [["WATCHDOG=1", f"STATUS=; version {__version__}"]]


def test_the_status_line_the_hosts_page_shows_is_the_agents(systemd: Systemd) -> None:
    """README showed `Status: "ready: kvm, 2000 slots, 1 stream"` without the `; version …` the
    agent appends (issue 50: 8): docs/hosts.md's line is what a ready agent with the default
    slots and the kubelet's stream tells systemd."""
    (shown,) = re.findall(r'systemctl status hyperlight-agent +# Status: "([^"]+)"', read("docs/hosts.md"))
    ready = DevicePluginSnapshot(
        Observation(True, "", "kvm"),
        True,
        State.STREAMED,
        "",
        "/k/kubelet.sock",
        1,
        config.BY_KEY["device_count"].default,
    )
    n = notifier(systemd.path)
    n.status(ready.status())
    assert systemd.received() == [[f"STATUS={shown}"]]
