"""The e2e harness's own choices that need no cluster (tests/e2e)."""

from __future__ import annotations

import fcntl
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.conftest import REPO, wait_for
from tests.e2e import hostwide, versions
from tests.e2e.cluster import (
    BRIDGE_PREFIX,
    MAX_NODES,
    PORTS_PER_SUBNET,
    Cluster,
    claimed_ports,
    free_subnets,
    routed_networks,
    run_tag,
)
from tests.e2e.outcomes import (
    PodSlots,
    denied_before_a_list,
    naming,
    rejected_at_admission,
    start_cut,
    start_to_list_s,
    why_failed,
)

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


def test_clusters_at_once_claim_different_subnets_and_a_released_claim_is_free_again(
    tmp_path: pathlib.Path,
) -> None:
    """Two workers' clusters started together both read the routes before either had a bridge (a
    bridge appears with its first pod), and took the same subnets: a claim is a lock held for the
    cluster's life, so the second takes the next free base."""
    locks = str(tmp_path)
    first = hostwide.SubnetClaim([0, 4, 8], locks)
    second = hostwide.SubnetClaim([0, 4, 8], locks)
    assert (first.base, second.base) == (0, 4)
    with pytest.raises(RuntimeError, match="every candidate is routed or claimed"):
        hostwide.SubnetClaim([0, 4], locks)
    first.release()
    again = hostwide.SubnetClaim([0, 4], locks)
    assert again.base == 0
    again.release()
    # A claim held by another process (a worker's cluster) counts too, and ends with it.
    lock = os.path.join(locks, "hyperlight-e2e-subnets-8.lock")
    holder = subprocess.Popen(["flock", "--exclusive", "--no-fork", lock, "sleep", "1000"])

    def held() -> bool:
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    try:
        wait_for(held, what="the other process's claim")
        beside = hostwide.SubnetClaim([8, 12], locks)
        assert beside.base == 12
        beside.release()
    finally:
        holder.kill()
        holder.wait(10)
    after = hostwide.SubnetClaim([8], locks)
    assert after.base == 8
    after.release()
    second.release()


