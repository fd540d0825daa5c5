"""Settings: one table, four sources. A flag beats the environment, which beats the TOML file,
which beats the default. Every setting is validated here, before anything touches the disk.

docs/settings.md's table (packaging/settings_doc.py) and `--help` are both generated from or checked against SETTINGS.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import json
import logging
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from hyperlight_agent import contracts
from hyperlight_agent.dra import names
from hyperlight_agent.text import cause, quote, shown

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on the hosts' older Pythons
    import tomli as tomllib

log = logging.getLogger(__name__)

DEFAULT_CONFIG_FILE = "/etc/hyperlight-agent/agent.toml"
CONFIG_ENV = "HYPERLIGHT_CONFIG"
# What Allocate returns: a CDI device name, a DeviceSpec, or both.
ALLOCATION_CDI = "cdi"
ALLOCATION_DEVICE_SPEC = "device-spec"
ALLOCATION_BOTH = "both"
ALLOCATION_MODES = (ALLOCATION_CDI, ALLOCATION_DEVICE_SPEC, ALLOCATION_BOTH)
LOG_LEVELS = ("debug", "info", "warning", "error")
# text: one line per event with its time (UTC); json: one JSON object per line, for a cluster's
# log pipeline. Under systemd with python-systemd the journal gets fields either way.
LOG_FORMATS = ("text", "json")
# The agent's modes (modes.MODES, one row each; modes.py holds the two equal).
MODE_NAMES = ("plugin", "device-access", "dra")
UINT32_MAX = 2**32 - 1
# A ListAndWatch list of more devices than this exceeds the kubelet's 4 MiB gRPC message limit.
MAX_DEVICE_COUNT = 100_000
# The settings file is a few kilobytes; anything this large is a mistake.
MAX_CONFIG_BYTES = 1024 * 1024
PATH_MAX = 4096


class ConfigError(Exception):
    """An invalid setting: the message names the setting and the value, on one line."""


def _int_in(low: int, high: int, what: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError(f"must be {what}")
        if isinstance(value, str):
            text = value.strip()
            # ASCII digits only (int() takes any Unicode digit), and few enough that int()'s
            # digit limit is never reached.
            if not (text.isascii() and text.isdigit() and len(text) <= 20):
                raise ValueError(f"must be {what}")
            value = int(text, 10)
        if not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"must be {what}")
        return value

    return parse


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or (isinstance(value, str) and not (value.isascii() and len(value) <= 40)):
        raise ValueError("must be a number of seconds from 0.1 to 86400")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a TOML integer beyond float's range
        raise ValueError("must be a number of seconds from 0.1 to 86400") from None
    if not 0.1 <= number <= 86400:
        raise ValueError("must be a number of seconds from 0.1 to 86400")
    return number


def _abs_dir(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise ValueError("must be an absolute directory path")
    if len(value.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise ValueError(f"must be at most {PATH_MAX} bytes")
    return os.path.normpath(value)


def _choice(choices: Sequence[str]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in choices:
            raise ValueError("must be one of " + ", ".join(choices))
        return value.lower()

    return parse


_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def _listen_address(value: Any) -> str:
    """HOST:PORT where HOST is an IP address ([v6] in brackets) or a host name, or :PORT for
    every address of the host (as Go and Prometheus read it); checked here, not when the server
    binds after startup."""
    problem = ValueError(
        "must be HOST:PORT or :PORT (every address), HOST an IP address or host name, e.g. 127.0.0.1:9464"
    )
    if not isinstance(value, str) or len(value) > 300:
        raise problem
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit() and len(port) <= 5):
        raise problem
    if not 0 < int(port) < 65536:
        raise ValueError("the port must be from 1 to 65535")
    if host == "":
        return value
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise problem from None
        return value
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not (host.isascii() and _HOSTNAME.fullmatch(host)):
            raise problem from None
    return value


_INSTANCE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")


def _instance(value: Any) -> str:
    if not (isinstance(value, str) and value.isascii() and _INSTANCE.fullmatch(value)):
        raise ValueError(
            "must be 1 to 63 lowercase letters, digits, '-' or '.', starting and ending with a "
            "letter or digit (e.g. the pod's name)"
        )
    return value


def _abs_file(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value or value.endswith("/"):
        raise ValueError("must be an absolute file path")
    if len(value.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise ValueError(f"must be at most {PATH_MAX} bytes")
    return os.path.normpath(value)


# A node's name is a DNS subdomain (RFC 1123): what the kubelet registers and ResourceSlices name.
_NODE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")


def _node_name(value: Any) -> str:
    if not (isinstance(value, str) and value.isascii() and len(value) <= 253 and _NODE_NAME.fullmatch(value)):
        raise ValueError("must be a node name: lowercase DNS labels joined by '.', at most 253 characters")
    return value


MAX_HANDOVER_S = 3600.0


def _seconds_where(ok: Callable[[float], bool], what: str) -> Callable[[Any], float]:
    """A number of seconds for which ok(number) holds (nan never does), else "must be `what`"."""

    def parse(value: Any) -> float:
        problem = ValueError(f"must be {what}")
        if isinstance(value, bool) or (isinstance(value, str) and not (value.isascii() and len(value) <= 40)):
            raise problem
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: a TOML integer beyond float's range
            raise problem from None
        if not ok(number):
            raise problem
        return number

    return parse


_handover_seconds = _seconds_where(
    lambda n: 0 <= n <= MAX_HANDOVER_S, f"a number of seconds from 0 to {MAX_HANDOVER_S:g}"
)
# An opt-in eviction waits at least this long (the default check interval).
MIN_EVICT_AFTER_S = 30.0
# The eviction debounce means "unusable that long, as seen by checks run within it": while one is
# pending, a check runs every dra_evict_after / EVICT_CHECKS seconds, the last at its end, and the
# taint turns NoExecute only if that last one fails too (dra/taints.py).
EVICT_CHECKS = 3
# Those checks may run at most this many times as often as check_interval, the operator's budget
# of probes (each creates a VM, on a node that may be loaded already): an interval longer than
# that allows is refused (load), not silently exceeded, nor left to evict between its checks.
EVICT_CHECK_SPEEDUP = 10
_evict_after = _seconds_where(
    lambda n: n == 0 or MIN_EVICT_AFTER_S <= n <= 86400,
    f"0 (never) or a number of seconds from {MIN_EVICT_AFTER_S:g} to 86400",
)


@dataclass(frozen=True)
class Setting:
    key: str  # TOML key and Settings attribute
    env: str
    flag: str
    default: Any
    parse: Callable[[Any], Any]
    help: str
    # For drop-in compatibility with the original's manifests: a bad value in this unprefixed
    # environment variable (the original's name, never HYPERLIGHT_*) is ignored with a warning,
    # as the original did, instead of stopping the agent; `--check` says FAIL for it.
    lenient_env: bool = False
    # TOML is typed: a quoted number where a number belongs is a mistake worth reporting.
    toml_types: tuple[type, ...] = (str,)
    # It names what is watched, written or served: a reload keeps the running value.
    restart_only: bool = False

    @property
    def default_text(self) -> str:
        return "unset" if self.default is None else str(self.default)

    @property
    def env_names(self) -> tuple[str, ...]:
        """The environment variables it is read from: its own and, for a name without our prefix
        (the original plugin's, the downward API's), the prefixed one as well (the environment's rule: _resolve_all)."""
        return (self.env,) if self.env.startswith(ENV_PREFIX) else (self.env, ENV_PREFIX + self.env)

    @property
    def env_text(self) -> str:
        """`DEVICE_COUNT or HYPERLIGHT_DEVICE_COUNT`: for --help, docs/settings.md and agent.toml."""
        return " or ".join(self.env_names)

    @property
    def meaning(self) -> str:
        """The help text, with the reload rule: for --help, docs/settings.md and the shipped agent.toml."""
        return self.help + ("; changes only on restart" if self.restart_only else "")


U32 = _int_in(0, UINT32_MAX, f"an integer from 0 to {UINT32_MAX}")
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "device_count",
        "DEVICE_COUNT",
        "--device-count",
        2000,
        _int_in(1, MAX_DEVICE_COUNT, f"an integer from 1 to {MAX_DEVICE_COUNT}"),
        "slots advertised for the shared hypervisor device",
        lenient_env=True,
        toml_types=(int,),
    ),
    Setting(
        "device_uid",
        "DEVICE_UID",
        "--device-uid",
        65534,
        U32,
        "owner of the device node inside containers (CDI)",
        lenient_env=True,
        toml_types=(int,),
    ),
    Setting(
        "device_gid",
        "DEVICE_GID",
        "--device-gid",
        65534,
        U32,
        "group of the device node inside containers (CDI)",
        lenient_env=True,
        toml_types=(int,),
    ),
    Setting(
        "host_device_dir",
        "HOST_DEVICE_DIR",
        "--host-device-dir",
        None,
        _abs_dir,
        "where the host's /dev is visible (e.g. /host-dev in a pod); unset: the device dir",
        restart_only=True,
    ),
    Setting(
        "device_dir",
        "HYPERLIGHT_DEVICE_DIR",
        "--device-dir",
        "/dev",
        _abs_dir,
        "directory holding the hypervisor node the agent probes",
        restart_only=True,
    ),
    Setting(
        "kubelet_dir",
        "HYPERLIGHT_KUBELET_DIR",
        "--kubelet-dir",
        contracts.KUBELET_PLUGIN_DIR,
        _abs_dir,
        "the kubelet's device-plugin directory (kubelet.sock, our socket)",
        restart_only=True,
    ),
    Setting(
        "cdi_dir",
        "HYPERLIGHT_CDI_DIR",
        "--cdi-dir",
        contracts.CDI_DIR,
        _abs_dir,
        "CDI spec directory; the agent owns only hyperlight.json in it",
        restart_only=True,
    ),
    Setting(
        "check_interval_seconds",
        "HYPERLIGHT_CHECK_INTERVAL",
        "--check-interval",
        30,
        _seconds,
        "seconds between periodic device checks",
        toml_types=(int, float),
    ),
    Setting(
        "allocation",
        "HYPERLIGHT_ALLOCATION",
        "--allocation",
        ALLOCATION_BOTH,
        _choice(ALLOCATION_MODES),
        "what Allocate returns: both (CDI name and DeviceSpec: works on every runtime), cdi, or device-spec",
    ),
    Setting(
        "mode",
        "HYPERLIGHT_MODE",
        "--mode",
        "plugin",
        _choice(MODE_NAMES),
        "plugin (hyperlight.dev/hypervisor slots), device-access (the bootstrap mode: --device-access) "
        "or dra (Dynamic Resource Allocation: --dra); --check and the exec probes follow it too",
        restart_only=True,
    ),
    Setting(
        "log_level", "HYPERLIGHT_LOG_LEVEL", "--log-level", "info", _choice(LOG_LEVELS), "debug, info, warning or error"
    ),
    Setting(
        "log_format",
        "HYPERLIGHT_LOG_FORMAT",
        "--log-format",
        "text",
        _choice(LOG_FORMATS),
        "text (a line per event, with its UTC time) or json (an object per line); the journal gets fields either way",
        restart_only=True,
    ),
    Setting(
        "nfd_features_dir",
        "HYPERLIGHT_NFD_FEATURES_DIR",
        "--nfd-features-dir",
        None,
        _abs_dir,
        "write node labels as an NFD feature file here (e.g. "
        "/etc/kubernetes/node-feature-discovery/features.d); unset: off",
        restart_only=True,
    ),
    Setting(
        "metrics_address",
        "HYPERLIGHT_METRICS_ADDRESS",
        "--metrics-address",
        None,
        _listen_address,
        "serve Prometheus metrics at http://HOST:PORT/metrics (e.g. 127.0.0.1:9464); unset: off",
        restart_only=True,
    ),
    Setting(
        "probe_address",
        "HYPERLIGHT_PROBE_ADDRESS",
        "--probe-address",
        None,
        _listen_address,
        "answer the kubelet's httpGet probes at http://HOST:PORT/livez and /readyz (and /healthz) from the "
        "agent's own state, no process per probe (in a pod: 0.0.0.0:8081); may equal metrics_address; unset: off",
        restart_only=True,
    ),
    Setting(
        "instance",
        "HYPERLIGHT_INSTANCE",
        "--instance",
        None,
        _instance,
        "a name unique to this agent on its node (in a pod: the pod's name); the socket becomes "
        "hyperlight.INSTANCE.sock, so a successor can register beside this agent during an update; "
        "unset: hyperlight.sock",
        restart_only=True,
    ),
    Setting(
        "handover_seconds",
        "HYPERLIGHT_HANDOVER_SECONDS",
        "--handover-seconds",
        0,
        _handover_seconds,
        "on SIGTERM, keep serving up to this long until another agent for the same resource is ready "
        "in the kubelet dir (a surge update), so the kubelet never counts zero devices; a second SIGTERM "
        "ends the wait; 0: stop at once",
        toml_types=(int, float),
    ),
    # The Dynamic Resource Allocation mode (--dra) only.
    Setting(
        "dra_devices",
        "HYPERLIGHT_DRA_DEVICES",
        "--dra-devices",
        contracts.RESOURCE_SLICE_MAX_DEVICES,
        _int_in(
            1, contracts.RESOURCE_SLICE_MAX_DEVICES, f"an integer from 1 to {contracts.RESOURCE_SLICE_MAX_DEVICES}"
        ),
        "--dra: identical devices published in this node's ResourceSlice, each one claim's share of the "
        "hypervisor, where it cannot be one shared device (dra_shared_device)",
        toml_types=(int,),
        restart_only=True,
    ),
    Setting(
        "dra_shared_device",
        "HYPERLIGHT_DRA_SHARED_DEVICE",
        "--dra-shared-device",
        "auto",
        _choice(("auto", "off")),
        "--dra: auto: publish the hypervisor as one device every claim shares, where the API server "
        "keeps allowMultipleAllocations (Kubernetes 1.36+), else dra_devices identical devices; "
        "off: always the identical devices (for kubelets before 1.36)",
        restart_only=True,
    ),
    Setting(
        "dra_evict_after_seconds",
        "HYPERLIGHT_DRA_EVICT_AFTER",
        "--dra-evict-after",
        0,
        _evict_after,
        "--dra: an unusable device is tainted NoSchedule at once (no new claims); with this set, its "
        "taint turns NoExecute (pods using it are evicted) once the checks run within this long, one every "
        "third of it, all found it unusable, so a shorter flap evicts nothing (the interval may be at most "
        "10/3 of it: those checks run at most 10 times as often); 0: never evict",
        toml_types=(int, float),
        restart_only=True,
    ),
    Setting(
        "node_name",
        "NODE_NAME",
        "--node-name",
        None,
        _node_name,
        "--dra: this node's name in Kubernetes (in a pod: spec.nodeName); unset: the host name",
        restart_only=True,
    ),
    Setting(
        "kubeconfig",
        "HYPERLIGHT_KUBECONFIG",
        "--kubeconfig",
        None,
        _abs_file,
        "--dra: kubeconfig file for the API server; unset: the pod's service account",
        restart_only=True,
    ),
    Setting(
        "dra_registry_dir",
        "HYPERLIGHT_DRA_REGISTRY_DIR",
        "--dra-registry-dir",
        contracts.DRA_REGISTRY_DIR,
        _abs_dir,
        "--dra: the kubelet's plugin registry (our registration socket)",
        restart_only=True,
    ),
    Setting(
        "dra_plugins_dir",
        "HYPERLIGHT_DRA_PLUGINS_DIR",
        "--dra-plugins-dir",
        contracts.DRA_PLUGINS_DIR,
        _abs_dir,
        "--dra: the kubelet's plugins directory (our service socket and record of prepared "
        f"claims, in {contracts.DRA_DRIVER}/ below it)",
        restart_only=True,
    ),
)
BY_KEY = {s.key: s for s in SETTINGS}
RESTART_ONLY = tuple(s.key for s in SETTINGS if s.restart_only)
# Every environment variable named HYPERLIGHT_* is ours: a setting's, or one of these (the
# workload variables CDI and Allocate set, which `helm test` runs `--check` beside; the
# in-place upgrade's; the image's commit). Any other is refused like an unknown TOML key.
ENV_PREFIX = "HYPERLIGHT_"
OTHER_ENV = (
    CONFIG_ENV,
    contracts.ENV_HYPERVISOR,
    contracts.ENV_DEVICE_PATH,
    contracts.PREDECESSOR_ENV,
    contracts.COMMIT_ENV,
)
# What the kubelet puts in a container for each Service of its namespace when service links are
# on (the chart turns them off): a Service named hyperlight-metrics gives HYPERLIGHT_METRICS_PORT=
# tcp://…, HYPERLIGHT_METRICS_SERVICE_HOST and the like. Not a setting, and not a typo.
_SERVICE_LINK = re.compile(
    r".+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_[0-9]+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?)"
)


