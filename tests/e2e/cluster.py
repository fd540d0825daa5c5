"""A real Kubernetes cluster on this machine, started and stopped by the e2e tests themselves.

    etcd ─ kube-apiserver (TLS, Node+RBAC, NodeRestriction, Pod Security) ─ controller-manager, scheduler
                    │
        node "a": containerd + kubelet    node "b": containerd + kubelet

Each node lives in a private mount namespace held open by a small process: the kubelet hardcodes
/var/lib/kubelet/device-plugins, and containerd resolves hostPath volumes, so both must see the
node's own directories at the standard paths (/var/lib/kubelet, /run/cdi, /etc/cdi, /var/log/pods,
/var/lib/cni, /run/netns, /run/containerd, /etc/kubernetes), bind-mounted from its directory under
the run directory. Pod Security is enforced cluster-wide at the restricted level, as a hardened
cluster's AdmissionConfiguration sets it (POD_SECURITY): a namespace runs pods beyond it only with
its own label, as the chart's namespace has. Each kubelet has its own cgroup root (kubelets
sharing one garbage-collect each other's pods), ports and CNI bridge.

Everything started is recorded in the run directory's state file as it is started; stop() (and the
next run's start, after a run killed half-way) ends it by PID and by mount namespace, removes the
cgroups and bridges it created, and nothing is left on the host. What clusters running at once
share (their subnets, the standard paths' mountpoints) is hostwide.py's.

Why: docs/decisions/a-real-cluster-in-the-tests.md.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, Callable, Optional

from tests.e2e import tools

from . import hostwide
from . import versions as kube_versions
from .kube import Api, ApiError
from .pki import Identity, Pki

COMPONENTS = kube_versions.COMPONENTS
# The API server's PodSecurity admission defaults: restricted for enforce, audit and warn in every
# namespace without labels of its own, no exemptions.
POD_SECURITY = {
    "apiVersion": "apiserver.config.k8s.io/v1",
    "kind": "AdmissionConfiguration",
    "plugins": [
        {
            "name": "PodSecurity",
            "configuration": {
                "apiVersion": "pod-security.admission.config.k8s.io/v1",
                "kind": "PodSecurityConfiguration",
                "defaults": {
                    "enforce": "restricted",
                    "enforce-version": "latest",
                    "audit": "restricted",
                    "audit-version": "latest",
                    "warn": "restricted",
                    "warn-version": "latest",
                },
                "exemptions": {"usernames": [], "runtimeClasses": [], "namespaces": []},
            },
        }
    ],
}
# Where containerd, runc and the CNI plugins come from.
RUNC = "/usr/sbin/runc"
CNI_BIN = "/usr/lib/cni"
SANDBOX_IMAGE = "localhost/hyperlight-e2e/pause:1"
# The standard paths each node sees as its own directory (relative name under the node dir).
NODE_MOUNTS = {
    "/var/lib/kubelet": "kubelet",
    "/run/cdi": "cdi",
    "/etc/cdi": "etc-cdi",
    "/var/log/pods": "log-pods",
    "/var/log/containers": "log-containers",
    "/var/lib/cni": "cni-state",
    "/run/netns": "netns",
    "/run/containerd": "run-containerd",
    "/etc/kubernetes": "etc-kubernetes",
}
CGROUP_ROOT = "/sys/fs/cgroup"
# Every process a run starts carries this in its environment (and so do the containerd shims its
# containerd starts): what proves a process in one of the run's mount namespaces to be the run's,
# since namespace numbers are reused at once once a namespace is gone.
RUN_ENV = "HYPERLIGHT_E2E_RUN"
DEVICE_PLUGINS = "device-plugins"
# The kubelets' syncFrequency (the pod workers' resync; the default is 60 s): Node.start_kubelet.
SYNC_FREQUENCY_S = 10


BRIDGE_PREFIX = "hle2e"


def run_tag(directory: str) -> str:
    """Six hex digits naming a cluster's run directory in host-wide names (cgroups, bridges)."""
    return hashlib.sha256(directory.encode()).hexdigest()[:6]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A cluster's ports come from a block its subnet claim owns (hostwide.py), below the host's
# ephemeral range: a port picked by bind(0) and let go until its component binds it could be taken
# meanwhile by any connection's source port or by another cluster's pick (two clusters start at
# once in `make test`), and an API server's or kubelet's restart binds the same port again.
PORTS_BASE = 20000
PORTS_PER_SUBNET = 10  # the claim's base steps by MAX_NODES: 40 ports a cluster, 20000–22519


