"""A kubelet stand-in: the device manager's side of the v1beta1 contract, for tests and demos.

It behaves like the real kubelet where plugins can tell the difference:
- Register validates the version and resource name, then *inside the call* dials the plugin's
  endpoint (10 s) and calls GetDevicePluginOptions, then starts ListAndWatch in the background;
- a later Register for the same resource replaces the earlier endpoint and stream;
- restart() deletes every file in its directory except its checkpoint, then serves a new
  kubelet.sock;
- allocate() calls Allocate with no deadline.
It can also hang Register (until released) or reject it, to exercise the plugin's bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, TypeVar

import grpc

from . import api, contracts
from . import deviceplugin_pb2 as pb

T = TypeVar("T")
_EXTENDED_RESOURCE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+)/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@dataclass
class Plugin:
    """What the stand-in knows about one registered resource."""

    resource: str
    endpoint: str
    options: pb.DevicePluginOptions
    registered_at: float
    channel: Any = None
    stream_task: Optional[asyncio.Task[None]] = None
    # (monotonic time, [(ID, health)]) for every list received, in order.
    lists: list[tuple[float, list[tuple[str, str]]]] = field(default_factory=list)
    stream_open: bool = False

    @property
    def devices(self) -> list[tuple[str, str]]:
        return self.lists[-1][1] if self.lists else []

    @property
    def healthy(self) -> int:
        """Allocatable slots as the kubelet would count them (0 once the stream has ended)."""
        if not self.stream_open:
            return 0
        return sum(1 for _, health in self.devices if health == contracts.HEALTHY)


class KubeletStandin:
    """Create and use inside one event loop (see StandinThread for synchronous tests)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.socket_path = os.path.join(directory, contracts.KUBELET_SOCKET)
        self.checkpoint = os.path.join(directory, contracts.KUBELET_CHECKPOINT)
        self.plugins: dict[str, Plugin] = {}
        self.register_calls: list[tuple[float, pb.RegisterRequest]] = []
        self.mode = "normal"  # "normal", "hang" or "reject"
        self.open_streams = True  # False: register plugins but never call ListAndWatch
        self._release = asyncio.Event()
        self._server: Optional[grpc.aio.Server] = None
        self.changed = asyncio.Event()  # set whenever anything above changes
        self.started_at = 0.0

    async def start(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        if not os.path.exists(self.checkpoint):
            with open(self.checkpoint, "w") as f:
                f.write('{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":0}\n')
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers([api.registration_handler(self)])
        self._server.add_insecure_port(api.unix_target(self.socket_path))
        await self._server.start()
        self.started_at = time.monotonic()  # when kubelet.sock began answering
        self._changed()

    async def stop(self) -> None:
        self._release.set()
        for plugin in self.plugins.values():
            await self._drop(plugin)
        if self._server is not None:
            await self._server.stop(0)
            self._server = None

    async def restart(self) -> None:
        """As the kubelet does on start: remove all but the checkpoint, serve kubelet.sock anew."""
        await self.stop()
        self.plugins.clear()
        for name in os.listdir(self.directory):
            if name != contracts.KUBELET_CHECKPOINT:
                path = os.path.join(self.directory, name)
                if not os.path.isdir(path) or os.path.islink(path):
                    os.unlink(path)
        self._release = asyncio.Event()
        await self.start()
        self._changed()

    async def replace_socket(self) -> None:
        """Serve a new kubelet.sock without touching anything else (plugins' sockets stay)."""
        self._release.set()
        for plugin in self.plugins.values():
            await self._drop(plugin)
        self.plugins.clear()
        if self._server is not None:
            await self._server.stop(0)
        with contextlib.suppress(FileNotFoundError):  # grpc may already have removed it
            os.unlink(self.socket_path)
        self._release = asyncio.Event()
        await self.start()

    def release(self) -> None:
        """Let hung Register calls return."""
        self._release.set()

    # --- Registration service -------------------------------------------------------------

    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        self.register_calls.append((time.monotonic(), request))
        self._changed()
        if self.mode == "hang":
            await self._release.wait()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stand-in released a hung Register")
        if self.mode == "reject":
            await context.abort(grpc.StatusCode.INTERNAL, "stand-in rejects registrations")
        if request.version != contracts.KUBELET_API_VERSION:
            await context.abort(grpc.StatusCode.UNKNOWN,
                                f"requested device plugin API version {request.version!r} is not supported")
        if not _EXTENDED_RESOURCE.match(request.resource_name) or \
                request.resource_name.split("/")[0].endswith("kubernetes.io"):
            await context.abort(grpc.StatusCode.UNKNOWN, f"invalid resource name {request.resource_name!r}")
        if not request.endpoint or "/" in request.endpoint:
            await context.abort(grpc.StatusCode.UNKNOWN, f"invalid endpoint {request.endpoint!r}")
        channel = grpc.aio.insecure_channel(api.unix_target(os.path.join(self.directory, request.endpoint)))
        try:
            # Dial back inside Register, as the kubelet's device manager does.
            await asyncio.wait_for(channel.channel_ready(), contracts.KUBELET_DIAL_TIMEOUT_S)
            options = await api.device_plugin_stub(channel).GetDevicePluginOptions(
                pb.Empty(), timeout=contracts.KUBELET_DIAL_TIMEOUT_S)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError) as exc:
            await channel.close(None)
            await context.abort(grpc.StatusCode.UNKNOWN, f"cannot reach plugin endpoint: {exc}")
        old = self.plugins.get(request.resource_name)
        if old is not None:
            await self._drop(old)
        plugin = Plugin(request.resource_name, request.endpoint, options, time.monotonic(), channel)
        if self.open_streams:
            plugin.stream_task = asyncio.ensure_future(self._watch(plugin))
        self.plugins[request.resource_name] = plugin
        self._changed()
        return pb.Empty()

    async def _watch(self, plugin: Plugin) -> None:
        plugin.stream_open = True
        try:
            call = api.device_plugin_stub(plugin.channel).ListAndWatch(pb.Empty())
            async for response in call:
                plugin.lists.append((time.monotonic(), [(d.ID, d.health) for d in response.devices]))
                self._changed()
        except grpc.aio.AioRpcError:
            pass
        finally:
            plugin.stream_open = False
            self._changed()

    async def drop_stream(self, resource: str) -> None:
        """End a plugin's ListAndWatch stream (as if the kubelet's watcher died)."""
        plugin = self.plugins[resource]
        if plugin.stream_task is not None:
            plugin.stream_task.cancel()
            await asyncio.gather(plugin.stream_task, return_exceptions=True)
            plugin.stream_task = None

    async def _drop(self, plugin: Plugin) -> None:
        if plugin.stream_task is not None:
            plugin.stream_task.cancel()
            await asyncio.gather(plugin.stream_task, return_exceptions=True)
        if plugin.channel is not None:
            await plugin.channel.close(None)

    # --- calls the kubelet makes later ----------------------------------------------------

    async def allocate(self, resource: str, *containers: list[str],
                       timeout: Optional[float] = None) -> pb.AllocateResponse:
        """Allocate as the kubelet does: no deadline unless a test asks for one."""
        plugin = self.plugins[resource]
        request = pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        response: pb.AllocateResponse = await api.device_plugin_stub(plugin.channel).Allocate(
            request, timeout=timeout)
        return response

    def _changed(self) -> None:
        event, self.changed = self.changed, asyncio.Event()
        event.set()


