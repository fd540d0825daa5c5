"""The hypervisors we support: one section each, with what the kernel says (its ioctl numbers),
the probe that proves a device usable, and the row the rest of the agent reads. Supporting
another is one more section and one more entry in HYPERVISORS (a test holds the unit's
DeviceAllow= and the deployment docs to the table).

Standard library only: the probe helper (helper_process.py) imports this module.

Why: docs/decisions/character-devices-only.md.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct

from hyperlight_agent.device.kernel import ProbeError
from hyperlight_agent.text import cause

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time

if TYPE_CHECKING:
    from typing import Any, Callable, Optional

    # ioctl(fd, request, arg[, mutate]) -> int; a parameter so tests can drive every error path.
    Ioctl = Callable[..., Any]


class Hypervisor:
    """One supported hypervisor device. (A plain class, not a dataclass: the probe helper imports
    this module, and dataclasses would cost it more memory than the whole table.)

    >>> KVM.device_path("/dev"), KVM.container_path
    ('/dev/kvm', '/dev/kvm')
    """

    __slots__ = ("api_version", "missing_hint", "name", "node", "probe", "proved")

    def __init__(
        self,
        name: str,
        node: str,
        probe: Callable[[int], None],
        api_version: Optional[int],
        proved: str,
        missing_hint: str,
    ) -> None:
        self.name = name
        # The node's name under the device directory and under /dev in containers.
        self.node = node
        # The kernel-level probe, run inside the probe helper on an open fd (kernel.probe_device).
        self.probe = probe
        # The API version a device that passes the probe reports (KVM's probe requires exactly
        # this one); None where the probe reads none. Published as a DRA device attribute.
        self.api_version = api_version
        # What a passed probe proved, for `--check`'s report.
        self.proved = proved
        # Where this hypervisor usually comes from, for `--check`'s report when no device is found.
        self.missing_hint = missing_hint

    def __repr__(self) -> str:
        return f"Hypervisor({self.name!r})"

    def device_path(self, device_dir: str) -> str:
        return os.path.join(device_dir, self.node)

    @property
    def container_path(self) -> str:
        # The original path: what CDI and DeviceSpecs name on the host and in containers.
        return "/dev/" + self.node


# --- MSHV (owner: the kernel, include/uapi/linux/mshv.h) ---
MSHV_CREATE_PARTITION = 0x4010B800  # _IOW(0xB8, 0x00, struct mshv_create_partition)
MSHV_PT_BIT_LAPIC = 0
MSHV_PT_BIT_X2APIC = 1
MSHV_PT_BIT_GPA_SUPER_PAGES = 2
# Bit 3 (CPU_AND_XSAVE_FEATURES) switches to a 64-byte struct that older kernels reject;
# we never set it, so CPU and XSAVE features stay at the kernel's defaults.
MSHV_PT_ISOLATION_NONE = 0
MSHV_CREATE_PARTITION_SIZE = 16


def mshv_create_partition_arg() -> bytes:
    """The 16-byte backward-compatible `struct mshv_create_partition` (no CPU/XSAVE bit)."""
    flags = (1 << MSHV_PT_BIT_LAPIC) | (1 << MSHV_PT_BIT_X2APIC) | (1 << MSHV_PT_BIT_GPA_SUPER_PAGES)
    return struct.pack("=QQ", flags, MSHV_PT_ISOLATION_NONE)


def probe_mshv(fd: int, ioctl: Ioctl = fcntl.ioctl, close: Callable[[int], None] = os.close) -> None:
    """MSHV_CREATE_PARTITION with the 16-byte argument, then close the partition uninitialised."""
    arg = bytearray(mshv_create_partition_arg())
    try:
        # mutate=True makes fcntl.ioctl return the syscall's result (the partition fd).
        partition_fd = ioctl(fd, MSHV_CREATE_PARTITION, arg, True)
    except OSError as exc:
        raise ProbeError(f"MSHV_CREATE_PARTITION failed: {cause(exc)}") from exc
    if not isinstance(partition_fd, int) or partition_fd < 0:
        raise ProbeError(f"MSHV_CREATE_PARTITION returned {partition_fd!r}, not a descriptor")
    close(partition_fd)


MSHV = Hypervisor(
    name="mshv",
    node="mshv",
    probe=probe_mshv,
    api_version=None,
    proved="partition created and closed",
    missing_hint="/dev/mshv: an Azure Linux host running as the Microsoft Hypervisor's root partition "
    "with the mshv driver loaded",
)


# --- KVM (owner: the kernel, include/uapi/linux/kvm.h) ---
KVM_API_VERSION = 12
KVM_GET_API_VERSION = 0xAE00  # _IO(0xAE, 0x00)
KVM_CREATE_VM = 0xAE01  # _IO(0xAE, 0x01)
KVM_VM_TYPE_DEFAULT = 0


def probe_kvm(fd: int, ioctl: Ioctl = fcntl.ioctl, close: Callable[[int], None] = os.close) -> None:
    """KVM_GET_API_VERSION must be 12, then an empty VM is created and destroyed."""
    try:
        version = ioctl(fd, KVM_GET_API_VERSION, 0)
    except OSError as exc:
        raise ProbeError(f"KVM_GET_API_VERSION failed: {cause(exc)}") from exc
    if version != KVM_API_VERSION:
        raise ProbeError(f"KVM API version is {version}, expected {KVM_API_VERSION}")
    try:
        vm_fd = ioctl(fd, KVM_CREATE_VM, KVM_VM_TYPE_DEFAULT)
    except OSError as exc:
        raise ProbeError(f"KVM_CREATE_VM failed: {cause(exc)}") from exc
    # Closing the VM fd destroys the VM; no memory regions or vCPUs were ever created.
    close(vm_fd)


KVM = Hypervisor(
    name="kvm",
    node="kvm",
    probe=probe_kvm,
    api_version=KVM_API_VERSION,
    proved="empty VM created and closed",
    missing_hint="/dev/kvm: virtualisation switched on in the firmware and the kvm module loaded "
    "(modprobe kvm_intel or kvm_amd); on a VM, a size that offers nested virtualisation "
    "(e.g. Azure Dv3/Ev3 and newer, GCE with --enable-nested-virtualization)",
)


# Detection order: the first row present wins (on hosts with both, mshv, as the original did).
HYPERVISORS: tuple[Hypervisor, ...] = (MSHV, KVM)
BY_NAME = {h.name: h for h in HYPERVISORS}


def present(device_dir: str) -> list[Hypervisor]:
    """The rows whose node under device_dir is a character device, in detection order.

    lstat only, nothing is opened: a symlink, regular file or anything else at a row's path is
    not that hypervisor (junk at /dev/mshv must not hide a working /dev/kvm).
    """
    found = []
    for hypervisor in HYPERVISORS:
        try:
            st = os.lstat(hypervisor.device_path(device_dir))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            found.append(hypervisor)
    return found


def detect(device_dir: str) -> Optional[Hypervisor]:
    """The first row present as a character device, or None."""
    found = present(device_dir)
    return found[0] if found else None


def absence_reason(device_dir: str) -> str:
    """Why no row is present, naming whatever non-device sits at a row's path."""
    if not os.path.isdir(device_dir):
        return f"no hypervisor device in {device_dir}: the directory does not exist"
    odd = []
    for hypervisor in HYPERVISORS:
        path = hypervisor.device_path(device_dir)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        odd.append(f"{path} is not a character device (mode {stat.filemode(st.st_mode)})")
    names = ", ".join(h.node for h in HYPERVISORS)
    return f"no hypervisor device in {device_dir} (looked for {names})" + ("; " + "; ".join(odd) if odd else "")
