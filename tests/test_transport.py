"""What both kubelet protocols do alike on their sockets (transport.py), on real gRPC servers over
unix sockets in temp dirs: a server put in place at its path, never over a live socket or a file
that is not a socket, a stale socket swapped out, abandoned private names swept; our socket removed
on stop only while it is still ours; method tables served and called through a Stub; bytes that
are not the request's type refused with INVALID_ARGUMENT naming the type; a stream's generator
closed when its call ends; and the wait for a kubelet done with us (until_quiet)."""

from __future__ import annotations

import asyncio
import os
import re
import time
from typing import Any, AsyncIterator, Optional

import grpc
import pytest
from google.protobuf import wrappers_pb2

from hyperlight_agent import transport
from hyperlight_agent.files import atomic
from tests.conftest import until
from tests.test_files_sockets import bound

SERVICE = "hyperlight.test.Echo"
METHODS: transport.Methods = {
    "Echo": (wrappers_pb2.StringValue, wrappers_pb2.StringValue, False),
    "Repeat": (wrappers_pb2.StringValue, wrappers_pb2.StringValue, True),
}
PREFIX = ".echo."
# A StringValue whose field says 5 bytes follow, and only 2 do.
TRUNCATED = b"\x0a\x05ab"


class Echo:
    """The toy service: Echo answers its request with the bound suffix; Repeat streams it until
    the call ends, saying when its generator is closed."""

    def __init__(self) -> None:
        self.calls = 0
        self.streams_closed = 0

    async def Echo(self, request: Any, context: Any, suffix: str) -> Any:
        self.calls += 1
        return wrappers_pb2.StringValue(value=request.value + suffix)

    async def Repeat(self, request: Any, context: Any, suffix: str) -> AsyncIterator[Any]:
        self.calls += 1
        try:
            while True:
                yield wrappers_pb2.StringValue(value=request.value + suffix)
                await asyncio.sleep(0.01)  # a stream's pace, not synchronisation
        finally:
            self.streams_closed += 1


async def serve(path: str, echo: Optional[Echo] = None) -> transport.Serving:
    service = echo or Echo()
    return await transport.serve_in_place(
        path,
        lambda server: server.add_generic_rpc_handlers([transport.handler(SERVICE, METHODS, service, "!")]),
        PREFIX,
        "echo_dir",
    )


async def echo(path: str, value: str) -> str:
    async with grpc.aio.insecure_channel(transport.unix_target(path)) as channel:
        answer = await transport.Stub(channel, SERVICE, METHODS).Echo(wrappers_pb2.StringValue(value=value), timeout=5)
    return str(answer.value)


async def send_bytes(path: str, method: str, data: bytes) -> None:
    """Call `method` with `data` as the request's bytes (no serializer), reading every answer."""
    async with grpc.aio.insecure_channel(transport.unix_target(path)) as channel:
        if METHODS[method][2]:
            async for _ in channel.unary_stream(f"/{SERVICE}/{method}", None, None)(data, timeout=5):
                pass
        else:
            await channel.unary_unary(f"/{SERVICE}/{method}", None, None)(data, timeout=5)


def inode(path: str) -> int:
    return os.lstat(path).st_ino


async def test_a_server_is_put_in_place_answers_through_a_stub_and_its_socket_goes_on_stop(tmp: str) -> None:
    path = os.path.join(tmp, "echo.sock")
    echo_service = Echo()
    serving = await serve(path, echo_service)
    try:
        assert serving.still_ours()
        assert os.listdir(tmp) == ["echo.sock"], "the private name was renamed into place"
        assert await echo(path, "hello") == "hello!", "the bound argument reaches the method"
        assert echo_service.calls == 1
    finally:
        await serving.stop(0)
    assert not os.path.lexists(path)


async def test_a_live_socket_at_the_path_is_never_taken_over(tmp: str) -> None:
    path = os.path.join(tmp, "echo.sock")
    first = await serve(path)
    try:
        before = inode(path)
        with pytest.raises(transport.Taken, match=f"^{re.escape(path)}: another agent is serving it"):
            await serve(path)
        assert inode(path) == before and first.still_ours()
        assert await echo(path, "still") == "still!"
        assert os.listdir(tmp) == ["echo.sock"], "the refused server left no private socket behind"
    finally:
        await first.stop(0)


async def test_a_stale_socket_is_swapped_out_and_a_file_that_is_no_socket_is_left_alone(tmp: str) -> None:
    path = os.path.join(tmp, "echo.sock")
    bound(path, listening=False).close()  # a socket file no one listens on: an agent that died
    serving = await serve(path)
    try:
        assert await echo(path, "fresh") == "fresh!"
    finally:
        await serving.stop(0)
    with open(path, "w") as f:
        f.write("not ours")
    with pytest.raises(transport.NotServing, match="exists and is not a socket; not replacing it"):
        await serve(path)
    with open(path) as f:
        assert f.read() == "not ours"
    assert os.listdir(tmp) == ["echo.sock"]


async def test_stop_removes_our_socket_only_while_it_is_still_ours(tmp: str) -> None:
    path = os.path.join(tmp, "echo.sock")
    serving = await serve(path)
    other = bound(os.path.join(tmp, "other.sock"), listening=True)
    theirs = inode(os.path.join(tmp, "other.sock"))
    try:
        os.rename(os.path.join(tmp, "other.sock"), path)  # someone else's socket now stands at our path
        assert not serving.still_ours()
        await serving.stop(0)
        assert os.path.lexists(path) and inode(path) == theirs
    finally:
        other.close()


