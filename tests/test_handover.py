"""handover.py's parts on their own: which sockets are peers, and waiting for calls in flight."""

from __future__ import annotations

import asyncio
import os
import socket

from hyperlight_agent import contracts
from hyperlight_agent.deviceplugin import handover


def _socket(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    return s


def test_peers_are_other_agents_sockets_for_the_same_resource(tmp: str) -> None:
    names = ["hyperlight.sock", "hyperlight.pod-a.sock", "hyperlight.pod-b.sock", "hyperlight-access.pod-a.sock",
             "kubelet.sock", ".hyperlight.pod-a.sock.12.abcd"]
    sockets = [_socket(os.path.join(tmp, n)) for n in names]
    with open(os.path.join(tmp, "hyperlight.file.sock"), "w"):
        pass  # a regular file with a matching name is no peer
    try:
        found = handover.peers(tmp, contracts.PLUGIN_SOCKET, "hyperlight.pod-a.sock")
        assert [os.path.basename(p) for p in found] == ["hyperlight.pod-b.sock", "hyperlight.sock"]
        access = handover.peers(tmp, contracts.DEVICE_ACCESS_SOCKET, "hyperlight-access.pod-b.sock")
        assert [os.path.basename(p) for p in access] == ["hyperlight-access.pod-a.sock"]
    finally:
        for s in sockets:
            s.close()


def test_a_peer_that_does_not_answer_is_not_ready(tmp: str) -> None:
    path = os.path.join(tmp, "hyperlight.quiet.sock")
    s = _socket(path)  # bound, never listening: connections are refused
    try:
        assert asyncio.run(handover.peer_ready(path)) is False
    finally:
        s.close()


def test_drained_waits_for_calls_in_flight_and_gives_up_at_the_bound() -> None:
    async def run() -> tuple[bool, bool]:
        in_flight = [2]

        async def finish() -> None:
            await asyncio.sleep(0.02)
            in_flight[0] = 0

        task = asyncio.ensure_future(finish())
        done = await handover.drained(lambda: in_flight[0], 5)
        await task
        stuck = await handover.drained(lambda: 1, 0.05)
        return done, stuck

    assert asyncio.run(run()) == (True, False)
