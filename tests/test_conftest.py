"""The suite's own harness (tests/conftest.py) where a mistake would hide or invent failures."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import GRPC_COMPLETION, NEIGHBOUR_ENV, REPO, SHARED_RUN, LoopOfATest

# grpc.aio's extension module (no stubs)
cygrpc = importlib.import_module("grpc._cython.cygrpc")


async def test_coroutine_tests_and_asyncio_run_get_a_test_loop() -> None:
    assert isinstance(asyncio.get_running_loop(), LoopOfATest)

    async def which() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    # Only where no loop runs (a test's own asyncio.run()): on a thread of its own here.
    assert isinstance(await asyncio.to_thread(asyncio.run, which()), LoopOfATest)


def test_a_closed_loop_drops_only_grpcs_late_completions() -> None:
    loop = LoopOfATest()
    loop.close()
    # The callback grpc.aio's completion queue hands to another loop is the one named.
    assert cygrpc._handle_callback_wrapper.__qualname__ == GRPC_COMPLETION
    assert loop.call_soon_threadsafe(cygrpc._handle_callback_wrapper, None, 1).cancelled()
    with pytest.raises(RuntimeError, match="Event loop is closed"):
        loop.call_soon_threadsafe(print, "anything else still fails")
    running = LoopOfATest()
    try:
        got: list[int] = []
        running.call_soon_threadsafe(got.append, 1)
        running.run_until_complete(asyncio.sleep(0))
        assert got == [1]
    finally:
        running.close()


# Two lanes in real pytest-xdist workers (`make test`: -n 2 --dist loadgroup): the harness's hook,
# unchanged, in a suite of its own whose tests say which worker ran them.
LANES_SUITE = {
    "conftest.py": "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n",
    "pytest.ini": "[pytest]\nmarkers =\n    e2e: a real cluster's\n    system: x\n    root: x\n    judge: x\n",
}
LANES_TEST = """
import os
import pytest

{mark}
@pytest.mark.parametrize("i", range(8))
def test_where(request, i):
    lane = request.node.get_closest_marker("xdist_group").args[0].replace(" ", "_")
    with open(os.path.join(os.path.dirname(__file__), "ran"), "a") as f:
        f.write(__name__ + " " + os.environ["PYTEST_XDIST_WORKER"] + " " + lane + "\\n")
"""


WHOLE_CLUSTERS_TEST = """
import os
import types
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=[types.SimpleNamespace(minor=m) for m in (35, 36)], ids=["1.35", "1.36"])
def whole(request):
    return request.param


@pytest.mark.parametrize("i", range(4))
def test_where(request, whole, i):
    lane = request.node.get_closest_marker("xdist_group").args[0].replace(" ", "_")
    with open(os.path.join(os.path.dirname(__file__), "ran"), "a") as f:
        f.write(f"{__name__}[1.{whole.minor}] " + os.environ["PYTEST_XDIST_WORKER"] + " " + lane + "\\n")
"""


def test_each_cluster_is_one_lane_in_real_workers(tmp_path: Any) -> None:
    """The session's cluster in one worker, each other minor's whole cluster in one worker (a
    module-scoped fixture's parameter), each other module in one worker (its fixtures made once):
    a pytest or pytest-xdist whose loadgroup ignores the groups (pytest-dev/pytest-xdist#1386)
    fails here, not in a cluster's timing an hour into CI."""
    for name, text in LANES_SUITE.items():
        (tmp_path / name).write_text(text)
    for module, mark in [("test_e2e", "pytestmark = pytest.mark.e2e"), ("test_one", ""), ("test_two", "")]:
        (tmp_path / f"{module}.py").write_text(LANES_TEST.format(mark=mark))
    (tmp_path / "test_e2e_versions.py").write_text(WHOLE_CLUSTERS_TEST)
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers: dict[str, set[str]] = {}
    lanes: dict[str, set[str]] = {}
    for line in (tmp_path / "ran").read_text().splitlines():
        module, worker, lane = line.split()
        workers.setdefault(module, set()).add(worker)
        lanes.setdefault(module, set()).add(lane)
    assert lanes == {
        "test_e2e": {"clusters"},
        "test_e2e_versions[1.35]": {"whole_cluster_1.35"},
        "test_e2e_versions[1.36]": {"whole_cluster_1.36"},
        "test_one": {"test_one.py"},
        "test_two": {"test_two.py"},
    }
    for module, ran_in in workers.items():
        assert len(ran_in) == 1, f"{module} ran in {sorted(ran_in)}"


def inner_env() -> dict[str, str]:
    """The environment of a pytest a test starts with our conftest: none of the session's own (its
    shared release directory, its suite switches such as the neighbour agent `make test` asks for,
    its xdist worker's name: PYTEST_*)."""
    assert SHARED_RUN.startswith("PYTEST_")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != NEIGHBOUR_ENV},
        "PYTHONPATH": REPO,
    }


FAILS_ON_A_CLUSTER = """
import pytest
from tests.e2e.cluster import Cluster, Node


@pytest.fixture
def cluster(tmp_path):
    made = Cluster.__new__(Cluster)
    made.directory = str(tmp_path)
    node = Node.__new__(Node)
    node.name, node.directory = "a", str(tmp_path / "node-a")
    made.nodes = {"a": node}
    for pod, line in [("hyperlight-system_agent-x_1", "the agent's own line"), ("apps_app_2", "an app's line")]:
        logs = tmp_path / "node-a" / "log-pods" / pod / "agent"
        logs.mkdir(parents=True)
        (logs / "0.log").write_text(line + "\\n")
    return made


def test_fails(cluster):
    raise AssertionError("the wait ran out")


def test_passes(cluster):
    pass
"""


def test_a_failed_test_on_a_cluster_shows_what_our_agents_pods_wrote(tmp_path: Any) -> None:
    """The failure of a real-cluster test carries the agents' own account (a timeout alone says
    only which wait ran out): our namespace's pods only, and only for a failed test."""
    (tmp_path / "test_cluster.py").write_text(FAILS_ON_A_CLUSTER)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "test_cluster.py"],
        cwd=tmp_path,
        env=inner_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    assert done.stdout.count("the agent's own line") == 1, done.stdout
    assert "hyperlight-system_agent-x_1/agent/0.log" in done.stdout, done.stdout
    assert "an app's line" not in done.stdout, done.stdout


def test_a_pytest_a_test_starts_leaves_the_sessions_shared_releases_alone(tmp_path: Any) -> None:
    """A pytest started by a test, with our conftest, inherits the session's SHARED_RUN: at its end
    it removed the workers' shared releases (CI: test_deb and test_podman found no release.json).
    Only the controller that chose the directory removes it."""
    run = "0123456789abcdef"
    made = tmp_path / f"hl-rel-{run}" / "dist" / "0.1.1" / "release.json"
    made.parent.mkdir(parents=True)
    made.write_text("{}")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "test_one.py"],
        cwd=tmp_path,
        env={**inner_env(), "TMPDIR": str(tmp_path), SHARED_RUN: run},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert made.exists(), "the session's releases removed by a pytest it started"
