"""The requests that change this node's ResourceSlices, for the publisher (slices.py), which decides
when: create or replace the slice we keep, delete its duplicates and the slices of our driver's
earlier names. Each is counted (the requests benchmarks read, the write metrics) and what it
repairs is said (slice_report.py); a write that finds the server's state stale raises Relist."""

from __future__ import annotations

import logging
from typing import Callable, Optional

from hyperlight_agent.dra.client import ApiError, KubeApi
from hyperlight_agent.dra.slice_informer import Relist, SliceInformer
from hyperlight_agent.dra.slice_report import SliceReport
from hyperlight_agent.dra.slice_spec import object_name, slice_object
from hyperlight_agent.dra.types import Json

log = logging.getLogger(__name__)


class SliceWrites:
    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        driver: str,
        informer: SliceInformer,
        report: SliceReport,
        on_event: Callable[..., None],
    ) -> None:
        self._api, self._node_name, self._driver = api, node_name, driver
        self._informer, self._report, self._event = informer, report, on_event
        self.requests = 0  # requests sent (writes, dry runs, deletes, the sweep's lists)
        self.written: Optional[Json] = None  # what we last wrote (a desired spec), once we have

    async def write(
        self, desired: Json, keep: Optional[Json], extras: list[Json], generation: int, name: str, dry_run: bool = False
    ) -> Json:
        """Delete the duplicates (`extras`), then create or update the slice (`keep`, None: none
        stands; `name`: the one we last settled on) at `generation`; the server's answer (`dry_run`:
        what the server would store; nothing deleted, nothing stored, nothing said)."""
        try:
            for extra in extras:
                self._report.notice(
                    f"duplicate {object_name(extra)}",
                    f"ResourceSlice {object_name(extra)} duplicates "
                    f"{object_name(keep or {})} for node {self._node_name}; deleting it",
                )
                await self.delete(object_name(extra))
            if keep is None:
                if self.written is not None and not dry_run:
                    self._report.notice(
                        "deleted",
                        f"ResourceSlice {name} was deleted (a kubelet start wipes them); creating it again",
                    )
                self.requests += 1
                if not dry_run:  # (the metric counts writes; `requests` what the server is asked)
                    self._event("write", "create")
                # generateName: the server appends five random characters ("node1-hypervisor.hyperlight.dev-x7k2p").
                prefix = {"generateName": f"{self._node_name}-{self._driver}-"}
                return await self._api.create_slice(slice_object(desired, prefix, generation), dry_run=dry_run)
            if self.written == desired and object_name(keep) == name and not dry_run:
                self._report.notice("edited", f"ResourceSlice {object_name(keep)} edited by someone else; restoring")
            self.requests += 1
            if not dry_run:
                self._event("write", "update")
            metadata = keep.get("metadata") or {}
            return await self._api.replace_slice(slice_object(desired, metadata, generation), dry_run=dry_run)
        except ApiError as exc:
            if exc.code == 409:
                raise Relist(f"conflict: {exc.message}") from exc
            if exc.code == 404 and exc.verb == "update":
                raise Relist("the slice went away while we updated it") from exc
            raise

    async def sweep(self, drivers_before: tuple[str, ...]) -> None:
        """Delete this node's slices published under our driver's earlier names."""
        for driver in drivers_before:
            self.requests += 1
            old, _ = await self._api.list_slices(self._node_name, driver)
            for obj in old:
                log.info(
                    "ResourceSlice %s: published under driver %s, our name before %s; deleting it",
                    object_name(obj),
                    driver,
                    self._driver,
                )
                await self.delete(object_name(obj))

    async def delete(self, name: str) -> None:
        self.requests += 1
        self._event("write", "delete")
        try:
            await self._api.delete_slice(name)
        except ApiError as exc:
            if exc.code != 404:  # already gone is what we wanted
                raise
        self._informer.drop(name)
