"""Rootful podman for the system tests, with private storage under a test's own temp dir and the
settings these machines need (runc, cgroupfs, ulimits), and the lock every test holds while it
writes the system CDI directories podman 4.3 reads."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

from tests import locks

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""

# /etc/cdi and /var/run/cdi are shared by every checkout's tests on this machine: a test that
# writes there holds this lock for as long as its files exist.
SYSTEM_CDI_LOCK = "/run/lock/hyperlight-agent-system-cdi.lock"


def system_cdi_lock() -> contextlib.AbstractContextManager[None]:
    return locks.locked(SYSTEM_CDI_LOCK)


class Podman:
    """`podman` with storage in `directory`; `argv` is the command prefix, `env` its environment."""

    def __init__(self, directory: str) -> None:
        assert shutil.which("podman"), "podman is missing: `make test` installs it"
        self.directory = directory
        conf = os.path.join(directory, "containers.conf")
        with open(conf, "w") as f:
            f.write(CONTAINERS_CONF)
        self.argv = [
            "podman",
            "--root",
            os.path.join(directory, "storage"),
            "--runroot",
            os.path.join(directory, "run"),
            "--storage-driver",
            "vfs",
        ]
        self.env = {**os.environ, "CONTAINERS_CONF": conf}

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.argv, *args], capture_output=True, text=True, env=self.env, timeout=timeout, check=check
        )

    def close(self) -> None:
        """Remove every container and image this storage holds, then the storage itself."""
        self("rm", "-a", "-f", "-t", "0", check=False)
        self("rmi", "-a", "-f", check=False)
        subprocess.run(["umount", "-R", os.path.join(self.directory, "storage")], check=False, capture_output=True)
