"""The Kubernetes API as the DRA mode uses it: this node's ResourceSlices and single ResourceClaims,
as plain JSON dicts, with every failure as one `ApiError`.

lightkube reads the kubeconfig (or the pod's service account) and builds the authenticated HTTP
client: TLS, client certificates, bearer tokens, token files and exec credential plugins. The six
requests are our own, on that client, because its request layer did not hold against a broken
environment: a credential plugin's failure escaped as an untranslated exception (the agent
exited), its watch re-opened a watch the server had ended at once, with no backoff (a hot loop),
waited on a silent connection forever (no read deadline) and ended on an event without a
resourceVersion with a KeyError. Here every request has a deadline, a watch ends (and says why)
rather than resuming by itself, and anything the server or a credential plugin does wrong is an
ApiError naming what we asked.

The only module that imports lightkube (and with it httpx), and only inside `connect()`: the
device-plugin modes never talk to the API and never pay for the client (ARCHITECTURE.md).

Why: docs/decisions/dra-our-own-requests.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Mapping, Optional

from hyperlight_agent import contracts, text, waits
from hyperlight_agent.dra.types import Json
from hyperlight_agent.dra.watch_liveness import (
    BOOKMARK_MARGIN_S,
    WATCH_GRACE_S,
    WATCH_HEARTBEAT_S,
    Bookmarks,
    Watch,
)

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

IN_CLUSTER_ENV = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
# Every request but a watch gives up after this long.
REQUEST_TIMEOUT_S = 10.0
# TCP keepalive on every connection to the API server: a peer gone from the network (a crashed
# node behind a load balancer, a NAT entry dropped) is found after this much silence and the
# probes, also before a watch's first bookmark. A proxy that stopped forwarding but still answers
# the probes is for the bookmarks to find.
KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_COUNT = 3
# A healthy server answers a watch (its headers, or 429) within a minute: priority and fairness
# queues a request at most that long (k8s.io/apiserver pkg/server/filters/priority-and-fairness.go,
# getRequestWaitContext). No answer in that and the margin: the request went down a dead connection.
QUEUE_LIMIT_S = 60.0
WATCH_ANSWER_S = QUEUE_LIMIT_S + BOOKMARK_MARGIN_S
# Far above any real kubeconfig (embedded certificates included) or watch event line (an object
# is at most 3 MiB in etcd): anything bigger is not ours to parse.
MAX_KUBECONFIG_BYTES = 4 << 20
MAX_EVENT_BYTES = 4 << 20
# What the server's answer is made of when a credential plugin or token file fails inside a
# request: the `reason` of such an ApiError.
CREDENTIALS = "credentials"

SLICES = "resourceslices"
CLAIMS = "resourceclaims"
SLICES_PATH = f"/apis/{contracts.RESOURCE_API_GROUP}/{contracts.RESOURCE_API_VERSION}/{SLICES}"
WATCH_EVENTS = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")
ACCESS_REVIEWS = "selfsubjectaccessreviews"
ACCESS_REVIEWS_PATH = f"/apis/authorization.k8s.io/v1/{ACCESS_REVIEWS}"


class ClientConfigError(Exception):
    """No way to reach the API: no kubeconfig and not in a cluster, or a kubeconfig that cannot be used."""


class ApiError(Exception):
    """A request the API server refused (code ≥ 400) or never answered (code 0: refused connection,
    timeout, TLS, credentials, an unreadable answer). One line: what we asked, and what came back."""

    def __init__(self, verb: str, resource: str, code: int, reason: str, message: str, name: str = "") -> None:
        self.verb, self.resource, self.code, self.reason, self.message = verb, resource, code, reason, message
        # The object the server's Status names (its details.name): a 404 that names one says that
        # object does not exist; one that names none says the path is not served (Kubernetes 1.38
        # answers an unserved path with a Status whose message is "404 page not found").
        self.name = name
        super().__init__(str(self))

    @property
    def missing(self) -> bool:
        """The server said the object we asked for does not exist (not: the API is not served)."""
        return self.code == 404 and bool(self.name)

    @property
    def problem(self) -> str:
        """What stays the same across retries of one problem: said once, not once per retry (an
        unreachable server fails lists, watches and writes alike, each with its own detail)."""
        if self.code == 0:
            return self.reason or "unreachable"
        return f"{self.verb} {self.resource} {self.code} {self.reason}"

    def __str__(self) -> str:
        what = f"{self.verb} {self.resource}.{contracts.RESOURCE_API_GROUP}"
        if self.code == 0:
            if self.reason == CREDENTIALS:
                return f"{what}: cannot authenticate: {self.message}"
            if self.reason:
                return f"{what}: {self.message}"
            return f"{what}: API server unreachable: {self.message}"
        if self.code == 403:
            # The RBAC rule that is missing, in the words of a ClusterRole.
            return (
                f"{what}: forbidden (RBAC needs verb {self.verb!r} on {self.resource!r} in API group "
                f"{contracts.RESOURCE_API_GROUP!r}): {self.message}"
            )
        if self.code == 404 and not self.missing:
            return (
                f"{what}: 404, the API server does not serve {contracts.RESOURCE_API_GROUP}/"
                f"{contracts.RESOURCE_API_VERSION} (Kubernetes 1.35 or newer needed)"
            )
        return f"{what}: {self.code} {self.reason}: {self.message}".rstrip(": ")


def _detail(exc: BaseException) -> str:
    """An exception as a few words on one line."""
    words = " ".join(str(exc).split())
    return text.shown(f"{type(exc).__name__}: {words}" if words else type(exc).__name__, 300)


def _dry(dry_run: bool) -> Optional[dict[str, str]]:
    # Every stage of a write but the storing: admission, defaults, dropped fields, validation.
    return {"dryRun": "All"} if dry_run else None


class KubeApi:
    """The calls the DRA mode makes, on `http` (an httpx.AsyncClient with the server's address,
    TLS and credentials: `connect`). `source` names where the credentials came from."""

    def __init__(
        self,
        http: Callable[[], httpx.AsyncClient],
        source: str,
        timeout_s: float = REQUEST_TIMEOUT_S,
        watch_grace_s: float = WATCH_GRACE_S,
        watch_heartbeat_s: float = WATCH_HEARTBEAT_S,
        first_bookmark_s: float = WATCH_HEARTBEAT_S,
    ) -> None:
        self._make_http = http
        self._http = http()
        self._stale = False  # a request's connection failed: the pool's others may be as dead
        self.source = source
        self._timeout_s = timeout_s
        self.bookmarks = Bookmarks(watch_heartbeat_s, first_bookmark_s, watch_grace_s)

    async def list_slices(self, node: str, driver: str) -> tuple[list[Json], str]:
        """This node's slices of `driver`, and the list's resourceVersion to watch from."""
        listing = await self._call("list", SLICES, "GET", SLICES_PATH, params=_selector(node, driver))
        items = listing.get("items")
        version = (listing.get("metadata") or {}).get("resourceVersion")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items) or not isinstance(version, str):
            raise ApiError("list", SLICES, 0, "unreadable", "unreadable answer: not a list with a resourceVersion")
        return items, version

    async def watch_slices(
        self, node: str, driver: str, resource_version: str, timeout_s: float
    ) -> AsyncIterator[tuple[str, Json]]:
        """Events (ADDED, MODIFIED, DELETED, BOOKMARK) after `resource_version`, until the server
        ends the watch (after about `timeout_s`: a normal end). Raises ApiError for anything else:
        an ERROR event (410: the version is too old to watch from), an unreadable event, a
        connection that failed, or one gone silent (dra/watch_liveness.py: still open past the
        timeout, without its first bookmark in time, or silent for a heartbeat after one)."""
        import httpx

        params = {
            **_selector(node, driver),
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, int(timeout_s))),
        }
        limit = timeout_s + self.bookmarks.grace_s
        loop = asyncio.get_running_loop()
        # Our deadlines decide, for the answer and the stream; httpx's read timeout, a second
        # later, never fires first.
        request = self._http.build_request(
            "GET", SLICES_PATH, params=params, timeout=httpx.Timeout(self._timeout_s, read=limit + 1)
        )
        answer_s = min(limit, WATCH_ANSWER_S)
        try:
            response = await waits.within(self._send("watch", SLICES, request, stream=True), answer_s)
        except asyncio.TimeoutError:
            self._stale = True
            raise ApiError("watch", SLICES, 0, "stalled", f"no answer to the watch in {answer_s:g} s") from None
        # The server's clock for timeoutSeconds starts as it sends the headers, not when we asked:
        # a busy server holds watches in its queues (priority and fairness) for seconds, and 400
        # agents starting at once saw watches end up to 5.4 s after their timeoutSeconds.
        ends = loop.time() + limit
        try:
            if response.status_code >= 400:
                await self._guarded("watch", SLICES, response.aread())
                raise _status_error("watch", SLICES, response)
            liveness = self.bookmarks.watch(loop.time(), ends)
            chunks = response.aiter_bytes()
            reads = _bounded_reads(
                lambda: self._guarded("watch", SLICES, chunks.__anext__()),
                liveness,
                self.bookmarks,
                params,
                self._stalled,
            )
            async for line in _lines(reads):
                kind, obj = _event(line)
                # A bookmark, or an event for us: the server's version has moved past the watch's
                # start, so its bookmarks come every minute from now on.
                if not liveness.bookmarked:
                    liveness.bookmarked = True
                    self.bookmarks.came()
                yield kind, obj
        finally:
            await response.aclose()

    def _stalled(self) -> None:
        self._stale = True  # the pool's other connections may be as dead

    async def create_slice(self, body: Json, dry_run: bool = False) -> Json:
        """POST; `dry_run`: the slice as the server would store it (its defaults, the fields of
        features it lacks dropped), with nothing stored."""
        return await self._call("create", SLICES, "POST", SLICES_PATH, params=_dry(dry_run), body=body)

    async def replace_slice(self, body: Json, dry_run: bool = False) -> Json:
        """PUT; the body's metadata.resourceVersion makes it conditional (409 when someone wrote
        first); `dry_run` as create_slice's."""
        name = str(body["metadata"]["name"])
        return await self._call("update", SLICES, "PUT", f"{SLICES_PATH}/{name}", params=_dry(dry_run), body=body)

    async def delete_slice(self, name: str) -> None:
        await self._call("delete", SLICES, "DELETE", f"{SLICES_PATH}/{name}")

    async def allowed(self, verb: str, resource: str) -> tuple[bool, str]:
        """Whether our credentials may `verb` `resource` of resource.k8s.io in every namespace, as
        the API server's authorizers say (a SelfSubjectAccessReview, which any authenticated user
        may create); (allowed, the authorizer's reason)."""
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": verb, "group": contracts.RESOURCE_API_GROUP, "resource": resource}},
        }
        answer = await self._call("create", ACCESS_REVIEWS, "POST", ACCESS_REVIEWS_PATH, body=body)
        status = answer.get("status")
        if not isinstance(status, dict):
            return False, "the review came back without a status"
        return status.get("allowed") is True, str(status.get("reason", ""))

    async def serves(self, group: str, version: str) -> bool:
        """Whether the API server serves group/version: its discovery document, which every
        authenticated user may read (the system:discovery role), also without any other permission."""
        try:
            await self._call("get", f"API {group}/{version}", "GET", f"/apis/{group}/{version}")
        except ApiError as exc:
            if exc.code == 404:
                return False
            raise
        return True

    async def get_claim(self, namespace: str, name: str) -> Json:
        path = f"/apis/{contracts.RESOURCE_API_GROUP}/{contracts.RESOURCE_API_VERSION}/namespaces/{namespace}"
        return await self._call("get", CLAIMS, "GET", f"{path}/{CLAIMS}/{name}")

    async def close(self) -> None:
        await self._http.aclose()

    # --- one request ----------------------------------------------------------------------------

    async def _call(
        self,
        verb: str,
        resource: str,
        method: str,
        path: str,
        *,
        params: Optional[dict[str, str]] = None,
        body: Optional[Json] = None,
    ) -> Json:
        request = self._http.build_request(method, path, params=params, json=body)
        response = await self._send(verb, resource, request)
        if response.status_code >= 400:
            raise _status_error(verb, resource, response)
        try:
            answer = response.json()
        except ValueError as exc:
            raise ApiError(verb, resource, 0, "unreadable", f"unreadable answer: {_detail(exc)}") from exc
        if not isinstance(answer, dict):
            raise ApiError(verb, resource, 0, "unreadable", "unreadable answer: not a JSON object")
        return answer

    async def _send(self, verb: str, resource: str, request: httpx.Request, stream: bool = False) -> httpx.Response:
        if self._stale:
            # A connection that stopped forwarding leaves its pooled siblings (to the same proxy
            # or load balancer) suspect: the retry must not wait out another dead one.
            self._stale = False
            old, self._http = self._http, self._make_http()
            await old.aclose()
        response: httpx.Response = await self._guarded(verb, resource, self._http.send(request, stream=stream))
        return response

    async def _guarded(self, verb: str, resource: str, work: Any) -> Any:
        """`work`'s result; what the network, the server or a credential plugin does wrong as ApiError."""
        import httpx
        from lightkube import ConfigError

        try:
            return await work
        except httpx.TimeoutException as exc:
            self._stale = True
            raise ApiError(verb, resource, 0, "", f"no answer in time ({_detail(exc)})") from exc
        except httpx.HTTPError as exc:
            self._stale = isinstance(exc, httpx.TransportError)
            raise ApiError(verb, resource, 0, "", _detail(exc)) from exc
        except (ConfigError, OSError, ValueError, KeyError, TypeError) as exc:
            # httpx raises only its own errors, so these come from the credentials: a token file
            # that is missing or unreadable, an exec plugin that failed or printed garbage.
            raise ApiError(verb, resource, 0, CREDENTIALS, f"{self.source}: {_detail(exc)}") from exc