def suggestion(word: str, candidates: Mapping[str, str]) -> str:
    """ " (did you mean X?)" for the candidate (a key of `candidates`: the value is said) nearest
    to `word`, or "" when none is near.

    >>> suggestion("devce_count", {"device_count": "device_count", "cdi_dir": "cdi_dir"})
    ' (did you mean device_count?)'
    """
    near = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.75)
    return f" (did you mean {candidates[near[0]]}?)" if near else ""


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse a HYPERLIGHT_* variable that no setting reads (a typo would otherwise be ignored in
    silence, while the same typo in TOML is an error)."""
    known = {name for s in SETTINGS for name in s.env_names} | set(OTHER_ENV)
    # A mistyped HYPERLIGHT_* name is given the HYPERLIGHT_* name it was meant to be (the last of env_names).
    candidates = {s.env_names[-1][len(ENV_PREFIX) :]: s.env_names[-1] for s in SETTINGS}
    candidates.update({s.key.upper(): s.env_names[-1] for s in SETTINGS})
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or _SERVICE_LINK.fullmatch(name):
            continue
        hint = suggestion(name[len(ENV_PREFIX) :], candidates) or suggestion(name, {n: n for n in known})
        raise ConfigError(
            f"{shown(name, 80)}={quote(environ[name])}: unknown setting{hint}; the settings are in "
            "`hyperlight-agent --help`"
        )


def toml_suggestion(key: str) -> str:
    candidates = {s.key: s.key for s in SETTINGS}
    candidates.update(
        {s.env[len(ENV_PREFIX) :].lower() if s.env.startswith(ENV_PREFIX) else s.env.lower(): s.key for s in SETTINGS}
    )
    return suggestion(key.lower(), candidates)


def longest_socket_name(instance: Optional[str]) -> int:
    """The longest name the agent binds in kubelet_dir (a private name, renamed into place)."""
    return max(
        len(contracts.private_socket_name(contracts.instance_socket_name(n, instance), contracts.PID_MAX, "0" * 8))
        for n in (contracts.PLUGIN_SOCKET, contracts.DEVICE_ACCESS_SOCKET)
    )


@dataclass(frozen=True)
class Settings:
    """Resolved settings. No defaults here: SETTINGS is their one home (see defaults())."""

    device_count: int
    device_uid: int
    device_gid: int
    host_device_dir: Optional[str]
    device_dir: str
    kubelet_dir: str
    cdi_dir: str
    check_interval_seconds: float
    allocation: str
    mode: str
    log_level: str
    log_format: str
    nfd_features_dir: Optional[str]
    metrics_address: Optional[str]
    probe_address: Optional[str]
    instance: Optional[str]
    handover_seconds: float
    dra_devices: int
    dra_shared_device: str
    dra_evict_after_seconds: float
    node_name: Optional[str]
    kubeconfig: Optional[str]
    dra_registry_dir: str
    dra_plugins_dir: str
    config_file: Optional[str] = None  # the file actually read, if any
    # Where each setting's value came from ({key: "default", "file", "environment NAME" or "flag
    # --x"}, as pairs), and the original's variables ignored for a bad value: what
    # --print-config and --check say. Not settings: equal settings compare equal whatever these say.
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    ignored: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def defaults(cls, **overrides: Any) -> Settings:
        """Every setting at its default, except `overrides` (for tests and embedders)."""
        return cls(**{**{s.key: s.default for s in SETTINGS}, **overrides})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; defaults stay None so we can tell "not given" apart."""
    group = parser.add_argument_group("settings (flag > environment > TOML file > default)")
    for s in SETTINGS:
        group.add_argument(
            s.flag,
            dest=s.key,
            metavar="VALUE",
            default=None,
            help=f"{s.meaning} [env {s.env_text}; toml {s.key}; default {s.default_text}]",
        )
    group.add_argument(
        "--config",
        dest="config",
        metavar="FILE",
        default=None,
        help=f"TOML settings file [env {CONFIG_ENV}; default {DEFAULT_CONFIG_FILE}; a missing default file is fine]",
    )