class StandinThread:
    """Runs a KubeletStandin on its own event loop in a thread, for synchronous code.

    >>> with StandinThread("/tmp/kubelet") as kubelet:           # doctest: +SKIP
    ...     kubelet.wait_until(lambda k: k.plugins, timeout=5)
    """

    def __init__(self, directory: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kubelet-standin", daemon=True)
        self._thread.start()
        self.kubelet: KubeletStandin = self.call(self._make(directory))
        self.call(self.kubelet.start())

    @staticmethod
    async def _make(directory: str) -> KubeletStandin:
        return KubeletStandin(directory)

    def call(self, coro: Awaitable[T], timeout: Optional[float] = 30) -> T:
        async def wrap() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

    def run(self, fn: Callable[[KubeletStandin], T]) -> T:
        """Run fn(kubelet) on the stand-in's loop (its state is only touched from there)."""

        async def wrap() -> T:
            return fn(self.kubelet)

        return self.call(wrap())

    def wait_until(self, predicate: Callable[[KubeletStandin], Any], timeout: float = 10,
                   what: str = "condition") -> Any:
        """Wait, without polling, until predicate(kubelet) is truthy; returns its value."""

        async def wait() -> Any:
            deadline = self.loop.time() + timeout
            while True:
                event = self.kubelet.changed
                value = predicate(self.kubelet)
                if value:
                    return value
                remaining = deadline - self.loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"kubelet stand-in: timed out after {timeout} s waiting for {what}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)

        return self.call(wait(), timeout=timeout + 5)

    def close(self) -> None:
        try:
            self.call(self.kubelet.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            self.loop.close()

    def __enter__(self) -> StandinThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
