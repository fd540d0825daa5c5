"""The other instances of our DRA driver (dra/instances.py): which registration sockets may be
one, and what each names in GetInfo. (Handovers and who keeps the slice through them:
test_dra_side.py.)"""

from __future__ import annotations

import os

from hyperlight_agent import contracts
from hyperlight_agent.dra.instances import Instances, candidates
from hyperlight_agent.identity import Identity
from tests.test_dra_succession import registered_driver
from tests.test_peers import silent_sockets

DRIVER = contracts.DRA_DRIVER


def test_candidates_are_sockets_named_as_a_drivers_registration_never_ours(tmp: str) -> None:
    registry = os.path.join(tmp, "registry")
    os.makedirs(registry)
    names = [
        f"{DRIVER}-a-reg.sock",  # ours, by name
        "dra-0a1b2c-reg.sock",  # a hashed name: any driver's, GetInfo says whose
        "gpu.other-vendor.example-x-reg.sock",  # another driver's by its name
        f"{DRIVER}-b.sock",  # not a registration socket
        f"{DRIVER}-own-reg.sock",  # our own
    ]
    listening = silent_sockets(registry, names)
    try:
        with open(os.path.join(registry, f"{DRIVER}-file-reg.sock"), "w"):
            pass  # a file, not a socket
        own = os.path.join(registry, f"{DRIVER}-own-reg.sock")
        assert candidates(registry, DRIVER, own) == [
            os.path.join(registry, "dra-0a1b2c-reg.sock"),
            os.path.join(registry, f"{DRIVER}-a-reg.sock"),
        ]
        assert candidates(os.path.join(tmp, "missing"), DRIVER, own) == []
    finally:
        for sock in listening:
            sock.close()


async def test_the_service_socket_is_what_an_instance_of_our_driver_names_in_getinfo(tmp: str) -> None:
    os.makedirs(os.path.join(tmp, "registry"))
    me = Identity.of("old", "dra", DRIVER)  # started before the instance below
    servers = await registered_driver(tmp, DRIVER, "dra-ours", Identity.of("new", "dra", DRIVER))
    servers += await registered_driver(tmp, "gpu.other-vendor.example", "dra-theirs", None)
    registry = os.path.join(tmp, "registry")
    instances = Instances(me, registry, DRIVER, os.path.join(registry, "none"))
    try:
        ours, theirs = (os.path.join(registry, f"dra-{n}-reg.sock") for n in ("ours", "theirs"))
        assert await instances.service_socket(ours, 5) == servers[0].path
        assert await instances.service_socket(theirs, 5) is None
        assert await instances.newer() == "new" and await instances.successor(5) == servers[0].path
    finally:
        for server in servers:
            await server.stop()
