"""What both kubelet protocols (the device plugin's and DRA's) do alike on their unix sockets:
serve a gRPC server at a path without ever taking over anyone's socket, stop it within one grace
and remove only our own socket, build method tables and client stubs from message types, and
refuse requests whose bytes are not their message type with INVALID_ARGUMENT.

    serving = await serve_in_place(path, configure, private_prefix, setting)
        sweep abandoned private names → bind <dir>/<private_prefix><pid>.<8 hex> → start →
        rename into place (never over a live socket: Taken; never over anything else: NotServing)
    await serving.stop(grace)   calls in flight get `grace`; then our socket goes, if still ours

grpc turns a deserializer's exception into UNKNOWN "Unexpected …" and logs a traceback per
request, so the deserializer returns an Unparsable instead and the method refuses it. grpcio
unlinks whatever is at the path it binds and again when the server stops: binding a private
name and renaming it into place keeps both off the shared path (docs/decisions/our-socket.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import secrets
import socket
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Protocol

import grpc
from google.protobuf.message import DecodeError

from hyperlight_agent import contracts
from hyperlight_agent.files import sockets
from hyperlight_agent.text import cause

# Calls in flight when a server stops get this long to finish (a kubelet's Allocate or Prepare
# that arrived before our socket went). Every server of ours stops with it.
STOP_GRACE_S = 1.0
PRIVATE_TOKEN_BYTES = 4  # the random part of a private socket name: 8 hex digits
# Once a successor is ready, a kubelet call addressed to us just before may still be on its way: a
# call that has not arrived this long after (or after the last one that did) is taken to be none.
# It bounds the case nothing proves (no pod arrives); arriving pods prove it sooner (until_quiet).
QUIET_S = 1.0
# How often until_quiet looks at the calls, and asks for a proof.
QUIET_LOOK_S, QUIET_PROOF_S = 0.01, 0.1

# method name → (request type, response type, server-streaming?)
Methods = dict[str, tuple[Any, Any, bool]]


class Answering(Protocol):
    """What Calls needs of a call's context (grpc.aio's ServicerContext): when its answer is sent."""

    def add_done_callback(self, callback: Any) -> None: ...


class Calls:
    """The kubelet's calls on one service of ours, counted for a stop: how many are in flight and
    how many came in all. A call ends when grpc has sent its answer (the context's done callback),
    not when our handler returns: between the two the answer is still on its way, and a
    deregistration then (which closes the kubelet's connection) would cancel it there."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.received = 0
        self.last_ended = float("-inf")  # when the last answer was sent (monotonic)
        self._none: Optional[asyncio.Event] = None  # set once none is in flight (made in the loop)

    @contextlib.asynccontextmanager
    async def counted(self, context: Optional[Answering]) -> AsyncIterator[None]:
        """One call, from its handler's start; without a context (a direct call in a test or a
        benchmark) it ends with the handler."""
        self.in_flight += 1
        self.received += 1
        try:
            yield
        finally:
            if context is None:
                self._ended()
            else:
                context.add_done_callback(lambda _: self._ended())

    async def none_in_flight(self) -> None:
        while self.in_flight:
            if self._none is None or self._none.is_set():
                self._none = asyncio.Event()
            await self._none.wait()

    def _ended(self) -> None:
        self.in_flight -= 1
        self.last_ended = time.monotonic()
        if not self.in_flight and self._none is not None:
            self._none.set()


class Unparsable:
    """A request whose bytes are not its message type; `message` says why, in one line."""

    def __init__(self, request_type: Any, exc: DecodeError) -> None:
        self.message = f"cannot parse {request_type.DESCRIPTOR.full_name}: {str(exc)[:200]}"


def parser(request_type: Any) -> Callable[[bytes], Any]:
    """A deserializer for request_type that returns an Unparsable instead of raising."""

    def parse(data: bytes) -> Any:
        try:
            return request_type.FromString(data)
        except DecodeError as exc:
            return Unparsable(request_type, exc)

    return parse


async def until_quiet(
    in_flight: Callable[[], int],
    received: Callable[[], int],
    proof: Optional[Callable[[], Awaitable[Optional[str]]]] = None,
    quiet: float = QUIET_S,
    grace: float = STOP_GRACE_S,
) -> str:
    """Called once a successor is ready, before we stop: returns, saying why, when the kubelet is
    done with us: no call of its in flight, and either `proof()` says why no more will come (asked
    every QUIET_PROOF_S), or none arrived for `quiet` seconds. The kubelet closes its connection to
    us when we go, failing whatever is on it. Calls in flight get `grace` beyond `quiet`."""
    loop = asyncio.get_running_loop()
    started = last_arrival = ask_at = loop.time()
    count = received()
    while True:
        now = loop.time()
        if received() != count:
            count, last_arrival = received(), now
        if in_flight() > 0:
            if now - started >= quiet + grace:
                return f"{in_flight()} call(s) still in flight after {quiet + grace:g} s"
        elif now - last_arrival >= quiet:
            return f"no call for {quiet:g} s"
        elif proof is not None and now >= ask_at:
            why = await proof()
            if why:
                return why
            ask_at = loop.time() + QUIET_PROOF_S
        await asyncio.sleep(QUIET_LOOK_S)


def unix_target(path: str) -> str:
    """grpc's address for a unix socket path: unix:///var/lib/kubelet/device-plugins/kubelet.sock."""
    return "unix://" + path


def handler(service: str, methods: Methods, implementation: object, *bound: Any) -> grpc.GenericRpcHandler[Any, Any]:
    """A handler serving `service` with implementation's methods of the same names, each called as
    method(request, context, *bound) (DRA binds the version's message module)."""
    handlers = {}
    for name, (request, response, streaming) in methods.items():
        make: Callable[..., grpc.RpcMethodHandler[Any, Any]] = (
            grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = make(
            _refusing_unparsable(getattr(implementation, name), streaming, bound),
            request_deserializer=parser(request),
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service, handlers)


def _refusing_unparsable(method: Callable[..., Any], streaming: bool, bound: tuple[Any, ...]) -> Callable[..., Any]:
    # grpc.aio tells the kinds of handler apart by what they are: a stream stays an async
    # generator function, a unary method a coroutine function.
    if streaming:

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            responses = method(request, context, *bound)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()  # `async for` alone leaves the inner generator to the GC

        return stream

    async def unary(request: Any, context: Any) -> Any:
        if isinstance(request, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(request, context, *bound)

    return unary


class Stub:
    """Client callables for a service: Stub(channel, service, methods).Allocate(request)."""

    def __init__(self, channel: Any, service: str, methods: Methods) -> None:
        for name, (request, response, streaming) in methods.items():
            factory = channel.unary_stream if streaming else channel.unary_unary
            setattr(
                self,
                name,
                factory(
                    f"/{service}/{name}",
                    request_serializer=request.SerializeToString,
                    response_deserializer=response.FromString,
                ),
            )

    def __getattr__(self, name: str) -> Any:  # for type checkers: methods are set in __init__
        raise AttributeError(name)


class NotServing(Exception):
    """We cannot serve at a socket path; the message names it, the setting and why."""


class Taken(NotServing):
    """A live server (another agent) serves the path: it is never taken over."""


class Serving:
    """One running server of ours and the socket we put in place for it."""

    def __init__(self, server: grpc.aio.Server, path: str, pin: sockets.Pin) -> None:
        self.server, self.path, self.pin = server, path, pin

    def still_ours(self) -> bool:
        """Whether the socket at our path is still the one we put there."""
        return self.pin.is_at(self.path)

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop accepting at once, give calls in flight `grace`, then remove our socket if it is
        still ours (also when this stop is itself cancelled: our socket must not stay)."""
        try:
            await self.server.stop(grace)
        finally:
            sockets.remove_ours(self.pin, self.path)


def private_name(prefix: str) -> re.Pattern[str]:
    """The names a server binds before its rename: <prefix><pid>.<8 hex>."""
    return re.compile(re.escape(prefix) + rf"[0-9]+\.[0-9a-f]{{{2 * PRIVATE_TOKEN_BYTES}}}")


async def serve_in_place(
    path: str, configure: Callable[[grpc.aio.Server], None], private_prefix: str, setting: str
) -> Serving:
    """A started server with configure()'s services, at `path` (in `setting`'s directory).
    Raises Taken or NotServing; nothing of ours is left behind then, nor when cancelled."""
    directory = os.path.dirname(path)
    sockets.sweep(directory, private_name(private_prefix))
    private = os.path.join(directory, f"{private_prefix}{os.getpid()}.{secrets.token_hex(PRIVATE_TOKEN_BYTES)}")
    if len(os.fsencode(private)) > contracts.UNIX_PATH_MAX:
        raise NotServing(f"{directory} ({setting}): too long for a unix socket path")
    server = grpc.aio.server()
    configure(server)
    try:
        problem = await listen(server, private)
        pin = None if problem else await _start_in_place(server, private, path)
    except BaseException as exc:
        # The name first, before anything that awaits: a stop may cancel this cleanup's await too.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(private)
        await server.stop(0)
        if isinstance(exc, sockets.InUse):
            raise Taken(str(exc)) from None
        if isinstance(exc, sockets.NotPlaced):
            raise NotServing(str(exc)) from None
        raise
    if pin is None:
        # The message names the directory, not the random name, so it stays the same per retry.
        raise NotServing(f"cannot listen in {directory} ({setting}): {problem}")
    return Serving(server, path, pin)


async def _start_in_place(server: grpc.aio.Server, private: str, path: str) -> sockets.Pin:
    await server.start()
    return sockets.put_in_place(private, path)


async def listen(server: grpc.aio.Server, path: str) -> str:
    """Have server listen on the unix socket at path: "" when it does, else why not. grpc says why
    only in its own log (C-core error lines on stderr, ahead of and unlike ours), so a plain socket
    is bound there first: what fails for it is said by us and never reaches grpc. On failure the
    server is stopped."""
    problem = bind_problem(path)
    if problem:
        await server.stop(0)
        return problem
    try:
        port = server.add_insecure_port(unix_target(path))
    except RuntimeError:  # some grpcio versions raise instead of returning 0
        port = 0
    if port:
        return ""
    await server.stop(0)
    return bind_error(path)


def bind_error(path: str) -> str:
    """Why grpc could not bind a unix socket at path (ENOENT, EROFS, EACCES, ...)."""
    return bind_problem(path) or "grpc could not bind there, though a plain socket could"


def bind_problem(path: str) -> str:
    """Why a unix socket cannot be bound at path, or "" when one can (it is removed again)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        try:
            probe.bind(path)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return "the directory does not exist (no kubelet installed or started yet?)"
            return cause(exc)
    with contextlib.suppress(OSError):
        os.unlink(path)
    return ""
