"""The Kubernetes API as the DRA mode uses it: this node's ResourceSlices and single ResourceClaims,
as plain JSON dicts, with every failure as one `ApiError`.

The only module that imports lightkube (and with it httpx), and only inside `connect()`: the
device-plugin modes never talk to the API and never pay for the client (about 13 MB of RSS, see
ARCHITECTURE.md). The objects are lightkube generic resources, not its typed models: the slice is
compared and written as the JSON the API server holds, and no lightkube-models release has to know
resource.k8s.io/v1.
"""

from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator, Mapping, Optional

from hyperlight_agent import contracts

SERVICE_ACCOUNT_DIR = contracts.SERVICE_ACCOUNT_DIR
IN_CLUSTER_ENV = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
# Every request but a watch gives up after this long; a watch waits for events without limit.
REQUEST_TIMEOUT_S = 10.0

GROUP = contracts.RESOURCE_API_GROUP
VERSION = contracts.RESOURCE_API_VERSION
SLICES = "resourceslices"
CLAIMS = "resourceclaims"
SELECT_NODE = contracts.SLICE_FIELD_NODE
SELECT_DRIVER = contracts.SLICE_FIELD_DRIVER

Json = dict[str, Any]


class ClientConfigError(Exception):
    """No way to reach the API: no kubeconfig and not in a cluster, or a kubeconfig that cannot be used."""


class ApiError(Exception):
    """A request the API server refused (code ≥ 400) or never answered (code 0: refused connection,
    timeout, TLS). One line: what we asked, and what came back."""

    def __init__(self, verb: str, resource: str, code: int, reason: str, message: str) -> None:
        self.verb, self.resource, self.code, self.reason, self.message = verb, resource, code, reason, message
        super().__init__(str(self))

    @property
    def problem(self) -> str:
        """What stays the same across retries of one problem: said once, not once per retry (an
        unreachable server fails lists, watches and writes alike, each with its own detail)."""
        return "unreachable" if self.code == 0 else f"{self.verb} {self.resource} {self.code} {self.reason}"

    def __str__(self) -> str:
        what = f"{self.verb} {self.resource}.{GROUP}"
        if self.code == 0:
            return f"{what}: API server unreachable: {self.message}"
        if self.code == 403:
            # The RBAC rule that is missing, in the words of a ClusterRole.
            return (f"{what}: forbidden (RBAC needs verb {self.verb!r} on {self.resource!r} in API group {GROUP!r}): "
                    f"{self.message}")
        if self.code == 404 and not self.message.endswith("not found"):
            return f"{what}: 404, the API server does not serve {GROUP}/{VERSION} (Kubernetes 1.34 or newer needed)"
        return f"{what}: {self.code} {self.reason}: {self.message}".rstrip(": ")


class KubeApi:
    """The calls the DRA mode makes. `client` is a lightkube AsyncClient (from `connect`)."""

    def __init__(self, client: Any) -> None:
        from lightkube.generic_resource import create_global_resource, create_namespaced_resource

        self._client = client
        self._slice: Any = create_global_resource(GROUP, VERSION, "ResourceSlice", SLICES)
        self._claim: Any = create_namespaced_resource(GROUP, VERSION, "ResourceClaim", CLAIMS)

    async def list_slices(self, node: str, driver: str) -> tuple[list[Json], str]:
        """This node's slices of `driver`, and the list's resourceVersion to watch from."""
        try:
            listing = self._client.list(self._slice, fields={SELECT_NODE: node, SELECT_DRIVER: driver})
            items = [dict(item) async for item in listing]
        except Exception as exc:
            raise _api_error("list", SLICES, exc) from exc
        return items, str(listing.resourceVersion or "")

    async def watch_slices(self, node: str, driver: str, resource_version: str) -> AsyncIterator[tuple[str, Json]]:
        """Events (ADDED, MODIFIED, DELETED, BOOKMARK) after `resource_version`, until an error."""
        import httpx

        events = self._client.watch(self._slice, fields={SELECT_NODE: node, SELECT_DRIVER: driver},
                                    resource_version=resource_version or None)
        try:
            async for kind, obj in events:
                yield str(kind), dict(obj)
        except httpx.TransportError:
            # The connection ended under the watch (the API server closes long watches, and its
            # restarts end them too): an end like any other. The caller lists again, and if the
            # server is really gone that list says so.
            return
        except Exception as exc:
            raise _api_error("watch", SLICES, exc) from exc

    async def create_slice(self, body: Json) -> Json:
        try:
            return dict(await self._client.create(self._slice.from_dict(body)))
        except Exception as exc:
            raise _api_error("create", SLICES, exc) from exc

    async def replace_slice(self, body: Json) -> Json:
        """PUT; the body's metadata.resourceVersion makes it conditional (409 when someone wrote first)."""
        try:
            return dict(await self._client.replace(self._slice.from_dict(body)))
        except Exception as exc:
            raise _api_error("update", SLICES, exc) from exc

    async def delete_slice(self, name: str) -> None:
        try:
            await self._client.delete(self._slice, name)
        except Exception as exc:
            raise _api_error("delete", SLICES, exc) from exc

    async def get_claim(self, namespace: str, name: str) -> Json:
        try:
            return dict(await self._client.get(self._claim, name, namespace=namespace))
        except Exception as exc:
            raise _api_error("get", CLAIMS, exc) from exc

    async def close(self) -> None:
        await self._client.close()


