"""The device plugin protocol's gRPC plumbing (deviceplugin/api.py), written by hand: its method
tables are the services of proto/deviceplugin.proto, method for method (names, message types,
streaming); the options tell the kubelet we need no PreStartContainer and offer no preferred
allocation; a handler and a stub built from the tables talk over a real unix socket. (The messages'
wire format: test_proto.py.)"""

from __future__ import annotations

import os
from typing import Any, AsyncIterator

import grpc
import pytest

from hyperlight_agent import transport
from hyperlight_agent.deviceplugin import api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb


@pytest.mark.parametrize(
    ("name", "service", "methods"),
    [
        ("DevicePlugin", api.DEVICE_PLUGIN_SERVICE, api.DEVICE_PLUGIN_METHODS),
        ("Registration", api.REGISTRATION_SERVICE, api.REGISTRATION_METHODS),
    ],
)
def test_the_method_tables_are_the_protos_services(name: str, service: str, methods: transport.Methods) -> None:
    described = pb.DESCRIPTOR.services_by_name[name]
    assert described.full_name == service
    assert [
        (m.name, m.input_type.full_name, m.output_type.full_name, m.server_streaming) for m in described.methods
    ] == [
        (method, request.DESCRIPTOR.full_name, response.DESCRIPTOR.full_name, streaming)
        for method, (request, response, streaming) in methods.items()
    ]


def test_the_options_ask_for_no_pre_start_and_offer_no_preferred_allocation() -> None:
    options = api.plugin_options()
    assert (options.pre_start_required, options.get_preferred_allocation_available) == (False, False)


class Plugin:
    def __init__(self) -> None:
        self.registered: list[Any] = []

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return api.plugin_options()

    async def Register(self, request: Any, context: Any) -> Any:
        self.registered.append(request)
        return pb.Empty()

    async def not_called(self, request: Any, context: Any) -> Any:
        raise AssertionError("not called here")

    GetPreferredAllocation = Allocate = PreStartContainer = not_called

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield pb.ListAndWatchResponse()


async def test_handlers_and_stubs_from_the_tables_talk_over_a_unix_socket(tmp: str) -> None:
    plugin = Plugin()
    path = os.path.join(tmp, "plugin.sock")
    serving = await transport.serve_in_place(
        path,
        lambda server: server.add_generic_rpc_handlers(
            [api.device_plugin_handler(plugin), api.registration_handler(plugin)]
        ),
        ".plugin.",
        "kubelet_dir",
    )
    try:
        async with grpc.aio.insecure_channel(transport.unix_target(path)) as channel:
            options = await api.device_plugin_stub(channel).GetDevicePluginOptions(pb.Empty(), timeout=5)
            assert options == api.plugin_options()
            request = pb.RegisterRequest(version="v1beta1", endpoint="plugin.sock", resource_name="example.com/r")
            assert await api.registration_stub(channel).Register(request, timeout=5) == pb.Empty()
        assert plugin.registered == [request]
    finally:
        await serving.stop(0)
