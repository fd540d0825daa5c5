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
