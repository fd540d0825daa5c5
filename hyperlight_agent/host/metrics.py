"""Prometheus metrics (prometheus-client), served only when metrics_address is set, by the
agent's own HTTP server (host/httpd.py).

The registry is the agent's own (not the library's global one), so tests and reloads never see
each other's series. Failure reasons are counted by cause (no-device, probe, cdi), not by the
free-text reason, which names paths and would make unbounded label values. Every labelled series
whose values are known beforehand is served from 0 at start: a series born at 1 has no
increase() for an alert on the first failure to see. A family exists only in the modes that
count it (FAMILIES, by the mode's kubelet protocol), and no `_created` series is served.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from hyperlight_agent import contracts
from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.observation import Cause, Observation
from hyperlight_agent.host import httpd

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
CAUSES = tuple(c.value for c in Cause if c not in (Cause.NONE, Cause.STARTING))
# The values of each labelled series, created at 0 (kept equal to where they are counted).
ALLOCATION_OUTCOMES = ("ok", "invalid", "unavailable")
DRA_OPERATIONS = ("prepare", "unprepare")
SLICE_VERBS = ("create", "update", "delete")
TAINT_EFFECTS = (contracts.TAINT_NO_SCHEDULE, contracts.TAINT_NO_EXECUTE)  # our device taint's
WATCH_REASONS = ("ended", "early", "failed", "relist")
# The series only a mode speaking this kubelet protocol counts (attribute names below).
FAMILIES = {
    "deviceplugin": ("registrations", "kubelet_restarts", "allocations", "open_streams", "streams_lost"),
    "dra": (
        "dra_calls",
        "dra_claims",
        "dra_call_seconds",
        "dra_slice_writes",
        "dra_api_errors",
        "dra_watch_restarts",
        "dra_health_streams",
        "dra_taint_effect",
    ),
}


class _Off:
    """Stands in for every series when metrics are off: prometheus_client is then never imported
    (it would add ~3 MiB of RSS for nothing)."""

    def __getattr__(self, name: str) -> Any:
        return self._ignore

    def _ignore(self, *args: Any, **kwargs: Any) -> _Off:
        return self


class Metrics:
    def __init__(
        self,
        enabled: bool,
        build: Optional[dict[str, str]] = None,
        protocol: str = "deviceplugin",
        device_dir: str = "/dev",
        cdi: bool = True,
    ) -> None:
        """`build`: hyperlight_build_info's labels (version, commit, mode); `protocol`: the mode's
        kubelet protocol (its families, FAMILIES); `device_dir`: where the device's path is;
        `cdi`: whether the mode writes the CDI spec (its repairs' counter)."""
        self._cause = ""
        self._device: tuple[str, str] = ("", "")  # hyperlight_device_info's labels now
        self._spec_right = False  # a check has found (or made) the CDI spec right: later writes are repairs
        self._healthy: Optional[bool] = None  # the last check's verdict (None: no check yet)
        self._taint = ""  # the effect of the device's taint in the slice now ("" none)
        self._counted = (0, 0, 0)  # the registrar's totals already added to our counters
        self._device_dir = device_dir
        self.enabled = enabled
        off: Any = _Off()
        for family in (name for names in FAMILIES.values() for name in names):
            setattr(self, family, off)
        if not enabled:
            self.healthy = self.unhealthy_cause = self.check_seconds = self.checks = self.failures = off
            self.cdi_repairs = self.helper_timeouts = self.device_info = self.advertised = off
            self.transitions = off
            return
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            Info,
            ProcessCollector,
            disable_created_metrics,
        )

        # `_created` series double a counter's output and say nothing a restart's
        # process_start_time_seconds does not (docs/metrics.md says so).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        r = self.registry
        # The process's own series (resident memory, CPU seconds, start time, open descriptors), as
        # the library's default registry would have them.
        ProcessCollector(registry=r)
        Info("hyperlight_build", "the agent's version, commit and mode", registry=r).info(build or {})
        self.device_info = Gauge(
            "hyperlight_device_info",
            "1 for the hypervisor device the agent found, by kind and path (none while none is found)",
            ["hypervisor", "path"],
            registry=r,
        )
        self.advertised = Gauge(
            "hyperlight_advertised_slots",
            "slots (device plugin) or ResourceSlice devices (DRA) offered to the kubelet as usable now: their "
            "count while the agent is ready, else 0",
            registry=r,
        )
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
        for to in ("healthy", "unhealthy"):
            self.transitions.labels(to)  # from 0, for increase() to see the first
        self.cdi_repairs = (
            Counter(
                "hyperlight_cdi_repairs_total",
                "times the CDI spec was written again after a check had found it right (someone changed it)",
                registry=r,
            )
            if cdi
            else off
        )
        self.helper_timeouts = Counter(
            "hyperlight_probe_helper_timeouts_total", "probe helpers killed for missing their deadline", registry=r
        )
        for result in ("ok", "failed"):
            self.checks.labels(result)
        for cause in CAUSES:
            self.failures.labels(cause)
            self.unhealthy_cause.labels(cause).set(0)
        families = FAMILIES.get(protocol, ())
        if "registrations" in families:
            self._device_plugin_families()
        if "dra_calls" in families:
            self._dra_families()

    def _device_plugin_families(self) -> None:
        from prometheus_client import Counter, Gauge

        r = self.registry
        self.registrations = Counter("hyperlight_registrations_total", "successful kubelet registrations", registry=r)
        self.kubelet_restarts = Counter("hyperlight_kubelet_restarts_total", "kubelet restarts detected", registry=r)
        self.allocations = Counter("hyperlight_allocations_total", "Allocate calls by outcome", ["outcome"], registry=r)
        for outcome in ALLOCATION_OUTCOMES:
            self.allocations.labels(outcome)
        self.open_streams = Gauge("hyperlight_listandwatch_streams", "open ListAndWatch streams", registry=r)
        self.streams_lost = Counter(
            "hyperlight_streams_lost_total",
            "kubelet streams that ended or never opened (each followed by a new Register)",
            registry=r,
        )

    def _dra_families(self) -> None:
        """The DRA mode's. Labels are fixed words or HTTP status codes: bounded."""
        from prometheus_client import Counter, Gauge, Histogram

        r = self.registry
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
            "1 for the effect of the taint on this node's device in the ResourceSlice, else 0 (both 0 while usable)",
            ["effect"],
            registry=r,
        )
        for effect in TAINT_EFFECTS:
            self.dra_taint_effect.labels(effect)  # 0 from the start, as every labelled series here
        for operation in DRA_OPERATIONS:
            self.dra_calls.labels(operation)
            self.dra_call_seconds.labels(operation)
            for result in ("ok", "error"):
                self.dra_claims.labels(operation, result)
        for verb in SLICE_VERBS:
            self.dra_slice_writes.labels(verb)
        for reason in WATCH_REASONS:
            self.dra_watch_restarts.labels(reason)

    def render(self) -> httpd.Answer:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return 200, CONTENT_TYPE_LATEST, bytes(generate_latest(self.registry))

    def routes(self) -> dict[str, httpd.Route]:
        """What the HTTP server at metrics_address serves for metrics (none when they are off)."""
        return {METRICS_PATH: self.render} if self.enabled else {}

    def check_done(self, observation: Observation, seconds: float, written: bool) -> None:
        self.check_seconds.observe(seconds)
        self.checks.labels("ok" if observation.healthy else "failed").inc()
        self.healthy.set(1 if observation.healthy else 0)
        if written and self._spec_right:
            self.cdi_repairs.inc()
        if observation.healthy:
            self._spec_right = True
        if self._healthy is not None and observation.healthy != self._healthy:
            self.transitions.labels("healthy" if observation.healthy else "unhealthy").inc()
        self._healthy = observation.healthy
        cause = observation.cause.value  # the label's value (str() of an Enum is its name)
        if not observation.healthy:
            self.failures.labels(cause).inc()
        if self.enabled and cause != self._cause:
            if self._cause:
                self.unhealthy_cause.labels(self._cause).set(0)
            if cause:
                self.unhealthy_cause.labels(cause).set(1)
            self._cause = cause
        self._found(observation.hypervisor)

    def _found(self, hypervisor: Optional[str]) -> None:
        device = (hypervisor, hypervisors.BY_NAME[hypervisor].device_path(self._device_dir)) if hypervisor else ("", "")
        if not self.enabled or device == self._device:
            return
        if self._device[0]:
            self.device_info.remove(*self._device)
        if device[0]:
            self.device_info.labels(*device).set(1)
        self._device = device

    def streams_open(self, streams: int) -> None:
        """The device plugin's ListAndWatch streams open now."""
        self.open_streams.set(streams)

    def allocated(self, outcome: str) -> None:
        """An Allocate's outcome (ALLOCATION_OUTCOMES)."""
        self.allocations.labels(outcome).inc()

    def dra_call(self, operation: str, seconds: float, ok: int, failed: int) -> None:
        self.dra_calls.labels(operation).inc()
        self.dra_call_seconds.labels(operation).observe(seconds)
        if ok:
            self.dra_claims.labels(operation, "ok").inc(ok)
        if failed:
            self.dra_claims.labels(operation, "error").inc(failed)

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

    def dra_health_stream(self, delta: int) -> None:
        """A resource-health stream opened (+1) or ended (-1)."""
        self.dra_health_streams.inc(delta)

    def dra_taint(self, effect: str) -> None:
        """The effect of the taint the slice's device carries now ("" none)."""
        if self.enabled and effect != self._taint:
            if self._taint:
                self.dra_taint_effect.labels(self._taint).set(0)
            if effect:
                self.dra_taint_effect.labels(effect).set(1)
            self._taint = effect
