"""Whole clusters of the other supported minors: for every row of tests/e2e/components/kubernetes but
the newest (whose cluster is test_e2e.py's), a control plane and a kubelet of that minor, built from
its pinned module, with the agent as users get it (README's `helm install`, then the chart's DRA
mode). Managed clusters run one minor throughout; these are those clusters. On each:

- the device plugin: installed, a workload through CDI, the agent pod deleted and `helm upgrade`
  under a pod every 0.2 s (pods rejected, failed);
- DRA with the chart's `draSharedDevice: auto`: the slice's shape the API server allows (one shared
  device where it keeps `allowMultipleAllocations`, else DRA_DEVICES identical ones, with the
  driver's log line saying why), a claim through the DeviceClass, the driver pod deleted under a
  DRA pod every 0.3 s (pods failed, prepares failed);
- an unchanged `resources.limits` pod where only DRA serves the node: run through DRA where the API
  server keeps the DeviceClass's `extendedResourceName`, else Pending, saying what it lacks;
- on the oldest minor's cluster (FULL_ROWS), the suite's other version-dependent events: the
  migration from the upstream plugin, the kubelet restarted under load, `helm test` in both
  modes, the .deb under systemd on node b's kubelet upgraded in place (`systemctl reload`,
  `apt-get install` of the next release, a next release failing before ready), the device made
  unusable where the API server keeps no device taints (its devices leave the slice), DRA's
  `helm upgrade` under load;
- the control plane upgraded to the newest minor under a running driver and a running claim (the
  oldest row): the driver's slice keeps its shape until the driver restarts; then one shared
  device, the running pod untouched and its claim on the old device unprepared when it ends.

The session's cluster (test_e2e.py) runs the rest of the suite on the newest minor, with the
oldest minor's kubelet under it for the device plugin's workload and lifecycle (a node-pool
upgrade's shape). What neither runs on the oldest minor: the migration of unchanged pods between
the device plugin and DRA (it needs the DeviceClass's extendedResourceName, 1.36+), and the health
scenarios that need the newest API server's fields (device taints, pod status).
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests import hyperlight
from tests.e2e import versions
from tests.e2e.cluster import Cluster, Node, wait_until
from tests.releases import CURRENT, PREVIOUS, Published
from tests.test_deb import UNIT
from tests.test_docs import ROOT
from tests.test_e2e import (
    BIN_DIR,
    DRA_DAEMONSET,
    DRA_DEVICES,
    DRA_DRIVER,
    DRA_WORKLOAD,
    HYPERVISOR,
    NAMESPACE,
    SLOTS,
    allocatable,
    daemonset_pods,
    dra_event,
    dra_pod,
    dra_ready,
    ensure_namespace,
    failed_prepares,
    finished,
    give_the_driver_api_access,
    helm,
    helm_test,
    host_agent,
    host_upgrades_in_place,
    kubelet_view,
    migrate_from_the_upstream_plugin,
    node_slices,
    other_release,
    pod_ready,
    readme_helm_install,
    record,
    release_chart,
    run_event,
    running,
    running_release,
    slice_devices,
    termination_message,
    through_dra,
    unusable_then_usable,
    workload_pod,
)

pytestmark = [pytest.mark.system, pytest.mark.e2e]

ROWS = versions.whole_clusters()
NEWEST = versions.newest()
# The oldest minor's cluster also runs the suite's other version-dependent events (the module's
# docstring); the other minors' clusters are a smoke.
FULL_ROWS = [versions.oldest()]


def full(rows: list[versions.Row]) -> pytest.MarkDecorator:
    """A test for these rows' clusters only (each the module's cluster of its row)."""
    return pytest.mark.parametrize("whole", rows, indirect=True, ids=[f"1.{row.minor}" for row in rows])


APPS = "hyperlight-apps"
# The first minor whose API server keeps a device's allowMultipleAllocations and a DeviceClass's
# extendedResourceName by default (DRAConsumableCapacity and DRAExtendedResource beta, on).
SHARED_SINCE = 36
WORKLOAD_SAYS = "uid=65534 node=660 owner=65534:65534 env=kvm api=12 vm=created"


@pytest.fixture(scope="module", params=ROWS, ids=[f"1.{row.minor}" for row in ROWS])
def whole(request: pytest.FixtureRequest, images: dict[str, str], published: Published) -> Iterator[Cluster]:
    """A cluster of one minor throughout: its API server, controller-manager, scheduler and node
    a's kubelet (labelled, the real /dev/kvm); the chart installed as README says."""
    row: versions.Row = request.param
    started = time.monotonic()
    run = os.path.join(ROOT, "build", "e2e", f"run-1.{row.minor}")
    c = Cluster(os.path.join(run, "cluster"), BIN_DIR, mirrors={"ghcr.io": f"http://{published.host}"})
    try:
        c.start(version=row.version)
        nodes = [c.add_node("a", row.version, labels={"hyperlight.dev/enabled": "true"})]
        if row in FULL_ROWS:  # node b: the host's agent (its /dev/kvm is /dev/null for containerd)
            nodes.append(c.add_node("b", row.version, device_unusable=True))
        for node in nodes:
            for archive in images.values():
                node.import_image(archive)
            node.start_kubelet(row.version)
        for node in nodes:
            wait_until(node.ready, 180, f"node {node.name} Ready on {row.version}")
        a = nodes[0]
        helm(c, *readme_helm_install(published))
        wait_until(lambda: allocatable(a, HYPERVISOR) == SLOTS, 120, "node a's allocatable hyperlight.dev/hypervisor")
        ensure_namespace(c, APPS)
        record(
            f"whole.{row.version}.start_to_allocatable_s", round(time.monotonic() - started - c.components_wait_s, 1)
        )
        yield c
    finally:
        c.stop()


