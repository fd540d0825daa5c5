"""Prometheus metrics (prometheus-client), served only when metrics_address is set.

The registry is the agent's own (not the library's global one), so tests and reloads never see
each other's series. Failure reasons are counted by cause (no-device, probe, cdi), not by the
free-text reason, which names paths and would make unbounded label values.
"""

from __future__ import annotations

import logging
from typing import Any

from .observation import Observation

log = logging.getLogger(__name__)


class _Off:
    """Stands in for every series when metrics are off: prometheus_client is then never imported
    (it would add ~3 MiB of RSS for nothing)."""

    def __getattr__(self, name: str) -> Any:
        return self._ignore

    def _ignore(self, *args: Any, **kwargs: Any) -> _Off:
        return self


class Metrics:
    def __init__(self, enabled: bool) -> None:
        self._cause = ""
        self.enabled = enabled
        if not enabled:
            off: Any = _Off()
            self.healthy = self.unhealthy_cause = self.check_seconds = self.checks = self.failures = off
            self.cdi_repairs = self.registrations = self.kubelet_restarts = self.allocations = off
            self.streams = self.helper_timeouts = self.streams_lost = off
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.healthy = Gauge("hyperlight_device_healthy", "1 when the last device check passed", registry=r)
        self.unhealthy_cause = Gauge("hyperlight_device_unhealthy_cause",
                                     "1 for the cause of the current unhealthy state", ["cause"], registry=r)
        self.check_seconds = Histogram(
            "hyperlight_check_duration_seconds", "device check duration (probe, host identity, CDI)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 2, 5), registry=r)
        self.checks = Counter("hyperlight_checks_total", "device checks completed", ["result"], registry=r)
        self.failures = Counter("hyperlight_check_failures_total", "failed device checks by cause", ["cause"],
                                registry=r)
        self.cdi_repairs = Counter("hyperlight_cdi_repairs_total", "times the CDI spec was (re)written",
                                   registry=r)
        self.registrations = Counter("hyperlight_registrations_total", "successful kubelet registrations",
                                     registry=r)
        self.kubelet_restarts = Counter("hyperlight_kubelet_restarts_total", "kubelet restarts detected",
                                        registry=r)
        self.allocations = Counter("hyperlight_allocations_total", "Allocate calls by outcome", ["outcome"],
                                   registry=r)
        self.streams = Gauge("hyperlight_listandwatch_streams", "open ListAndWatch streams", registry=r)
        self.streams_lost = Counter("hyperlight_streams_lost_total",
                                    "kubelet streams that ended or never opened (each followed by a new Register)",
                                    registry=r)
        self.helper_timeouts = Counter("hyperlight_probe_helper_timeouts_total",
                                       "probe helpers killed for missing their deadline", registry=r)

    def serve(self, address: str) -> None:
        from prometheus_client import start_http_server

        host, _, port = address.rpartition(":")
        start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        log.info("metrics on http://%s/metrics", address)

    def check_done(self, observation: Observation, seconds: float, repaired: bool) -> None:
        self.check_seconds.observe(seconds)
        self.checks.labels("ok" if observation.healthy else "failed").inc()
        self.healthy.set(1 if observation.healthy else 0)
        if repaired:
            self.cdi_repairs.inc()
        if not observation.healthy:
            self.failures.labels(observation.cause).inc()
        if self.enabled and observation.cause != self._cause:
            if self._cause:
                self.unhealthy_cause.remove(self._cause)
            if observation.cause:
                self.unhealthy_cause.labels(observation.cause).set(1)
            self._cause = observation.cause
