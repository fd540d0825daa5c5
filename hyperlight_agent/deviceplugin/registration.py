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
and removed changes its ctime but not the file. We hold every socket we remember open (O_PATH,
see Pin), so its inode cannot be freed and its number handed to a new file meanwhile.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import stat
import time
from typing import Awaitable, Callable, Optional

import grpc

from hyperlight_agent import contracts, transport, waits
from hyperlight_agent.backoff import JITTER, Backoff
from hyperlight_agent.deviceplugin import api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.files import sockets
from hyperlight_agent.files.sockets import Identity, Pin
from hyperlight_agent.text import cause

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 5.0
# The kubelet opens ListAndWatch right after Register returns; without one this long after, the
# registration did not take.
STREAM_OPEN_TIMEOUT_S = 3.0
# A stream that lived this long was a healthy registration: the backoff starts over after it.
STABLE_STREAM_S = 30.0
# After ending a stream the kubelet still had open, before registering again with that same kubelet:
# it handles the end asynchronously, and in 1.28 an old stream ending after a new Register
# disconnects the new one (kubernetes issue 121994); later releases mark the resource unhealthy
# instead. A kubelet that restarted meanwhile never knew that stream: no wait then.
STREAM_SETTLE_S = 0.1
# A safety net for when the kubelet directory is not watched (inotify unavailable, the directory
# missing or its watch refused): re-check the sockets this often. While it is watched, events wake
# us instead (an overflow or the watch's loss too), and no timer runs.
VERIFY_INTERVAL_S = 5.0
# A new kubelet.sock that does not answer yet: retry this often, for this long, before backing off.
KUBELET_STARTING_RETRY_S = 0.05
KUBELET_STARTING_S = 10.0


class RegistrationError(Exception):
    """Register with the kubelet failed (the message names its socket and the cause)."""


class Unserved(RegistrationError):
    """Our socket left its path while Register was in flight: serve again at once."""


class AlreadyServed(Exception):
    """A live plugin (another agent) serves our socket path: we never take it over."""


