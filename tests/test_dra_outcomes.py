"""dra/outcomes.py: what the DRA driver counts, in a registry of its own here."""

from __future__ import annotations

from prometheus_client import generate_latest

from hyperlight_agent import contracts
from hyperlight_agent.dra.outcomes import DraOutcomes
from hyperlight_agent.host.metrics import Metrics

TAINT = "hyperlight_dra_device_taint"


def served(metrics: Metrics) -> str:
    return bytes(generate_latest(metrics.registry)).decode()


def test_the_taint_gauge_follows_the_effect_and_back_to_none() -> None:
    metrics = Metrics(True)
    outcomes = DraOutcomes(metrics.families)
    no_schedule, no_execute = contracts.TAINT_NO_SCHEDULE, contracts.TAINT_NO_EXECUTE
    for effect, ones in ((no_schedule, {no_schedule}), (no_execute, {no_execute}), ("", set())):
        outcomes.taint(effect)
        text = served(metrics)
        for each in (no_schedule, no_execute):
            assert f'{TAINT}{{effect="{each}"}} {1.0 if each in ones else 0.0}' in text, (effect, each)


def test_a_call_counts_its_claims_by_result() -> None:
    metrics = Metrics(True)
    outcomes = DraOutcomes(metrics.families)
    outcomes.call("prepare", 0.01, ok=2, failed=1)
    outcomes.call("unprepare", 0.01, ok=0, failed=0)
    outcomes.slice_event("api_error", "update", "409")
    text = served(metrics)
    assert 'hyperlight_dra_calls_total{operation="prepare"} 1.0' in text
    assert 'hyperlight_dra_claims_total{operation="prepare",result="ok"} 2.0' in text
    assert 'hyperlight_dra_claims_total{operation="prepare",result="error"} 1.0' in text
    assert 'hyperlight_dra_claims_total{operation="unprepare",result="ok"} 0.0' in text
    assert 'hyperlight_dra_call_duration_seconds_count{operation="unprepare"} 1.0' in text
    assert 'hyperlight_dra_api_errors_total{code="409",verb="update"} 1.0' in text
