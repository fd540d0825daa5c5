"""Small fakes for the fast loop (`make check`): the core's logic in-process, with no root, no
device node and no probe helper process where the kernel is not the point.

- FakeHelper stands for device.helper.ProbeHelper: it answers each ProbeRequest with a
  ProbeResult the test chose (or raises what the test chose), and records the requests.
- files_as_devices(monkeypatch) makes a regular file at a row's path count as that hypervisor's
  node (hypervisors.present reads only the file type; making a character device needs mknod,
  i.e. root). What the kernel says is the FakeHelper's answer.
- FakeChecker is anything with `check(timeout)`: all the servicer needs of a checker.
- RecordingNotifier keeps sd_notify messages instead of sending them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any, Callable, NoReturn, Optional, Union

import pytest

from hyperlight_agent import __version__
from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.helper import ProbeRequest, ProbeResult
from hyperlight_agent.device.observation import Observation
from hyperlight_agent.host.notify import Notifier

Answer = Union[ProbeResult, BaseException, Callable[[ProbeRequest], ProbeResult]]


class FakeHelper:
    """A probe helper that answers from `answers`: hypervisor name → ProbeResult, an exception to
    raise, or a function of the request. A row without an answer passes."""

    def __init__(self, answers: Optional[dict[str, Answer]] = None, **_: Any) -> None:
        self.answers: dict[str, Answer] = dict(answers or {})
        self.requests: list[ProbeRequest] = []
        self.gate: Optional[asyncio.Event] = None  # set: each run() waits for it first
        self.closed = False
        self.started = 0

    async def run(self, request: ProbeRequest) -> ProbeResult:
        self.requests.append(request)
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.get(request.hypervisor, ProbeResult(True))
        if isinstance(answer, BaseException):
            raise answer
        if callable(answer):
            return answer(request)
        return answer

    async def close(self) -> None:
        self.closed = True


def files_as_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A regular file at a row's path is that row's node, for hypervisors.present."""

    def present(device_dir: str) -> list[hypervisors.Hypervisor]:
        return [h for h in hypervisors.HYPERVISORS if os.path.isfile(h.device_path(device_dir))]

    monkeypatch.setattr(hypervisors, "present", present)


def device_dir(top: str, *nodes: str) -> str:
    """`top`/dev holding a regular file for each node name (see files_as_devices)."""
    path = os.path.join(top, "dev")
    os.makedirs(path, exist_ok=True)
    for node in nodes:
        with open(os.path.join(path, node), "w"):
            pass
    return path


HEALTHY_KVM = Observation(True, "", "kvm")


class FakeChecker:
    """What the servicer needs of a checker: check(timeout) → the observation it is given."""

    def __init__(self, observation: Observation = HEALTHY_KVM) -> None:
        self.observation = observation
        self.timeouts: list[Optional[float]] = []
        self.error: Optional[BaseException] = None

    async def check(self, timeout: Optional[float] = None) -> Observation:
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error
        return self.observation


