"""A DRA kubelet stand-in: the plugin watcher and the DRA plugin manager's side of the contract,
for tests. Runs on the caller's event loop.

As strict as the kubelet (1.37's pkg/kubelet/pluginmanager and pkg/kubelet/cm/dra; 1.35 only where
said), never more forgiving:
- it watches the registry directory with inotify, as the plugin watcher does with fsnotify: a
  socket whose name does not start with "." that is created or moved in (fsnotify's Create) is
  registered, again if it was already (the desired state's new UUID makes the reconciler
  re-register it); one deleted (Remove) deregisters that (driver, endpoint); one moved away
  (Rename) changes nothing; sockets there at the start are registered;
- a registration that failed (dial, GetInfo, or refused) is tried again while the socket is
  there: the reconciler looks every second and the operation executor backs off per socket,
  0.5 s doubling to 2 min 2 s (pluginmanager/reconciler, operationexecutor's goroutinemap);
- registering: dial the socket, GetInfo with a 1 s deadline; type must be "DRAPlugin"; an empty
  endpoint means the registration socket itself; supported_versions is walked in the plugin's
  order and the first the kubelet knows ("v1.DRAPlugin", "v1beta1.DRAPlugin") is chosen (an
  empty list, or none known, is refused); an endpoint already registered for the driver is
  refused; a refusal is told by NotifyRegistrationStatus (5 s) with the reason; an accepted
  plugin is first registered (calls go to it, its health stream opens), then told yes; when
  that notify fails (its deadline, or `notify_lost`: the plugin's answer read too late) 1.36 on
  take the registration back and try again with the backoff above, 1.35 (`keeps_failed_notify`)
  leaves it registered (`notify_failed` lists them);
- several instances of one driver (different endpoints) are kept in registration order; a call
  goes to the newest one that is connected (its channel is READY or can become so), else the newest;
- prepare()/unprepare() send only namespace, uid and name, with a 45 s deadline, and check that
  every claim of the request has an entry and no entry is for a claim not asked about; the
  instance is picked first and called after (`before_call`, a test's hook for the moment
  between), and a deregistration closes the instance's connection at once, whatever is on it:
  such a call fails as the kubelet's does ("the client connection is closing");
- resource health (1.37, pkg/kubelet/cm/dra: dra_plugin_manager.go add(), manager.go
  HandleWatchResourcesStream, healthinfo.go), with `resource_health` (the ResourceHealthStatus
  gate, on by default from 1.36): the health service is picked from supported_versions in the
  kubelet's own order (v1.DRAResourceHealth, then v1alpha1.DRAResourceHealth), none when the
  plugin names neither; one NodeWatchResources stream per registered instance, opened when it is
  registered, opened again 5 s after it ended (not after UNIMPLEMENTED), cancelled when the
  instance is deregistered; each report is stamped on arrival and reconciled with the driver's
  cache (a device not reported is dropped once its timeout passed); a device reads as Unknown
  when it is not in the cache or its last report is older than its health_check_timeout_seconds
  (30 s when not above 0); any stream's end forgets the whole driver's health, without telling
  the pods; messages are cut to 1024 characters. health() is what the kubelet would write into a
  pod's allocatedResourcesStatus. With `health_needs_offer` off it is 1.36's (ResourceHealthStatus
  beta there too): every plugin is asked for v1alpha1, whatever it offers, forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, NamedTuple, Optional

import grpc
from asyncinotify import Inotify, Mask

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.dra import api
from hyperlight_agent.dra import pluginregistration_pb2 as reg

# Versions this kubelet knows, as supported_versions names them.
KNOWN_VERSIONS = (contracts.DRA_VERSION_V1, contracts.DRA_VERSION_V1BETA1)
# The health services it knows, in its own order of preference.
KNOWN_HEALTH_SERVICES = (contracts.DRA_HEALTH_V1, contracts.DRA_HEALTH_V1ALPHA1)
HEALTH_NAMES = {0: "Unknown", 1: "Healthy", 2: "Unhealthy"}  # v1.ResourceHealthStatus


class RegistrationRefused(Exception):
    """The kubelet would not register the plugin (the message is what it tells the plugin)."""


# What grpc-go says of a call on a connection its ClientConn.Close() ended (ErrClientConnClosing).
# A failed registration's retry (see the module's docstring): the reconciler's period and the
# operation executor's exponential backoff per socket.
RECONCILE_S = contracts.DRA_RECONCILE_S
RETRY_INITIAL_S = contracts.DRA_REGISTER_RETRY_INITIAL_S
RETRY_CAP_S = 122.0
CONNECTION_CLOSING = "rpc error: code = Canceled desc = grpc: the client connection is closing"


class CallFailed(Exception):
    """The plugin's answer breaks the contract (the kubelet would fail the pod's sync)."""


@dataclass
class Instance:
    """One registered instance of a driver."""

    driver: str
    endpoint: str
    version: str
    registration_socket: str
    channel: Any
    stub: Any
    closed: bool = False  # deregistered: its connection is closed
    health_service: str = ""  # the DRAResourceHealth service chosen ("": the plugin offers none)
    health_task: Optional[asyncio.Task[None]] = None
    health_streams: int = 0  # NodeWatchResources streams opened


class DeviceHealth(NamedTuple):
    """One device's entry in the kubelet's health cache."""

    health: str  # Healthy, Unhealthy, Unknown
    message: str
    received: float  # the loop's time of the report
    timeout: float


@dataclass
class Claim:
    namespace: str
    name: str
    uid: str


@dataclass
class DraKubeletStandin:
    registry_dir: str
    known_versions: tuple[str, ...] = KNOWN_VERSIONS
    instances: dict[str, list[Instance]] = field(default_factory=dict)
    # Registration attempts that failed: (registration socket, reason).
    refused: list[tuple[str, str]] = field(default_factory=list)
    # Registrations whose NotifyRegistrationStatus(yes) failed: (registration socket, why).
    notify_failed: list[tuple[str, str]] = field(default_factory=list)
    # A test's hook, asked after a notify the plugin answered: True makes it a notify that failed
    # anyway (the answer came after the kubelet's deadline).
    notify_lost: Optional[Callable[[str], bool]] = None
    # 1.35 keeps a plugin whose notify failed; 1.36 on take it back (and register it again).
    keeps_failed_notify: bool = False
    # Every change of a driver's registered instances: (loop time, driver, how many).
    registered_counts: list[tuple[float, str, int]] = field(default_factory=list)
    # Awaited with the instance picked and before the call is sent (a test's hook).
    before_call: Optional[Callable[[Instance], Awaitable[None]]] = None
    # The ResourceHealthStatus gate: whether health streams are opened at all.
    resource_health: bool = True
    # The health services this kubelet knows, in its order of preference.
    known_health_services: tuple[str, ...] = KNOWN_HEALTH_SERVICES
    # 1.37 opens a stream only for a plugin that names a health service it knows; 1.36 (False
    # here) asks every plugin for v1alpha1, and tries again every 5 s even after UNIMPLEMENTED.
    health_needs_offer: bool = True
    # driver → "pool/device" → its entry (healthinfo.go's cache).
    health_cache: dict[str, dict[str, DeviceHealth]] = field(default_factory=dict)
    # Every change the kubelet would tell the pods of: (loop time, driver, "pool/device", health).
    health_changes: list[tuple[float, str, str, str]] = field(default_factory=list)
    # When a stream's end forgot a driver's health (the pods are not told): (loop time, driver).
    health_forgotten: list[tuple[float, str]] = field(default_factory=list)
    # How health streams ended: (driver, endpoint, the gRPC status or "eof").
    health_ends: list[tuple[str, str, str]] = field(default_factory=list)
    health_reopen_s: float = contracts.DRA_HEALTH_REOPEN_S
    _task: Optional[asyncio.Task[None]] = None
    # Per registration socket that failed: its next try (a task), and its backoff now with the
    # loop time before which no try is made.
    _retries: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _backoff: dict[str, tuple[float, float]] = field(default_factory=dict)

    async def __aenter__(self) -> DraKubeletStandin:
        self._task = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in [*self._retries.values(), *([self._task] if self._task is not None else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._retries.clear()
        for instances in self.instances.values():
            for instance in instances:
                await self._stop_health(instance)
                await instance.channel.close(None)
        self.instances.clear()

    # --- the plugin watcher ---------------------------------------------------------------------

    async def _watch(self) -> None:
        with Inotify() as inotify:
            inotify.add_watch(self.registry_dir, Mask.CREATE | Mask.MOVED_TO | Mask.DELETE)
            with contextlib.suppress(FileNotFoundError):
                for name in sorted(os.listdir(self.registry_dir)):
                    await self._created(os.path.join(self.registry_dir, name))
            async for event in inotify:
                path = os.path.join(self.registry_dir, str(event.name))
                if event.mask & (Mask.CREATE | Mask.MOVED_TO):
                    await self._created(path)
                elif event.mask & Mask.DELETE:
                    self._forget_retry(path)
                    await self._deregister(path)

    async def _created(self, path: str) -> None:
        """A Create event: a socket (not a dot-file) is registered, afresh if it was already."""
        try:
            st = os.lstat(path)
        except OSError:
            return
        if os.path.basename(path).startswith(".") or not stat.S_ISSOCK(st.st_mode):
            return
        if path in self._retries:  # its backoff holds for the new socket too: the pending try waits it out
            return
        await self._deregister(path)
        await self._try(path)

    async def _try(self, path: str) -> None:
        try:
            await self.register(path)
        except (RegistrationRefused, grpc.RpcError, asyncio.TimeoutError) as exc:
            why = str(exc) if isinstance(exc, RegistrationRefused) else f"dial/GetInfo/notify failed: {exc}"
            self.refused.append((path, why))
            delay = min(self._backoff.get(path, (RETRY_INITIAL_S / 2, 0.0))[0] * 2, RETRY_CAP_S)
            self._backoff[path] = (delay, asyncio.get_running_loop().time() + delay)
            self._retries[path] = asyncio.ensure_future(self._retry(path))
        else:
            self._backoff.pop(path, None)

    async def _retry(self, path: str) -> None:
        """The next try, no sooner than the kubelet's: its backoff, then the reconciler's next look."""
        loop = asyncio.get_running_loop()
        wait = max(0.0, self._backoff[path][1] - loop.time())
        await asyncio.sleep(wait + (-(loop.time() + wait)) % RECONCILE_S)
        del self._retries[path]
        try:
            st = os.lstat(path)
        except OSError:
            return
        if stat.S_ISSOCK(st.st_mode):
            await self._deregister(path)
            await self._try(path)

    def _forget_retry(self, path: str) -> None:
        """The socket is gone from the kubelet's desired state: no more tries (nor backoff)."""
        pending = self._retries.pop(path, None)
        if pending is not None:
            pending.cancel()
        self._backoff.pop(path, None)

    async def register(self, path: str) -> Instance:
        channel = grpc.aio.insecure_channel(transport.unix_target(path))
        registration = api.registration_stub(channel)
        try:
            info = await waits.within(registration.GetInfo(reg.InfoRequest()), contracts.DRA_GET_INFO_TIMEOUT_S)
        except BaseException:
            await channel.close(None)
            raise
        try:
            instance = await self._validate(info, path)
        except RegistrationRefused as exc:
            with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
                await waits.within(
                    registration.NotifyRegistrationStatus(
                        reg.RegistrationStatus(plugin_registered=False, error=str(exc))
                    ),
                    contracts.DRA_NOTIFY_TIMEOUT_S,
                )
            await channel.close(None)
            raise
        # RegisterPlugin (the plugin manager's store, its health stream) before the notify, as
        # operation_generator.go does: a plugin told it is registered may be called at once, and
        # stays registered when the notify fails.
        self.instances.setdefault(instance.driver, []).append(instance)
        self._counted(instance.driver)
        if self.resource_health and instance.health_service:
            instance.health_task = asyncio.ensure_future(self._watch_health(instance))
        try:
            await self._notify_registered(registration, path)
        except (grpc.RpcError, asyncio.TimeoutError) as exc:
            self.notify_failed.append((path, str(exc)))
            if not self.keeps_failed_notify:
                await self._deregister(path)
                raise
        finally:
            await channel.close(None)
        return instance

    async def _notify_registered(self, registration: Any, path: str) -> None:
        await waits.within(
            registration.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True)),
            contracts.DRA_NOTIFY_TIMEOUT_S,
        )
        if self.notify_lost is not None and self.notify_lost(path):
            raise asyncio.TimeoutError("the plugin's answer came after the deadline")

    async def _validate(self, info: reg.PluginInfo, path: str) -> Instance:
        if info.type != contracts.DRA_PLUGIN_TYPE:
            raise RegistrationRefused(f"no handler registered for plugin type: {info.type}")
        if not info.name:
            raise RegistrationRefused("empty plugin name")
        versions = list(info.supported_versions)
        if not versions:
            raise RegistrationRefused("empty list of supported gRPC services (aka supported versions)")
        chosen = next((v for v in versions if v in self.known_versions), None)
        if chosen is None:
            raise RegistrationRefused(
                f"none of services supported by the plugin ({versions}) "
                f"are supported by the kubelet ({list(self.known_versions)})"
            )
        endpoint = info.endpoint or path
        if any(i.endpoint == endpoint for i in self.instances.get(info.name, [])):
            raise RegistrationRefused(f"endpoint {endpoint} already registered for DRA driver plugin {info.name}")
        channel = grpc.aio.insecure_channel(transport.unix_target(endpoint))
        channel.get_state(try_to_connect=True)  # the kubelet connects at once and stays connected
        return Instance(
            driver=info.name,
            endpoint=endpoint,
            version=chosen,
            registration_socket=path,
            channel=channel,
            stub=api.dra_stub(channel, chosen),
            health_service=next(
                (h for h in self.known_health_services if h in versions or not self.health_needs_offer), ""
            ),
        )

    async def _deregister(self, path: str) -> None:
        for driver, instances in list(self.instances.items()):
            for instance in [i for i in instances if i.registration_socket == path]:
                instances.remove(instance)
                instance.closed = True
                await self._stop_health(instance)
                await instance.channel.close(None)
                self._counted(driver)
            if not instances:
                del self.instances[driver]

    def _counted(self, driver: str) -> None:
        count = len(self.instances.get(driver, []))
        self.registered_counts.append((asyncio.get_running_loop().time(), driver, count))

    # --- resource health ------------------------------------------------------------------------

    async def _watch_health(self, instance: Instance) -> None:
        """One instance's stream, opened again health_reopen_s after it ended, until UNIMPLEMENTED
        or the instance's deregistration (cancel)."""
        stub = api.health_stub(instance.channel, instance.health_service)
        messages = api.HEALTH_VERSIONS[instance.health_service]
        while True:
            how = "eof"
            try:
                instance.health_streams += 1
                async for report in stub.NodeWatchResources(messages.NodeWatchResourcesRequest()):
                    self._reported(instance.driver, report)
            except grpc.aio.AioRpcError as exc:
                how = exc.code().name
            finally:
                # Whatever ended the stream (a cancel included): the driver's health is forgotten.
                self.health_cache.pop(instance.driver, None)
                self.health_forgotten.append((asyncio.get_running_loop().time(), instance.driver))
            self.health_ends.append((instance.driver, instance.endpoint, how))
            if how == grpc.StatusCode.UNIMPLEMENTED.name and self.health_needs_offer:
                return
            await asyncio.sleep(self.health_reopen_s)

    def _reported(self, driver: str, report: Any) -> None:
        """updateHealthInfo: stamp, record the changes, drop what timed out unreported."""
        now = asyncio.get_running_loop().time()
        cache = self.health_cache.setdefault(driver, {})
        reported = set()
        for device in report.devices:
            key = f"{device.device.pool_name}/{device.device.device_name}"
            reported.add(key)
            timeout = float(device.health_check_timeout_seconds)
            entry = DeviceHealth(
                HEALTH_NAMES.get(device.health, "Unknown"),
                _cut(device.message),
                now,
                timeout if timeout > 0 else contracts.DRA_HEALTH_DEFAULT_TIMEOUT_S,
            )
            old = cache.get(key)
            if old is None or (old.health, old.message, old.timeout) != (entry.health, entry.message, entry.timeout):
                self.health_changes.append((now, driver, key, entry.health))
            cache[key] = entry
        for key, old in list(cache.items()):
            if key not in reported and now - old.received > old.timeout:
                if old.health != "Unknown":
                    self.health_changes.append((now, driver, key, "Unknown"))
                del cache[key]

    def health(self, driver: str, pool: str, device: str) -> tuple[str, str]:
        """getHealthInfo: (health, message) as the pod's allocatedResourcesStatus would show it."""
        entry = self.health_cache.get(driver, {}).get(f"{pool}/{device}")
        if entry is None or asyncio.get_running_loop().time() - entry.received > entry.timeout:
            return "Unknown", ""
        return entry.health, entry.message

    async def _stop_health(self, instance: Instance) -> None:
        task, instance.health_task = instance.health_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- calls ----------------------------------------------------------------------------------

    def instance(self, driver: str) -> Instance:
        """The instance a call goes to: the newest connected one, else the newest."""
        instances = self.instances.get(driver)
        if not instances:
            raise CallFailed(f"DRA driver {driver} is not registered")
        for instance in reversed(instances):
            if instance.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
                return instance
        return instances[-1]

    async def prepare(self, driver: str, claims: list[Claim]) -> dict[str, Any]:
        """NodePrepareResources for these claims; the entries by claim uid. Raises CallFailed."""
        return await self._call(driver, claims, "NodePrepareResources")

    async def unprepare(self, driver: str, claims: list[Claim]) -> dict[str, Any]:
        return await self._call(driver, claims, "NodeUnprepareResources")

    async def _call(self, driver: str, claims: list[Claim], method: str) -> dict[str, Any]:
        instance = self.instance(driver)
        if self.before_call is not None:
            await self.before_call(instance)
        if instance.closed:
            raise CallFailed(f"{method} failed: {CONNECTION_CLOSING}")
        _, messages = api.VERSIONS[instance.version]
        request = getattr(messages, f"{method}Request")(
            claims=[messages.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        try:
            response = await waits.within(getattr(instance.stub, method)(request), contracts.DRA_CALL_TIMEOUT_S)
        except asyncio.CancelledError:
            if not instance.closed:
                raise  # our own caller went away
            raise CallFailed(f"{method} failed: {CONNECTION_CLOSING}") from None
        return _entries(method, claims, response)


def _cut(message: str) -> str:
    """truncateHealthMessage: at most 1024 characters (Go counts bytes; ours are ASCII)."""
    limit = contracts.DRA_HEALTH_MESSAGE_MAX
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _entries(method: str, claims: list[Claim], response: Any) -> dict[str, Any]:
    asked = {c.uid for c in claims}
    unknown = set(response.claims) - asked
    if unknown:
        raise CallFailed(f"{method} returned result for unknown claim UID(s) {sorted(unknown)}")
    missing = asked - set(response.claims)
    if missing:
        raise CallFailed(f"{method} skipped {len(missing)} ResourceClaims: {sorted(missing)}")
    return dict(response.claims)
