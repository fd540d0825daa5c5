"""Our device plugin server at its socket path, one generation at a time: served in place (bound
at a private name, renamed over no live socket), stopped with its streams ended first, and which
of its ListAndWatch streams is the kubelet's. The registrar (registration.py) serves a new
generation for each Register; streams of a generation it already replaced change nothing.

Why: docs/decisions/endpoint-naming.md.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import grpc

from hyperlight_agent import transport
from hyperlight_agent.deviceplugin.registration_state import KubeletStream


class AlreadyServed(Exception):
    """A live plugin (another agent) serves our socket path: we never take it over."""


# configure(server, on_stream) adds our services to a new server and returns a function ending its
# ListAndWatch streams; on_stream(+1/-1, stream) must be called as they open and end, `stream`
# being any object that stands for the one stream.
Configure = Callable[[grpc.aio.Server, Callable[[int, object], None]], Callable[[], None]]


class PluginServer:
    """Serves `configure`'s services at socket_path; on_streams(kubelets) after each change of its
    streams: +1 the kubelet's opened, -1 it ended, 0 another client's."""

    def __init__(self, socket_path: str, configure: Configure, on_streams: Callable[[int], None]) -> None:
        self.socket_path = socket_path
        self._configure = configure
        self._on_streams = on_streams
        self._serving: Optional[transport.Serving] = None
        self._end_streams: Callable[[], None] = lambda: None
        self._generation = 0  # of the current server; streams of older ones are ignored
        self.current_streams = 0  # open ListAndWatch streams on the current server, anyone's
        self.stream = KubeletStream()

    async def serve(self) -> None:
        """A new generation in place. Raises AlreadyServed (a live socket is there) or
        transport.NotServing."""
        self._generation += 1
        generation = self._generation

        def configure(server: grpc.aio.Server) -> None:
            self._end_streams = self._configure(
                server, lambda delta, stream: self._on_stream(generation, delta, stream)
            )

        name = os.path.basename(self.socket_path)
        try:
            # Our private name: .<our socket>.<pid>.<8 hex> (contracts.private_socket_name).
            self._serving = await transport.serve_in_place(self.socket_path, configure, f".{name}.", "kubelet_dir")
        except transport.Taken as exc:
            raise AlreadyServed(str(exc)) from None

    def ours(self) -> bool:
        """We serve, and our socket is still the file at its path."""
        return self._serving is not None and self._serving.still_ours()

    def end_streams(self) -> None:
        """End the current server's ListAndWatch streams now (the first step of a shutdown)."""
        end_streams, self._end_streams = self._end_streams, lambda: None
        end_streams()

    async def stop(self, grace: float) -> None:
        """End our streams and stop accepting at once, give in-flight calls `grace`, then remove
        our socket (only if it is still the one we put there)."""
        serving, self._serving = self._serving, None
        self._generation += 1  # from here on, the old server's streams change nothing
        self.current_streams = 0
        self.stream.forget()
        self.end_streams()
        if serving is not None:
            await serving.stop(grace)

    def _on_stream(self, generation: int, delta: int, stream: object) -> None:
        if generation != self._generation:
            return  # a server we already replaced
        self.current_streams = max(0, self.current_streams + delta)
        if delta > 0:
            kubelets = 1 if self.stream.opened(stream, time.monotonic()) else 0
        else:
            kubelets = -1 if self.stream.closed(stream) else 0
        self._on_streams(kubelets)
