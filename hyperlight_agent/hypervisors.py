"""The hypervisors we support: one row each. Supporting another is one more row.

Standard library only: the probe helper imports this module.
"""

from __future__ import annotations

import os

from . import probe

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time

if TYPE_CHECKING:
    from typing import Callable, Optional


class Hypervisor:
    """One supported hypervisor device. (A plain class, not a dataclass: the probe helper imports
    this module, and dataclasses would cost it more memory than the whole table.)

    >>> KVM.device_path("/dev"), KVM.container_path
    ('/dev/kvm', '/dev/kvm')
    """

    __slots__ = ("check", "name", "node")

    def __init__(self, name: str, node: str, check: Callable[[int], None]) -> None:
        self.name = name
        # The node's name under the device directory and under /dev in containers.
        self.node = node
        # The kernel-level usability check, run inside the probe helper on an open fd.
        self.check = check

    def __repr__(self) -> str:
        return f"Hypervisor({self.name!r})"

    def device_path(self, device_dir: str) -> str:
        return os.path.join(device_dir, self.node)

    @property
    def container_path(self) -> str:
        # The original path: what CDI and DeviceSpecs name on the host and in containers.
        return "/dev/" + self.node


MSHV = Hypervisor(name="mshv", node="mshv", check=probe.check_mshv)
KVM = Hypervisor(name="kvm", node="kvm", check=probe.check_kvm)

# Detection order: the first row present wins (on hosts with both, mshv, as the original did).
HYPERVISORS: tuple[Hypervisor, ...] = (MSHV, KVM)
BY_NAME = {h.name: h for h in HYPERVISORS}


def detect(device_dir: str) -> Optional[Hypervisor]:
    """The first hypervisor whose node exists under device_dir as a character device, or None.

    Uses lstat: a symlink or regular file at the path is "something there", so it is detected
    and then fails the probe with a reason, rather than silently falling through to another row.
    """
    for hypervisor in HYPERVISORS:
        try:
            os.lstat(hypervisor.device_path(device_dir))
        except FileNotFoundError:
            continue
        except OSError:
            return hypervisor
        return hypervisor
    return None

