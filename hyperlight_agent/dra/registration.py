"""One agent instance's DRA servers and its registration with the kubelet's plugin watcher.

    DriverServers(service, driver, instance, registry_dir, plugins_dir)
    start(): serve DRAPlugin (v1, v1beta1), and DRAResourceHealth (v1, v1alpha1) when given a
             health service, at <plugins_dir>/<driver>/dra-<instance>.sock,
             then Registration at <registry_dir>/<driver>-<instance>-reg.sock
             (the kubelet dials the service as soon as the registration socket appears)
    run():   start() if need be, then keep both sockets ours: one removed or replaced (a cleanup
             tool, an administrator) is served anew at once, and the kubelet registers us again;
             meanwhile we are not registered (readiness is off)
    kubelet: GetInfo → {type DRAPlugin, name driver, endpoint the service socket,
             supported_versions [v1.DRAPlugin, v1beta1.DRAPlugin (, v1.DRAResourceHealth,
             v1alpha1.DRAResourceHealth)]} → NotifyRegistrationStatus
    close(): remove the registration socket (the kubelet deregisters this instance only), stop
             both servers (calls in flight get transport.STOP_GRACE_S), remove the service socket;
             a socket is removed only while it is still the one we put there.

    e.g. driver hypervisor.hyperlight.dev, instance web-1:
      /var/lib/kubelet/plugins_registry/hypervisor.hyperlight.dev-web-1-reg.sock
      /var/lib/kubelet/plugins/hyperlight.dev/dra-web-1.sock

Both names carry the instance (a pod name or uid) so that a rolling update's new agent registers
beside the old one: the kubelet keeps several instances of a driver when their endpoints differ,
and calls the newest connected one. A name whose path would not fit a unix socket address
(contracts.UNIX_PATH_MAX) is replaced by a shorter one made from a hash of the instance, the same
on every start.

Each server binds a private name in the socket's directory and renames it into place without
replacing anything: a stale socket (no one listening: our own instance's earlier run) is swapped
out, anything else (a live socket, a file, a directory) makes start() fail and is left alone.

State for readiness and status: `registered` (the kubelet's last NotifyRegistrationStatus said
so) and `error` (why it did not, or why serving failed); on_change() is called when they change.

Why: docs/decisions/dra-registration-settles.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

import grpc

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.dra import api, names
from hyperlight_agent.dra import pluginregistration_pb2 as reg
from hyperlight_agent.text import cause

if TYPE_CHECKING:
    from hyperlight_agent.dra.health import Health, HealthEndpoint

log = logging.getLogger(__name__)

# A safety net for when our sockets' directories are not watched (inotify unavailable, a directory
# missing): look at the sockets this often. While they are watched, events wake us at once.
VERIFY_INTERVAL_S = 5.0
# After our registration socket goes, the kubelet deregisters us only when its plugin manager's
# reconciler (a 1 s loop) sees it; until then it may still route a claim to us, which must be
# answered rather than refused with "Server shutdown" (seen on the e2e cluster's 1.34 kubelet).
DEREGISTER_GRACE_S = 1.5
# As it deregisters us the kubelet closes its connection, which cancels the calls it still has
# with us ("grpc: the client connection is closing": a pod's Prepare failed so on the 1.34 kubelet
# when a rolling update's successor registered while that Prepare ran). So before our registration
# socket goes, the calls in flight get this long to end; the kubelet sends new ones to the newest
# instance, so during a handover none follow. Far below the kubelet's 45 s per call.
CALLS_DRAIN_S = 5.0
# The kubelet (1.36 on: operation_generator.go) takes a registration back when its
# NotifyRegistrationStatus fails, and it fails on the kubelet's deadline (contracts.DRA_NOTIFY_TIMEOUT_S)
# even when we have answered, if our answer reached it too late (a starved node). It then registers
# us again: its backoff (contracts.DRA_REGISTER_RETRY_INITIAL_S) and the reconciler's next look
# (contracts.DRA_RECONCILE_S) later, with GetInfo first, telling us again. So until this long
# after the kubelet's last word, our registration may still be taken back without our knowing: a
# predecessor handing over to us then would leave the kubelet with no instance of the driver
# ("DRA driver ... is not registered").
REGISTRATION_SETTLE_S = (
    contracts.DRA_NOTIFY_TIMEOUT_S
    + contracts.DRA_REGISTER_RETRY_INITIAL_S
    + contracts.DRA_RECONCILE_S
    + contracts.DRA_GET_INFO_TIMEOUT_S
)


@dataclass(frozen=True)
class Graces:
    """How long a stop waits: for the calls in flight before our registration socket goes, for the
    kubelet's deregistration after it, and for the service's calls as it stops. Each default is its
    constant as it is when a Graces is made, not when this module was imported (tests shorten them)."""

    calls_drain_s: float = field(default_factory=lambda: CALLS_DRAIN_S)
    deregister_s: float = field(default_factory=lambda: DEREGISTER_GRACE_S)
    stop_s: float = field(default_factory=lambda: transport.STOP_GRACE_S)


@dataclass(frozen=True)
class Hooks:
    """What the agent's DRA side tells the servers and asks of them."""

    on_change: Callable[[], None] = lambda: None  # `registered` or `error` may have changed
    # More services on the DRA socket's server (the gRPC health service).
    configure: Optional[Callable[[grpc.aio.Server], None]] = None
    # Whether both sockets' directories are watched: their changes wake() us, no timer.
    watched: Callable[[], bool] = lambda: False
    # Awaited between serving the DRA service and the registration socket (the side's succession
    # holds a registration that would take the kubelet's calls from a ready instance of ours).
    may_register: Optional[Callable[[], Awaitable[None]]] = None


