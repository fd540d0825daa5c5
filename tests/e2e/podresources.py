"""The kubelet's own view of allocatable devices, read from its pod-resources API
(`/v1.PodResourcesLister/GetAllocatableResources` on pod-resources/kubelet.sock): the device
manager's healthy devices, the set it admits pods against, at the moment of the call. The node
status in the API lags it by up to nodeStatusUpdateFrequency.

Only two fields are needed, so the response is read at the wire level instead of generating code:
AllocatableResourcesResponse.devices = 1 (ContainerDevices: resource_name = 1, device_ids = 2).
"""

from __future__ import annotations

import grpc

METHOD = "/v1.PodResourcesLister/GetAllocatableResources"


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(data: bytes) -> list[tuple[int, bytes]]:
    """(field number, bytes) of each length-delimited field; others are skipped."""
    out, i = [], 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 2:
            size, i = _varint(data, i)
            out.append((number, data[i : i + size]))
            i += size
        elif wire == 0:
            _, i = _varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"wire type {wire} in a pod-resources response")
    return out


def allocatable_counts(response: bytes) -> dict[str, int]:
    counts: dict[str, int] = {}
    for number, devices in _fields(response):
        if number != 1:
            continue
        name, ids = "", 0
        for inner, value in _fields(devices):
            if inner == 1:
                name = value.decode()
            elif inner == 2:
                ids += 1
        counts[name] = counts.get(name, 0) + ids
    return counts


class PodResources:
    def __init__(self, socket_path: str) -> None:
        self._channel = grpc.insecure_channel("unix://" + socket_path)
        self._call = self._channel.unary_unary(
            METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )

    def allocatable(self, timeout: float = 2.0) -> dict[str, int]:
        return allocatable_counts(self._call(b"", timeout=timeout))

    def close(self) -> None:
        self._channel.close()
