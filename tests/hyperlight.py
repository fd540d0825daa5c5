"""The real client: the Hyperlight example (deploy/examples/hyperlight), a host program on
hyperlight-host and its guest, built once for the session (its build.sh; cargo's and the fetched
standard library's caches outside the checkout make a later clone's build warm). The tests run it
wherever we hand the device through (a pod through the device plugin or a claim, podman with our
CDI spec) and check the guest's answer, not only that a VM could be created."""

from __future__ import annotations

import functools
import os
import subprocess
import time
from typing import NamedTuple

from tests import locks
from tests.e2e import tools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "deploy", "examples", "hyperlight", "build.sh")
OUT = os.path.join(ROOT, "build", "hyperlight-example")
LOG = "build/hyperlight-example.log"

# Where the image puts them (the example's Containerfile too): the host program finds its guest
# at /hyperlight-guest unless told otherwise.
HOST_IN_IMAGE, GUEST_IN_IMAGE = "/hyperlight-example", "/hyperlight-guest"
# What a run that reached the guest prints (the guest's Add(40, 2) came back).
ANSWER = "guest Add(40, 2) = 42"
# Hyperlight's own words when it has no hypervisor it can open (absent, or not ours to open).
NO_HYPERVISOR = "No hypervisor was found"


class Example(NamedTuple):
    host: str
    guest: str


@functools.cache
def example() -> Example:
    """Built here, or found built (another worker of the session may be building it: its lock)."""
    started = time.monotonic()
    with locks.locked(OUT + ".lock"):
        done = subprocess.run([BUILD, OUT], capture_output=True, text=True, timeout=1800, check=False)
    seconds = time.monotonic() - started
    with open(os.path.join(ROOT, LOG), "a") as log:
        log.write(done.stdout + done.stderr + f"hyperlight example ready in {seconds:.0f} s\n")
    tools.WAITED[LOG] = tools.WAITED.get(LOG, 0.0) + seconds
    assert done.returncode == 0, f"{BUILD} {OUT}: status {done.returncode}: {done.stderr[-3000:]}"
    built = Example(os.path.join(OUT, "hyperlight-example"), os.path.join(OUT, "hyperlight-guest"))
    assert all(os.path.isfile(p) for p in built), f"{built} missing after the build"
    return built
