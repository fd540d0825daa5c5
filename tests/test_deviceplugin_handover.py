"""Handing the kubelet over on stop (deviceplugin/handover.py): the candidates are sockets named like
ours for the same resource, never our own; a successor is an instance of ours for the same resource
that says it is ready (or an agent of an earlier release proving it is a device plugin); sockets that
look like one but are not (a bare gRPC health server, a socket that never answers) are never taken
for one, and however many there are, the search ends by its deadline. (Two whole agents handing the
kubelet over: test_handover.py.)"""

from __future__ import annotations

import asyncio
import os

from hyperlight_agent import contracts, peers
from hyperlight_agent.deviceplugin import handover
from hyperlight_agent.identity import Identity
from tests.test_peers import Server, silent_sockets

RESOURCE = contracts.RESOURCE_HYPERVISOR


def me(protocol: str = "deviceplugin", resource: str = RESOURCE, instance: str = "old") -> Identity:
    return Identity.of(instance, protocol, resource)


def test_candidates_are_sockets_named_like_ours_for_the_same_resource(tmp: str) -> None:
    names = [
        "hyperlight.sock",
        "hyperlight.pod-a.sock",
        "hyperlight.pod-b.sock",
        "hyperlight-access.pod-a.sock",
        "kubelet.sock",
        ".hyperlight.pod-a.sock.12.abcd",
    ]
    sockets = silent_sockets(tmp, names)
    with open(os.path.join(tmp, "hyperlight.file.sock"), "w"):
        pass  # a regular file with a matching name is no candidate
    try:
        found = handover.candidates(tmp, contracts.PLUGIN_SOCKET, "hyperlight.pod-a.sock")
        assert [os.path.basename(p) for p in found] == ["hyperlight.pod-b.sock", "hyperlight.sock"]
        access = handover.candidates(tmp, contracts.DEVICE_ACCESS_SOCKET, "hyperlight-access.pod-b.sock")
        assert [os.path.basename(p) for p in access] == ["hyperlight-access.pod-a.sock"]
    finally:
        for s in sockets:
            s.close()


# 15: a bare gRPC health server at a name like ours, SERVING, is no successor.
async def test_a_health_server_at_a_name_like_ours_is_no_successor(tmp: str) -> None:
    impostor = await Server(os.path.join(tmp, "hyperlight.sidecar.sock")).with_health().start()
    try:
        assert await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 0.5) is None
    finally:
        await impostor.stop()


async def test_a_ready_agent_of_ours_is_the_successor_and_one_for_another_resource_is_not(tmp: str) -> None:
    other = (
        await Server(os.path.join(tmp, "hyperlight.other.sock"))
        .with_describe(me(resource=contracts.RESOURCE_DEVICE_ACCESS, instance="other"))
        .start()
    )
    unready = (
        await Server(os.path.join(tmp, "hyperlight.unready.sock"))
        .with_describe(me(instance="unready"), ready=False)
        .start()
    )
    try:
        assert await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 0.3) is None
        new = await Server(os.path.join(tmp, "hyperlight.new.sock")).with_describe(me(instance="new")).start()
        try:
            found = await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 5)
            assert found == new.path
        finally:
            await new.stop()
    finally:
        await other.stop()
        await unready.stop()


async def test_an_agent_of_an_earlier_release_is_a_successor_when_it_proves_it_is_a_device_plugin(tmp: str) -> None:
    legacy = await Server(os.path.join(tmp, "hyperlight.legacy.sock")).with_health().with_device_plugin().start()
    try:
        found = await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 5)
        assert found == legacy.path
    finally:
        await legacy.stop()


# 8: however many sockets never answer, the search ends by its deadline.
async def test_the_successor_search_ends_by_its_deadline_whatever_the_sockets_do(tmp: str) -> None:
    """100 sockets that never answer, each worth PEER_TIMEOUT_S: asked one after another (at the
    0.5 s it was then) they took 50 s; the search ends by its deadline (1 s here)."""
    sockets = silent_sockets(tmp, [f"hyperlight.silent-{i}.sock" for i in range(100)])
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        found = await handover.wait_for_successor(me(), tmp, contracts.PLUGIN_SOCKET, "hyperlight.old.sock", 1)
        lasted = loop.time() - started
    finally:
        for s in sockets:
            s.close()
    assert found is None and lasted < 1 + peers.PEER_TIMEOUT_S, lasted
