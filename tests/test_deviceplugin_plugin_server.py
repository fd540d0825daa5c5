"""Our plugin server, one generation at a time (deviceplugin/plugin_server.py): served in place
and never over a live socket, the kubelet's stream told from other clients', streams of a
generation it replaced ignored, and its socket removed at stop only while it is ours."""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Callable

import grpc
import pytest

from hyperlight_agent.deviceplugin.plugin_server import AlreadyServed, PluginServer


class Recorder:
    """configure() for the server: keeps each generation's on_stream, and counts ended streams."""

    def __init__(self) -> None:
        self.on_stream: list[Callable[[int, object], None]] = []
        self.ended = 0
        self.seen: list[int] = []  # on_streams(kubelets) calls

    def configure(self, server: grpc.aio.Server, on_stream: Callable[[int, object], None]) -> Callable[[], None]:
        self.on_stream.append(on_stream)

        def end() -> None:
            self.ended += 1

        return end


def serve(body: Callable[[PluginServer, Recorder, str], object]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        recorder = Recorder()
        path = os.path.join(tmp, "hyperlight.sock")
        server = PluginServer(path, recorder.configure, recorder.seen.append)

        async def main() -> None:
            await server.serve()
            try:
                await body(server, recorder, path)  # type: ignore[misc]
            finally:
                await server.stop(0)

        asyncio.run(main())


def test_the_kubelets_stream_is_the_first_after_register_and_others_are_counted_only() -> None:
    async def body(server: PluginServer, recorder: Recorder, path: str) -> None:
        assert server.ours() and os.path.exists(path)
        on_stream = recorder.on_stream[-1]
        sidecar, kubelet = object(), object()
        on_stream(+1, sidecar)  # before our Register: another client's
        server.stream.sent()
        on_stream(+1, kubelet)
        assert recorder.seen == [0, 1] and server.current_streams == 2 and server.stream.open
        on_stream(-1, sidecar)
        on_stream(-1, kubelet)
        assert recorder.seen == [0, 1, 0, -1] and server.current_streams == 0 and server.stream.ended

    serve(body)


def test_streams_of_a_replaced_generation_change_nothing() -> None:
    async def body(server: PluginServer, recorder: Recorder, path: str) -> None:
        old = recorder.on_stream[-1]
        await server.stop(0)
        assert recorder.ended == 1 and not server.ours() and not os.path.exists(path)
        await server.serve()
        old(+1, object())
        old(-1, object())
        assert recorder.seen == [] and server.current_streams == 0
        recorder.on_stream[-1](+1, object())
        assert recorder.seen == [0] and server.current_streams == 1

    serve(body)


def test_a_live_socket_at_the_path_is_never_taken_over() -> None:
    async def body(server: PluginServer, recorder: Recorder, path: str) -> None:
        other = PluginServer(path, Recorder().configure, lambda kubelets: None)
        with pytest.raises(AlreadyServed, match=r"hyperlight\.sock"):
            await other.serve()
        assert server.ours()
        await other.stop(0)  # never served: leaves ours alone
        assert server.ours() and os.path.exists(path)

    serve(body)


def test_stop_leaves_a_socket_that_is_no_longer_ours() -> None:
    async def body(server: PluginServer, recorder: Recorder, path: str) -> None:
        os.unlink(path)
        with open(path, "w") as f:  # someone else's file now
            f.write("theirs")
        assert not server.ours()
        await server.stop(0)
        with open(path) as f:
            assert f.read() == "theirs"

    serve(body)
