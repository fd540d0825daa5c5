"""How the agent is seen from outside, all said from one snapshot of its state: sd_notify (READY=1,
STATUS=, the watchdog's pings), the gRPC health service that every socket of ours serves beside
Describe (the exec probes, a successor's wait), and one HTTP server per address (the kubelet's
httpGet probes, metrics). Built once per agent (parts.face); the agent says what changed."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Optional

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from hyperlight_agent.host import probes
from hyperlight_agent.host.metrics import Metrics
from hyperlight_agent.host.notify import Notifier


class Face:
    def __init__(
        self, notifier: Notifier, metrics: Metrics, metrics_address: Optional[str], probe_address: Optional[str]
    ) -> None:
        self.notifier = notifier
        self.metrics = metrics
        self.health_service = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.readiness = probes.Readiness(self.health_service, notifier, advertised=metrics.advertised.set)
        # The metrics port answers the probes' paths too (a scraper's or an operator's health check).
        probe_routes = probes.routes(self.readiness.answer)
        self.http_servers = probes.servers(
            {
                "metrics_address": (metrics_address, {**probe_routes, **metrics.routes()}),
                "probe_address": (probe_address, probe_routes),
            }
        )

    def serve_ours(self, server: grpc.aio.Server, describe: grpc.GenericRpcHandler[Any, Any]) -> None:
        """What every socket of ours serves beside its kubelet protocol: the health service and
        Describe (peers.py)."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health_service, server)
        server.add_generic_rpc_handlers([describe])

    def jobs(self) -> list[Coroutine[Any, Any, None]]:
        """What runs for the agent's life: each HTTP server, and the watchdog's pings."""
        jobs = [server.run() for server in self.http_servers]
        if self.notifier.watchdog_interval is not None:
            jobs.append(self._watchdog(self.notifier.watchdog_interval))
        return jobs

    async def _watchdog(self, interval: float) -> None:
        """WATCHDOG=1 from the loop that does the work: if the loop wedges, systemd restarts us."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)
