"""The kubelet lifecycle, kept apart from device logic: serve, register, stay streamed, serve again.

    serve (private name → our socket) → Register (bounded) ─ok→ registered ─stream opens→ streamed
          ↑                                  └─fail→ stop, back off (capped, jittered) or until
          │                                          a new kubelet.sock appears
          └── stop serving (streams end first), then again, when:
                - the kubelet restarted (our socket gone, or kubelet.sock replaced): at once;
                - no ListAndWatch stream opened within STREAM_OPEN_TIMEOUT_S of Register, or the
                  stream ended: after the backoff (the kubelet never dials a plugin again once its
                  stream ended, so "registered" without a stream would strand the node at 0).

Our socket is never someone else's file: the server binds a private name and renames it into
place without replacing a live socket (another agent serving the same path makes us exit), and
only the socket we put there is ever removed. grpcio unlinks whatever is at the path it binds
and again at stop; binding a private name keeps both of those off the shared path.

Watcher events only wake us; what happened is always decided by stat()ing both sockets and by
following the kubelet's own stream on this server, so stale events, streams of a server we
already replaced and other clients' streams cannot cause anything.

A socket is "the same" while its (device, inode) is: a chmod, touch, chown or a hard link added
and removed changes its ctime but not the file (kubelets.py remembers the kubelets we met).

Why: docs/decisions/registered-means-streamed.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Awaitable, Callable, NoReturn, Optional

import grpc

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.backoff import JITTER, Backoff
from hyperlight_agent.deviceplugin import api, kubelets
from hyperlight_agent.deviceplugin.plugin_server import Configure, PluginServer
from hyperlight_agent.deviceplugin.registration_state import (
    AFTER,
    Ending,
    KubeletStarting,
    Seen,
    State,
    ending,
    ending_text,
    retry_delay,
)
from hyperlight_agent.files import sockets

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 5.0
# The kubelet opens ListAndWatch right after Register returns; without one this long after, the
# registration did not take.
STREAM_OPEN_TIMEOUT_S = 3.0


class RegistrationError(Exception):
    """Register with the kubelet failed (the message names its socket and the cause)."""


class Unserved(RegistrationError):
    """Our socket left its path while Register was in flight: serve again at once."""


async def _at_once() -> None:
    """May we register? Yes (a registrar no handover holds back)."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long the registrar waits for what, and how it backs off."""

    register_timeout: float = REGISTER_TIMEOUT_S
    stream_open_timeout: float = STREAM_OPEN_TIMEOUT_S
    # Register failures; reset by a successful one.
    backoff: Backoff = dataclasses.field(default_factory=lambda: Backoff(rand=JITTER))
    # Streams lost (or never opened) after a successful Register: reset only after a stream that
    # lived STABLE_STREAM_S, so a kubelet that keeps dropping streams backs us off too. The first
    # retry is immediate: a 1.34 kubelet ends our stream when the agent we took over from ends its
    # own (handover.py), and every moment until we register again is one with no healthy device.
    loss_backoff: Backoff = dataclasses.field(default_factory=lambda: Backoff(rand=JITTER, immediate_first=True))


