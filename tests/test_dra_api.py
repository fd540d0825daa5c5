"""The DRA messages speak the kubelet's wire format: requests as the kubelet sends them, answers as
it parses them, checked against hand-written bytes so a wrong field number fails here."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from hyperlight_agent import contracts, transport
from hyperlight_agent.dra import api
from hyperlight_agent.dra import dra_v1_pb2 as v1
from hyperlight_agent.dra import dra_v1beta1_pb2 as v1beta1
from hyperlight_agent.dra import pluginregistration_pb2 as reg
from hyperlight_agent.dra.registration import DriverServers

# NodePrepareResourcesRequest{claims=[Claim{namespace="ns" (1), uid="u1" (2), name="c" (3)}]}
PREPARE_REQUEST = b"\n\x0b\n\x02ns\x12\x02u1\x1a\x01c"
# NodePrepareResourcesResponse{claims={"u1": {devices=[Device{request_names=["hv"] (1), pool_name="p" (2),
#   device_name="kvm-0" (3), cdi_device_ids=["x"] (4), share_id="s" (5)}]}}}: a map entry is key 1, value 2.
PREPARE_RESPONSE = b'\n\x1c\n\x02u1\x12\x16\n\x14\n\x02hv\x12\x01p\x1a\x05kvm-0"\x01x*\x01s'
# RegistrationStatus{plugin_registered=true (1), error="x" (2)}
STATUS = b"\x08\x01\x12\x01x"
# PluginInfo{type (1), name (2), endpoint (3), supported_versions (4)}
INFO = b'\n\tDRAPlugin\x12\x19hypervisor.hyperlight.dev\x1a\x02/e"\x0cv1.DRAPlugin'


@pytest.mark.parametrize("messages", [v1, v1beta1])
def test_prepare_request_bytes(messages: object) -> None:
    request = messages.NodePrepareResourcesRequest(  # type: ignore[attr-defined]
        claims=[messages.Claim(namespace="ns", uid="u1", name="c")]  # type: ignore[attr-defined]
    )
    assert request.SerializeToString() == PREPARE_REQUEST
    assert messages.NodePrepareResourcesRequest.FromString(PREPARE_REQUEST) == request  # type: ignore[attr-defined]
    unprepare = messages.NodeUnprepareResourcesRequest.FromString(PREPARE_REQUEST)  # type: ignore[attr-defined]
    assert [(c.namespace, c.uid, c.name) for c in unprepare.claims] == [("ns", "u1", "c")]


def test_prepare_response_bytes() -> None:
    response = v1.NodePrepareResourcesResponse()
    response.claims["u1"].devices.add(
        request_names=["hv"], pool_name="p", device_name="kvm-0", cdi_device_ids=["x"], share_id="s"
    )
    assert response.SerializeToString() == PREPARE_RESPONSE
    decoded = v1.NodePrepareResourcesResponse.FromString(PREPARE_RESPONSE)
    assert decoded == response and decoded.claims["u1"].devices[0].HasField("share_id")
    # v1beta1 has no share_id: a kubelet speaking it skips field 5 and reads the rest.
    old = v1beta1.NodePrepareResourcesResponse.FromString(PREPARE_RESPONSE).claims["u1"].devices[0]
    assert (list(old.request_names), old.pool_name, old.device_name, list(old.cdi_device_ids)) == (
        ["hv"],
        "p",
        "kvm-0",
        ["x"],
    )
    # The error is field 2 of a claim's entry, unprepare's error field 1.
    assert v1.NodePrepareResourceResponse(error="e").SerializeToString() == b"\x12\x01e"
    assert v1.NodeUnprepareResourceResponse(error="e").SerializeToString() == b"\n\x01e"


def test_registration_bytes() -> None:
    assert reg.RegistrationStatus.FromString(STATUS) == reg.RegistrationStatus(plugin_registered=True, error="x")
    assert (
        reg.PluginInfo(
            type="DRAPlugin", name="hypervisor.hyperlight.dev", endpoint="/e", supported_versions=["v1.DRAPlugin"]
        ).SerializeToString()
        == INFO
    )


def test_packages_and_services_are_the_kubelets() -> None:
    assert v1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert v1beta1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    assert reg.DESCRIPTOR.package == "pluginregistration"
    for messages, service in ((v1, api.DRA_V1_SERVICE), (v1beta1, api.DRA_V1BETA1_SERVICE)):
        described = messages.DESCRIPTOR.services_by_name["DRAPlugin"]
        assert described.full_name == service
        assert [m.name for m in described.methods] == ["NodePrepareResources", "NodeUnprepareResources"]
    assert [m.name for m in reg.DESCRIPTOR.services_by_name["Registration"].methods] == [
        "GetInfo",
        "NotifyRegistrationStatus",
    ]
    assert reg.DESCRIPTOR.services_by_name["Registration"].full_name == api.REGISTRATION_SERVICE
    assert list(api.VERSIONS) == list(contracts.DRA_SUPPORTED_VERSIONS)


class Unreached:
    async def NodePrepareResources(self, *args: object) -> None:
        raise AssertionError("an unparsable request reached the service")

    NodeUnprepareResources = NodePrepareResources


def test_unparsable_request_is_invalid_argument(tmp: str) -> None:
    async def main() -> None:
        registry, plugins = os.path.join(tmp, "reg"), os.path.join(tmp, "plugins")
        os.mkdir(registry)
        registrar = DriverServers(Unreached(), "hypervisor.hyperlight.dev", "a", registry, plugins)
        await registrar.start()
        try:
            async with grpc.aio.insecure_channel(transport.unix_target(registrar.service_socket)) as channel:
                call = channel.unary_unary(f"/{api.DRA_V1_SERVICE}/NodePrepareResources", None, None)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(b"\n\xff")  # a length past the end
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "cannot parse k8s.io.kubelet.pkg.apis.dra.v1.NodePrepareResourcesRequest" in str(
                    caught.value.details()
                )
        finally:
            await registrar.close()

    asyncio.run(main())
