"""A TCP proxy for tests, on the caller's event loop, that can go silent the way a broken network
does: freeze() makes every connection open at that moment stop forwarding in both directions,
with no FIN and no RST (the peers' sockets stay open, their data unread), while connections made
afterwards work as before. It counts the bytes it forwards each way (benchmarks read them: what
crossed the network, TLS included), and how often each of `markers` went down to the client: a
test that freezes a connection after an answer reached the client waits on that, not on the
server having been asked."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Optional


class FreezingProxy:
    def __init__(self, target_host: str, target_port: int, markers: tuple[bytes, ...] = ()) -> None:
        self._target = (target_host, target_port)
        self.seen = dict.fromkeys(markers, 0)  # marker → times forwarded to the client
        self._server: Optional[asyncio.base_events.Server] = None
        self._connections: list[tuple[asyncio.Event, list[asyncio.StreamWriter]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.accepted = 0
        self.bytes_up = 0  # client → target
        self.bytes_down = 0  # target → client

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def freeze(self) -> None:
        """Every connection open now forwards nothing more, and is never closed by us."""
        for frozen, _ in self._connections:
            frozen.set()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for _, writers in self._connections:
            for writer in writers:
                writer.close()
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        frozen = asyncio.Event()
        self._connections.append((frozen, [writer, upstream_writer]))
        for source, sink, up in ((reader, upstream_writer, True), (upstream_reader, writer, False)):
            task = asyncio.ensure_future(self._pump(source, sink, frozen, up))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, frozen: asyncio.Event, up: bool
    ) -> None:
        tail = b""  # the end of what went down before, for a marker split between two reads
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while not frozen.is_set():
                data = await source.read(65536)
                if frozen.is_set():
                    break  # read, but never forwarded: lost on the way
                if not data:
                    sink.close()
                    return
                sink.write(data)
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                    if self.seen:
                        # The tail is shorter than any marker: an occurrence counted before is not in it.
                        window = tail + data
                        for marker in self.seen:
                            self.seen[marker] += window.count(marker)
                        keep = max(len(m) for m in self.seen) - 1
                        tail = window[len(window) - keep :] if keep else b""
                await sink.drain()
            await asyncio.Event().wait()  # frozen: hold both sockets open, silently
