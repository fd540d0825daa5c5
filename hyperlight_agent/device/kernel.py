"""Probing a device node at the kernel level: open it (never through a symlink), prove it is the
host's device, and run a hypervisor's probe on it (the probes are the rows' own: hypervisors.py).
A leaf: the standard library and text only.

A hypervisor ioctl can block in the kernel, so the agent never probes itself: the probe helper
process (helper_process.py) does, and the agent kills it when it misses its deadline (helper.py).
The helper is started with `python -I -S`: standard library only.
"""

from __future__ import annotations

import os
import stat

from hyperlight_agent import text

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time

if TYPE_CHECKING:  # typing costs the helper memory at run time; annotations need it only here
    from typing import Callable, Optional


class ProbeError(Exception):
    """A device failed its probe; the message names the path and the cause."""


def host_identity(host_path: str) -> int:
    """The device number of the host's node, which must be a character device (not a symlink)."""
    try:
        st = os.lstat(host_path)
    except FileNotFoundError as exc:
        raise ProbeError(f"{text.shown(host_path)}: host device node is missing") from exc
    except OSError as exc:
        raise ProbeError(f"{text.shown(host_path)}: cannot stat host device node: {text.cause(exc)}") from exc
    if not stat.S_ISCHR(st.st_mode):
        raise ProbeError(
            f"{text.shown(host_path)}: host device node is {text.file_kind(st.st_mode)}, not a character device"
        )
    return st.st_rdev


def probe_device(
    probe: Callable[[int], None],
    device_path: str,
    host_path: Optional[str] = None,
    open_: Callable[[str, int], int] = os.open,
    close: Callable[[int], None] = os.close,
) -> None:
    """Open device_path (never following symlinks), confirm it is the host's device, run probe.

    host_path is where the host's own node is visible (HOST_DEVICE_DIR); without it the device
    path is the host path. Raises ProbeError; the device fd is closed on every path.
    """
    expected_rdev = host_identity(host_path or device_path)
    try:
        fd = open_(device_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY)
    except OSError as exc:
        raise ProbeError(f"{text.shown(device_path)}: cannot open read/write: {text.cause(exc)}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISCHR(st.st_mode):
            raise ProbeError(f"{text.shown(device_path)}: is {text.file_kind(st.st_mode)}, not a character device")
        if st.st_rdev != expected_rdev:
            raise ProbeError(
                f"{text.shown(device_path)}: device {_numbers(st.st_rdev)} differs from the host's "
                f"{_numbers(expected_rdev)} at {text.shown(host_path or device_path)}"
            )
        try:
            probe(fd)
        except ProbeError as exc:
            raise ProbeError(f"{text.shown(device_path)}: {exc}") from exc
    finally:
        close(fd)


def _numbers(rdev: int) -> str:
    return f"{os.major(rdev)}:{os.minor(rdev)}"
