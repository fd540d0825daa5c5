"""The e2e harness's own choices that need no cluster (tests/e2e)."""

from __future__ import annotations

import os
import pathlib
import subprocess
from typing import Any

import pytest

from tests.e2e import versions
from tests.e2e.cluster import BRIDGE_PREFIX, Cluster, free_subnets, routed_networks, run_tag
from tests.e2e.outcomes import PodSlots, naming, rejected_at_admission, start_cut, why_failed

SLASH_24 = 0xFFFFFF00


def net(third: int) -> int:
    return (10 << 24) | (250 << 16) | (third << 8)


def test_the_nodes_subnets_avoid_a_bridge_another_run_left() -> None:
    """A bridge of another checkout's killed run kept 10.250.1.0/24 routed (down): the probes of
    our pods on a new bridge with that subnet went to it ("no route to host")."""
    assert free_subnets(4, set()) == 0
    assert free_subnets(4, {(net(1), SLASH_24)}) == 4
    assert free_subnets(4, {(net(1), SLASH_24), (net(6), SLASH_24)}) == 8
    assert free_subnets(4, {(net(2) | 0x80, 0xFFFFFF80)}) == 4  # a narrower route inside one
    # Broader routes lose to a bridge's /24 by their length: the default, a VPN's 10.0.0.0/8.
    assert free_subnets(4, {(0, 0), (10 << 24, 0xFF000000)}) == 0
    with pytest.raises(RuntimeError, match="no 4 free /24 subnets"):
        free_subnets(4, {(net(i), SLASH_24) for i in range(256)})


def test_the_hosts_routes_are_read() -> None:
    routes = routed_networks()
    assert routes and all(dest & mask == dest for dest, mask in routes)


def test_the_kubernetes_rows_are_read_newest_first_and_each_pins_its_own_minor(tmp_path: pathlib.Path) -> None:
    """tests/e2e/components/kubernetes: one row per minor; the roles follow from the order."""
    rows = versions.rows()
    assert [r.minor for r in rows] == sorted({r.minor for r in rows}, reverse=True)
    assert versions.newest() == rows[0] and versions.oldest() == rows[-1]
    assert versions.whole_clusters() == list(reversed(rows[1:]))
    for row in rows:
        assert row.version.startswith(f"v1.{row.minor}.") and "kubelet" in row.components, row
    table = tmp_path / "kubernetes"
    table.write_text(f"# a comment\n1.30  {rows[0].module}  kubelet\n")
    with pytest.raises(ValueError, match=rf"row 1.30's module {rows[0].module} pins {rows[0].version}"):
        versions.rows(str(table))
    table.write_text("1.37 k8s-v1.37\n")
    with pytest.raises(ValueError, match="want 'MINOR MODULE COMPONENT…'"):
        versions.rows(str(table))
    table.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no rows"):
        versions.rows(str(table))


@pytest.mark.root
def test_a_bridge_named_for_the_run_directory_goes_even_without_its_state(tmp_path: pathlib.Path) -> None:
    """A killed run's checkout removed with its state file (rm -rf) left its node's bridge, with an
    old address and route: the next run in that directory took other subnets, and the CNI plugin
    refused the bridge ("already has an IP address different from …"). The directory's own
    bridges go; another directory's stay."""
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    mine, other = (f"{BRIDGE_PREFIX}{run_tag(d)}a" for d in (ours, theirs))
    for link in (mine, other):
        subprocess.run(["ip", "link", "add", link, "type", "bridge"], check=True)
    try:
        Cluster.clean_leftovers(os.path.join(ours, "state.json"), ours)
        assert not os.path.exists(f"/sys/class/net/{mine}")
        assert os.path.exists(f"/sys/class/net/{other}")
    finally:
        for link in (mine, other):
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)


def ended(reason: str, code: int, message: str) -> dict[str, Any]:
    terminated = {"reason": reason, "exitCode": code, "message": message}
    return {"status": {"phase": "Failed", "containerStatuses": [{"name": "app", "state": {"terminated": terminated}}]}}


# What the API server said of the load pod a 1.35.4 kubelet's restart failed (the fourth of four
# restarts in a row on the whole 1.35 cluster; containerd 2.2.9's StartContainer, "context canceled").
SAID = 'failed to start containerd task "07722f19207e": context canceled'
CUT = ended("StartError", 128, SAID)


def test_only_a_start_the_kubelets_exit_cancelled_counts_as_cut_by_the_restart() -> None:
    assert why_failed(CUT) == ("StartError exit 128", SAID)
    assert start_cut(*why_failed(CUT))
    # A start that failed for the container's own sake (a device node runc could not open), a
    # workload that failed (our check said no), a pod the kubelet refused: each still counts.
    runc = ended("StartError", 128, "failed to create containerd task: open /dev/kvm: no such file or directory")
    assert not start_cut(*why_failed(runc))
    assert not start_cut(*why_failed(ended("Error", 1, "context canceled")))
    refused = {"status": {"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": "context canceled"}}
    assert rejected_at_admission(refused["status"]) and not start_cut(*why_failed(refused))
    assert not rejected_at_admission(CUT["status"])


def test_a_load_never_holds_more_unfinished_pods_than_its_slots() -> None:
    """The DRA load filled node a's 110 pods (each unfinished 30 s or more, one every 0.3 s) and the
    driver's replacement pod, system-node-critical, preempted a just-bound load pod: the test saw
    it gone. Created pods that could reach the cap are counted by one listing; a full load waits."""
    unfinished: set[str] = set()
    listed = []

    def listing() -> set[str]:
        listed.append(1)
        return set(unfinished)

    slots, created = PodSlots(3, listing), list[str]()

    def create() -> None:
        created.append(f"load-{len(created)}")
        unfinished.add(created[-1])

    while slots.free(created):
        create()
    assert created == ["load-0", "load-1", "load-2"] and len(listed) == 1  # none asked for below the cap
    assert not slots.free(created) and len(listed) == 2  # still full: asked again, no room
    unfinished -= {"load-0", "load-2"}  # two finished
    assert slots.free(created)
    create()
    assert slots.free(created) and len(listed) == 3  # room for one more without asking
    create()
    assert not slots.free(created)  # load-1, load-3, load-4: full again


def test_the_log_lines_naming_a_gone_pod_are_its_own() -> None:
    log = [
        'I1204 04:22:51.8 "SyncLoop DELETE" pods=["ns/load-225"]\n',
        'I1204 04:22:51.9 "Deleting pod" pod="ns/load-22"\n',
        'I1204 04:22:52.0 "Deleting pod" pod="ns/load-2250"\n',
        'I1204 04:22:52.1 claim="ns/load-225-hypervisor-x5mrz"\n',
        'I1204 04:22:52.2 "Deleting pod" pod="other/load-225"\n',
    ]
    assert naming(log, "ns", "load-225") == ['I1204 04:22:51.8 "SyncLoop DELETE" pods=["ns/load-225"]']
    assert naming(log, "ns", "load-22") == ['I1204 04:22:51.9 "Deleting pod" pod="ns/load-22"']
