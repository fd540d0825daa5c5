"""`make run`: the demo the README opens with, run as a user would (it is the module `make run` calls)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.test_docs import ROOT

# Real agents on real device nodes (mknod) and the host's /dev/kvm.
pytestmark = pytest.mark.root


def test_make_run_shows_registration_slots_allocation_and_spec() -> None:
    with open(os.path.join(ROOT, "Makefile")) as f:
        assert re.search(r"^run: .*\n\t\$\(PY\) -m standin\.demo$", f.read(), re.M)
    result = subprocess.run(
        [sys.executable, "-m", "standin.demo"], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "== registered after" in out and "resource=hyperlight.dev/hypervisor" in out
    assert "== advertised 8 slots: kvm-0=Healthy" in out
    assert 'cdi_devices { name: "hyperlight.dev/hypervisor=kvm" }' in out
    spec = out.split("hyperlight.json:\n", 1)[1].split("== agent stopped", 1)[0]
    assert json.loads(spec)["kind"] == "hyperlight.dev/hypervisor"
    assert "== agent stopped with SIGTERM: exit 0" in out
    top = re.search(r"== hyperlight-agent demo in (\S+)", out)
    assert top and not os.path.exists(top.group(1)), "the demo removes its temporary directory"
