"""Exec probes (`--health-check=liveness|readiness`): one gRPC health Check over the unix
socket, with a short deadline. Imports only grpc and the health messages, to start fast."""

from __future__ import annotations

import os

from . import contracts, modes
from .config import Settings

PROBE_TIMEOUT_S = 2.0


def health_check(settings: Settings, which: str, device_access: bool) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2

    path = os.path.join(settings.kubelet_dir,
                        contracts.instance_socket_name(modes.of(device_access).socket, settings.instance))
    if not os.path.exists(path):
        return False, f"{which}: not serving: no socket at {path}"
    with grpc.insecure_channel("unix://" + path) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            request = health_pb2.HealthCheckRequest(service=modes.HEALTH_SERVICES[which])
            response = check(request, timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            return False, f"{which}: no answer from {path}: {exc.code().name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status == health_pb2.HealthCheckResponse.SERVING:
        return True, f"{which}: SERVING ({path})"
    return False, f"{which}: {status} ({path})"
