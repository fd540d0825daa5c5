"""Who an instance of our agent is (`Identity`: fixed for its life) and what one said of itself
when asked (`Description`: Describe's answer, peers.py). Data only, below the kubelet sides' seam:
what the agent gives a side names who we are (kubelet_side.Wiring)."""

from __future__ import annotations

import functools
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from hyperlight_agent import __version__, contracts

AGENT = "hyperlight-agent"


# Where the package's source tree would be the top of a git checkout (`make run`, a fork's tests).
SOURCE_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIT_TIMEOUT_S = 2.0


def commit(environ: Mapping[str, str], source_tree: str = SOURCE_TREE) -> str:
    """The commit this code was built from: the image says it (HYPERLIGHT_AGENT_COMMIT), a git
    checkout has it; else "unknown" (an installed package)."""
    return environ.get(contracts.COMMIT_ENV) or _checkout_commit(source_tree)


@functools.lru_cache(maxsize=4)
def _checkout_commit(source_tree: str) -> str:
    if not os.path.exists(os.path.join(source_tree, ".git")):  # a directory, or a worktree's file
        return "unknown"
    try:
        done = subprocess.run(
            # The tree may be another user's (root running a developer's checkout): git would
            # refuse it as "dubious ownership"; only a commit id is read from it.
            ["git", "-c", f"safe.directory={source_tree}", "-C", source_tree, "rev-parse", "--verify", "-q", "HEAD"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):  # no git here
        return "unknown"
    found = done.stdout.strip()
    return found if done.returncode == 0 and len(found) in (40, 64) else "unknown"


def boottime_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class Identity:
    """Who an instance is: fixed for its life."""

    instance: str  # its instance name ("" under systemd without one)
    protocol: str  # "deviceplugin" or "dra"
    resource: str  # the device plugin's resource name, or the DRA driver's name
    started: int  # boottime_ns() at its start
    pid: int
    version: str = __version__
    agent: str = AGENT

    @classmethod
    def of(cls, instance: str, protocol: str, resource: str) -> Identity:
        return cls(instance, protocol, resource, boottime_ns(), os.getpid())

    @property
    def name(self) -> str:
        """How a log line names the instance."""
        return self.instance or f"pid {self.pid}"

    def same_kind(self, other: Identity) -> bool:
        """Another instance of ours serving the same resource over the same protocol."""
        return (other.agent, other.protocol, other.resource) == (self.agent, self.protocol, self.resource)

    def is_newer_than(self, other: Identity) -> bool:
        """Started later (ties broken by instance name, then pid: a total order)."""
        return (self.started, self.instance, self.pid) > (other.started, other.instance, other.pid)


@dataclass(frozen=True)
class Description:
    """What another instance answered: who it is, and how it stood then."""

    identity: Identity
    ready: bool
    path: str  # the socket it answered on
    # How its in-place upgrades stand (host/successor.py, UpgradeRecord); None from an instance that
    # cannot upgrade in place (an earlier release).
    upgrade: Optional[Mapping[str, Any]] = None
    # Ready but for what it shares with its peers (an earlier release's: its readiness).
    serving: bool = False
    # The kubelet's calls it has received (None from an earlier release: unknown).
    calls: Optional[int] = None
    # It waits for its predecessor's agreement before it registers (host/successor.py).
    registering: bool = False
    # The pid of the agent an in-place upgrade replaced with it (0: none).
    replaced: int = 0
    # Registered so recently that the kubelet may still take it back (dra/registration.py).
    settling: bool = False
    # Its stop has begun (it serves on at most until a successor of its own is ready), or an
    # in-place upgrade's child has taken over from it: no successor. (An earlier release: never says.)
    stopping: bool = False
