"""The tools the tests drive (helm, kubectl, the CNCF distribution registry, cosign, promtool),
built from their pinned Go modules into build/tools by tests/e2e/components/build.sh; never shipped.

`make test` starts that build in the background (at a lower priority) beside the first tests,
which need none of them (conftest.py runs the tests that do after those); the first test that
asks for a tool waits here for that one (its lock in build.sh), and finds it built from then on.

Why: docs/decisions/test-tools-from-go-modules.md.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "build", "tools")
BUILD = os.path.join(ROOT, "tests", "e2e", "components", "build.sh")
# How long the tests waited for each background build, by its log (the session's phases).
WAITED: dict[str, float] = {}


@functools.cache
def tool(name: str) -> str:
    """The path of one tool: built here if no build ran, else the running build waited for."""
    started = time.monotonic()
    done = subprocess.run([BUILD, TOOLS, "tools", name], capture_output=True, text=True, timeout=5400, check=False)
    WAITED["build/tools.log"] = WAITED.get("build/tools.log", 0.0) + time.monotonic() - started
    assert done.returncode == 0, f"{BUILD} {TOOLS} tools {name}: status {done.returncode}: {done.stderr[-3000:]}"
    path = os.path.join(TOOLS, name)
    assert os.access(path, os.X_OK), f"{name} is missing from {TOOLS} after its build"
    return path
