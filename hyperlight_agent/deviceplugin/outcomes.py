"""What the device plugin counts of what it did, as metric series of its own (docs/metrics.md),
made by its row (parts.py) in the agent's registry: they exist only in the device plugin modes."""

from __future__ import annotations

from hyperlight_agent.kubelet_side import Family, Series

# An Allocate's outcomes, each served from 0.
ALLOCATION_OUTCOMES = ("ok", "invalid", "unavailable")


REGISTRATIONS = Family("counter", "hyperlight_registrations_total", "successful kubelet registrations")
KUBELET_RESTARTS = Family("counter", "hyperlight_kubelet_restarts_total", "kubelet restarts detected")
ALLOCATIONS = Family(
    "counter",
    "hyperlight_allocations_total",
    "Allocate calls by outcome",
    ("outcome",),
    tuple((outcome,) for outcome in ALLOCATION_OUTCOMES),
)
OPEN_STREAMS = Family("gauge", "hyperlight_listandwatch_streams", "open ListAndWatch streams")
STREAMS_LOST = Family(
    "counter",
    "hyperlight_streams_lost_total",
    "kubelet streams that ended or never opened (each followed by a new Register)",
)


class DevicePluginOutcomes:
    def __init__(self, series: Series) -> None:
        self.registrations, self.kubelet_restarts, self.allocations, self.open_streams, self.streams_lost = map(
            series.make, (REGISTRATIONS, KUBELET_RESTARTS, ALLOCATIONS, OPEN_STREAMS, STREAMS_LOST)
        )
        self._counted = (0, 0, 0)  # the registrar's totals already added to the counters

    def streams_open(self, streams: int) -> None:
        """The ListAndWatch streams open now."""
        self.open_streams.set(streams)

    def allocated(self, outcome: str) -> None:
        """An Allocate's outcome (ALLOCATION_OUTCOMES)."""
        self.allocations.labels(outcome).inc()

    def registrar_totals(self, registrations: int, kubelet_restarts: int, streams_lost: int) -> None:
        """The registrar keeps running totals; the counters get what was added since the last call."""
        done = self._counted
        self.registrations.inc(registrations - done[0])
        self.kubelet_restarts.inc(kubelet_restarts - done[1])
        self.streams_lost.inc(streams_lost - done[2])
        self._counted = (registrations, kubelet_restarts, streams_lost)
