"""This node's ResourceSlices of our driver as the API server has them, for the publisher
(dra/slices.py): listed once, then watched from the list's resourceVersion and kept as the events
say (an informer, as client-go's).

A watch asks the server to end it after a time drawn from a range and is opened again from the
last version it saw, without a list; a watch the server ends before half that time ended early (a
failure). Whoever reconciles is called whenever the cache changed or `dirty` was set, between
events, never during one: what it reads of the cache is one moment's.

    informer = SliceInformer(api, node, driver, (300.0, 600.0), dirty)
    await informer.run(reconcile, backoff, report, on_event)   sessions until cancelled
    await informer.session(reconcile)   one list (if needed) and one watch; raises ApiError
    informer.forget()                   the next session lists again (410 Gone, a conflict)

Why: docs/decisions/dra-an-informer-and-one-backoff.md.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Awaitable, Callable, Optional

from hyperlight_agent.backoff import Backoff
from hyperlight_agent.dra.client import SLICES, ApiError, KubeApi
from hyperlight_agent.dra.slice_report import SliceReport
from hyperlight_agent.dra.slice_spec import is_newer, object_name, object_version
from hyperlight_agent.dra.types import Json

log = logging.getLogger(__name__)

# A watch the server ended sooner than this fraction of what we asked for ended early: a failure.
EARLY_END = 0.5


class Relist(Exception):
    """What we know of the server is stale (a conflict, an expired watch): list again."""


class SliceInformer:
    """`cache`: our node's slices of our driver by name, as the server has them (writes of ours
    are put in as the server answered them); `requests`: the list and watch requests sent."""

    def __init__(
        self, api: KubeApi, node_name: str, driver: str, watch_timeout_s: tuple[float, float], dirty: asyncio.Event
    ) -> None:
        self._api, self._node_name, self._driver = api, node_name, driver
        self._watch_timeout_s = watch_timeout_s
        self._dirty = dirty
        self.cache: dict[str, Json] = {}
        self.listed_version: Optional[str] = None  # where the next watch starts (None: list first)
        self.requests = 0

    async def run(
        self,
        reconcile: Callable[[], Awaitable[None]],
        backoff: Backoff,
        report: SliceReport,
        on_event: Callable[..., None],
    ) -> None:
        """Sessions until cancelled; never raises but CancelledError. A session that failed is
        followed by the next after `backoff` (reported once a retry has to wait); one that ran to
        its end, at once. on_event: ("watch", why it was opened again), ("api_error", verb, code)."""
        while True:
            try:
                await self.session(reconcile)
                # A whole watch without trouble: the streak is over, and the next one starts afresh.
                backoff.reset()
                report.streak_over()
                on_event("watch", "ended")
                continue
            except Relist as exc:
                on_event("watch", "relist")
                self.forget()
                log.debug("ResourceSlice: %s; listing again", exc)
                line, problem = f"ResourceSlice for node {self._node_name}: {exc}", "relist"
            except ApiError as exc:
                on_event("api_error", exc.verb, str(exc.code))
                on_event("watch", "early" if exc.reason == "early" else "failed")
                if exc.code == 410 or exc.problem == "unreadable":
                    # Too old to watch from, or a server whose events we cannot read (re-watching
                    # from the same version would replay the same event): a fresh list.
                    self.forget()
                line, problem = str(exc), exc.problem
            delay = backoff.next()
            if delay > 0:  # an immediate retry is no problem yet; a streak is
                report.problem(problem, line)
            await asyncio.sleep(delay)

    def forget(self) -> None:
        """What we know is stale (a conflict, an expired watch): the next session lists again."""
        self.listed_version = None

    def put(self, obj: Json) -> None:
        """A slice as the server answered a write of ours (unless the cache has a newer one)."""
        if is_newer(obj, self.cache.get(object_name(obj))):
            self.cache[object_name(obj)] = obj

    def drop(self, name: str) -> None:
        self.cache.pop(name, None)

    async def session(self, reconcile: Callable[[], Awaitable[None]]) -> None:
        """List if needed, then one watch; `reconcile()` whenever something changed (and once at
        the start: the last session may have ended mid-write). Returns when the watch ran to its
        end; raises ApiError (a watch that ended early included) or what reconcile raised."""
        if self.listed_version is None:
            self.requests += 1
            items, self.listed_version = await self._api.list_slices(self._node_name, self._driver)
            self.cache = {object_name(o): o for o in items}
        self._dirty.set()
        timeout = random.uniform(*self._watch_timeout_s)  # noqa: S311 - a spread, not a secret
        loop = asyncio.get_running_loop()
        started = loop.time()
        watch = asyncio.ensure_future(self._watch(self.listed_version, timeout))
        try:
            while not watch.done():
                dirty = asyncio.ensure_future(self._dirty.wait())
                try:
                    await asyncio.wait([watch, dirty], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    dirty.cancel()
                if self._dirty.is_set():
                    self._dirty.clear()
                    await reconcile()
        finally:
            watch.cancel()
            await asyncio.wait([watch])
            # Retrieved even when a failed write ends the session first (else asyncio logs it).
            ended = None if watch.cancelled() else watch.exception()
        if ended is not None:
            raise ended
        lasted = loop.time() - started
        if lasted < EARLY_END * timeout:
            raise ApiError(
                "watch",
                SLICES,
                0,
                "early",
                f"the API server ended the watch after {lasted:.1f} s (asked for {timeout:.0f} s)",
            )

    async def _watch(self, version: str, timeout: float) -> None:
        """Follow the server's changes to our slices from `version` until the watch ends."""
        self.requests += 1
        async for kind, obj in self._api.watch_slices(self._node_name, self._driver, version, timeout):
            self.listed_version = object_version(obj)
            if kind == "BOOKMARK":
                continue
            name, known = object_name(obj), self.cache.get(object_name(obj))
            if not is_newer(obj, known):
                continue
            if kind == "DELETED":
                self.cache.pop(name, None)
            else:
                self.cache[name] = obj
            self._dirty.set()
