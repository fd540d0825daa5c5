"""The ResourceSlice publisher against a fake API server on the test's own loop: plain HTTP/1.1 with
JSON bodies shaped as a v1.37 kube-apiserver's (standin/apiserver.py). Also the client's
configuration errors and lazy import."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import os
import subprocess
import sys
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple, Optional

import pytest

from hyperlight_agent.dra import client as dra_client
from hyperlight_agent.dra import slices, watch_liveness
from hyperlight_agent.dra.client import ApiError, ClientConfigError, KubeApi
from hyperlight_agent.dra.slice_spec import DeviceInfo, desired_spec, owned
from hyperlight_agent.dra.slices import WATCH_TIMEOUT_S, Pacing, SlicePublisher
from hyperlight_agent.dra.taints import Taint
from standin.apiserver import (
    DRIVER,
    NODE,
    SLICES_PATH,
    WATCH_ANSWERED,
    FakeApiServer,
    Json,
    kubeconfig,
    recorded,
    status,
)
from tests.conftest import until
from tests.test_docs import ROOT

KVM = DeviceInfo("kvm", 12, "/dev/kvm")
QUICK = Pacing(0.01, 0.05)  # retries within a test's time


Body = Callable[[FakeApiServer, KubeApi], Awaitable[None]]


def run(tmp_path: Any, body: Body, setup: Optional[Callable[[FakeApiServer], Awaitable[None]]] = None) -> None:
    async def main() -> None:
        fake = FakeApiServer()
        url = await fake.start()
        api = dra_client.connect(kubeconfig(tmp_path, url), environ={})
        try:
            if setup:
                await setup(fake)
            await asyncio.wait_for(body(fake, api), 20)
        finally:
            await api.close()
            await fake.stop()

    asyncio.run(main())


async def publishing(
    fake: FakeApiServer,
    api: KubeApi,
    check: Callable[[SlicePublisher], Awaitable[None]],
    device: Optional[DeviceInfo] = KVM,
    count: int = 4,
    leaves_slice: bool = True,
    shared: bool = False,
) -> None:
    """A publisher of `count` identical devices (of one shared device with `shared`)."""
    publisher = SlicePublisher(api, NODE, DRIVER, count, pacing=QUICK, shared=shared)
    publisher.set_device(device)
    task = asyncio.ensure_future(publisher.run())
    try:
        await check(publisher)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    if leaves_slice:
        assert fake.ours(), "closing leaves the slice for a successor"


def equal_to_desired(fake: FakeApiServer, publisher: SlicePublisher) -> bool:
    ours = fake.ours()
    return len(ours) == 1 and owned(ours[0]["spec"]) == publisher.desired()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("hyperlight")]


# --- the slice ---


def test_slices_under_the_drivers_earlier_name_are_deleted_once(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """This node's slices of the driver's name before the first release go before our first write;
    another node's, and anyone else's driver's, stay (issue 29: 4)."""
    caplog.set_level(logging.INFO, "hyperlight_agent")

    def old(name: str, node: str, driver: str) -> Json:
        return {
            "metadata": {"name": name, "resourceVersion": "5", "creationTimestamp": "t"},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [],
            },
        }

    async def setup(fake: FakeApiServer) -> None:
        fake.slices.update(
            {
                "ours-before": old("ours-before", NODE, "hyperlight.dev"),
                "elsewhere": old("elsewhere", "node2", "hyperlight.dev"),
                "someone": old("someone", NODE, "gpu.example.com"),
            }
        )

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            assert sorted(fake.slices) == sorted(["elsewhere", "someone", publisher.standing.slice_name])
            deletes = [r for r in fake.requests if r.method == "DELETE"]
            assert [r.path.rsplit("/", 1)[1] for r in deletes] == ["ours-before"]
            assert (
                "ResourceSlice ours-before: published under driver hyperlight.dev, our name before "
                f"{DRIVER}; deleting it" in caplog.text
            )

        await publishing(fake, api, check)

    run(tmp_path, body, setup)


def test_nothing_is_written_before_the_first_check_says_what_the_device_is(tmp_path: Any) -> None:
    """A successor starting beside its predecessor (whose slice stands) must not publish an empty
    slice while its first check runs: the scheduler would see the node's devices go (issue 29: 6)."""

    async def setup(fake: FakeApiServer) -> None:
        fake.slices["kept"] = {
            "metadata": {"name": "kept", "resourceVersion": "7", "creationTimestamp": "t"},
            "spec": {
                **desired_spec(NODE, DRIVER, 4, KVM),
                "pool": {"name": NODE, "generation": 3, "resourceSliceCount": 1},
            },
        }

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        publisher = SlicePublisher(api, NODE, DRIVER, 4, pacing=QUICK)
        task = asyncio.ensure_future(publisher.run())
        try:
            await until(lambda: publisher.looks >= 1, what="a first look at the server's slices")
            await until(lambda: publisher.requests >= 2, what="the watch")
            assert not [r for r in fake.requests if r.method != "GET"], "no write before a check"
            assert len(fake.ours()[0]["spec"]["devices"]) == 4
            publisher.set_device(None)  # the first check: no usable device
            await until(lambda: fake.ours()[0]["spec"].get("devices", []) == [], what="the devices leave")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(tmp_path, body, setup)


