"""The DRA side's succession (dra/succession.py) against real sockets: which instances in the
kubelet's plugin registry (registration sockets, GetInfo, then Describe on the service socket) are
successors of ours, newer instances, or neither."""

from __future__ import annotations

import asyncio
import os
from typing import Optional

from hyperlight_agent import peers
from hyperlight_agent.dra.side import DraSide, DraTarget
from hyperlight_agent.identity import Identity
from tests.fakes import dra_outcomes, wiring
from tests.test_peers import Server, silent_sockets

DRIVER = "hypervisor.hyperlight.dev"


def dra_driver(tmp: str, instance: str = "old") -> DraSide:
    registry, plugins = os.path.join(tmp, "registry"), os.path.join(tmp, "plugins")
    os.makedirs(registry, exist_ok=True)
    return DraSide(
        DraTarget("node1", instance, 4, None, registry, plugins),
        wiring(identity=Identity.of(instance, "dra", DRIVER)),
        dra_outcomes(),
    )


async def registered_driver(tmp: str, name: str, sock: str, identity: Optional[Identity]) -> list[Server]:
    """A DRA driver's registration socket naming `name`, and its service socket (health SERVING,
    Describe when an identity is given)."""
    endpoint = os.path.join(tmp, f"{sock}-service.sock")
    service = Server(endpoint).with_health()
    if identity is not None:
        service.with_describe(identity)
    registration = Server(os.path.join(tmp, "registry", f"{sock}-reg.sock")).with_registration(name, endpoint)
    return [await service.start(), await registration.start()]


# 9: another vendor's DRA driver in the registry is no successor.
async def test_a_foreign_dra_driver_is_no_successor(tmp: str) -> None:
    driver = dra_driver(tmp)
    await driver.registrar.start()
    servers = await registered_driver(tmp, "gpu.other-vendor.example", "dra-0a1b2c", None)
    servers += await registered_driver(
        tmp, "gpu.other-vendor.example", "dra-3d4e5f", Identity.of("x", "dra", "gpu.other-vendor.example")
    )
    try:
        assert len(driver.instances.candidates()) == 2
        assert await driver.succession.hand_over(0.5) is None
        ours = await registered_driver(tmp, DRIVER, f"{DRIVER}-new", Identity.of("new", "dra", DRIVER))
        servers += ours
        assert await driver.succession.hand_over(5) == ours[0].path
    finally:
        for server in servers:
            await server.stop()
        await driver.close()


async def test_the_dra_successor_search_ends_by_its_deadline_whatever_the_sockets_do(tmp: str) -> None:
    driver = dra_driver(tmp)
    await driver.registrar.start()
    sockets = silent_sockets(os.path.join(tmp, "registry"), [f"{DRIVER}-silent-{i}-reg.sock" for i in range(100)])
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        assert await driver.succession.hand_over(1) is None
        assert loop.time() - started < 1 + peers.PEER_TIMEOUT_S
    finally:
        for s in sockets:
            s.close()
        await driver.close()


async def test_a_newer_live_instance_is_found_and_an_older_one_is_not(tmp: str) -> None:
    older = Identity.of("older", "dra", DRIVER)
    driver = dra_driver(tmp, "middle")
    await driver.registrar.start()
    servers = await registered_driver(tmp, DRIVER, f"{DRIVER}-older", older)
    try:
        assert await driver.succession.newer_instance() is None
        servers += await registered_driver(tmp, DRIVER, f"{DRIVER}-newest", Identity.of("newest", "dra", DRIVER))
        assert await driver.succession.newer_instance() == "newest"
    finally:
        for server in servers:
            await server.stop()
        await driver.close()
