"""Prometheus metrics (prometheus-client), served only when metrics_address is set, by the
agent's own HTTP server (host/httpd.py).

The registry is the agent's own (not the library's global one), so tests and reloads never see
each other's series. Failure reasons are counted by cause (no-device, probe, cdi), not by the
free-text reason, which names paths and would make unbounded label values. Every labelled series
whose values are known beforehand is served from 0 at start: a series born at 1 has no
increase() for an alert on the first failure to see. The series a kubelet protocol counts are its
own (deviceplugin/outcomes.py, dra/outcomes.py), made through Families in this registry by its
row (parts.py): they exist only in the modes speaking it. No `_created` series is served.

Why: docs/decisions/metrics-never-cost-slots.md.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.observation import Cause, Observation
from hyperlight_agent.host import httpd
from hyperlight_agent.kubelet_side import Family

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
CAUSES = tuple(c.value for c in Cause if c not in (Cause.NONE, Cause.STARTING))


class _Off:
    """Stands in for every series when metrics are off: prometheus_client is then never imported
    (it would add ~3 MiB of RSS for nothing)."""

    def __getattr__(self, name: str) -> Any:
        return self._ignore

    def _ignore(self, *args: Any, **kwargs: Any) -> _Off:
        return self


class Families:
    """Makes series in one registry (kubelet_side.Series): the agent's, or none while metrics are
    off, when every series is an _Off."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def make(self, family: Family) -> Any:
        if self._registry is None:
            return _Off()
        import prometheus_client

        kind = {"counter": prometheus_client.Counter, "gauge": prometheus_client.Gauge}
        if family.kind == "histogram":
            made: Any = prometheus_client.Histogram(
                family.name, family.doc, list(family.labels), registry=self._registry, buckets=tuple(family.buckets)
            )
        else:
            made = kind[family.kind](family.name, family.doc, list(family.labels), registry=self._registry)
        for values in family.at_zero:
            made.labels(*values)
        return made


# The agent's own families, whatever its mode (Metrics; a protocol's are its row's).
_BY_CAUSE = tuple((cause,) for cause in CAUSES)
DEVICE_INFO = Family(
    "gauge",
    "hyperlight_device_info",
    "1 for the hypervisor device the agent found, by kind and path (none while none is found)",
    ("hypervisor", "path"),
)
ADVERTISED = Family(
    "gauge",
    "hyperlight_advertised_slots",
    "slots (device plugin) or ResourceSlice devices (DRA) offered to the kubelet as usable now: their "
    "count while the agent is ready, else 0",
)
HEALTHY = Family("gauge", "hyperlight_device_healthy", "1 when the last device check passed")
UNHEALTHY_CAUSE = Family(
    "gauge",
    "hyperlight_device_unhealthy_cause",
    "1 for the cause of the current unhealthy state",
    ("cause",),
    _BY_CAUSE,
)
CHECK_SECONDS = Family(
    "histogram",
    "hyperlight_check_duration_seconds",
    "device check duration (probe, host identity, CDI)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 2, 5),
)
CHECKS = Family("counter", "hyperlight_checks_total", "device checks completed", ("result",), (("ok",), ("failed",)))
FAILURES = Family("counter", "hyperlight_check_failures_total", "failed device checks by cause", ("cause",), _BY_CAUSE)
TRANSITIONS = Family(
    "counter",
    "hyperlight_device_health_transitions_total",
    "changes of the device check's verdict (the first check's is none), by the new one",
    ("to",),
    (("healthy",), ("unhealthy",)),
)
CDI_REPAIRS = Family(
    "counter",
    "hyperlight_cdi_repairs_total",
    "times the CDI spec was written again after a check had found it right (someone changed it)",
)
HELPER_TIMEOUTS = Family(
    "counter", "hyperlight_probe_helper_timeouts_total", "probe helpers killed for missing their deadline"
)


class Metrics:
    def __init__(
        self,
        enabled: bool,
        build: Optional[dict[str, str]] = None,
        device_dir: str = "/dev",
        cdi: bool = True,
    ) -> None:
        """`build`: hyperlight_build_info's labels (version, commit, mode); `device_dir`: where the
        device's path is; `cdi`: whether the mode writes the CDI spec (its repairs' counter).
        `families`: where the mode's kubelet protocol makes its own series (kubelet_side.Series)."""
        self._cause = ""
        self._device: tuple[str, str] = ("", "")  # hyperlight_device_info's labels now
        self._spec_right = False  # a check has found (or made) the CDI spec right: later writes are repairs
        self._healthy: Optional[bool] = None  # the last check's verdict (None: no check yet)
        self._device_dir = device_dir
        self.enabled = enabled
        self.families = Families(self._registry(build or {}) if enabled else None)
        make = self.families.make
        self.device_info, self.advertised, self.healthy, self.unhealthy_cause = map(
            make, (DEVICE_INFO, ADVERTISED, HEALTHY, UNHEALTHY_CAUSE)
        )
        self.check_seconds, self.checks, self.failures, self.transitions, self.helper_timeouts = map(
            make, (CHECK_SECONDS, CHECKS, FAILURES, TRANSITIONS, HELPER_TIMEOUTS)
        )
        # Only a mode that writes the CDI spec repairs it.
        self.cdi_repairs = (self.families if cdi else Families(None)).make(CDI_REPAIRS)

    def _registry(self, build: dict[str, str]) -> Any:
        """The agent's own registry, with the process's series and the build's."""
        from prometheus_client import CollectorRegistry, Info, ProcessCollector, disable_created_metrics

        # `_created` series double a counter's output and say nothing a restart's
        # process_start_time_seconds does not (docs/metrics.md says so).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        # The process's own series (resident memory, CPU seconds, start time, open descriptors), as
        # the library's default registry would have them.
        ProcessCollector(registry=self.registry)
        Info("hyperlight_build", "the agent's version, commit and mode", registry=self.registry).info(build)
        return self.registry

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
