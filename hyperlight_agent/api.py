"""gRPC plumbing for the kubelet's v1beta1 services, written by hand on top of the generated
messages (deviceplugin_pb2).

Why not grpcio-tools' *_pb2_grpc.py: recent generated stubs refuse to import under older
grpcio (Debian 12 ships 1.51), and the services are five methods and one: a table is enough.
"""

from __future__ import annotations

from typing import Any, Callable

import grpc

from . import deviceplugin_pb2 as pb

REGISTRATION_SERVICE = "v1beta1.Registration"
DEVICE_PLUGIN_SERVICE = "v1beta1.DevicePlugin"

# method name → (request type, response type, server-streaming?)
DEVICE_PLUGIN_METHODS: dict[str, tuple[Any, Any, bool]] = {
    "GetDevicePluginOptions": (pb.Empty, pb.DevicePluginOptions, False),
    "ListAndWatch": (pb.Empty, pb.ListAndWatchResponse, True),
    "GetPreferredAllocation": (pb.PreferredAllocationRequest, pb.PreferredAllocationResponse, False),
    "Allocate": (pb.AllocateRequest, pb.AllocateResponse, False),
    "PreStartContainer": (pb.PreStartContainerRequest, pb.PreStartContainerResponse, False),
}
REGISTRATION_METHODS: dict[str, tuple[Any, Any, bool]] = {
    "Register": (pb.RegisterRequest, pb.Empty, False),
}


def generic_handler(service: str, methods: dict[str, tuple[Any, Any, bool]],
                    implementation: object) -> grpc.GenericRpcHandler[Any, Any]:
    """A handler serving `service` with implementation's methods of the same names."""
    handlers = {}
    for name, (request, response, streaming) in methods.items():
        make: Callable[..., grpc.RpcMethodHandler[Any, Any]] = (
            grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = make(
            getattr(implementation, name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service, handlers)


def device_plugin_handler(servicer: object) -> grpc.GenericRpcHandler[Any, Any]:
    return generic_handler(DEVICE_PLUGIN_SERVICE, DEVICE_PLUGIN_METHODS, servicer)


def registration_handler(servicer: object) -> grpc.GenericRpcHandler[Any, Any]:
    return generic_handler(REGISTRATION_SERVICE, REGISTRATION_METHODS, servicer)


class Stub:
    """Client callables for a service: Stub(channel, DEVICE_PLUGIN_SERVICE, ...).Allocate(req)."""

    def __init__(self, channel: Any, service: str, methods: dict[str, tuple[Any, Any, bool]]) -> None:
        for name, (request, response, streaming) in methods.items():
            factory = channel.unary_stream if streaming else channel.unary_unary
            setattr(self, name, factory(
                f"/{service}/{name}",
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            ))

    def __getattr__(self, name: str) -> Any:  # for type checkers: methods are set in __init__
        raise AttributeError(name)


def device_plugin_stub(channel: Any) -> Stub:
    return Stub(channel, DEVICE_PLUGIN_SERVICE, DEVICE_PLUGIN_METHODS)


def registration_stub(channel: Any) -> Stub:
    return Stub(channel, REGISTRATION_SERVICE, REGISTRATION_METHODS)


def unix_target(path: str) -> str:
    """gRPC's address for a unix socket path: unix:///var/lib/kubelet/device-plugins/kubelet.sock."""
    return "unix://" + path
