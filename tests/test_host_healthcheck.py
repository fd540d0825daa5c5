"""The exec probe (host/healthcheck.py): one gRPC health Check of the service a probe names, over
the socket itself (never through a symlink, never to what is no socket), SERVING or why not in one
line, within its deadline; the same question asked of a peer during a handover; and no module of
the running agent loaded to ask it. (The probes of running agents in every state:
test_health_reporting.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from grpc_health.v1 import health_pb2

from hyperlight_agent import contracts, waits
from hyperlight_agent.host import healthcheck
from tests.test_health_reporting import probe
from tests.test_peers import Server, silent_sockets

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


async def check(path: str, which: str) -> tuple[bool, str]:
    """The probe, in a thread of its own (its channel blocks) while the loop serves."""
    return await waits.in_thread(lambda: healthcheck.health_check(path, which), "probe")


async def test_each_probe_asks_its_own_service_and_says_serving_or_why_not(tmp: str) -> None:
    server = await Server(os.path.join(tmp, "agent.sock")).with_health().start()
    try:
        await server.health.set(contracts.HEALTH_SERVICES["liveness"], SERVING)
        await server.health.set(contracts.HEALTH_SERVICES["readiness"], NOT_SERVING)
        assert await check(server.path, "liveness") == (True, f"liveness: SERVING ({server.path})")
        assert await check(server.path, "readiness") == (False, f"readiness: NOT_SERVING ({server.path})")
        assert not await healthcheck.peer_ready(server.path, 5)
        await server.health.set(contracts.HEALTH_SERVICES["readiness"], SERVING)
        assert await check(server.path, "readiness") == (True, f"readiness: SERVING ({server.path})")
        assert await healthcheck.peer_ready(server.path, 5)
    finally:
        await server.stop()


async def test_a_symlink_or_a_file_at_the_path_is_not_our_socket(tmp: str) -> None:
    server = await Server(os.path.join(tmp, "agent.sock")).with_health().start()
    link, regular = os.path.join(tmp, "link.sock"), os.path.join(tmp, "file.sock")
    os.symlink(server.path, link)  # to a live, SERVING socket: still not asked through
    with open(regular, "w"):
        pass
    try:
        assert await check(link, "liveness") == (False, f"liveness: not serving: {link} is a symlink, not our socket")
        assert await check(regular, "readiness") == (False, f"readiness: not serving: {regular} is not a socket")
    finally:
        await server.stop()


async def test_a_socket_that_never_answers_is_no_answer_within_the_deadline(
    tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(healthcheck, "CHECK_RPC_TIMEOUT_S", 0.2)
    [silent] = silent_sockets(tmp, ["silent.sock"])
    path = os.path.join(tmp, "silent.sock")
    try:
        assert await check(path, "liveness") == (False, f"liveness: no answer from {path}: DEADLINE_EXCEEDED")
        assert not await healthcheck.peer_ready(path, 0.2)
    finally:
        silent.close()


def test_probes_with_no_agent_fail_with_a_reason(tmp: str) -> None:
    code, line = probe(tmp, "liveness")
    assert code == 1
    assert line.startswith("liveness: not serving: no socket at ")


def test_health_check_starts_fast_without_agent_modules(tmp: str) -> None:
    code = (
        "import sys, runpy; sys.argv=['x','--config','/dev/null','--kubelet-dir',sys.argv[1],"
        "'--health-check=liveness']\n"
        "from hyperlight_agent import cli\ncli.main()\n"
        "heavy=[m for m in ('hyperlight_agent.agent','hyperlight_agent.deviceplugin.servicer',"
        "'hyperlight_agent.deviceplugin.registration') if m in sys.modules]\nprint('HEAVY', heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, tmp], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    assert "HEAVY []" in out
