"""Handing the kubelet over between two instances of the device plugin, in-process against the
kubelet stand-in in each of its flavours (issue 35): a successor that is not ready never takes the
kubelet's endpoint from a ready agent, and the old agent's stream ends only once the kubelet can
send it no more Allocates (the kubelet closes the connection then, failing what is on it)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any, Optional

import pytest

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.agent import Agent
from hyperlight_agent.config import Settings
from standin.kubelet import FLAVORS, KubeletStandin, Plugin
from tests.conftest import until
from tests.fakes import FakeHelper, RecordingNotifier, dp_side, shut
from tests.test_agent import settings_in, with_kubelet

R = contracts.RESOURCE_HYPERVISOR


def zeros_since(kubelet: KubeletStandin, since: float) -> list[float]:
    """When the kubelet counted no healthy slot of ours since `since`."""
    return [at for at, counts in kubelet.timeline if at >= since and counts.get(R, 0) == 0]


def registered_endpoints(kubelet: KubeletStandin) -> list[str]:
    return [request.endpoint for _, request in kubelet.register_calls]


def without_device(tmp: str, **kw: Any) -> Settings:
    """An agent whose device directory holds no hypervisor: its check fails (a next release whose
    probe fails, as issue 35 reproduced it)."""
    empty = os.path.join(tmp, "no-device")
    os.makedirs(empty, exist_ok=True)
    return dataclasses.replace(settings_in(tmp, **kw), device_dir=empty)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_successor_whose_device_fails_never_takes_the_kubelet_from_a_ready_agent(
    tmp: str, helpers: list[FakeHelper], flavor: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 35, 1: a successor registering with its device unhealthy made the kubelet's endpoint and
    device list its own (0 healthy), and once it was stopped the kubelet counted 0 for good."""
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(kubelet: KubeletStandin) -> None:
        kubelet.flavor = flavor
        old = Agent(settings_in(tmp, instance="old"), notifier=RecordingNotifier())
        await old.start()
        new: Optional[Agent] = None
        try:
            await until(lambda: old.ready and kubelet.allocatable() == 3, what="the old agent ready")
            since = time.monotonic()
            new = Agent(without_device(tmp, instance="new"), notifier=RecordingNotifier())
            await new.start()
            await until(
                lambda: getattr(dp_side(new), "held", "") or "hyperlight.new.sock" in registered_endpoints(kubelet),
                what="the new agent holding its Register back, or sending it",
            )
            assert registered_endpoints(kubelet) == ["hyperlight.old.sock"]
            status = new.status()
            assert status.startswith(f"unhealthy: no hypervisor device in {new.settings.device_dir}"), status
            assert "not registering while the device is unhealthy: " in caplog.text
            await shut(new)  # the failed release goes
            new = None
            assert zeros_since(kubelet, since) == [] and kubelet.allocatable() == 3
            assert (await kubelet.allocate(R, ["kvm-1"])).container_responses
        finally:
            await shut(old)
            if new is not None:
                await shut(new)

    with_kubelet(tmp, body)