class DriverServers:
    """Owns both gRPC servers of one agent instance: start() → (kubelet registers us) → close()."""

    def __init__(
        self,
        service: object,
        driver: str = contracts.DRA_DRIVER,
        instance: str = "",
        registry_dir: str = contracts.DRA_REGISTRY_DIR,
        plugins_dir: str = contracts.DRA_PLUGINS_DIR,
        hooks: Hooks = Hooks(),
        graces: Optional[Graces] = None,
        health: Optional[Health] = None,
    ) -> None:
        if not instance:
            raise ValueError("a DRA plugin instance needs a name unique on the node (the pod name or uid)")
        self.driver, self.instance = driver, instance
        self.registration_socket = names.registration_socket(registry_dir, driver, instance)
        self.service_socket = names.service_socket(plugins_dir, driver, instance)
        self._service = service  # answers NodePrepareResources / NodeUnprepareResources (service.Service)
        self._hooks, self.graces = hooks, graces or Graces()
        self._health = health  # the resource-health service beside DRAPlugin, named in GetInfo (None: neither)
        self._dra: Optional[transport.Serving] = None
        self._health_endpoint: Optional[HealthEndpoint] = None  # the current DRA server's
        self._registration: Optional[transport.Serving] = None
        self.registered = False
        self.error = ""  # the kubelet's reason for refusing us, or why we could not serve
        self.notifications = 0  # NotifyRegistrationStatus calls received
        self._registered_at = 0.0  # the loop's time of the kubelet's last "registered"
        self.served_again = 0  # sockets of ours put back after someone removed or replaced them
        self._wake = asyncio.Event()

    def settling(self) -> bool:
        """Registered, but too recently for the kubelet to be done with it (REGISTRATION_SETTLE_S)."""
        elapsed = asyncio.get_running_loop().time() - self._registered_at
        return self.registered and elapsed < REGISTRATION_SETTLE_S

    @property
    def serving(self) -> bool:
        return self._registration is not None

    async def start(self) -> None:
        """Serve the DRA service, then the registration socket. Raises transport.NotServing; nothing
        of ours is left behind then (nor when a stop cancels us half-way)."""
        try:
            driver_dir(os.path.dirname(self.service_socket))
            self._dra = await self._serve_dra(self.service_socket)
            if self._hooks.may_register is not None:
                await self._hooks.may_register()
            self._registration = await serve_at(
                self.registration_socket, [api.registration_handler(self)], "dra_registry_dir"
            )
        except transport.NotServing as exc:
            self._set(False, str(exc))
            await self.close()
            raise
        except BaseException:
            await self.close()
            raise
        log.info(
            "DRA driver %s serving %s, registering at %s", self.driver, self.service_socket, self.registration_socket
        )

    def wake(self) -> None:
        """One of our sockets' directories changed: look at our sockets."""
        self._wake.set()

    async def run(self) -> None:
        """start() if not serving, then keep both sockets ours until cancelled. Raises
        transport.NotServing when one cannot be served again (the caller retries with backoff)."""
        if not self.serving:
            await self.start()
        while True:
            self._wake.clear()
            await self.keep()
            await waits.event(self._wake, None if self._hooks.watched() else VERIFY_INTERVAL_S)

    async def keep(self) -> None:
        """Serve anew whichever of our sockets is no longer ours at its path."""
        registration, dra = self._registration, self._dra
        if dra is not None and not dra.pin.is_at(dra.path):
            log.warning("our DRA service socket %s was removed or replaced; serving it again", dra.path)
            old_health = self._health_endpoint
            self._dra = await self._serve_dra(dra.path)
            if old_health is not None:
                old_health.close()  # the kubelet opens its stream again on the new server
            await dra.stop(self.graces.stop_s)  # calls in flight finish on the old server
            self.served_again += 1  # (once the old server is gone: the kubelet's next call dials anew)
        if registration is not None and not registration.pin.is_at(registration.path):
            # The kubelet has deregistered us (or will in a moment): not registered until it says so.
            log.warning(
                "our registration socket %s was removed or replaced; serving it again for the kubelet to register us",
                registration.path,
            )
            self._set(False, "our registration socket was removed; registering again")
            await registration.stop(0)
            self._registration = await serve_at(registration.path, [api.registration_handler(self)], "dra_registry_dir")
            self.served_again += 1

    async def close(self) -> None:
        """Deregister (our registration socket goes first, once the calls in flight ended or
        CALLS_DRAIN_S passed), then stop serving. Idempotent."""
        registration, self._registration = self._registration, None
        dra, self._dra = self._dra, None
        try:
            if registration is not None:
                idle = getattr(self._service, "idle", None)
                if idle is not None and dra is not None:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await waits.within(idle(), self.graces.calls_drain_s)
                await registration.stop(0)
                if dra is not None and self.graces.deregister_s > 0:
                    await asyncio.sleep(self.graces.deregister_s)  # still serving claims meanwhile
        finally:
            # Also when a stop cancels this close (a start cut short): our sockets must not stay.
            if self._health_endpoint is not None:
                self._health_endpoint.close()  # a stream would hold the stop for its whole grace
                self._health_endpoint = None
            if dra is not None:
                await dra.stop(self.graces.stop_s)
            if self.registered:
                self._set(False, "")

    # --- the Registration service ---------------------------------------------------------------

    async def GetInfo(self, request: reg.InfoRequest, context: grpc.aio.ServicerContext[Any, Any]) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=contracts.DRA_PLUGIN_TYPE,
            name=self.driver,
            endpoint=self.service_socket,
            supported_versions=list(self.supported_versions),
        )

    @property
    def supported_versions(self) -> tuple[str, ...]:
        """What GetInfo offers: DRAPlugin's versions, and the health service's when we serve it."""
        health = contracts.DRA_HEALTH_SERVICES if self._health is not None else ()
        return contracts.DRA_SUPPORTED_VERSIONS + health

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.aio.ServicerContext[Any, Any]
    ) -> reg.RegistrationStatusResponse:
        self.notifications += 1
        if request.plugin_registered:
            self._registered_at = asyncio.get_running_loop().time()
            if not self.registered:
                log.info("the kubelet registered DRA driver %s at %s", self.driver, self.service_socket)
            self._set(True, "")
        else:
            error = request.error.splitlines()[0] if request.error else "no reason given"
            log.error("the kubelet refused DRA driver %s (%s): %s", self.driver, self.registration_socket, error)
            self._set(False, error)
        return reg.RegistrationStatusResponse()

    # --- helpers --------------------------------------------------------------------------------

    def _set(self, registered: bool, error: str) -> None:
        changed = (registered, error) != (self.registered, self.error)
        self.registered, self.error = registered, error
        if changed:
            self._hooks.on_change()

    async def _serve_dra(self, path: str) -> transport.Serving:
        """The DRA service socket's server: DRAPlugin, the health service, and what `configure` adds."""
        handlers = api.dra_handlers(self._service)
        endpoint = None
        if self._health is not None:
            endpoint = self._health.endpoint()
            handlers += api.health_handlers(endpoint)
        serving = await serve_at(path, handlers, "dra_plugins_dir", self._hooks.configure)
        self._health_endpoint = endpoint
        return serving


