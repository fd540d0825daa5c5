"""gRPC plumbing for the kubelet's v1beta1 services, written by hand on top of the generated
messages (deviceplugin_pb2).

Why not grpcio-tools' *_pb2_grpc.py: recent generated stubs refuse to import under older
grpcio (Debian 12 ships 1.51), and the services are five methods and one: a table is enough.

Why: docs/decisions/grpc-tables-and-protoc-3-21.md.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Optional

import grpc

from hyperlight_agent import contracts, transport
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


async def register(
    kubelet_socket: str, endpoint: str, resource: str, timeout: float, unless: Awaitable[None]
) -> Optional[BaseException]:
    """Register `resource` served at `endpoint` (a socket name in the kubelet's directory) through
    kubelet_socket, cancelled if `unless` completes first. Returns how it failed, or None: the
    kubelet's grpc.aio.AioRpcError, or asyncio.CancelledError when `unless` came first.

    The error is taken, not raised, inside the channel: a traceback through this frame would keep
    the call, and grpc's connection state for kubelet.sock with it, until the garbage collector ran."""
    request = pb.RegisterRequest(
        version=contracts.KUBELET_API_VERSION, endpoint=endpoint, resource_name=resource, options=plugin_options()
    )
    async with grpc.aio.insecure_channel(transport.unix_target(kubelet_socket)) as channel:
        call = asyncio.ensure_future(registration_stub(channel).Register(request, timeout=timeout))
        first = asyncio.ensure_future(unless)
        try:
            await asyncio.wait({call, first}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            first.cancel()
            call.cancel()  # nothing once it is done; else the RPC is cancelled
        if not call.done():
            await asyncio.wait({call})
            return asyncio.CancelledError()
        error: Optional[BaseException] = call.exception()
        return error