def minor(cluster: Cluster) -> int:
    return int(cluster.control_plane_version.split(".")[1])


def run_workload(cluster: Cluster, pod: dict[str, Any]) -> dict[str, Any]:
    """Creates the pod in APPS, waits for its end and returns it (deleted)."""
    name = pod["metadata"]["name"]
    cluster.api.create(f"/api/v1/namespaces/{APPS}/pods", pod)
    try:
        return finished(cluster, APPS, name)
    finally:
        cluster.api.delete(f"/api/v1/namespaces/{APPS}/pods/{name}")


# The node as CDI made it, then the real client: a Hyperlight guest's answer.
SAYS = ["/bin/sh", "-c", f"{{ /kvmcheck && {hyperlight.HOST_IN_IMAGE}; }} >/dev/termination-log 2>&1"]


def worked(pod: dict[str, Any]) -> bool:
    said = termination_message(pod)
    return pod["status"]["phase"] == "Succeeded" and WORKLOAD_SAYS in said and hyperlight.ANSWER in said


def device_plugin_event(cluster: Cluster, published: Published, event: str) -> dict[str, Any]:
    """Under a pod every 0.2 s: the device plugin's pod deleted, or `helm upgrade` to CURRENT."""
    a = cluster.nodes["a"]
    old = {p["metadata"]["uid"] for p in daemonset_pods(cluster, "hyperlight-device-plugin")}

    def replaced_and_healthy() -> bool:
        pods = daemonset_pods(cluster, "hyperlight-device-plugin")
        replaced = bool(pods) and all(p["metadata"]["uid"] not in old and pod_ready(p) for p in pods)
        return replaced and kubelet_view(a).get(HYPERVISOR) == SLOTS

    def act() -> None:
        if event == "agent_pod_deleted":
            for p in daemonset_pods(cluster, "hyperlight-device-plugin"):
                cluster.api.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{p['metadata']['name']}", grace=None)
        else:
            helm(cluster, "upgrade", "hyperlight", *release_chart(published, CURRENT), "--namespace", NAMESPACE)

    return run_event(cluster, a, f"whole-{cluster.control_plane_version}-{event}", act, replaced_and_healthy)


@full(FULL_ROWS)
def test_migration_from_the_upstream_plugin_on_a_whole_cluster(whole: Cluster, published: Published) -> None:
    """docs/operations.md's migration from the upstream plugin (test_e2e.py's, on this minor):
    first, as it leaves the chart as README's install does (the device plugin, N-1)."""
    migrate_from_the_upstream_plugin(whole, published, f"whole.{whole.control_plane_version}.migration")