async def _bounded_reads(
    read_next: Callable[[], Awaitable[bytes]],
    liveness: Watch,
    bookmarks: Bookmarks,
    params: dict[str, str],
    stalled: Callable[[], None],
) -> AsyncIterator[bytes]:
    """A watch's bytes as they come (read_next() until StopAsyncIteration: the server ended it);
    ApiError "stalled" once it is silent past what `liveness` allows (a read in progress is kept
    across a deadline forgiven: dra/watch_liveness.py)."""
    loop = asyncio.get_running_loop()
    read: Optional[asyncio.Future[bytes]] = None
    try:
        while True:
            if read is None:
                read = asyncio.ensure_future(read_next())
            until = bookmarks.until(liveness)
            done, _ = await asyncio.wait({read}, timeout=max(0.0, until - loop.time()))
            if not done:
                early = until < liveness.ends
                if early and not liveness.bookmarked and bookmarks.forgiven():
                    liveness.first_due = False  # not this watch's fault: on to its end, reading on
                    continue
                stalled()
                why = bookmarks.why(params["timeoutSeconds"], liveness.bookmarked, early)
                raise ApiError("watch", SLICES, 0, "stalled", why)
            try:
                yield read.result()
            except StopAsyncIteration:
                return
            finally:
                read = None
            liveness.heard = loop.time()
    finally:
        if read is not None:
            read.cancel()
            await asyncio.wait({read})


