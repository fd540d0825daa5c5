"""A fake Kubernetes API server for the DRA mode's tests and benchmarks, not shipped: plain
HTTP/1.1 on 127.0.0.1 with JSON bodies shaped as a v1.37 kube-apiserver's (standin/data/dra/, from
the k8s.io/api types and the apiserver's Status objects). It serves resourceslices (cluster-scoped)
and resourceclaims (namespaced, read-only) of resource.k8s.io/v1, checks every request it gets
(method, path, field selector, body) and keeps its slices as the real one would (resourceVersion,
409 on a stale update, generateName, watch events)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
from typing import Any, Callable, Optional
from urllib.parse import parse_qsl, unquote, urlsplit

DATA = os.path.join(os.path.dirname(__file__), "data", "dra")
# When the real API server's watch cache sends bookmarks (k8s.io/apiserver pkg/storage/cacher, 1.34
# and 1.37 alike): each watch that allowed them is looked at every minute from its start
# (defaultBookmarkFrequency), and 2 s before its deadline, and gets a bookmark at the cache's
# version only if that has moved past the version the watch started from. Never more often.
BOOKMARK_INTERVAL_S = 60.0
BOOKMARK_BEFORE_DEADLINE_S = 2.0
NODE = "node1"
DRIVER = "hypervisor.hyperlight.dev"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
ACCESS_REVIEWS_PATH = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
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
    def __init__(self, method: str, path: str, query: dict[str, str], body: Optional[Json], at: float = 0.0) -> None:
        self.method, self.path, self.query, self.body = method, path, query, body
        self.at = at  # the loop's time when it came

    @property
    def verb(self) -> str:
        if self.method == "GET":
            if self.path.startswith(SLICES_PATH):
                return "watch" if self.query.get("watch") == "true" else "list"
            return "get"
        return {"POST": "create", "PUT": "update", "DELETE": "delete"}[self.method]

    def __repr__(self) -> str:
        return f"{self.method} {self.path} {self.query}"


DISCOVERY_PATH = "/apis/resource.k8s.io/v1"
# The start of a watch's answer (only watches answer in chunks): a test that freezes a watch's
# connection once it was answered waits for a proxy to have forwarded this (standin.proxy).
WATCH_ANSWERED = b"Transfer-Encoding: chunked"


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
        self.end_watches = False  # answer every watch with an empty stream that ends at once
        # Applied to every written slice's spec, as a mutating admission webhook would.
        self.mutate: Optional[Callable[[Json], None]] = None
        # False: a server without DRAConsumableCapacity (before 1.36, or switched off), which drops
        # a device's allowMultipleAllocations on the way in (dropDisabledFields), unless the slice
        # it replaces already had it.
        self.consumable_capacity = True
        # False: a server without DRADeviceTaints (before 1.36, or switched off), which drops a
        # device's taints on the way in, unless the slice it replaces already had some.
        self.device_taints = True
        # (verb, resource) pairs a SelfSubjectAccessReview is told are not allowed.
        self.denied: set[tuple[str, str]] = set()
        # Whether resource.k8s.io/v1 is served (its discovery document; before 1.34 it is not).
        self.serves_v1 = True
        self.refused = 0  # connections closed unanswered while down
        self.bookmark_interval_s = BOOKMARK_INTERVAL_S  # tests shorten it, as they shorten timeouts
        # How long a watch waits before the server starts it (and its timeout): a busy server's
        # priority-and-fairness queues hold requests for seconds.
        self.watch_queue_s = 0.0
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

    async def inject(self, kind: str, obj: Json) -> None:
        """An event sent to the watches as it is (say, one without a resourceVersion)."""
        self.version += 1
        await self._event(kind, obj)

    async def advance(self) -> None:
        """The version moves on without an event for our node: another node's slice changed, or
        etcd told the cache of its progress (the cacher's version is the cluster's etcd revision)."""
        self.version += 1
        await self._notify()

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
                request = Request(
                    method, unquote(url.path), dict(parse_qsl(url.query)), body, asyncio.get_running_loop().time()
                )
                self.requests.append(request)
                if request.verb == "watch" and not self._fault(request.verb, remove=False):
                    await self._watch(request, writer)
                    return
                code, body = self._answer(request)
                await self._notify()  # the watches send what this changed
                data = json.dumps(body).encode()
                writer.write(
                    f"HTTP/1.1 {code} {'OK' if code < 300 else 'Error'}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
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
        if request.method == "GET" and request.path == DISCOVERY_PATH:
            # Discovery: open to every authenticated user (the system:discovery role).
            if not self.serves_v1:
                return 404, {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "reason": "NotFound",
                    "code": 404,
                }
            return 200, {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": "resource.k8s.io/v1",
                "resources": [],
            }
        fault = self._fault(request.verb)
        if fault:
            return fault
        if request.verb == "get":
            return self._get_claim(request)
        if request.path == ACCESS_REVIEWS_PATH:
            return self._review(request)
        assert request.path.startswith(SLICES_PATH), request
        name = request.path[len(SLICES_PATH) + 1 :]
        if request.verb == "list":
            # The field selectors ResourceSlices offer, each "field=value", all of them ANDed.
            wanted = dict(part.split("=", 1) for part in request.query.get("fieldSelector", "").split(",") if part)
            assert set(wanted) <= {"spec.nodeName", "spec.driver"}, request
            answer = recorded("resourceslice-list.json")
            answer["metadata"]["resourceVersion"] = str(self.version)
            answer["items"] = [
                {k: v for k, v in s.items() if k not in ("kind", "apiVersion")}
                for s in self.slices.values()
                if all(s["spec"].get(field.split(".")[1]) == value for field, value in wanted.items())
            ]
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

    def _review(self, request: Request) -> tuple[int, Json]:
        """A SelfSubjectAccessReview, answered as the RBAC authorizer would for `denied`."""
        assert request.method == "POST" and request.body is not None
        assert request.body["kind"] == "SelfSubjectAccessReview", request.body
        attributes = request.body["spec"]["resourceAttributes"]
        allowed = (attributes["verb"], attributes["resource"]) not in self.denied
        status: Json = {"allowed": allowed}
        if allowed:
            status["reason"] = 'RBAC: allowed by ClusterRoleBinding "hyperlight-dra-driver"'
        return 201, dict(request.body, metadata={"creationTimestamp": None}, status=status)

    def _drop_disabled(self, spec: Json, old: Optional[Json]) -> Json:
        """The spec as stored: a copy, without the fields of features the server does not have."""
        spec = copy.deepcopy(spec)
        in_use = any("allowMultipleAllocations" in d for d in (old or {}).get("devices", []))
        if not self.consumable_capacity and not in_use:
            for device in spec.get("devices", []):
                device.pop("allowMultipleAllocations", None)
        tainted = any(d.get("taints") for d in (old or {}).get("devices", []))
        for device in spec.get("devices", []):
            if not self.device_taints and not tainted:
                device.pop("taints", None)
            for taint in device.get("taints", []):
                # Set on the way in where not given (the real server: the time of the write).
                taint.setdefault("timeAdded", "2026-11-30T10:20:00Z")
        return spec

    def _check_slice_body(self, body: Json) -> None:
        assert body["apiVersion"] == "resource.k8s.io/v1" and body["kind"] == "ResourceSlice"
        spec = body["spec"]
        assert set(spec) <= {"driver", "nodeName", "pool", "devices"}, spec
        assert spec["driver"] == DRIVER and spec["nodeName"] == NODE
        assert set(spec["pool"]) == {"name", "generation", "resourceSliceCount"} and spec["pool"]["name"] == NODE
        assert spec["pool"]["resourceSliceCount"] == 1 and isinstance(spec["pool"]["generation"], int)
        assert len(spec.get("devices", [])) <= 128 and spec.get("devices", None) != []  # omitempty, as the server
        # With a taint on any device, a slice holds at most 64 devices (validation.go).
        assert not any("taints" in d for d in spec.get("devices", [])) or len(spec["devices"]) <= 64, spec
        for device in spec.get("devices", []):
            assert set(device) - {"allowMultipleAllocations", "taints"} == {"name", "attributes"}, device
            for key, value in device["attributes"].items():
                assert len(key) <= 32 and key.isidentifier() and len(value) == 1
            assert 1 <= len(device.get("taints", [None])) <= 16, device  # listType atomic, omitempty
            for taint in device.get("taints", []):
                check_taint(taint)

    @staticmethod
    def _dry_run(request: Request) -> bool:
        """?dryRun=All: every stage of the write (defaults, dropped fields, validation, a conflict)
        but the storing; the answer is what would be stored. The server knows no other value."""
        assert set(request.query) <= {"dryRun"} and request.query.get("dryRun", "All") == "All", request
        return "dryRun" in request.query

    def _create(self, request: Request) -> tuple[int, Json]:
        body = request.body
        assert body is not None
        self._check_slice_body(body)
        dry_run = self._dry_run(request)
        assert "name" not in body["metadata"] and body["metadata"]["generateName"] == "node1-hypervisor.hyperlight.dev-"
        template = recorded("resourceslice.json")
        names, version = self.names + 1, self.version + 1
        name = f"node1-hypervisor.hyperlight.dev-{names:05d}"
        metadata = dict(
            template["metadata"],
            name=name,
            resourceVersion=str(version),
            uid=f"00000000-0000-4000-8000-{names:012d}",
            creationTimestamp=f"2026-11-30T10:15:{names:02d}Z",
        )
        body = dict(body, spec=self._drop_disabled(body["spec"], None))  # the request stays as sent
        if self.mutate is not None:
            self.mutate(body["spec"])
        obj = {"kind": "ResourceSlice", "apiVersion": "resource.k8s.io/v1", "metadata": metadata, "spec": body["spec"]}
        if dry_run:
            return 201, obj
        self.names, self.version = names, version
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
        version = self.version + 1
        body = dict(body, spec=self._drop_disabled(body["spec"], current["spec"]))
        if self.mutate is not None:
            self.mutate(body["spec"])
        obj = dict(current, spec=body["spec"], metadata=dict(current["metadata"], resourceVersion=str(version)))
        if self._dry_run(request):
            return 200, obj
        self.version = version
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
        """As the real server: events after resourceVersion; with timeoutSeconds the watch ends
        then; bookmarks (with allowWatchBookmarks) only when and as the real one sends them; an
        ERROR event for a fault."""
        assert request.query.get("fieldSelector") == f"spec.nodeName={NODE},spec.driver={DRIVER}", request
        since = int(request.query["resourceVersion"])
        timeout = float(request.query["timeoutSeconds"]) if "timeoutSeconds" in request.query else None
        await asyncio.sleep(self.watch_queue_s)
        loop = asyncio.get_running_loop()
        ends = None if timeout is None else loop.time() + timeout
        look = None  # when the next bookmark may be due
        if request.query.get("allowWatchBookmarks") == "true":
            look = self._next_look(loop.time(), ends)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + WATCH_ANSWERED + b"\r\n\r\n")
        if self.end_watches:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return
        fault = self._fault("watch")
        if fault:  # an ERROR event, as the server sends for an expired resourceVersion
            self._chunk(writer, {"type": "ERROR", "object": fault[1]})
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return
        sent = since
        while not self.down:
            for version, kind, obj in list(self.events):
                if version > sent:
                    sent = version
                    if obj["spec"].get("nodeName") == NODE and obj["spec"]["driver"] == DRIVER:
                        self._chunk(writer, {"type": kind, "object": obj})
            await writer.drain()

            def news(last: int = sent) -> bool:
                return self.down or any(v > last for v, _, _ in self.events)

            wake = min((t for t in (ends, look) if t is not None), default=None)
            try:
                async with self.changed:
                    await asyncio.wait_for(self.changed.wait_for(news), None if wake is None else wake - loop.time())
            except asyncio.TimeoutError:
                pass
            now = loop.time()
            if look is not None and now >= look:
                if self.version > since:  # compared with where the watch started, as the cacher does
                    self._chunk(
                        writer,
                        {
                            "type": "BOOKMARK",
                            "object": {
                                "kind": "ResourceSlice",
                                "apiVersion": "resource.k8s.io/v1",
                                "metadata": {"resourceVersion": str(self.version)},
                            },
                        },
                    )
                look = self._next_look(now, ends)
            if ends is not None and now >= ends:
                writer.write(b"0\r\n\r\n")  # the end of a watch whose time is up
                await writer.drain()
                return

    def _next_look(self, now: float, ends: Optional[float]) -> Optional[float]:
        """The cacher's next look at a watch (cache_watcher.go, nextBookmarkTime): a minute on, or
        2 s before its deadline if that is sooner; none once that moment has passed."""
        due = now + self.bookmark_interval_s
        if ends is not None:
            due = min(due, ends - BOOKMARK_BEFORE_DEADLINE_S)
        return None if due < now else due

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, event: Json) -> None:
        line = json.dumps(event).encode() + b"\n"
        writer.write(b"%x\r\n%s\r\n" % (len(line), line))


# A qualified label name (an optional DNS-subdomain prefix and "/"), and a label value.
_LABEL_NAME = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def check_taint(taint: Json) -> None:
    """A DeviceTaint as the 1.37 API server validates it: a label name for its key (name part at
    most 63 characters), a label value (at most 63), an effect it knows; timeAdded optional."""
    assert set(taint) <= {"key", "value", "effect", "timeAdded"}, taint
    key, value = taint["key"], taint.get("value", "")
    assert _LABEL_NAME.fullmatch(key) and len(key.rsplit("/", 1)[-1]) <= 63, taint
    assert _LABEL_VALUE.fullmatch(value) and len(value) <= 63, taint
    assert taint["effect"] in ("None", "NoSchedule", "NoExecute"), taint


def kubeconfig(tmp_path: Any, server: str) -> str:
    path = os.path.join(str(tmp_path), "kubeconfig")
    with open(path, "w") as f:
        json.dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": server}}],
                "users": [{"name": "test", "user": {"token": "test-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            },
            f,
        )
    return path
