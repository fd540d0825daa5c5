"""The agent's own small HTTP server, on its event loop: what serves the metrics
(`metrics_address`) and the kubelet's httpGet probes (`probe_address`), one server per address,
each path a route answered from the agent's memory.

Not prometheus-client's thread-per-connection server: that one had no timeouts and no cap, so
idle connections each held a thread and a file descriptor for as long as the client liked, and
enough of them starved the device check of descriptors (every slot went Unhealthy). Here the
kernel hands over a connection only once its request (or its end) has come, or after DEFER_ACCEPT_S
without one; connections are taken in at most ACCEPT_ROUNDS_PER_SECOND rounds a second of at most
ACCEPT_BATCH each, a connection has REQUEST_TIMEOUT_S for its request and again for its response, a
request head is at most MAX_REQUEST_BYTES, and at most MAX_CONNECTIONS are open: one more evicts the
oldest connection still sending its request. No connection is closed for want of a request before
its REQUEST_TIMEOUT_S but by that eviction.

    server = HttpServer("0.0.0.0:8081", {"/livez": lambda: (200, TEXT, b"ok\n")}, "probe_address")
    await server.run()     # until cancelled
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Any, Callable, Mapping, Optional

from hyperlight_agent.backoff import Backoff
from hyperlight_agent.text import cause

log = logging.getLogger(__name__)

TEXT = "text/plain; charset=utf-8"
# What a route answers: (status code, content type, body).
Answer = tuple[int, str, bytes]
Route = Callable[[], Answer]

# A scraper (Prometheus, an agent's sidecar, an operator's curl) needs one connection at a time;
# this leaves room for a few at once and bounds the descriptors the endpoint can ever hold.
MAX_CONNECTIONS = 16
# For the whole request head, and again for the whole response: slow or idle clients go.
REQUEST_TIMEOUT_S = 5.0
# "GET /metrics HTTP/1.1" and a few headers; anything longer is not a scrape.
MAX_REQUEST_BYTES = 8192
# Binding the address is retried (see ARCHITECTURE.md: metrics never cost the node its slots).
BIND_RETRY_INITIAL_S = 1.0
BIND_RETRY_CAP_S = 30.0
# Connections waiting to be accepted cost the kernel some memory, not our descriptors. The deferred
# ones (DEFER_ACCEPT_S) count against it too: once it is full, the kernel completes further
# connections with SYN cookies, which it hands over at once whether their request came or not
# (measured, Linux 6.18). 1024 holds a second's worth of a 1000-a-second flood (net.core.somaxconn
# caps it: 4096 by default since Linux 5.4).
LISTEN_BACKLOG = 1024
# TCP_DEFER_ACCEPT (tcp(7)) on the listener: the kernel drops a new connection's bare ACK and
# queues it for accept() only once data or a FIN comes on it, or after this long without (it then
# resends its SYN-ACK and takes the client's answering ACK: kernel commit d1b99ba41d6c, "tcp:
# accept socket after TCP_DEFER_ACCEPT period"). The kubelet and a scraper write their request as
# soon as they are connected, so it is there when they are accepted, and answered in that
# callback. Without it (issue 47: 3) a round could take the kubelet's connection between its
# connect and its write, when it looked as idle as a flood's. A flood's idle connections stay in
# the kernel; those it closes within the period come with their FIN and are closed at once.
DEFER_ACCEPT_S = 1
# Connections are taken in rounds, at most this many a second, each round at most ACCEPT_BATCH of
# what the kernel queued since the last: a flood then costs the loop (which also answers the
# kubelet) a bounded share, at most ROUNDS × BATCH connections a second, and no round holds the
# loop for long. One connection a round was the rule before (issue 47: 3): a local process's 1000
# connections a second kept the backlog full of its own, the kubelet's SYNs were dropped and most
# of its probes timed out. 32 a round drains 3200 a second: such a flood with room to spare for a
# round that comes late (BENCHMARKS.md, "Probe flood").
ACCEPT_ROUNDS_PER_SECOND = 100
ACCEPT_BATCH = 32
# After accept() failed for want of descriptors (something else holds them): try again this soon.
ACCEPT_RETRY_S = 0.5
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (config.py has checked it) → (host, port); [v6] loses its brackets.

    >>> split_address("[::1]:9464")
    ('::1', 9464)
    """
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _every_address(port: int) -> tuple[socket.socket, tuple[Any, ...]]:
    """ ":PORT": one socket for every address, IPv6 and IPv4 (v4-mapped), as Go listens; IPv4's
    alone on a host without IPv6."""
    try:
        listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port)  # noqa: S104 - asked for
    try:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    except OSError:
        listener.close()
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port)  # noqa: S104 - asked for
    return listener, ("::", port)