def claimed_ports(subnet_base: int) -> Iterator[int]:
    """The block of ports of the cluster whose subnets start at subnet_base, each one nothing
    listens on when it is handed out (a stranger's listener is skipped)."""
    first = PORTS_BASE + subnet_base * PORTS_PER_SUBNET
    for port in range(first, first + MAX_NODES * PORTS_PER_SUBNET):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        yield port
    raise RuntimeError(f"ports {first}–{first + MAX_NODES * PORTS_PER_SUBNET - 1}: every one is taken")


def routed_networks() -> set[tuple[int, int]]:
    """The host's IPv4 routes as (network, mask), host byte order (/proc/net/route, every table's
    main entries): a bridge left by another checkout's killed run keeps its route even when down,
    and a second route to the same subnet takes no traffic."""
    networks = set()
    with open("/proc/net/route") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            destination, mask = (socket.ntohl(int(fields[i], 16)) for i in (1, 7))
            networks.add((destination, mask))
    return networks


def subnet_bases(count: int, routes: set[tuple[int, int]]) -> Iterator[int]:
    """Each x, lowest first, for which 10.250.x+1 … 10.250.x+count are /24s within which no route
    of a /24 or longer lies (a broader route, a VPN's 10.0.0.0/8, loses to our bridge's by its
    length)."""

    def overlaps(octet: int) -> bool:
        net = (10 << 24) | (250 << 16) | (octet << 8)
        return any(mask >= 0xFFFFFF00 and (dest & 0xFFFFFF00) == net for dest, mask in routes)

    for base in range(0, 255 - count, count):
        if not any(overlaps(base + i) for i in range(1, count + 1)):
            yield base


def free_subnets(count: int, routes: set[tuple[int, int]]) -> int:
    for base in subnet_bases(count, routes):
        return base
    raise RuntimeError(f"no {count} free /24 subnets in 10.250.0.0/16: every one is routed already")


class ComponentExited(Exception):
    pass


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = condition()
        except ComponentExited:
            raise
        except Exception as exc:  # a component still starting answers with errors
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:g} s (last: {last!r})")


def build_components(bin_dir: str, *names: str) -> float:
    """Components `names` (etcd, containerd, a Kubernetes minor such as "1.35") built into bin_dir,
    once: a finished build is reused, one under way (the one `make test` starts in the background
    beside the tests before these) waited for at each's lock. Returns the seconds it took."""
    started = time.monotonic()
    done = subprocess.run(
        [os.path.join(COMPONENTS, "build.sh"), bin_dir, "components", *names],
        capture_output=True,
        text=True,
        timeout=5400,
        check=False,
    )
    took = time.monotonic() - started
    tools.WAITED["build/e2e/components.log"] = tools.WAITED.get("build/e2e/components.log", 0.0) + took
    if done.returncode != 0:
        raise RuntimeError(f"{COMPONENTS}/build.sh {bin_dir}: status {done.returncode}: {done.stderr[-3000:]}")
    return took


def versions() -> dict[str, str]:
    """The pinned versions: "newest" and "oldest" Kubernetes (tests/e2e/versions.py's rows), etcd's
    and containerd's (their modules' go.mod files)."""
    return {
        "newest": kube_versions.newest().version,
        "oldest": kube_versions.oldest().version,
        "etcd": kube_versions.pinned("etcd", "go.etcd.io/etcd/server/v3"),
        "containerd": kube_versions.pinned("containerd", "github.com/containerd/containerd/v2"),
    }


# --- the state file: what a run started, so that whatever it left can be ended later ---


