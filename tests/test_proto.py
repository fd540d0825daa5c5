"""The committed message code is what protoc makes of proto/, and speaks the kubelet's wire format."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from tests.test_docs import ROOT

# proto file → the package directory its generated modules are committed in.
GENERATED = {
    "deviceplugin.proto": "hyperlight_agent/deviceplugin",
    "dra_v1.proto": "hyperlight_agent/dra",
    "dra_v1beta1.proto": "hyperlight_agent/dra",
    "dra_health_v1.proto": "hyperlight_agent/dra",
    "dra_health_v1alpha1.proto": "hyperlight_agent/dra",
    "pluginregistration.proto": "hyperlight_agent/dra",
}


def test_every_proto_has_its_generated_code() -> None:
    assert sorted(GENERATED) == sorted(n for n in os.listdir(os.path.join(ROOT, "proto")) if n.endswith(".proto"))


@pytest.mark.system  # protoc: a system tool `make test` installs, not `make check`
@pytest.mark.parametrize("proto", sorted(GENERATED))
def test_generated_code_matches_the_proto(tmp: str, proto: str) -> None:
    protoc = shutil.which("protoc")
    assert protoc, "protoc is missing: `make test` installs protobuf-compiler"
    subprocess.run(
        [
            protoc,
            "-I",
            os.path.join(ROOT, "proto"),
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            os.path.join(ROOT, "proto", proto),
        ],
        check=True,
        timeout=60,
    )
    stem = proto[: -len(".proto")]
    for name in (f"{stem}_pb2.py", f"{stem}_pb2.pyi"):
        with open(os.path.join(tmp, name), "rb") as a, open(os.path.join(ROOT, GENERATED[proto], name), "rb") as b:
            assert a.read() == b.read(), f"{name} is stale: run `make proto`"


def test_wire_format_field_numbers() -> None:
    # RegisterRequest{version=1, endpoint=2, resource_name=3, options=4{pre_start_required=1}}
    data = pb.RegisterRequest(
        version="v1beta1", endpoint="e", resource_name="r", options=pb.DevicePluginOptions(pre_start_required=True)
    ).SerializeToString()
    assert data == b'\n\x07v1beta1\x12\x01e\x1a\x01r"\x02\x08\x01'
    # ContainerAllocateResponse.cdi_devices = 5, CDIDevice.name = 1
    assert pb.ContainerAllocateResponse(cdi_devices=[pb.CDIDevice(name="x")]).SerializeToString() == b"*\x03\n\x01x"
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]


def test_resource_health_wire_format() -> None:
    """NodeWatchResourcesResponse{devices=1{device=1{pool_name=1, device_name=2}, health=2,
    last_updated_time=3, health_check_timeout_seconds=4, message=5}}, the same in v1 and v1alpha1,
    each in its own package (the gRPC service is "<package>.DRAResourceHealth")."""
    from hyperlight_agent.dra import dra_health_v1_pb2, dra_health_v1alpha1_pb2

    for messages, package in ((dra_health_v1_pb2, "v1"), (dra_health_v1alpha1_pb2, "v1alpha1")):
        health = messages.DeviceHealth(
            device=messages.DeviceIdentifier(pool_name="p", device_name="d"),
            health=messages.HEALTHY,
            last_updated_time=5,
            health_check_timeout_seconds=7,
            message="m",
        )
        data = messages.NodeWatchResourcesResponse(devices=[health]).SerializeToString()
        assert data == b"\n\x11\n\x06\n\x01p\x12\x01d\x10\x01\x18\x05 \x07*\x01m"
        assert (messages.UNKNOWN, messages.HEALTHY, messages.UNHEALTHY) == (0, 1, 2)
        assert messages.DESCRIPTOR.package == package
        (method,) = messages.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods
        assert method.name == "NodeWatchResources" and method.server_streaming
