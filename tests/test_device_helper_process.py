"""The probe helper's own process (device/helper_process.py): a request line in, a result line out
with the reason in one short line, and nothing but the standard library and the probe's own modules
loaded. (The agent's side of the helper: test_device_helper.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

from hyperlight_agent.device import helper_process, kernel


def test_helper_protocol_reports_reasons(kvm_dir: str, tmp: str) -> None:
    assert helper_process.run_request({"hypervisor": "kvm", "device": os.path.join(kvm_dir, "kvm"), "host": None}) == {
        "ok": True,
        "reason": "",
    }
    bad = helper_process.run_request({"hypervisor": "kvm", "device": os.path.join(tmp, "none"), "host": None})
    assert not bad["ok"] and "missing" in bad["reason"]
    assert (
        helper_process.run_request({"hypervisor": "xen", "device": "/dev/xen", "host": None})["reason"]
        == "unknown hypervisor 'xen'"
    )
    assert helper_process.run_request({"hypervisor": "kvm"})["reason"].startswith("bad probe request")


def test_probe_modules_import_without_site_packages() -> None:
    # The helper runs under `python -I -S`: the probe and its imports must need nothing else.
    code = (
        "import io, sys; sys.path.insert(0, sys.argv[1]); "
        "from hyperlight_agent.device.helper_process import serve; "
        "serve(io.StringIO(sys.argv[2] + '\\n'), io.StringIO()); "
        "print(sorted(m for m in sys.modules if 'grpc' in m or m.startswith(('google', 'hyperlight')) "
        "or m in ('typing', 'dataclasses', 'asyncio')))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(kernel.__file__))))
    request = '{"hypervisor": "kvm", "device": "/dev/null", "host": null}'
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, root, request], capture_output=True, text=True, check=True, timeout=30
    )
    # After serving a request the helper holds exactly these agent modules (standard library
    # only), and none of grpc, typing, dataclasses or asyncio: it stays small.
    assert out.stdout.strip() == str(
        [
            "hyperlight_agent",
            "hyperlight_agent.device",
            "hyperlight_agent.device.helper_process",
            "hyperlight_agent.device.hypervisors",
            "hyperlight_agent.device.kernel",
            "hyperlight_agent.text",
        ]
    )


def test_a_long_path_in_a_request_gives_a_short_reason(tmp: str) -> None:
    """Found by the helper fuzzer: a 1149-character host path came back whole in the reason."""
    host = os.path.join(tmp, *["segment" * 9] * 20)
    reply = helper_process.run_request({"hypervisor": "kvm", "device": os.path.join(tmp, "kvm"), "host": host})
    assert reply["ok"] is False and len(reply["reason"]) < 300, reply
    assert reply["reason"].endswith(f"({len(host)} characters): host device node is missing")
