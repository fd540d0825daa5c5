"""A kubelet stand-in: the device manager's side of the v1beta1 contract, for tests and demos.

As strict as the real device manager (the kubelet's pkg/kubelet/cm/devicemanager), never more forgiving:
- Register validates the version and resource name, then *inside the call* dials the plugin's
  endpoint (10 s) and calls GetDevicePluginOptions with no deadline, then starts ListAndWatch in
  the background;
- when a ListAndWatch stream ends, for any reason, every device of the resource is unhealthy and
  the endpoint stopped; the stand-in never dials that plugin again (only a new Register helps);
- the resource's devices are the last list any of its endpoints sent (the device manager keeps
  them per resource name, genericDeviceUpdateCallback): a new Register leaves the count as it
  was until the new endpoint's first list;
- a later Register for the same resource replaces the client, and the old client lives on until
  its stream ends. What that end does depends on the kubelet (`flavor`, read from the kubelet's
  devicemanager sources, 1.34.4 to 1.37.2):
  "1.34" (1.28 to 1.36): one client per resource name; the old client's end looks the client up
  by name and disconnects the *newest* one (its stream ends, the resource is unhealthy);
  "1.37" (1.37 on): one endpoint per socket path (endpointStore); an old endpoint's end removes only it,
  the primary's end promotes a remaining live endpoint (the resource never drops), and only the
  last one's end stops the resource. A Register at a socket path that is still connected is
  refused ("device plugin already connected");
- allocate() admits one pod at a time (the allocation manager's mutex): it takes the resource's
  current endpoint, then (after `before_call`, a test's hook standing for the kubelet's goroutine
  between the two) calls Allocate on that endpoint's connection, only while the endpoint is not
  stopped and the IDs are healthy devices, with exactly one ContainerRequest and no deadline. A
  stream's end closes the endpoint's connection at once, whatever is in flight on it (the
  client's Disconnect): such an Allocate fails as the kubelet's does, with "code = Canceled desc =
  grpc: the client connection is closing" (AllocateFailed), and the pod is rejected;
- restart() deletes the sockets in its directory (not regular files, directories or the
  checkpoint), then serves a new kubelet.sock;
- allocated_health() is what a running pod holding a device ID shows in its
  allocatedResourcesStatus (1.36+, UpdateAllocatedResourcesStatus): the health the last list gave
  that ID, Healthy for an ID no list names any more, and unchanged when the endpoint stopped
  (markResourceUnhealthy changes the allocatable count, not that).
It can also hang Register (until released) or reject it, to exercise the plugin's bounds.
raw_allocate() is not kubelet behaviour: any client's Allocate, to test a plugin's own checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import grpc

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.deviceplugin import api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb

T = TypeVar("T")
_EXTENDED_RESOURCE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+)/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


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
    # The endpoint was stopped (its stream ended, or an older client's did): no Allocate, ever.
    stopped: bool = False
    stream_ended_at: Optional[float] = None
    closing: Optional[asyncio.Future[None]] = None  # the connection, closed when the stream ended

    @property
    def devices(self) -> list[tuple[str, str]]:
        return self.lists[-1][1] if self.lists else []


class NotAllocatable(Exception):
    """The real kubelet would not call Allocate now (the pod fails admission instead)."""


class AllocateFailed(Exception):
    """Allocate was called and failed on the kubelet's side (the pod fails admission)."""


# What grpc-go says of a call on a connection its ClientConn.Close() ended (ErrClientConnClosing).
CONNECTION_CLOSING = "rpc error: code = Canceled desc = grpc: the client connection is closing"


FLAVORS = ("1.34", "1.37")


