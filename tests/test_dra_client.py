"""The DRA mode's API client (dra/client.py) against a broken environment: credentials that fail
inside a request, kubeconfigs of every wrong shape, watch events the client cannot read, and a
connection that goes silent. Each failure is one ApiError or ClientConfigError naming what we
asked or the file, never an exception of the libraries underneath."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import stat
from typing import Any, Optional

import pytest

from hyperlight_agent.dra import client as dra_client
from hyperlight_agent.dra.client import ApiError, ClientConfigError, KubeApi
from standin.apiserver import DRIVER, NODE, WATCH_ANSWERED, FakeApiServer, kubeconfig
from standin.proxy import FreezingProxy
from tests.conftest import until


def write_kubeconfig(tmp_path: Any, server: str, user: dict[str, Any]) -> str:
    path = os.path.join(str(tmp_path), "kubeconfig")
    with open(path, "w") as f:
        json.dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": server}}],
                "users": [{"name": "test", "user": user}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            },
            f,
        )
    return path


def exec_plugin(tmp_path: Any, body: str) -> str:
    path = os.path.join(str(tmp_path), "credential-plugin")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\n{body}\n")
    os.chmod(path, stat.S_IRWXU)
    return path


# 1: a credential problem inside a request is an ApiError naming the kubeconfig, never an escape.
@pytest.mark.parametrize(
    ("user", "cause"),
    [
        ({"tokenFile": "/nonexistent/token"}, "Token file /nonexistent/token not found"),
        ({"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "PLUGIN"}}, "returned 1"),
        ({"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "GARBAGE"}}, "JSONDecodeError"),
        (
            {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "/nonexistent/plugin"}},
            "FileNotFoundError",
        ),
    ],
)
async def test_a_credential_failure_is_an_api_error_naming_the_kubeconfig(
    tmp_path: Any, user: dict[str, Any], cause: str
) -> None:
    fake = FakeApiServer()
    url = await fake.start()
    if user.get("exec", {}).get("command") == "PLUGIN":
        user["exec"]["command"] = exec_plugin(tmp_path, "echo 'no credentials today' >&2; exit 1")
    if user.get("exec", {}).get("command") == "GARBAGE":
        user["exec"]["command"] = exec_plugin(tmp_path, "echo not-json")
    path = write_kubeconfig(tmp_path, url, user)
    api = dra_client.connect(path, environ={})
    try:
        for call in (
            lambda: api.list_slices(NODE, DRIVER),
            lambda: api.get_claim("ns", "c"),
            lambda: api.delete_slice("x"),
        ):
            with pytest.raises(ApiError) as caught:
                await call()
            error = caught.value
            assert error.code == 0 and error.problem == "credentials"
            assert str(error).count("\n") == 0 and f"cannot authenticate: kubeconfig {path}: " in str(error)
            assert cause in str(error), str(error)
        with pytest.raises(ApiError, match="cannot authenticate"):
            async for _ in api.watch_slices(NODE, DRIVER, "1", 5):
                pass
    finally:
        await api.close()
        await fake.stop()
    assert not fake.requests, "nothing was sent without credentials"


# 13: every wrong shape of kubeconfig is one line naming the file and what is wrong.
@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "empty"),
        ("[]", r"not a mapping \(a list\)"),
        ("42", r"not a mapping \(a number\)"),
        ("'text'", r"not a mapping \(a string\)"),
        ("clusters: {}\ncontexts: []", "'clusters' is not a list"),
        ("clusters: []", "no 'contexts'"),
        ("clusters: [1]\ncontexts: []", r"clusters\[0\] is not a mapping with a name"),
        ("clusters: []\ncontexts: [{name: a, context: x}]", r"contexts\[0\] \('a'\): 'context' is not a mapping"),
        (
            "clusters: []\ncontexts: [{name: a, context: {}}]\nusers: [{name: u, user: [1]}]",
            r"users\[0\] \('u'\): 'user' is not a mapping",
        ),
        ("clusters: []\ncontexts: [{name: a, context: {}}]", "no current-context"),
        ("clusters: []\ncontexts: [{name: a, context: {}}]\ncurrent-context: b", "current-context 'b' is not among"),
        ("clusters: []\ncontexts: [{name: a, context: {cluster: c}}]\ncurrent-context: a", "KeyError"),
        ("clusters: [" * 100000, "nested too deeply|not YAML"),
        # Half as deep again as the parser gets before it passes the interpreter's recursion limit.
        ("a: " + "[" * 700 + "]" * 700, "nested too deeply"),
        ("clusters: [\n", "not YAML"),
    ],
)
def test_a_kubeconfig_of_the_wrong_shape_is_one_line_naming_the_file(tmp_path: Any, content: str, problem: str) -> None:
    path = os.path.join(str(tmp_path), "kubeconfig")
    with open(path, "w") as f:
        f.write(content)
    with pytest.raises(ClientConfigError) as caught:
        dra_client.connect(path, environ={})
    line = str(caught.value)
    assert line.startswith(f"kubeconfig {path}: ") and "\n" not in line and len(line) < 500, line
    assert re.search(problem, line), line


def test_a_kubeconfig_larger_than_any_real_one_is_not_parsed(tmp_path: Any) -> None:
    path = os.path.join(str(tmp_path), "kubeconfig")
    with open(path, "wb") as f:
        f.write(b"#" * (dra_client.MAX_KUBECONFIG_BYTES + 1))
    with pytest.raises(ClientConfigError, match=f"^kubeconfig {path}: larger than"):
        dra_client.connect(path, environ={})


# 16: an event the client cannot read ends the watch with an ApiError, not a KeyError.
@pytest.mark.parametrize(
    "event",
    [
        {"type": "MODIFIED", "object": {"metadata": {"name": "x"}, "spec": {"nodeName": NODE, "driver": DRIVER}}},
        {
            "type": "SURPRISE",
            "object": {"metadata": {"resourceVersion": "9"}, "spec": {"nodeName": NODE, "driver": DRIVER}},
        },
    ],
)
async def test_an_unreadable_watch_event_ends_the_watch_with_an_api_error(tmp_path: Any, event: dict[str, Any]) -> None:
    fake = FakeApiServer()
    url = await fake.start()
    api = dra_client.connect(kubeconfig(tmp_path, url), environ={})
    try:
        seen: list[str] = []

        async def watch() -> None:
            async for kind, _ in api.watch_slices(NODE, DRIVER, str(fake.version), 30):
                seen.append(kind)

        task = asyncio.ensure_future(watch())
        await until(lambda: fake.of("watch"), what="the watch")
        await fake.inject(event["type"], event["object"])
        with pytest.raises(ApiError) as caught:
            await asyncio.wait_for(task, 10)
        assert caught.value.code == 0 and caught.value.problem == "unreadable" and seen == []
        assert "unreadable watch event" in str(caught.value)
    finally:
        await api.close()
        await fake.stop()


def test_watch_event_lines_are_read_strictly() -> None:
    good = b'{"type": "ADDED", "object": {"metadata": {"resourceVersion": "5"}}}'
    assert dra_client._event(good) == ("ADDED", {"metadata": {"resourceVersion": "5"}})
    for line in (
        b"not json",
        b"[]",
        b'{"type": "ADDED"}',
        b'{"type": "ADDED", "object": []}',
        b'{"type": "ADDED", "object": {"metadata": {"resourceVersion": 5}}}',
    ):
        with pytest.raises(ApiError, match="unreadable watch event"):
            dra_client._event(line)
    with pytest.raises(ApiError) as caught:
        dra_client._event(b'{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}')
    assert caught.value.code == 410


# 3: a watch asks the server to end it, and a connection that went silent is given up.
async def test_a_silent_watch_connection_is_given_up_past_its_timeout(tmp_path: Any) -> None:
    fake = FakeApiServer()
    url = await fake.start()
    proxy = FreezingProxy("127.0.0.1", int(url.rsplit(":", 1)[1]))
    proxied = kubeconfig(tmp_path, await proxy.start())
    api = dra_client.connect(proxied, environ={}, watch_grace_s=0.5)
    # Past the stall, a watch on a new connection with the default grace: its answer's deadline is
    # the grace past the timeout, and 0.5 s is a loaded machine's scheduling noise, not a stall.
    patient = dra_client.connect(proxied, environ={})
    try:

        async def watch(client: KubeApi) -> list[str]:
            return [kind async for kind, _ in client.watch_slices(NODE, DRIVER, str(fake.version), 1)]

        task = asyncio.ensure_future(watch(api))
        await until(lambda: fake.of("watch") and proxy.bytes_down, what="the watch answered")
        (request,) = fake.of("watch")
        assert request.query["timeoutSeconds"] == "1" and request.query["allowWatchBookmarks"] == "true"
        proxy.freeze()
        with pytest.raises(ApiError) as caught:
            await asyncio.wait_for(task, 10)
        # Our deadline gave it up (httpx's read timeout, a second later, says something else).
        assert caught.value.code == 0 and caught.value.problem == "stalled", str(caught.value)
        assert "0.5 s past its timeoutSeconds=1" in str(caught.value), str(caught.value)
        # Unfrozen, the same watch ends when its timeout is up; with nothing new since its start,
        # the real server sends it no bookmark (nor any to a watch of under 2 s).
        assert await asyncio.wait_for(watch(patient), 10) == []
    finally:
        await patient.close()
        await api.close()
        await proxy.stop()
        await fake.stop()


# A watch the server held in its queues before starting it ends normally: the server's clock starts
# when it answers, and so does ours (issue 29: 400 agents starting at once saw watches end 5 s late).
async def test_a_watch_queued_by_a_busy_server_is_not_taken_for_a_stalled_one(tmp_path: Any) -> None:
    fake = FakeApiServer()
    fake.watch_queue_s = 1.0
    url = await fake.start()
    api = dra_client.connect(kubeconfig(tmp_path, url), environ={}, watch_grace_s=0.5)
    try:
        kinds = [kind async for kind, _ in api.watch_slices(NODE, DRIVER, str(fake.version), 1)]
        assert kinds == [], "ended by the server, one second after it started it"
    finally:
        await api.close()
        await fake.stop()


# ... but a watch the server does not answer at all (a connection that stopped forwarding before the
# answer) is given up too.
async def test_a_watch_without_an_answer_is_given_up(tmp_path: Any) -> None:
    fake = FakeApiServer()
    fake.watch_queue_s = 30.0
    url = await fake.start()
    api = dra_client.connect(kubeconfig(tmp_path, url), environ={}, watch_grace_s=0.5)
    try:
        with pytest.raises(ApiError) as caught:
            async for _ in api.watch_slices(NODE, DRIVER, str(fake.version), 1):
                pass
        # Given up by its own deadline (the message says which), not at the server's 30 s.
        assert caught.value.problem == "stalled" and "no answer to the watch in 1.5 s" in str(caught.value)
    finally:
        await api.close()
        await fake.stop()


# The server's bookmarks are the heartbeat: once they come, a silence of a bookmark interval and a
# margin is a dead connection, given up long before the watch's timeout.
async def test_a_watch_whose_bookmarks_stop_is_given_up_long_before_its_timeout(tmp_path: Any) -> None:
    fake = FakeApiServer()
    fake.bookmark_interval_s = 0.2
    url = await fake.start()
    proxy = FreezingProxy("127.0.0.1", int(url.rsplit(":", 1)[1]))
    api = dra_client.connect(kubeconfig(tmp_path, await proxy.start()), environ={}, watch_heartbeat_s=0.6)
    try:
        kinds: list[str] = []

        async def watch() -> None:
            async for kind, _ in api.watch_slices(NODE, DRIVER, str(fake.version), 60):
                kinds.append(kind)

        task = asyncio.ensure_future(watch())
        await until(lambda: fake.of("watch"), what="the watch")
        await fake.advance()  # the cluster moved on (another node's slice, etcd's progress)
        await until(lambda: kinds.count("BOOKMARK") >= 5, what="five bookmarks")
        assert not task.done(), "bookmarks 0.2 s apart keep a watch with a 0.6 s heartbeat alive"
        proxy.freeze()
        with pytest.raises(ApiError) as caught:
            await asyncio.wait_for(task, 10)
        # Given up a heartbeat after the last bookmark (the message says so; wait_for's 10 s, not 60).
        assert caught.value.problem == "stalled" and "nothing for 0.6 s after a bookmark" in str(caught.value)
    finally:
        await api.close()
        await proxy.stop()
        await fake.stop()


# A quiet resource: the real server sends a watch no bookmark until its version moves past the
# watch's start, so silence before the first bookmark's due proves nothing.
async def test_a_watch_shorter_than_its_first_bookmarks_due_runs_to_its_timeout(tmp_path: Any) -> None:
    fake = FakeApiServer()
    fake.bookmark_interval_s = 0.1
    url = await fake.start()
    api = dra_client.connect(kubeconfig(tmp_path, url), environ={}, watch_heartbeat_s=0.3)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        kinds = [kind async for kind, _ in api.watch_slices(NODE, DRIVER, str(fake.version), 3)]
        assert kinds == [] and loop.time() - started >= 2.9, "silent for ten heartbeats, and a normal end"
    finally:
        await api.close()
        await fake.stop()


# Issue 40, 6: watches of minutes, and a connection that stopped forwarding before the watch's first
# bookmark: given up at the first bookmark's due, not at the watch's end.
async def test_a_watch_frozen_before_its_first_bookmark_is_given_up_at_its_due(tmp_path: Any) -> None:
    fake = FakeApiServer()
    fake.bookmark_interval_s = 0.4
    fake.watch_queue_s = 0.3  # a busy server: the answer comes well after the request
    url = await fake.start()
    await fake.advance()  # the cluster has moved on: the server sends the watch bookmarks
    proxy = FreezingProxy("127.0.0.1", int(url.rsplit(":", 1)[1]), markers=(WATCH_ANSWERED,))
    api = dra_client.connect(kubeconfig(tmp_path, await proxy.start()), environ={}, first_bookmark_s=0.8)
    try:
        kinds: list[str] = []

        async def watch() -> None:
            async for kind, _ in api.watch_slices(NODE, DRIVER, str(fake.version - 1), 60):
                kinds.append(kind)

        task = asyncio.ensure_future(watch())
        # Frozen between the request and its answer, the client would wait for the answer instead
        # (test_a_watch_without_an_answer_is_given_up): so only once the answer went down.
        await until(lambda: proxy.seen[WATCH_ANSWERED], what="the watch answered")
        proxy.freeze()  # before the first bookmark, 0.4 s after the answer
        with pytest.raises(ApiError) as caught:
            await asyncio.wait_for(task, 10)
        assert kinds == [] and caught.value.problem == "stalled", kinds
        assert "no bookmark within 0.8 s of its start" in str(caught.value)
        # The next watch, on a fresh connection, hears its bookmarks and is kept.
        fresh: list[str] = []

        async def again() -> None:
            async for kind, _ in api.watch_slices(NODE, DRIVER, str(fake.version - 1), 60):
                fresh.append(kind)

        task = asyncio.ensure_future(again())
        await until(lambda: fresh.count("BOOKMARK") >= 3, what="bookmarks on the fresh connection")
        assert not task.done() and api.bookmarks.expected
        task.cancel()
        await asyncio.wait([task])
    finally:
        await api.close()
        await proxy.stop()
        await fake.stop()


# Where etcd reports no progress, a quiet cluster's watches get no bookmark at all: one watch is
# given up, the next (on a fresh connection) shows it is the server, and from then on watches run to
# their end, said once, until a bookmark comes again.
async def test_a_server_that_sends_no_bookmarks_while_quiet_costs_one_watch_and_one_line(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "hyperlight_agent")
    fake = FakeApiServer()
    fake.bookmark_interval_s = 0.1
    url = await fake.start()
    api = dra_client.connect(kubeconfig(tmp_path, url), environ={}, first_bookmark_s=0.3)
    loop = asyncio.get_running_loop()

    async def watch(timeout: float) -> tuple[list[str], Optional[ApiError], float]:
        started, kinds = loop.time(), []
        try:
            async for kind, _ in api.watch_slices(NODE, DRIVER, str(fake.version), timeout):
                kinds.append(kind)
        except ApiError as exc:
            return kinds, exc, loop.time() - started
        return kinds, None, loop.time() - started

    try:
        kinds, error, _ = await watch(1)
        assert error is not None and error.problem == "stalled" and api.bookmarks.expected, error
        for _ in range(2):
            kinds, error, lasted = await watch(1)
            assert (kinds, error) == ([], None) and lasted >= 0.9 and not api.bookmarks.expected
        said = [
            r.getMessage() for r in caplog.records if "sent no bookmark within 0.3 s of two watches" in r.getMessage()
        ]
        assert len(said) == 1, said
        # The cluster moves on: a bookmark comes, and is expected from then on. (A watch's last
        # look is 2 s before its end: a longer one, for looks before that.)
        await fake.advance()
        async for kind, _ in api.watch_slices(NODE, DRIVER, str(fake.version - 1), 10):
            assert kind == "BOOKMARK"
            break
        assert api.bookmarks.expected and "the API server sends bookmarks again" in caplog.text
    finally:
        await api.close()
        await fake.stop()


async def test_every_connection_to_the_api_server_has_tcp_keepalive(tmp_path: Any) -> None:
    import socket

    fake = FakeApiServer()
    url = await fake.start()
    api = dra_client.connect(kubeconfig(tmp_path, url), environ={})
    try:
        response = await api._http.get(
            dra_client.SLICES_PATH,
            params={"fieldSelector": "spec.nodeName=node1,spec.driver=hypervisor.hyperlight.dev"},
        )
        sock = response.extensions["network_stream"].get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == dra_client.KEEPALIVE_IDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == dra_client.KEEPALIVE_INTERVAL_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == dra_client.KEEPALIVE_COUNT
        # A peer gone silent is found within two minutes of its last word.
        found = dra_client.KEEPALIVE_IDLE_S + dra_client.KEEPALIVE_INTERVAL_S * dra_client.KEEPALIVE_COUNT
        assert found <= 120
    finally:
        await api.close()
        await fake.stop()


async def test_a_cluster_ca_without_key_usage_is_trusted_as_client_go_trusts_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.13 verifies X.509 strictly by default (VERIFY_X509_STRICT): a CA certificate
    without keyUsage is refused ("CA cert does not include key usage extension"), while client-go
    and kubectl accept it. The DRA driver in the Debian 13 image could not reach the e2e cluster's
    API server (a CA made with openssl's defaults): never ready. Python 3.13's default is applied
    here whatever Python runs the test."""
    import ssl

    from tests.e2e.pki import Pki

    pki = Pki(str(tmp_path / "pki"))
    server = pki.issue("apiserver", "/CN=kube-apiserver", ("IP:127.0.0.1",))
    agent = pki.issue("agent", "/CN=agent")
    default = ssl.create_default_context

    def strict(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        context = default(*args, **kwargs)
        context.verify_flags |= ssl.VERIFY_X509_STRICT
        return context

    monkeypatch.setattr(ssl, "create_default_context", strict)
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(server.cert, server.key)
    body = json.dumps({"kind": "APIResourceList", "groupVersion": "resource.k8s.io/v1", "resources": []}).encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):  # a client that refused our certificate hangs up
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        writer.close()

    listener = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=serving)
    port = listener.sockets[0].getsockname()[1]
    api = dra_client.connect(pki.kubeconfig("agent", f"https://127.0.0.1:{port}", agent), environ={})
    try:
        assert await api.serves("resource.k8s.io", "v1")
    finally:
        await api.close()
        listener.close()
        await listener.wait_closed()


async def _chunks(*parts: bytes) -> Any:
    for part in parts:
        yield part


async def test_a_watchs_lines_are_whole_however_the_stream_is_cut_and_a_huge_one_is_refused() -> None:
    lines = [line async for line in dra_client._lines(_chunks(b'{"a"', b':1}\n\n{"b":2}\n{"c', b'":3}\n'))]
    assert lines == [b'{"a":1}', b'{"b":2}', b'{"c":3}']
    huge = b"x" * (dra_client.MAX_EVENT_BYTES + 1)
    with pytest.raises(ApiError, match="a watch event longer than"):
        [line async for line in dra_client._lines(_chunks(b'{"a":1}\n', huge))]