def test_device_plugin_on_a_whole_cluster(whole: Cluster, published: Published) -> None:
    cluster, version = whole, whole.control_plane_version
    pod = run_workload(cluster, workload_pod("workload", SAYS))
    assert worked(pod), (pod["status"], termination_message(pod))
    for event in ("agent_pod_deleted", f"helm_upgrade_{PREVIOUS}_to_{CURRENT}"):
        figure = device_plugin_event(cluster, published, event)
        record(f"whole.{version}.{event}", figure)
        assert figure["failed"] == 0, figure
        # Before 1.37 a kubelet ends the newest plugin's stream with an older one's (kubernetes issue
        # 121994; docs/deploy.md): one gap, no more, and nothing failing after admission.
        assert len(figure["kubelet_zero_windows_s"]) <= (0 if minor(cluster) >= 37 else 1), figure


@full(FULL_ROWS)
def test_kubelet_restart_and_helm_test_on_a_whole_cluster(whole: Cluster) -> None:
    """The kubelet restarted under a pod every 0.2 s (the agent registers again: no pod rejected
    but those the kubelet admits at its start before our first list, outcomes.denied_before_a_list; a pod fails
    only if the kubelet's own exit cut its container's start, test_e2e.start_cut), then `helm
    test`: the chart's test pod gets the device and its --check passes."""
    cluster, version = whole, whole.control_plane_version
    a = cluster.nodes["a"]

    def restart() -> None:
        a.stop_kubelet()
        a.start_kubelet(version)

    def back() -> bool:
        return a.ready() and kubelet_view(a).get(HYPERVISOR) == SLOTS

    figure = run_event(cluster, a, f"whole-{version}-kubelet-restart", restart, back)
    record(f"whole.{version}.kubelet_restart", figure)
    assert figure["rejected"] == figure["rejected_at_kubelet_start"], figure
    assert figure["failed"] == figure["start_cut"], figure
    assert helm_test(cluster) == {"hyperlight-test-device-plugin": "Succeeded"}


@full(FULL_ROWS)
def test_host_reload_and_apt_upgrade_on_a_whole_cluster(whole: Cluster, published: Published, tmp: str) -> None:
    """The .deb under real systemd (nspawn) serving node b's kubelet of this minor, as on a host:
    `systemctl reload` and `apt-get install` of the next release hand over in place under load (no
    pod rejected or failed, no moment without a healthy device), and a next release failing before
    it is ready leaves the old agent serving."""
    b = whole.nodes["b"]
    with host_agent(whole, published, tmp) as (guest, root, _):
        wait_until(lambda: kubelet_view(b).get(HYPERVISOR) == SLOTS, 120, "node b's kubelet counting the host agent")

        def serving() -> bool:
            return guest.is_active(UNIT) == "active" and kubelet_view(b).get(HYPERVISOR) == SLOTS

        wait_until(serving, 60, "the unit active")
        host_upgrades_in_place(whole, published, guest, root, serving, "whole.host")
    wait_until(lambda: kubelet_view(b).get(HYPERVISOR, 0) == 0, 30, "the stopped host agent's slots gone")


def dra_values(published: Published, mode: str, version: str = CURRENT) -> list[str]:
    return [*release_chart(published, version), "--set", f"mode={mode}", "--set", "draSharedDevice=auto"]


def expected_devices(cluster: Cluster) -> int:
    return 1 if minor(cluster) >= SHARED_SINCE else DRA_DEVICES


def container_log(node: Node, pod: dict[str, Any]) -> str:
    """What the pod's containers wrote, read from the node's /var/log/pods (the nodes report no
    address, so the API server cannot fetch logs)."""
    meta = pod["metadata"]
    pattern = node.path("log-pods", f"{meta['namespace']}_{meta['name']}_{meta['uid']}", "*", "*.log")
    text = ""
    for path in sorted(glob.glob(pattern)):
        with open(path, errors="replace") as f:
            text += f.read()
    return text


FALLBACK_SAYS = "the API server does not keep allowMultipleAllocations"


