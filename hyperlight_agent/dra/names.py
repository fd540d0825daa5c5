"""The DRA mode's socket names, from its directories, driver and instance: what the agent serves,
what the exec probe asks and what the configuration checks room for. Standard library only.

    registration_socket("/var/lib/kubelet/plugins_registry", "hypervisor.hyperlight.dev", "web-1")
      → /var/lib/kubelet/plugins_registry/hypervisor.hyperlight.dev-web-1-reg.sock
    service_socket("/var/lib/kubelet/plugins", "hypervisor.hyperlight.dev", "web-1")
      → /var/lib/kubelet/plugins/hypervisor.hyperlight.dev/dra-web-1.sock

Both names carry the instance (a pod name or uid) so that a rolling update's new agent registers
beside the old one. A name whose path would not fit a unix socket address (contracts.UNIX_PATH_MAX)
is replaced by a shorter one made from a hash of the instance, the same on every start: the
shortest are "dra-<24 hex>-reg.sock" and "dra-<16 hex>.sock" (SHORTEST_NAMES, the room the
configuration checks for).
"""

from __future__ import annotations

import hashlib
import os
import re

from hyperlight_agent import contracts

# Where a server binds before its rename: .hl-dra.<pid>.<8 hex> (the plugin watcher ignores dot-files).
PRIVATE_PREFIX = ".hl-dra."


class TooLong(ValueError):
    """A directory too long for any of our socket names (the configuration refuses these)."""


# An instance used verbatim in a file name; anything else is hashed.
_PLAIN_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _digest(*parts: str, chars: int) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:chars]


def _fits(path: str) -> bool:
    return len(os.fsencode(path)) <= contracts.UNIX_PATH_MAX


def _first_fitting(directory: str, names: list[str]) -> str:
    for name in names:
        path = os.path.join(directory, name)
        if _fits(path):
            return path
    raise TooLong(f"{directory}: too long for a unix socket path even with the name {names[-1]}")


def _registration_names(driver: str, instance: str) -> list[str]:
    """The registration socket's names, longest first: the last is the shortest we ever bind."""
    names = [f"{driver}-{_digest(instance, chars=12)}-reg.sock", f"dra-{_digest(driver, instance, chars=24)}-reg.sock"]
    if _PLAIN_INSTANCE.fullmatch(instance):
        names.insert(0, f"{driver}-{instance}-reg.sock")
    return names


def _service_names(instance: str) -> list[str]:
    """The service socket's names, longest first, as _registration_names."""
    names = [f"dra-{_digest(instance, chars=16)}.sock"]
    if _PLAIN_INSTANCE.fullmatch(instance):
        names.insert(0, f"dra-{instance}.sock")
    return names


def registration_socket(registry_dir: str, driver: str, instance: str) -> str:
    """<registry_dir>/<driver>-<instance>-reg.sock, or a shorter hashed name where that is too long.

    >>> registration_socket("/var/lib/kubelet/plugins_registry", "hypervisor.hyperlight.dev", "web-1")
    '/var/lib/kubelet/plugins_registry/hypervisor.hyperlight.dev-web-1-reg.sock'
    """
    return _first_fitting(registry_dir, _registration_names(driver, instance))


def is_service_socket_name(name: str) -> bool:
    """Whether a name in a driver's directory is one service_socket gives (any instance)."""
    return name.startswith("dra-") and name.endswith(".sock")


def service_socket(plugins_dir: str, driver: str, instance: str) -> str:
    """<plugins_dir>/<driver>/dra-<instance>.sock, or a shorter hashed name where that is too long.

    >>> service_socket("/var/lib/kubelet/plugins", "hypervisor.hyperlight.dev", "web-1")
    '/var/lib/kubelet/plugins/hypervisor.hyperlight.dev/dra-web-1.sock'
    """
    return _first_fitting(os.path.join(plugins_dir, driver), _service_names(instance))


# The most bytes a private name (PRIVATE_PREFIX, a pid, 8 hex) takes.
_PRIVATE_NAME_MAX = len(f"{PRIVATE_PREFIX}{contracts.PID_MAX}.{'0' * 8}")
# The room the configuration checks for in each directory setting (with the directory below it where
# the socket is): the shortest name bound there, its last-resort hashed name or the private name
# bound before the rename, whichever is longer. From the builders above, so the two cannot differ.
SHORTEST_NAMES = (
    ("dra_registry_dir", "", max(len(_registration_names("", "")[-1]), _PRIVATE_NAME_MAX)),
    ("dra_plugins_dir", contracts.DRA_DRIVER, max(len(_service_names("")[-1]), _PRIVATE_NAME_MAX)),
)
