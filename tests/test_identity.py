"""Who an instance of our agent is (identity.py): identities order by start, then name; the same
kind is the same protocol and resource."""

from __future__ import annotations

from hyperlight_agent import contracts
from hyperlight_agent.identity import Identity

RESOURCE = contracts.RESOURCE_HYPERVISOR
DRIVER = contracts.DRA_DRIVER


def test_identities_order_by_start_then_name() -> None:
    a = Identity("a", "dra", DRIVER, started=10, pid=1)
    b = Identity("b", "dra", DRIVER, started=20, pid=2)
    assert b.is_newer_than(a) and not a.is_newer_than(b)
    assert Identity("b", "dra", DRIVER, 10, 1).is_newer_than(a)  # a tie: the name decides
    assert a.same_kind(b) and not a.same_kind(Identity("c", "deviceplugin", RESOURCE, 30, 3))