def test_a_successor_registers_once_its_device_is_healthy(tmp: str, helpers: list[FakeHelper]) -> None:
    """Held back only while unhealthy: the same successor registers when its device turns healthy,
    and an agent alone registers whatever its device says (the kubelet then counts it unhealthy)."""

    async def body(kubelet: KubeletStandin) -> None:
        kubelet.flavor = "1.37"
        alone = Agent(without_device(tmp, instance="alone"), notifier=RecordingNotifier())
        await alone.start()
        try:
            await until(lambda: registered_endpoints(kubelet) == ["hyperlight.alone.sock"], what="registered anyway")
        finally:
            await shut(alone)
        old = Agent(settings_in(tmp, instance="old"), notifier=RecordingNotifier())
        await old.start()
        new = Agent(without_device(tmp, instance="new"), notifier=RecordingNotifier())
        try:
            await until(lambda: old.ready and kubelet.allocatable() == 3, what="the old agent ready")
            await new.start()
            await until(lambda: dp_side(new).held, what="the new agent holding its Register back")
            device_dir = new.settings.device_dir
            with open(os.path.join(device_dir, "kvm"), "w"):
                pass  # the device appears (a regular file counts as one here: tests/fakes.py)
            new.checker.request()
            await until(lambda: new.ready, what="the new agent registered and ready")
            assert registered_endpoints(kubelet)[-1] == "hyperlight.new.sock" and not dp_side(new).held
            assert kubelet.allocatable() == 3
        finally:
            await shut(new)
            await shut(old)

    with_kubelet(tmp, body)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_an_allocate_on_its_way_to_the_old_agent_is_answered_before_its_stream_ends(
    tmp: str, helpers: list[FakeHelper], flavor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35, 13: the kubelet took the old agent's endpoint for a pod, then the successor's
    Register made the successor the endpoint; the call reached the old agent only after that agent
    had found its successor ready. Ending the old stream then closed the kubelet's connection, and
    the Allocate failed with "the client connection is closing" (a rejected pod)."""
    found = asyncio.Event()
    until_quiet = getattr(transport, "until_quiet", None)  # (none before issue 35)

    async def noted(*args: Any, **kw: Any) -> str:
        found.set()  # the old agent has found its successor and waits for the kubelet to be done
        assert until_quiet is not None
        return str(await until_quiet(*args, **kw))

    monkeypatch.setattr(transport, "until_quiet", noted, raising=False)

    async def body(kubelet: KubeletStandin) -> None:
        kubelet.flavor = flavor
        old = Agent(settings_in(tmp, instance="old", handover_seconds=30), notifier=RecordingNotifier())
        new = Agent(settings_in(tmp, instance="new"), notifier=RecordingNotifier())
        await old.start()
        stopping: Optional[asyncio.Future[None]] = None
        looked_up: list[Plugin] = []
        stream_ended = asyncio.Event()

        async def slow_kubelet(plugin: Plugin) -> None:
            # The kubelet's admission between taking the endpoint and calling it: the call goes
            # out once the old agent found its successor (or, failing that, ended its stream).
            looked_up.append(plugin)
            waiting = [asyncio.ensure_future(found.wait()), asyncio.ensure_future(stream_ended.wait())]
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in waiting:
                task.cancel()

        try:
            await until(lambda: old.ready and kubelet.allocatable() == 3, what="the old agent ready")
            kubelet.before_call = slow_kubelet
            pod = asyncio.ensure_future(kubelet.allocate(R, ["kvm-0"]))
            await until(lambda: looked_up, what="the kubelet taking the old agent's endpoint")
            assert looked_up[0].endpoint == "hyperlight.old.sock"
            kubelet.before_call = None
            await new.start()
            await until(lambda: new.ready, what="the successor ready")
            stopping = asyncio.ensure_future(shut(old))
            await until(lambda: found.is_set() or not looked_up[0].stream_open, what="the handover under way, or over")
            if not looked_up[0].stream_open:
                stream_ended.set()
            response = await waits.within(pod, 10)
            assert response.container_responses, "the pod is admitted"
            assert kubelet.allocations[-1][1] == "hyperlight.old.sock"
        finally:
            await shut(new)
            await waits.within(stopping if stopping is not None else shut(old), 20)

    with_kubelet(tmp, body)


def test_the_successors_first_allocate_ends_the_wait(
    tmp: str, helpers: list[FakeHelper], caplog: pytest.LogCaptureFixture
) -> None:
    """With pods arriving, the old agent need not wait out transport.QUIET_S: admission is serial,
    so a call the successor received proves the kubelet finished every call to us first."""
    caplog.set_level(logging.INFO, "hyperlight_agent")

    async def body(kubelet: KubeletStandin) -> None:
        kubelet.flavor = "1.37"
        old = Agent(settings_in(tmp, instance="old", handover_seconds=30), notifier=RecordingNotifier())
        new = Agent(settings_in(tmp, instance="new"), notifier=RecordingNotifier())
        await old.start()
        stopping: Optional[asyncio.Future[None]] = None
        try:
            await until(lambda: old.ready, what="the old agent ready")
            await new.start()
            await until(lambda: new.ready, what="the successor ready")
            stopping = asyncio.ensure_future(shut(old))
            while not stopping.done():  # a pod every few milliseconds, all to the successor
                assert (await kubelet.allocate(R, ["kvm-2"])).container_responses
                await asyncio.sleep(0.005)
            assert "the kubelet is done with us: the successor has received an Allocate" in caplog.text
            assert {endpoint for _, endpoint in kubelet.allocations} == {"hyperlight.new.sock"}
        finally:
            await shut(new)
            await waits.within(stopping if stopping is not None else shut(old), 20)

    with_kubelet(tmp, body)