def _selector(node: str, driver: str) -> dict[str, str]:
    return {"fieldSelector": f"{contracts.SLICE_FIELD_NODE}={node},{contracts.SLICE_FIELD_DRIVER}={driver}"}


def _status_error(verb: str, resource: str, response: httpx.Response) -> ApiError:
    """The API server's Status (or, for a body that is none, a proxy's page, the HTTP status)."""
    try:
        status = response.json()
    except ValueError:
        status = None
    if isinstance(status, dict) and status.get("kind") == "Status":
        code = status.get("code")
        details = status.get("details")
        return ApiError(
            verb,
            resource,
            code if isinstance(code, int) and code else response.status_code,
            str(status.get("reason") or ""),
            " ".join(str(status.get("message") or "").split()),
            str(details.get("name") or "") if isinstance(details, dict) else "",
        )
    return ApiError(verb, resource, response.status_code, response.reason_phrase, "")


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A watch's lines (one event each, blank ones skipped) from its chunks, however they are cut;
    ApiError "unreadable" for a line longer than MAX_EVENT_BYTES."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_EVENT_BYTES:
            raise ApiError("watch", SLICES, 0, "unreadable", f"a watch event longer than {MAX_EVENT_BYTES} bytes")
        for line in lines:
            if line.strip():
                yield line


