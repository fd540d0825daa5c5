"""A DRA kubelet stand-in: the plugin watcher and the DRA plugin manager's side of the contract,
for tests. Runs on the caller's event loop.

As strict as the kubelet (1.34 and 1.37 behave alike here; pkg/kubelet/pluginmanager and
pkg/kubelet/cm/dra), never more forgiving:
- it watches the registry directory with inotify, as the plugin watcher does with fsnotify: a
  socket whose name does not start with "." that is created or moved in (fsnotify's Create) is
  registered, again if it was already (the desired state's new UUID makes the reconciler
  re-register it); one deleted (Remove) deregisters that (driver, endpoint); one moved away
  (Rename) changes nothing; sockets there at the start are registered;
- registering: dial the socket, GetInfo with a 1 s deadline; type must be "DRAPlugin"; an empty
  endpoint means the registration socket itself; supported_versions is walked in the plugin's
  order and the first the kubelet knows ("v1.DRAPlugin", "v1beta1.DRAPlugin") is chosen (an
  empty list, or none known, is refused); an endpoint already registered for the driver is
  refused; then NotifyRegistrationStatus (5 s) says yes, or no with the reason;
- several instances of one driver (different endpoints) are kept in registration order; a call
  goes to the newest one that is connected (its channel is READY or can become so), else the newest;
- prepare()/unprepare() send only namespace, uid and name, with a 45 s deadline, and check that
  every claim of the request has an entry and no entry is for a claim not asked about; the
  instance is picked first and called after (`before_call`, a test's hook for the moment
  between), and a deregistration closes the instance's connection at once, whatever is on it:
  such a call fails as the kubelet's does ("the client connection is closing").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

import grpc
from asyncinotify import Inotify, Mask

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.dra import api
from hyperlight_agent.dra import pluginregistration_pb2 as reg

# Versions this kubelet knows, as supported_versions names them.
KNOWN_VERSIONS = (contracts.DRA_VERSION_V1, contracts.DRA_VERSION_V1BETA1)


class RegistrationRefused(Exception):
    """The kubelet would not register the plugin (the message is what it tells the plugin)."""


# What grpc-go says of a call on a connection its ClientConn.Close() ended (ErrClientConnClosing).
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
    # Awaited with the instance picked and before the call is sent (a test's hook).
    before_call: Optional[Callable[[Instance], Awaitable[None]]] = None
    _task: Optional[asyncio.Task[None]] = None

    async def __aenter__(self) -> DraKubeletStandin:
        self._task = asyncio.ensure_future(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for instances in self.instances.values():
            for instance in instances:
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
                    await self._deregister(path)

    async def _created(self, path: str) -> None:
        """A Create event: a socket (not a dot-file) is registered, afresh if it was already."""
        try:
            st = os.lstat(path)
        except OSError:
            return
        if os.path.basename(path).startswith(".") or not stat.S_ISSOCK(st.st_mode):
            return
        await self._deregister(path)
        try:
            await self.register(path)
        except RegistrationRefused as exc:
            self.refused.append((path, str(exc)))
        except (grpc.RpcError, asyncio.TimeoutError) as exc:
            self.refused.append((path, f"dial/GetInfo failed: {exc}"))

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
        await waits.within(
            registration.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True)),
            contracts.DRA_NOTIFY_TIMEOUT_S,
        )
        await channel.close(None)
        self.instances.setdefault(instance.driver, []).append(instance)
        return instance

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
        )

    async def _deregister(self, path: str) -> None:
        for driver, instances in list(self.instances.items()):
            for instance in [i for i in instances if i.registration_socket == path]:
                instances.remove(instance)
                instance.closed = True
                await instance.channel.close(None)
            if not instances:
                del self.instances[driver]

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


def _entries(method: str, claims: list[Claim], response: Any) -> dict[str, Any]:
    asked = {c.uid for c in claims}
    unknown = set(response.claims) - asked
    if unknown:
        raise CallFailed(f"{method} returned result for unknown claim UID(s) {sorted(unknown)}")
    missing = asked - set(response.claims)
    if missing:
        raise CallFailed(f"{method} skipped {len(missing)} ResourceClaims: {sorted(missing)}")
    return dict(response.claims)
