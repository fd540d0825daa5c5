"""Kernel-level usability checks: a leaf (it imports only contracts and the standard library).

A hypervisor ioctl can block in the kernel, so the agent never calls these itself: the probe
helper process (helper_process.py) runs them, and the agent kills it when it misses its deadline
(helper.py). The helper is started with `python -I -S`: standard library only.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct

from hyperlight_agent import contracts, text

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time

if TYPE_CHECKING:  # typing costs the helper memory at run time; annotations need it only here
    from typing import Any, Callable, Optional

    # ioctl(fd, request, arg[, mutate]) -> int; a parameter so tests can drive every error path.
    Ioctl = Callable[..., Any]


class ProbeError(Exception):
    """A device failed a check; the message names the path and the cause."""


def mshv_create_partition_arg() -> bytes:
    """The 16-byte backward-compatible `struct mshv_create_partition` (no CPU/XSAVE bit)."""
    flags = (
        (1 << contracts.MSHV_PT_BIT_LAPIC)
        | (1 << contracts.MSHV_PT_BIT_X2APIC)
        | (1 << contracts.MSHV_PT_BIT_GPA_SUPER_PAGES)
    )
    return struct.pack("=QQ", flags, contracts.MSHV_PT_ISOLATION_NONE)


def check_kvm(fd: int, ioctl: Ioctl = fcntl.ioctl, close: Callable[[int], None] = os.close) -> None:
    """KVM_GET_API_VERSION must be 12, then an empty VM is created and destroyed."""
    try:
        version = ioctl(fd, contracts.KVM_GET_API_VERSION, 0)
    except OSError as exc:
        raise ProbeError(f"KVM_GET_API_VERSION failed: {exc.strerror or exc}") from exc
    if version != contracts.KVM_API_VERSION:
        raise ProbeError(f"KVM API version is {version}, expected {contracts.KVM_API_VERSION}")
    try:
        vm_fd = ioctl(fd, contracts.KVM_CREATE_VM, contracts.KVM_VM_TYPE_DEFAULT)
    except OSError as exc:
        raise ProbeError(f"KVM_CREATE_VM failed: {exc.strerror or exc}") from exc
    # Closing the VM fd destroys the VM; no memory regions or vCPUs were ever created.
    close(vm_fd)


def check_mshv(fd: int, ioctl: Ioctl = fcntl.ioctl, close: Callable[[int], None] = os.close) -> None:
    """MSHV_CREATE_PARTITION with the 16-byte argument, then close the partition uninitialised."""
    arg = bytearray(mshv_create_partition_arg())
    try:
        # mutate=True makes fcntl.ioctl return the syscall's result (the partition fd).
        partition_fd = ioctl(fd, contracts.MSHV_CREATE_PARTITION, arg, True)
    except OSError as exc:
        raise ProbeError(f"MSHV_CREATE_PARTITION failed: {exc.strerror or exc}") from exc
    if not isinstance(partition_fd, int) or partition_fd < 0:
        raise ProbeError(f"MSHV_CREATE_PARTITION returned {partition_fd!r}, not a descriptor")
    close(partition_fd)


def host_identity(host_path: str) -> int:
    """The device number of the host's node, which must be a character device (not a symlink)."""
    try:
        st = os.lstat(host_path)
    except FileNotFoundError as exc:
        raise ProbeError(f"{text.shown(host_path)}: host device node is missing") from exc
    except OSError as exc:
        raise ProbeError(f"{text.shown(host_path)}: cannot stat host device node: {exc.strerror}") from exc
    if not stat.S_ISCHR(st.st_mode):
        raise ProbeError(f"{text.shown(host_path)}: host device node is {_kind(st.st_mode)}, not a character device")
    return st.st_rdev


def check_device(
    check: Callable[[int], None],
    device_path: str,
    host_path: Optional[str] = None,
    open_: Callable[[str, int], int] = os.open,
    close: Callable[[int], None] = os.close,
) -> None:
    """Open device_path (never following symlinks), confirm it is the host's device, run check.

    host_path is where the host's own node is visible (HOST_DEVICE_DIR); without it the device
    path is the host path. Raises ProbeError; the device fd is closed on every path.
    """
    expected_rdev = host_identity(host_path or device_path)
    try:
        fd = open_(device_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY)
    except OSError as exc:
        raise ProbeError(f"{text.shown(device_path)}: cannot open read/write: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISCHR(st.st_mode):
            raise ProbeError(f"{text.shown(device_path)}: is {_kind(st.st_mode)}, not a character device")
        if st.st_rdev != expected_rdev:
            raise ProbeError(
                f"{text.shown(device_path)}: device {_numbers(st.st_rdev)} differs from the host's "
                f"{_numbers(expected_rdev)} at {text.shown(host_path or device_path)}"
            )
        try:
            check(fd)
        except ProbeError as exc:
            raise ProbeError(f"{text.shown(device_path)}: {exc}") from exc
    finally:
        close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a device"


def _numbers(rdev: int) -> str:
    return f"{os.major(rdev)}:{os.minor(rdev)}"
