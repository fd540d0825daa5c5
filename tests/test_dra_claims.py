"""Reading a claim's allocation, against the fake API server of test_dra_slices serving recorded
v1.37 ResourceClaims and Status objects (standin/data/dra/)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from hyperlight_agent.dra.claims import ApiClaims
from hyperlight_agent.dra.client import KubeApi
from hyperlight_agent.dra.types import AllocatedDevice, ClaimError
from standin.apiserver import FakeApiServer, recorded, status
from tests.test_dra_slices import run

UID = "8d5c0f2a-1b3e-4d6f-a7c9-0e1f2a3b4c5d"
CLAIM = ("default", "pod-hv-9x2lq")
PATH = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/pod-hv-9x2lq"


def read(tmp_path: Any, claim: Any, uid: str = UID) -> list[AllocatedDevice]:
    """The allocation of default/pod-hv-9x2lq as the reader returns it (or its ClaimError)."""
    found: list[list[AllocatedDevice]] = []

    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        if isinstance(claim, tuple):
            fake.stuck["get"] = claim
        elif claim is not None:
            fake.claims[CLAIM] = claim
        try:
            found.append(await ApiClaims(api).allocation(*CLAIM, uid))
        finally:
            assert [(r.method, r.path) for r in fake.requests] == [("GET", PATH)]

    run(tmp_path, body)
    return found[0]


def test_an_allocated_claim_gives_every_result_other_drivers_included(tmp_path: Any) -> None:
    # The node service filters by driver: it knows which driver it serves.
    assert read(tmp_path, recorded("resourceclaim-allocated.json")) == [
        AllocatedDevice("hv", "hypervisor.hyperlight.dev", "node1", "kvm-3", None),
        AllocatedDevice("gpu", "gpu.example.com", "node1", "gpu-0", "9f1c2d3e-4a5b-4c6d-8e7f-0a1b2c3d4e5f"),
    ]


def test_a_claim_not_allocated_is_an_error(tmp_path: Any) -> None:
    with pytest.raises(ClaimError, match=r"^claim default/pod-hv-9x2lq is not allocated$"):
        read(tmp_path, recorded("resourceclaim-pending.json"))


def test_a_replaced_claim_is_an_error_naming_both_uids(tmp_path: Any) -> None:
    with pytest.raises(
        ClaimError, match=f"^claim default/pod-hv-9x2lq was replaced \\(uid {UID}, the kubelet asked for 0000\\)$"
    ):
        read(tmp_path, recorded("resourceclaim-allocated.json"), uid="0000")


def test_a_missing_claim_is_an_error(tmp_path: Any) -> None:
    with pytest.raises(ClaimError, match=r"^claim default/pod-hv-9x2lq not found"):
        read(tmp_path, None)


def test_forbidden_names_the_missing_permission(tmp_path: Any) -> None:
    with pytest.raises(
        ClaimError,
        match="^"
        + re.escape(
            "claim default/pod-hv-9x2lq: forbidden: RBAC needs verb 'get' on 'resourceclaims' in API group "
            "'resource.k8s.io' ("
        ),
    ):
        read(tmp_path, status("status-403-get-claim.json"))


@pytest.mark.parametrize(
    "answer",
    [
        "status-404-api.json",  # 1.35-1.37: "the server could not find the requested resource"
        "status-404-page.json",  # 1.38's handler of unserved paths: "404 page not found", no details
    ],
)
def test_an_api_server_without_resource_v1_is_said_plainly(tmp_path: Any, answer: str) -> None:
    with pytest.raises(ClaimError, match=re.escape("does not serve resource.k8s.io/v1")):
        read(tmp_path, status(answer))


def test_an_unreachable_server_is_one_line(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        await fake.go_down()
        with pytest.raises(
            ClaimError,
            match="^"
            + re.escape("claim default/pod-hv-9x2lq: get resourceclaims.resource.k8s.io: API server unreachable: "),
        ) as raised:
            await ApiClaims(api).allocation(*CLAIM, UID)
        assert "\n" not in str(raised.value)

    run(tmp_path, body)