class Registrar:
    """Keeps one plugin server (a grpc.aio server with our handlers) registered and streamed."""

    def __init__(
        self,
        kubelet_dir: str,
        socket_name: str,
        resource: str,
        configure: Configure,
        on_change: Callable[[], None] = lambda: None,
        timing: Optional[Timing] = None,
        watched: Callable[[], bool] = lambda: False,
        may_register: Callable[[], Awaitable[None]] = _at_once,
    ) -> None:
        """configure: our services on each new server (plugin_server.Configure). on_change: our
        state changed (readiness and status are derived from it). watched(): every change of the
        two sockets wakes us now (else a timer does). may_register() returns when we may send
        Register (handover.py: not while it would take the kubelet from a ready instance of ours)."""
        self.socket_path = os.path.join(kubelet_dir, socket_name)
        self.kubelet_socket = os.path.join(kubelet_dir, contracts.KUBELET_SOCKET)
        self._kubelets = kubelets.Kubelets(self.kubelet_socket)
        self._socket_name, self._resource = socket_name, resource
        self._server = PluginServer(self.socket_path, configure, self._on_streams)
        self._on_change, self._watched, self._may_register = on_change, watched, may_register
        self._timing = timing or Timing()
        self._renew = False
        self.registering_now = False  # a Register of ours is on its way
        self._starting = KubeletStarting()
        self._wake = asyncio.Event()
        self.state: State = State.WAITING
        self.registrations = self.kubelet_restarts = self.streams_lost = 0
        self._restart_said = False  # the restart the next Register counts was logged already
        self.last_error = ""

    @property
    def registered(self) -> bool:
        return self.state in (State.REGISTERED, State.STREAMED)

    def wake(self) -> None:
        """Something changed in the kubelet directory (called by the watcher)."""
        self._wake.set()

    async def run(self) -> None:
        """Forever: serve, register, stay streamed. Cancel to stop; then call stop().

        Raises AlreadyServed when another live plugin serves our socket path.
        """
        while True:
            if await self._serve_and_register():
                await self._registration_ended(await self._watch())

    async def _serve_and_register(self) -> bool:
        """Serve and Register; False after a failure (backed off)."""
        self._kubelets.trying()
        try:
            await self._server.serve()
            await self._kubelets.settle()
            await self._may_register()
            await self._register()
        except (RegistrationError, transport.NotServing) as exc:
            self.last_error = str(exc)
            await self.stop(grace=0)
            self._set(State.WAITING)
            delay = _failure_delay(exc, self._timing.backoff, self._starting, self._kubelets)
            log.warning(
                "registration failed: %s; retrying in %.1f s or when %s appears", exc, delay, self.kubelet_socket
            )
            await self._kubelets.wait_for_new(delay, self._wake, self._watched)
            return False
        self.registrations += 1
        self._timing.backoff.reset()  # Register works; stream losses have their own backoff
        self.last_error = ""
        log.info("registered %s with the kubelet (endpoint %s)", self._resource, self._socket_name)
        self._set(State.STREAMED if self._server.stream.open else State.REGISTERED)
        return True

    async def _registration_ended(self, outcome: Ending) -> None:
        """Do what AFTER says follows `outcome` (_watch's) before serving again."""
        after = AFTER[outcome]
        if not after.backoff:
            if after.restart:
                self._after_kubelet_restart()  # (says so)
            else:
                said = after.said.format(socket=self.socket_path, resource=self._resource)
                log.log(logging.WARNING if after.warn else logging.INFO, "%s", said)
            self._set(after.state)
            await self.stop(grace=0)
            return
        if self._server.stream.stable(outcome, time.monotonic()):
            self._timing.loss_backoff.reset()
        delay = self._timing.loss_backoff.next()
        self.last_error = ending_text(outcome, self._timing.stream_open_timeout)
        log.warning("%s", after.said.format(why=self.last_error, delay=delay))  # the cause, then the status
        self._set(after.state)
        await self.stop(grace=0)
        if await self._kubelets.wait_for_new(delay, self._wake, self._watched):
            self._after_kubelet_restart()  # a new kubelet.sock: that is why the stream ended
        else:
            self.streams_lost += 1

    def renew(self) -> None:
        """End the kubelet's stream and register again now (after a failed handover, whose
        successor may have taken the kubelet's endpoint for our resource: handover.py)."""
        self._renew = True
        self._wake.set()

    def _after_kubelet_restart(self) -> None:
        """A new kubelet owes us nothing from the old one's losses: no backoff before we register."""
        self._timing.loss_backoff.reset()
        self._restart_said = True  # (_send_register counts it once the Register is through)
        log.info("%s", AFTER[Ending.RESTART].said)

    @property
    def current_streams(self) -> int:
        """Open ListAndWatch streams on the current server, anyone's."""
        return self._server.current_streams

    def end_streams(self) -> None:
        """End the current server's ListAndWatch streams now (the first step of a shutdown)."""
        self._server.end_streams()

    async def stop(self, grace: float = transport.STOP_GRACE_S) -> None:
        """Stop serving (plugin_server.PluginServer.stop)."""
        if self._server.stream.open:
            self._kubelets.stream_ended()
        await self._server.stop(grace)

    def _set(self, state: State) -> None:
        self.state = state
        self._on_change()

    def _on_streams(self, kubelets: int) -> None:
        """Our server's streams changed: +1 the kubelet's opened, -1 it ended, 0 another's."""
        if kubelets > 0 and self.state == State.REGISTERED:
            self._set(State.STREAMED)
        elif kubelets < 0 and self.state is State.STREAMED:
            # Said as what it is at once (_watch acts on it next): not as "registered; waiting
            # for the kubelet's stream", as if the first had yet to open.
            self.state = State.LOST
            self.last_error = ending_text(Ending.LOST, self._timing.stream_open_timeout)
        self._wake.set()
        self._on_change()

    async def _register(self) -> None:
        # Set before any await: the side's "we may register" and this Register are one step, so an
        # in-place upgrade never agrees to its child's Register with ours on its way (agent.py).
        self.registering_now = True
        try:
            await self._send_register()
        finally:
            self.registering_now = False

    async def _send_register(self) -> None:
        kubelet = self._kubelets.trying()
        if kubelet is None:
            raise RegistrationError(sockets.not_a_socket(self.kubelet_socket, "kubelet"))
        self._server.stream.sent()
        self._renew = False  # a Register from now on is what renew() asked for
        # Given up once our socket is no longer at its path: the kubelet dials back to it inside
        # Register, and a kubelet starting removes every socket in its directory, ours too.
        unserved = waits.condition(lambda: not self._server.ours(), self._wake)
        error = await api.register(
            self.kubelet_socket, self._socket_name, self._resource, self._timing.register_timeout, unserved
        )
        if error is not None:
            _raise_for(error, self.kubelet_socket, self.socket_path)
        if self._kubelets.registered(kubelet):
            # Counted here, where it is certain: a restart first seen as a lost stream (the
            # kubelet stopping ends it before its new socket exists) is registered anew at once.
            self.kubelet_restarts += 1
            if not self._restart_said:
                log.info("kubelet restart detected: %s is a new socket", self.kubelet_socket)
        self._restart_said = False

    async def _watch(self) -> Ending:
        """Until the registration ends (registration_state.ending); how it did."""
        loop = asyncio.get_running_loop()
        no_stream_by = loop.time() + self._timing.stream_open_timeout
        while True:
            self._wake.clear()
            due = no_stream_by - loop.time() if self.state == State.REGISTERED else None
            ours = self._server.ours()
            seen = Seen(
                ours=ours,
                path_taken=not ours and os.path.lexists(self.socket_path),
                kubelet=self._kubelets.now(),
                registered_with=self._kubelets.registered_with,
                stream_ended=self._server.stream.ended,
                renew=self._renew,
                stream_due_in=due,
            )
            outcome = ending(seen)
            if outcome is not None:
                if outcome is Ending.RENEW:
                    self._renew = False
                return outcome
            unwatched = kubelets.VERIFY_INTERVAL_S
            await waits.event(self._wake, due if due is not None else None if self._watched() else unwatched)


def _failure_delay(exc: Exception, backoff: Backoff, starting: KubeletStarting, met: kubelets.Kubelets) -> float:
    """How long after a failed Register before the next: at once when our socket was removed
    under it, else the backoff's next delay, cut short for a kubelet still starting that did not
    answer yet (a kubelet that refuses us is backed off)."""
    unanswered = isinstance(exc.__cause__, grpc.aio.AioRpcError) and exc.__cause__.code() == grpc.StatusCode.UNAVAILABLE
    delay = 0.0 if isinstance(exc, Unserved) else backoff.next()
    still_starting = unanswered and starting.starting(met.now(), met.registered_with, time.monotonic())
    return retry_delay(delay, unanswered, still_starting)


def _raise_for(error: BaseException, kubelet_socket: str, socket_path: str) -> NoReturn:
    """A failed Register (api.register's answer) as the error that says it."""
    if isinstance(error, asyncio.CancelledError):
        raise Unserved(f"Register with {kubelet_socket}: {socket_path} was removed meanwhile (a kubelet starting?)")
    if isinstance(error, grpc.aio.AioRpcError):
        raise RegistrationError(f"Register with {kubelet_socket}: {error.code().name}: {error.details()}") from error
    raise error