async def serve_at(
    path: str,
    handlers: list[grpc.GenericRpcHandler[Any, Any]],
    setting: str,
    configure: Optional[Callable[[grpc.aio.Server], None]] = None,
) -> transport.Serving:
    """A server of `handlers` (and what `configure` adds) at `path`, from the directory `setting` names."""

    def add(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers(handlers)
        if configure is not None:
            configure(server)

    return await transport.serve_in_place(path, add, names.PRIVATE_PREFIX, setting)


def driver_dir(directory: str) -> None:
    """Make our directory below the plugins directory (<plugins_dir>/<driver>), or refuse what is
    there instead: a symlink is never followed (our sockets and record would land wherever it
    points), as for cdi_dir. Raises transport.NotServing naming the path."""
    try:
        os.makedirs(directory, 0o750, exist_ok=True)
    except FileExistsError:
        pass  # not a directory (a dangling symlink, a file): said below
    except OSError as exc:
        raise transport.NotServing(f"cannot create {directory}: {cause(exc)}") from exc
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise transport.NotServing(f"cannot look at {directory}: {cause(exc)}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise transport.NotServing(
            f"{directory} is a symlink; refusing to follow it "
            f"(dra_plugins_dir/{os.path.basename(directory)} must be a directory)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise transport.NotServing(f"{directory} is not a directory; refusing to replace it")
