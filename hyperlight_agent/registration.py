"""The kubelet lifecycle, kept apart from device logic: serve, register, watch, serve again.

    serve our socket → Register (bounded) ─ok→ registered ─kubelet restart→ stop, serve again
                 ↑           └─fail→ stop serving, remove our socket, back off (capped, jittered)
                 └────────────── or at once when kubelet.sock is created anew

A kubelet restart shows as our socket disappearing or kubelet.sock being replaced. Watcher
events only wake us; what happened is always decided by stat()ing both sockets, so our own
socket removals and stale events cannot cause a spurious restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import stat
from typing import Callable, Optional

import grpc

from . import api, contracts
from . import deviceplugin_pb2 as pb

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 5.0
BACKOFF_INITIAL_S = 0.5
BACKOFF_CAP_S = 30.0
# A safety net behind inotify (which can be unavailable or overflow): re-check sockets this often.
VERIFY_INTERVAL_S = 5.0
STOP_GRACE_S = 1.0


class RegistrationError(Exception):
    pass


class Backoff:
    """Capped exponential backoff with jitter: 0.5, 1, 2 … 30 s, each scaled by 0.5–1.0."""

    def __init__(self, initial: float = BACKOFF_INITIAL_S, cap: float = BACKOFF_CAP_S,
                 rand: Callable[[], float] = random.random) -> None:
        self._initial, self._cap, self._rand = initial, cap, rand
        self.attempt = 0

    def next(self) -> float:
        base: float = min(self._cap, self._initial * (2.0 ** self.attempt))
        if base < self._cap:  # past the cap the exponent stops growing (and cannot overflow)
            self.attempt += 1
        return base * (0.5 + 0.5 * float(self._rand()))

    def reset(self) -> None:
        self.attempt = 0


def _identity(path: str) -> Optional[tuple[int, int, int]]:
    """(device, inode, ctime) of a socket at path, or None if there is none.

    The inode alone is not enough: ext4 and xfs hand a deleted file's inode number to the next
    file created, so a kubelet.sock recreated at once can reuse it; its ctime still differs.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


class Registrar:
    """Keeps one plugin server (a grpc.aio server with our handlers) registered with the kubelet."""

    def __init__(self, kubelet_dir: str, socket_name: str, resource: str,
                 configure: Callable[[grpc.aio.Server], None],
                 on_change: Optional[Callable[[], None]] = None,
                 register_timeout: float = REGISTER_TIMEOUT_S,
                 backoff: Optional[Backoff] = None) -> None:
        self.kubelet_dir = kubelet_dir
        self.socket_path = os.path.join(kubelet_dir, socket_name)
        self.kubelet_socket = os.path.join(kubelet_dir, contracts.KUBELET_SOCKET)
        self._socket_name = socket_name
        self._resource = resource
        self._configure = configure  # adds our services to each new server
        self._on_change = on_change  # readiness and status are derived from our state
        self._register_timeout = register_timeout
        self._backoff = backoff or Backoff()
        self._server: Optional[grpc.aio.Server] = None
        self._served: Optional[tuple[int, int, int]] = None
        self._kubelet_seen: Optional[tuple[int, int, int]] = None
        # The kubelet.sock a failed attempt used (None: there was none). Any other one ends the
        # backoff at once, even if it appeared before the backoff began.
        self._kubelet_tried: Optional[tuple[int, int, int]] = None
        self._wake = asyncio.Event()
        self.registered = False
        self.registrations = 0
        self.kubelet_restarts = 0
        self.last_error = ""

    def wake(self) -> None:
        """Something changed in the kubelet directory (called by the watcher)."""
        self._wake.set()

    async def run(self) -> None:
        """Forever: serve and stay registered. Cancel to stop; then call stop()."""
        while True:
            self._kubelet_tried = _identity(self.kubelet_socket)
            try:
                await self._serve()
                await self._register()
            except RegistrationError as exc:
                self.last_error = str(exc)
                await self.stop(grace=0)
                delay = self._backoff.next()
                log.warning("registration failed: %s; retrying in %.1f s or when %s appears",
                            exc, delay, self.kubelet_socket)
                self._notify()
                await self._wait_for_kubelet(delay)
                continue
            self._backoff.reset()
            self.registered, self.last_error = True, ""
            self.registrations += 1
            log.info("registered %s with the kubelet (endpoint %s)", self._resource, self._socket_name)
            self._notify()
            await self._wait_for_kubelet_restart()
            self.registered = False
            self.kubelet_restarts += 1
            log.info("kubelet restart detected; serving and registering again")
            self._notify()
            await self.stop(grace=0)

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop serving and remove our socket (only if it is still the one we created)."""
        self.registered = False
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        if self._served is not None and _identity(self.socket_path) == self._served:
            try:
                os.unlink(self.socket_path)
            except OSError as exc:
                log.warning("cannot remove %s: %s", self.socket_path, exc.strerror)
        self._served = None

    async def _serve(self) -> None:
        server = grpc.aio.server()
        self._configure(server)
        try:
            # Fails while the directory does not exist yet (kubelet not installed or started).
            port = server.add_insecure_port(api.unix_target(self.socket_path))
        except RuntimeError:
            port = 0
        if port == 0:
            await server.stop(0)
            raise RegistrationError(f"cannot listen on {self.socket_path}")
        await server.start()
        self._server = server
        self._served = _identity(self.socket_path)

    async def _register(self) -> None:
        kubelet = self._kubelet_tried = _identity(self.kubelet_socket)
        if kubelet is None:
            raise RegistrationError(f"no kubelet socket at {self.kubelet_socket}")
        request = pb.RegisterRequest(
            version=contracts.KUBELET_API_VERSION,
            endpoint=self._socket_name,
            resource_name=self._resource,
            options=pb.DevicePluginOptions(pre_start_required=False,
                                           get_preferred_allocation_available=False),
        )
        try:
            async with grpc.aio.insecure_channel(api.unix_target(self.kubelet_socket)) as channel:
                await api.registration_stub(channel).Register(request, timeout=self._register_timeout)
        except grpc.aio.AioRpcError as exc:
            raise RegistrationError(
                f"Register with {self.kubelet_socket}: {exc.code().name}: {exc.details()}") from exc
        self._kubelet_seen = kubelet

    async def _wait_for_kubelet(self, delay: float) -> None:
        """Sleep `delay`, cut short as soon as a (new) kubelet.sock exists."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        while loop.time() < deadline:
            self._wake.clear()
            now = _identity(self.kubelet_socket)
            if now is not None and now != self._kubelet_tried:
                return
            try:
                await asyncio.wait_for(self._wake.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return

    async def _wait_for_kubelet_restart(self) -> None:
        while True:
            self._wake.clear()
            if _identity(self.socket_path) != self._served:
                return
            if _identity(self.kubelet_socket) not in (None, self._kubelet_seen):
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), VERIFY_INTERVAL_S)

    def _notify(self) -> None:
        if self._on_change:
            self._on_change()
