"""deviceplugin/outcomes.py: what the device plugin counts, in a registry of its own here."""

from __future__ import annotations

from prometheus_client import generate_latest

from hyperlight_agent.deviceplugin.outcomes import ALLOCATION_OUTCOMES, DevicePluginOutcomes
from hyperlight_agent.host.metrics import Metrics


def served(metrics: Metrics) -> str:
    return bytes(generate_latest(metrics.registry)).decode()


def test_every_allocation_outcome_is_served_from_zero() -> None:
    metrics = Metrics(True)
    DevicePluginOutcomes(metrics.families).allocated("invalid")
    text = served(metrics)
    assert 'hyperlight_allocations_total{outcome="invalid"} 1.0' in text
    for outcome in set(ALLOCATION_OUTCOMES) - {"invalid"}:
        assert f'hyperlight_allocations_total{{outcome="{outcome}"}} 0.0' in text


def test_the_registrars_running_totals_are_counted_once() -> None:
    """The registrar reports running totals after every change: only what was added is counted."""
    metrics = Metrics(True)
    outcomes = DevicePluginOutcomes(metrics.families)
    outcomes.registrar_totals(1, 0, 0)
    outcomes.registrar_totals(1, 0, 0)
    outcomes.registrar_totals(3, 1, 2)
    text = served(metrics)
    assert "hyperlight_registrations_total 3.0" in text
    assert "hyperlight_kubelet_restarts_total 1.0" in text
    assert "hyperlight_streams_lost_total 2.0" in text
