"""Hostile neighbours: a CDI directory full of other vendors' specs, temp-looking files, symlinks
(dangling too) and subdirectories, and a kubelet directory with other plugins' live sockets and
the kubelet's checkpoint. Through a fault-heavy run of the agent (our spec deleted, corrupted
and chmod-ed over and over, kubelet restarts, SIGHUP reloads, an agent restart) not one of them
changes: same bytes, mode, owner and mtime, same link targets and listings, and every neighbour
socket still answers."""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
from typing import Any

from hyperlight_agent import contracts
from hyperlight_agent.files import cdi
from standin.kubelet import StandinThread
from tests.conftest import AgentProcess, count_inputs, read_bytes, wait_for
from tests.test_fuzz import snapshot

R = contracts.RESOURCE_HYPERVISOR
WANTED = cdi.render("kvm", "/dev/kvm", 65534, 65534)
# Other plugins' sockets; one looks like our private name, one like the bootstrap mode's socket.
NEIGHBOUR_SOCKETS = ("nvidia-gpu.sock", "sriov.sock", ".hyperlight.sock.1.0000abcd", "hyperlight-access.sock.old")


class NeighbourPlugin:
    """Another plugin's socket, answering every connection; like a real plugin it serves its
    socket anew when the kubelet's restart removed it (serve_again)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._server: socket.socket
        self._serve()

    def _serve(self) -> None:
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(16)
        threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()

    @staticmethod
    def _accept(server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed
            with conn:
                conn.sendall(b"neighbour\n")

    def serve_again(self) -> None:
        if not os.path.lexists(self.path):
            self._server.close()
            self._serve()

    def answers(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(self.path)
            return s.recv(16) == b"neighbour\n"

    def close(self) -> None:
        self._server.close()


def populate_cdi(cdi_dir: str) -> None:
    os.makedirs(cdi_dir)

    def write(name: str, data: bytes, mode: int = 0o644, owner: Any = None, old: bool = False) -> None:
        path = os.path.join(cdi_dir, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
        if owner:
            os.chown(path, *owner)
        if old:  # abandoned long ago, were it ours
            os.utime(path, (1, 1))

    write("nvidia.json", b'{"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": []}\n')
    write("vendor.yaml", b"cdiVersion: 0.6.0\nkind: vendor.com/thing\ndevices: []\n", 0o600, (1234, 1234))
    write("hyperlight.yaml", b"cdiVersion: 0.3.0\nkind: other.com/hyperlight\ndevices: []\n", 0o640)
    write("Hyperlight.json", WANTED)
    write("hyperlight.json.bak", b"{old}")
    # Temp-looking names, all old: only exactly our pattern, owned by us, may ever be removed.
    write(".hyperlight.json.x.tmp", b"x", old=True)
    write(".hyperlight.json.hlagent-1-zz.tmp", b"zz", old=True)
    write(".hyperlight.json.hlagent-1-abcdefabcdef.tmp.part", b"part", old=True)
    write(".hyperlight.json.hlagent-1-ABCDEFABCDEF.tmp", b"upper", old=True)
    write(".hyperlight.json.hlagent-7-abcdefabcdef.tmp", b"not our owner", owner=(1234, 1234), old=True)
    os.symlink("nvidia.json", os.path.join(cdi_dir, "link.json"))
    os.symlink("nowhere.json", os.path.join(cdi_dir, "dangling.json"))
    os.symlink("/etc/passwd", os.path.join(cdi_dir, "passwd.json"))
    os.mkdir(os.path.join(cdi_dir, "sub"))
    with open(os.path.join(cdi_dir, "sub", "inner.json"), "wb") as f:
        f.write(WANTED)
    os.mkdir(os.path.join(cdi_dir, "hyperlight.json.d"))


def wait_slots(kubelet: StandinThread, n: int, what: str) -> None:
    kubelet.wait_until(lambda k: k.allocatable() == n, 15, what)


def test_a_fault_heavy_run_leaves_every_neighbour_exactly_as_it_was(
    kubelet: StandinThread, tmp: str, kvm_dir: str
) -> None:
    cdi_dir = os.path.join(tmp, "cdi")
    kubelet_dir = os.path.join(tmp, "kubelet")
    populate_cdi(cdi_dir)
    with open(os.path.join(kubelet_dir, "DEPRECATION"), "w") as f:
        f.write("a regular file the kubelet keeps\n")
    os.mkdir(os.path.join(kubelet_dir, "plugins"))
    neighbours = [NeighbourPlugin(os.path.join(kubelet_dir, name)) for name in NEIGHBOUR_SOCKETS]
    config = os.path.join(tmp, "agent.toml")
    with open(config, "w") as f:
        f.write("device_count = 3\n")
    cdi_before = snapshot(cdi_dir)
    kubelet_files = ("DEPRECATION", "plugins", contracts.KUBELET_CHECKPOINT)
    kubelet_before = {k: v for k, v in snapshot(kubelet_dir).items() if k in kubelet_files}
    assert len(kubelet_before) == 3
    spec = cdi.spec_path(cdi_dir)
    args = ("--kubelet-dir", kubelet_dir, "--cdi-dir", cdi_dir, "--device-dir", kvm_dir, "--config", config)
    agents = [AgentProcess(tmp, *args)]
    try:
        kubelet.wait_until(lambda k: k.allocatable() == 3, 15, "registered")
        wait_for(lambda: read_bytes(spec) == WANTED, 5, "our spec")
        for round_ in range(5):
            os.unlink(spec)
            wait_for(lambda: read_bytes(spec) == WANTED, 5, "the deleted spec repaired")
            with open(spec, "wb") as f:
                f.write(b'{"cdiVersion": "9.9.9"' * round_)
            wait_for(lambda: read_bytes(spec) == WANTED, 5, "the corrupted spec repaired")
            os.chmod(spec, 0o600)
            wait_for(lambda: stat.S_IMODE(os.stat(spec).st_mode) == cdi.SPEC_MODE, 5, "the mode repaired")
            if round_ % 2 == 0:
                # The kubelet restarts (removing every socket); the neighbours serve theirs anew.
                kubelet.call(kubelet.kubelet.restart())
                for neighbour in neighbours:
                    neighbour.serve_again()
                kubelet.wait_until(lambda k: k.allocatable() == 3, 15, "registered again")
            else:
                slots = 4 + round_  # 5, then 7
                with open(config, "w") as f:
                    f.write(f"device_count = {slots}\n")
                agents[-1].proc.send_signal(signal.SIGHUP)
                wait_slots(kubelet, slots, "reloaded")
                with open(config, "w") as f:
                    f.write("device_count = 3\n")
                agents[-1].proc.send_signal(signal.SIGHUP)
                kubelet.wait_until(lambda k: k.allocatable() == 3, 15, "reloaded back")
        # An agent restart.
        assert agents[-1].stop() == 0
        agents.append(AgentProcess(tmp, *args))
        kubelet.wait_until(lambda k: k.allocatable() == 3, 15, "registered by the new agent")
        wait_for(lambda: read_bytes(spec) == WANTED, 5, "our spec")
        assert agents[-1].stop() == 0
        registrations = kubelet.run(lambda k: len(k.register_calls))
        assert registrations >= 5, f"{registrations} registrations: the faults did not all happen"
        print(f"{registrations} registrations, {len(agents)} agents, 15 spec faults, 3 kubelet restarts, 4 reloads")
        count_inputs("neighbour run: faults (spec, kubelet restarts, reloads, agent restart)", 15 + 3 + 4 + 1)
        for agent in agents:
            assert "Traceback" not in agent.log, agent.log[-3000:]
    finally:
        for agent in agents:
            agent.kill()
        wait_for(lambda: not any(a.helpers_left() for a in agents), 5, "no helper left")
    cdi_after = snapshot(cdi_dir)
    del cdi_after[contracts.CDI_SPEC_FILE]
    assert cdi_after == cdi_before, "a neighbour in the CDI directory changed"
    kubelet_after = {k: v for k, v in snapshot(kubelet_dir).items() if k in kubelet_files}
    assert kubelet_after == kubelet_before, "the kubelet's own files changed"
    for neighbour in neighbours:
        assert stat.S_ISSOCK(os.lstat(neighbour.path).st_mode), f"{neighbour.path} is gone"
        assert neighbour.answers(), f"{neighbour.path} no longer answers"
        neighbour.close()
