"""Probing a device node (device/kernel.py): real KVM where this machine has it, made-up nodes for
the host identity, every path opened and closed without following a symlink."""

from __future__ import annotations

import os

import pytest

from hyperlight_agent.device import hypervisors, kernel
from tests.conftest import make_node


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="this machine has no /dev/kvm")
def test_real_kvm_is_usable() -> None:
    kernel.probe_device(hypervisors.probe_kvm, "/dev/kvm")


def test_made_node_with_kvm_numbers_is_usable(kvm_dir: str) -> None:
    kernel.probe_device(hypervisors.probe_kvm, os.path.join(kvm_dir, "kvm"))


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


@pytest.mark.skipif(os.environ.get("TEST_MSHV_LIVE") != "1", reason="opt-in: TEST_MSHV_LIVE=1 on an MSHV host")
def test_mshv_live_partition_creation() -> None:
    """TEST_MSHV_LIVE=1: the real MSHV check on this host; fails clearly where /dev/mshv is absent."""
    assert os.path.exists("/dev/mshv"), "TEST_MSHV_LIVE=1 but this host has no /dev/mshv"
    kernel.probe_device(hypervisors.probe_mshv, "/dev/mshv")
