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


def test_the_commit_is_the_environments_else_the_checkouts_else_unknown(tmp: str) -> None:
    """An image says its commit in HYPERLIGHT_AGENT_COMMIT; a checkout has it in git (issue 50: 9:
    `make run` said `commit unknown`); an installed package without either says unknown."""
    import os
    import subprocess

    from hyperlight_agent import identity

    checkout = os.path.join(tmp, "checkout")
    os.makedirs(checkout)
    git = ["git", "-C", checkout, "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert identity.commit({}, checkout) == head
    assert identity.commit({contracts.COMMIT_ENV: "0123abc"}, checkout) == "0123abc"
    assert identity.commit({}, os.path.join(tmp, "installed")) == "unknown"
    # This test's own tree, where the package runs from: a checkout (or a copy without git).
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    expected = "unknown" if not os.path.exists(os.path.join(here, ".git")) else None
    found = identity.commit({})
    assert found == expected if expected else len(found) == 40 and found != "unknown"
