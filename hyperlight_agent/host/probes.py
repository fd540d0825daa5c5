"""The kubelet's httpGet probes (`probe_address`): `/livez`, `/readyz` and `/healthz`, answered
from the agent's own state on its HTTP server (host/httpd.py), so a probe costs the agent one
short request on its loop instead of a process (the exec probe, host/healthcheck.py, starts a
Python interpreter: 0.16-0.19 s of CPU and ~35 MB each time; BENCHMARKS.md "Probe cost").

    /livez, /healthz   200 while the agent's loop answers (what the exec liveness probe's gRPC
                       health Check says: the server runs)
    /readyz            200 when ready, else 503; the body is the status line either way
    /                  the paths this server answers

Both probes answer what the gRPC health service says, from the same state: `Readiness`, what the
agent says of its readiness everywhere it is asked (sd_notify, the gRPC health service, these).

Why: docs/decisions/http-probes.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Mapping, Optional

from grpc_health.v1 import health_pb2

from hyperlight_agent import contracts
from hyperlight_agent.host.httpd import TEXT, HttpServer, Route
from hyperlight_agent.host.notify import Notifier
from hyperlight_agent.kubelet_side import Snapshot

log = logging.getLogger(__name__)

LIVEZ = "/livez"
READYZ = "/readyz"
HEALTHZ = "/healthz"  # the older name some tools and people try first


def routes(readiness: Callable[[], tuple[bool, str]]) -> dict[str, Route]:
    """The probes' routes; `readiness()` is (ready, the status line)."""

    def live() -> tuple[int, str, bytes]:
        return 200, TEXT, b"live: serving\n"

    def ready() -> tuple[int, str, bytes]:
        ok, status = readiness()
        word = "ready" if ok else "not ready"
        # A ready agent's status line says "ready: …" itself; an unready one's says why, not that.
        line = status if status.startswith(f"{word}:") else f"{word}: {status}"
        return (200 if ok else 503), TEXT, f"{line}\n".encode()

    return {LIVEZ: live, HEALTHZ: live, READYZ: ready}


def servers(wanted: Mapping[str, tuple[Optional[str], Mapping[str, Route]]]) -> list[HttpServer]:
    """One HTTP server per address: {setting: (its address or None, its routes)}; settings with
    the same address share one server (e.g. metrics and probes on one port)."""
    by_address: dict[str, tuple[list[str], dict[str, Route]]] = {}
    for setting, (address, served) in wanted.items():
        if address and served:
            names, table = by_address.setdefault(address, ([], {}))
            names.append(setting)
            table.update(served)
    found = []
    for address, (names, table) in by_address.items():
        listing = "".join(f"{path}\n" for path in sorted(table)).encode()
        table.setdefault("/", lambda listing=listing: (200, TEXT, listing))  # type: ignore[misc]
        found.append(HttpServer(address, table, " and ".join(names)))
    return found


class Readiness:
    """What the agent says of its readiness, the same answer everywhere it is asked: the status
    line (logged, sd_notify STATUS=) and READY=1, the gRPC health service (the exec probes, a
    successor's wait), the httpGet probes (`answer`) and the slots advertised (`advertised`: the
    metric). Each says only what changed."""

    def __init__(self, health_service: Any, notifier: Notifier, advertised: Callable[[int], None]) -> None:
        self._health_service = health_service  # grpc_health's aio HealthServicer
        self._notifier = notifier
        self._advertised = advertised
        self._last_status = ""
        self._serving: Optional[bool] = None
        self._health_update: Optional[asyncio.Future[None]] = None

    async def start(self) -> None:
        """The health service's first word: live, not ready."""
        services = contracts.HEALTH_SERVICES
        await self._health_service.set(services["liveness"], health_pb2.HealthCheckResponse.SERVING)
        await self._health_service.set(services["readiness"], health_pb2.HealthCheckResponse.NOT_SERVING)

    def answer(self) -> tuple[bool, str]:
        """What the httpGet readiness probe answers: what the gRPC health service says."""
        return self._serving is True, self._last_status

    def forget_status(self) -> None:
        self._last_status = ""  # something else took systemd's status line: say ours again

    def changed(self, snapshot: Snapshot) -> None:
        """Readiness or status may have changed: say what did."""
        text = snapshot.status()
        if text != self._last_status:
            self._last_status = text
            log.info("status: %s", text)
            self._notifier.status(text)
        ready = snapshot.ready()
        self._advertised(snapshot.slots if ready else 0)
        if ready:
            self._notifier.ready()
        if ready != self._serving:
            self._serving = ready
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            self._health_update = asyncio.ensure_future(
                self._health_service.set(contracts.HEALTH_SERVICES["readiness"], status)
            )
