"""Many DRA publishers against a real etcd and kube-apiserver built from the pinned modules, and
what they cost the API server, read from its own side: its audit log (every request of the fleet,
with its user, verb, node, code and times) and its metrics. `python -m bench fleet` and
tests/test_fleet.py use it.

The publishers are the agent's own (dra.slices.SlicePublisher, dra.claims.ApiClaims, each node
with its own dra.client.KubeApi: its own httpx client, TLS connections, watch and backoff, as
separate agents have). They all run in one process, on one event loop in a thread of their own:
what each sends, and when it would send it, is what separate agents send; what they share is this
machine's two cores, which can delay a request under load but never adds or removes one.
"""

from __future__ import annotations

import asyncio
import calendar
import json
import os
import threading
import time
import urllib.parse
from typing import Any, AsyncIterator, Awaitable, NamedTuple, Optional, TypeVar

import yaml

from hyperlight_agent import contracts
from hyperlight_agent.dra import client as dra_client
from hyperlight_agent.dra.claims import ApiClaims
from hyperlight_agent.dra.slice_spec import DeviceInfo
from hyperlight_agent.dra.slices import WATCH_TIMEOUT_S, Pacing, SlicePublisher
from hyperlight_agent.dra.types import Json

from .cluster import Cluster

T = TypeVar("T")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN_DIR = os.path.join(ROOT, "build", "e2e", "bin")
DRIVER = contracts.DRA_DRIVER
KVM = DeviceInfo("kvm", 12, "/dev/kvm")
RBAC = os.path.join(ROOT, "deploy", "components", "dra", "dra-rbac.yaml")
# Every identity of a fleet is in this group: the audit policy records their requests (and only
# theirs), RBAC grants them the driver's ClusterRole.
GROUP = "hyperlight-fleet"
# etcd as kubeadm starts it (cmd/kubeadm/app/phases/etcd/local.go): it tells watchers, the API
# server's watch cache among them, of its progress every 5 s (etcd's own default: 10 minutes).
ETCD_ARGS = ("--watch-progress-notify-interval", "5s")
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  userGroups: ["{GROUP}"]
- level: None
"""
CLAIMS_PATH = f"/apis/{contracts.RESOURCE_API_GROUP}/{contracts.RESOURCE_API_VERSION}/namespaces/default/resourceclaims"


class Request(NamedTuple):
    """One request of the fleet, as the API server's audit log has it."""

    user: str
    verb: str  # list, watch, get, create, update, delete
    resource: str
    node: str  # the node it is about ("" for a create: its name is generated)
    code: int  # 0 while a watch is still open
    received: float  # epoch seconds
    ended: Optional[float]  # None while a watch is still open
    uri: str

    @property
    def timeout_s(self) -> Optional[float]:
        """A watch's timeoutSeconds."""
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.uri).query))
        return float(query["timeoutSeconds"]) if "timeoutSeconds" in query else None


def _epoch(stamp: str) -> float:
    """'2026-12-01T12:00:00.123456Z' as epoch seconds."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{fraction or 0}")


def _node(event: dict[str, Any]) -> str:
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(event.get("requestURI", "")).query))
    for term in query.get("fieldSelector", "").split(","):
        key, _, value = term.partition("=")
        if key == contracts.SLICE_FIELD_NODE:
            return str(value)
    name = str((event.get("objectRef") or {}).get("name", ""))
    return name.partition(f"-{DRIVER}-")[0].removesuffix("-claim")  # a slice's generated name, a claim's


class ControlPlane:
    """etcd and the API server only (tests/e2e/cluster.py's, with an audit log), and identities
    for fleets: client certificates in GROUP, bound to the driver's ClusterRole."""

    def __init__(self, directory: str, bin_dir: str = BIN_DIR) -> None:
        self.directory = directory
        self.cluster = Cluster(os.path.join(directory, "cluster"), bin_dir)
        self.audit_dir = os.path.join(directory, "audit")
        self.audit_log = os.path.join(self.audit_dir, "audit.log")
        self._read = 0  # how far the audit log has been read
        self._requests: dict[str, Request] = {}

    def start(self) -> None:
        os.makedirs(self.audit_dir, exist_ok=True)
        if os.path.exists(self.audit_log):
            os.unlink(self.audit_log)
        policy = os.path.join(self.audit_dir, "policy.yaml")
        with open(policy, "w") as f:
            f.write(AUDIT_POLICY)
        self.cluster.start(
            controllers=False,
            etcd_args=ETCD_ARGS,
            api_server_args=(
                "--audit-policy-file",
                policy,
                "--audit-log-path",
                self.audit_log,
                "--audit-log-maxsize",
                "0",
                "--audit-log-mode",
                "blocking",
            ),
        )
        with open(RBAC) as f:
            role = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "ClusterRole")
        api = self.cluster.api
        name = role["metadata"]["name"]
        api.create(
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": name},
                "rules": role["rules"],
            },
        )
        api.create(
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": GROUP}],
            },
        )

    def stop(self) -> None:
        self.cluster.stop()

    def kubeconfig(self, user: str, server: str = "") -> str:
        """A kubeconfig for `user` (in GROUP) to `server` (the API server's own address unless
        given: a relay in front of it)."""
        identity = self.cluster.pki.issue(f"fleet-{user}", f"/O={GROUP}/CN={user}")
        return self.cluster.pki.kubeconfig(f"fleet-{user}", server or self.cluster.server, identity)

    def requests(self) -> list[Request]:
        """Every request of the fleets so far, in the order received."""
        with open(self.audit_log, "rb") as f:
            f.seek(self._read)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # the server may be writing the last line
        self._read += len(complete)
        for line in complete.splitlines():
            event = json.loads(line)
            user = event["user"]["username"]
            ended = event["stage"] == "ResponseComplete"
            self._requests[event["auditID"]] = Request(
                user,
                event["verb"],
                str((event.get("objectRef") or {}).get("resource", "")),
                _node(event),
                int((event.get("responseStatus") or {}).get("code", 0)) if ended else 0,
                _epoch(event["requestReceivedTimestamp"]),
                _epoch(event["stageTimestamp"]) if ended else None,
                event.get("requestURI", ""),
            )
        return sorted(self._requests.values(), key=lambda r: r.received)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the API server's samples of metric `name` with these labels."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for family in text_string_to_metric_families(self.cluster.api.get("/metrics")):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def create_claim(self, node: str) -> tuple[str, str]:
        """A ResourceClaim allocated kvm-0 of `node`'s pool, as the scheduler leaves it: (name, uid)."""
        name = f"{node}-claim"
        claim = self.cluster.api.create(
            CLAIMS_PATH,
            {
                "apiVersion": f"{contracts.RESOURCE_API_GROUP}/{contracts.RESOURCE_API_VERSION}",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "hv", "exactly": {"deviceClassName": "hyperlight-kvm"}}]}},
            },
        )
        claim["status"] = {
            "allocation": {
                "devices": {"results": [{"request": "hv", "driver": DRIVER, "pool": node, "device": "kvm-0"}]},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
            }
        }
        self.cluster.api.request("PUT", f"{CLAIMS_PATH}/{name}/status", claim)
        return name, str(claim["metadata"]["uid"])


