"""Node labels without Kubernetes credentials: a node-feature-discovery local feature file.

NFD's local source reads every file in its features.d directory (names starting with "." are
ignored, which our temp files use) and turns `name=value` lines into node labels. The file says
which hypervisor this node has; it is rewritten when that changes and removed when there is none.
NFD must be allowed the hyperlight.dev label namespace (-extra-label-ns=hyperlight.dev).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from hyperlight_agent.files import atomic
from hyperlight_agent.files.watcher import CONTENT, DirectoryWatcher
from hyperlight_agent.text import cause

log = logging.getLogger(__name__)

FEATURE_FILE = "hyperlight"
TEMP_PREFIX = ".hyperlight."
FILE_MODE = 0o644
ENABLED_LABEL = "hyperlight.dev/enabled"
HYPERVISOR_LABEL = "hyperlight.dev/hypervisor"


def render(hypervisor: str) -> bytes:
    """The feature file's content.

    >>> render("kvm")
    b'hyperlight.dev/enabled=true\\nhyperlight.dev/hypervisor=kvm\\n'
    """
    return f"{ENABLED_LABEL}=true\n{HYPERVISOR_LABEL}={hypervisor}\n".encode()


def sync(features_dir: str, hypervisor: Optional[str]) -> bool:
    """Make the feature file match `hypervisor` (None: remove it). True if anything changed.

    Raises OSError, or atomic.Refused when something other than a regular file is at our path
    (it is never followed, replaced or removed); the caller logs either (labels are advice to the
    scheduler, not health).
    """
    path = os.path.join(features_dir, FEATURE_FILE)
    atomic.remove_temps(features_dir, TEMP_PREFIX)
    wanted = render(hypervisor) if hypervisor else b""
    current = atomic.read_regular(path, len(wanted) + 1)
    if hypervisor is None:
        if current is None:
            return False
        os.unlink(path)
        log.info("node labels withdrawn: removed %s", path)
        return True
    if atomic.is_exact(current, wanted, FILE_MODE):
        return False
    os.makedirs(features_dir, mode=0o755, exist_ok=True)
    atomic.write(
        features_dir,
        FEATURE_FILE,
        wanted,
        TEMP_PREFIX,
        mode=FILE_MODE,
        replace=current.identity if current is not None else None,
    )
    log.info("node labels %s=true, %s=%s written to %s", ENABLED_LABEL, HYPERVISOR_LABEL, hypervisor, path)
    return True


class Keeper:
    """The feature file kept right from one place: synced after every device check and whenever
    the file changes (a deleted or edited file is repaired; anything but a regular file at our
    path is refused). A problem is logged once, until it changes."""

    def __init__(self, features_dir: str) -> None:
        self.features_dir = features_dir
        self._problem = ""  # why the file cannot be kept right ("" when it is)
        self._told: Optional[tuple[Optional[str]]] = None  # the last sync's hypervisor, once one came
        self._closed = False

    def watch(self, watcher: DirectoryWatcher) -> None:
        """Someone changed the file: put it right, once a check has said what it says."""
        watcher.watch(self.features_dir, lambda name: self._changed(), {FEATURE_FILE}, mask=CONTENT)

    def close(self) -> None:
        """No more syncs from file events (the agent stops; the file stays as it is)."""
        self._closed = True

    def _changed(self) -> None:
        if self._told is not None and not self._closed:
            self.sync(self._told[0])

    def sync(self, hypervisor: Optional[str]) -> None:
        self._told = (hypervisor,)
        problem = ""
        try:
            sync(self.features_dir, hypervisor)
        except atomic.Refused as exc:
            problem = f"node labels not written: {exc}"
        except OSError as exc:
            problem = f"cannot write node labels in {self.features_dir} (nfd_features_dir): {cause(exc)}"
        if problem and problem != self._problem:
            log.warning("%s", problem)
        self._problem = problem