def test_dra_takes_the_shape_the_api_server_allows(whole: Cluster, published: Published) -> None:
    cluster, version = whole, whole.control_plane_version
    a = cluster.nodes["a"]
    devices = expected_devices(cluster)
    started = time.monotonic()
    notes = helm(cluster, "upgrade", "hyperlight", *dra_values(published, "both"), "--namespace", NAMESPACE).stdout
    # The chart's NOTES say what this API server does with an unchanged pod.
    if minor(cluster) >= SHARED_SINCE:
        assert f'(or with resources.limits["{HYPERVISOR}"] on nodes without the device plugin)' in notes, notes
    else:
        assert f"Kubernetes {version} keeps no DeviceClass extendedResourceName" in notes, notes
        assert "stay Pending on nodes without the device plugin" in notes, notes
    give_the_driver_api_access(cluster)
    wait_until(lambda: dra_ready(cluster, devices), 180, f"the DRA driver's slice of {devices} devices")
    (slice_,) = node_slices(cluster, "a")
    names = [d["name"] for d in slice_["spec"]["devices"]]
    (driver,) = daemonset_pods(cluster, DRA_DAEMONSET)
    said = [line for line in container_log(a, driver).splitlines() if FALLBACK_SAYS in line]
    deviceclass = cluster.api.get(f"/apis/resource.k8s.io/v1/deviceclasses/{DRA_DRIVER}")
    figure: dict[str, Any] = {
        "upgrade_to_slice_s": round(time.monotonic() - started, 1),
        "slice_devices": len(names),
        "fallback_log_lines": len(said),
        "deviceclass_extended_resource_name": deviceclass["spec"].get("extendedResourceName"),
    }
    if devices == 1:
        assert names == ["kvm"] and slice_["spec"]["devices"][0]["allowMultipleAllocations"] is True, slice_
        assert said == [], said
        assert deviceclass["spec"].get("extendedResourceName") == HYPERVISOR, deviceclass["spec"]
    else:
        assert names == [f"kvm-{i}" for i in range(DRA_DEVICES)], names
        # Said once, why and what instead.
        assert len(said) == 1 and f"publishing {DRA_DEVICES} identical devices instead" in said[0], said
        assert "extendedResourceName" not in deviceclass["spec"], deviceclass["spec"]

    # A claim through the DeviceClass (the example's template), as a non-root user.
    with open(DRA_WORKLOAD) as f:
        template = next(d for d in yaml.safe_load_all(f) if d["kind"] == "ResourceClaimTemplate")
    template["metadata"]["namespace"] = APPS
    cluster.api.create(f"/apis/resource.k8s.io/v1/namespaces/{APPS}/resourceclaimtemplates", template)
    pod = run_workload(cluster, dra_pod("dra-workload", SAYS))
    assert worked(pod), (pod["status"], termination_message(pod))

    # In mode both an unchanged pod is the device plugin's (node a's allocatable is above 0).
    pod = run_workload(cluster, workload_pod("unchanged", SAYS))
    assert worked(pod) and not through_dra(pod), (pod["status"], termination_message(pod))

    # The driver's pod deleted under DRA load (its successor takes over the slice).
    old = driver["metadata"]["uid"]

    def act() -> None:
        cluster.api.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{driver['metadata']['name']}", grace=None)

    def back() -> bool:
        pods = daemonset_pods(cluster, DRA_DAEMONSET)
        return bool(pods) and all(p["metadata"]["uid"] != old for p in pods) and dra_ready(cluster, devices)

    figure["driver_pod_deleted"] = dra_event(cluster, f"whole-{version}-driver-deleted", act, back)
    record(f"whole.{version}.dra", figure)
    event = figure["driver_pod_deleted"]
    assert event["failed"] == 0 and event["failed_prepares"] == [], event
    assert event["running_pod_untouched"] and event["slice_fewest_devices"] == devices, event


# The driver's line where the API server drops device taints (an unusable device leaves the slice).
NO_TAINTS_SAYS = "the API server does not keep device taints"


