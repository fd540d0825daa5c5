"""What the DRA driver counts of what it did, as metric series of its own (docs/metrics.md), made
by its row (parts.py) in the agent's registry: they exist only in the DRA mode. Labels are fixed
words or HTTP status codes: bounded."""

from __future__ import annotations

from hyperlight_agent import contracts
from hyperlight_agent.kubelet_side import Series

# The values of each labelled series, served from 0 (kept equal to where they are counted).
OPERATIONS = ("prepare", "unprepare")
SLICE_VERBS = ("create", "update", "delete")
TAINT_EFFECTS = (contracts.TAINT_NO_SCHEDULE, contracts.TAINT_NO_EXECUTE)  # our device taint's
WATCH_REASONS = ("ended", "early", "failed", "relist")


class DraOutcomes:
    def __init__(self, series: Series) -> None:
        by_operation = [(operation,) for operation in OPERATIONS]
        self.calls = series.counter(
            "hyperlight_dra_calls_total",
            "NodePrepareResources and NodeUnprepareResources calls from the kubelet",
            ["operation"],
            at_zero=by_operation,
        )
        self.claims = series.counter(
            "hyperlight_dra_claims_total",
            "claims in those calls by result (error: the claim's answer carried an error)",
            ["operation", "result"],
            at_zero=[(operation, result) for operation in OPERATIONS for result in ("ok", "error")],
        )
        self.call_seconds = series.histogram(
            "hyperlight_dra_call_duration_seconds",
            "time to answer a NodePrepareResources or NodeUnprepareResources call",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 45),
            ["operation"],
            at_zero=by_operation,
        )
        self.slice_writes = series.counter(
            "hyperlight_dra_slice_writes_total",
            "writes of this node's ResourceSlices by verb",
            ["verb"],
            at_zero=[(verb,) for verb in SLICE_VERBS],
        )
        self.api_errors = series.counter(
            "hyperlight_dra_api_errors_total",
            "ResourceSlice requests the API server refused or never answered (code 0)",
            ["verb", "code"],
        )
        self.watch_restarts = series.counter(
            "hyperlight_dra_watch_restarts_total",
            "ResourceSlice watches opened again, by why the last one ended (ended: its timeout, as asked)",
            ["reason"],
            at_zero=[(reason,) for reason in WATCH_REASONS],
        )
        self.health_streams = series.gauge(
            "hyperlight_dra_health_streams",
            "resource-health streams open now (the kubelet's: 1 once it watches this instance)",
        )
        self.taint_effect = series.gauge(
            "hyperlight_dra_device_taint",
            "1 for the effect of the taint on this node's device in the ResourceSlice, else 0 (both 0 while usable)",
            ["effect"],
            at_zero=[(effect,) for effect in TAINT_EFFECTS],
        )
        self._taint = ""  # the effect of the device's taint in the slice now ("" none)

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
