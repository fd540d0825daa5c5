"""gRPC fuzzing against a running agent: generated and mutated messages (sent as raw bytes, so
they need not parse) for all five DevicePlugin methods, and raw garbage written straight to the
socket. Throughout, the same agent process answers GetDevicePluginOptions within a deadline and
its registration stays healthy; at the end its log holds no traceback and it stops with exit 0.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import socket
import time
from typing import Any

import grpc

from hyperlight_agent import contracts, transport
from hyperlight_agent.deviceplugin import api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from standin.kubelet import StandinThread
from tests.conftest import StartAgent, count_inputs, fuzz_budget

SLOTS = 4
# Defaults: 8000 RPCs, 800 raw connections, a 60 s cap (all scaled by HYPERLIGHT_FUZZ_SCALE).
RPCS = fuzz_budget(8000)
RAW_CONNECTIONS = fuzz_budget(800)
TIME_CAP_S = 60.0 * fuzz_budget(1)
CHECK_EVERY = 100  # inputs between liveness checks
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# What a refused or unparsable request may end in. UNKNOWN would mean an exception escaped a
# servicer method; anything else is a bug in our handling.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


def seeds(rng: random.Random) -> dict[str, bytes]:
    """One valid serialized request per method, varied."""

    def ids() -> list[str]:
        return [
            rng.choice([f"kvm-{rng.randrange(SLOTS + 2)}", "mshv-0", "kvm-01", "", "x" * rng.randrange(100)])
            for _ in range(rng.randrange(4))
        ]

    return {
        "GetDevicePluginOptions": b"",
        "ListAndWatch": b"",
        "GetPreferredAllocation": pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=ids(),
                    must_include_deviceIDs=ids(),
                    allocation_size=rng.randrange(-3, 2**31 - 1),
                )
                for _ in range(rng.randrange(3))
            ]
        ).SerializeToString(),
        "Allocate": pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids()) for _ in range(rng.randrange(3))]
        ).SerializeToString(),
        "PreStartContainer": pb.PreStartContainerRequest(devices_ids=ids()).SerializeToString(),
    }


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def random_wire(rng: random.Random) -> bytes:
    """Protobuf-shaped noise: random field numbers and wire types, lengths that may lie."""
    out = bytearray()
    for _ in range(rng.randrange(6)):
        field, wire = rng.choice([1, 2, 3, 4, 5, 15, 16, 2**29 - 1, 0]), rng.choice([0, 1, 2, 3, 4, 5, 6, 7])
        out += varint(field << 3 | wire)
        if wire == 0:
            out += varint(rng.choice([0, 1, 2**31, 2**63, 2**64 - 1]))
        elif wire == 1:
            out += rng.randbytes(8)
        elif wire == 2:
            body = rng.randbytes(rng.randrange(20))
            out += varint(rng.choice([len(body), len(body) + 5, 2**31, 0])) + body
        elif wire == 5:
            out += rng.randbytes(4)
    return bytes(out)


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        kind = rng.randrange(5)
        i = rng.randrange(len(out) + 1)
        if kind == 0 and out:
            out[min(i, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif kind == 1:
            out[i:i] = rng.randbytes(rng.randrange(1, 8))
        elif kind == 2:
            del out[i : i + rng.randrange(1, 8)]
        elif kind == 3:
            out[i:i] = out[i : i + rng.randrange(1, 16)] * rng.randrange(2, 8)
        else:
            out = out[:i]
    return bytes(out)


def payload(rng: random.Random, method: str) -> bytes:
    roll = rng.random()
    if roll < 0.3:
        return seeds(rng)[method]
    if roll < 0.7:
        return mutate(rng, seeds(rng)[method])
    if roll < 0.85:
        return random_wire(rng)
    if roll < 0.98:
        return rng.randbytes(rng.randrange(64))
    return rng.randbytes(rng.randrange(1 << 16, 1 << 20))  # large and meaningless


def raw_garbage(path: str, rng: random.Random) -> None:
    """Connect and write bytes no gRPC client would, then go away (half the time abruptly)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(path)
        data = rng.randbytes(rng.randrange(1, 4096))
        if rng.random() < 0.5:
            data = H2_PREFACE + data  # a real preface, then junk frames
        try:
            s.sendall(data)
            if rng.random() < 0.5:
                s.recv(4096)
        except OSError:
            pass  # the server may close first: that is its right


def check_refusal(name: str, data: bytes, exc: grpc.aio.AioRpcError) -> None:
    assert exc.code() in ALLOWED, f"{name}({data[:80]!r}…): {exc.code()} {exc.details()}"
    assert len(exc.details() or "") <= 500