@full(FULL_ROWS)
def test_dra_device_unusable_helm_upgrade_and_helm_test_on_a_whole_cluster(
    whole: Cluster, published: Published
) -> None:
    """In the chart's mode both: the device made unusable (/dev/null bound over the driver's
    /dev/kvm) is tainted where the API server keeps device taints, else its devices leave the slice
    (the driver says why, once); a new pod waits, and runs when the device is usable again. Then
    `helm upgrade` to the other release under a DRA pod every 0.3 s, and `helm test` with both
    test pods."""
    cluster, version = whole, whole.control_plane_version
    a = cluster.nodes["a"]
    devices = expected_devices(cluster)
    wait_until(lambda: dra_ready(cluster, devices), 60, "the DRA driver ready")
    (driver,) = daemonset_pods(cluster, DRA_DAEMONSET)
    keeps_taints = minor(cluster) >= SHARED_SINCE
    pod, unusable_s, usable_s = unusable_then_usable(cluster, APPS, "dra-waits", SAYS, devices, keeps_taints)
    figure: dict[str, Any] = {"unusable_to_slice_s": unusable_s, "usable_to_slice_full_s": usable_s}
    assert worked(pod), (pod["status"], termination_message(pod))
    said = [line for line in container_log(a, driver).splitlines() if NO_TAINTS_SAYS in line]
    assert len(said) == (0 if keeps_taints else 1), said
    figure["no_taints_log_lines"] = len(said)

    # `helm upgrade` to the other release under DRA load.
    old = driver["metadata"]["uid"]
    target = other_release(running_release(published, daemonset_pods(cluster, DRA_DAEMONSET)))

    def act() -> None:
        helm(cluster, "upgrade", "hyperlight", *dra_values(published, "both", target), "--namespace", NAMESPACE)

    def back() -> bool:
        pods = daemonset_pods(cluster, DRA_DAEMONSET)
        return bool(pods) and all(p["metadata"]["uid"] != old for p in pods) and dra_ready(cluster, devices)

    event = dra_event(cluster, f"whole-{version}-dra-helm-upgrade", act, back)
    figure[f"helm_upgrade_to_{target}"] = event
    record(f"whole.{version}.dra_events", figure)
    assert event["failed"] == 0 and event["failed_prepares"] == [], event
    assert event["running_pod_untouched"] and event["slice_fewest_devices"] == devices, event

    assert helm_test(cluster) == {"hyperlight-test-device-plugin": "Succeeded", "hyperlight-test-dra": "Succeeded"}


def test_unchanged_pod_where_only_dra_serves_the_node(whole: Cluster, published: Published) -> None:
    """The chart's mode dra (no device plugin on the node): an unchanged `resources.limits` pod
    runs through DRA where the API server kept the DeviceClass's extendedResourceName, else stays
    Pending with the scheduler saying the resource is missing (docs/migrating-to-dra.md)."""
    cluster, version = whole, whole.control_plane_version
    a = cluster.nodes["a"]
    devices = expected_devices(cluster)
    helm(cluster, "upgrade", "hyperlight", *dra_values(published, "dra"), "--namespace", NAMESPACE)
    wait_until(lambda: not daemonset_pods(cluster, "hyperlight-device-plugin"), 120, "the device plugin's pod gone")
    wait_until(lambda: allocatable(a, HYPERVISOR) == 0, 120, "node a's allocatable hyperlight.dev/hypervisor at 0")
    wait_until(lambda: dra_ready(cluster, devices), 180, "the DRA driver ready")
    name = "unchanged-dra-only"
    cluster.api.create(f"/api/v1/namespaces/{APPS}/pods", workload_pod(name, SAYS))
    try:
        if minor(cluster) >= SHARED_SINCE:
            pod = finished(cluster, APPS, name)
            assert worked(pod) and through_dra(pod), (pod["status"], termination_message(pod))
            outcome = "ran through DRA"
        else:

            def refused() -> str:
                events = cluster.api.get(
                    f"/api/v1/namespaces/{APPS}/events", fieldSelector=f"involvedObject.name={name}"
                )
                return next(
                    (e["message"] for e in events["items"] if f"Insufficient {HYPERVISOR}" in e.get("message", "")), ""
                )

            message = wait_until(refused, 60, "a FailedScheduling event naming the resource")
            pod = cluster.api.get(f"/api/v1/namespaces/{APPS}/pods/{name}")
            assert pod["status"]["phase"] == "Pending" and not through_dra(pod), pod["status"]
            outcome = f"Pending: {message}"
        record(f"whole.{version}.unchanged_pod_dra_only", outcome)
    finally:
        cluster.api.delete(f"/api/v1/namespaces/{APPS}/pods/{name}")


def prepared_claims(node: Node) -> set[str]:
    """The claim UIDs the driver's record on node holds prepared."""
    uids: set[str] = set()
    for path in glob.glob(node.path("kubelet", "plugins", "*", "prepared.json")):
        with open(path) as f:
            uids |= set(json.load(f).get("claims", {}))
    return uids