class KubeletStandin:
    """Create and use inside one event loop (see StandinThread for synchronous tests)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.socket_path = os.path.join(directory, contracts.KUBELET_SOCKET)
        self.checkpoint = os.path.join(directory, contracts.KUBELET_CHECKPOINT)
        self.plugins: dict[str, Plugin] = {}
        # Per resource: the last list any of its endpoints sent, [(ID, health)] (the device
        # manager's healthyDevices and unhealthyDevices).
        self.devices: dict[str, list[tuple[str, str]]] = {}
        # Per resource: the last list, as sent (the device manager's allDevices).
        self.listed: dict[str, dict[str, str]] = {}
        self.register_calls: list[tuple[float, pb.RegisterRequest]] = []
        # "normal", "hang" or "reject"; "late_reply": connect and start the stream, then hold
        # Register's reply until release() (the real kubelet starts ListAndWatch in a goroutine
        # before Register returns, so its first list may reach it before the plugin has the reply).
        self.mode = "normal"
        self.open_streams = True  # False: register plugins but never call ListAndWatch
        self.flavor = "1.34"  # how an old client's stream end hits a newer registration (FLAVORS)
        # Clients replaced by a later Register whose streams have not ended yet.
        self.replaced: list[Plugin] = []
        self._release = asyncio.Event()
        self._server: Optional[grpc.aio.Server] = None
        self.changed = asyncio.Event()  # set whenever anything above changes
        # (monotonic time, {resource: allocatable slots}) at every change: the view admission uses.
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.started_at = 0.0
        # Admission is serial (the allocation manager holds its mutex through Allocate).
        self._admission = asyncio.Lock()
        # Awaited with the endpoint taken and before its Allocate is sent: a test's hook for the
        # moment the kubelet's admission spends between the two (endpoint lookup, then the RPC).
        self.before_call: Optional[Callable[[Plugin], Awaitable[None]]] = None
        self.allocations: list[tuple[float, str]] = []  # (when sent, the endpoint), per Allocate

    def allocatable(self, resource: str = contracts.RESOURCE_HYPERVISOR) -> int:
        """The resource's allocatable count as the kubelet reports it (0 before any registration)."""
        p = self.plugins.get(resource)
        if p is None or p.stopped:
            return 0
        return len(self._healthy(resource))

    def registers_since_start(self) -> list[pb.RegisterRequest]:
        """The Registers this kubelet.sock (the last one started) has received."""
        return [request for when, request in self.register_calls if when >= self.started_at]

    def allocated_health(self, resource: str, device_id: str) -> str:
        """A running pod's allocatedResourcesStatus for the device ID it was allocated."""
        health = self.listed.get(resource, {}).get(device_id, contracts.HEALTHY)
        return "Healthy" if health == contracts.HEALTHY else "Unhealthy"

    def _healthy(self, resource: str) -> set[str]:
        return {i for i, health in self.devices.get(resource, []) if health == contracts.HEALTHY}

    def _mark_unhealthy(self, resource: str) -> None:
        """As markResourceUnhealthy: the last endpoint is gone, every device is unhealthy."""
        self.devices[resource] = [(i, contracts.UNHEALTHY) for i, _ in self.devices.get(resource, [])]

    async def start(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        if not os.path.exists(self.checkpoint):
            with open(self.checkpoint, "w") as f:
                f.write('{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":0}\n')
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers([api.registration_handler(self)])
        self._server.add_insecure_port(transport.unix_target(self.socket_path))
        self.started_at = time.monotonic()  # kubelet.sock answers from here on (no Register before it)
        await self._server.start()
        self._changed()

    async def stop(self) -> None:
        """As the kubelet's exit: kubelet.sock stops answering, and every plugin's stream ends."""
        # Not listening first: an exiting kubelet's socket closes with its streams, so a plugin that
        # registers again the moment its stream ends finds nobody there (CI once saw such a Register
        # counted by the old server, and the new server's after it). A held Register ends with the
        # server, unanswered, as the kubelet's exit leaves it; only then are the holds let go.
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        self._release.set()
        for plugin in [*self.plugins.values(), *self.replaced]:
            await self._drop(plugin)
        self.replaced.clear()

    async def restart(self, bound_while_down: Sequence[list[str]] = ()) -> list[str]:
        """As the kubelet does on start: remove the sockets in its directory, serve kubelet.sock
        anew, then admit the pods bound to the node while it was down (their device IDs), at once:
        the real one admits them as soon as its pod informer has them, which can be before any
        plugin has registered again (kubernetes issue 133382). Returns each one's outcome: the
        error that rejects it, or "allocated"."""
        await self.stop()
        self.plugins.clear()
        self.devices.clear()
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
        self._release = asyncio.Event()
        await self.start()
        self._changed()
        outcomes = []
        for ids in bound_while_down:
            try:
                await self.allocate(contracts.RESOURCE_HYPERVISOR, ids)
                outcomes.append("allocated")
            except (NotAllocatable, AllocateFailed) as exc:
                outcomes.append(str(exc))
        return outcomes

    async def replace_socket(self) -> None:
        """Serve a new kubelet.sock without touching anything else (plugins' sockets stay)."""
        await self.stop()
        self.plugins.clear()
        self.devices.clear()
        with contextlib.suppress(FileNotFoundError):  # grpc may already have removed it
            os.unlink(self.socket_path)
        self._release = asyncio.Event()
        await self.start()

    def release(self) -> None:
        """Let held Registers ("hang", "late_reply") go on."""
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
            await context.abort(
                grpc.StatusCode.UNKNOWN, f"requested device plugin API version {request.version!r} is not supported"
            )
        if not _EXTENDED_RESOURCE.match(request.resource_name) or request.resource_name.split("/")[0].endswith(
            "kubernetes.io"
        ):
            await context.abort(grpc.StatusCode.UNKNOWN, f"invalid resource name {request.resource_name!r}")
        if not request.endpoint or "/" in request.endpoint:
            await context.abort(grpc.StatusCode.UNKNOWN, f"invalid endpoint {request.endpoint!r}")
        channel = grpc.aio.insecure_channel(transport.unix_target(os.path.join(self.directory, request.endpoint)))
        try:
            # Dial back inside Register, as the kubelet's device manager does.
            await waits.within(channel.channel_ready(), contracts.KUBELET_DIAL_TIMEOUT_S)
            # No deadline, as the kubelet: a plugin that never answers hangs this Register.
            options = await api.device_plugin_stub(channel).GetDevicePluginOptions(pb.Empty())
        except (asyncio.TimeoutError, grpc.aio.AioRpcError) as exc:
            await channel.close(None)
            await context.abort(grpc.StatusCode.UNKNOWN, f"cannot reach plugin endpoint: {exc}")
        old = self.plugins.get(request.resource_name)
        if self.flavor == "1.37" and any(
            p.endpoint == request.endpoint and p.stream_open
            for p in (old, *self.replaced)
            if p and p.resource == request.resource_name
        ):
            await channel.close(None)
            await context.abort(
                grpc.StatusCode.UNKNOWN,
                "device plugin already connected: " + os.path.join(self.directory, request.endpoint),
            )
        if old is not None and old.stream_task is not None and not old.stream_task.done():
            self.replaced.append(old)  # it lives on until its stream ends
        plugin = Plugin(request.resource_name, request.endpoint, options, time.monotonic(), channel)
        if self.open_streams:
            plugin.stream_task = asyncio.ensure_future(self._watch(plugin))
        self.plugins[request.resource_name] = plugin
        self._changed()
        if self.mode == "late_reply":
            await self._release.wait()
        return pb.Empty()

    async def _watch(self, plugin: Plugin) -> None:
        plugin.stream_open = True
        call = api.device_plugin_stub(plugin.channel).ListAndWatch(pb.Empty())
        try:
            async for response in call:
                plugin.lists.append((time.monotonic(), [(d.ID, d.health) for d in response.devices]))
                self.devices[plugin.resource] = plugin.lists[-1][1]
                self.listed[plugin.resource] = dict(plugin.lists[-1][1])
                self._changed()
        except grpc.aio.AioRpcError:
            pass
        finally:
            # As the kubelet's Disconnect: the stream and the connection go, so the plugin sees it.
            call.cancel()
            plugin.closing = asyncio.ensure_future(plugin.channel.close(None))
            plugin.stream_open = False
            plugin.stopped = True
            plugin.stream_ended_at = time.monotonic()
            if plugin in self.replaced:
                self.replaced.remove(plugin)
                self._old_client_ended(plugin)
            elif self.plugins.get(plugin.resource) is plugin and not self._promote(plugin.resource):
                self._mark_unhealthy(plugin.resource)
            self._changed()

    def _promote(self, resource: str) -> bool:
        """1.37+: the primary endpoint ended; another live one for the resource takes its place
        (True). 1.34 has one client per resource: never."""
        live = [p for p in self.replaced if p.resource == resource and p.stream_open]
        if self.flavor != "1.37" or not live:
            return False
        self.replaced.remove(live[-1])
        self.plugins[resource] = live[-1]
        return True

    def _old_client_ended(self, old: Plugin) -> None:
        """What a replaced client's end does to the resource's current registration."""
        current = self.plugins.get(old.resource)
        if current is None or current is old or self.flavor == "1.37":
            return  # 1.37+: endpoints are per socket path; the old one's end touches no other
        # runClient looks the client up by resource name and disconnects the newest one: its
        # stream ends and the resource is unhealthy until a new Register.
        if current.stream_task is not None:
            current.stream_task.cancel()

    async def drop_stream(self, resource: str) -> None:
        """End a plugin's ListAndWatch stream (as if the connection broke or the kubelet ended it)."""
        plugin = self.plugins[resource]
        if plugin.stream_task is not None:
            plugin.stream_task.cancel()
            await asyncio.gather(plugin.stream_task, return_exceptions=True)

    async def _drop(self, plugin: Plugin) -> None:
        if plugin.stream_task is not None:
            plugin.stream_task.cancel()
            await asyncio.gather(plugin.stream_task, return_exceptions=True)
        if plugin.channel is not None:
            await plugin.channel.close(None)

    # --- calls the kubelet makes later ----------------------------------------------------

    async def allocate(self, resource: str, ids: list[str]) -> pb.AllocateResponse:
        """Allocate as the kubelet's admission does: one pod at a time, the resource's endpoint
        taken first and its Allocate sent after (`before_call`), healthy device IDs, one container,
        no deadline. Raises NotAllocatable where the kubelet would not call the plugin at all, and
        AllocateFailed where the call fails (both reject the pod)."""
        async with self._admission:
            healthy = self._healthy(resource)
            if not ids or not set(ids) <= healthy:
                raise NotAllocatable(f"{resource}: {ids} are not healthy devices")
            plugin = self.plugins.get(resource)  # m.endpoints[resource], under the manager's mutex
            if plugin is None:
                raise NotAllocatable(f"{resource}: no plugin registered")
            if self.before_call is not None:
                await self.before_call(plugin)
            if plugin.stopped or plugin.stream_task is None:
                raise NotAllocatable(f"{resource}: endpoint {plugin.endpoint} has been stopped")
            if plugin.closing is not None:  # closed by the stream's end, not yet marked stopped
                raise AllocateFailed(f"{resource}: Allocate failed due to {CONNECTION_CLOSING}")
            request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
            self.allocations.append((time.monotonic(), plugin.endpoint))
            call = api.device_plugin_stub(plugin.channel).Allocate(request)
            try:
                response: pb.AllocateResponse = await call
            except asyncio.CancelledError:
                if plugin.closing is None:
                    raise  # our own caller went away
                raise AllocateFailed(f"{resource}: Allocate failed due to {CONNECTION_CLOSING}") from None
            if not response.container_responses:
                raise NotAllocatable(f"{resource}: Allocate returned no container response")
            return response

    async def raw_allocate(
        self, resource: str, *containers: list[str], timeout: Optional[float] = None
    ) -> pb.AllocateResponse:
        """Any client's Allocate on the plugin's channel: whatever IDs, whatever health (not
        kubelet behaviour; for testing the plugin's own checks)."""
        plugin = self.plugins[resource]
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
        )
        response: pb.AllocateResponse = await api.device_plugin_stub(plugin.channel).Allocate(request, timeout=timeout)
        return response

    def _changed(self) -> None:
        self.timeline.append((time.monotonic(), {r: self.allocatable(r) for r in self.plugins}))
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

    def wait_until(
        self, predicate: Callable[[KubeletStandin], Any], timeout: float = 10, what: str = "condition"
    ) -> Any:
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
                await waits.event(event, remaining)

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
