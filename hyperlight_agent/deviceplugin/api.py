"""gRPC plumbing for the kubelet's v1beta1 services, written by hand on top of the generated
messages (deviceplugin_pb2).

Why not grpcio-tools' *_pb2_grpc.py: recent generated stubs refuse to import under older
grpcio (Debian 12 ships 1.51), and the services are five methods and one: a table is enough.
"""

from __future__ import annotations

from typing import Any

import grpc

from hyperlight_agent import transport
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb

REGISTRATION_SERVICE = "v1beta1.Registration"
DEVICE_PLUGIN_SERVICE = "v1beta1.DevicePlugin"

# method name → (request type, response type, server-streaming?)
DEVICE_PLUGIN_METHODS: transport.Methods = {
    "GetDevicePluginOptions": (pb.Empty, pb.DevicePluginOptions, False),
    "ListAndWatch": (pb.Empty, pb.ListAndWatchResponse, True),
    "GetPreferredAllocation": (pb.PreferredAllocationRequest, pb.PreferredAllocationResponse, False),
    "Allocate": (pb.AllocateRequest, pb.AllocateResponse, False),
    "PreStartContainer": (pb.PreStartContainerRequest, pb.PreStartContainerResponse, False),
}
REGISTRATION_METHODS: transport.Methods = {
    "Register": (pb.RegisterRequest, pb.Empty, False),
}


def plugin_options() -> pb.DevicePluginOptions:
    """What we tell the kubelet, in Register and GetDevicePluginOptions alike: no PreStartContainer
    and no preferred allocation (slots are interchangeable)."""
    return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)


def device_plugin_handler(servicer: object) -> grpc.GenericRpcHandler[Any, Any]:
    return transport.handler(DEVICE_PLUGIN_SERVICE, DEVICE_PLUGIN_METHODS, servicer)


def registration_handler(servicer: object) -> grpc.GenericRpcHandler[Any, Any]:
    return transport.handler(REGISTRATION_SERVICE, REGISTRATION_METHODS, servicer)


def device_plugin_stub(channel: Any) -> transport.Stub:
    return transport.Stub(channel, DEVICE_PLUGIN_SERVICE, DEVICE_PLUGIN_METHODS)


def registration_stub(channel: Any) -> transport.Stub:
    return transport.Stub(channel, REGISTRATION_SERVICE, REGISTRATION_METHODS)