def _start_time(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _mount_ns(pid: int) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


class State:
    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "run": uuid.uuid4().hex,
            "pids": [],
            "namespaces": [],
            "cgroups": [],
            "bridges": [],
            "mountpoints": [],
        }
        self.started: list[subprocess.Popen[bytes]] = []  # this run's children, to reap at the end
        if os.path.exists(path):
            with open(path) as f:
                self.data.update({"run": None}, **json.load(f))  # a run before markers: none to match

    @property
    def run(self) -> Optional[str]:
        return self.data["run"]  # type: ignore[no-any-return]

    def add(self, kind: str, value: Any) -> None:
        self.data[kind].append(value)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def _in_cgroups(pid: int, roots: tuple[str, ...]) -> bool:
    """Whether the process is in one of the cgroup trees `roots` (in any hierarchy)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            paths = [line.rstrip("\n").split(":", 2)[2] for line in f]
    except (OSError, IndexError):
        return False
    return any(p == root or p.startswith(root + "/") for p in paths for root in roots)


def _marked(pid: int, run: Optional[str]) -> bool:
    """Whether the process carries this run's marker in its environment."""
    if not run:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{RUN_ENV}={run}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _victims(state: State) -> list[int]:
    """The run's processes still alive (see _kill_everything), never ourselves."""
    namespaces = set(state.data["namespaces"])
    roots = tuple(state.data["cgroups"])
    found = {pid for pid, started in state.data["pids"] if _start_time(pid) == started}
    if namespaces or roots:
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (
                _in_cgroups(int(entry), roots)
                or (_mount_ns(int(entry)) in namespaces and _marked(int(entry), state.run))
            ):
                found.add(int(entry))
    found.discard(os.getpid())
    return sorted(found)


def _kill_everything(state: State) -> None:
    """End every process the run started, proven to be its own: a recorded PID with its recorded
    start time, a process in a node's cgroup tree (the containers: their own mount namespaces),
    or one in a node's mount namespace that carries the run's marker (containerd's shims). A
    namespace number alone proves nothing: it is reused at once once its namespace is gone. Then
    remove what they left on the host: cgroups and bridges (the mountpoints: hostwide.py)."""
    for _ in range(50):
        victims = _victims(state)
        if not victims:
            break
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for path in sorted(state.data["cgroups"], key=len, reverse=True):
        for hierarchy in _hierarchies():
            rmdir_tree(os.path.join(CGROUP_ROOT, hierarchy, path.lstrip("/")))
    for bridge in state.data["bridges"]:
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)


def _hierarchies() -> list[str]:
    """Every mounted cgroup hierarchy (v1 controllers, the named systemd one and unified)."""
    names = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mountpoint = fields[4]
            fstype = fields[fields.index("-") + 1]
            if fstype in ("cgroup", "cgroup2") and mountpoint.startswith(CGROUP_ROOT + "/"):
                names.append(mountpoint[len(CGROUP_ROOT) + 1 :])
    return names


def rmdir_tree(path: str) -> None:
    """A tree of empty directories (a cgroup's), deepest first; what is still busy stays."""
    if not os.path.isdir(path):
        return
    for root, dirs, _ in os.walk(path, topdown=False):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, d))
    with contextlib.suppress(OSError):
        os.rmdir(path)


class Process:
    """A component process, its log, and its PID recorded before anything else can happen."""

    def __init__(
        self, state: State, name: str, argv: list[str], log_dir: str, env: Optional[dict[str, str]] = None
    ) -> None:
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        marked = {**(os.environ if env is None else env), RUN_ENV: state.run or ""}
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=marked, start_new_session=True
            )
        state.started.append(self.popen)
        state.add("pids", [self.popen.pid, _start_time(self.popen.pid)])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check(self) -> bool:
        """True while running; raises ComponentExited (which ends any wait_until) once it is not."""
        if not self.alive():
            raise ComponentExited(f"{self.name} exited ({self.popen.returncode}):\n{self.log_tail()}")
        return True

    def stop(self, timeout: float = 20) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])