async def test_abandoned_private_names_are_swept_and_a_neighbours_similar_name_is_not(tmp: str) -> None:
    abandoned = os.path.join(tmp, f"{PREFIX}4242.0a1b2c3d")
    young = os.path.join(tmp, f"{PREFIX}4243.0a1b2c3d")
    neighbours = os.path.join(tmp, f"{PREFIX}4242.not-hex")
    for name in (abandoned, young, neighbours):
        bound(name, listening=False).close()
    old = time.time() - atomic.ABANDONED_AFTER_S - 5
    for name in (abandoned, neighbours):
        os.utime(name, (old, old))
    serving = await serve(os.path.join(tmp, "echo.sock"))
    try:
        assert sorted(os.listdir(tmp)) == sorted(["echo.sock", os.path.basename(young), os.path.basename(neighbours)])
    finally:
        await serving.stop(0)


@pytest.mark.parametrize(
    ("directory", "message"),
    [
        ("missing", r"cannot listen in {d} \(echo_dir\): the directory does not exist"),
        ("d" * 100, r"{d} \(echo_dir\): too long for a unix socket path"),
    ],
)
async def test_a_directory_we_cannot_serve_in_is_named_with_its_setting(tmp: str, directory: str, message: str) -> None:
    where = os.path.join(tmp, directory)
    with pytest.raises(transport.NotServing, match="^" + message.format(d=re.escape(where))):
        await serve(os.path.join(where, "echo.sock"))
    assert os.listdir(tmp) == []


@pytest.mark.parametrize("method", ["Echo", "Repeat"])
async def test_bytes_that_are_not_the_request_type_are_refused_with_invalid_argument(tmp: str, method: str) -> None:
    path = os.path.join(tmp, "echo.sock")
    echo_service = Echo()
    serving = await serve(path, echo_service)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await send_bytes(path, method, TRUNCATED)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith("cannot parse google.protobuf.StringValue: ")
        assert echo_service.calls == 0, "the method never saw the bytes"
        assert await echo(path, "after") == "after!", "the server serves on"
    finally:
        await serving.stop(0)


def test_the_parser_returns_an_unparsable_instead_of_raising() -> None:
    parse = transport.parser(wrappers_pb2.StringValue)
    assert parse(wrappers_pb2.StringValue(value="x").SerializeToString()) == wrappers_pb2.StringValue(value="x")
    refused = parse(TRUNCATED)
    assert isinstance(refused, transport.Unparsable)
    assert refused.message.startswith("cannot parse google.protobuf.StringValue: ") and "\n" not in refused.message


async def test_a_streams_generator_is_closed_when_its_call_ends(tmp: str) -> None:
    path = os.path.join(tmp, "echo.sock")
    echo_service = Echo()
    serving = await serve(path, echo_service)
    try:
        async with grpc.aio.insecure_channel(transport.unix_target(path)) as channel:
            call = transport.Stub(channel, SERVICE, METHODS).Repeat(wrappers_pb2.StringValue(value="r"))
            assert [(await call.read()).value for _ in range(2)] == ["r!", "r!"]
            assert echo_service.streams_closed == 0
            call.cancel()
            await until(lambda: echo_service.streams_closed == 1, timeout=5, what="the stream's generator closed")
    finally:
        await serving.stop(0)


async def test_the_kubelet_is_done_with_us_once_quiet_or_proven_and_calls_in_flight_get_a_bound() -> None:
    """transport.until_quiet: calls in flight finish first; then `quiet` seconds without a call,
    or a proof sooner; a call that never ends is given up after quiet + grace."""
    loop = asyncio.get_running_loop()
    in_flight, received = [2], [2]

    async def finish() -> None:
        await asyncio.sleep(0.02)
        in_flight[0] = 0

    task = asyncio.ensure_future(finish())
    started = loop.time()
    assert await transport.until_quiet(lambda: in_flight[0], lambda: received[0], quiet=0.2) == "no call for 0.2 s"
    assert loop.time() - started >= 0.2
    await task
    proven = await transport.until_quiet(lambda: 0, lambda: 0, lambda: _said("proven"), quiet=60)
    assert proven == "proven"
    stuck = await transport.until_quiet(lambda: 1, lambda: 1, quiet=0.05, grace=0.05)
    assert stuck == "1 call(s) still in flight after 0.1 s"


async def _said(why: str) -> Optional[str]:
    return why


class Delivery:
    """A call's context whose answer is sent when the test says (send())."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def send(self) -> None:
        for callback in self.callbacks:
            callback(self)


async def test_a_call_ends_when_its_answer_is_sent_not_when_its_handler_returns() -> None:
    """The one counter of the kubelet's calls (the device plugin's Allocates, DRA's Prepares and
    Unprepares): a stop that waits for none in flight waits for the answers to be sent."""
    calls = transport.Calls()
    first, second = Delivery(), Delivery()
    async with calls.counted(first), calls.counted(second):
        assert (calls.in_flight, calls.received) == (2, 2)
    assert calls.in_flight == 2, "both handlers returned, neither answer sent"
    waiting = asyncio.ensure_future(calls.none_in_flight())
    first.send()
    assert calls.in_flight == 1
    await asyncio.sleep(0)  # the waiter runs, and waits on
    assert not waiting.done()
    before = time.monotonic()
    second.send()
    await asyncio.wait_for(waiting, 5)
    assert calls.in_flight == 0 and calls.received == 2 and calls.last_ended >= before
    async with calls.counted(None):  # a direct call (a test, a benchmark): over with its handler
        assert calls.in_flight == 1
    assert (calls.in_flight, calls.received) == (0, 3)
