"""The systemd-nspawn harness itself (tests/nspawn.py): what a test may rely on when it compares a
guest's state before and after."""

from __future__ import annotations

import os

import pytest

from tests import nspawn

pytestmark = [pytest.mark.system, pytest.mark.root]

# A boot job ordered after multi-user.target, as systemd-update-utmp-runlevel.service is: held
# until the test lets it go (a file it waits for), so that the window the purge tests once took
# their baseline in (CI failed on a cold machine with this job's invocation link and journal stream
# in "before" only) stays open for as long as the test looks, however loaded the machine.
LATE_JOB = "systemd-update-utmp-runlevel.service"
GO = "/run/late-job-go"
HELD = f"[Service]\nExecStartPre=/bin/sh -c 'until [ -e {GO} ]; do sleep 0.1; done'\n"


def test_a_settled_guest_has_run_the_boot_jobs_ordered_after_multi_user(tmp: str) -> None:
    dropin = os.path.join(tmp, "held")
    os.makedirs(dropin)
    with open(os.path.join(dropin, "held.conf"), "w") as f:
        f.write(HELD)
    with nspawn.Guest(nspawn.rootfs(), [f"{dropin}:/etc/systemd/system/{LATE_JOB}.d"]) as guest:
        # In a group of its own: two guests in one (nspawn's "payload" under a worker's root
        # group) would share one systemd tree, each's stop ending the other's units.
        with open(f"/proc/{guest.pid1}/cgroup") as f:
            groups = [line.rstrip("\n").split(":", 2)[2] for line in f if line.split(":")[1] in ("name=systemd", "")]
        assert groups and all(g.startswith(f"/{guest.group.name}/payload") for g in groups), groups
        # Where Guest() returns (multi-user.target active), the late job is still queued: a
        # listing taken here is not the boot's end, and one taken later differs from it.
        assert LATE_JOB in guest.jobs(), guest.jobs()
        early = guest.listing()
        assert f"/run/systemd/units/invocation:{LATE_JOB}" in early
        guest.run("touch", GO)
        guest.settle()
        assert guest.jobs() == []
        timers = guest.run("systemctl", "list-units", "--type=timer", "--state=active", "--no-legend", "--plain")
        assert timers.stdout.strip() == "", "a timer left running can start its service between two listings"
        settled = guest.listing()
        assert f"/run/systemd/units/invocation:{LATE_JOB}" not in settled
    assert not any(os.path.exists(path) for path in guest.group.paths), "the guest's groups stay"
