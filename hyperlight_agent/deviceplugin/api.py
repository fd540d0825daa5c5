"""gRPC plumbing for the kubelet's v1beta1 services, written by hand on top of the generated
messages (deviceplugin_pb2).

Why not grpcio-tools' *_pb2_grpc.py: recent generated stubs refuse to import under older
grpcio (Debian 12 ships 1.51), and the services are five methods and one: a table is enough.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import grpc

from hyperlight_agent import wire
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb

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


def plugin_options() -> pb.DevicePluginOptions:
    """What we tell the kubelet, in Register and GetDevicePluginOptions alike: no PreStartContainer
    and no preferred allocation (slots are interchangeable)."""
    return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)


def generic_handler(service: str, methods: dict[str, tuple[Any, Any, bool]],
                    implementation: object) -> grpc.GenericRpcHandler[Any, Any]:
    """A handler serving `service` with implementation's methods of the same names."""
    handlers = {}
    for name, (request, response, streaming) in methods.items():
        make: Callable[..., grpc.RpcMethodHandler[Any, Any]] = (
            grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = make(
            _refusing_unparsable(getattr(implementation, name), streaming),
            request_deserializer=wire.parser(request),
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service, handlers)


def _refusing_unparsable(method: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
    # grpc.aio tells the kinds of handler apart by what they are: a stream stays an async
    # generator function, a unary method a coroutine function.
    if streaming:
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, wire.Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            responses = method(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()  # `async for` alone leaves the inner generator to the GC

        return stream

    async def unary(request: Any, context: Any) -> Any:
        if isinstance(request, wire.Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context)

    return unary


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


unix_target = wire.unix_target
