"""The ResourceSlice publisher against a fake API server on the test's own loop: plain HTTP/1.1 with
JSON bodies shaped as a v1.37 kube-apiserver's (tests/data/dra/, from the k8s.io/api types and the
apiserver's Status objects), which checks every request it gets (method, path, field selector,
body) and keeps its slices as the real one would (resourceVersion, 409 on a stale update,
generateName, watch events). Also the client's configuration errors and lazy import."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import subprocess
import sys
from typing import Any, Awaitable, Callable, Optional
from urllib.parse import parse_qsl, unquote, urlsplit

import pytest

from hyperlight_agent.dra import client as dra_client
from hyperlight_agent.dra.client import ApiError, ClientConfigError, KubeApi
from hyperlight_agent.dra.slices import DeviceInfo, SlicePublisher, desired_spec, essence
from tests.conftest import until
from tests.test_docs import ROOT

DATA = os.path.join(os.path.dirname(__file__), "data", "dra")
NODE = "node1"
DRIVER = "hyperlight.dev"
KVM = DeviceInfo("kvm", 12, "/dev/kvm")
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
SELECTOR = {"spec.nodeName": NODE, "spec.driver": DRIVER}
Json = dict[str, Any]


def recorded(name: str, **names: str) -> Any:
    """A recorded body; `names` replace the recorded object names (the slice name is random)."""
    with open(os.path.join(DATA, name)) as f:
        text = f.read()
    for old, new in names.items():
        text = text.replace(old.replace("_", "-"), new)
    return json.loads(text)


def status(name: str, object_name: str = "") -> tuple[int, Json]:
    body = recorded(name)
    if object_name:
        recorded_name = body["details"].get("name", "")
        body = json.loads(json.dumps(body).replace(recorded_name, object_name))
    return int(body["code"]), body


class Request:
    def __init__(self, method: str, path: str, query: dict[str, str], body: Optional[Json]) -> None:
        self.method, self.path, self.query, self.body = method, path, query, body

    @property
    def verb(self) -> str:
        if self.method == "GET":
            if self.path.startswith(SLICES_PATH):
                return "watch" if self.query.get("watch") == "true" else "list"
            return "get"
        return {"POST": "create", "PUT": "update", "DELETE": "delete"}[self.method]

    def __repr__(self) -> str:
        return f"{self.method} {self.path} {self.query}"


class FakeApiServer:
    """resourceslices (cluster-scoped) and resourceclaims (namespaced, read-only) of resource.k8s.io/v1."""

    def __init__(self) -> None:
        self.slices: dict[str, Json] = {}
        self.claims: dict[tuple[str, str], Json] = {}
        self.requests: list[Request] = []
        self.events: list[tuple[int, str, Json]] = []  # (resourceVersion, type, object)
        self.changed = asyncio.Condition()
        self.version = 1042
        self.names = 0
        self.faults: dict[str, list[tuple[int, Json]]] = {}  # verb → answers, first used first
        self.stuck: dict[str, tuple[int, Json]] = {}  # verb → answer, until cleared
        self.down = False  # close every connection at once, as a server going away
        self.refused = 0  # connections closed unanswered while down
        self.server: Optional[asyncio.base_events.Server] = None
        self.connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.server
        self.server.close()
        for writer in list(self.connections):
            writer.close()
        await self.server.wait_closed()

    async def go_down(self) -> None:
        self.down = True
        for writer in list(self.connections):
            writer.close()
        await self._notify()  # ends the watches

    # --- what someone else does to the slices (a kubelet start, an editor) ---

    async def put(self, obj: Json, event: str = "MODIFIED") -> Json:
        obj = copy.deepcopy(obj)
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.slices[obj["metadata"]["name"]] = obj
        await self._event(event, obj)
        return obj

    async def remove(self, name: str) -> Json:
        obj = self.slices.pop(name)
        self.version += 1
        await self._event("DELETED", dict(obj, metadata=dict(obj["metadata"], resourceVersion=str(self.version))))
        return obj

    async def _event(self, kind: str, obj: Json) -> None:
        async with self.changed:
            self.events.append((self.version, kind, copy.deepcopy(obj)))
            self.changed.notify_all()

    def ours(self) -> list[Json]:
        return [s for s in self.slices.values() if s["spec"].get("nodeName") == NODE and s["spec"]["driver"] == DRIVER]

    def of(self, verb: str) -> list[Request]:
        return [r for r in self.requests if r.verb == verb]

    # --- HTTP ---

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.add(writer)
        self.refused += self.down
        try:
            while not self.down:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode().split(" ", 2)
                headers = {}
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    key, _, value = header.decode().partition(":")
                    headers[key.strip().lower()] = value.strip()
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                if self.down:
                    return
                url = urlsplit(target)
                body = json.loads(raw) if raw else None
                request = Request(method, unquote(url.path), dict(parse_qsl(url.query)), body)
                self.requests.append(request)
                if request.verb == "watch" and not self._fault(request.verb, remove=False):
                    await self._watch(request, writer)
                    return
                code, body = self._answer(request)
                await self._notify()  # the watches send what this changed
                data = json.dumps(body).encode()
                writer.write(f"HTTP/1.1 {code} {'OK' if code < 300 else 'Error'}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            # Cancelled: the loop closing at the test's end; asyncio would log it as an error.
            return
        finally:
            self.connections.discard(writer)
            writer.close()

    def _fault(self, verb: str, remove: bool = True) -> Optional[tuple[int, Json]]:
        if verb in self.stuck:
            return self.stuck[verb]
        queued = self.faults.get(verb)
        if queued:
            return queued.pop(0) if remove else queued[0]
        return None

    def _answer(self, request: Request) -> tuple[int, Json]:  # noqa: PLR0911 - one return per verb reads best
        fault = self._fault(request.verb)
        if fault:
            return fault
        if request.verb == "get":
            return self._get_claim(request)
        assert request.path.startswith(SLICES_PATH), request
        name = request.path[len(SLICES_PATH) + 1:]
        if request.verb == "list":
            assert request.query.get("fieldSelector") == "spec.nodeName=node1,spec.driver=hyperlight.dev", request
            answer = recorded("resourceslice-list.json")
            answer["metadata"]["resourceVersion"] = str(self.version)
            answer["items"] = [{k: v for k, v in s.items() if k not in ("kind", "apiVersion")} for s in self.ours()]
            return 200, answer
        if request.verb == "create":
            return self._create(request)
        if request.verb == "update":
            return self._update(name, request)
        if name not in self.slices:
            return status("status-404-notfound.json", name)
        obj = self.slices.pop(name)  # ReturnDeletedObject: the API server answers with the object
        self.version += 1
        self.events.append((self.version, "DELETED", obj))
        return 200, obj

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _check_slice_body(self, body: Json) -> None:
        assert body["apiVersion"] == "resource.k8s.io/v1" and body["kind"] == "ResourceSlice"
        spec = body["spec"]
        assert set(spec) <= {"driver", "nodeName", "pool", "devices"}, spec
        assert spec["driver"] == DRIVER and spec["nodeName"] == NODE
        assert set(spec["pool"]) == {"name", "generation", "resourceSliceCount"} and spec["pool"]["name"] == NODE
        assert spec["pool"]["resourceSliceCount"] == 1 and isinstance(spec["pool"]["generation"], int)
        assert len(spec.get("devices", [])) <= 128 and spec.get("devices", None) != []  # omitempty, as the server
        for device in spec.get("devices", []):
            assert set(device) == {"name", "attributes"}
            for key, value in device["attributes"].items():
                assert len(key) <= 32 and key.isidentifier() and len(value) == 1

    def _create(self, request: Request) -> tuple[int, Json]:
        body = request.body
        assert body is not None
        self._check_slice_body(body)
        assert "name" not in body["metadata"] and body["metadata"]["generateName"] == "node1-hyperlight.dev-"
        template = recorded("resourceslice.json")
        self.names += 1
        self.version += 1
        name = f"node1-hyperlight.dev-{self.names:05d}"
        metadata = dict(template["metadata"], name=name, resourceVersion=str(self.version),
                        uid=f"00000000-0000-4000-8000-{self.names:012d}",
                        creationTimestamp=f"2026-11-30T10:15:{self.names:02d}Z")
        obj = {"kind": "ResourceSlice", "apiVersion": "resource.k8s.io/v1", "metadata": metadata, "spec": body["spec"]}
        self.slices[name] = obj
        self.events.append((self.version, "ADDED", copy.deepcopy(obj)))
        return 201, obj

    def _update(self, name: str, request: Request) -> tuple[int, Json]:
        body = request.body
        assert body is not None
        self._check_slice_body(body)
        assert body["metadata"]["name"] == name
        if name not in self.slices:
            return status("status-404-notfound.json", name)
        current = self.slices[name]
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return status("status-409-conflict.json", name)
        self.version += 1
        obj = dict(current, spec=body["spec"], metadata=dict(current["metadata"], resourceVersion=str(self.version)))
        self.slices[name] = obj
        self.events.append((self.version, "MODIFIED", copy.deepcopy(obj)))
        return 200, obj

    def _get_claim(self, request: Request) -> tuple[int, Json]:
        parts = request.path.split("/")
        assert parts[:4] == ["", "apis", "resource.k8s.io", "v1"] and parts[4] == "namespaces", request
        assert parts[6] == "resourceclaims" and len(parts) == 8, request
        claim = self.claims.get((parts[5], parts[7]))
        if claim is None:
            return status("status-404-claim.json", parts[7])
        return 200, claim

    async def _watch(self, request: Request, writer: asyncio.StreamWriter) -> None:
        assert request.query.get("fieldSelector") == "spec.nodeName=node1,spec.driver=hyperlight.dev", request
        since = int(request.query["resourceVersion"])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        fault = self._fault("watch")
        if fault:  # an ERROR event, as the server sends for an expired resourceVersion
            line = json.dumps({"type": "ERROR", "object": fault[1]}).encode() + b"\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(line), line))
            await writer.drain()
            return
        sent = since
        while not self.down:
            for version, kind, obj in list(self.events):
                if version > sent:
                    sent = version
                    if obj["spec"].get("nodeName") == NODE and obj["spec"]["driver"] == DRIVER:
                        line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                        writer.write(b"%x\r\n%s\r\n" % (len(line), line))
            await writer.drain()
            def news(last: int = sent) -> bool:
                return self.down or any(v > last for v, _, _ in self.events)

            async with self.changed:
                await self.changed.wait_for(news)


def kubeconfig(tmp_path: Any, server: str) -> str:
    path = os.path.join(str(tmp_path), "kubeconfig")
    with open(path, "w") as f:
        json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "test",
                   "clusters": [{"name": "test", "cluster": {"server": server}}],
                   "users": [{"name": "test", "user": {"token": "test-token"}}],
                   "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}, f)
    return path


Body = Callable[[FakeApiServer, KubeApi], Awaitable[None]]


def run(tmp_path: Any, body: Body, setup: Optional[Callable[[FakeApiServer], Awaitable[None]]] = None) -> None:
    async def main() -> None:
        fake = FakeApiServer()
        url = await fake.start()
        api = dra_client.connect(kubeconfig(tmp_path, url))
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
        dra_client.connect(missing)
    garbled = os.path.join(str(tmp_path), "garbled")
    with open(garbled, "w") as f:
        f.write("clusters: [")
    with pytest.raises(ClientConfigError, match=f"^kubeconfig {garbled}: "):
        dra_client.connect(garbled)
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
