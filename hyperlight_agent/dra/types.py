"""What the DRA service needs from whoever reads ResourceClaims from the Kubernetes API: the
claim reader's interface, the allocated device it answers with and the error it raises.

Types only; the API client that implements ClaimReader lives beside this module.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

# A Kubernetes object or part of one, as JSON decodes it.
Json = dict[str, Any]


class AllocatedDevice(NamedTuple):
    """One entry of a claim's status.allocation.devices.results."""

    request: str  # the claim's request this device was allocated for
    driver: str
    pool: str
    device: str
    share_id: Optional[str] = None  # set only for a device allocated several times at once


class ClaimError(Exception):
    """A claim's allocation cannot be read: not found, replaced (another uid), not allocated, or
    the API did not answer. The message is one line naming the claim; it becomes that claim's
    error in the kubelet's response."""


class ClaimReader(Protocol):
    async def allocation(self, namespace: str, name: str, uid: str) -> list[AllocatedDevice]:
        """The devices allocated to claim namespace/name, which must have this uid.

        Raises ClaimError when they cannot be known."""
        ...
