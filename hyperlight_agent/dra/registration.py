"""One agent instance's DRA servers and its registration with the kubelet's plugin watcher.

    Registrar(service, driver, instance, registry_dir, plugins_dir)
    start(): serve DRAPlugin (v1, v1beta1) at <plugins_dir>/<driver>/dra-<instance>.sock,
             then Registration at <registry_dir>/<driver>-<instance>-reg.sock
             (the kubelet dials the service as soon as the registration socket appears)
    kubelet: GetInfo → {type DRAPlugin, name driver, endpoint the service socket,
             supported_versions [v1.DRAPlugin, v1beta1.DRAPlugin]} → NotifyRegistrationStatus
    close(): remove the registration socket (the kubelet deregisters this instance only), stop
             both servers (calls in flight get STOP_GRACE_S), remove the service socket;
             a socket is removed only while it is still the one we put there.

    e.g. driver hyperlight.dev, instance web-1:
      /var/lib/kubelet/plugins_registry/hyperlight.dev-web-1-reg.sock
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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import secrets
from typing import Any, Callable, Optional

import grpc

from hyperlight_agent import contracts, wire
from hyperlight_agent.dra import api
from hyperlight_agent.dra import pluginregistration_pb2 as reg
from hyperlight_agent.node import sockets

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
# After our registration socket goes, the kubelet deregisters us only when its plugin manager's
# reconciler (a 1 s loop) sees it; until then it may still route a claim to us, which must be
# answered rather than refused with "Server shutdown" (seen on the e2e cluster's 1.34 kubelet).
DEREGISTER_GRACE_S = 1.5
PRIVATE_PREFIX = ".hl-dra."  # .hl-dra.<pid>.<8 hex>: the plugin watcher ignores dot-files
_PRIVATE_NAME = re.compile(re.escape(PRIVATE_PREFIX) + r"[0-9]+\.[0-9a-f]{8}")
# An instance used verbatim in a file name; anything else is hashed.
_PLAIN_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class RegistrationError(Exception):
    """We cannot serve at our socket path (the message names it and says why)."""


def _digest(*parts: str, chars: int) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:chars]


def _fits(path: str) -> bool:
    return len(os.fsencode(path)) <= contracts.UNIX_PATH_MAX


def _first_fitting(directory: str, names: list[str]) -> str:
    for name in names:
        path = os.path.join(directory, name)
        if _fits(path):
            return path
    raise RegistrationError(f"{directory}: too long for a unix socket path even with the name {names[-1]}")


def registration_socket(registry_dir: str, driver: str, instance: str) -> str:
    """<registry_dir>/<driver>-<instance>-reg.sock, or a shorter hashed name where that is too long.

    >>> registration_socket("/var/lib/kubelet/plugins_registry", "hyperlight.dev", "web-1")
    '/var/lib/kubelet/plugins_registry/hyperlight.dev-web-1-reg.sock'
    """
    names = [f"{driver}-{_digest(instance, chars=12)}-reg.sock", f"dra-{_digest(driver, instance, chars=24)}-reg.sock"]
    if _PLAIN_INSTANCE.fullmatch(instance):
        names.insert(0, f"{driver}-{instance}-reg.sock")
    return _first_fitting(registry_dir, names)


def service_socket(plugins_dir: str, driver: str, instance: str) -> str:
    """<plugins_dir>/<driver>/dra-<instance>.sock, or a shorter hashed name where that is too long.

    >>> service_socket("/var/lib/kubelet/plugins", "hyperlight.dev", "web-1")
    '/var/lib/kubelet/plugins/hyperlight.dev/dra-web-1.sock'
    """
    names = [f"dra-{_digest(instance, chars=16)}.sock"]
    if _PLAIN_INSTANCE.fullmatch(instance):
        names.insert(0, f"dra-{instance}.sock")
    return _first_fitting(os.path.join(plugins_dir, driver), names)


class _Served:
    """One running server and the socket we put in place for it."""

    def __init__(self, server: grpc.aio.Server, path: str, pin: sockets.Pin) -> None:
        self.server, self.path, self.pin = server, path, pin

    def remove_socket(self) -> None:
        """Unlink our socket if it is still ours; a file someone put there instead stays."""
        sockets.remove_ours(self.pin, self.path)


class Registrar:
    """Owns both gRPC servers of one agent instance: start() → (kubelet registers us) → close()."""

    def __init__(self, service: object, driver: str = contracts.DRA_DRIVER, instance: str = "",
                 registry_dir: str = contracts.DRA_REGISTRY_DIR, plugins_dir: str = contracts.DRA_PLUGINS_DIR,
                 on_change: Optional[Callable[[], None]] = None, stop_grace: float = STOP_GRACE_S,
                 deregister_grace: float = DEREGISTER_GRACE_S,
                 configure: Optional[Callable[[grpc.aio.Server], None]] = None) -> None:
        if not instance:
            raise ValueError("a DRA plugin instance needs a name unique on the node (the pod name or uid)")
        self.driver = driver
        self.instance = instance
        self.registration_socket = registration_socket(registry_dir, driver, instance)
        self.service_socket = service_socket(plugins_dir, driver, instance)
        self._service = service  # answers NodePrepareResources / NodeUnprepareResources (service.Service)
        self._on_change = on_change
        self._stop_grace = stop_grace
        self._deregister_grace = deregister_grace
        # Adds more services to the DRA socket's server (the agent's gRPC health service, which the
        # exec probes ask there).
        self._configure = configure
        self._dra: Optional[_Served] = None
        self._registration: Optional[_Served] = None
        self.registered = False
        self.error = ""  # the kubelet's reason for refusing us, or why we could not serve
        self.notifications = 0  # NotifyRegistrationStatus calls received

    @property
    def serving(self) -> bool:
        return self._registration is not None

    async def start(self) -> None:
        """Serve the DRA service, then the registration socket. Raises RegistrationError; nothing
        of ours is left behind then."""
        try:
            os.makedirs(os.path.dirname(self.service_socket), mode=0o750, exist_ok=True)
            self._dra = await self._serve(self.service_socket, api.dra_handlers(self._service), self._configure)
            self._registration = await self._serve(self.registration_socket, [api.registration_handler(self)])
        except RegistrationError as exc:
            self._set(False, str(exc))
            await self.close()
            raise
        except OSError as exc:
            self._set(False, f"cannot create {os.path.dirname(self.service_socket)}: {exc.strerror}")
            await self.close()
            raise RegistrationError(self.error) from exc
        log.info("DRA driver %s serving %s, registering at %s", self.driver, self.service_socket,
                 self.registration_socket)

    async def close(self) -> None:
        """Deregister (our registration socket goes first), then stop serving. Idempotent."""
        registration, self._registration = self._registration, None
        dra, self._dra = self._dra, None
        if registration is not None:
            registration.remove_socket()
            await registration.server.stop(0)
            if dra is not None and self._deregister_grace > 0:
                await asyncio.sleep(self._deregister_grace)  # still serving claims meanwhile
        if dra is not None:
            await dra.server.stop(self._stop_grace)
            dra.remove_socket()
        if self.registered:
            self._set(False, "")

    # --- the Registration service ---------------------------------------------------------------

    async def GetInfo(self, request: reg.InfoRequest, context: grpc.aio.ServicerContext[Any, Any]) -> reg.PluginInfo:
        return reg.PluginInfo(type=contracts.DRA_PLUGIN_TYPE, name=self.driver, endpoint=self.service_socket,
                              supported_versions=list(contracts.DRA_SUPPORTED_VERSIONS))

    async def NotifyRegistrationStatus(self, request: reg.RegistrationStatus,
                                       context: grpc.aio.ServicerContext[Any, Any]) -> reg.RegistrationStatusResponse:
        self.notifications += 1
        if request.plugin_registered:
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
        if changed and self._on_change:
            self._on_change()

    async def _serve(self, path: str, handlers: list[grpc.GenericRpcHandler[Any, Any]],
                     configure: Optional[Callable[[grpc.aio.Server], None]] = None) -> _Served:
        directory = os.path.dirname(path)
        sockets.sweep(directory, _PRIVATE_NAME)
        private = os.path.join(directory, f"{PRIVATE_PREFIX}{os.getpid()}.{secrets.token_hex(4)}")
        if not _fits(private):
            raise RegistrationError(f"{directory}: too long for a unix socket path")
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(handlers)
        if configure is not None:
            configure(server)
        problem = await wire.listen(server, private)
        if problem:
            raise RegistrationError(f"cannot listen in {directory}: {problem}")
        await server.start()
        try:
            pin = sockets.put_in_place(private, path)
        except BaseException as exc:
            await server.stop(0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(private)
            if isinstance(exc, sockets.NotPlaced):
                raise RegistrationError(str(exc)) from None
            raise
        return _Served(server, path, pin)
