"""The kernel-level checks: real KVM where this machine has it, made-up nodes for identity,
and injected ioctls for every error path and descriptor cleanup."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from typing import Any

import pytest

from hyperlight_agent.device import helper_process, hypervisors, kernel
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


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="this machine has no /dev/kvm")
def test_real_kvm_is_usable() -> None:
    kernel.probe_device(hypervisors.probe_kvm, "/dev/kvm")


def test_made_node_with_kvm_numbers_is_usable(kvm_dir: str) -> None:
    kernel.probe_device(hypervisors.probe_kvm, os.path.join(kvm_dir, "kvm"))


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


def test_device_fd_is_closed_on_every_path(kvm_dir: str) -> None:
    opened: list[int] = []
    closed: list[int] = []

    def open_(path: str, flags: int) -> int:
        assert flags & os.O_NOFOLLOW and flags & os.O_RDWR
        fd = os.open(path, flags)
        opened.append(fd)
        return fd

    def close(fd: int) -> None:
        closed.append(fd)
        os.close(fd)

    def failing(fd: int) -> None:
        raise kernel.ProbeError("boom")

    with pytest.raises(kernel.ProbeError, match="boom"):
        kernel.probe_device(failing, os.path.join(kvm_dir, "kvm"), open_=open_, close=close)
    kernel.probe_device(hypervisors.probe_kvm, os.path.join(kvm_dir, "kvm"), open_=open_, close=close)
    assert opened == closed and len(opened) == 2


@pytest.mark.root
@pytest.mark.parametrize("hypervisor", hypervisors.HYPERVISORS, ids=lambda h: h.name)
def test_dev_null_is_not_a_hypervisor(tmp: str, hypervisor: hypervisors.Hypervisor) -> None:
    # /dev/null's numbers at the device path, with a matching host identity: only the ioctl can
    # tell, and it must.
    node = make_node(os.path.join(tmp, hypervisor.node), 1, 3)
    with pytest.raises(kernel.ProbeError, match="failed: Inappropriate ioctl for device"):
        kernel.probe_device(hypervisor.probe, node)


def test_host_identity_cases(tmp: str, kvm_dir: str) -> None:
    device = os.path.join(kvm_dir, "kvm")
    host = os.path.join(tmp, "host")
    os.mkdir(host)
    host_kvm = os.path.join(host, "kvm")
    with pytest.raises(kernel.ProbeError, match="host device node is missing"):
        kernel.probe_device(hypervisors.probe_kvm, device, host_kvm)
    make_node(host_kvm, 10, 232)
    kernel.probe_device(hypervisors.probe_kvm, device, host_kvm)  # same numbers: fine
    os.unlink(host_kvm)
    make_node(host_kvm, 10, 233)
    with pytest.raises(kernel.ProbeError, match="device 10:232 differs from the host's 10:233"):
        kernel.probe_device(hypervisors.probe_kvm, device, host_kvm)
    os.unlink(host_kvm)
    with open(host_kvm, "w"):
        pass
    with pytest.raises(kernel.ProbeError, match="is a regular file, not a character device"):
        kernel.probe_device(hypervisors.probe_kvm, device, host_kvm)
    os.unlink(host_kvm)
    os.symlink(device, host_kvm)
    with pytest.raises(kernel.ProbeError, match="is a symlink, not a character device"):
        kernel.probe_device(hypervisors.probe_kvm, device, host_kvm)


def test_device_path_symlink_or_file_is_refused(tmp: str, kvm_dir: str) -> None:
    link = os.path.join(tmp, "kvm-link")
    os.symlink(os.path.join(kvm_dir, "kvm"), link)
    with pytest.raises(kernel.ProbeError, match="symlink"):
        kernel.probe_device(hypervisors.probe_kvm, link)
    regular = os.path.join(tmp, "kvm-file")
    with open(regular, "w"):
        pass
    with pytest.raises(kernel.ProbeError, match="regular file"):
        kernel.probe_device(hypervisors.probe_kvm, regular)


def test_helper_protocol_reports_reasons(kvm_dir: str, tmp: str) -> None:
    assert helper_process.run_request({"hypervisor": "kvm", "device": os.path.join(kvm_dir, "kvm"), "host": None}) == {
        "ok": True,
        "reason": "",
    }
    bad = helper_process.run_request({"hypervisor": "kvm", "device": os.path.join(tmp, "none"), "host": None})
    assert not bad["ok"] and "missing" in bad["reason"]
    assert (
        helper_process.run_request({"hypervisor": "xen", "device": "/dev/xen", "host": None})["reason"]
        == "unknown hypervisor 'xen'"
    )
    assert helper_process.run_request({"hypervisor": "kvm"})["reason"].startswith("bad probe request")


@pytest.mark.skipif(os.environ.get("TEST_MSHV_LIVE") != "1", reason="opt-in: TEST_MSHV_LIVE=1 on an MSHV host")
def test_mshv_live_partition_creation() -> None:
    """TEST_MSHV_LIVE=1: the real MSHV check on this host; fails clearly where /dev/mshv is absent."""
    assert os.path.exists("/dev/mshv"), "TEST_MSHV_LIVE=1 but this host has no /dev/mshv"
    kernel.probe_device(hypervisors.probe_mshv, "/dev/mshv")


def test_probe_modules_import_without_site_packages() -> None:
    # The helper runs under `python -I -S`: the probe and its imports must need nothing else.
    code = (
        "import io, sys; sys.path.insert(0, sys.argv[1]); "
        "from hyperlight_agent.device.helper_process import serve; "
        "serve(io.StringIO(sys.argv[2] + '\\n'), io.StringIO()); "
        "print(sorted(m for m in sys.modules if 'grpc' in m or m.startswith(('google', 'hyperlight')) "
        "or m in ('typing', 'dataclasses', 'asyncio')))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(kernel.__file__))))
    request = '{"hypervisor": "kvm", "device": "/dev/null", "host": null}'
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, root, request], capture_output=True, text=True, check=True, timeout=30
    )
    # After serving a request the helper holds exactly these agent modules (standard library
    # only), and none of grpc, typing, dataclasses or asyncio: it stays small.
    assert out.stdout.strip() == str(
        [
            "hyperlight_agent",
            "hyperlight_agent.device",
            "hyperlight_agent.device.helper_process",
            "hyperlight_agent.device.hypervisors",
            "hyperlight_agent.device.kernel",
            "hyperlight_agent.text",
        ]
    )


def test_a_long_path_in_a_request_gives_a_short_reason(tmp: str) -> None:
    """Found by the helper fuzzer: a 1149-character host path came back whole in the reason."""
    host = os.path.join(tmp, *["segment" * 9] * 20)
    reply = helper_process.run_request({"hypervisor": "kvm", "device": os.path.join(tmp, "kvm"), "host": host})
    assert reply["ok"] is False and len(reply["reason"]) < 300, reply
    assert reply["reason"].endswith(f"({len(host)} characters): host device node is missing")
