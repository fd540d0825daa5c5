"""Names and numbers that other parties own: the kubelet, CDI, the Linux kernel, the Kubernetes
API and systemd (a hypervisor's own ioctl numbers are its row's: device/hypervisors.py).

None of these is a tunable. Components still take their directories as arguments (tests run in
temporary directories); the values here are the defaults those arguments take in production.
Standard library only.
"""

from __future__ import annotations

# --- kubelet device-plugin API (owner: Kubernetes, pkg/kubelet/apis/deviceplugin/v1beta1) ---
KUBELET_API_VERSION = "v1beta1"
KUBELET_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
# The kubelet keeps this file across restarts; it deletes every other file in the directory.
KUBELET_CHECKPOINT = "kubelet_internal_checkpoint"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# The kubelet rejects device IDs longer than this.
MAX_DEVICE_ID_LENGTH = 63
# The kubelet dials the plugin back inside Register with this timeout.
KUBELET_DIAL_TIMEOUT_S = 10.0

# --- our resources (owner: hyperlight-agent; workloads and manifests depend on them) ---
RESOURCE_HYPERVISOR = "hyperlight.dev/hypervisor"
RESOURCE_DEVICE_ACCESS = "hyperlight.dev/device-access"
PLUGIN_SOCKET = "hyperlight.sock"
DEVICE_ACCESS_SOCKET = "hyperlight-access.sock"

# gRPC health service names (grpc.health.v1) every socket of ours serves, for the exec probes and
# a successor's readiness: readiness is the overall service "", liveness our own name.
HEALTH_SERVICES = {"liveness": "liveness", "readiness": ""}

# --- Linux (owner: the kernel) ---
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL
PID_MAX = 4194304  # /proc/sys/kernel/pid_max's upper bound
# A random UUID the kernel makes at each boot, the same in every container on the host (proc(5)):
# what tells a record written before the last reboot from a current one.
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def instance_socket_name(socket_name: str, instance: str | None) -> str:
    """The socket of one named agent instance: hyperlight.sock for instance web-1 is
    hyperlight.web-1.sock. Unique names let a successor register beside a running agent (the
    kubelet keys endpoints by socket path from 1.37 on, and rejects a second one at the same path)."""
    if not instance:
        return socket_name
    stem, _, suffix = socket_name.rpartition(".")
    return f"{stem}.{instance}.{suffix}"


def is_instance_socket_name(name: str, socket_name: str) -> bool:
    """Whether `name` is socket_name itself or one instance's (instance_socket_name)."""
    stem, _, suffix = socket_name.rpartition(".")
    return name == socket_name or (name.startswith(stem + ".") and name.endswith("." + suffix) and name.count(".") >= 2)


def private_socket_name(socket_name: str, pid: int, token: str) -> str:
    """Where a server binds before its socket is renamed into place: .hyperlight.sock.<pid>.<hex>."""
    return f".{socket_name}.{pid}.{token}"


# --- Container Device Interface (owner: cncf-tags/container-device-interface) ---
CDI_DIR = "/var/run/cdi"
# The CDI device kind we own: the same string as the resource workloads ask for, by choice (a
# workload's resource and its CDI device read alike), but CDI's name, not the kubelet's.
CDI_KIND = "hyperlight.dev/hypervisor"
CDI_SPEC_FILE = "hyperlight.json"
# The minimum version our content needs; podman 4.3 silently ignores specs declaring 0.6.0+.
CDI_VERSION = "0.3.0"
# Runtimes read only *.json and *.yaml, so our temp files end in neither.
CDI_TEMP_PREFIX = ".hyperlight.json."
CDI_TEMP_SUFFIX = ".tmp"
ENV_HYPERVISOR = "HYPERLIGHT_HYPERVISOR"
ENV_DEVICE_PATH = "HYPERLIGHT_DEVICE_PATH"

# --- systemd (owner: systemd, sd_notify(3)) ---
NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
JOURNAL_STREAM_ENV = "JOURNAL_STREAM"
# A line on a journal stream may start with its syslog priority (sd-daemon(3)): "<3>" is an error.
JOURNAL_STREAM_ERR_PREFIX = "<3>"
# Ours, beside systemd's: in an in-place upgrade's child (host/successor.py), the pid of the agent
# it replaces. Until that process is gone the child is not the unit's main process, and says
# nothing to systemd (NotifyAccess=main would drop it, with a warning in the journal).
PREDECESSOR_ENV = "HYPERLIGHT_AGENT_PREDECESSOR"
# Ours, not systemd's: baked into the container image at build time (Containerfile), printed at
# startup and in hyperlight_build_info.
COMMIT_ENV = "HYPERLIGHT_AGENT_COMMIT"


