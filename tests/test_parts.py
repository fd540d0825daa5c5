"""parts.py: every kubelet protocol is one row of parts.ROWS, and nothing else knows which
protocols there are. The toy protocol here is the proof: one class and one row, and the agent runs
it (start, ready, its own metric, stop) without a line of the agent, the modes, the settings or
the metrics changed."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, cast

import grpc
import pytest

from hyperlight_agent import cli, config, contracts, modes, parts, peers, transport
from hyperlight_agent.agent import Agent
from hyperlight_agent.config import Settings
from hyperlight_agent.device.observation import Observation
from hyperlight_agent.files import sockets
from hyperlight_agent.host.healthcheck import health_check
from hyperlight_agent.kubelet_side import Family, Series, Succession, Wiring, count
from tests.conftest import until
from tests.fakes import FakeHelper, RecordingNotifier, device_dir, shut
from tests.test_host_metrics import free_port, scrape


def test_every_protocol_is_one_row() -> None:
    assert set(parts.ROWS) == set(modes.KubeletProtocol)
    assert {m.protocol for m in modes.MODES} == set(modes.KubeletProtocol)


@pytest.mark.parametrize(
    ("key", "below", "shortest"), [room for row in parts.ROWS.values() for room in row.shortest_names]
)
def test_the_settings_refuse_a_directory_without_room_for_a_rows_shortest_name(
    key: str, below: str, shortest: int
) -> None:
    """The settings take the rows' shortest names as data, below their layer: each row's counts."""
    room = contracts.UNIX_PATH_MAX - 1 - shortest - (len(below) + 1 if below else 0)
    longest = "/" + "d" * (room - 1)
    flag = "--" + key.replace("_", "-")
    parser = cli.build_parser()
    assert getattr(config.load(parser.parse_args(["--config", "/dev/null", flag, longest]), {}), key) == longest
    with pytest.raises(config.ConfigError, match=f"^{key} = "):
        config.load(parser.parse_args(["--config", "/dev/null", flag, longest + "d"]), {})


def test_the_device_plugin_and_dra_sides_can_be_succeeded() -> None:
    """Both real sides carry Succession (a surge update's or an in-place upgrade's handover): mypy
    checks the assignment below, the agent's succession() the same at run time."""
    from hyperlight_agent.deviceplugin.side import DevicePluginSide
    from hyperlight_agent.dra.side import DraSide

    def typed(device_plugin: DevicePluginSide, dra: DraSide) -> tuple[Succession, Succession]:
        return device_plugin.succession, dra.succession

    assert not issubclass(ToySide, Succession)


class _Toy(str, enum.Enum):
    """The toy protocol's name: in the agent, a new member of modes.KubeletProtocol."""

    PROTOCOL = "toy"


@dataclass(frozen=True)
class _ToySnapshot:
    observation: Observation
    checked: bool
    serving: bool
    slots: int = 1

    def ready(self) -> bool:
        return self.serving and self.checked and self.observation.healthy

    def status(self) -> str:
        return f"ready: {count(self.slots, 'toy')}" if self.ready() else "waiting"


class ToyOutcomes:
    """What the toy protocol counts: its own series, in the agent's registry."""

    def __init__(self, series: Series) -> None:
        self.serving = series.make(Family("gauge", "hyperlight_toy_serving", "1 while the toy socket serves"))


class ToySide:
    """A third kubelet protocol: one socket that serves only what every socket of ours serves (the
    health service and Describe), ready once it serves and the device is healthy. It has no
    succession (kubelet_side.Succession): a stop stops at once, and in-place upgrades are refused."""

    close_bound_s = transport.STOP_GRACE_S

    def __init__(self, path: str, wiring: Wiring, outcomes: ToyOutcomes) -> None:
        self.path = path
        self._wiring = wiring
        self._outcomes = outcomes
        self._server: Optional[grpc.aio.Server] = None

    def describe(self) -> str:
        return f"toy socket {self.path}"

    async def run(self) -> None:
        server = grpc.aio.server()
        self._wiring.serve_ours(server)
        server.add_insecure_port(transport.unix_target(self.path))
        await server.start()
        self._server = server
        self._outcomes.serving.set(1)
        self._wiring.on_change()
        await asyncio.Event().wait()

    def described(self) -> Mapping[str, Any]:
        return {"serving": self._server is not None, "calls": 0}

    def begin_stop(self) -> None:
        pass

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def snapshot(self, observation: Observation, checked: bool) -> _ToySnapshot:
        return _ToySnapshot(observation, checked, self._server is not None)

    def reconfigure(self, target: Any) -> None:
        pass


def _toy_socket(settings: Settings, mode: modes.Mode) -> str:
    return os.path.join(settings.kubelet_dir, "toy.sock")


TOY_ROW = parts.ProtocolRow(
    target=_toy_socket,
    outcomes=ToyOutcomes,
    side=ToySide,
    health_socket=_toy_socket,
    instance_sockets=lambda settings, mode: sockets.listing(settings.kubelet_dir, lambda name: name == "toy.sock"),
)
TOY = modes.Mode(
    "toy",
    "toy.hyperlight.dev",
    "",
    None,
    config.ALLOCATION_CDI,
    workload_env=False,
    inventory_only=False,
    protocol=cast(modes.KubeletProtocol, _Toy.PROTOCOL),
)


async def test_a_third_protocol_is_one_class_and_one_row(tmp: str, helpers: list[FakeHelper], monkeypatch: Any) -> None:
    monkeypatch.setitem(parts.ROWS, _Toy.PROTOCOL, TOY_ROW)
    address = f"127.0.0.1:{free_port()}"
    settings = Settings.defaults(
        kubelet_dir=os.path.join(tmp, "kubelet"),
        cdi_dir=os.path.join(tmp, "cdi"),
        device_dir=device_dir(tmp, "kvm"),
        metrics_address=address,
    )
    os.mkdir(settings.kubelet_dir)
    agent = Agent(settings, TOY, notifier=RecordingNotifier())
    assert isinstance(agent.side, ToySide)
    await agent.start()
    try:
        await until(lambda: agent.ready, what="ready")
        assert agent.status().startswith("ready: 1 toy")
        # The exec probe finds it where the row says, as it finds the device plugin and DRA.
        socket = parts.row(TOY).health_socket(settings, TOY)
        ok, line = await asyncio.to_thread(health_check, socket, "readiness")
        assert ok, line
        assert parts.row(TOY).instance_sockets(settings, TOY) == [socket]
        found = await peers.describe(socket, peers.PEER_TIMEOUT_S)
        assert found is not None and found.identity.protocol == "toy" and found.ready
        # Its own series beside the agent's, on /metrics; no other protocol's.
        await until(lambda: all(server.listening for server in agent.face.http_servers), what="metrics served")
        text = await asyncio.to_thread(scrape, address)
        assert "hyperlight_toy_serving 1.0" in text and "hyperlight_device_healthy 1.0" in text
        assert "hyperlight_registrations_total" not in text and "hyperlight_dra_" not in text
        # Without succession, an in-place upgrade is refused, and said so.
        assert agent.succession is None
        agent.upgrade()
        said = agent.upgrader.said()["upgrade"]
        assert said["state"] == "failed" and "cannot hand over" in said["why"], said
    finally:
        await shut(agent)
    assert not os.path.exists(socket)
