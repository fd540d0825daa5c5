"""The hypervisors we support: one row each. Supporting another is one more row.

Standard library only: the probe helper imports this module.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Callable, Optional

from . import probe


@dataclass(frozen=True)
class Hypervisor:
    """One supported hypervisor device.

    >>> KVM.device_path("/dev"), KVM.container_path
    ('/dev/kvm', '/dev/kvm')
    """

    name: str
    # The node's name under the device directory and under /dev in containers.
    node: str
    # The kernel-level usability check, run inside the probe helper on an open fd.
    check: Callable[[int], None]

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


def is_char_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.lstat(path).st_mode)
    except OSError:
        return False