def test_a_clusters_ports_are_its_claims_block_below_the_ephemeral_range() -> None:
    """A port picked by bind(0) and let go until the API server bound it could be taken meanwhile by
    a connection's source port or by the other worker's cluster: each cluster's ports are a block
    of its own, and one a stranger listens on is skipped."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    first, second = claimed_ports(0), claimed_ports(MAX_NODES)
    mine = [next(first) for _ in range(3)]
    theirs = [next(second) for _ in range(3)]
    assert not set(mine) & set(theirs) and max(mine + theirs) < ephemeral, (mine, theirs)
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", mine[-1] + 1))
        stranger.listen()
        assert next(first) == mine[-1] + 2
    last = claimed_ports(248)  # the highest base free_subnets gives
    block = [next(last) for _ in range(MAX_NODES * PORTS_PER_SUBNET)]
    assert max(block) < ephemeral
    with pytest.raises(RuntimeError, match="every one is taken"):
        next(last)


def test_mountpoints_are_removed_by_the_last_cluster_out(tmp_path: pathlib.Path) -> None:
    """Removing /var/lib/kubelet while another worker's nodes had it bound detached their mounts:
    what the host lacked stays while any cluster holds a claim, and goes with the last one."""
    locks, host = str(tmp_path / "locks"), tmp_path / "host"
    host.mkdir()
    (host / "etc-cdi").mkdir()  # the host's own: never ours to remove
    targets = [str(host / "kubelet"), str(host / "etc-cdi")]
    first = hostwide.SubnetClaim([0], locks)
    hostwide.make_mountpoints(targets, locks)
    second = hostwide.SubnetClaim([4], locks)
    hostwide.make_mountpoints(targets, locks)
    first.release()
    assert hostwide.remove_mountpoints(lock_dir=locks) == [targets[0]]
    assert (host / "kubelet").is_dir()
    second.release()
    assert hostwide.remove_mountpoints(lock_dir=locks) == []
    assert not (host / "kubelet").exists() and (host / "etc-cdi").is_dir()
    # A user that is no cluster (a podman test binding /run/cdi into a guest) holds it too.
    with hostwide.Claim(locks):
        hostwide.make_mountpoints(targets, locks)
        assert hostwide.remove_mountpoints(lock_dir=locks) == [targets[0]]
    assert hostwide.remove_mountpoints(lock_dir=locks) == []
    assert not (host / "kubelet").exists()
    # A killed run's (its state file's list, from before the registry) goes the same way.
    (host / "old").mkdir()
    assert hostwide.remove_mountpoints([str(host / "old")], locks) == []
    assert not (host / "old").exists()
    assert sorted(os.listdir(locks)) == [
        "hyperlight-e2e-host.lock",
        "hyperlight-e2e-subnets-0.lock",
        "hyperlight-e2e-subnets-4.lock",
    ]


# Another worker's window: opened once it can be, then what it waited, then closed.
OTHER_WINDOW = """
import sys
from tests.e2e import hostwide
window = hostwide.LoadWindow(sys.argv[1])
print(window.waited_s, flush=True)
window.release()
"""


def waiting_on_a_lock(pid: int) -> bool:
    """Whether the kernel lists pid as waiting for a lock ("1: -> FLOCK ADVISORY WRITE <pid> ...")."""
    with open("/proc/locks") as f:
        return any(line.split()[1:2] == ["->"] and line.split()[5] == str(pid) for line in f)


def test_one_load_window_at_a_time_on_the_host(tmp_path: pathlib.Path) -> None:
    """Two clusters' loads at once kept both cores busy and a successor agent's pod took longer to
    start than the handover waits (issue 46, ci39): a window measured under load opens only once no
    other on the host is open, whichever process opened it; inside one process a window is one."""
    locks = str(tmp_path)
    lock = os.path.join(locks, "hyperlight-e2e-load-window.lock")
    first = hostwide.LoadWindow(locks)
    again = hostwide.LoadWindow(locks)  # the same process's: no wait, and no deadlock
    nonblocking = ["flock", "--exclusive", "--nonblock", lock, "true"]
    other = subprocess.Popen([sys.executable, "-c", OTHER_WINDOW, locks], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        again.release()
        # The other process blocked on the lock (the kernel lists it as waiting: "->").
        wait_for(lambda: waiting_on_a_lock(other.pid), what="the other window waiting")
        blocked = time.monotonic()
        assert subprocess.run(nonblocking, check=False).returncode == 1  # still held by `first`
        held_until = time.monotonic()
        first.release()
        out, _ = other.communicate(timeout=60)
    finally:
        other.kill()
        other.wait(10)
    # Its wait began before it was seen blocked and ended after the release (one clock for both).
    assert other.returncode == 0 and float(out) >= held_until - blocked, (out, held_until - blocked)
    assert subprocess.run(nonblocking, check=False).returncode == 0  # and nobody holds it now


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


# The shape of a 1.35.8 kubelet's restart on a cold machine (CI, whole 1.35 cluster): the new
# kubelet's pod informer handed it the pods bound while it was down 6 ms before our first list
# arrived, and it refused them; a pod refused by the kubelet before (still serving), and one
# refused after the list, are not the start's.
RESTART_LOG = (pathlib.Path(__file__).parent / "data" / "kubelet-1.35-restart.log").read_text()


def test_only_refusals_before_a_restarted_kubelet_has_our_list_are_its_start() -> None:
    assert denied_before_a_list(RESTART_LOG, "hyperlight.dev/hypervisor") == {
        "load/load-1": False,
        "load/load-2": True,
        "load/load-3": True,
        "load/load-4": False,
    }
    # Another resource's list is not ours: for it, nothing here came before its list.
    assert denied_before_a_list(RESTART_LOG, "hyperlight.dev/device-access")["load/load-2"] is False
    assert start_to_list_s(RESTART_LOG, "hyperlight.dev/hypervisor") == 0.235
    assert start_to_list_s(RESTART_LOG.split("I1205 16:33:55.324", maxsplit=1)[0], "hyperlight.dev/hypervisor") is None
    # The part of a log after its last start marker: no kubelet started there, so no start figure.
    after_start = RESTART_LOG[RESTART_LOG.rindex('"Kubelet version"') + 1 :]
    assert start_to_list_s(after_start, "hyperlight.dev/hypervisor") is None


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


# A stand-in for go in build.sh (its GO): records the module directory of each build, makes the
# output named by -o, and holds while HOLD (a path) is set and does not exist yet.
FAKE_GO = """#!/bin/sh
echo "$(basename "$PWD")" >>"$FAKE_GO_LOG"
while [ "$#" -gt 1 ]; do [ "$1" = -o ] && out=$2; shift; done
case $out in */) ;; *) : >"$out"; chmod +x "$out" ;; esac
if [ -n "$HOLD" ]; then while [ ! -e "$HOLD" ]; do sleep 0.01; done; fi
"""
BUILD_SH = os.path.join(versions.COMPONENTS, "build.sh")


@pytest.fixture
def fake_go(tmp_path: pathlib.Path) -> dict[str, str]:
    go = tmp_path / "go"
    go.write_text(FAKE_GO)
    go.chmod(0o755)
    return dict(os.environ, GO=str(go), FAKE_GO_LOG=str(tmp_path / "go.log"), HOLD="")


def built(env: dict[str, str]) -> list[str]:
    try:
        return pathlib.Path(env["FAKE_GO_LOG"]).read_text().split()
    except FileNotFoundError:
        return []


def build_sh(env: dict[str, str], out: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BUILD_SH, str(out), *args], env=env, capture_output=True, text=True, timeout=60, check=False)


def test_the_components_build_in_the_order_the_clusters_lane_needs_them_and_once(
    fake_go: dict[str, str], tmp_path: pathlib.Path
) -> None:
    """etcd and containerd (every cluster's), the oldest row (the lane's first whole cluster), the
    newest (that cluster's last test moves its control plane there), then the others newest first."""
    rows = versions.rows()
    assert len(rows) >= 3  # so that the order below says something
    out = tmp_path / "bin"
    assert build_sh(fake_go, out, "components").returncode == 0
    expected = ["etcd", "containerd", rows[-1].module, rows[0].module, *(row.module for row in rows[1:-1])]
    assert built(fake_go) == expected
    assert build_sh(fake_go, out, "components").returncode == 0
    assert built(fake_go) == expected  # each found complete: nothing built again
    # Only what is named: a cluster of one row waits for no other row's build.
    assert build_sh(fake_go, tmp_path / "other", "components", f"1.{rows[1].minor}").returncode == 0
    assert built(fake_go) == [*expected, rows[1].module]


def test_the_tools_build_helm_first_each_reached_by_its_link(fake_go: dict[str, str], tmp_path: pathlib.Path) -> None:
    out = tmp_path / "tools"
    assert build_sh(fake_go, out, "tools", "cosign").returncode == 0
    assert built(fake_go) == ["cosign"] and os.access(out / "cosign", os.X_OK)
    assert build_sh(fake_go, out, "tools").returncode == 0
    assert built(fake_go) == ["cosign", "helm", "registry", versions.newest().module, "promtool"]
    for name in ("helm", "registry", "cosign", "kubectl", "promtool"):
        assert os.access(out / name, os.X_OK), name


@pytest.mark.parametrize("args", [["components", "1.99"], ["tools", "kind"], ["everything"]])
def test_build_sh_refuses_what_it_does_not_build(
    fake_go: dict[str, str], tmp_path: pathlib.Path, args: list[str]
) -> None:
    done = build_sh(fake_go, tmp_path / "out", *args)
    assert done.returncode == 2 and args[-1] in done.stderr, done
    assert built(fake_go) == []


def test_a_second_asker_waits_for_the_build_under_way_and_finds_it_done(
    fake_go: dict[str, str], tmp_path: pathlib.Path
) -> None:
    held = dict(fake_go, HOLD=str(tmp_path / "release"))
    out = tmp_path / "bin"
    first = subprocess.Popen([BUILD_SH, str(out), "components", "etcd"], env=held, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: built(fake_go) == ["etcd"], 30, "the first build under way")
        # Asked while the first is held in go: only the lock can make it find etcd built.
        second = subprocess.Popen(
            [BUILD_SH, str(out), "components", "etcd"], env=fake_go, stdout=subprocess.PIPE, text=True
        )
        # Released once the second has ended (it built etcd itself) or waits at the lock.
        wait_for(lambda: second.poll() is not None or "flock" in children(second.pid), 30, "the second at the lock")
        (tmp_path / "release").touch()
        said, _ = second.communicate(timeout=30)
        assert first.wait(30) == 0 and second.returncode == 0
        assert "cached" in said and built(fake_go) == ["etcd"], said
    finally:
        (tmp_path / "release").touch()
        first.kill()
        first.wait()


def children(pid: int) -> list[str]:
    """The commands (comm) of pid's child processes."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                comm, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except (FileNotFoundError, ProcessLookupError):  # ended since listed
            continue
        if int(rest.split()[1]) == pid:
            found.append(comm)
    return found


def nice_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


@pytest.mark.root  # lowering a process's nice value needs CAP_SYS_NICE
def test_a_test_that_waits_for_the_background_build_gives_it_the_tests_priority(
    fake_go: dict[str, str], tmp_path: pathlib.Path
) -> None:
    """make test's build starts at nice 19, behind every test; once a test waits for it, the build
    is what the lanes wait on, and it runs at the test's priority from then on."""
    release = tmp_path / "release"
    background_env = dict(fake_go, HOLD=str(release), BUILD_STOPS_WITH=str(os.getpid()))
    out = tmp_path / "bin"
    background = subprocess.Popen(
        ["setsid", "nice", "-n", "19", BUILD_SH, str(out), "components", "etcd"], env=background_env
    )
    waiter = None
    try:
        wait_for(lambda: built(fake_go) == ["etcd"], 30, "the background build under way")
        assert nice_of(background.pid) == 19
        waiter = subprocess.Popen([BUILD_SH, str(out), "components", "etcd"], env=fake_go, stdout=subprocess.DEVNULL)
        wait_for(lambda: nice_of(background.pid) == os.nice(0), 30, "the background build at the waiter's priority")
        release.touch()
        assert background.wait(30) == 0 and waiter.wait(30) == 0
        assert built(fake_go) == ["etcd"] and not (out / ".background").exists()
    finally:
        release.touch()
        for process in (background, waiter):
            if process is not None:
                process.kill()
                process.wait()
