"""The ResourceSlice publisher against a fake API server on the test's own loop: plain HTTP/1.1 with
JSON bodies shaped as a v1.37 kube-apiserver's (standin/apiserver.py). Also the client's
configuration errors and lazy import."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import subprocess
import sys
from typing import Any, Awaitable, Callable, Optional

import pytest

from hyperlight_agent.dra import client as dra_client
from hyperlight_agent.dra.client import ApiError, ClientConfigError, KubeApi
from hyperlight_agent.dra.slices import DeviceInfo, SlicePublisher, desired_spec, essence
from standin.apiserver import DRIVER, NODE, SLICES_PATH, FakeApiServer, kubeconfig, recorded, status
from tests.conftest import until
from tests.test_docs import ROOT

KVM = DeviceInfo("kvm", 12, "/dev/kvm")


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


async def publishing(fake: FakeApiServer, api: KubeApi, check: Callable[[SlicePublisher], Awaitable[None]],
                     device: Optional[DeviceInfo] = KVM, count: int = 4, leaves_slice: bool = True) -> None:
    publisher = SlicePublisher(api, NODE, DRIVER, count, backoff_initial_s=0.01, backoff_cap_s=0.05)
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
    return len(ours) == 1 and essence(ours[0]["spec"]) == publisher.desired()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("hyperlight")]


# --- the slice ---


def test_desired_spec_names_n_identical_devices_with_qualified_attributes() -> None:
    spec = desired_spec(NODE, DRIVER, 3, KVM)
    assert [d["name"] for d in spec["devices"]] == ["kvm-0", "kvm-1", "kvm-2"]
    assert spec["devices"][0]["attributes"] == {"hypervisor": {"string": "kvm"}, "apiVersion": {"int": 12},
                                                "devicePath": {"string": "/dev/kvm"}}
    assert spec["pool"] == {"name": NODE, "resourceSliceCount": 1}
    assert desired_spec(NODE, DRIVER, 3, None)["devices"] == []


def test_the_default_is_128_devices_and_more_than_one_slice_holds_is_refused() -> None:
    api: Any = object()
    assert SlicePublisher(api, NODE).count == 128
    with pytest.raises(ValueError, match="129: must be 1 to 128"):
        SlicePublisher(api, NODE, DRIVER, 129)
    with pytest.raises(ValueError, match="0: must be 1 to 128"):
        SlicePublisher(api, NODE, DRIVER, 0)


def test_the_server_omitting_an_empty_device_list_is_no_difference() -> None:
    recorded_slice = recorded("resourceslice.json")
    assert essence(recorded_slice["spec"]) == desired_spec(NODE, DRIVER, 1, KVM)
    assert essence({k: v for k, v in desired_spec(NODE, DRIVER, 1, None).items() if k != "devices"}) == \
        desired_spec(NODE, DRIVER, 1, None)


def test_first_publish_creates_the_slice_with_generate_name(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.published, what="published")
            assert publisher.first_published_at is not None and publisher.last_error == ""
            assert equal_to_desired(fake, publisher)
            (create,) = fake.of("create")
            assert create.path == SLICES_PATH
            assert create.body and create.body["spec"]["pool"]["generation"] == 1
            assert [d["name"] for d in create.body["spec"]["devices"]] == ["kvm-0", "kvm-1", "kvm-2", "kvm-3"]
            assert publisher.slice_name == fake.ours()[0]["metadata"]["name"]
            await until(lambda: fake.of("watch"), what="a watch")
            assert fake.of("watch")[0].query["resourceVersion"] == "1042"  # from the list
        await publishing(fake, api, check)
    run(tmp_path, body)


def test_a_deleted_slice_is_created_again(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.published and fake.of("watch"), what="published")
            first = publisher.slice_name
            await fake.remove(first)  # the kubelet's wipe at its start
            await until(lambda: len(fake.of("create")) == 2 and equal_to_desired(fake, publisher), what="re-created")
            (again,) = fake.ours()
            assert again["metadata"]["name"] != first and again["spec"]["pool"]["generation"] == 2
            await until(lambda: publisher.published and publisher.slice_name == again["metadata"]["name"])
        await publishing(fake, api, check)
    run(tmp_path, body)


def test_an_edited_slice_is_restored_with_one_line(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.published and fake.of("watch"), what="published")
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
            await until(lambda: publisher.published, what="published")
            publisher.set_device(None)
            assert not publisher.published
            await until(lambda: publisher.published, what="published empty")
            (empty,) = fake.ours()
            assert "devices" not in empty["spec"] and empty["spec"]["pool"]["generation"] == 2
            update = fake.of("update")[-1].body
            assert update and "devices" not in update["spec"]
            publisher.set_device(DeviceInfo("mshv", 0, "/dev/mshv"))
            await until(lambda: publisher.published, what="published again")
            (back,) = fake.ours()
            assert [d["name"] for d in back["spec"]["devices"]][:1] == ["mshv-0"]
            assert back["spec"]["pool"]["generation"] == 3 and len(fake.of("create")) == 1
        await publishing(fake, api, check)
    run(tmp_path, body)


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
            await until(lambda: publisher.published, what="published")
            assert [r.path for r in fake.of("delete")] == [f"{SLICES_PATH}/s1"]
            assert sorted(fake.slices) == ["s0", "s2", "s3"]  # the oldest of ours stays, updated
            assert fake.slices["s0"]["spec"]["pool"]["generation"] == 6
            assert equal_to_desired(fake, publisher) and not fake.of("create")
        await publishing(fake, api, check)
    run(tmp_path, body, setup)


def test_a_conflict_is_read_again_and_retried_without_a_warning(tmp_path: Any,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.published, what="published")
            fake.faults["update"] = [status("status-409-conflict.json", publisher.slice_name)]
            publisher.set_device(None)
            await until(lambda: publisher.published, what="published after the conflict")
            assert len(fake.of("update")) == 2 and "devices" not in fake.ours()[0]["spec"]
            assert warnings(caplog) == []
        await publishing(fake, api, check)
    run(tmp_path, body)


def test_an_expired_watch_is_listed_again(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        fake.faults["watch"] = [(410, recorded("watch-error-410.json")["object"])]

        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: len(fake.of("watch")) >= 2, what="a second watch")
            assert len(fake.of("list")) >= 2 and publisher.published and publisher.last_error == ""
        await publishing(fake, api, check)
    run(tmp_path, body)


def test_a_server_that_goes_away_is_said_once_and_backed_off(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hyperlight_agent")

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: publisher.published and fake.of("watch"), what="published")
            await fake.go_down()
            publisher.set_device(None)
            await until(lambda: fake.refused >= 4, what="retries")
            assert "API server unreachable" in publisher.last_error and not publisher.published
            assert len(warnings(caplog)) == 1 and "unreachable" in warnings(caplog)[0]
            fake.down = False
            await until(lambda: publisher.published, what="published after the server came back")
            assert publisher.last_error == "" and "devices" not in fake.ours()[0]["spec"]
            assert any("published again" in r.getMessage() for r in caplog.records)
        await publishing(fake, api, check)
    run(tmp_path, body)


def test_forbidden_names_the_verb_and_resource_once(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        fake.stuck["list"] = status("status-403-list.json")

        async def check(publisher: SlicePublisher) -> None:
            await until(lambda: len(fake.of("list")) >= 4, what="retries")
            (line,) = warnings(caplog)
            assert line.startswith("list resourceslices.resource.k8s.io: forbidden (RBAC needs verb 'list' on "
                                   "'resourceslices' in API group 'resource.k8s.io')"), line
            assert "\n" not in line and publisher.last_error in line and not publisher.published
            del fake.stuck["list"]
            await until(lambda: publisher.published, what="published once allowed")
        await publishing(fake, api, check)
    run(tmp_path, body)


def test_an_api_server_without_resource_v1_is_said_plainly(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        fake.stuck["list"] = status("status-404-api.json")

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
    with pytest.raises(ClientConfigError, match=f"^kubeconfig {missing}: .*not found"):
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
    assert str(ApiError("create", "resourceslices", 0, "", "ConnectError: refused")) == \
        "create resourceslices.resource.k8s.io: API server unreachable: ConnectError: refused"
    assert str(ApiError("update", "resourceslices", 422, "Invalid", "spec.devices: Too many")) == \
        "update resourceslices.resource.k8s.io: 422 Invalid: spec.devices: Too many"


def test_the_device_plugin_modes_never_load_the_api_client() -> None:
    code = ("import sys, hyperlight_agent.agent, hyperlight_agent.dra.slices, hyperlight_agent.dra.claims; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightkube', 'httpx', 'httpcore', 'anyio')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
