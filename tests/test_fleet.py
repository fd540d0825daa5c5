"""The DRA mode at fleet scale against a real API server (etcd and kube-apiserver 1.37 from the
pinned builds, with an audit log: tests/e2e/fleet.py): an API server restart under 200 publishers
is no relist storm. The figures of the fleet's everyday cost are `python -m bench fleet`'s."""

from __future__ import annotations

import os
import time

import pytest

from hyperlight_agent.backoff import Backoff
from hyperlight_agent.dra import slices
from tests.conftest import E2E_FIGURES
from tests.e2e.cluster import wait_until
from tests.e2e.fleet import ROOT, ControlPlane, Fleet, LoopThread, Request, per_node

pytestmark = [pytest.mark.system, pytest.mark.e2e]

PUBLISHERS = 200
# "The next minute": counted from the API server's start, once it is ready.
WINDOW_S = 60.0
# The most requests one session of a publisher sends: a list (first, or after a 410 or a conflict),
# its watch, and one write if the server's slice is not the desired one (a conflict ends the session).
REQUESTS_PER_SESSION = 3


def sessions_within(window_s: float) -> int:
    """The most sessions one publisher can start within `window_s` of a failure, by its own
    backoff: the first retry at once, then each wait at least its jittered floor (0.25, 0.5, 1 …
    15 s); a session that fails at once is the worst case."""
    backoff = Backoff(slices.BACKOFF_INITIAL_S, slices.BACKOFF_CAP_S, rand=lambda: 0.0, immediate_first=True)
    elapsed, sessions = 0.0, 0
    while True:
        elapsed += backoff.next()
        if elapsed > window_s:
            return sessions
        sessions += 1


def watching(requests: list[Request], nodes: list[str], since: float) -> set[str]:
    """The nodes with a watch received after `since` and still open."""
    return {r.node for r in requests if r.verb == "watch" and r.received >= since and r.ended is None} & set(nodes)


def test_an_api_server_restart_under_200_publishers_is_no_relist_storm() -> None:
    plane = ControlPlane(os.path.join(ROOT, "build", "e2e", "fleet-run"))
    runner = LoopThread()
    nodes = [f"node-{i:03d}" for i in range(PUBLISHERS)]
    fleets: list[Fleet] = []
    try:
        plane.start()
        fleet = Fleet(plane.kubeconfig("fleet"), nodes)
        fleets.append(fleet)
        runner.call(fleet.start())
        wait_until(
            lambda: fleet.published() and len(watching(plane.requests(), nodes, 0)) == PUBLISHERS,
            300,
            "200 slices published and watched",
        )

        # SIGTERM: the API server stops listening at once, keeps the watches it serves until it
        # exits (its own shutdown timeout is 60 s; the harness kills it after 20), and a new one
        # starts on the same port: every publisher's watch breaks at the same moment.
        stopping = time.time()
        plane.cluster.stop_api_server()
        stopped = time.time()
        plane.cluster.start_api_server()  # returns once /readyz is ok
        ready = time.time()
        time.sleep(max(0.0, ready + WINDOW_S - time.time()))  # the minute counted, not synchronisation
        requests = plane.requests()
        counted = [r for r in requests if stopping <= r.received <= ready + WINDOW_S]
        wait_until(
            lambda: (
                len(watching(plane.requests(), nodes, stopping)) == PUBLISHERS
                and not any(p.last_error for p in fleet.publishers)
            ),
            120,
            "every publisher watching again",
        )
    finally:
        for started in fleets:
            runner.call(started.stop())
        runner.close()
        plane.stop()

    # Storms are counts: a publisher that re-lists or re-watches without waiting sends hundreds of
    # requests in a minute; the backoff allows each at most this many sessions in the window.
    window = ready + WINDOW_S - stopping
    bound = PUBLISHERS * sessions_within(window) * REQUESTS_PER_SESSION
    verbs = per_node(counted, "fleet", PUBLISHERS, stopping, ready + WINDOW_S)
    firsts = sorted(
        min(r.received for r in counted if r.node == node) for node in nodes if any(r.node == node for r in counted)
    )
    figure = (
        f"{len(counted)} requests ({', '.join(f'{v} {n:.2f}' for v, n in sorted(verbs.items()))} per node) "
        f"from SIGTERM to {WINDOW_S:g} s after ready ({window:.0f} s: {stopped - stopping:.1f} s to stop, "
        f"{ready - stopped:.1f} s to ready); bound {bound}; the first requests to the new server came over "
        f"{firsts[-1] - firsts[0]:.1f} s"
    )
    E2E_FIGURES["fleet_api_server_restart_200"] = figure
    print(f"\nfigure fleet_api_server_restart_200: {figure}")
    assert len(counted) <= bound, figure
    # Every watch asked for client-go's 5-10 minutes (issue 40, 6): an idle node renews about 8
    # times an hour, its liveness held by the bookmarks (python -m bench fleet counts the hour).
    asked = [r.timeout_s or 0.0 for r in requests if r.verb == "watch" and r.user == "fleet"]
    low, high = slices.WATCH_TIMEOUT_S
    assert asked and all(low <= t <= high for t in asked), sorted(set(asked))
