"""host/face.py: how the agent is seen, one HTTP server per address, the watchdog only under a
watchdog."""

from __future__ import annotations

import asyncio
from typing import Optional

import pytest

from hyperlight_agent.host import probes
from hyperlight_agent.host.face import Face
from hyperlight_agent.host.metrics import METRICS_PATH, Metrics
from tests.conftest import until
from tests.fakes import RecordingNotifier

A, B = "127.0.0.1:9101", "127.0.0.1:9102"


@pytest.mark.parametrize(
    ("metrics_address", "probe_address", "served"),
    [
        (A, A, [(A, {METRICS_PATH, probes.READYZ})]),  # one server: the metrics port answers the probes too
        (A, B, [(A, {METRICS_PATH, probes.READYZ}), (B, {probes.READYZ})]),
        (None, B, [(B, {probes.READYZ})]),  # metrics off: no metrics path anywhere
        (None, None, []),
    ],
)
def test_one_http_server_per_address(
    metrics_address: Optional[str], probe_address: Optional[str], served: list[tuple[str, set[str]]]
) -> None:
    face = Face(RecordingNotifier(), Metrics(metrics_address is not None), metrics_address, probe_address)
    assert [(s.address, {METRICS_PATH, probes.READYZ} & set(s.routes)) for s in face.http_servers] == served


async def test_the_watchdog_pings_only_under_a_watchdog() -> None:
    quiet = RecordingNotifier()
    assert Face(quiet, Metrics(False), None, None).jobs() == []
    watched = RecordingNotifier(watchdog_interval=0.01)
    (ping,) = Face(watched, Metrics(False), None, None).jobs()
    task = asyncio.ensure_future(ping)
    try:
        await until(
            lambda: sum(m[0] == "WATCHDOG=1" for m in watched.messages) >= 2, what="pinged again and again, not once"
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