def test_desired_spec_names_n_identical_devices_with_qualified_attributes() -> None:
    spec = desired_spec(NODE, DRIVER, 3, KVM)
    assert [d["name"] for d in spec["devices"]] == ["kvm-0", "kvm-1", "kvm-2"]
    assert spec["devices"][0]["attributes"] == {
        "hypervisor": {"string": "kvm"},
        "apiVersion": {"int": 12},
        "devicePath": {"string": "/dev/kvm"},
    }
    assert spec["pool"] == {"name": NODE, "resourceSliceCount": 1}
    assert desired_spec(NODE, DRIVER, 3, None)["devices"] == []


def test_the_publisher_reports_writes_api_errors_and_watch_restarts(tmp_path: Any) -> None:
    """What the metrics count (dra/outcomes.py, slice_event)."""
    events: list[tuple[str, ...]] = []

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        publisher = SlicePublisher(
            api,
            NODE,
            DRIVER,
            4,
            pacing=Pacing(0.01, 0.05, watch_timeout_s=(2.0, 2.0)),
            shared=False,
            on_event=lambda *e: events.append(e),
        )
        publisher.set_device(KVM)
        task = asyncio.ensure_future(publisher.run())
        try:
            await until(lambda: publisher.standing.published, what="published")
            fake.end_watches = True  # every watch ends at once: early
            await until(lambda: ("watch", "early") in events, what="an early end counted")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(tmp_path, body)
    assert events[0] == ("write", "create")
    assert ("api_error", "watch", "0") in events


def test_desired_spec_with_sharing_is_one_device_every_claim_may_share() -> None:
    spec = desired_spec(NODE, DRIVER, 3, KVM, shared=True)
    assert spec["devices"] == [
        {
            "name": "kvm",
            "allowMultipleAllocations": True,
            "attributes": {
                "hypervisor": {"string": "kvm"},
                "apiVersion": {"int": 12},
                "devicePath": {"string": "/dev/kvm"},
            },
        }
    ]
    assert owned(spec) == spec, "the field is ours to compare"
    assert desired_spec(NODE, DRIVER, 3, None, shared=True)["devices"] == []


