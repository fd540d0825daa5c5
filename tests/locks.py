"""Locks across the test session's processes (`make test` runs pytest's workers side by side):
what they share on disk is built by one of them at a time."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The work tree's build/ as make writes it (the wheels, packages and image-wheels of `make release`
# and `make image`, build/venv): one make into it at a time.
BUILD_TREE_LOCK = os.path.join(ROOT, "build", ".make.lock")

_held: dict[str, int] = {}
_guard = threading.Lock()


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """An exclusive lock on path (a file made for it) across processes; taken again by a process
    that holds it already, it is held until the outermost release."""
    with _guard:
        depth = _held.get(path, 0)
        _held[path] = depth + 1
    if depth:
        try:
            yield
        finally:
            with _guard:
                _held[path] -= 1
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        with _guard:
            del _held[path]


def shared_build_tree() -> contextlib.AbstractContextManager[None]:
    """Held while a test makes something into the work tree's build/."""
    return locked(BUILD_TREE_LOCK)
