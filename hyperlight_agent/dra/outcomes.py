"""What the DRA driver counts of what it did, as metric series of its own (docs/metrics.md), made
by its row (parts.py) in the agent's registry: they exist only in the DRA mode. Labels are fixed
words or HTTP status codes: bounded."""

from __future__ import annotations

from hyperlight_agent import contracts
from hyperlight_agent.kubelet_side import Family, Series

# The values of each labelled series, served from 0 (kept equal to where they are counted).
OPERATIONS = ("prepare", "unprepare")
SLICE_VERBS = ("create", "update", "delete")
TAINT_EFFECTS = (contracts.TAINT_NO_SCHEDULE, contracts.TAINT_NO_EXECUTE)  # our device taint's
WATCH_REASONS = ("ended", "early", "failed", "relist")


_BY_OPERATION = tuple((operation,) for operation in OPERATIONS)
CALLS = Family(
    "counter",
    "hyperlight_dra_calls_total",
    "NodePrepareResources and NodeUnprepareResources calls from the kubelet",
    ("operation",),
    _BY_OPERATION,
)
CLAIMS = Family(
    "counter",
    "hyperlight_dra_claims_total",
    "claims in those calls by result (error: the claim's answer carried an error)",
    ("operation", "result"),
    tuple((operation, result) for operation in OPERATIONS for result in ("ok", "error")),
)
CALL_SECONDS = Family(
    "histogram",
    "hyperlight_dra_call_duration_seconds",
    "time to answer a NodePrepareResources or NodeUnprepareResources call",
    ("operation",),
    _BY_OPERATION,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 45),
)
SLICE_WRITES = Family(
    "counter",
    "hyperlight_dra_slice_writes_total",
    "writes of this node's ResourceSlices by verb",
    ("verb",),
    tuple((verb,) for verb in SLICE_VERBS),
)
API_ERRORS = Family(
    "counter",
    "hyperlight_dra_api_errors_total",
    "ResourceSlice requests the API server refused or never answered (code 0)",
    ("verb", "code"),
)
WATCH_RESTARTS = Family(
    "counter",
    "hyperlight_dra_watch_restarts_total",
    "ResourceSlice watches opened again, by why the last one ended (ended: its timeout, as asked)",
    ("reason",),
    tuple((reason,) for reason in WATCH_REASONS),
)
HEALTH_STREAMS = Family(
    "gauge",
    "hyperlight_dra_health_streams",
    "resource-health streams open now (the kubelet's: 1 once it watches this instance)",
)
TAINT_EFFECT = Family(
    "gauge",
    "hyperlight_dra_device_taint",
    "1 for the effect of the taint on this node's device in the ResourceSlice, else 0 (both 0 while usable)",
    ("effect",),
    tuple((effect,) for effect in TAINT_EFFECTS),
)


class DraOutcomes:
    def __init__(self, series: Series) -> None:
        self.calls, self.claims, self.call_seconds = map(series.make, (CALLS, CLAIMS, CALL_SECONDS))
        self.slice_writes, self.api_errors, self.watch_restarts = map(
            series.make, (SLICE_WRITES, API_ERRORS, WATCH_RESTARTS)
        )
        self.health_streams, self.taint_effect = map(series.make, (HEALTH_STREAMS, TAINT_EFFECT))
        self._taint = ""  # the effect of the taint the slice's device carries now ("" none)

    def call(self, operation: str, seconds: float, ok: int, failed: int) -> None:
        """A NodePrepareResources or NodeUnprepareResources answered: its claims ok and failed."""
        self.calls.labels(operation).inc()
        self.call_seconds.labels(operation).observe(seconds)
        if ok:
            self.claims.labels(operation, "ok").inc(ok)
        if failed:
            self.claims.labels(operation, "error").inc(failed)

    def slice_event(self, kind: str, *labels: str) -> None:
        """What the ResourceSlice publisher reports (dra/slices.py: on_event)."""
        series = {"write": self.slice_writes, "api_error": self.api_errors, "watch": self.watch_restarts}[kind]
        series.labels(*labels).inc()

    def health_stream(self, delta: int) -> None:
        """A resource-health stream opened (+1) or ended (-1)."""
        self.health_streams.inc(delta)

    def taint(self, effect: str) -> None:
        """The effect of the taint the slice's device carries now ("" none)."""
        if effect != self._taint:
            if self._taint:
                self.taint_effect.labels(self._taint).set(0)
            if effect:
                self.taint_effect.labels(effect).set(1)
            self._taint = effect
