"""The supported hypervisors' table (device/hypervisors.py): the kernel's ioctl numbers and request
structs, the rows' order and paths, detection, and each row's probe against injected ioctls for
every error path and descriptor cleanup. (Opening a device node and proving it is the host's:
test_device_kernel.py.)"""

from __future__ import annotations

import os
import struct
from typing import Any

import pytest

from hyperlight_agent.device import hypervisors, kernel
from tests.conftest import make_node


def _ioc(direction: int, kind: int, nr: int, size: int) -> int:
    # include/uapi/asm-generic/ioctl.h: dir << 30 | size << 16 | type << 8 | nr
    return (direction << 30) | (size << 16) | (kind << 8) | nr


def test_ioctl_numbers_follow_the_kernel_encoding() -> None:
    assert _ioc(0, 0xAE, 0x00, 0) == hypervisors.KVM_GET_API_VERSION
    assert _ioc(0, 0xAE, 0x01, 0) == hypervisors.KVM_CREATE_VM
    assert hypervisors.MSHV_CREATE_PARTITION == _ioc(1, 0xB8, 0x00, 16) == 0x4010B800


def test_mshv_request_is_the_16_byte_backward_compatible_struct() -> None:
    arg = hypervisors.mshv_create_partition_arg()
    assert len(arg) == hypervisors.MSHV_CREATE_PARTITION_SIZE == 16
    flags, isolation = struct.unpack("=QQ", arg)
    assert flags == 0b111  # LAPIC, X2APIC, GPA_SUPER_PAGES
    assert not flags & (1 << 3), "CPU_AND_XSAVE_FEATURES would select the 64-byte v2 struct"
    assert isolation == hypervisors.MSHV_PT_ISOLATION_NONE


def test_table_prefers_mshv_and_maps_paths() -> None:
    assert [h.name for h in hypervisors.HYPERVISORS] == ["mshv", "kvm"]
    for h in hypervisors.HYPERVISORS:
        assert h.container_path == f"/dev/{h.name}"
        assert h.device_path("/host-dev") == f"/host-dev/{h.name}"


@pytest.mark.root
def test_detect(tmp: str) -> None:
    assert hypervisors.detect(tmp) is None
    make_node(os.path.join(tmp, "kvm"), 10, 232)
    assert hypervisors.detect(tmp) is hypervisors.KVM
    make_node(os.path.join(tmp, "mshv"), 10, 100)
    assert hypervisors.detect(tmp) is hypervisors.MSHV


class Recorder:
    """An ioctl and close that record calls and fail where told."""

    def __init__(self, results: dict[int, Any]) -> None:
        self.results = results
        self.calls: list[tuple[int, int, Any]] = []
        self.closed: list[int] = []

    def ioctl(self, fd: int, request: int, arg: Any, *mutate: bool) -> Any:
        self.calls.append((fd, request, bytes(arg) if isinstance(arg, bytearray) else arg))
        result = self.results[request]
        if isinstance(result, OSError):
            raise result
        return result

    def close(self, fd: int) -> None:
        self.closed.append(fd)


def test_kvm_probe_creates_and_closes_one_vm() -> None:
    r = Recorder({hypervisors.KVM_GET_API_VERSION: 12, hypervisors.KVM_CREATE_VM: 99})
    hypervisors.probe_kvm(7, ioctl=r.ioctl, close=r.close)
    assert r.calls == [(7, hypervisors.KVM_GET_API_VERSION, 0), (7, hypervisors.KVM_CREATE_VM, 0)]
    assert r.closed == [99]


@pytest.mark.parametrize(
    ("results", "message"),
    [
        (
            {hypervisors.KVM_GET_API_VERSION: OSError(25, "Inappropriate ioctl for device")},
            "KVM_GET_API_VERSION failed: Inappropriate ioctl",
        ),
        ({hypervisors.KVM_GET_API_VERSION: 11}, "KVM API version is 11, expected 12"),
        (
            {hypervisors.KVM_GET_API_VERSION: 12, hypervisors.KVM_CREATE_VM: OSError(24, "Too many open files")},
            "KVM_CREATE_VM failed: Too many open files",
        ),
    ],
)
def test_kvm_probe_errors(results: dict[int, Any], message: str) -> None:
    r = Recorder(results)
    with pytest.raises(kernel.ProbeError, match=message):
        hypervisors.probe_kvm(7, ioctl=r.ioctl, close=r.close)
    assert r.closed == []  # no VM fd was ever returned


def test_mshv_probe_creates_and_closes_one_partition() -> None:
    r = Recorder({hypervisors.MSHV_CREATE_PARTITION: 42})
    hypervisors.probe_mshv(7, ioctl=r.ioctl, close=r.close)
    assert r.calls == [(7, hypervisors.MSHV_CREATE_PARTITION, hypervisors.mshv_create_partition_arg())]
    assert r.closed == [42]


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (OSError(22, "Invalid argument"), "MSHV_CREATE_PARTITION failed: Invalid argument"),
        (OSError(25, "Inappropriate ioctl for device"), "MSHV_CREATE_PARTITION failed: Inappropriate"),
        (-1, "returned -1, not a descriptor"),
    ],
)
def test_mshv_probe_errors(result: Any, message: str) -> None:
    r = Recorder({hypervisors.MSHV_CREATE_PARTITION: result})
    with pytest.raises(kernel.ProbeError, match=message):
        hypervisors.probe_mshv(7, ioctl=r.ioctl, close=r.close)
    assert r.closed == []
