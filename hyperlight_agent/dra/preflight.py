"""`--dra --check`: what the DRA mode needs beyond the device, asked without changing anything:
the kubelet's plugin directories, a usable kubeconfig (or service account), an API server that
answers and knows us, and each permission the driver uses (a SelfSubjectAccessReview per verb).
One line each, "ok   …" or "FAIL …" naming what is wrong and where.

    directories({"dra_registry_dir": "/var/lib/kubelet/plugins_registry", ...})   # [(ok, line), ...]
    await api(kubeconfig, node_name, environ)                                     # [(ok, line), ...]
"""

from __future__ import annotations

import os
import stat
from typing import Mapping, Optional

from hyperlight_agent import contracts
from hyperlight_agent.dra.client import CLAIMS, SLICES, ApiError, ClientConfigError, connect

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


def directories(paths: Mapping[str, str]) -> list[tuple[bool, str]]:
    """Each setting's directory (the plugin registry, the plugins directory) exists as one: the
    kubelet makes them, so a missing one usually means a kubelet root other than /var/lib/kubelet,
    or a mount left out."""
    found = []
    for key, path in paths.items():
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            found.append(
                (
                    False,
                    f"FAIL {key}: {path}: {exc.strerror} (is the kubelet's root directory "
                    f"{os.path.dirname(contracts.DRA_REGISTRY_DIR)}? set {key})",
                )
            )
            continue
        if not stat.S_ISDIR(mode):
            found.append((False, f"FAIL {key}: {path} is not a directory"))
        else:
            found.append((True, f"ok   {key}: {path}"))
    return found


async def api(kubeconfig: Optional[str], node_name: str, environ: Mapping[str, str]) -> list[tuple[bool, str]]:
    """The credentials, the server, and every permission the driver needs."""
    try:
        client = connect(kubeconfig, environ=environ)
    except ClientConfigError as exc:
        return [(False, f"FAIL API credentials: {exc}")]
    try:
        found = [(True, f"ok   API credentials: {client.source}")]
        try:
            # Reachable, authenticated, and serving resource.k8s.io/v1: one read of our own slices.
            await client.list_slices(node_name, contracts.DRA_DRIVER)
        except ApiError as exc:
            if exc.code != 403:  # forbidden is the permissions' line below
                return [*found, (False, f"FAIL API server: {exc}")]
        found.append((True, "ok   API server: answers, and serves resource.k8s.io/v1"))
        for verb, resource in NEEDED:
            try:
                allowed, reason = await client.allowed(verb, resource)
            except ApiError as exc:
                return [*found, (False, f"FAIL API server: {exc}")]
            where = f"{verb} {resource}.{contracts.RESOURCE_API_GROUP}"
            found.append(
                (True, f"ok   permission: {where}")
                if allowed
                else (
                    False,
                    f"FAIL permission: cannot {where} (the ClusterRole hyperlight-dra-driver grants "
                    f"it){': ' + reason if reason else ''}",
                )
            )
        return found
    finally:
        await client.close()
