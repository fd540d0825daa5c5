"""What both kubelet protocols (the device plugin's and DRA's) do alike on the wire: parse a
request so that bytes that are not its message type are refused with INVALID_ARGUMENT, and name
a unix socket for grpc.

grpc turns a deserializer's exception into UNKNOWN "Unexpected …" and logs a traceback per
request, so the deserializer returns an Unparsable instead and the method refuses it.
"""

from __future__ import annotations

from typing import Any, Callable

from google.protobuf.message import DecodeError


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