def test_one_shared_device_where_the_server_keeps_it_and_identical_devices_where_it_drops_it(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def shared(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            assert publisher.shared and publisher.published_devices == 1 and equal_to_desired(fake, publisher)
            assert fake.ours()[0]["spec"]["devices"][0]["allowMultipleAllocations"] is True

        await publishing(fake, api, shared, shared=True)
        fake.slices.clear()
        fake.consumable_capacity = False  # 1.34, 1.35: dropped on the way in

        async def dropped(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            assert not publisher.shared and publisher.published_devices == 4 and equal_to_desired(fake, publisher)
            writes = [r for r in fake.requests if r.method in ("POST", "PUT")]
            assert len(writes) == 2, "one write to find out, one with the identical devices"
            # Found out by a dry run: the stored slice never held the one device, which the
            # scheduler would have handed to one claim at a time (seen on a real 1.35 cluster).
            assert [w.query for w in writes] == [{"dryRun": "All"}, {}], writes
            assert [len(obj["spec"]["devices"]) for _, _, obj in fake.events[before:]] == [4], fake.events

        fake.requests.clear()
        before = len(fake.events)
        await publishing(fake, api, dropped, shared=True)

    run(tmp_path, body)


def test_the_default_is_128_devices_and_more_than_one_slice_holds_is_refused() -> None:
    api: Any = object()
    assert SlicePublisher(api, NODE).identical_devices == 128
    with pytest.raises(ValueError, match="129: must be 1 to 128"):
        SlicePublisher(api, NODE, DRIVER, 129)
    with pytest.raises(ValueError, match="0: must be 1 to 128"):
        SlicePublisher(api, NODE, DRIVER, 0)


def test_a_dead_connection_is_found_within_two_minutes_though_watches_last_minutes() -> None:
    # Issue 26, 3 and issue 40, 6: a slice deleted behind a connection that stopped forwarding is
    # back within 2 minutes whatever the network does: the watch is given up by the longest of its
    # silences (no answer; no first bookmark; none after one), with room for a new watch, a list and
    # a write; the watches themselves last client-go's 5-10 minutes.
    low, high = slices.WATCH_TIMEOUT_S
    assert (low, high) == (300, 600), slices.WATCH_TIMEOUT_S
    silence = max(dra_client.WATCH_ANSWER_S, watch_liveness.WATCH_HEARTBEAT_S)  # the first bookmark's too
    assert silence + 2 * dra_client.REQUEST_TIMEOUT_S <= 120 and silence < low, silence


def test_the_server_omitting_an_empty_device_list_is_no_difference() -> None:
    recorded_slice = recorded("resourceslice.json")
    assert owned(recorded_slice["spec"]) == desired_spec(NODE, DRIVER, 1, KVM)
    assert owned({k: v for k, v in desired_spec(NODE, DRIVER, 1, None).items() if k != "devices"}) == desired_spec(
        NODE, DRIVER, 1, None
    )


def test_first_publish_creates_the_slice_with_generate_name(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            assert publisher.standing.first_published_at is not None and publisher.last_error == ""
            assert equal_to_desired(fake, publisher)
            (create,) = fake.of("create")
            assert create.path == SLICES_PATH
            assert create.body and create.body["spec"]["pool"]["generation"] == 1
            assert [d["name"] for d in create.body["spec"]["devices"]] == ["kvm-0", "kvm-1", "kvm-2", "kvm-3"]
            assert publisher.standing.slice_name == fake.ours()[0]["metadata"]["name"]
            await until(lambda: fake.of("watch"), what="a watch")
            assert fake.of("watch")[0].query["resourceVersion"] == "1042"  # from the list

        await publishing(fake, api, check)

    run(tmp_path, body)


def test_a_deleted_slice_is_created_again(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published and fake.of("watch"), what="published")
            first = publisher.standing.slice_name
            await fake.remove(first)  # the kubelet's wipe at its start
            await until(lambda: len(fake.of("create")) == 2 and equal_to_desired(fake, publisher), what="re-created")
            (again,) = fake.ours()
            assert again["metadata"]["name"] != first and again["spec"]["pool"]["generation"] == 2
            await until(
                lambda: publisher.standing.published and publisher.standing.slice_name == again["metadata"]["name"]
            )

        await publishing(fake, api, check)

    run(tmp_path, body)


def test_an_edited_slice_is_restored_with_one_line(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published and fake.of("watch"), what="published")
            (mine,) = fake.ours()
            edited = copy.deepcopy(mine)
            edited["spec"]["devices"] = edited["spec"]["devices"][:1]
            edited["spec"]["pool"]["generation"] = 7
            await fake.put(edited)
            await until(lambda: fake.of("update") and equal_to_desired(fake, publisher), what="restored")
            (restored,) = fake.ours()
            assert restored["spec"]["pool"]["generation"] == 8  # past the editor's
            assert warnings(caplog) == [f"ResourceSlice {mine['metadata']['name']} edited by someone else; restoring"]

        await publishing(fake, api, check)

    run(tmp_path, body)


def test_an_unusable_device_leaves_the_slice_and_comes_back(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            publisher.set_device(None)
            assert not publisher.standing.published
            await until(lambda: publisher.standing.published, what="published empty")
            (empty,) = fake.ours()
            assert "devices" not in empty["spec"] and empty["spec"]["pool"]["generation"] == 2
            update = fake.of("update")[-1].body
            assert update and "devices" not in update["spec"]
            publisher.set_device(DeviceInfo("mshv", 0, "/dev/mshv"))
            await until(lambda: publisher.standing.published, what="published again")
            (back,) = fake.ours()
            assert [d["name"] for d in back["spec"]["devices"]][:1] == ["mshv-0"]
            assert back["spec"]["pool"]["generation"] == 3 and len(fake.of("create")) == 1

        await publishing(fake, api, check)

    run(tmp_path, body)


PROBE = Taint("probe", "NoSchedule")


def tainted(fake: FakeApiServer) -> list[list[Json]]:
    """Each device's taints as the server keeps them."""
    (ours,) = fake.ours()
    return [d.get("taints", []) for d in ours["spec"].get("devices", [])]


def test_an_unusable_device_stays_with_our_taint_which_goes_on_recovery(tmp_path: Any) -> None:
    """Issue 40, 3: the devices stay, each with the taint (the server adds timeAdded, which is not
    ours to compare); its effect changes in one update; a passing check removes it."""

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            publisher.set_device(KVM, PROBE)
            assert not publisher.standing.published
            await until(lambda: publisher.standing.published, what="published with the taint")
            taints = tainted(fake)
            assert len(taints) == 4 and all(t == taints[0] for t in taints)
            (taint,) = taints[0]
            assert {k: v for k, v in taint.items() if k != "timeAdded"} == {
                "key": "hyperlight.dev/unusable",
                "value": "probe",
                "effect": "NoSchedule",
            } and taint["timeAdded"]
            assert fake.ours()[0]["spec"]["devices"][0]["attributes"]["hypervisor"] == {"string": "kvm"}
            updates = len(fake.of("update"))
            publisher.set_device(KVM, Taint("probe", "NoExecute"))
            await until(lambda: publisher.standing.published, what="NoExecute")
            assert [t["effect"] for t in tainted(fake)[0]] == ["NoExecute"] and len(fake.of("update")) == updates + 1
            publisher.set_device(KVM)
            await until(lambda: publisher.standing.published, what="the taint gone")
            assert tainted(fake) == [[]] * 4 and publisher.taints

        await publishing(fake, api, check)

    run(tmp_path, body)


def test_a_tainted_slice_holds_at_most_64_identical_devices(tmp_path: Any) -> None:
    """The API server refuses more than 64 devices in a slice once any has a taint."""
    spec = desired_spec(NODE, DRIVER, 128, KVM, taint=PROBE)
    assert [d["name"] for d in spec["devices"]] == [f"kvm-{i}" for i in range(64)]
    assert len(desired_spec(NODE, DRIVER, 128, KVM)["devices"]) == 128
    assert len(desired_spec(NODE, DRIVER, 128, KVM, shared=True, taint=PROBE)["devices"]) == 1

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            publisher.set_device(KVM, PROBE)
            await until(lambda: publisher.standing.published, what="64 tainted devices")
            assert len(tainted(fake)) == 64
            publisher.set_device(KVM)
            await until(lambda: publisher.standing.published, what="128 again")
            assert len(tainted(fake)) == 128

        await publishing(fake, api, check, count=128)

    run(tmp_path, body)


def test_a_server_without_device_taints_gets_the_device_out_of_the_slice_said_once(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 40, 3: an API server that drops taints on the way in (before 1.36, DRADeviceTaints off)
    is found out by the first tainted write; from then on an unusable device leaves the slice, as
    before taints, said in one line however often it happens."""
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        fake.device_taints = False

        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            for _ in range(3):
                publisher.set_device(KVM, PROBE)
                await until(lambda: publisher.standing.published, what="published without the device")
                assert "devices" not in fake.ours()[0]["spec"] and not publisher.taints
                publisher.set_device(KVM)
                await until(lambda: publisher.standing.published, what="back")
                assert len(fake.ours()[0]["spec"]["devices"]) == 4
            said = [r.getMessage() for r in caplog.records if "does not keep device taints" in r.getMessage()]
            assert len(said) == 1 and "an unusable device leaves the slice instead" in said[0], said
            assert [bool(r.body and "taints" in str(r.body)) for r in fake.of("update")].count(True) == 1
            # Found out by a dry run: the stored slice never held the unusable device untainted.
            stored = [len(obj["spec"].get("devices", [])) for _, _, obj in fake.events]
            assert stored == [4, 0, 4, 0, 4, 0, 4], stored

        await publishing(fake, api, check)

    run(tmp_path, body)


def test_only_our_taint_is_compared_without_the_time_the_server_added() -> None:
    spec = desired_spec(NODE, DRIVER, 1, KVM, taint=PROBE)
    stored = copy.deepcopy(spec)
    stored["devices"][0]["taints"] = [
        {"key": "example.com/other", "value": "x", "effect": "NoSchedule"},
        {**PROBE.as_json(), "timeAdded": "2026-11-30T10:20:00Z"},
    ]
    assert owned(stored) == spec
    stored["devices"][0]["taints"] = [{"key": "example.com/other", "value": "x", "effect": "NoSchedule"}]
    assert owned(stored) == desired_spec(NODE, DRIVER, 1, KVM)


def test_duplicates_are_deleted_and_other_slices_left_alone(tmp_path: Any) -> None:
    async def setup(fake: FakeApiServer) -> None:
        template = recorded("resourceslice.json")
        owners = [(NODE, DRIVER), (NODE, DRIVER), ("node2", DRIVER), (NODE, "gpu.example.com")]
        for i, (node, driver) in enumerate(owners):
            obj = copy.deepcopy(template)
            obj["metadata"]["name"] = f"s{i}"
            obj["metadata"]["creationTimestamp"] = f"2026-11-30T10:00:0{i}Z"
            obj["spec"].update(nodeName=node, driver=driver)
            obj["spec"]["pool"]["generation"] = 5
            await fake.put(obj, "ADDED")

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            assert [r.path for r in fake.of("delete")] == [f"{SLICES_PATH}/s1"]
            assert sorted(fake.slices) == ["s0", "s2", "s3"]  # the oldest of ours stays, updated
            assert fake.slices["s0"]["spec"]["pool"]["generation"] == 6
            assert equal_to_desired(fake, publisher) and not fake.of("create")

        await publishing(fake, api, check)

    run(tmp_path, body, setup)


def test_a_conflict_is_read_again_and_retried_without_a_warning(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published, what="published")
            fake.faults["update"] = [status("status-409-conflict.json", publisher.standing.slice_name)]
            publisher.set_device(None)
            await until(lambda: publisher.standing.published, what="published after the conflict")
            assert len(fake.of("update")) == 2 and "devices" not in fake.ours()[0]["spec"]
            assert warnings(caplog) == []

        await publishing(fake, api, check)

    run(tmp_path, body)


def test_an_expired_watch_is_listed_again(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        fake.faults["watch"] = [(410, recorded("watch-error-410.json")["object"])]

        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: len(fake.of("watch")) >= 2, what="a second watch")
            assert len(fake.of("list")) >= 2 and publisher.standing.published and publisher.last_error == ""

        await publishing(fake, api, check)

    run(tmp_path, body)


def test_a_server_that_goes_away_is_said_once_and_backed_off(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hyperlight_agent")

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.standing.published and fake.of("watch"), what="published")
            await fake.go_down()
            publisher.set_device(None)
            await until(lambda: fake.refused >= 4, what="retries")
            assert "API server unreachable" in publisher.last_error and not publisher.standing.published
            assert len(warnings(caplog)) == 1 and "unreachable" in warnings(caplog)[0]
            fake.down = False
            # A connection the server dropped while down may still fail one request (a pooled one):
            # that is said, and the next look clears it.
            await until(
                lambda: publisher.standing.published and publisher.last_error == "",
                what="published, and no error left, after the server came back",
            )
            assert "devices" not in fake.ours()[0]["spec"]
            assert any("published again" in r.getMessage() for r in caplog.records)

        await publishing(fake, api, check)

    run(tmp_path, body)


def test_forbidden_names_the_verb_and_resource_once(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        fake.stuck["list"] = status("status-403-list.json")

        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: len(fake.of("list")) >= 4, what="retries")
            (line,) = warnings(caplog)
            assert line.startswith(
                "list resourceslices.resource.k8s.io: forbidden (RBAC needs verb 'list' on "
                "'resourceslices' in API group 'resource.k8s.io')"
            ), line
            assert "\n" not in line and publisher.last_error in line and not publisher.standing.published
            del fake.stuck["list"]
            await until(lambda: publisher.standing.published, what="published once allowed")

        await publishing(fake, api, check)

    run(tmp_path, body)


@pytest.mark.parametrize("answer", ["status-404-api.json", "status-404-page.json"])  # 1.35-1.37, 1.38
def test_an_api_server_without_resource_v1_is_said_plainly(tmp_path: Any, answer: str) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        fake.stuck["list"] = status(answer)

        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.last_error, what="an error")
            assert "does not serve resource.k8s.io/v1" in publisher.last_error

        await publishing(fake, api, check, leaves_slice=False)

    run(tmp_path, body)


# --- the client ---


def test_client_errors_name_the_path_or_setting(tmp_path: Any) -> None:
    with pytest.raises(ClientConfigError, match=r"^no kubeconfig setting and not in a cluster \(KUBERNETES_"):
        dra_client.connect(None, environ={})
    missing = os.path.join(str(tmp_path), "nope")
    with pytest.raises(ClientConfigError, match=f"^kubeconfig {missing}: No such file or directory$"):
        dra_client.connect(missing, environ={})
    garbled = os.path.join(str(tmp_path), "garbled")
    with open(garbled, "w") as f:
        f.write("clusters: [")
    with pytest.raises(ClientConfigError, match=f"^kubeconfig {garbled}: "):
        dra_client.connect(garbled, environ={})
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ClientConfigError, match=f"^service account {tmp_path}: .*token"):
        dra_client.connect(None, service_account_dir=str(tmp_path), environ=env)


def test_api_errors_are_one_line() -> None:
    assert (
        str(ApiError("create", "resourceslices", 0, "", "ConnectError: refused"))
        == "create resourceslices.resource.k8s.io: API server unreachable: ConnectError: refused"
    )
    assert (
        str(ApiError("update", "resourceslices", 422, "Invalid", "spec.devices: Too many"))
        == "update resourceslices.resource.k8s.io: 422 Invalid: spec.devices: Too many"
    )


def test_the_device_plugin_modes_never_load_the_api_client() -> None:
    code = (
        "import sys, hyperlight_agent.agent, hyperlight_agent.dra.slices, hyperlight_agent.dra.claims; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightkube', 'httpx', 'httpcore', 'anyio')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


# --- hostile neighbours and a broken network (issue 26) ---


async def publisher_on(
    api: KubeApi, count: int = 4, watch_timeout_s: tuple[float, float] = WATCH_TIMEOUT_S, **kw: Any
) -> tuple[SlicePublisher, asyncio.Task[None]]:
    pacing = Pacing(0.05, 0.4, watch_timeout_s)
    publisher = SlicePublisher(api, NODE, DRIVER, count, pacing=pacing, **{"shared": False, **kw})
    publisher.set_device(KVM)
    return publisher, asyncio.ensure_future(publisher.run())


async def stopped(*tasks: asyncio.Task[None]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)


class Publishing(NamedTuple):
    fake: FakeApiServer
    publisher: SlicePublisher
    proxy: Any  # standin.proxy.FreezingProxy, when asked for


@contextlib.asynccontextmanager
async def running_publisher(
    tmp_path: Any,
    fake: Optional[FakeApiServer] = None,
    proxied: bool = False,
    client: Optional[dict[str, Any]] = None,
    **kw: Any,
) -> AsyncIterator[Publishing]:
    """A fake API server (`fake`, set up by the test, or a new one), a client to it (through a
    FreezingProxy when `proxied`; `client`: connect()'s options) and a publisher running on it
    (`kw`: publisher_on's); all stopped at the end."""
    from standin.proxy import FreezingProxy

    fake = fake or FakeApiServer()
    url = await fake.start()
    proxy = FreezingProxy("127.0.0.1", int(url.rsplit(":", 1)[1]), markers=(WATCH_ANSWERED,)) if proxied else None
    if proxy is not None:
        url = await proxy.start()
    api = dra_client.connect(kubeconfig(tmp_path, url), environ={}, **(client or {}))
    publisher, task = await publisher_on(api, **kw)
    try:
        yield Publishing(fake, publisher, proxy)
    finally:
        await stopped(task)
        await api.close()
        if proxy is not None:
            await proxy.stop()
        await fake.stop()


# 3: a deleted slice comes back whatever the network does to the watch's connection.
async def test_a_slice_deleted_behind_a_silent_watch_is_back_within_the_watch_timeout(tmp_path: Any) -> None:
    events: list[tuple[str, ...]] = []
    async with running_publisher(
        tmp_path,
        proxied=True,
        client={"watch_grace_s": 0.5},
        watch_timeout_s=(1.0, 1.0),
        on_event=lambda *e: events.append(e),
    ) as (fake, publisher, proxy):
        await until(lambda: publisher.standing.published and fake.of("watch"), what="published")
        proxy.freeze()  # the watch's connection stops forwarding: no FIN, no RST
        await fake.remove(publisher.standing.slice_name)  # as a starting kubelet does
        await until(lambda: len(fake.ours()) == 1, what="the slice back")
        await until(lambda: publisher.standing.published, what="published again")
        # Found out by the client giving up the silent watch (an ApiError of no HTTP status), not
        # by a wall-clock bound a loaded machine could miss.
        assert ("api_error", "watch", "0") in events and ("watch", "failed") in events, events


# The same with watches of minutes, as by default: once the server's bookmarks come, the slice is
# back a heartbeat after the connection went silent, not at the watch's end.
async def test_a_slice_deleted_behind_a_silent_watch_is_back_within_a_heartbeat(tmp_path: Any) -> None:
    events: list[tuple[str, ...]] = []
    fake = FakeApiServer()
    fake.bookmark_interval_s = 0.2
    async with running_publisher(
        tmp_path,
        fake,
        proxied=True,
        client={"watch_heartbeat_s": 0.6},
        watch_timeout_s=(60.0, 60.0),
        on_event=lambda *e: events.append(e),
    ) as (_, publisher, proxy):
        await until(lambda: publisher.standing.published and fake.of("watch"), what="published")
        await fake.advance()  # the cluster moves on: the server's bookmarks start
        await until(lambda: publisher._informer.listed_version == str(fake.version), what="a bookmark")
        await deleted_behind_a_frozen_watch(fake, publisher, proxy, events)


async def deleted_behind_a_frozen_watch(
    fake: FakeApiServer, publisher: SlicePublisher, proxy: Any, events: list[tuple[str, ...]]
) -> None:
    """The watch's connection stops forwarding and the slice is deleted: it is back long before
    the 60 s watch would end, by a new watch from where the last one was (no list)."""
    proxy.freeze()
    await fake.remove(publisher.standing.slice_name)
    await until(lambda: len(fake.ours()) == 1, what="the slice back")
    assert ("api_error", "watch", "0") in events, events
    lists = [r for r in fake.of("list") if r.query["fieldSelector"].endswith(f"spec.driver={DRIVER}")]
    assert len(fake.of("watch")) == 2 and len(lists) == 1, "a new watch, from where it was: no list"


# Issue 40, 6: with client-go's long watches, a connection that stopped forwarding before the
# watch's first bookmark is found at that bookmark's due, not at the watch's end.
async def test_a_slice_deleted_behind_a_watch_frozen_before_its_first_bookmark_is_back(tmp_path: Any) -> None:
    events: list[tuple[str, ...]] = []
    fake = FakeApiServer()
    fake.bookmark_interval_s = 0.4
    fake.watch_queue_s = 0.3  # the server holds the watch a moment before answering (as a busy one does)
    # The slice is there and right already (an agent restart): the watch hears nothing at first.
    spec = desired_spec(NODE, DRIVER, 4, KVM)
    metadata = {"name": f"{NODE}-{DRIVER}-x7k2p", "creationTimestamp": "2026-11-30T10:15:00Z"}
    await fake.put({"metadata": metadata, "spec": dict(spec, pool=dict(spec["pool"], generation=1))}, "ADDED")
    async with running_publisher(
        tmp_path,
        fake,
        proxied=True,
        client={"first_bookmark_s": 0.8},
        watch_timeout_s=(60.0, 60.0),
        on_event=lambda *e: events.append(e),
    ) as (_, publisher, proxy):
        # The watch's answer went down to the client before the freeze (a freeze between the
        # request and its answer is another case: the answer's own deadline, a minute).
        await until(lambda: publisher.standing.published and proxy.seen[WATCH_ANSWERED], what="the watch answered")
        assert not fake.of("create") and not fake.of("update")
        # Before the first bookmark (the server would send it 0.4 s after the answer).
        await deleted_behind_a_frozen_watch(fake, publisher, proxy, events)


# Issue 29, 7: publishers that fail together (an API server restart meets every node at once)
# retry apart, so the server meets them spread out: the backoff is jittered.
async def test_publishers_failing_together_retry_apart(tmp_path: Any) -> None:
    fakes, apis = [FakeApiServer() for _ in range(20)], []
    for i, fake in enumerate(fakes):
        fake.stuck["list"] = status("status-403-list.json")
        os.mkdir(os.path.join(str(tmp_path), str(i)))
        apis.append(dra_client.connect(kubeconfig(os.path.join(str(tmp_path), str(i)), await fake.start()), environ={}))
    publishers = [SlicePublisher(api, NODE, DRIVER, 4, pacing=Pacing(0.8, 1.6)) for api in apis]
    for publisher in publishers:
        publisher.set_device(KVM)
    tasks = [asyncio.ensure_future(publisher.run()) for publisher in publishers]
    try:
        await until(lambda: all(len(fake.of("list")) >= 3 for fake in fakes), what="three lists each")
        # Each failed at once, retried at once, failed again, then waited 0.4-0.8 s (0.8 s jittered).
        waits = [fake.of("list")[2].at - fake.of("list")[1].at for fake in fakes]
        assert min(waits) >= 0.4 - 0.01, waits
        assert max(waits) - min(waits) > 0.1, f"twenty waits within {max(waits) - min(waits):.3f} s: not jittered"
    finally:
        await stopped(*tasks)
        for api in apis:
            await api.close()
        for fake in fakes:
            await fake.stop()


# 5: a watch that ends at once, or is refused with 410 every time, is retried with backoff.
@pytest.mark.parametrize("fault", ["ends at once", "410 every time"])
async def test_a_watch_that_keeps_ending_is_backed_off_not_a_hot_loop(
    tmp_path: Any, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeApiServer()
    if fault == "ends at once":
        fake.end_watches = True
    else:
        fake.stuck["watch"] = (410, recorded("watch-error-410.json")["object"])
    async with running_publisher(tmp_path, fake) as (_, publisher, _):
        await until(lambda: publisher.standing.published, what="published")
        await asyncio.sleep(1.5)  # a window to count requests in, not synchronisation
        watches, lists = len(fake.of("watch")), len(fake.of("list"))
        # Backoff 0 (the first retry), then 0.05 doubling to 0.4, each 0.5-1.0 of that: at most ~12.
        assert watches <= 14 and lists <= 14, (watches, lists)
        (said,) = warnings(caplog)  # the streak, once
        assert ("ended the watch after" if fault == "ends at once" else "410 Expired") in said, said


# 6: two instances of the driver for one node (a surge update changing the device count): the
# older yields to the newer, and the slice is written a bounded number of times.
async def test_two_publishers_for_one_node_do_not_fight(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeApiServer()
    url = await fake.start()
    api = dra_client.connect(kubeconfig(tmp_path, url), environ={})
    alive = {"new": True}

    async def newer_than_old() -> Optional[str]:
        return "new" if alive["new"] else None

    async def nobody() -> Optional[str]:
        return None

    old, old_task = await publisher_on(api, count=8, newer=newer_than_old)
    alive["new"] = False
    try:
        await until(lambda: old.standing.published, what="the old instance published")
        alive["new"] = True
        new, new_task = await publisher_on(api, count=4, newer=nobody)
        await until(
            lambda: new.standing.published and len(fake.ours()[0]["spec"]["devices"]) == 4, what="the new one's slice"
        )
        writes = len(fake.of("update")) + len(fake.of("create"))
        await asyncio.sleep(1.0)  # a window in which a fight would show, not synchronisation
        assert len(fake.of("update")) + len(fake.of("create")) == writes, "nobody rewrote the new slice"
        assert len(fake.ours()[0]["spec"]["devices"]) == 4 and writes <= 3
        await until(lambda: old.standing.kept_by == "new" and old.standing.published, what="the old one yielded")
        # The newer instance gone, the old one keeps the slice again (its own count).
        await stopped(new_task)
        alive["new"] = False
        old.wake()
        await until(
            lambda: len(fake.ours()[0]["spec"]["devices"]) == 8 and old.standing.kept_by == "", what="taken back"
        )
    finally:
        await stopped(old_task)
        await api.close()
        await fake.stop()
    assert not [w for w in warnings(caplog) if "edited" in w], warnings(caplog)


# 7: what others add to the slice is not ours to compare; what the server changes on write is
# accepted once, not fought.
@pytest.mark.parametrize("webhook", ["adds an attribute", "changes ours"])
async def test_a_mutating_webhook_neither_starves_readiness_nor_causes_rewrites(
    tmp_path: Any, webhook: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeApiServer()

    def mutate(spec: dict[str, Any]) -> None:
        for device in spec.get("devices", []):
            if webhook == "adds an attribute":
                device["attributes"]["vendor.example.com/zone"] = {"string": "a"}
            else:
                device["attributes"]["devicePath"] = {"string": "/dev/elsewhere"}

    fake.mutate = mutate
    async with running_publisher(tmp_path, fake) as (_, publisher, _):
        await until(lambda: publisher.standing.published and fake.of("watch"), what="published")
        await asyncio.sleep(0.5)  # a window in which a rewrite loop would show, not synchronisation
        assert len(fake.of("create")) == 1 and not fake.of("update")
        assert publisher.standing.published and publisher.last_error == ""
        said = [w for w in warnings(caplog) if "changed what we wrote" in w]
        assert len(said) == (1 if webhook == "changes ours" else 0), warnings(caplog)


# 16: a watch event without a resourceVersion ends that watch, not the publisher.
async def test_an_unreadable_event_is_followed_by_a_new_watch_that_still_repairs(tmp_path: Any) -> None:
    async with running_publisher(tmp_path) as (fake, publisher, _):
        await until(lambda: publisher.standing.published and fake.of("watch"), what="published")
        watches = len(fake.of("watch"))
        await fake.inject("MODIFIED", {"metadata": {"name": "x"}, "spec": {"nodeName": NODE, "driver": DRIVER}})
        await until(lambda: len(fake.of("watch")) > watches, what="a new watch")
        await fake.remove(publisher.standing.slice_name)
        await until(lambda: len(fake.ours()) == 1 and publisher.standing.published, what="the deleted slice back")


# 21: a repeated edit is answered every time but said once.
async def test_repeated_edits_are_restored_and_said_once(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    async with running_publisher(tmp_path) as (fake, publisher, _):
        await until(lambda: publisher.standing.published and fake.of("watch"), what="published")

        def restored(edits: int) -> bool:
            return len(fake.of("update")) == edits and equal_to_desired(fake, publisher)

        for i in range(10):
            (mine,) = fake.ours()
            edited = copy.deepcopy(mine)
            edited["spec"]["devices"] = edited["spec"]["devices"][:1]
            await fake.put(edited)
            await until(functools.partial(restored, i + 1), what=f"edit {i} restored")
        said = [w for w in warnings(caplog) if "edited by someone else" in w]
        assert len(said) == 1, said
