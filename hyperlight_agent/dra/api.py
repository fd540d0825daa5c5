"""gRPC plumbing for the kubelet's DRA services, written by hand on top of the generated messages
(dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2), as deviceplugin/api.py does for the
device plugin protocol and for the same reason: grpcio-tools' stubs need a recent grpcio.

    registration_handler(servicer)  → /pluginregistration.Registration/{GetInfo,NotifyRegistrationStatus}
    dra_handlers(servicer)          → /k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/... and the v1beta1 one
    health_handlers(servicer)       → /v1.DRAResourceHealth/NodeWatchResources and the v1alpha1 one

The two DRAPlugin versions have the same messages in different packages (v1 adds Device.share_id),
so one servicer answers both: each method is called with the request message and the module
(`v1` or `v1beta1`) whose messages the answer must be built from. The resource-health service's
two versions are alike too (v1alpha1 is v1 in another package), and served the same way.

Why: docs/decisions/grpc-tables-and-protoc-3-21.md.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import grpc

from hyperlight_agent import contracts, transport
from hyperlight_agent.dra import dra_health_v1_pb2 as health_v1
from hyperlight_agent.dra import dra_health_v1alpha1_pb2 as health_v1alpha1
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

# The resource-health service's supported_versions entries are its gRPC service names.
HEALTH_VERSIONS: dict[str, ModuleType] = {
    contracts.DRA_HEALTH_V1: health_v1,
    contracts.DRA_HEALTH_V1ALPHA1: health_v1alpha1,
}


def dra_methods(messages: ModuleType) -> transport.Methods:
    """method name → (request type, response type, streaming?) in one version's message module."""
    return {
        "NodePrepareResources": (messages.NodePrepareResourcesRequest, messages.NodePrepareResourcesResponse, False),
        "NodeUnprepareResources": (
            messages.NodeUnprepareResourcesRequest,
            messages.NodeUnprepareResourcesResponse,
            False,
        ),
    }


def health_methods(messages: ModuleType) -> transport.Methods:
    return {"NodeWatchResources": (messages.NodeWatchResourcesRequest, messages.NodeWatchResourcesResponse, True)}


REGISTRATION_METHODS: transport.Methods = {
    "GetInfo": (reg.InfoRequest, reg.PluginInfo, False),
    "NotifyRegistrationStatus": (reg.RegistrationStatus, reg.RegistrationStatusResponse, False),
}


def registration_handler(servicer: object) -> grpc.GenericRpcHandler[Any, Any]:
    """Serves servicer.GetInfo(request, context) and .NotifyRegistrationStatus(request, context)."""
    return transport.handler(REGISTRATION_SERVICE, REGISTRATION_METHODS, servicer)


def dra_handlers(servicer: object) -> list[grpc.GenericRpcHandler[Any, Any]]:
    """Both DRAPlugin versions, served by servicer.NodePrepareResources(request, context, messages)
    and .NodeUnprepareResources(request, context, messages)."""
    return [
        transport.handler(service, dra_methods(messages), servicer, messages) for service, messages in VERSIONS.values()
    ]


def health_handlers(servicer: object) -> list[grpc.GenericRpcHandler[Any, Any]]:
    """Both DRAResourceHealth versions, served by servicer.NodeWatchResources(request, context,
    messages), an async generator."""
    return [
        transport.handler(service, health_methods(messages), servicer, messages)
        for service, messages in HEALTH_VERSIONS.items()
    ]


def registration_stub(channel: Any) -> transport.Stub:
    return transport.Stub(channel, REGISTRATION_SERVICE, REGISTRATION_METHODS)


def dra_stub(channel: Any, version: str) -> transport.Stub:
    """The DRAPlugin client for one supported_versions entry ("v1.DRAPlugin")."""
    service, messages = VERSIONS[version]
    return transport.Stub(channel, service, dra_methods(messages))


def health_stub(channel: Any, service: str) -> transport.Stub:
    """The DRAResourceHealth client for one of its services ("v1.DRAResourceHealth")."""
    return transport.Stub(channel, service, health_methods(HEALTH_VERSIONS[service]))