def _api_error(verb: str, resource: str, exc: Exception) -> Exception:
    """lightkube's and httpx's exceptions as one ApiError naming the verb and resource; any other
    exception (a bug of ours) is returned as it is, to be raised unchanged."""
    import httpx
    from lightkube import ApiError as LightkubeApiError

    if isinstance(exc, LightkubeApiError):
        status = exc.status
        code = status.code or (exc.response.status_code if exc.response is not None else 0)
        return ApiError(verb, resource, int(code), str(status.reason or ""), str(status.message or ""))
    if isinstance(exc, httpx.HTTPStatusError):  # a body that is no Status (a proxy's page, a watch's answer)
        return ApiError(verb, resource, exc.response.status_code, exc.response.reason_phrase, "")
    if isinstance(exc, httpx.HTTPError):
        return ApiError(verb, resource, 0, "", f"{type(exc).__name__}: {exc}".rstrip(": "))
    if isinstance(exc, ValueError):  # an answer that is not the JSON we asked for
        return ApiError(verb, resource, 0, "", f"unreadable answer: {exc}")
    return exc


def connect(kubeconfig: Optional[str], *, service_account_dir: str = SERVICE_ACCOUNT_DIR,
            environ: Mapping[str, str], timeout_s: float = REQUEST_TIMEOUT_S) -> KubeApi:
    """A client from the kubeconfig at `kubeconfig` (the `kubeconfig` setting), else from the pod's
    service account and the in-cluster address in `environ` (the process environment, handed over
    by the entry point). Raises ClientConfigError naming the path or what is missing."""
    import httpx
    import yaml
    from lightkube import AsyncClient, ConfigError, KubeConfig

    timeout = httpx.Timeout(timeout_s)
    # httpx logs every request at INFO: our own lines say what matters (a change, a problem).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    missing = [name for name in IN_CLUSTER_ENV if not environ.get(name)]
    if not kubeconfig and missing:
        raise ClientConfigError(f"no kubeconfig setting and not in a cluster ({' and '.join(missing)} unset)")
    try:
        if kubeconfig:
            config = KubeConfig.from_file(kubeconfig)
            # trust_env=False: proxies and the like come from the kubeconfig we were given, nothing else.
            return KubeApi(AsyncClient(config, timeout=timeout, trust_env=False))
        host, port = environ[IN_CLUSTER_ENV[0]], environ[IN_CLUSTER_ENV[1]]
        config = _service_account_config(KubeConfig, service_account_dir, host, port)
        return KubeApi(AsyncClient(config, timeout=timeout, trust_env=False))
    except (ConfigError, OSError, ValueError, KeyError, TypeError, AssertionError, yaml.YAMLError) as exc:
        source = f"kubeconfig {kubeconfig}" if kubeconfig else f"service account {service_account_dir}"
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise ClientConfigError(f"{source}: {detail}") from exc


def _service_account_config(kubeconfig: Any, directory: str, host: str, port: str) -> Any:
    """lightkube's in-cluster config, from our arguments rather than the process environment."""
    from lightkube.config import models

    token_file = os.path.join(directory, "token")
    with open(token_file) as f:
        token = f.read()
    host = f"[{host}]" if ":" in host else host
    cluster = models.Cluster(server=f"https://{host}:{port}", certificate_auth=os.path.join(directory, "ca.crt"))
    return kubeconfig.from_one(cluster=cluster, user=models.User(token=token, token_file=token_file))