class Node:
    def __init__(self, cluster: Cluster, name: str, index: int, labels: dict[str, str], device_unusable: bool) -> None:
        self.cluster = cluster
        self.name = name
        self.labels = labels
        self.directory = os.path.join(cluster.directory, f"node-{name}")
        # Named for the run directory too: two checkouts' clusters on one machine never share one.
        run = run_tag(cluster.directory)
        self.cgroup = f"/hl-e2e-{run}-{name}"
        self.bridge = f"{BRIDGE_PREFIX}{run}{name}"[:15]
        octet = cluster.subnet_base + index
        self.subnet = f"10.250.{octet}.0/24"
        self.gateway = f"10.250.{octet}.1"
        self.kubelet_port = cluster.port()
        self.healthz_port = cluster.port()
        self.device_unusable = device_unusable
        self.holder: Optional[Process] = None
        self.containerd: Optional[Process] = None
        self.kubelet: Optional[Process] = None
        self.kubelet_version = ""
        self.identity: Optional[Identity] = None

    def path(self, *parts: str) -> str:
        return os.path.join(self.directory, *parts)

    @property
    def device_plugin_dir(self) -> str:
        """The node's /var/lib/kubelet/device-plugins, seen from the host."""
        return self.path("kubelet", DEVICE_PLUGINS)

    @property
    def containerd_socket(self) -> str:
        return self.path("containerd.sock")

    def in_namespace(self, argv: list[str]) -> list[str]:
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.popen.pid), "-m", "--", *argv]

    def start(self) -> None:
        state = self.cluster.state
        for sub in ("logs", *NODE_MOUNTS.values(), "cni-conf", "containerd-root", "volume-plugins"):
            os.makedirs(self.path(sub), exist_ok=True)
        hostwide.make_mountpoints(NODE_MOUNTS, self.cluster.lock_dir)
        self._cgroups()
        state.add("bridges", self.bridge)
        script = ["set -e", "mount --make-rprivate /"]
        for target, sub in NODE_MOUNTS.items():
            script.append(f"mount --bind {self.path(sub)} {target}")
        if self.device_unusable:
            script.append("mount --bind /dev/null /dev/kvm")
        script += [f"touch {self.path('namespace-ready')}", "exec sleep infinity"]
        self.holder = Process(
            state,
            f"{self.name}-namespace",
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script)],
            self.path("logs"),
        )
        wait_until(lambda: os.path.exists(self.path("namespace-ready")), 10, f"node {self.name}'s mount namespace")
        state.add("namespaces", _mount_ns(self.holder.popen.pid))
        self._start_containerd()

    def _cgroups(self) -> None:
        self.cluster.state.add("cgroups", self.cgroup)
        for hierarchy in _hierarchies():
            path = os.path.join(CGROUP_ROOT, hierarchy, self.cgroup.lstrip("/"))
            os.makedirs(path, exist_ok=True)
            if hierarchy == "cpuset":  # a v1 cpuset takes no task until its cpus and mems are set
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    with (
                        open(os.path.join(CGROUP_ROOT, hierarchy, knob)) as src,
                        open(os.path.join(path, knob), "w") as dst,
                    ):
                        dst.write(src.read())

    def _start_containerd(self) -> None:
        with open(self.path("cni-conf", "10-bridge.conflist"), "w") as f:
            json.dump(
                {
                    "cniVersion": "1.0.0",
                    "name": f"hle2e-{self.name}",
                    "plugins": [
                        # The gateway (the bridge's own .1 address) is how pods reach the host: the API
                        # server through Cluster.api_for_pods (there is no service network here).
                        {
                            "type": "bridge",
                            "bridge": self.bridge,
                            "isGateway": True,
                            "ipMasq": False,
                            "ipam": {"type": "host-local", "ranges": [[{"subnet": self.subnet}]]},
                        },
                        {"type": "loopback"},
                    ],
                },
                f,
            )
        config = self.path("containerd.toml")
        with open(config, "w") as f:
            f.write(f"""version = 3
root = "{self.path("containerd-root")}"
state = "/run/containerd"
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{self.containerd_socket}.ttrpc"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{SANDBOX_IMAGE}"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{self._registry_hosts()}"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  # No CAP_SYS_RESOURCE here: never lower a container's oom_score_adj below ours.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{self.path("cni-conf")}"
# No NRI: its socket is the host's /run/nri/nri.sock, which every node's containerd (of every
# cluster running at once) would delete and make again.
[plugins.'io.containerd.nri.v1.nri']
  disable = true
""")
        binaries = self.cluster.binaries("containerd", self.cluster.versions["containerd"])
        env = {**os.environ, "PATH": f"{binaries}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.containerd = Process(
            self.cluster.state,
            f"{self.name}-containerd",
            self.in_namespace([os.path.join(binaries, "containerd"), "--config", config]),
            self.path("logs"),
            env=env,
        )
        containerd = self.containerd
        wait_until(
            lambda: containerd.check() and self.ctr("version").returncode == 0, 60, f"node {self.name}'s containerd"
        )

    def _registry_hosts(self) -> str:
        """containerd's registry host configuration: each of the cluster's mirrors (registry →
        the URL that serves it, e.g. a plain-HTTP registry on this machine) as a hosts.toml."""
        directory = self.path("certs.d")
        for registry, url in self.cluster.mirrors.items():
            os.makedirs(os.path.join(directory, registry), exist_ok=True)
            with open(os.path.join(directory, registry, "hosts.toml"), "w") as f:
                f.write(f'server = "https://{registry}"\n[host."{url}"]\n  capabilities = ["pull", "resolve"]\n')
        return directory

    def ctr(self, *args: str, timeout: float = 300, in_node: bool = False) -> subprocess.CompletedProcess[str]:
        """`in_node`: ctr in the node's mount namespace, where containerd's /run/containerd is (a
        `task exec` makes its stdio fifos there, for containerd to open)."""
        binaries = self.cluster.binaries("containerd", self.cluster.versions["containerd"])
        argv = [os.path.join(binaries, "ctr"), "-a", self.containerd_socket, "-n", "k8s.io", *args]
        return subprocess.run(
            self.in_namespace(argv) if in_node else argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def import_image(self, archive: str) -> None:
        done = self.ctr("images", "import", "--no-unpack", "--local", archive)
        if done.returncode != 0:
            done = self.ctr("images", "import", archive)
        assert done.returncode == 0, done.stderr

    def start_kubelet(self, version: str) -> None:
        assert self.kubelet is None or not self.kubelet.alive()
        if self.identity is None:
            self.identity = self.cluster.pki.issue(f"node-{self.name}", f"/O=system:nodes/CN=system:node:{self.name}")
        kubeconfig = self.cluster.pki.kubeconfig(f"kubelet-{self.name}", self.cluster.server, self.identity)
        config = self.path("kubelet.yaml")
        with open(config, "w") as f:
            f.write(f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# These machines boot hybrid cgroup v1; kubelets from 1.35 on refuse it unless told otherwise.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: {self.cgroup}
containerRuntimeEndpoint: unix://{self.containerd_socket}
address: 127.0.0.1
port: {self.kubelet_port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {self.healthz_port}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {self.cluster.pki.ca.cert}}}
authorization: {{mode: Webhook}}
failSwapOn: false
# A pod whose start failed without an error in SyncPod's result (the kubelet's own claim read
# refused by the Node authorizer, kubernetes/kubernetes#139836) waits for the pod worker's next
# resync: every 60-90 s by default, every 10-15 s here (SYNC_FREQUENCY_S), which only shortens the
# tests' waits for such pods.
syncFrequency: {SYNC_FREQUENCY_S}s
volumePluginDir: {self.path("volume-plugins")}
evictionHard: {{memory.available: "0%", nodefs.available: "0%", imagefs.available: "0%"}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
""")
        binaries = self.cluster.binaries("kubernetes", version)
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        argv = [
            os.path.join(binaries, "kubelet"),
            "--config",
            config,
            "--kubeconfig",
            kubeconfig,
            "--hostname-override",
            self.name,
            "--node-ip",
            "127.0.0.1",
            "--root-dir",
            "/var/lib/kubelet",
            "--cert-dir",
            "/var/lib/kubelet/pki",
            "--v=2",
        ]
        if labels:
            argv.append(f"--node-labels={labels}")
        self.kubelet = Process(self.cluster.state, f"{self.name}-kubelet", self.in_namespace(argv), self.path("logs"))
        self.kubelet_version = version

    def stop_kubelet(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()

    def ready(self) -> bool:
        assert self.kubelet is not None
        self.kubelet.check()
        node = self.cluster.api.get(f"/api/v1/nodes/{self.name}")
        conditions = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
        running = node["status"]["nodeInfo"]["kubeletVersion"]
        return conditions.get("Ready") == "True" and running == self.kubelet_version

    def allocatable(self) -> dict[str, str]:
        return dict(self.cluster.api.get(f"/api/v1/nodes/{self.name}")["status"].get("allocatable", {}))

    @property
    def pod_resources_socket(self) -> str:
        return self.path("kubelet", "pod-resources", "kubelet.sock")


MAX_NODES = 4


def _has_address(address: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


class Forwarder:
    """TCP from (host, an ephemeral port) to `target`, one thread pair per connection."""

    def __init__(self, host: str, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server((host, 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = threading.Event()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=10)
                upstream.settimeout(None)
            except OSError:  # the API server restarting (an upgrade): the client tries again
                client.close()
                continue
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for conn in self._open:
            with contextlib.suppress(OSError):
                conn.close()


class Cluster:
    def __init__(
        self,
        directory: str,
        bin_dir: str,
        mirrors: Optional[dict[str, str]] = None,
        lock_dir: str = hostwide.LOCK_DIR,
    ) -> None:
        """mirrors: registry → URL whose registry the nodes' containerd pulls that registry's
        images from (as a mirror), e.g. {"ghcr.io": "http://127.0.0.1:5000"}. lock_dir: where
        the clusters on this host claim their subnets and list their mountpoints."""
        self.directory = directory
        self.lock_dir = lock_dir
        self.bin_dir = bin_dir
        self.mirrors = dict(mirrors or {})
        self.versions = versions()
        self.state_path = os.path.join(os.path.dirname(directory.rstrip("/")), "cluster-state.json")
        self.processes: list[Process] = []
        self._forwarders: dict[str, Forwarder] = {}
        self.nodes: dict[str, Node] = {}
        self.server = ""
        self.api: Api = None  # type: ignore[assignment]  # set by start()
        self.admin_kubeconfig = ""
        # The nodes' subnets are 10.250.subnet_base+1… (start(): none another bridge routes already,
        # none another cluster claims).
        self.subnet_base = 0
        self.subnets: Optional[hostwide.SubnetClaim] = None
        self._ports: Iterator[int] = iter(())
        # How long binaries() waited for the components' build (the one `make test` runs beside).
        self.components_wait_s = 0.0

    def port(self) -> int:
        """The next port of the cluster's own block (claimed_ports), from start() on."""
        return next(self._ports)

    def binaries(self, component: str, version: str) -> str:
        """The directory of `component` (etcd, containerd, kubernetes) at `version`: built (or its
        build waited for) the first time a cluster needs it, so that a cluster starts once its own
        components are built, not every row's."""
        path = os.path.join(self.bin_dir, component, version)
        if not os.path.exists(os.path.join(path, ".complete")):
            name = component if component != "kubernetes" else ".".join(version.lstrip("v").split(".")[:2])
            self.components_wait_s += build_components(self.bin_dir, name)
        return path

    @staticmethod
    def clean_leftovers(state_path: str, directory: str, lock_dir: str = hostwide.LOCK_DIR) -> None:
        """Whatever a run killed half-way left: its processes, cgroups, bridges, mountpoints, files."""
        if os.path.exists(state_path):
            state = State(state_path)
            _kill_everything(state)
            hostwide.remove_mountpoints(state.data["mountpoints"], lock_dir)  # a run's before the registry
            os.unlink(state_path)
        # A bridge named for this run directory is this directory's, even when its state file is
        # gone with the directory (rm -rf of a killed run's checkout): left, its route moves our
        # subnets and the CNI plugin refuses the bridge's old address.
        ours = f"{BRIDGE_PREFIX}{run_tag(directory)}"
        for link in os.listdir("/sys/class/net"):
            if link.startswith(ours):
                subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
        shutil.rmtree(directory, ignore_errors=True)

    def start(
        self,
        controllers: bool = True,
        etcd_args: tuple[str, ...] = (),
        api_server_args: tuple[str, ...] = (),
        version: str = "",
    ) -> None:
        """etcd and the API server, then (`controllers`) the controller-manager and scheduler, of
        Kubernetes `version` (default: the newest row's); the extra arguments are added to etcd's
        and the API server's command lines."""
        self.control_plane_version = version or self.versions["newest"]
        # Built (or waited for) first: the ports and subnets below are free only when chosen.
        for component, pinned in (("etcd", self.versions["etcd"]), ("containerd", self.versions["containerd"])):
            self.binaries(component, pinned)
        k8s = self.binaries("kubernetes", self.control_plane_version)
        self.clean_leftovers(self.state_path, self.directory, self.lock_dir)
        os.makedirs(os.path.join(self.directory, "logs"))
        self.state = State(self.state_path)
        self.logs = os.path.join(self.directory, "logs")
        self.subnets = hostwide.SubnetClaim(subnet_bases(MAX_NODES, routed_networks()), self.lock_dir)
        self.subnet_base = self.subnets.base
        self._ports = claimed_ports(self.subnet_base)
        self.pki = Pki(os.path.join(self.directory, "pki"))
        etcd_client, etcd_peer, api_port = self.port(), self.port(), self.port()
        etcd = self.binaries("etcd", self.versions["etcd"])
        self.processes.append(
            Process(
                self.state,
                "etcd",
                [
                    os.path.join(etcd, "etcd"),
                    "--data-dir",
                    os.path.join(self.directory, "etcd"),
                    "--listen-client-urls",
                    f"http://127.0.0.1:{etcd_client}",
                    "--advertise-client-urls",
                    f"http://127.0.0.1:{etcd_client}",
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{etcd_peer}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{etcd_peer}",
                    "--initial-cluster",
                    f"default=http://127.0.0.1:{etcd_peer}",
                    "--unsafe-no-fsync",
                    "--log-level",
                    "warn",
                    *etcd_args,
                ],
                self.logs,
            )
        )
        serving = self.pki.issue(
            "apiserver",
            "/CN=kube-apiserver",
            (
                "IP:127.0.0.1",
                "DNS:localhost",
                "DNS:kubernetes",
                "DNS:kubernetes.default",
                "IP:10.96.0.1",
                *(f"IP:10.250.{self.subnet_base + i}.1" for i in range(1, MAX_NODES + 1)),
            ),
        )
        kubelet_client = self.pki.issue(
            "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client"
        )
        admission = os.path.join(self.directory, "admission.json")
        with open(admission, "w") as f:
            json.dump(POD_SECURITY, f)
        self.api_port = api_port
        self.server = f"https://127.0.0.1:{api_port}"
        self._api_server_argv = [
            os.path.join(k8s, "kube-apiserver"),
            "--etcd-servers",
            f"http://127.0.0.1:{etcd_client}",
            "--bind-address",
            "127.0.0.1",
            "--advertise-address",
            "127.0.0.1",
            "--secure-port",
            str(api_port),
            "--tls-cert-file",
            serving.cert,
            "--tls-private-key-file",
            serving.key,
            "--client-ca-file",
            self.pki.ca.cert,
            "--kubelet-client-certificate",
            kubelet_client.cert,
            "--kubelet-client-key",
            kubelet_client.key,
            "--service-account-key-file",
            self.pki.service_account_pub,
            "--service-account-signing-key-file",
            self.pki.service_account_key,
            "--service-account-issuer",
            "https://kubernetes.default.svc",
            "--authorization-mode",
            "Node,RBAC",
            "--enable-admission-plugins",
            "NodeRestriction,PodSecurity",
            "--admission-control-config-file",
            admission,
            "--service-cluster-ip-range",
            "10.96.0.0/24",
            "--endpoint-reconciler-type",
            "none",
            "--allow-privileged=false",
            "--profiling=false",
            *api_server_args,
        ]
        admin = self.pki.issue("admin", "/O=system:masters/CN=hyperlight-e2e-admin")
        self.admin_kubeconfig = self.pki.kubeconfig("admin", self.server, admin)
        self.api = Api("127.0.0.1", api_port, self.pki.ca.cert, admin)
        self._start_api_server()
        if not controllers:
            return
        controller = self.pki.issue("controller-manager", "/CN=system:kube-controller-manager")
        self._controllers_argv = [
            [
                os.path.join(k8s, "kube-controller-manager"),
                "--kubeconfig",
                self.pki.kubeconfig("controller-manager", self.server, controller),
                "--authentication-kubeconfig",
                self.pki.kubeconfig("controller-manager", self.server, controller),
                "--authorization-kubeconfig",
                self.pki.kubeconfig("controller-manager", self.server, controller),
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(self.port()),
                "--leader-elect=false",
                "--use-service-account-credentials",
                "--service-account-private-key-file",
                self.pki.service_account_key,
                "--root-ca-file",
                self.pki.ca.cert,
                # No pod CIDRs to hand out (each node's CNI has its own range); the cloud controllers
                # are not in a providerless build.
                "--controllers",
                "*,-node-ipam-controller",
            ],
        ]
        scheduler = self.pki.issue("scheduler", "/CN=system:kube-scheduler")
        scheduler_kubeconfig = self.pki.kubeconfig("scheduler", self.server, scheduler)
        self._controllers_argv.append(
            [
                os.path.join(k8s, "kube-scheduler"),
                "--kubeconfig",
                scheduler_kubeconfig,
                "--authentication-kubeconfig",
                scheduler_kubeconfig,
                "--authorization-kubeconfig",
                scheduler_kubeconfig,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(self.port()),
                "--leader-elect=false",
            ]
        )
        self._start_controllers()

    def _start_controllers(self) -> None:
        self.controllers = [
            Process(self.state, os.path.basename(argv[0]), argv, self.logs) for argv in self._controllers_argv
        ]
        self.processes += self.controllers
        wait_until(
            lambda: self.check_alive() and self.api.get("/api/v1/namespaces/default/serviceaccounts/default"),
            120,
            "the default service account (controller-manager running)",
        )

    def upgrade_control_plane(self, version: str) -> None:
        """The API server, then the controller-manager and scheduler, stopped and started again as
        Kubernetes `version`, in the order an upgrade takes (the API server first: the components
        must never be newer than it); etcd, the nodes and everything on them run on."""
        k8s = self.binaries("kubernetes", version)
        self.stop_api_server()
        self._api_server_argv[0] = os.path.join(k8s, "kube-apiserver")
        self.start_api_server()
        for process in self.controllers:
            process.stop()
            self.processes.remove(process)
        for argv in self._controllers_argv:
            argv[0] = os.path.join(k8s, os.path.basename(argv[0]))
        self._start_controllers()
        self.control_plane_version = version

    def _start_api_server(self) -> None:
        self.api_server = Process(self.state, "kube-apiserver", self._api_server_argv, self.logs)
        self.processes.insert(1, self.api_server)  # after etcd: stopped before it
        wait_until(lambda: self.check_alive() and self.api.get("/readyz") == "ok", 120, "kube-apiserver /readyz")

    def stop_api_server(self) -> None:
        """SIGTERM, as a restart or an upgrade of the API server does; etcd and the rest run on."""
        self.api_server.stop()
        self.processes.remove(self.api_server)
        self.api.close()  # its keep-alive connections were to the old process

    def start_api_server(self) -> None:
        """The API server again, with the same command line (port, certificates, flags)."""
        self._start_api_server()

    def add_node(
        self, name: str, version: str, labels: Optional[dict[str, str]] = None, device_unusable: bool = False
    ) -> Node:
        assert len(self.nodes) < MAX_NODES, "the API server's certificate names the gateways of MAX_NODES nodes"
        node = Node(self, name, len(self.nodes) + 1, labels or {}, device_unusable)
        self.nodes[name] = node
        node.start()
        return node

    def check_alive(self) -> bool:
        return all(process.check() for process in self.processes)

    def api_for_pods(self, node: Node) -> int:
        """The port on node's gateway address at which its pods reach the API server (which
        listens on the host's loopback only): a forwarder, as a kube-proxy would be for the
        kubernetes Service; it ends with the cluster."""
        if node.name not in self._forwarders:
            wait_until(lambda: _has_address(node.gateway), 60, f"{node.gateway} on {node.bridge}")
            self._forwarders[node.name] = Forwarder(node.gateway, ("127.0.0.1", self.api_port))
        return self._forwarders[node.name].port

    def pod_logs(self, namespace: str, lines: int = 200) -> str:
        """The last `lines` of every container log of the namespace's pods on every node, ended or
        running, read from the nodes' /var/log/pods (a failed test shows the agents' own account)."""
        text = ""
        for node in self.nodes.values():
            for path in sorted(glob.glob(node.path("log-pods", f"{namespace}_*", "*", "*.log"))):
                with open(path, errors="replace") as f:
                    tail = f.readlines()[-lines:]
                text += f"--- node {node.name}: {os.path.relpath(path, node.path('log-pods'))} ---\n{''.join(tail)}"
        return text

    def stop(self) -> None:
        for forwarder in self._forwarders.values():
            forwarder.close()
        if self.api is not None:
            self.api.close()
        for node in self.nodes.values():
            node.stop_kubelet()
        for process in reversed(self.processes):
            process.stop()
        _kill_everything(self.state)
        for popen in self.state.started:
            popen.wait(10)
        if self.subnets is not None:
            self.subnets.release()
        hostwide.remove_mountpoints(lock_dir=self.lock_dir)
        os.unlink(self.state_path)

    def kubectl(
        self, *args: str, input: Optional[str] = None, check: bool = True, tools: str = ""
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [os.path.join(tools, "kubectl"), "--kubeconfig", self.admin_kubeconfig, *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done


__all__ = ["ApiError", "Cluster", "Node", "versions", "wait_until"]
