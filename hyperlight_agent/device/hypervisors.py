"""The hypervisors we support: one row each. Supporting another is one more row.

Standard library only: the probe helper (helper_process.py) imports this module.
"""

from __future__ import annotations

import os
import stat

from hyperlight_agent import contracts
from hyperlight_agent.device import kernel

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time

if TYPE_CHECKING:
    from typing import Callable, Optional


class Hypervisor:
    """One supported hypervisor device. (A plain class, not a dataclass: the probe helper imports
    this module, and dataclasses would cost it more memory than the whole table.)

    >>> KVM.device_path("/dev"), KVM.container_path
    ('/dev/kvm', '/dev/kvm')
    """

    __slots__ = ("api_version", "check", "name", "node")

    def __init__(self, name: str, node: str, check: Callable[[int], None], api_version: Optional[int]) -> None:
        self.name = name
        # The node's name under the device directory and under /dev in containers.
        self.node = node
        # The kernel-level usability check, run inside the probe helper on an open fd.
        self.check = check
        # The API version a device that passes the check reports (KVM's check requires exactly
        # this one); None where the check reads none. Published as a DRA device attribute.
        self.api_version = api_version

    def __repr__(self) -> str:
        return f"Hypervisor({self.name!r})"

    def device_path(self, device_dir: str) -> str:
        return os.path.join(device_dir, self.node)

    @property
    def container_path(self) -> str:
        # The original path: what CDI and DeviceSpecs name on the host and in containers.
        return "/dev/" + self.node


MSHV = Hypervisor(name="mshv", node="mshv", check=kernel.check_mshv, api_version=None)
KVM = Hypervisor(name="kvm", node="kvm", check=kernel.check_kvm, api_version=contracts.KVM_API_VERSION)

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
