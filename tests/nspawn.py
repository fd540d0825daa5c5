"""Real systemd as PID 1: a debootstrapped Debian (12 by default; 13 where a test says so) booted
with systemd-nspawn, controlled from the host with nsenter."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import subprocess
import uuid
from typing import Optional, Sequence

from tests.conftest import wait_for
from tests.e2e.cluster import CGROUP_ROOT, rmdir_tree
from tests.locks import shared_build_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build")
# python3-systemd lets the agent log to the guest's journal with fields; procps has /bin/kill
# (ExecReload); man-db lets `systemd-analyze verify` check the unit's Documentation=; curl runs
# README's commands for the apt repository as an operator would.
PACKAGES = "systemd,systemd-sysv,dbus,python3,python3-systemd,procps,man-db,curl"


# systemd-nspawn --keep-unit places a guest in "payload" under its own cgroup (and itself in
# "supervisor"): started from a worker in the root cgroup, every guest would be /payload, two
# guests' systemd would manage one tree (one's `systemctl stop` ending the other's agent), and
# each start would remove the others' empty groups. So each guest, and each pipe(), starts in a
# group of its own, in every hierarchy nspawn places it by.
ENTER = 'for group in $HL_NSPAWN_GROUPS; do echo $$ > "$group/cgroup.procs"; done; exec "$@"'


class OwnGroup:
    """A cgroup of its own in the named systemd hierarchy and the unified one (hybrid), or in the
    unified root (cgroup v2), for one nspawn; removed, with what nspawn made below it, by close()."""

    def __init__(self) -> None:
        hierarchies = [
            os.path.join(CGROUP_ROOT, h)
            for h in ("systemd", "unified")
            if os.path.exists(os.path.join(CGROUP_ROOT, h, "cgroup.procs"))
        ]
        self.name = f"hl-nspawn-{uuid.uuid4().hex[:12]}"
        self.paths = [os.path.join(h, self.name) for h in hierarchies or [CGROUP_ROOT]]
        for path in self.paths:
            os.mkdir(path)

    def wrap(self, argv: Sequence[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """argv run from inside the group (the shell moves itself in, then execs it)."""
        return ["sh", "-c", ENTER, "sh", *argv], {**env, "HL_NSPAWN_GROUPS": " ".join(self.paths)}

    def close(self) -> None:
        """Ours and every group nspawn made below it (the guest's processes have ended; one still
        being reaped keeps its group busy for a moment)."""
        for path in self.paths:
            wait_for(functools.partial(_removed, path), 10, f"{path} removed")


def _removed(path: str) -> bool:
    rmdir_tree(path)
    return not os.path.exists(path)


def require_tools() -> None:
    missing = [t for t in ("debootstrap", "systemd-nspawn", "nsenter") if not shutil.which(t)]
    assert not missing, f"missing {missing}: `make test` installs debootstrap and systemd-container"


def rootfs(suite: str = "bookworm") -> str:
    """The cached root filesystem of a Debian suite (bookworm, trixie), built once (about a minute)
    and reused by every boot."""
    require_tools()
    os.makedirs(BUILD, exist_ok=True)
    root = os.path.join(BUILD, f"rootfs-{suite}")
    with open(os.path.join(BUILD, f".rootfs-{suite}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = os.path.join(root, ".complete")
        try:
            with open(done) as f:
                current = f.read() == PACKAGES  # rebuilt whenever the package list changes
        except OSError:
            current = False
        if not current:
            shutil.rmtree(root, ignore_errors=True)
            subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", suite, root],
                check=True,
                timeout=900,
                stdout=subprocess.DEVNULL,
            )
            with open(done, "w") as f:
                f.write(PACKAGES)
    return root


def stage(dest: str) -> str:
    """The installed file tree (packaging/stage.sh), as the packages ship it, built in the build
    environment the packages are built in (the Makefile's build/venv)."""
    with shared_build_tree():
        subprocess.run(["make", "-s", "build/venv/.installed"], cwd=ROOT, check=True, timeout=600, capture_output=True)
    subprocess.run(
        [os.path.join(ROOT, "packaging", "stage.sh"), dest],
        check=True,
        timeout=600,
        env={**os.environ, "PYTHON": os.path.join(BUILD, "venv", "bin", "python")},
    )
    return dest


class Guest:
    """One booted container. Use as a context manager; it powers off and is reaped on exit."""

    def __init__(
        self, directory: str, binds: Sequence[str] = (), ephemeral: bool = True, private_network: bool = True
    ) -> None:
        """private_network=False: the host's network (a guest that must reach a server on the
        host's loopback, as the DRA mode's API server on the e2e cluster)."""
        args = [
            "systemd-nspawn",
            "-D",
            directory,
            "--boot",
            "--register=no",
            "--keep-unit",
            "--console=read-only",
            *(["--private-network"] if private_network else []),
            "--system-call-filter=bpf",
            "--capability=CAP_BPF,CAP_PERFMON,CAP_NET_ADMIN",
        ]
        if ephemeral:
            args.append("--ephemeral")
        args += [f"--bind={b}" for b in binds]
        self.group = OwnGroup()
        argv, env = self.group.wrap(args, {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"})
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        self.pid1 = 0
        try:
            self.pid1 = wait_for(self._find_pid1, 30, "the guest's systemd")
            # multi-user.target, not is-system-running: an activating Type=notify unit (ours,
            # waiting for a kubelet) keeps the system "starting", by design.
            wait_for(
                lambda: self.run("systemctl", "is-active", "multi-user.target", check=False).stdout.strip() == "active",
                60,
                "the guest to boot",
            )
        except BaseException:
            self.close()
            raise

    def _find_pid1(self) -> Optional[int]:
        if self.proc.poll() is not None:
            why = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise AssertionError(f"systemd-nspawn exited: {why}")
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    with open(f"/proc/{entry}/comm") as f:
                        comm = f.read().strip()
                except OSError:
                    continue
                if int(fields[1]) == self.proc.pid and comm == "systemd":
                    return int(entry)
        return None

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """The command in the guest; with `check`, a failure is an AssertionError carrying its
        output and the guest journal's last lines (what a failed systemctl explains only there)."""
        result = subprocess.run(
            ["nsenter", "-t", str(self.pid1), "-m", "-u", "-i", "-n", "-p", "--", *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            journal = self.run("journalctl", "--no-pager", "-n", "60", check=False).stdout
            raise AssertionError(
                f"in the guest, {' '.join(cmd)} exited {result.returncode}\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}\njournal:\n{journal}"
            )
        return result

    def listing(self) -> set[str]:
        """What the guest's root holds, as paths: the persistent tree and /run (a tmpfs of its
        own). /proc, /sys, /dev and /tmp are other file systems (-xdev); the kubelet directory is
        the host's, bind-mounted, and checked from the host."""
        script = "find / /run -xdev -path /var/lib/kubelet/device-plugins -prune -o -print | sort -u"
        return set(self.run("sh", "-c", script, timeout=120).stdout.splitlines())

    def jobs(self) -> list[str]:
        """The units with a job in systemd's queue: a boot job still running, a timer's service."""
        listed = self.run("systemctl", "list-jobs", "--no-legend", "--plain").stdout
        return [line.split()[1] for line in listed.splitlines() if line.split()[1:]]

    def settle(self, timeout: float = 60) -> None:
        """Until systemd's job queue is empty: the boot is over (multi-user.target is reached
        before the jobs ordered after it, such as systemd-update-utmp-runlevel, have run) and no
        unit is starting or stopping. A test that compares the guest's state before and after
        takes each side only then, or it sees systemd's own runtime files (a job's invocation
        link, its journal stream) come and go. Not for a guest whose unit is held activating.
        The guest's timers (apt-daily, dpkg-db-backup and the like) are stopped first: their
        services would otherwise start whenever their time comes, between the two sides too."""
        self.run("systemctl", "stop", "*.timer")
        try:
            wait_for(lambda: self.jobs() == [], timeout, "systemd's job queue to empty")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: still queued {self.jobs()}") from None

    def journal(self, unit: str, holding: str = "", timeout: float = 30) -> str:
        """The unit's journal; with `holding`, once a line holds that text. journald takes a unit's
        output from its stream a moment after the unit wrote it: a line the unit wrote before
        what the test saw (its status, a finished systemctl) may not be in the journal yet."""
        text = ""

        def read() -> bool:
            nonlocal text
            text = self.run("journalctl", "-u", unit, "--no-pager").stdout
            return holding in text

        try:
            wait_for(read, timeout, f"{holding!r} in {unit}'s journal")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the journal ends: {text[-3000:]}") from None
        return text

    def is_active(self, unit: str) -> str:
        return self.run("systemctl", "is-active", unit, check=False).stdout.strip()

    def status(self, unit: str) -> str:
        return self.run("systemctl", "status", "--no-pager", "--lines=0", unit, check=False).stdout

    def close(self) -> None:
        if self.proc.poll() is None and self.pid1:
            self.run("systemctl", "poweroff", "--no-block", check=False)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        if self.proc.poll() is None:
            # Killing the guest's PID 1 ends every process in its PID namespace; killing only
            # systemd-nspawn would leave the guest (and our agent inside it) running.
            pid1 = self.pid1 or self._find_pid1()
            if pid1:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid1, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.group.close()

    def __enter__(self) -> Guest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pipe(
    directory: str, *cmd: str, binds: Sequence[str] = (), timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """One command in the root filesystem without booting, with the host's network."""
    group = OwnGroup()
    argv, env = group.wrap(
        [
            "systemd-nspawn",
            "-q",
            "-D",
            directory,
            "--register=no",
            "--keep-unit",
            "--pipe",
            *(f"--bind-ro={b}" for b in binds),
            *cmd,
        ],
        {**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"},
    )
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    finally:
        group.close()