def load(
    args: argparse.Namespace, environ: Mapping[str, str], default_file_path: str = DEFAULT_CONFIG_FILE
) -> Settings:
    """Resolve every setting from flags, environment, file and defaults. Raises ConfigError."""
    check_environment(environ)
    explicit_file = args.config or environ.get(CONFIG_ENV) or None
    path = explicit_file or default_file_path
    from_file, file_read = read_file(path, required=explicit_file is not None)
    values, sources, ignored = _resolve_all(args, environ, from_file, path)
    socket_bytes = _bytes(values["kubelet_dir"]) + 1 + longest_socket_name(values["instance"])
    if socket_bytes > contracts.UNIX_PATH_MAX:
        named = f" with instance = {quote(values['instance'])}" if values["instance"] else ""
        raise ConfigError(
            f"kubelet_dir = {quote(values['kubelet_dir'])}{named}: socket paths in it would be up to "
            f"{socket_bytes} bytes; unix sockets allow {contracts.UNIX_PATH_MAX}"
        )
    # A protocol that shortens its socket names to fit (DRA: a hash of the instance) says how short
    # they get, as its row does (parts.ProtocolRow.shortest_names; the settings are read below the
    # rows' layer, so they take the protocol's data from its leaf): only a directory too long even
    # for those cannot hold its sockets. The device plugin's are never shortened: the check above.
    for key, below, shortest in names.SHORTEST_NAMES:
        directory = os.path.join(values[key], below) if below else values[key]
        socket_bytes = _bytes(directory) + 1 + shortest
        if socket_bytes > contracts.UNIX_PATH_MAX:
            raise ConfigError(
                f"{key} = {quote(values[key])}: socket paths in it would be at least {socket_bytes} "
                f"bytes; unix sockets allow {contracts.UNIX_PATH_MAX}"
            )
    _check_eviction(values["dra_evict_after_seconds"], values["check_interval_seconds"])
    return Settings(**values, config_file=path if file_read else None, sources=sources, ignored=ignored)