class HttpServer:
    """GET (and HEAD) of its routes over HTTP/1.1, one request per connection, bounded in every
    dimension. `what` names the setting(s) it serves, for its log lines."""

    def __init__(
        self,
        address: str,
        routes: Mapping[str, Route],
        what: str,
        max_connections: int = MAX_CONNECTIONS,
        timeout: float = REQUEST_TIMEOUT_S,
        defer_accept: int = DEFER_ACCEPT_S,
    ) -> None:
        self.address = address
        self.routes = dict(routes)
        self.what = what
        self._max = max_connections
        self._timeout = timeout
        self._defer_accept = defer_accept
        # Open connections in arrival order; the value says whether its request is still coming.
        self._open: dict[_Exchange, bool] = {}
        self.bind_error = ""  # why the address cannot be served now ("" once it is)
        self.listening = False

    async def run(self) -> None:
        """Serve until cancelled; binding is retried with a capped backoff, said once per cause."""
        backoff = Backoff(BIND_RETRY_INITIAL_S, BIND_RETRY_CAP_S)
        while True:
            try:
                listener = await self._listen()
                break
            except OSError as exc:
                error = f"{self.what} {self.address}: cannot listen: {cause(exc)}"
                if error != self.bind_error:
                    log.warning(
                        "%s; retrying (up to every %g s), the agent carries on without it", error, BIND_RETRY_CAP_S
                    )
                    self.bind_error = error
                await asyncio.sleep(backoff.next())
        if self.bind_error:
            log.info("%s %s: listening now", self.what, self.address)
        self.bind_error = ""
        self.listening = True
        log.info("%s: serving %s on http://%s", self.what, " ".join(sorted(self.routes)), self.address)
        try:
            await self._accept(listener)
        finally:
            self.listening = False
            listener.close()
            for connection in list(self._open):
                connection.abort()

    async def _listen(self) -> socket.socket:
        host, port = split_address(self.address)
        if host:
            loop = asyncio.get_running_loop()
            family, kind, proto, _, where = (
                await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            )[0]
            listener = socket.socket(family, kind, proto)
        else:
            listener, where = _every_address(port)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, self._defer_accept)
            listener.bind(where)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        return listener

    async def _accept(self, listener: socket.socket) -> None:
        """Each connection of a round makes room for itself before the next is taken (asyncio's
        own servers take up to 100 at once, before anything can be evicted: enough to run a small
        descriptor limit out), so at most MAX_CONNECTIONS are ever open. The listener stays
        registered with the loop: no system calls to register it again for each connection (what
        `loop.sock_accept` makes), and no task or future for a connection that is answered at once
        (_Exchange)."""
        loop = asyncio.get_running_loop()
        state = _Accepting(loop, listener)
        loop.add_reader(listener.fileno(), self._readable, state)
        try:
            await loop.create_future()  # until cancelled
        finally:
            loop.remove_reader(listener.fileno())
            if state.resume is not None:
                state.resume.cancel()

    def _readable(self, state: _Accepting) -> None:
        """A round: up to ACCEPT_BATCH of the connections queued since the last one, each answered
        at once when its request is there (the listener defers them until it is), else watched
        until it comes or its deadline."""
        loop, listener = state.loop, state.listener
        now = loop.time()
        if now < state.next_round:
            state.pause(self._readable, state.next_round - now)
            return
        state.next_round = max(now, state.next_round) + 1 / ACCEPT_ROUNDS_PER_SECOND
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                return  # none left
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    continue  # ECONNABORTED and the like: that client is gone
                if not state.short_of_fds:
                    log.warning(
                        "%s: cannot accept a connection: %s; trying again every %g s",
                        self.what,
                        cause(exc),
                        ACCEPT_RETRY_S,
                    )
                state.short_of_fds = True
                state.pause(self._readable, ACCEPT_RETRY_S)
                return
            state.short_of_fds = False
            self._make_room()
            _Exchange(self, conn, loop).start()

    def _make_room(self) -> None:
        """At the cap, close the oldest connection still sending its request."""
        if len(self._open) >= self._max:
            oldest = next((c for c, reading in self._open.items() if reading), None)
            if oldest is None:  # every one is being answered, which ends within the timeout
                oldest = next(iter(self._open))
            del self._open[oldest]
            oldest.abort()

    def _response(self, head: bytes) -> bytes:
        method, path = _request_line(head)
        route = self.routes.get(path.split("?", 1)[0])
        if method is None:
            code, content_type, body = 400, TEXT, b""
        elif method not in ("GET", "HEAD"):
            code, content_type, body = 405, TEXT, b""
        elif route is None:
            code, content_type, body = 404, TEXT, b""
        else:
            code, content_type, body = route()
        if not body:
            body = f"{code} {_REASONS[code]}\n".encode()
        headers = (
            f"HTTP/1.1 {code} {_REASONS[code]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        return headers + (b"" if method == "HEAD" else body)


class _Accepting:
    """The accepting side of one listener: its rate, and a pause (for the rate, or after running
    out of descriptors) during which the loop does not watch it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
        self.loop, self.listener = loop, listener
        self.next_round = loop.time()
        self.short_of_fds = False
        self.resume: Optional[asyncio.TimerHandle] = None

    def pause(self, readable: Callable[[_Accepting], None], delay: float) -> None:
        fd = self.listener.fileno()
        self.loop.remove_reader(fd)
        self.resume = self.loop.call_later(delay, self.loop.add_reader, fd, readable, self)


class _Exchange:
    """One connection's request and answer, on its socket itself: no transport, task or future.
    A request is nearly always there by the time its connection is accepted (the listener defers
    it until then), and is answered in that callback; the loop watches the socket only while a
    request is still coming or an answer waits for the client to read it, and a deadline aborts
    it either way (a client that never finishes its request, or never reads the answer).
    asyncio's streams, a task and two timed waits per connection cost a probe about 0.4 ms of the
    agent's CPU (BENCHMARKS.md, "Probe cost")."""

    def __init__(self, server: HttpServer, conn: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self._server, self._conn, self._loop = server, conn, loop
        self._fd = conn.fileno()
        self._head = b""
        self._out = b""
        self._watching = ""  # "r" or "w": the loop watches the socket for that
        self._deadline: Optional[asyncio.TimerHandle] = None

    def start(self) -> None:
        """Answer the request that came with the connection, or wait for the rest of it."""
        self._conn.setblocking(False)
        self._server._open[self] = True
        self._receive()
        if self._server._open.get(self):
            self._watch("r", self._receive)

    def _watch(self, how: str, callback: Callable[[], None]) -> None:
        self._unwatch()
        if how == "r":
            self._loop.add_reader(self._fd, callback)
        else:
            self._loop.add_writer(self._fd, callback)
        self._watching = how
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._loop.call_later(self._server._timeout, self.abort)

    def _unwatch(self) -> None:
        if self._watching == "r":
            self._loop.remove_reader(self._fd)
        elif self._watching == "w":
            self._loop.remove_writer(self._fd)
        self._watching = ""

    def _receive(self) -> None:
        try:
            data = self._conn.recv(MAX_REQUEST_BYTES + 1 - len(self._head))
        except BlockingIOError:
            return
        except OSError:
            self.abort()
            return
        if not data:
            self.abort()  # gone before it asked
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_REQUEST_BYTES:
                self.abort()  # too long to be a scrape or a probe: no answer
            return
        self._server._open[self] = False
        try:
            self._out = self._server._response(self._head[: end + 4])
        except Exception:  # never a traceback on stderr for what a client sent
            log.debug("%s: request failed", self._server.what, exc_info=True)
            self.abort()
            return
        self._send()

    def _send(self) -> None:
        try:
            sent = self._conn.send(self._out)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.abort()
            return
        self._out = self._out[sent:]
        if not self._out:
            self.abort()  # answered: closed
        elif self._watching != "w":
            self._watch("w", self._send)  # the rest once the client reads, within the deadline

    def abort(self) -> None:
        """Close the connection, whatever it was doing (answered, timed out, evicted, shut down)."""
        self._unwatch()
        if self._deadline is not None:
            self._deadline.cancel()
        self._server._open.pop(self, None)
        self._conn.close()


def _request_line(head: bytes) -> tuple[Optional[str], str]:
    """(method, path) of an HTTP/1.x request head, or (None, "") when it is not one."""
    line = head.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[0].isalpha():
        return None, ""
    try:
        return parts[0].decode("ascii"), parts[1].decode("ascii")
    except UnicodeDecodeError:
        return None, ""
