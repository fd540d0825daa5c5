"""The kubelet's httpGet probes (host/probes.py): /livez and /healthz answer while the loop does,
/readyz 200 or 503 with the status line, from the readiness it is given; settings that share an
address share one server, which lists its paths at /. (The agent's own readiness behind them:
test_agent.py.)"""

from __future__ import annotations

from hyperlight_agent.host import probes
from hyperlight_agent.host.httpd import TEXT
from tests.test_host_httpd import exchange, get, serving
from tests.test_host_metrics import free_port


def test_liveness_answers_and_readiness_follows_the_state_with_its_status_line() -> None:
    state = [False, "registering with the kubelet"]
    routes = probes.routes(lambda: (bool(state[0]), str(state[1])))
    assert set(routes) == {"/livez", "/readyz", "/healthz"}
    assert routes["/livez"]() == routes["/healthz"]() == (200, TEXT, b"live: serving\n")
    assert routes["/readyz"]() == (503, TEXT, b"not ready: registering with the kubelet\n")
    state[:] = [True, "serving 4 healthy slots"]
    assert routes["/readyz"]() == (200, TEXT, b"ready: serving 4 healthy slots\n")
    # The agent's status line when ready says "ready: …" itself: said once (issue 50: 9).
    state[:] = [True, "ready: kvm, 3 slots, 1 stream"]
    assert routes["/readyz"]() == (200, TEXT, b"ready: kvm, 3 slots, 1 stream\n")


def test_settings_sharing_an_address_share_one_server_and_unset_ones_get_none() -> None:
    metrics = {"/metrics": lambda: (200, TEXT, b"")}
    ready = probes.routes(lambda: (True, "ok"))
    [shared] = probes.servers(
        {"metrics_address": ("127.0.0.1:9464", metrics), "probe_address": ("127.0.0.1:9464", ready)}
    )
    assert shared.what == "metrics_address and probe_address" and shared.address == "127.0.0.1:9464"
    assert set(shared.routes) == {"/", "/metrics", "/livez", "/readyz", "/healthz"}
    assert shared.routes["/"]() == (200, TEXT, b"/healthz\n/livez\n/metrics\n/readyz\n")
    two = probes.servers({"metrics_address": ("127.0.0.1:1", metrics), "probe_address": ("127.0.0.1:2", ready)})
    assert [s.what for s in two] == ["metrics_address", "probe_address"]
    assert probes.servers({"metrics_address": (None, metrics), "probe_address": ("127.0.0.1:2", {})}) == []


async def test_readyz_over_http_follows_the_readiness_as_it_changes() -> None:
    state = [False]
    address = f"127.0.0.1:{free_port()}"
    [server] = probes.servers({"probe_address": (address, probes.routes(lambda: (state[0], "status")))})
    async with serving(server):
        assert (await exchange(address, get("/readyz"))).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        state[0] = True
        answer = await exchange(address, get("/readyz"))
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\nready: status\n")
        assert (await exchange(address, get("/livez"))).endswith(b"live: serving\n")
