"""The real client: the Hyperlight example (deploy/examples/hyperlight), a host program on
hyperlight-host and its guest, built once for the session (its build.sh; cargo's and the fetched
standard library's caches outside the checkout make a later clone's build warm). The tests run it
wherever we hand the device through (a pod through the device plugin or a claim, podman with our
CDI spec) and check the guest's answer, not only that a VM could be created."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from typing import NamedTuple

from tests import locks
from tests.e2e import tools

ROOT = locks.ROOT
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


# The figure users care about (issue 48): a sandbox's build and a guest call's round trip, the
# medians of this many runs, where we hand the device over and on the host, in the same session.
FIGURE_RUNS = 10
MEASURE_IN_IMAGE = f"{HOST_IN_IMAGE} --json --runs {FIGURE_RUNS}"


def beside_the_host(said: str) -> dict[str, float]:
    """The --json line in `said` (a container's output) beside the same runs on this host, and
    their ratios: figures, never bounds."""
    (line,) = [x for x in said.splitlines() if x.startswith("{")]
    there = json.loads(line)
    built = example()
    done = subprocess.run(
        [built.host, "--guest", built.guest, "--json", "--runs", str(FIGURE_RUNS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    here = json.loads(done.stdout)
    return {
        "build_ms": there["build_ms"],
        "host_build_ms": here["build_ms"],
        "build_ratio": round(there["build_ms"] / here["build_ms"], 2),
        "call_us": there["call_us"],
        "host_call_us": here["call_us"],
        "call_ratio": round(there["call_us"] / here["call_us"], 2),
    }