# ---- Dynamic Resource Allocation: the kubelet's side
# (owner: Kubernetes, pkg/kubelet/pluginmanager and pkg/kubelet/cm/dra; same in 1.34 and 1.37)
# The kubelet's plugin watcher registers every socket that appears here (dot-files excepted).
DRA_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
# Each driver's own directory below it holds the socket its DRAPlugin service answers on.
DRA_PLUGINS_DIR = "/var/lib/kubelet/plugins"
# PluginInfo.type the kubelet routes to its DRA handler.
DRA_PLUGIN_TYPE = "DRAPlugin"
# PluginInfo.supported_versions entries: not gRPC service names but "<package tail>.<service>".
# The kubelet takes the first of ours it knows, so the newest comes first.
DRA_VERSION_V1 = "v1.DRAPlugin"
DRA_VERSION_V1BETA1 = "v1beta1.DRAPlugin"
DRA_SUPPORTED_VERSIONS = (DRA_VERSION_V1, DRA_VERSION_V1BETA1)
# The optional resource-health service (pkg/apis/dra-health; here the gRPC service name itself):
# a 1.37 kubelet with ResourceHealthStatus (beta, on from 1.36) opens one stream per registered
# instance that names a version it knows, v1 before v1alpha1 in its own order; 1.36 asks every
# instance for v1alpha1 whatever it names; earlier kubelets, or the gate off, never do. Each
# message is every device's health; the kubelet puts it into the status of the pods using the
# devices (allocatedResourcesStatus).
DRA_HEALTH_V1 = "v1.DRAResourceHealth"
DRA_HEALTH_V1ALPHA1 = "v1alpha1.DRAResourceHealth"
DRA_HEALTH_SERVICES = (DRA_HEALTH_V1, DRA_HEALTH_V1ALPHA1)
# After a health stream ends the kubelet opens the next this much later (UNIMPLEMENTED: never), and
# forgets every device's health of the driver at once (all of its instances').
DRA_HEALTH_REOPEN_S = 5.0
# A device not reported again within its health_check_timeout_seconds reads as Unknown; unset, 30 s.
DRA_HEALTH_DEFAULT_TIMEOUT_S = 30.0
# ResourceHealth.message's limit: longer messages are cut to 1021 characters and "...".
DRA_HEALTH_MESSAGE_MAX = 1024
# The kubelet's deadlines: GetInfo, NotifyRegistrationStatus, each Prepare/Unprepare call.
DRA_GET_INFO_TIMEOUT_S = 1.0
DRA_NOTIFY_TIMEOUT_S = 5.0
DRA_CALL_TIMEOUT_S = 45.0
# The plugin manager's reconciler looks every second; a failed registration is tried again after
# the operation executor's backoff, 0.5 s doubling (pluginmanager/reconciler, goroutinemap).
DRA_RECONCILE_S = 1.0
DRA_REGISTER_RETRY_INITIAL_S = 0.5
# Our driver and DeviceClass names (owner: hyperlight-agent), named like what they publish under
# our domain, as DRA drivers are: ResourceSlice.spec.driver, the class workloads ask for, the
# chart's (deploy/helm: tests/test_deploy.py keeps them equal to these).
DRA_DRIVER = "hypervisor.hyperlight.dev"
DRA_DEVICE_CLASS = "hypervisor.hyperlight.dev"
# The driver's name before the first release: this node's slices under it are deleted at start.
DRA_DRIVERS_BEFORE = ("hyperlight.dev",)

# ---- Dynamic Resource Allocation: the API's side (owner: Kubernetes, resource.k8s.io/v1: GA in
# 1.34; 1.35 is the oldest minor we support)
RESOURCE_API_GROUP = "resource.k8s.io"
RESOURCE_API_VERSION = "v1"
# One ResourceSlice holds at most this many devices (ResourceSliceMaxDevices), and at most this many
# once any of them has a taint (ResourceSliceMaxDevicesWithAdvancedFeatures).
RESOURCE_SLICE_MAX_DEVICES = 128
RESOURCE_SLICE_MAX_TAINTED_DEVICES = 64
# Device taints (KEP-5055: DRADeviceTaints, beta and on from 1.36, GA in 1.37): the effects a taint
# may have. The key and value are label names and values (a value: at most 63 characters).
TAINT_NO_SCHEDULE = "NoSchedule"
TAINT_NO_EXECUTE = "NoExecute"
# Ours (owner: hyperlight-agent; documented in docs/troubleshooting.md, tolerated by that key): the
# taint an unusable device carries, its value saying why (device/observation.Cause: no-device,
# probe, cdi).
TAINT_UNUSABLE = "hyperlight.dev/unusable"
# The field selectors the API server offers on ResourceSlices.
SLICE_FIELD_NODE = "spec.nodeName"
SLICE_FIELD_DRIVER = "spec.driver"
# Where a pod's service-account token, CA and namespace are mounted.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
