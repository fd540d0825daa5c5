"""Exec probes (`--health-check=liveness|readiness`): one gRPC health Check over the unix
socket the mode serves it on, with a short deadline; and asking another instance whether it is
ready. grpc and the health messages are imported only when asked (the CLI loads this module
before it knows it will ask)."""

from __future__ import annotations

import os
import stat

from hyperlight_agent import contracts, transport
from hyperlight_agent.text import cause

# The exec probe's one Check RPC (the device probe's deadline is device.helper.PROBE_DEADLINE_S).
CHECK_RPC_TIMEOUT_S = 2.0


def health_check(path: str, which: str) -> tuple[bool, str]:
    """Ask the health service on the socket at `path` (parts.ProtocolRow.health_socket)."""
    # The socket itself, never through a symlink (which could lead to another agent's socket):
    # opened without following, checked, and connected to through that very descriptor.
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False, f"{which}: not serving: no socket at {path}"
    except OSError as exc:
        return False, f"{which}: not serving: cannot open {path}: {cause(exc)}"
    try:
        mode = os.fstat(fd).st_mode  # with O_PATH, O_NOFOLLOW opens a symlink itself
        if stat.S_ISLNK(mode):
            return False, f"{which}: not serving: {path} is a symlink, not our socket"
        if not stat.S_ISSOCK(mode):
            return False, f"{which}: not serving: {path} is not a socket"
        return _check(which, path, f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else path)
    finally:
        os.close(fd)


def _check(which: str, path: str, target: str) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2

    with grpc.insecure_channel(transport.unix_target(target)) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            request = health_pb2.HealthCheckRequest(service=contracts.HEALTH_SERVICES[which])
            response = check(request, timeout=CHECK_RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            return False, f"{which}: no answer from {path}: {exc.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status == health_pb2.HealthCheckResponse.SERVING:
        return True, f"{which}: SERVING ({path})"
    return False, f"{which}: {status} ({path})"


async def peer_ready(path: str, timeout: float) -> bool:
    """Whether the agent serving `path` (another instance, during a handover) says it is ready."""
    import grpc
    from grpc_health.v1 import health_pb2

    async with grpc.aio.insecure_channel(transport.unix_target(path)) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            response = await check(
                health_pb2.HealthCheckRequest(service=contracts.HEALTH_SERVICES["readiness"]), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)
