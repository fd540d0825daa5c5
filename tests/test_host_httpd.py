"""The agent's own HTTP server (host/httpd.py), in-process on a real port: each route answered with
its status, type and length (HEAD without the body), anything else 404, 405 or 400; a request
head too long for a scrape gets no answer; a client that sends nothing is closed after the
timeout; at the cap the oldest connection still sending its request makes room; a connection
reaches the server only with its request or its end, or once idle for the defer period, and then
waits for its request; a request written after newer idle connections came is answered; an
address in use is said once and retried until it is free. (The metrics port of a running agent:
idle connections and garbage, test_host_metrics.py; the probes' routes: test_host_probes.py; a
flood on the probe port: test_hostile.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import AsyncIterator

import pytest

from hyperlight_agent import waits
from hyperlight_agent.host import httpd
from hyperlight_agent.host.httpd import TEXT, HttpServer
from tests.conftest import until
from tests.test_docs import ROOT
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
            for _, writer in idle:
                writer.write(b"GET /hel")  # and never the rest
            await until(lambda: len(server._open) == 2, timeout=10, what="both slow connections accepted")
            assert (await exchange(address, get("/hello"))).endswith(b"hello\n")
            oldest, newer = idle
            assert await waits.within(oldest[0].read(), 10) == b"", "the oldest idle one was evicted"
            assert not newer[0].at_eof()
        finally:
            for _, writer in idle:
                writer.close()


async def received(client: socket.socket) -> bytes:
    """What the server sent on a (non-blocking) client socket until it closed the connection."""
    loop = asyncio.get_running_loop()
    answer = b""
    while chunk := await waits.within(loop.sock_recv(client, 4096), 10):
        answer += chunk
    return answer


def queued(address: str, n: int) -> list[socket.socket]:
    """n connections, made while the loop runs nothing (blocking connects in a coroutine): the
    kernel queues them all for the server's next round."""
    return [socket.create_connection(httpd.split_address(address), timeout=10) for _ in range(n)]


async def test_a_request_written_after_newer_idle_connections_came_is_answered() -> None:
    """The kubelet connects, then writes its request; a flood's idle connections may come in
    between. Its probe is answered: before, a round that took it before its request came, with
    newer idle connections, closed it as one of them (issue 47: 3)."""
    address = f"127.0.0.1:{free_port()}"
    async with serving(HttpServer(address, ROUTES, "test_address")):
        loop = asyncio.get_running_loop()
        [probe] = queued(address, 1)  # connected, its request not written yet
        idle = queued(address, 3)
        [asking] = queued(address, 1)
        asking.sendall(get("/hello"))
        clients = [probe, *idle, asking]
        try:
            for client in clients:
                client.setblocking(False)
            assert (await received(asking)).endswith(b"hello\n"), "a round ran"
            await loop.sock_sendall(probe, get("/hello"))
            assert (await received(probe)).endswith(b"hello\n")
        finally:
            for client in clients:
                client.close()


async def test_a_connection_reaches_the_server_only_with_its_request_or_its_end() -> None:
    """Idle connections, twice the cap, stay in the kernel and cost the server nothing: none is
    taken, closed or evicted (TCP_DEFER_ACCEPT); one that ends without a request is taken and
    closed at once; one with its request is answered."""
    address = f"127.0.0.1:{free_port()}"
    server = HttpServer(address, ROUTES, "test_address", max_connections=2, defer_accept=60)
    async with serving(server):
        idle = queued(address, 4)
        [ending] = queued(address, 1)
        ending.shutdown(socket.SHUT_WR)
        clients = [*idle, ending]
        try:
            for client in clients:
                client.setblocking(False)
            assert await received(ending) == b"", "closed, no answer"
            assert (await exchange(address, get("/hello"))).endswith(b"hello\n")
            assert not server._open, "no idle connection taken"
            for client in idle:
                with pytest.raises(BlockingIOError):
                    client.recv(1)  # still open, nothing from the server
        finally:
            for client in clients:
                client.close()


async def test_a_connection_idle_for_the_defer_period_is_taken_and_waits_for_its_request() -> None:
    """After DEFER_ACCEPT_S the kernel hands an idle connection over; it then has the request
    timeout like any other, and is answered when its request comes."""
    address = f"127.0.0.1:{free_port()}"
    server = HttpServer(address, ROUTES, "test_address")
    async with serving(server):
        loop = asyncio.get_running_loop()
        [late] = queued(address, 1)
        try:
            late.setblocking(False)
            await until(lambda: len(server._open) == 1, timeout=10, what="the idle connection taken")
            await loop.sock_sendall(late, get("/hello"))
            assert (await received(late)).endswith(b"hello\n")
        finally:
            late.close()


def syncookies() -> bool:
    with open("/proc/sys/net/ipv4/tcp_syncookies") as f:
        return f.read().strip() == "1"  # the default: cookies once a listener's SYN queue is full


async def test_connections_past_the_backlog_are_taken_idle_and_wait_for_their_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deferred connections count against the backlog; past it the kernel completes new ones with
    SYN cookies and hands them over at once, request or not. Those wait for their request like
    any other, and every connection is answered (a round's older idle connections were closed,
    issue 47: 3)."""
    if not syncookies():
        pytest.skip("net.ipv4.tcp_syncookies is not 1: the kernel drops connections past the backlog")
    monkeypatch.setattr(httpd, "LISTEN_BACKLOG", 4)
    address = f"127.0.0.1:{free_port()}"
    server = HttpServer(address, ROUTES, "test_address", defer_accept=60)
    async with serving(server):
        loop = asyncio.get_running_loop()
        clients = queued(address, 7)  # 4 or 5 deferred, the rest past the backlog (and the accept queue fits them)
        try:
            for client in clients:
                client.setblocking(False)
            await until(lambda: len(server._open) >= 2, timeout=10, what="the connections past the backlog taken")
            for client in clients:
                await loop.sock_sendall(client, get("/hello"))
            for client in clients:
                assert (await received(client)).endswith(b"hello\n")
        finally:
            for client in clients:
                client.close()


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


async def test_an_address_without_a_host_is_served_on_every_address() -> None:
    """`:PORT` (issue 50: 9): IPv4 and, where the host has it, IPv6 loopback both answer."""
    port = free_port()
    async with serving(HttpServer(f":{port}", ROUTES, "test_address")) as server:
        assert server.listening
        assert (await exchange(f"127.0.0.1:{port}", get("/hello"))).endswith(b"hello\n")
        if socket.has_ipv6 and os.path.exists("/proc/net/if_inet6"):
            assert (await exchange(f"[::1]:{port}", get("/hello"))).endswith(b"hello\n")


def test_the_docs_state_the_server_s_bounds() -> None:
    """docs/agent.md's sentence on the HTTP server names its constants (they change here first)."""
    with open(os.path.join(ROOT, "docs", "agent.md")) as f:
        text = " ".join(f.read().split())
    assert (
        f"new connections taken in at most {httpd.ACCEPT_ROUNDS_PER_SECOND} rounds a second of at most "
        f"{httpd.ACCEPT_BATCH} and {httpd.MAX_CONNECTIONS} open"
    ) in text
    assert f"only once its request has come (or after {httpd.DEFER_ACCEPT_S} s without one" in text
    assert f"{httpd.REQUEST_TIMEOUT_S:g} s to send the request" in text
    assert f"request heads up to {httpd.MAX_REQUEST_BYTES // 1024} KiB" in text
