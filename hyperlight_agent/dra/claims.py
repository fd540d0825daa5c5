"""What a ResourceClaim was allocated, read from the API.

The kubelet's NodePrepareResources names a claim (namespace, name, uid) but does not carry its
allocation, so the node service reads it here: GET the claim, check it is the same object (the
uid) and allocated, and return every allocation result. Results of other drivers are returned too;
the node service picks ours (it knows the driver it serves).
"""

from __future__ import annotations

from typing import Any

from hyperlight_agent import contracts
from hyperlight_agent.dra.client import CLAIMS, ApiError, KubeApi
from hyperlight_agent.dra.types import AllocatedDevice, ClaimError


class ApiClaims:
    """Reads claims from the API server: the ClaimReader the DRA service is given (types.py)."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api

    async def allocation(self, namespace: str, name: str, uid: str) -> list[AllocatedDevice]:
        """The allocation results of claim namespace/name, which must still be the object `uid`."""
        claim = f"{namespace}/{name}"
        try:
            obj = await self._api.get_claim(namespace, name)
        except ApiError as exc:
            if exc.missing:
                raise ClaimError(f"claim {claim} not found (deleted?)") from exc
            if exc.code == 403:
                raise ClaimError(
                    f"claim {claim}: forbidden: RBAC needs verb 'get' on '{CLAIMS}' in API group "
                    f"'{contracts.RESOURCE_API_GROUP}' ({exc.message})"
                ) from exc
            raise ClaimError(f"claim {claim}: {exc}") from exc
        found_uid = (obj.get("metadata") or {}).get("uid")
        if found_uid != uid:
            raise ClaimError(f"claim {claim} was replaced (uid {found_uid}, the kubelet asked for {uid})")
        allocation = (obj.get("status") or {}).get("allocation")
        if not allocation:
            raise ClaimError(f"claim {claim} is not allocated")
        try:
            return [_result(r) for r in (allocation.get("devices") or {}).get("results") or []]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ClaimError(f"claim {claim}: unreadable allocation result: {exc!r}") from exc


def _result(result: Any) -> AllocatedDevice:
    share_id = result.get("shareID")
    return AllocatedDevice(
        request=str(result["request"]),
        driver=str(result["driver"]),
        pool=str(result["pool"]),
        device=str(result["device"]),
        share_id=None if share_id is None else str(share_id),
    )