def _event(line: bytes) -> tuple[str, Json]:
    """One watch event line: (type, object). ERROR events and anything unreadable raise ApiError."""
    try:
        event = json.loads(line)
    except ValueError as exc:
        raise ApiError("watch", SLICES, 0, "unreadable", f"an unreadable watch event: {_detail(exc)}") from exc
    kind = event.get("type") if isinstance(event, dict) else None
    obj = event.get("object") if isinstance(event, dict) else None
    if kind == "ERROR" and isinstance(obj, dict):
        code = obj.get("code")
        raise ApiError(
            "watch",
            SLICES,
            code if isinstance(code, int) else 0,
            str(obj.get("reason") or "unreadable"),
            " ".join(str(obj.get("message") or "").split()),
        )
    version = (obj.get("metadata") or {}).get("resourceVersion") if isinstance(obj, dict) else None
    if kind not in WATCH_EVENTS or not isinstance(version, str) or not isinstance(obj, dict):
        raise ApiError(
            "watch",
            SLICES,
            0,
            "unreadable",
            f"an unreadable watch event (type {text.quote(str(kind))}, no object with a resourceVersion)",
        )
    return str(kind), obj


def connect(
    kubeconfig: Optional[str],
    *,
    service_account_dir: str = contracts.SERVICE_ACCOUNT_DIR,
    environ: Mapping[str, str],
    timeout_s: float = REQUEST_TIMEOUT_S,
    watch_grace_s: float = WATCH_GRACE_S,
    watch_heartbeat_s: float = WATCH_HEARTBEAT_S,
    first_bookmark_s: float = WATCH_HEARTBEAT_S,
) -> KubeApi:
    """A client from the kubeconfig at `kubeconfig` (the `kubeconfig` setting), else from the pod's
    service account and the in-cluster address in `environ` (the process environment, handed over
    by the entry point). Raises ClientConfigError naming the path and what is wrong with it."""
    missing = [name for name in IN_CLUSTER_ENV if not environ.get(name)]
    if not kubeconfig and missing:
        raise ClientConfigError(f"no kubeconfig setting and not in a cluster ({' and '.join(missing)} unset)")
    source = f"kubeconfig {kubeconfig}" if kubeconfig else f"service account {service_account_dir}"
    try:
        return _connect(
            kubeconfig,
            service_account_dir,
            environ,
            timeout_s,
            source,
            (watch_grace_s, watch_heartbeat_s, first_bookmark_s),
        )
    except ClientConfigError as exc:
        raise ClientConfigError(f"{source}: {exc}") from exc
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename and exc.filename != kubeconfig else ""
        raise ClientConfigError(f"{source}: {where}{exc.strerror or _detail(exc)}") from exc
    except RecursionError as exc:  # YAML nested deeper than the parser recurses
        raise ClientConfigError(f"{source}: nested too deeply") from exc
    except Exception as exc:  # lightkube's, yaml's and ssl's ways to refuse a config are many
        raise ClientConfigError(f"{source}: {_detail(exc)}") from exc