class LoopThread:
    """An event loop in a daemon thread: the fleets live there, the caller waits and reads."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fleet", daemon=True)
        self._thread.start()

    def call(self, work: Awaitable[T], timeout: float = 300) -> T:
        async def run() -> T:
            return await work

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_the_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.call(cancel_the_rest(), 60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class Fleet:
    """A publisher per node of `nodes`, each with its own client from `kubeconfig`, on the event
    loop it is started on. `bookmarks` counts the bookmarks their watches received."""

    def __init__(
        self, kubeconfig: str, nodes: list[str], watch_timeout_s: tuple[float, float] = WATCH_TIMEOUT_S
    ) -> None:
        self.kubeconfig = kubeconfig
        self.nodes = nodes
        self.watch_timeout_s = watch_timeout_s
        self.publishers: list[SlicePublisher] = []
        self.apis: list[dra_client.KubeApi] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.bookmarks = 0

    async def start(self, device: Optional[DeviceInfo] = KVM) -> None:
        for node in self.nodes:
            api = dra_client.connect(self.kubeconfig, environ={})
            self._count_bookmarks(api)
            publisher = SlicePublisher(api, node, DRIVER, pacing=Pacing(watch_timeout_s=self.watch_timeout_s))
            publisher.set_device(device)
            self.apis.append(api)
            self.publishers.append(publisher)
            self._tasks.append(asyncio.ensure_future(publisher.run()))

    def _count_bookmarks(self, api: dra_client.KubeApi) -> None:
        watch = api.watch_slices

        async def counting(*args: Any, **kwargs: Any) -> AsyncIterator[tuple[str, Json]]:
            async for kind, obj in watch(*args, **kwargs):
                self.bookmarks += kind == "BOOKMARK"
                yield kind, obj

        api.watch_slices = counting  # type: ignore[method-assign]

    async def stop(self) -> None:
        """As agents stopping: the publishers end, their connections close, the slices stay."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for api in self.apis:
            await api.close()
        self._tasks, self.publishers, self.apis = [], [], []

    async def restart(self) -> None:
        """Every agent stopped and started again (new process: new client, nothing remembered)."""
        await self.stop()
        await self.start()

    async def set_device(self, device: Optional[DeviceInfo]) -> None:
        for publisher in self.publishers:
            publisher.set_device(device)

    async def prepare(self, claims: list[tuple[str, str, str]]) -> None:
        """Each node's agent reads its claim, as NodePrepareResources does: (node, name, uid)."""
        readers = {p.node_name: ApiClaims(api) for p, api in zip(self.publishers, self.apis)}
        await asyncio.gather(*(readers[node].allocation("default", name, uid) for node, name, uid in claims))

    def published(self) -> bool:
        return len(self.publishers) == len(self.nodes) and all(p.standing.published for p in self.publishers)


def per_node(requests: list[Request], user: str, nodes: int, start: float, end: float) -> dict[str, float]:
    """The requests `user` sent in [start, end), by verb, per node (and "all")."""
    counts: dict[str, float] = {}
    for r in requests:
        if r.user == user and start <= r.received < end:
            counts[r.verb] = counts.get(r.verb, 0) + 1
    counts["all"] = sum(counts.values())
    return {verb: n / nodes for verb, n in counts.items()}


__all__ = ["KVM", "ControlPlane", "Fleet", "LoopThread", "Request", "per_node"]