# The rows whose API server drops the shared device: the upgrade to the newest changes the shape.
FALLBACK_ROWS = [row for row in ROWS if row.minor < SHARED_SINCE]


@full(FALLBACK_ROWS)
def test_control_plane_upgraded_under_a_running_driver(whole: Cluster) -> None:
    """The control plane moves to the newest minor (API server first, then controller-manager and
    scheduler) while the driver runs and a pod holds a claim. The driver keeps the shape it found
    at its start (it asks the API server when it starts, not later) and claims keep being served;
    its next start (a restart, an upgrade, `kubectl rollout restart`) publishes one shared device.
    The running pod's claim stays on its old device, untouched, and is unprepared when the pod ends."""
    cluster, version = whole, whole.control_plane_version
    assert expected_devices(cluster) == DRA_DEVICES
    a = cluster.nodes["a"]
    holder = dra_pod("holder", ["/bin/sh", "-c", "/kvmcheck && exec sleep 3600"])
    cluster.api.create(f"/api/v1/namespaces/{APPS}/pods", holder)
    before = running(cluster, APPS, "holder")
    (claim_status,) = before["status"]["resourceClaimStatuses"]
    claim = cluster.api.get(
        f"/apis/resource.k8s.io/v1/namespaces/{APPS}/resourceclaims/{claim_status['resourceClaimName']}"
    )
    (held,) = claim["status"]["allocation"]["devices"]["results"]
    assert held["device"].startswith("kvm-") and claim["metadata"]["uid"] in prepared_claims(a), held
    (driver,) = daemonset_pods(cluster, DRA_DAEMONSET)
    cluster.binaries("kubernetes", NEWEST.version)  # built (or its build waited for) before the clock starts

    started = time.monotonic()
    cluster.upgrade_control_plane(NEWEST.version)
    upgraded_s = time.monotonic() - started
    # Served on, in the shape found at the driver's start: a new claim gets one of the N devices.
    pod = run_workload(cluster, dra_pod("after-upgrade", SAYS))
    assert worked(pod), (pod["status"], termination_message(pod))
    assert slice_devices(cluster, "a") == DRA_DEVICES
    assert [p["metadata"]["uid"] for p in daemonset_pods(cluster, DRA_DAEMONSET)] == [driver["metadata"]["uid"]]

    # The driver's next start: one shared device.
    restarted = time.monotonic()
    cluster.api.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{driver['metadata']['name']}", grace=None)
    wait_until(
        lambda: (
            dra_ready(cluster, 1)
            and daemonset_pods(cluster, DRA_DAEMONSET)[0]["metadata"]["uid"] != driver["metadata"]["uid"]
        ),
        180,
        "the restarted driver's slice of one shared device",
    )
    shared_s = time.monotonic() - restarted
    (slice_,) = node_slices(cluster, "a")
    assert [d["name"] for d in slice_["spec"]["devices"]] == ["kvm"], slice_["spec"]
    pod = run_workload(cluster, dra_pod("after-restart", SAYS))
    assert worked(pod), (pod["status"], termination_message(pod))

    after = cluster.api.get(f"/api/v1/namespaces/{APPS}/pods/holder")
    untouched = (
        after["metadata"]["uid"] == before["metadata"]["uid"]
        and after["status"]["phase"] == "Running"
        and after["status"]["containerStatuses"][0]["restartCount"] == 0
    )
    assert untouched, after["status"]
    assert claim["metadata"]["uid"] in prepared_claims(a)
    ended = time.monotonic()
    cluster.api.delete(f"/api/v1/namespaces/{APPS}/pods/holder", grace=None)
    wait_until(lambda: claim["metadata"]["uid"] not in prepared_claims(a), 120, "the held claim unprepared")
    unprepared_s = time.monotonic() - ended
    failed, _ = failed_prepares(cluster, APPS)
    assert failed == [], failed
    record(
        f"whole.{version}.control_plane_to_{NEWEST.version}",
        {
            "upgrade_s": round(upgraded_s, 1),
            "restart_to_shared_device_s": round(shared_s, 1),
            "held_device": held["device"],
            "held_pod_untouched": untouched,
            "held_claim_unprepared_s": round(unprepared_s, 1),
        },
    )