def _connect(
    kubeconfig: Optional[str],
    service_account_dir: str,
    environ: Mapping[str, str],
    timeout_s: float,
    source: str,
    watch_deadlines: tuple[float, float, float],
) -> KubeApi:
    """`watch_deadlines`: KubeApi's watch_grace_s, watch_heartbeat_s and first_bookmark_s."""
    import ssl

    import httpx

    # httpx logs every request at INFO: our own lines say what matters (a change, a problem).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from lightkube.config.client_adapter import ConnectionParams

    if kubeconfig:
        config = _kubeconfig(kubeconfig)
    else:
        host, port = environ[IN_CLUSTER_ENV[0]], environ[IN_CLUSTER_ENV[1]]
        config = _service_account_config(service_account_dir, host, port)
    # trust_env=False: proxies and the like come from the kubeconfig we were given, nothing else.
    params = ConnectionParams(timeout=httpx.Timeout(timeout_s), trust_env=False)

    def client() -> httpx.AsyncClient:
        # lightkube's arguments for httpx (address, TLS, credentials), with a transport of ours
        # for what lightkube cannot ask for: TCP keepalive on every connection.
        kwargs = params.httpx_params(config)
        verify = kwargs.pop("verify")
        if isinstance(verify, ssl.SSLContext):
            # Python 3.13 verifies strictly by default and refuses a cluster CA without keyUsage
            # (openssl's defaults make such CAs); client-go and kubectl trust it, and so do we.
            verify.verify_flags &= ~ssl.VERIFY_X509_STRICT
        transport = httpx.AsyncHTTPTransport(
            verify=verify, proxy=kwargs.pop("proxy"), socket_options=keepalive_options()
        )
        kwargs.update(transport=transport, http2=False)
        return httpx.AsyncClient(**kwargs)

    return KubeApi(client, source, timeout_s, *watch_deadlines)