def test_fuzz_grpc_methods_and_raw_socket_garbage_never_hurt_the_agent(
    kubelet: StandinThread, start_agent: StartAgent, tmp: str, kvm_dir: str
) -> None:
    agent = start_agent("--device-count", str(SLOTS), "--device-dir", kvm_dir)
    kubelet.wait_until(lambda k: k.allocatable() == SLOTS, 15)
    pid = agent.proc.pid
    sock = os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET)
    rng = random.Random(11)
    codes: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    sent = raw_sent = 0

    def alive() -> None:
        assert agent.proc.poll() is None and agent.proc.pid == pid, "the agent died"
        assert kubelet.run(lambda k: k.allocatable()) == SLOTS, "the registration is no longer healthy"

    async def fuzz() -> None:
        nonlocal sent, raw_sent
        async with grpc.aio.insecure_channel(transport.unix_target(sock)) as channel:
            calls: dict[str, Any] = {}
            for name, (_, _, streaming) in api.DEVICE_PLUGIN_METHODS.items():
                path = f"/{api.DEVICE_PLUGIN_SERVICE}/{name}"
                # No serializers: bytes go out as they are, so they need not parse.
                make = channel.unary_stream if streaming else channel.unary_unary
                calls[name] = make(path, None, None)
            options = calls["GetDevicePluginOptions"]
            while sent < RPCS and time.monotonic() - started < TIME_CAP_S:
                name = rng.choice(list(calls))
                data = payload(rng, name)
                try:
                    if name == "ListAndWatch":
                        stream = calls[name](data, timeout=5)
                        async for _ in stream:
                            break  # the first list is enough; leaving cancels the stream
                        stream.cancel()
                    else:
                        await calls[name](data, timeout=5)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    check_refusal(name, data, exc)
                    codes[exc.code().name] += 1
                sent += 1
                if sent % 10 == 0 and raw_sent < RAW_CONNECTIONS:
                    await asyncio.get_running_loop().run_in_executor(None, raw_garbage, sock, rng)
                    raw_sent += 1
                if sent % CHECK_EVERY == 0:
                    await options(b"", timeout=2)  # still answering promptly
                    alive()

    asyncio.run(fuzz())
    while raw_sent < RAW_CONNECTIONS and time.monotonic() - started < TIME_CAP_S:
        raw_garbage(sock, rng)
        raw_sent += 1
    alive()
    elapsed = time.monotonic() - started
    count_inputs("gRPC requests (running agent)", sent)
    count_inputs("raw socket garbage (running agent)", raw_sent)
    print(f"{sent} RPCs and {raw_sent} raw connections in {elapsed:.1f} s: {dict(codes)}")
    assert sent >= min(RPCS, 500), f"only {sent} RPCs within {TIME_CAP_S} s"
    assert agent.stop() == 0
    log = agent.log
    assert "Traceback" not in log and "Unexpected" not in log, log[-3000:]


def test_unparsable_request_bytes_are_invalid_arguments_without_a_traceback(
    kubelet: StandinThread, start_agent: StartAgent, tmp: str, kvm_dir: str
) -> None:
    """Found by the fuzzer: grpc made a deserializer's DecodeError an UNKNOWN "Unexpected …" and
    logged its traceback, once per garbage request."""
    agent = start_agent("--device-count", str(SLOTS), "--device-dir", kvm_dir)
    kubelet.wait_until(lambda k: k.allocatable() == SLOTS, 15)
    sock = os.path.join(tmp, "kubelet", contracts.PLUGIN_SOCKET)

    async def refused(name: str) -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(transport.unix_target(sock)) as channel:
            path = f"/{api.DEVICE_PLUGIN_SERVICE}/{name}"
            try:
                if api.DEVICE_PLUGIN_METHODS[name][2]:
                    async for _ in channel.unary_stream(path, None, None)(b"\xff", timeout=5):
                        pass
                else:
                    await channel.unary_unary(path, None, None)(b"\xff", timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), str(exc.details())
        raise AssertionError(f"{name} accepted bytes that are no message")

    for name, (request_type, _, _) in api.DEVICE_PLUGIN_METHODS.items():
        code, details = asyncio.run(refused(name))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert details.startswith(f"cannot parse {request_type.DESCRIPTOR.full_name}: "), details
    assert kubelet.run(lambda k: k.allocatable()) == SLOTS
    assert agent.stop() == 0
    assert "Traceback" not in agent.log and "Unexpected" not in agent.log, agent.log
