"""`--check` for a mode that talks to the API (`--dra`): what it needs beyond the device and the
kubelet's directories (diagnose.py), asked without changing anything: a usable kubeconfig (or
service account), an API server that answers and serves resource.k8s.io/v1, and each permission
the driver uses (a SelfSubjectAccessReview per verb). One line each, "ok   …" or "FAIL …" naming
what is wrong and where, a FAIL followed by a "hint" line saying what to do.

    await api(kubeconfig, node_name, environ)                                     # [(ok, line), ...]
"""

from __future__ import annotations

from typing import Mapping, Optional

from hyperlight_agent import contracts
from hyperlight_agent.dra.client import CLAIMS, SLICES, ApiError, ClientConfigError, KubeApi, connect

# What the driver does with the API (dra/slices.py, dra/claims.py); the chart's ClusterRole grants
# exactly these (tests/test_deploy.py keeps the two equal).
NEEDED = (
    ("list", SLICES),
    ("watch", SLICES),
    ("create", SLICES),
    ("update", SLICES),
    ("delete", SLICES),
    ("get", CLAIMS),
)


CREDENTIALS_HINT = (
    "hint set kubeconfig (HYPERLIGHT_KUBECONFIG, --kubeconfig) to a kubeconfig file for the driver, or run it "
    "in a pod with its service account's token mounted (the chart's DRA driver does: serviceAccount.*)"
)
SERVER_HINT = (
    "hint the API server named by the credentials must be reachable from here (a network policy: the chart's "
    "allows the driver's egress to it) and accept them"
)
VERSION_HINT = (
    "hint DRA needs Kubernetes 1.35 or later (resource.k8s.io/v1); use the device plugin mode on older clusters"
)


async def api(kubeconfig: Optional[str], node_name: str, environ: Mapping[str, str]) -> list[tuple[bool, str]]:
    """The credentials, the server, and every permission the driver needs."""
    try:
        client = connect(kubeconfig, environ=environ)
    except ClientConfigError as exc:
        return [(False, f"FAIL API credentials: {exc}"), (False, CREDENTIALS_HINT)]
    try:
        found = [(True, f"ok   API credentials: {client.source}")]
        try:
            found.append(await _server(client, node_name))
            for verb, resource in NEEDED:
                found += await _permission(client, verb, resource)
        except ApiError as exc:
            if exc.code == 401:
                return [*found, (False, f"FAIL API credentials: {exc}"), (False, CREDENTIALS_HINT)]
            return [*found, (False, f"FAIL API server: {exc}"), (False, SERVER_HINT)]
        except _NotServed as exc:
            return [*found, (False, f"FAIL API server: {exc}"), (False, VERSION_HINT)]
        return found
    finally:
        await client.close()


class _NotServed(Exception):
    pass


async def _server(client: KubeApi, node_name: str) -> tuple[bool, str]:
    """Reachable, authenticated, and serving resource.k8s.io/v1: one read of our own slices."""
    api_version = f"{contracts.RESOURCE_API_GROUP}/{contracts.RESOURCE_API_VERSION}"
    try:
        await client.list_slices(node_name, contracts.DRA_DRIVER)
    except ApiError as exc:
        if exc.code != 403:
            raise
        # Forbidden says nothing of the API version (the authorizer answers before the route is
        # looked up): ask the discovery document, which any user may read. Being forbidden is the
        # permissions' lines.
        if not await client.serves(contracts.RESOURCE_API_GROUP, contracts.RESOURCE_API_VERSION):
            raise _NotServed(f"does not serve {api_version}") from None
    return True, f"ok   API server: answers, and serves {api_version}"


async def _permission(client: KubeApi, verb: str, resource: str) -> list[tuple[bool, str]]:
    allowed, reason = await client.allowed(verb, resource)
    where = f"{verb} {resource}.{contracts.RESOURCE_API_GROUP}"
    if allowed:
        return [(True, f"ok   permission: {where}")]
    return [
        (False, f"FAIL permission: cannot {where}{': ' + reason if reason else ''}"),
        (
            False,
            "hint bind the driver's account to the chart's ClusterRole hyperlight-dra-driver (the chart does, for "
            "serviceAccount.name), which grants it",
        ),
    ]
