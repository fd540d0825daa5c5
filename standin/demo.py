"""`make run`: the agent against a kubelet stand-in in a temporary directory, narrated.

Starts the stand-in, starts the agent as a real process (real probe of /dev/kvm when present),
shows registration, the advertised slots, one Allocate response and the CDI spec it wrote,
then stops the agent with SIGTERM and removes the temporary directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from hyperlight_agent import contracts
from hyperlight_agent.device import hypervisors
from standin.kubelet import StandinThread

SLOTS = 8


def main() -> int:
    top = tempfile.mkdtemp(prefix="hyperlight-demo-")
    detected = hypervisors.detect("/dev")
    print(f"== hyperlight-agent demo in {top}")
    print(f"   hypervisor device on this machine: {detected.device_path('/dev') if detected else 'none'}")
    try:
        with StandinThread(os.path.join(top, "device-plugins")) as kubelet:
            print(f"== kubelet stand-in serving {kubelet.kubelet.socket_path}")
            agent = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hyperlight_agent",
                    "--config",
                    "/dev/null",
                    "--kubelet-dir",
                    kubelet.kubelet.directory,
                    "--cdi-dir",
                    os.path.join(top, "cdi"),
                    "--device-count",
                    str(SLOTS),
                ]
            )
            try:
                _narrate(kubelet, os.path.join(top, "cdi"))
            finally:
                # Stop the agent while the stand-in still runs, the order a node shuts down in.
                agent.terminate()
                print(f"== agent stopped with SIGTERM: exit {agent.wait(10)}")
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return 0


def _narrate(kubelet: StandinThread, cdi_dir: str) -> None:
    started = time.monotonic()
    plugin = kubelet.wait_until(lambda k: k.plugins.get(contracts.RESOURCE_HYPERVISOR), timeout=15, what="registration")
    request = kubelet.kubelet.register_calls[-1][1]
    print(
        f"== registered after {time.monotonic() - started:.2f} s: version={request.version} "
        f"endpoint={request.endpoint} resource={request.resource_name}"
    )
    kubelet.wait_until(lambda k: plugin.lists, timeout=15, what="the first device list")
    devices = plugin.devices
    print(f"== advertised {len(devices)} slots: " + ", ".join(f"{i}={h}" for i, h in devices))
    if not devices or devices[0][1] != contracts.HEALTHY:
        print("== no usable hypervisor here: nothing Healthy to allocate")
        return
    response = kubelet.call(kubelet.kubelet.allocate(contracts.RESOURCE_HYPERVISOR, [devices[0][0]]))
    print(f"== Allocate([{devices[0][0]}]) -> " + " ".join(str(response).split()))
    spec = os.path.join(cdi_dir, contracts.CDI_SPEC_FILE)
    print(f"== CDI spec {spec}:")
    with open(spec) as f:
        print(f.read(), end="")


if __name__ == "__main__":
    sys.exit(main())
