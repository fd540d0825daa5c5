"""gRPC plumbing for the kubelet's DRA services, written by hand on top of the generated messages
(dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2), as deviceplugin/api.py does for the
device plugin protocol and for the same reason: grpcio-tools' stubs need a recent grpcio.

    registration_handler(servicer)  → /pluginregistration.Registration/{GetInfo,NotifyRegistrationStatus}
    dra_handlers(servicer)          → /k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/... and the v1beta1 one

The two DRAPlugin versions have the same messages in different packages (v1 adds Device.share_id),
so one servicer answers both: each method is called with the request message and the module
(`v1` or `v1beta1`) whose messages the answer must be built from.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Awaitable, Callable

import grpc

from hyperlight_agent import contracts, wire
from hyperlight_agent.dra import dra_v1_pb2 as v1
from hyperlight_agent.dra import dra_v1beta1_pb2 as v1beta1
from hyperlight_agent.dra import pluginregistration_pb2 as reg

# Full gRPC service names (the proto package and service), for the wire.
REGISTRATION_SERVICE = "pluginregistration.Registration"
DRA_V1_SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
DRA_V1BETA1_SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"

# What the kubelet calls each version in PluginInfo.supported_versions → (service, messages).
VERSIONS: dict[str, tuple[str, ModuleType]] = {
    contracts.DRA_VERSION_V1: (DRA_V1_SERVICE, v1),
    contracts.DRA_VERSION_V1BETA1: (DRA_V1BETA1_SERVICE, v1beta1),
}


def dra_methods(messages: ModuleType) -> dict[str, tuple[Any, Any]]:
    """method name → (request type, response type) in one version's message module."""
    return {
        "NodePrepareResources": (messages.NodePrepareResourcesRequest, messages.NodePrepareResourcesResponse),
        "NodeUnprepareResources": (messages.NodeUnprepareResourcesRequest, messages.NodeUnprepareResourcesResponse),
    }


REGISTRATION_METHODS: dict[str, tuple[Any, Any]] = {
    "GetInfo": (reg.InfoRequest, reg.PluginInfo),
    "NotifyRegistrationStatus": (reg.RegistrationStatus, reg.RegistrationStatusResponse),
}


def _unary(method: Callable[..., Awaitable[Any]], *bound: Any) -> Callable[..., Awaitable[Any]]:
    # A coroutine function, so grpc.aio treats it as a unary handler.
    async def call(request: Any, context: Any) -> Any:
        if isinstance(request, wire.Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context, *bound)

    return call


def _handler(service: str, methods: dict[str, tuple[Any, Any]], implementation: object,
             *bound: Any) -> grpc.GenericRpcHandler[Any, Any]:
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _unary(getattr(implementation, name), *bound),
            request_deserializer=wire.parser(request),
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in methods.items()
    }
    return grpc.method_handlers_generic_handler(service, handlers)


def registration_handler(servicer: object) -> grpc.GenericRpcHandler[Any, Any]:
    """Serves servicer.GetInfo(request, context) and .NotifyRegistrationStatus(request, context)."""
    return _handler(REGISTRATION_SERVICE, REGISTRATION_METHODS, servicer)


def dra_handlers(servicer: object) -> list[grpc.GenericRpcHandler[Any, Any]]:
    """Both DRAPlugin versions, served by servicer.NodePrepareResources(request, context, messages)
    and .NodeUnprepareResources(request, context, messages)."""
    return [_handler(service, dra_methods(messages), servicer, messages) for service, messages in VERSIONS.values()]


class Stub:
    """Client callables for a service: Stub(channel, REGISTRATION_SERVICE, REGISTRATION_METHODS).GetInfo(req)."""

    def __init__(self, channel: Any, service: str, methods: dict[str, tuple[Any, Any]]) -> None:
        for name, (request, response) in methods.items():
            setattr(self, name, channel.unary_unary(
                f"/{service}/{name}",
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            ))

    def __getattr__(self, name: str) -> Any:  # for type checkers: methods are set in __init__
        raise AttributeError(name)


def registration_stub(channel: Any) -> Stub:
    return Stub(channel, REGISTRATION_SERVICE, REGISTRATION_METHODS)


def dra_stub(channel: Any, version: str) -> Stub:
    """The DRAPlugin client for one supported_versions entry ("v1.DRAPlugin")."""
    service, messages = VERSIONS[version]
    return Stub(channel, service, dra_methods(messages))


unix_target = wire.unix_target
