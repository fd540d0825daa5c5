"""What both kubelet protocols (the device plugin's and DRA's) do alike on the wire: parse a
request so that bytes that are not its message type are refused with INVALID_ARGUMENT, and name
a unix socket for grpc.

grpc turns a deserializer's exception into UNKNOWN "Unexpected …" and logs a traceback per
request, so the deserializer returns an Unparsable instead and the method refuses it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from typing import TYPE_CHECKING, Any, Callable

from google.protobuf.message import DecodeError

if TYPE_CHECKING:
    import grpc


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


def unix_target(path: str) -> str:
    """grpc's address for a unix socket path: unix:///var/lib/kubelet/device-plugins/kubelet.sock."""
    return "unix://" + path


async def listen(server: grpc.aio.Server, path: str) -> str:
    """Have server listen on the unix socket at path: "" when it does, else why not. grpc says why
    only in its own log, so the reason comes from binding a plain socket there; on failure the
    server is stopped."""
    try:
        port = server.add_insecure_port(unix_target(path))
    except RuntimeError:  # some grpcio versions raise instead of returning 0
        port = 0
    if port:
        return ""
    await server.stop(0)
    return bind_error(path)


def bind_error(path: str) -> str:
    """Why a unix socket cannot be bound at path (ENOENT, EROFS, EACCES, ...)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        try:
            probe.bind(path)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return "the directory does not exist (no kubelet installed or started yet?)"
            return exc.strerror or str(exc)
    with contextlib.suppress(OSError):
        os.unlink(path)
    return "grpc could not bind there, though a plain socket could"