class Aborted(Exception):
    def __init__(self, code: Any, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class Context:
    """What the servicer uses of grpc.aio's ServicerContext."""

    def __init__(self, remaining: Optional[float] = None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> Optional[float]:
        return self.remaining

    async def abort(self, code: Any, message: str) -> NoReturn:
        raise Aborted(code, message)

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """The answer is sent once the handler returns (where a test calls it directly)."""
        callback(self)


class RecordingNotifier(Notifier):
    """sd_notify messages, kept instead of sent."""

    def __init__(self, watchdog_interval: Optional[float] = None) -> None:
        super().__init__(environ={})
        self.messages: list[tuple[str, ...]] = []
        if watchdog_interval is not None:
            self.watchdog_interval = watchdog_interval

    def _deliver(self, lines: tuple[str, ...]) -> None:
        self.messages.append(lines)

    async def _deliver_surely(self, lines: tuple[str, ...], timeout: float) -> Optional[str]:
        self.messages.append(lines)
        return None

    @property
    def statuses(self) -> list[str]:
        """The status lines, without the version each ends with."""
        return [
            line[len("STATUS=") :].removesuffix(VERSION_SUFFIX)
            for m in self.messages
            for line in m
            if line.startswith("STATUS=")
        ]


# What Notifier appends to every status line of ours.
VERSION_SUFFIX = f"; version {__version__}"


def wiring(
    checker: Optional[FakeChecker] = None, identity: Optional[Any] = None, on_change: Callable[[], None] = lambda: None
) -> Any:
    """What an agent gives its kubelet side (kubelet_side.Wiring), with a FakeChecker, a watcher
    nobody runs and one healthy check already done: for building a side on its own."""
    from hyperlight_agent.device.observation import SharedObservation
    from hyperlight_agent.files.watcher import DirectoryWatcher
    from hyperlight_agent.identity import Identity
    from hyperlight_agent.kubelet_side import Wiring

    observation = SharedObservation()
    observation.publish(HEALTHY_KVM)
    return Wiring(
        observation=observation,
        checker=checker or FakeChecker(),  # type: ignore[arg-type]
        identity=identity or Identity.of("test", "dra", "hypervisor.hyperlight.dev"),
        serve_ours=lambda server: None,
        watcher=DirectoryWatcher(),
        on_change=on_change,
        environ={},
    )


def dra_outcomes() -> Any:
    """A DRA side's outcomes with metrics off: for building a side on its own."""
    from hyperlight_agent.dra.outcomes import DraOutcomes
    from hyperlight_agent.host.metrics import Families

    return DraOutcomes(Families(None))


def dp_side(agent: Any) -> Any:
    """The device plugin side of an agent (its registrar, servicer, profile)."""
    from hyperlight_agent.deviceplugin.side import DevicePluginSide

    assert isinstance(agent.side, DevicePluginSide)
    return agent.side


def dra_side(agent: Any) -> Any:
    """The DRA side of an agent (its registrar, publisher, service)."""
    from hyperlight_agent.dra.side import DraSide

    assert isinstance(agent.side, DraSide)
    return agent.side


def registrar(kubelet_dir: str, on_stream_seen: Optional[Callable[[int], None]] = None, **kw: Any) -> Any:
    """A device plugin Registrar serving 2 healthy slots of hyperlight.dev/hypervisor at
    hyperlight.sock in kubelet_dir (a FakeChecker behind the servicer); on_stream_seen(+1/-1)
    follows its ListAndWatch streams. Keyword arguments go to the Registrar."""
    import grpc

    from hyperlight_agent import contracts
    from hyperlight_agent.device.observation import SharedObservation
    from hyperlight_agent.deviceplugin import api
    from hyperlight_agent.deviceplugin.registration import Registrar, Timing
    from hyperlight_agent.deviceplugin.servicer import DevicePluginServicer, Endpoint, Profile

    state = SharedObservation()
    state.publish(HEALTHY_KVM)
    servicer = DevicePluginServicer(
        Profile(contracts.RESOURCE_HYPERVISOR, contracts.PLUGIN_SOCKET, 2, "cdi"),
        state,
        FakeChecker(),  # type: ignore[arg-type]
    )

    def configure(server: grpc.aio.Server, on_stream: Callable[[int, object], None]) -> Callable[[], None]:
        def counted(delta: int, stream: object) -> None:
            if on_stream_seen:
                on_stream_seen(delta)
            on_stream(delta, stream)

        endpoint = Endpoint(servicer, counted)
        server.add_generic_rpc_handlers([api.device_plugin_handler(endpoint)])
        return endpoint.close

    timing = {k: kw.pop(k) for k in [f.name for f in dataclasses.fields(Timing)] if k in kw}
    return Registrar(
        kubelet_dir, contracts.PLUGIN_SOCKET, contracts.RESOURCE_HYPERVISOR, configure, timing=Timing(**timing), **kw
    )


async def shut(agent: Any) -> None:
    """Stop an agent built in-process as a signal would: stop, wait, close."""
    agent.stop()
    await agent.wait()
    await agent.close()
