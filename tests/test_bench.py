"""The benchmarks still run: a refactor renamed what the probe's fresh-process baseline called, and
`make bench` failed at its first figure. The sections the last changes touched run here, small."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_docs import ROOT

pytestmark = [pytest.mark.system, pytest.mark.root]


def test_the_probe_restart_and_upgrade_sections_run() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "d", "l"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "HYPERLIGHT_BENCH_RESTARTS": "3"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = result.stdout.split("| figure | value | target |", 1)[1]
    for figure in (
        "fresh process per check p50",
        "kubelet restart (1.37): new kubelet.sock → Healthy listed",
        "in-place upgrade (--upgrade-in-place): kubelet moments at zero healthy over 10 (restart: section e) | 0 |",
    ):
        assert figure in table, table
