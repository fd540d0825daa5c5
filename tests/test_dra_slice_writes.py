"""The slice's writes against the fake API server: what each sends and counts, a dry run that
stores and says nothing, and the answers that mean "list again"."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from hyperlight_agent.dra.client import KubeApi
from hyperlight_agent.dra.slice_informer import Relist, SliceInformer
from hyperlight_agent.dra.slice_report import SliceReport
from hyperlight_agent.dra.slice_spec import DeviceInfo, desired_spec
from hyperlight_agent.dra.slice_writes import SliceWrites
from standin.apiserver import DRIVER, NODE, FakeApiServer, status
from tests.test_dra_slices import run

DESIRED = desired_spec(NODE, DRIVER, 2, DeviceInfo("kvm", 12, "/dev/kvm"), False, None, True)


def writes(api: KubeApi, events: list[tuple[str, ...]]) -> SliceWrites:
    informer = SliceInformer(api, NODE, DRIVER, (300.0, 600.0), asyncio.Event())
    report = SliceReport(time.monotonic, lambda: None)
    return SliceWrites(api, NODE, DRIVER, informer, report, lambda *e: events.append(e))


def test_a_dry_run_stores_nothing_and_a_write_creates_then_updates(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        events: list[tuple[str, ...]] = []
        w = writes(api, events)
        answer = await w.write(DESIRED, None, [], 1, "", dry_run=True)
        assert answer["spec"]["devices"] == DESIRED["devices"]
        assert not fake.slices and w.requests == 1 and events == [], "asked, nothing stored, no write counted"
        created = await w.write(DESIRED, None, [], 1, "")
        name = created["metadata"]["name"]
        assert name.startswith(f"{NODE}-{DRIVER}-") and list(fake.slices) == [name]
        updated = await w.write(DESIRED, created, [], 2, name)
        assert updated["spec"]["pool"]["generation"] == 2
        assert events == [("write", "create"), ("write", "update")] and w.requests == 3

    run(tmp_path, body)


def test_a_conflict_means_list_again_and_a_slice_gone_already_is_deleted(tmp_path: Any) -> None:
    async def body(fake: FakeApiServer, api: KubeApi) -> None:
        events: list[tuple[str, ...]] = []
        w = writes(api, events)
        created = await w.write(DESIRED, None, [], 1, "")
        name = created["metadata"]["name"]
        fake.faults["update"] = [status("status-409-conflict.json", name)]
        with pytest.raises(Relist, match="conflict"):
            await w.write(DESIRED, created, [], 2, name)
        await w.delete(name)
        await w.delete(name)  # 404: what we wanted
        assert not fake.slices
        assert events.count(("write", "delete")) == 2

    run(tmp_path, body)