def _check_eviction(evict_after: float, interval: float) -> None:
    """Refuse an eviction debounce its checks cannot fill within their budget (EVICT_CHECKS)."""
    longest = evict_after * EVICT_CHECK_SPEEDUP / EVICT_CHECKS
    if evict_after and interval > longest:
        raise ConfigError(
            f"dra_evict_after_seconds = {evict_after:g} with check_interval_seconds = {interval:g}: an eviction "
            f"waits for {EVICT_CHECKS} failed checks within its {evict_after:g} s, and checks run at most "
            f"{EVICT_CHECK_SPEEDUP} times as often as the interval; use check_interval_seconds at most {longest:g} "
            f"or dra_evict_after_seconds at least {interval * EVICT_CHECKS / EVICT_CHECK_SPEEDUP:g}"
        )


def _bytes(path: str) -> int:
    return len(path.encode("utf-8", "surrogateescape"))


def _read_bytes(path: str) -> Optional[bytes]:
    """The file's bytes (None when missing): regular files only (and /dev/null, read as empty),
    never blocking (a FIFO is refused at once), at most MAX_CONFIG_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3):
            return b""  # /dev/null: "no settings file", as tests and `make run` use it
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"config file {shown(path)}: not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {shown(path)}: larger than {MAX_CONFIG_BYTES} bytes")
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {shown(path)}: larger than {MAX_CONFIG_BYTES} bytes")
        return data
    finally:
        os.close(fd)


def read_file(path: str, required: bool) -> tuple[dict[str, Any], bool]:
    """The TOML file's settings (validated keys and types), and whether a file was read."""
    try:
        raw = _read_bytes(path)
        if raw is None:
            if required:
                raise ConfigError(f"config file {shown(path)}: does not exist")
            return {}, False
        data = tomllib.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {shown(path)}: cannot read: {cause(exc)}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {shown(path)}: invalid TOML: {_one_line(exc)}") from None
    except RecursionError:
        raise ConfigError(f"config file {shown(path)}: invalid TOML: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer beyond int()'s digit limit
        raise ConfigError(f"config file {shown(path)}: invalid TOML: {_one_line(exc)}") from None
    for key in data:
        if key not in BY_KEY:
            raise ConfigError(f"config file {shown(path)}: unknown setting {quote(key)}{toml_suggestion(key)}")
    return data, True


# The environment's rule (docs/settings.md says it to operators): every setting has a
# HYPERLIGHT_* name, and the five the original plugin or the downward API named without our prefix
# keep that name too; both set to different values is an error naming both. An invalid value is an
# error wherever it is given, except in the original's own DEVICE_COUNT, DEVICE_UID and DEVICE_GID
# (lenient_env), which the original ignored with a warning: ignored so still, and `--check` says
# FAIL for it.
def _resolve_all(
    args: argparse.Namespace, environ: Mapping[str, str], from_file: Mapping[str, Any], path: str
) -> tuple[dict[str, Any], tuple[tuple[str, str], ...], tuple[str, ...]]:
    """Every setting's value, where it came from, and the original's variables ignored."""
    values: dict[str, Any] = {}
    sources: list[tuple[str, str]] = []
    ignored: list[str] = []
    for s in SETTINGS:
        value, source, dropped = _resolve(s, getattr(args, s.key, None), environ, from_file, path)
        values[s.key] = value
        sources.append((s.key, source))
        ignored += [dropped] if dropped else []
    return values, tuple(sources), tuple(ignored)


def _from_environment(s: Setting, environ: Mapping[str, str]) -> Optional[tuple[str, str]]:
    """(the variable, its value) the setting is given in, if any; its two names set to different
    values is an error."""
    given = [(name, environ[name]) for name in s.env_names if environ.get(name, "") != ""]
    if len(given) == 2 and given[0][1] != given[1][1]:
        (a, a_value), (b, b_value) = given
        raise ConfigError(
            f"{a}={quote(a_value)} and {b}={quote(b_value)}: two names of {s.key} with different values; set one"
        )
    return given[-1] if given else None  # both, and equal: said as the prefixed name


def _resolve(
    s: Setting, flag: Optional[str], environ: Mapping[str, str], from_file: Mapping[str, Any], path: str
) -> tuple[Any, str, str]:
    """(value, where it came from, the original's variable ignored or "")."""
    if flag is not None:
        return _parse(s, flag, s.flag), f"flag {s.flag}", ""
    dropped = ""
    given = _from_environment(s, environ)
    if given is not None:
        name, env_value = given
        try:
            return s.parse(env_value), f"environment {name}", ""
        except ValueError as exc:
            if not (s.lenient_env and name == s.env and not name.startswith(ENV_PREFIX)):
                raise ConfigError(f"{name}={quote(env_value)}: {exc}") from None
            # The original plugin's manifests set these; a bad one there was ignored, so it still is,
            # for now: said once, with what is used instead and what a later release will do.
            instead = "the config file's value" if s.key in from_file else f"the default {s.default}"
            dropped = f"{name}={quote(env_value)} ({exc}); using {instead} instead"
            log.warning("ignoring %s; a later release will refuse it and not start", dropped)
    if s.key in from_file:
        value = from_file[s.key]
        if isinstance(value, bool) or not isinstance(value, s.toml_types):
            wanted = " or ".join(t.__name__ for t in s.toml_types)
            raise ConfigError(f"{s.key} in {shown(path)} = {quote(value)}: must be a TOML {wanted}")
        return _parse(s, value, f"{s.key} in {shown(path)}"), "file", dropped
    return s.default, "default", dropped


def _parse(s: Setting, value: Any, where: str) -> Any:
    try:
        return s.parse(value)
    except ValueError as exc:
        raise ConfigError(f"{where} = {quote(value)}: {exc}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def settings_table() -> str:
    """docs/settings.md's table, as Markdown rows (packaging/settings_doc.py writes it; a test compares)."""
    rows = ["| TOML key | environment | flag | default | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        rows.append(f"| {s.key} | {s.env_text} | {s.flag} | {s.default_text} | {s.meaning} |")
    rows.append(
        f"| (the file itself) | {CONFIG_ENV} | --config | {DEFAULT_CONFIG_FILE} | "
        "TOML file with any of the keys above; a missing default file is fine |"
    )
    return "\n".join(rows)


UNSET_EXAMPLES = {
    "host_device_dir": "/host-dev",
    "metrics_address": "127.0.0.1:9464",
    "probe_address": "127.0.0.1:8081",
    "instance": "node-agent-1",
    "node_name": "node-1",
    "kubeconfig": "/etc/hyperlight-agent/kubeconfig",
    "nfd_features_dir": "/etc/kubernetes/node-feature-discovery/features.d",
}


# The directories the agent writes into (sockets, the CDI spec, the NFD feature file, the DRA record
# of prepared claims). The packaged unit lets it write the default kubelet_dir and cdi_dir only, so
# agent.toml says beside each that any other needs a drop-in (tests/test_packaging_files.py holds
# this to the unit and to the modes' kubelet directories).
WRITTEN_DIRS = ("kubelet_dir", "cdi_dir", "nfd_features_dir", "dra_registry_dir", "dra_plugins_dir")
UNIT_DROP_IN_NOTE = (
    "# Under the packaged systemd unit the agent may write only in the default kubelet_dir and cdi_dir:\n"
    "# any other directory here needs a drop-in with ReadWritePaths= (docs/hosts.md)."
)


def default_file() -> str:
    """The commented default agent.toml shipped in the packages (a test keeps the two equal)."""
    out = [
        "# hyperlight-agent settings. Every key is optional; shown here with its default.",
        "# Environment variables and flags override this file (see `hyperlight-agent --help`).",
        "# After editing: `systemctl reload hyperlight-agent` applies every setting without a moment",
        "# unserved (an in-place replacement; a file it refuses leaves the running agent as it was).",
    ]
    for s in SETTINGS:
        out += ["", f"# {s.meaning[0].upper()}{s.meaning[1:]}.", f"# env {s.env_text}, flag {s.flag}"]
        if s.key in WRITTEN_DIRS:
            out.append(UNIT_DROP_IN_NOTE)
        if s.default is None:
            out.append(f'#{s.key} = "{UNSET_EXAMPLES[s.key]}"   # unset by default')
        elif isinstance(s.default, str):
            out.append(f'#{s.key} = "{s.default}"')
        else:
            out.append(f"#{s.key} = {s.default}")
    return "\n".join(out) + "\n"


def effective(settings: Settings) -> list[str]:
    """What --print-config prints (and the agent logs at debug on start): every setting as a TOML
    line with its value and where it came from; unset ones commented out. A file of these lines
    (without the ignored ones) gives the same settings.

    >>> effective(Settings.defaults(device_count=5, sources=(("device_count", "flag --device-count"),)))[1:3]
    ['device_count = 5  # flag --device-count', 'device_uid = 65534  # default']
    """
    sources = dict(settings.sources)
    lines = [f"# config file: {shown(settings.config_file) if settings.config_file else 'none read'}"]
    for s in SETTINGS:
        value = getattr(settings, s.key)
        source = sources.get(s.key, "default")
        if source == "file" and settings.config_file:
            source = f"file {shown(settings.config_file)}"
        if value is None:
            lines.append(f"#{s.key} = unset  # {source}")
        else:
            lines.append(f"{s.key} = {_toml_value(value)}  # {source}")
    lines += [f"# ignored: {text}" for text in settings.ignored]
    return lines


def _toml_value(value: Any) -> str:
    # json's strings are TOML basic strings (its escapes are TOML's); numbers are the same.
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)
