"""The agent's own HTTP server (host/httpd.py), in-process on a real port: each route answered with
its status, type and length (HEAD without the body), anything else 404, 405 or 400; a request
head too long for a scrape gets no answer; a client that sends nothing is closed after the
timeout; at the cap the oldest connection still sending its request makes room; an address in
use is said once and retried until it is free. (The metrics port of a running agent: idle
connections and garbage, test_host_metrics.py; the probes' routes: test_host_probes.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import AsyncIterator

import pytest

from hyperlight_agent import waits
from hyperlight_agent.host import httpd
from hyperlight_agent.host.httpd import TEXT, HttpServer
from tests.conftest import until
from tests.test_host_metrics import free_port

ROUTES = {"/hello": lambda: (200, TEXT, b"hello\n"), "/empty": lambda: (503, TEXT, b"")}


@contextlib.asynccontextmanager
async def serving(server: HttpServer) -> AsyncIterator[HttpServer]:
    task = asyncio.ensure_future(server.run())
    try:
        await until(lambda: server.listening or task.done(), timeout=10, what="the server listening")
        yield server
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def exchange(address: str, request: bytes) -> bytes:
    """What the server answers `request` with, until it closes the connection (b"": nothing, also
    when it closed on what we sent unread, which the kernel says with a reset)."""
    host, port = httpd.split_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        return await waits.within(reader.read(), 10)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


def get(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


async def test_routes_are_answered_and_anything_else_refused_by_its_code() -> None:
    address = f"127.0.0.1:{free_port()}"
    async with serving(HttpServer(address, ROUTES, "test_address")):
        hello = await exchange(address, get("/hello?x=1"))
        assert hello == (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 6\r\n"
            b"Connection: close\r\n\r\nhello\n"
        )
        head = await exchange(address, get("/hello", "HEAD"))
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(
            b"Content-Length: 6\r\nConnection: close\r\n\r\n"
        )
        assert (await exchange(address, get("/empty"))).endswith(b"\r\n\r\n503 Service Unavailable\n")
        assert (await exchange(address, get("/nowhere"))).startswith(b"HTTP/1.1 404 Not Found\r\n")
        assert (await exchange(address, get("/hello", "POST"))).startswith(b"HTTP/1.1 405 Method Not Allowed\r\n")
        assert (await exchange(address, b"\x16\x03\x01 hello\r\n\r\n")).startswith(b"HTTP/1.1 400 Bad Request\r\n")


async def test_a_request_head_too_long_for_a_scrape_gets_no_answer() -> None:
    address = f"127.0.0.1:{free_port()}"
    async with serving(HttpServer(address, ROUTES, "test_address")):
        long = b"GET /hello HTTP/1.1\r\nX: " + b"a" * httpd.MAX_REQUEST_BYTES
        assert await exchange(address, long) == b""
        assert (await exchange(address, get("/hello"))).endswith(b"hello\n"), "the server serves on"


async def test_a_client_that_sends_nothing_is_closed_after_the_timeout() -> None:
    address = f"127.0.0.1:{free_port()}"
    async with serving(HttpServer(address, ROUTES, "test_address", timeout=0.2)):
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await exchange(address, b"GET /hel") == b"", "half a request, then silence"
        assert 0.2 <= loop.time() - started < 5


async def test_at_the_cap_the_oldest_connection_still_sending_makes_room() -> None:
    address = f"127.0.0.1:{free_port()}"
    server = HttpServer(address, ROUTES, "test_address", max_connections=2)
    async with serving(server):
        host, port = httpd.split_address(address)
        idle = [await asyncio.open_connection(host, port) for _ in range(2)]
        try:
            await until(lambda: len(server._open) == 2, timeout=10, what="both idle connections accepted")
            assert (await exchange(address, get("/hello"))).endswith(b"hello\n")
            oldest, newer = idle
            assert await waits.within(oldest[0].read(), 10) == b"", "the oldest idle one was evicted"
            assert not newer[0].at_eof()
        finally:
            for _, writer in idle:
                writer.close()


async def test_an_address_in_use_is_said_once_and_retried_until_free(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hyperlight_agent")
    monkeypatch.setattr(httpd, "BIND_RETRY_INITIAL_S", 0.02)
    monkeypatch.setattr(httpd, "BIND_RETRY_CAP_S", 0.05)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    server = HttpServer(address, ROUTES, "test_address")
    attempts = []
    listen = server._listen

    async def counted() -> socket.socket:
        attempts.append(1)
        return await listen()

    monkeypatch.setattr(server, "_listen", counted)
    task = asyncio.ensure_future(server.run())
    try:
        await until(lambda: len(attempts) >= 3, timeout=10, what="three attempts to listen")
        assert server.bind_error.startswith(f"test_address {address}: cannot listen: Address already in use")
        taken.close()
        await until(lambda: server.listening, timeout=10, what="listening once the address is free")
        assert server.bind_error == "" and caplog.text.count("cannot listen") == 1, "said once, not per retry"
        assert f"test_address {address}: listening now" in caplog.text
        assert (await exchange(address, get("/hello"))).endswith(b"hello\n")
    finally:
        taken.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
