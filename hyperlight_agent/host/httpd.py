"""The agent's own small HTTP server, on its event loop: what serves the metrics
(`metrics_address`) and the kubelet's httpGet probes (`probe_address`), one server per address,
each path a route answered from the agent's memory.

Not prometheus-client's thread-per-connection server: that one had no timeouts and no cap, so
idle connections each held a thread and a file descriptor for as long as the client liked, and
enough of them starved the device check of descriptors (every slot went Unhealthy). Here at most
ACCEPTS_PER_SECOND connections are taken a second, a connection has REQUEST_TIMEOUT_S for its
request and again for its response, a request head is at most MAX_REQUEST_BYTES, and at most
MAX_CONNECTIONS are open: one more evicts the oldest connection still sending its request (a
scraper or the kubelet sends its request at once, so it is rarely the one evicted).

    server = HttpServer("0.0.0.0:8081", {"/livez": lambda: (200, TEXT, b"ok\n")}, "probe_address")
    await server.run()     # until cancelled
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Callable, Mapping, Optional

from hyperlight_agent import waits
from hyperlight_agent.backoff import Backoff

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
LISTEN_BACKLOG = 128
# At most this many connections a second are taken: a scraper needs one every few seconds, and a
# flood of connections then costs the loop (which also answers the kubelet) a bounded share.
ACCEPTS_PER_SECOND = 100
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
    ) -> None:
        self.address = address
        self.routes = dict(routes)
        self.what = what
        self._max = max_connections
        self._timeout = timeout
        # Open connections in arrival order; the value says whether its request is still coming.
        self._open: dict[asyncio.StreamWriter, bool] = {}
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
                error = f"{self.what} {self.address}: cannot listen: {exc.strerror or exc}"
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
        tasks: set[asyncio.Future[None]] = set()
        try:
            await self._accept(listener, tasks)
        finally:
            self.listening = False
            listener.close()
            for writer in list(self._open):
                writer.transport.abort()
            for task in tasks:
                task.cancel()

    async def _listen(self) -> socket.socket:
        host, port = split_address(self.address)
        loop = asyncio.get_running_loop()
        family, kind, proto, _, where = (
            await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        )[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(where)
            # Connections waiting to be accepted cost the kernel some memory, not our descriptors.
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        return listener

    async def _accept(self, listener: socket.socket, tasks: set[asyncio.Future[None]]) -> None:
        """One connection at a time (asyncio's own servers take up to 100 at once, before anything
        can be evicted: enough to run a small descriptor limit out)."""
        loop = asyncio.get_running_loop()
        short_of_fds = False
        next_accept = loop.time()
        while True:
            if loop.time() < next_accept:
                await asyncio.sleep(next_accept - loop.time())
            next_accept = max(loop.time(), next_accept) + 1 / ACCEPTS_PER_SECOND
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    continue  # ECONNABORTED and the like: that client is gone
                if not short_of_fds:
                    log.warning(
                        "%s: cannot accept a connection: %s; trying again every %g s",
                        self.what,
                        exc.strerror or exc,
                        ACCEPT_RETRY_S,
                    )
                short_of_fds = True
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            short_of_fds = False
            self._make_room()
            try:
                reader, writer = await asyncio.open_connection(sock=conn, limit=MAX_REQUEST_BYTES)
            except OSError:
                conn.close()
                continue
            self._open[writer] = True
            task = asyncio.ensure_future(self._serve(reader, writer))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def _make_room(self) -> None:
        """At the cap, close the oldest connection still sending its request."""
        if len(self._open) >= self._max:
            oldest = next((w for w, reading in self._open.items() if reading), None)
            if oldest is None:  # every one is being answered, which ends within the timeout
                oldest = next(iter(self._open))
            del self._open[oldest]
            oldest.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await waits.within(reader.readuntil(b"\r\n\r\n"), self._timeout)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                return  # idle, slow, too long or gone: nothing to answer
            if writer not in self._open:
                return  # evicted meanwhile
            self._open[writer] = False
            writer.write(self._response(head))
            await waits.within(writer.drain(), self._timeout)
        except (asyncio.TimeoutError, OSError):
            pass  # a client that does not read its answer, or went away
        except Exception:  # never a traceback on stderr for what a client sent
            log.debug("%s: request failed", self.what, exc_info=True)
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()

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