def keepalive_options() -> list[tuple[int, int, int]]:
    """setsockopt arguments for TCP keepalive (KEEPALIVE_*): probes after KEEPALIVE_IDLE_S of
    silence, KEEPALIVE_COUNT of them KEEPALIVE_INTERVAL_S apart."""
    return [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S),
        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S),
        (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT),
    ]


def _kubeconfig(path: str) -> Any:
    """lightkube's SingleConfig for the current context of the kubeconfig at `path`, its shape
    checked first: lightkube indexes into whatever YAML it is given."""
    import yaml
    from lightkube import KubeConfig

    with open(path, "rb") as f:
        data = f.read(MAX_KUBECONFIG_BYTES + 1)
    if len(data) > MAX_KUBECONFIG_BYTES:
        raise ClientConfigError(f"larger than {MAX_KUBECONFIG_BYTES} bytes")
    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise ClientConfigError(f"not YAML: {' '.join(str(exc).split())}") from exc
    problem = kubeconfig_problem(doc)
    if problem:
        raise ClientConfigError(problem)
    return KubeConfig.from_dict(doc, fname=path).get()


def kubeconfig_problem(doc: Any) -> str:  # noqa: PLR0911 - one return per problem reads best
    """What makes a parsed kubeconfig unusable ("" when its shape is right).

    >>> kubeconfig_problem([])
    'not a mapping (a list)'
    >>> kubeconfig_problem({"clusters": [], "contexts": [{"name": "a", "context": None}]})
    "contexts[0] ('a'): 'context' is not a mapping"
    """
    if not isinstance(doc, dict):
        return "empty" if doc is None else f"not a mapping (a {_kind(doc)})"
    for key, inner, required in (
        ("clusters", "cluster", True),
        ("contexts", "context", True),
        ("users", "user", False),
    ):
        entries = doc.get(key)
        if entries is None and not required:
            continue
        if not isinstance(entries, list):
            return f"{key!r} is not a list" if key in doc else f"no {key!r}"
        for i, entry in enumerate(entries):
            where = f"{key}[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                return f"{where} is not a mapping with a name"
            where += f" ({text.quote(entry['name'])})"
            if not isinstance(entry.get(inner), dict):
                return f"{where}: {inner!r} is not a mapping"
    current = doc.get("current-context")
    if not isinstance(current, str) or not current:
        return "no current-context"
    names = {c["name"] for c in doc["contexts"]}
    if current not in names:
        return f"current-context {text.quote(current)} is not among its contexts"
    return ""


def _kind(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def _service_account_config(directory: str, host: str, port: str) -> Any:
    """lightkube's in-cluster config, from our arguments rather than the process environment."""
    from lightkube import KubeConfig
    from lightkube.config import models

    token_file = os.path.join(directory, "token")
    with open(token_file) as f:
        f.read(1)  # readable now; lightkube reads it (again, rotated) for each request
    host = f"[{host}]" if ":" in host else host
    cluster = models.Cluster(server=f"https://{host}:{port}", certificate_auth=os.path.join(directory, "ca.crt"))
    return KubeConfig.from_one(cluster=cluster, user=models.User(token_file=token_file)).get()
