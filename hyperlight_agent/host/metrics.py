"""Prometheus metrics (prometheus-client), served only when metrics_address is set.

The registry is the agent's own (not the library's global one), so tests and reloads never see
each other's series. Failure reasons are counted by cause (no-device, probe, cdi), not by the
free-text reason, which names paths and would make unbounded label values.

The HTTP endpoint is our own small server on the agent's event loop, not prometheus-client's
thread-per-connection one: that one had no timeouts and no cap, so idle connections each held a
thread and a file descriptor for as long as the client liked, and enough of them starved the
device check of descriptors (every slot went Unhealthy). Here at most ACCEPTS_PER_SECOND
connections are taken a second, a connection has
REQUEST_TIMEOUT_S for its request and again for its response, a request head is at most
MAX_REQUEST_BYTES, and at most MAX_CONNECTIONS are open: one more evicts the oldest connection
still sending its request (a scraper sends its request at once, so it is rarely the one evicted).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Any, Callable, Optional

from hyperlight_agent import waits
from hyperlight_agent.backoff import Backoff
from hyperlight_agent.device.observation import Observation

log = logging.getLogger(__name__)

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
METRICS_PATH = "/metrics"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (config.py has checked it) → (host, port); [v6] loses its brackets.

    >>> split_address("[::1]:9464")
    ('::1', 9464)
    """
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class MetricsServer:
    """GET /metrics over HTTP/1.1, one request per connection, bounded in every dimension."""

    def __init__(
        self,
        address: str,
        render: Callable[[], bytes],
        content_type: str,
        max_connections: int = MAX_CONNECTIONS,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.address = address
        self._render = render
        self._content_type = content_type
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
                error = f"metrics_address {self.address}: cannot listen: {exc.strerror or exc}"
                if error != self.bind_error:
                    log.warning(
                        "%s; retrying (up to every %g s), the device plugin carries on without metrics",
                        error,
                        BIND_RETRY_CAP_S,
                    )
                    self.bind_error = error
                await asyncio.sleep(backoff.next())
        if self.bind_error:
            log.info("metrics_address %s: listening now", self.address)
        self.bind_error = ""
        self.listening = True
        log.info("metrics on http://%s%s", self.address, METRICS_PATH)
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
                        "metrics: cannot accept a connection: %s; trying again every %g s",
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
            log.debug("metrics request failed", exc_info=True)
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()

    def _response(self, head: bytes) -> bytes:
        method, path = _request_line(head)
        body = b""
        if method is None:
            code = 400
        elif method not in ("GET", "HEAD"):
            code = 405
        elif path.split("?", 1)[0] != METRICS_PATH:
            code = 404
        else:
            code = 200
            body = self._render()
        content_type = self._content_type if code == 200 else "text/plain; charset=utf-8"
        if code != 200:
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


class _Off:
    """Stands in for every series when metrics are off: prometheus_client is then never imported
    (it would add ~3 MiB of RSS for nothing)."""

    def __getattr__(self, name: str) -> Any:
        return self._ignore

    def _ignore(self, *args: Any, **kwargs: Any) -> _Off:
        return self


class Metrics:
    def __init__(self, enabled: bool, build: Optional[dict[str, str]] = None) -> None:
        """`build`: hyperlight_build_info's labels (version, commit, mode)."""
        self._cause = ""
        self._healthy: Optional[bool] = None  # the last check's verdict (None: no check yet)
        self._taint = ""  # the effect of the device's taint in the slice now ("" none)
        self._counted = (0, 0, 0)  # the registrar's totals already added to our counters
        self.enabled = enabled
        if not enabled:
            off: Any = _Off()
            self.healthy = self.unhealthy_cause = self.check_seconds = self.checks = self.failures = off
            self.cdi_repairs = self.registrations = self.kubelet_restarts = self.allocations = off
            self.open_streams = self.helper_timeouts = self.streams_lost = off
            self.dra_calls = self.dra_claims = self.dra_call_seconds = off
            self.dra_slice_writes = self.dra_api_errors = self.dra_watch_restarts = off
            self.transitions = self.dra_health_streams = self.dra_taint_effect = off
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector

        self.registry = CollectorRegistry()
        r = self.registry
        # The process's own series (resident memory, CPU seconds, start time, open descriptors), as
        # the library's default registry would have them.
        ProcessCollector(registry=r)
        Info("hyperlight_build", "the agent's version, commit and mode", registry=r).info(build or {})
        self.healthy = Gauge("hyperlight_device_healthy", "1 when the last device check passed", registry=r)
        self.unhealthy_cause = Gauge(
            "hyperlight_device_unhealthy_cause", "1 for the cause of the current unhealthy state", ["cause"], registry=r
        )
        self.check_seconds = Histogram(
            "hyperlight_check_duration_seconds",
            "device check duration (probe, host identity, CDI)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 2, 5),
            registry=r,
        )
        self.checks = Counter("hyperlight_checks_total", "device checks completed", ["result"], registry=r)
        self.failures = Counter(
            "hyperlight_check_failures_total", "failed device checks by cause", ["cause"], registry=r
        )
        self.transitions = Counter(
            "hyperlight_device_health_transitions_total",
            "changes of the device check's verdict (the first check's is none), by the new one",
            ["to"],
            registry=r,
        )
        self.cdi_repairs = Counter("hyperlight_cdi_repairs_total", "times the CDI spec was (re)written", registry=r)
        self.registrations = Counter("hyperlight_registrations_total", "successful kubelet registrations", registry=r)
        self.kubelet_restarts = Counter("hyperlight_kubelet_restarts_total", "kubelet restarts detected", registry=r)
        self.allocations = Counter("hyperlight_allocations_total", "Allocate calls by outcome", ["outcome"], registry=r)
        self.open_streams = Gauge("hyperlight_listandwatch_streams", "open ListAndWatch streams", registry=r)
        self.streams_lost = Counter(
            "hyperlight_streams_lost_total",
            "kubelet streams that ended or never opened (each followed by a new Register)",
            registry=r,
        )
        self.helper_timeouts = Counter(
            "hyperlight_probe_helper_timeouts_total", "probe helpers killed for missing their deadline", registry=r
        )
        # The DRA mode (--dra). Labels are fixed words or HTTP status codes: bounded.
        self.dra_calls = Counter(
            "hyperlight_dra_calls_total",
            "NodePrepareResources and NodeUnprepareResources calls from the kubelet",
            ["operation"],
            registry=r,
        )
        self.dra_claims = Counter(
            "hyperlight_dra_claims_total",
            "claims in those calls by result (error: the claim's answer carried an error)",
            ["operation", "result"],
            registry=r,
        )
        self.dra_call_seconds = Histogram(
            "hyperlight_dra_call_duration_seconds",
            "time to answer a NodePrepareResources or NodeUnprepareResources call",
            ["operation"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 45),
            registry=r,
        )
        self.dra_slice_writes = Counter(
            "hyperlight_dra_slice_writes_total", "writes of this node's ResourceSlices by verb", ["verb"], registry=r
        )
        self.dra_api_errors = Counter(
            "hyperlight_dra_api_errors_total",
            "ResourceSlice requests the API server refused or never answered (code 0)",
            ["verb", "code"],
            registry=r,
        )
        self.dra_watch_restarts = Counter(
            "hyperlight_dra_watch_restarts_total",
            "ResourceSlice watches opened again, by why the last one ended (ended: its timeout, as asked)",
            ["reason"],
            registry=r,
        )
        self.dra_health_streams = Gauge(
            "hyperlight_dra_health_streams",
            "resource-health streams open now (the kubelet's: 1 once it watches this instance)",
            registry=r,
        )
        self.dra_taint_effect = Gauge(
            "hyperlight_dra_device_taint",
            "1 for the effect of the taint this node's device carries in the ResourceSlice (none while usable)",
            ["effect"],
            registry=r,
        )
        for to in ("healthy", "unhealthy"):
            self.transitions.labels(to)  # from 0, for increase() to see the first
        if (build or {}).get("mode") == "dra":
            # Each claim outcome is served from 0 before it first happens: a series born at 1
            # has no increase() for an alert on the first failed claim to see.
            for operation in ("prepare", "unprepare"):
                for result in ("ok", "error"):
                    self.dra_claims.labels(operation, result)

    def server(self, address: str) -> MetricsServer:
        """The endpoint for `address`; run() it on the agent's loop."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return MetricsServer(address, lambda: bytes(generate_latest(self.registry)), CONTENT_TYPE_LATEST)

    def check_done(self, observation: Observation, seconds: float, repaired: bool) -> None:
        self.check_seconds.observe(seconds)
        self.checks.labels("ok" if observation.healthy else "failed").inc()
        self.healthy.set(1 if observation.healthy else 0)
        if repaired:
            self.cdi_repairs.inc()
        if self._healthy is not None and observation.healthy != self._healthy:
            self.transitions.labels("healthy" if observation.healthy else "unhealthy").inc()
        self._healthy = observation.healthy
        cause = observation.cause.value  # the label's value (str() of an Enum is its name)
        if not observation.healthy:
            self.failures.labels(cause).inc()
        if self.enabled and cause != self._cause:
            if self._cause:
                self.unhealthy_cause.remove(self._cause)
            if cause:
                self.unhealthy_cause.labels(cause).set(1)
            self._cause = cause

    def dra_call(self, operation: str, seconds: float, ok: int, failed: int) -> None:
        self.dra_calls.labels(operation).inc()
        self.dra_call_seconds.labels(operation).observe(seconds)
        if ok:
            self.dra_claims.labels(operation, "ok").inc(ok)
        if failed:
            self.dra_claims.labels(operation, "error").inc(failed)

    def dra_health_stream(self, delta: int) -> None:
        """A resource-health stream opened (+1) or ended (-1)."""
        self.dra_health_streams.inc(delta)

    def dra_taint(self, effect: str) -> None:
        """The effect of the taint the slice's device carries now ("" none)."""
        if self.enabled and effect != self._taint:
            if self._taint:
                self.dra_taint_effect.remove(self._taint)
            if effect:
                self.dra_taint_effect.labels(effect).set(1)
            self._taint = effect

    def dra_event(self, kind: str, *labels: str) -> None:
        """What the ResourceSlice publisher reports (dra/slices.py: on_event)."""
        series = {"write": self.dra_slice_writes, "api_error": self.dra_api_errors, "watch": self.dra_watch_restarts}[
            kind
        ]
        series.labels(*labels).inc()

    def registrar_totals(self, registrations: int, kubelet_restarts: int, streams_lost: int) -> None:
        """The registrar keeps running totals; our counters get what was added since the last call."""
        done = self._counted
        self.registrations.inc(registrations - done[0])
        self.kubelet_restarts.inc(kubelet_restarts - done[1])
        self.streams_lost.inc(streams_lost - done[2])
        self._counted = (registrations, kubelet_restarts, streams_lost)