def _no_kubelet(path: str) -> str:
    """Why there is no kubelet socket to register with at path."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return f"no kubelet socket at {path}"
    except OSError as exc:
        return f"cannot look at {path}: {cause(exc)}"
    kind = (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a symlink"
        if stat.S_ISLNK(mode)
        else "a regular file"
        if stat.S_ISREG(mode)
        else "not a socket"
    )
    return f"{path} is {kind}, not the kubelet's socket"


# What the registrar is doing, for status lines and readiness.
class State(str, enum.Enum):
    """Where the registration stands (a str: status lines and metrics show its value)."""

    WAITING = "waiting"  # for a kubelet (serving or registering failed; backing off)
    REGISTERED = "registered"  # Register succeeded; no stream yet
    STREAMED = "streamed"  # the kubelet's ListAndWatch stream is open
    LOST = "lost"  # the stream ended, or never opened: serving and registering again


class Ending(enum.Enum):
    """How a registration ended (Registrar._watch), and so what comes before serving again."""

    RESTART = "restart"  # the kubelet restarted, or our socket is gone: at once
    REPLACED = "replaced"  # another socket is at our path: serve again (a stale one is swapped out)
    LOST = "lost"  # the kubelet's stream ended: after the loss backoff
    NO_STREAM = "no-stream"  # no stream opened in time after Register: likewise
    RENEW = "renew"  # asked to (renew()): end our stream and register again, with no backoff


class Registrar:
    """Keeps one plugin server (a grpc.aio server with our handlers) registered and streamed."""

    def __init__(
        self,
        kubelet_dir: str,
        socket_name: str,
        resource: str,
        configure: Callable[[grpc.aio.Server, Callable[[int, object], None]], Callable[[], None]],
        on_change: Optional[Callable[[], None]] = None,
        register_timeout: float = REGISTER_TIMEOUT_S,
        backoff: Optional[Backoff] = None,
        stream_open_timeout: float = STREAM_OPEN_TIMEOUT_S,
        loss_backoff: Optional[Backoff] = None,
        watched: Callable[[], bool] = lambda: False,
        may_register: Optional[Callable[[], Awaitable[None]]] = None,
    ) -> None:
        self.kubelet_dir = kubelet_dir
        self.socket_path = os.path.join(kubelet_dir, socket_name)
        self.kubelet_socket = os.path.join(kubelet_dir, contracts.KUBELET_SOCKET)
        self._socket_name = socket_name
        self._resource = resource
        # configure(server, on_stream) adds our services to a new server; on_stream(+1/-1, stream)
        # must be called as that server's ListAndWatch streams open and end, `stream` being any
        # object that stands for the one stream. It returns a function that ends those streams
        # (called when the server stops).
        self._configure = configure
        self._on_change = on_change  # readiness and status are derived from our state
        # Whether kubelet_dir is watched now: then every change of the two sockets calls wake(),
        # and so do an inotify overflow and the watch's loss; otherwise we re-check on a timer.
        self._watched = watched
        self._register_timeout = register_timeout
        # Awaited between serving and each Register: returns when we may register (the side holds
        # a Register that would take the kubelet from a ready instance of ours, handover.py).
        self._may_register = may_register
        self._renew = False
        self.registering_now = False  # a Register of ours is on its way
        self._stream_open_timeout = stream_open_timeout
        self._backoff = backoff or Backoff(rand=JITTER)  # Register failures; reset by a successful one
        # Streams lost (or never opened) after a successful Register: reset only after a stream
        # that lived STABLE_STREAM_S, so a kubelet that keeps dropping streams backs us off too.
        # The first retry is immediate: a 1.34 kubelet ends our stream when the agent we took over
        # from ends its own (handover.py), and every moment until we register again is a moment
        # with no healthy device.
        self._loss_backoff = loss_backoff or Backoff(rand=JITTER, immediate_first=True)
        self._serving: Optional[transport.Serving] = None
        self._end_streams: Callable[[], None] = lambda: None
        self._kubelet_seen: Optional[Pin] = None
        self._starting: Optional[tuple[Identity, float]] = None  # a new kubelet.sock, first failed at
        # The kubelet.sock a failed attempt used (None: there was none). Any other one ends the
        # backoff at once, even if it appeared before the backoff began.
        self._kubelet_tried: Optional[Pin] = None
        self._wake = asyncio.Event()
        self._generation = 0  # of the current server; streams of older ones are ignored
        self.current_streams = 0  # open ListAndWatch streams on the current server, anyone's
        # The kubelet's stream: the first to open on this server after our Register was sent
        # (the kubelet dials back inside Register and opens ListAndWatch right after). Other
        # clients' streams (a monitoring sidecar, an operator's grpcurl) never stand in for it.
        self._register_sent = False
        self._kubelet_stream: Optional[object] = None
        self._kubelet_stream_open = False
        self._stream_since = 0.0
        # The kubelet our last Register went to, when stop() ended its stream (None: none ended).
        # Pinned: a restarted kubelet's new socket may get the old one's inode number.
        self._stream_ended_with: Optional[Pin] = None
        self.state: State = State.WAITING
        self.registrations = 0
        self.kubelet_restarts = 0
        self._restart_said = False  # the restart the next Register counts was logged already
        self.streams_lost = 0
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
        self._pin("_kubelet_tried", Pin.take(self.kubelet_socket))
        try:
            await self._serve()
            ended = self._stream_ended_with
            if ended is not None:
                same_kubelet = ended.is_at(self.kubelet_socket)
                self._pin("_stream_ended_with", None)
                if same_kubelet:
                    await asyncio.sleep(STREAM_SETTLE_S)
            if self._may_register is not None:
                await self._may_register()
            await self._register()
        except (RegistrationError, transport.NotServing) as exc:
            self.last_error = str(exc)
            await self.stop(grace=0)
            self._set(State.WAITING)
            delay = 0.0 if isinstance(exc, Unserved) else self._backoff.next()
            unanswered = (
                isinstance(exc.__cause__, grpc.aio.AioRpcError) and exc.__cause__.code() == grpc.StatusCode.UNAVAILABLE
            )
            if unanswered and self._kubelet_starting():  # a kubelet that refuses us is backed off
                delay = min(delay, KUBELET_STARTING_RETRY_S)
            log.warning(
                "registration failed: %s; retrying in %.1f s or when %s appears", exc, delay, self.kubelet_socket
            )
            await self._wait_for_kubelet(delay)
            return False
        self.registrations += 1
        self._backoff.reset()  # Register works; stream losses have their own backoff
        self.last_error = ""
        log.info("registered %s with the kubelet (endpoint %s)", self._resource, self._socket_name)
        self._set(State.STREAMED if self._kubelet_stream_open else State.REGISTERED)
        return True

    async def _registration_ended(self, outcome: Ending) -> None:
        """Act on how a registration ended (_watch's outcome) before serving again."""
        if outcome is Ending.REPLACED:
            # Not a kubelet restart: serving again either swaps out a stale socket or finds the
            # live one of another agent (and then we exit, never taking it over).
            log.warning("%s is no longer our socket: another one was put there; serving again", self.socket_path)
            self._set(State.WAITING)
            await self.stop(grace=0)
            return
        if outcome is Ending.RENEW:
            log.info("registering %s with the kubelet again", self._resource)
            self._set(State.WAITING)
            await self.stop(grace=0)
            return
        if outcome is Ending.RESTART:
            self._after_kubelet_restart()
            self._set(State.WAITING)
            await self.stop(grace=0)
            return
        # The stream ended or never opened: the kubelet will not dial us again.
        if time.monotonic() - self._stream_since >= STABLE_STREAM_S and outcome is Ending.LOST:
            self._loss_backoff.reset()  # a long-lived stream: this is no loop
        delay = self._loss_backoff.next()
        self.last_error = outcome_text(outcome, self._stream_open_timeout)
        log.warning("%s; serving and registering again in %.1f s", self.last_error, delay)  # the cause, then the status
        self._set(State.LOST)
        await self.stop(grace=0)
        if await self._wait_for_kubelet(delay):
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
        self._loss_backoff.reset()
        self._restart_said = True  # (_send_register counts it once the Register is through)
        log.info("kubelet restart detected; serving and registering again")

    def _kubelet_starting(self) -> bool:
        """A kubelet.sock we have not registered with, for less than KUBELET_STARTING_S: a
        kubelet still starting (its socket exists before it serves), and every moment until we
        register is one in which its admission counts no device."""
        now = sockets.identity(self.kubelet_socket)
        seen = self._kubelet_seen
        if now is None or (seen is not None and now == seen.identity):
            return False
        if self._starting is None or self._starting[0] != now:
            self._starting = (now, time.monotonic())
        return time.monotonic() - self._starting[1] < KUBELET_STARTING_S

    def _forget_kubelet_stream(self) -> None:
        """The next stream to open after our next Register is the kubelet's."""
        self._register_sent = False
        self._kubelet_stream = None
        self._kubelet_stream_open = False

    def end_streams(self) -> None:
        """End the current server's ListAndWatch streams now (the first step of a shutdown)."""
        end_streams, self._end_streams = self._end_streams, lambda: None
        end_streams()

    async def stop(self, grace: float = transport.STOP_GRACE_S) -> None:
        """Stop serving: end our streams and stop accepting at once, give in-flight calls `grace`,
        then remove our socket (only if it is still the one we put there)."""
        serving, self._serving = self._serving, None
        self._generation += 1  # from here on, the old server's streams change nothing
        if self._kubelet_stream_open:
            self._pin("_stream_ended_with", self._kubelet_tried)  # the kubelet of this stream's Register
        self.current_streams = 0
        self._forget_kubelet_stream()
        self.end_streams()
        if serving is not None:
            await serving.stop(grace)

    def _pin(self, attr: str, new: Optional[Pin]) -> Optional[Pin]:
        """Remember `new` as _kubelet_seen, _kubelet_tried or _stream_ended_with; the pin it
        replaces is closed unless another of them still holds it."""
        old = getattr(self, attr)
        setattr(self, attr, new)
        if old is not None and all(
            old is not p for p in (self._kubelet_seen, self._kubelet_tried, self._stream_ended_with)
        ):
            old.close()
        return new

    def _set(self, state: State) -> None:
        self.state = state
        if self._on_change:
            self._on_change()

    def _on_stream(self, generation: int, delta: int, stream: object) -> None:
        if generation != self._generation:
            return  # a server we already replaced
        self.current_streams = max(0, self.current_streams + delta)
        if delta > 0 and self._register_sent and self._kubelet_stream is None:
            self._kubelet_stream = stream
            self._kubelet_stream_open = True
            self._stream_since = time.monotonic()
            if self.state == State.REGISTERED:
                self._set(State.STREAMED)
        elif delta < 0 and stream is self._kubelet_stream:
            self._kubelet_stream_open = False
            if self.state is State.STREAMED:
                # Said as what it is at once (_watch acts on it next): not as "registered; waiting
                # for the kubelet's stream", as if the first had yet to open.
                self.state = State.LOST
                self.last_error = outcome_text(Ending.LOST, self._stream_open_timeout)
        self._wake.set()
        if self._on_change:
            self._on_change()

    async def _serve(self) -> None:
        self._generation += 1
        generation = self._generation

        def configure(server: grpc.aio.Server) -> None:
            self._end_streams = self._configure(
                server, lambda delta, stream: self._on_stream(generation, delta, stream)
            )

        try:
            # Our private name: .<our socket>.<pid>.<8 hex> (contracts.private_socket_name).
            self._serving = await transport.serve_in_place(
                self.socket_path, configure, f".{self._socket_name}.", "kubelet_dir"
            )
        except transport.Taken as exc:
            raise AlreadyServed(str(exc)) from None

    async def _register(self) -> None:
        # Set before any await: the side's "we may register" and this Register are one step, so an
        # in-place upgrade never agrees to its child's Register with ours on its way (agent.py).
        self.registering_now = True
        try:
            await self._send_register()
        finally:
            self.registering_now = False

    async def _send_register(self) -> None:
        kubelet = self._pin("_kubelet_tried", Pin.take(self.kubelet_socket))
        if kubelet is None:
            raise RegistrationError(_no_kubelet(self.kubelet_socket))
        request = pb.RegisterRequest(
            version=contracts.KUBELET_API_VERSION,
            endpoint=self._socket_name,
            resource_name=self._resource,
            options=api.plugin_options(),
        )
        self._register_sent = True
        self._renew = False  # a Register from now on is what renew() asked for
        async with grpc.aio.insecure_channel(transport.unix_target(self.kubelet_socket)) as channel:
            register = asyncio.ensure_future(
                api.registration_stub(channel).Register(request, timeout=self._register_timeout)
            )
            unserved = asyncio.ensure_future(self._unserved())
            try:
                await asyncio.wait({register, unserved}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                unserved.cancel()
                register.cancel()  # nothing once it is done; else the RPC is cancelled
            if not register.done():
                await asyncio.wait({register})
                raise Unserved(
                    f"Register with {self.kubelet_socket}: {self.socket_path} was removed "
                    "meanwhile (a kubelet starting?)"
                )
            # Taken, not raised here: a traceback through this frame would keep the call, and
            # grpc's connection state for kubelet.sock with it, until the garbage collector ran.
            error = register.exception()
        if isinstance(error, grpc.aio.AioRpcError):
            raise RegistrationError(
                f"Register with {self.kubelet_socket}: {error.code().name}: {error.details()}"
            ) from error
        if error is not None:
            raise error
        previous = self._kubelet_seen
        if previous is not None and previous.identity != kubelet.identity:
            # Counted here, where it is certain: a restart first seen as a lost stream (the
            # kubelet stopping ends it before its new socket exists) is registered anew at once.
            self.kubelet_restarts += 1
            if not self._restart_said:
                log.info("kubelet restart detected: %s is a new socket", self.kubelet_socket)
        self._restart_said = False
        self._pin("_kubelet_seen", kubelet)

    async def _unserved(self) -> None:
        """Returns once our socket is no longer at its path. The kubelet dials back to that path
        inside Register: a kubelet starting removes every socket in its directory, ours too, and
        its dial then finds nothing until Register's deadline."""
        while True:
            self._wake.clear()
            if self._serving is None or not self._serving.still_ours():
                return
            await self._wake.wait()

    async def _wait_for_kubelet(self, delay: float) -> bool:
        """Sleep `delay`, cut short (True) as soon as a (new) kubelet.sock exists: woken by the
        watcher, or looked at every VERIFY_INTERVAL_S while the kubelet directory is not watched."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        while loop.time() < deadline:
            self._wake.clear()
            now = sockets.identity(self.kubelet_socket)
            tried = self._kubelet_tried
            if now is not None and (tried is None or now != tried.identity):
                return True
            left = deadline - loop.time()
            await waits.event(self._wake, left if self._watched() else min(left, VERIFY_INTERVAL_S))
        return False

    async def _watch(self) -> Ending:
        """Until the registration ends; how it did."""
        loop = asyncio.get_running_loop()
        no_stream_by = loop.time() + self._stream_open_timeout
        while True:
            self._wake.clear()
            if self._serving is None or not self._serving.still_ours():
                return Ending.REPLACED if os.path.lexists(self.socket_path) else Ending.RESTART
            kubelet = sockets.identity(self.kubelet_socket)
            if kubelet is not None and (self._kubelet_seen is None or kubelet != self._kubelet_seen.identity):
                return Ending.RESTART
            if self._kubelet_stream is not None and not self._kubelet_stream_open:
                return Ending.LOST
            if self._renew:
                self._renew = False
                return Ending.RENEW
            timeout: Optional[float] = None if self._watched() else VERIFY_INTERVAL_S
            if self.state == State.REGISTERED:
                timeout = no_stream_by - loop.time()
                if timeout <= 0:
                    return Ending.NO_STREAM
            await waits.event(self._wake, timeout)


def outcome_text(outcome: Ending, stream_open_timeout: float) -> str:
    if outcome is Ending.NO_STREAM:
        return f"no ListAndWatch stream within {stream_open_timeout:g} s of registering"
    return "the kubelet's ListAndWatch stream ended"
