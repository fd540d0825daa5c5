"""The slice informer (dra/slice_informer.py) against the fake API server: one list, then a watch
whose events keep the cache, reconcile called on each change; a watch ended early is a failure;
forget() lists again. (The publisher built on it: test_dra_slices.py.)"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Awaitable, Callable

import pytest

from hyperlight_agent.dra import client as dra_client
from hyperlight_agent.dra.client import ApiError
from hyperlight_agent.dra.slice_informer import SliceInformer
from standin.apiserver import DRIVER, NODE, FakeApiServer, Json, kubeconfig
from tests.conftest import until


def slice_of(name: str, node: str = NODE) -> Json:
    return {
        "metadata": {"name": name, "resourceVersion": "1", "creationTimestamp": "t"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def run(tmp_path: Any, body: Callable[[FakeApiServer, SliceInformer, asyncio.Event], Awaitable[None]]) -> None:
    async def main() -> None:
        fake = FakeApiServer()
        url = await fake.start()
        api = dra_client.connect(kubeconfig(tmp_path, url), environ={})
        dirty = asyncio.Event()
        try:
            await asyncio.wait_for(body(fake, SliceInformer(api, NODE, DRIVER, (60.0, 60.0), dirty), dirty), 20)
        finally:
            await api.close()
            await fake.stop()

    asyncio.run(main())


def test_a_session_lists_then_keeps_the_cache_as_the_watch_says_and_reconciles_on_each_change(
    tmp_path: Any,
) -> None:
    async def body(fake: FakeApiServer, informer: SliceInformer, dirty: asyncio.Event) -> None:
        await fake.put(slice_of("a"), "ADDED")
        await fake.put(slice_of("elsewhere", node="node-2"), "ADDED")  # another node's: never ours
        seen: list[set[str]] = []

        async def reconcile() -> None:
            seen.append(set(informer.cache))

        session = asyncio.ensure_future(informer.session(reconcile))
        try:
            await until(lambda: seen == [{"a"}], what="the first reconcile, after the list")
            assert informer.requests == 2  # the list and the watch
            await fake.put(slice_of("b"), "ADDED")
            await until(lambda: seen[-1] == {"a", "b"}, what="a slice someone made")
            await fake.remove("a")
            await until(lambda: seen[-1] == {"b"}, what="a slice someone deleted")
            # An event older than what the cache holds changes nothing, and wakes no one.
            looks = len(seen)
            stale = copy.deepcopy(informer.cache["b"])
            stale["metadata"]["resourceVersion"] = "2"
            await fake.inject("MODIFIED", stale)
            await fake.put(slice_of("c"), "ADDED")
            await until(lambda: "c" in seen[-1], what="the next change")
            assert len(seen) == looks + 1 and informer.cache["b"]["metadata"]["resourceVersion"] != "2"
            # A write of ours is put in as the server answered it; an older answer is not.
            informer.put(dict(slice_of("d"), metadata={"name": "d", "resourceVersion": str(fake.version + 1)}))
            informer.put(dict(slice_of("c"), metadata={"name": "c", "resourceVersion": "3"}))
            assert "d" in informer.cache and informer.cache["c"]["metadata"]["resourceVersion"] != "3"
            informer.drop("d")
            assert set(informer.cache) == {"b", "c"}
            assert informer.listed_version == str(fake.version)
        finally:
            session.cancel()
            await asyncio.wait([session])

    run(tmp_path, body)


def test_a_watch_the_server_ends_early_fails_and_forget_lists_again(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, informer: SliceInformer, dirty: asyncio.Event) -> None:
        fake.end_watches = True  # every watch answered, then ended at once

        async def reconcile() -> None:
            pass

        with pytest.raises(ApiError) as failed:
            await informer.session(reconcile)
        assert failed.value.reason == "early" and "ended the watch after" in failed.value.message
        assert [r.verb for r in fake.requests] == ["list", "watch"]
        # The next session watches from where the list left off, without listing...
        with pytest.raises(ApiError):
            await informer.session(reconcile)
        assert [r.verb for r in fake.requests] == ["list", "watch", "watch"]
        # ...unless what we know is stale.
        informer.forget()
        with pytest.raises(ApiError):
            await informer.session(reconcile)
        assert [r.verb for r in fake.requests] == ["list", "watch", "watch", "list", "watch"]

    run(tmp_path, body)
