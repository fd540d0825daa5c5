"""`make bench`: the agent's speed and memory figures, each against a baseline measured in the
same run, printed as one table. Figures, not assertions: nothing here fails a build.

Why: docs/decisions/idle-cost.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable, Optional

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc loads: no GOAWAY chatter in the table

import grpc

from hyperlight_agent import contracts, transport
from hyperlight_agent.device import hypervisors, kernel
from hyperlight_agent.device.helper import ProbeHelper, ProbeRequest
from hyperlight_agent.deviceplugin import api
from hyperlight_agent.deviceplugin import deviceplugin_pb2 as pb
from hyperlight_agent.files import cdi
from standin import flood, procs
from standin.kubelet import Plugin, StandinThread

R = contracts.RESOURCE_HYPERVISOR
ROWS: list[tuple[str, str, str]] = []


def row(name: str, figure: str, target: str = "") -> None:
    ROWS.append((name, figure, target))
    print(f"  {name}: {figure}" + (f"  (target {target})" if target else ""), flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def mknod(path: str, major: int, minor: int) -> None:
    os.mknod(path, 0o600 | 0o020000, os.makedev(major, minor))


class Agent:
    def __init__(self, top: str, *args: str, wrap: Optional[Callable[[list[str]], list[str]]] = None) -> None:
        self.kubelet_dir = os.path.join(top, "kubelet")
        self.cdi_dir = os.path.join(top, "cdi")
        self.proc = subprocess.Popen(
            (wrap or list)(
                [
                    sys.executable,
                    "-m",
                    "hyperlight_agent",
                    "--config",
                    "/dev/null",
                    "--log-level",
                    "warning",
                    "--kubelet-dir",
                    self.kubelet_dir,
                    "--cdi-dir",
                    self.cdi_dir,
                    *args,
                ]
            )
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)

    def rss_mib(self) -> tuple[float, float, float]:
        """(agent RSS, helper RSS, helper private) in MiB. The helper maps the same interpreter
        and libraries as the agent, which a pod's memory cgroup charges once: what the helper
        adds to the agent is its private memory."""
        helpers = procs.children(self.proc.pid)
        return (
            _smaps(self.proc.pid, ("Rss",)),
            sum(_smaps(p, ("Rss",)) for p in helpers),
            sum(_smaps(p, ("Private_Clean", "Private_Dirty")) for p in helpers),
        )


def _smaps(pid: int, fields: tuple[str, ...]) -> float:
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                total += int(rest.split()[0])
    return total / 1024


def wait_file(path: str, wanted: bytes, timeout: float = 5) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path, "rb") as f:
                if f.read() == wanted:
                    return time.monotonic()
        except FileNotFoundError:
            pass
    raise TimeoutError(path)


def bench_probe(device_dir: str) -> float:
    print("probe", flush=True)
    node = os.path.join(device_dir, "kvm")
    raw = []
    for _ in range(200):
        t = time.perf_counter()
        kernel.probe_device(hypervisors.probe_kvm, node)
        raw.append(time.perf_counter() - t)

    async def helper_times() -> tuple[list[float], list[float]]:
        helper = ProbeHelper()
        req = ProbeRequest("kvm", node)
        await helper.run(req)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            await helper.run(req)
            times.append(time.perf_counter() - t)
        await helper.close()
        fresh = []
        for _ in range(20):
            t = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                "-c",
                "import sys; sys.path.insert(0, sys.argv[1]); from hyperlight_agent.device import hypervisors, kernel; "
                "kernel.probe_device(hypervisors.probe_kvm, sys.argv[2])",
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(kernel.__file__)))),
                node,
            )
            assert await proc.wait() == 0, "the fresh process did not probe"
            fresh.append(time.perf_counter() - t)
        return times, fresh

    helper, fresh = asyncio.run(helper_times())
    p50 = statistics.median(raw)
    row("raw in-process probe p50", ms(p50))
    row("helper check p50 (long-lived helper)", ms(statistics.median(helper)))
    row("fresh process per check p50 (rejected design)", ms(statistics.median(fresh)))
    return p50


def bench_allocate(top: str, raw_probe: float) -> None:
    print("allocate", flush=True)
    agent = Agent(top, "--device-count", "2000")
    with StandinThread(os.path.join(top, "kubelet")) as k:
        k.wait_until(lambda kk: kk.allocatable() == 2000, 15)
        sock = os.path.join(top, "kubelet", contracts.PLUGIN_SOCKET)

        async def timed(concurrency: int, n: int, call: Callable[[object], object]) -> list[float]:
            async with grpc.aio.insecure_channel(transport.unix_target(sock)) as ch:
                stub = api.device_plugin_stub(ch)
                times: list[float] = []
                sem = asyncio.Semaphore(concurrency)

                async def one(i: int) -> None:
                    async with sem:
                        t = time.perf_counter()
                        await call(stub)  # type: ignore[misc]
                        times.append(time.perf_counter() - t)

                await asyncio.gather(*(one(i) for i in range(n)))
                return times

        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["kvm-0"])])
        for concurrency, n, target in ((1, 300, 3), (32, 1000, 5)):
            empty = k.call(timed(concurrency, n, lambda s: s.GetDevicePluginOptions(pb.Empty())))  # type: ignore[attr-defined]
            alloc = k.call(timed(concurrency, n, lambda s: s.Allocate(req)))  # type: ignore[attr-defined]
            base = raw_probe + pct(empty, 0.99)
            label = "sequential" if concurrency == 1 else f"{concurrency} concurrent"
            row(f"Allocate {label} p50 / p99", f"{ms(pct(alloc, 0.5))} / {ms(pct(alloc, 0.99))}")
            row(
                f"Allocate {label} p99 ratio to (raw probe + empty RPC p99 {ms(pct(empty, 0.99))})",
                f"{pct(alloc, 0.99) / base:.2f}",
                f"≤ {target}",
            )

        # Helpers alive during a burst of 500 Allocates.
        alive: set[int] = set()
        done = False

        async def burst() -> None:
            nonlocal done
            try:
                await timed(500, 500, lambda s: s.Allocate(req))  # type: ignore[attr-defined]
            finally:
                done = True

        fut = asyncio.run_coroutine_threadsafe(burst(), k.loop)
        max_alive = 0
        while not done:
            pids = procs.children(agent.proc.pid)
            alive.update(pids)
            max_alive = max(max_alive, len(pids))
        fut.result(60)
        row("helpers alive at once during a 500-Allocate burst", str(max_alive), "≤ 1")
        agent.stop()


def bench_streams(top: str) -> None:
    print("streams", flush=True)
    dev = os.path.join(top, "dev")
    os.mkdir(dev)
    mknod(os.path.join(dev, "kvm"), 10, 232)
    agent = Agent(top, "--device-count", "2000", "--device-dir", dev)
    with StandinThread(os.path.join(top, "kubelet")) as k:
        k.wait_until(lambda kk: kk.allocatable() == 2000, 15)
        sock = os.path.join(top, "kubelet", contracts.PLUGIN_SOCKET)
        received: list[list[float]] = [[] for _ in range(50)]

        async def watch(i: int) -> None:
            async with grpc.aio.insecure_channel(transport.unix_target(sock)) as ch:
                async for _ in api.device_plugin_stub(ch).ListAndWatch(pb.Empty()):
                    received[i].append(time.monotonic())

        tasks = [asyncio.run_coroutine_threadsafe(watch(i), k.loop) for i in range(50)]
        while not all(received):
            time.sleep(0.01)
        rss_many = agent.rss_mib()
        spreads, totals = [], []
        for flip in range(10):
            node = os.path.join(dev, "kvm")
            counts = [len(r) for r in received]
            t0 = time.monotonic()
            os.unlink(node)
            mknod(node, *((1, 3) if flip % 2 == 0 else (10, 232)))
            while not all(len(r) > c for r, c in zip(received, counts)):
                time.sleep(0.0005)
            arrivals = [r[c] for r, c in zip(received, counts)]
            spreads.append(max(arrivals) - min(arrivals))
            totals.append(max(arrivals) - t0)
        row("50 streams: first → last stream updated, worst of 10 changes", ms(max(spreads)))
        row("50 streams: device change → all updated (check included), worst of 10", ms(max(totals)), "≤ 50 ms")
        row("RSS with 2000 slots and 51 streams: agent + helper's private (MiB)", f"{rss_many[0] + rss_many[2]:.1f}")
        for t in tasks:
            t.cancel()
    agent.stop()


def bench_rss_and_start(top: str) -> None:
    print("start and memory", flush=True)
    grpc_imports = []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import grpc"], check=True)
        grpc_imports.append(time.perf_counter() - t)
    notify_path = os.path.join(top, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    os.environ["NOTIFY_SOCKET"] = notify_path
    try:
        with StandinThread(os.path.join(top, "kubelet")) as k:
            starts = []
            for _ in range(5):
                t = time.monotonic()
                agent = Agent(top, "--device-count", "2000")
                notify.settimeout(15)
                while b"READY=1" not in notify.recv(65536):
                    pass
                starts.append(time.monotonic() - t)
                sock = os.path.join(top, "kubelet", contracts.PLUGIN_SOCKET)

                async def watch(sock: str = sock) -> None:
                    async with grpc.aio.insecure_channel(transport.unix_target(sock)) as ch:
                        async for _ in api.device_plugin_stub(ch).ListAndWatch(pb.Empty()):
                            pass

                streams = [asyncio.run_coroutine_threadsafe(watch(), k.loop) for _ in range(9)]
                time.sleep(0.5)  # benchmark settling, not synchronisation: let the streams send
                rss = agent.rss_mib()
                for s in streams:
                    s.cancel()
                agent.stop()
                k.call(k.kubelet.restart())
    finally:
        del os.environ["NOTIFY_SOCKET"]
        notify.close()
    row("process start → READY=1 (sd_notify), p50", ms(statistics.median(starts)), "≤ 1.5 s")
    row("python -c 'import grpc' p50 (baseline)", ms(statistics.median(grpc_imports)))
    row(
        "RSS with 2000 slots and 10 streams: agent / probe helper (its private part) (MiB)",
        f"{rss[0]:.1f} / {rss[1]:.1f} ({rss[2]:.1f})",
    )
    row("RSS with 2000 slots and 10 streams: agent + helper's private (MiB)", f"{rss[0] + rss[2]:.1f}", "≤ 48 MiB")


# Kubelet restarts per flavour in section d (HYPERLIGHT_BENCH_RESTARTS overrides it).
KUBELET_RESTARTS = int(os.environ.pop("HYPERLIGHT_BENCH_RESTARTS", "100"))


def bench_restart_and_cdi(top: str) -> None:
    print("restart and CDI repair", flush=True)
    agent = Agent(top, "--device-count", "2000")
    with StandinThread(os.path.join(top, "kubelet")) as k:
        k.wait_until(lambda kk: kk.allocatable() == 2000, 15)
        for flavor in ("1.34", "1.37"):
            k.run(lambda kk, f=flavor: setattr(kk, "flavor", f))  # type: ignore[misc]
            regs, healthies = [], []
            for _ in range(KUBELET_RESTARTS):
                k.call(k.kubelet.restart())
                k.wait_until(lambda kk: kk.allocatable() == 2000, 10)
                kk = k.kubelet
                regs.append(kk.register_calls[-1][0] - kk.started_at)
                healthies.append(kk.plugins[R].lists[-1][0] - kk.started_at)
            row(
                f"kubelet restart ({flavor}): new kubelet.sock → Register p50 / max",
                f"{ms(pct(regs, 0.5))} / {ms(max(regs))}",
            )
            row(
                f"kubelet restart ({flavor}): new kubelet.sock → Healthy listed p50 / p99 / max over "
                f"{KUBELET_RESTARTS}",
                f"{ms(pct(healthies, 0.5))} / {ms(pct(healthies, 0.99))} / {ms(max(healthies))}",
                "p99 ≤ 20 ms",
            )
        path = cdi.spec_path(agent.cdi_dir)
        wanted = cdi.render("kvm", "/dev/kvm", 65534, 65534)
        wait_file(path, wanted)
        latencies = []
        for i in range(100):
            t = time.monotonic()
            if i % 2:
                os.unlink(path)
            else:
                with open(path, "wb") as f:
                    f.write(b'{"cdiVersion": "0.3.0", "kind": ')
            latencies.append(wait_file(path, wanted) - t)
        row(
            "CDI repair (delete or corrupt → exact bytes) p50 / p99",
            f"{ms(pct(latencies, 0.5))} / {ms(pct(latencies, 0.99))}",
            "p99 ≤ 0.25 s",
        )
    agent.stop()


def bench_upgrade_in_place(top: str) -> None:
    """`systemctl reload` / a package upgrade (host/successor.py) under the service-manager
    stand-in, against the restart it replaces (section e, same run): the kubelet's zero-healthy
    time during each, and how long an upgrade takes."""
    print("in-place upgrade", flush=True)
    events, notify = os.path.join(top, "events.jsonl"), os.path.join(top, "notify")
    common = [
        "--config",
        "/dev/null",
        "--log-level",
        "warning",
        "--kubelet-dir",
        os.path.join(top, "kubelet"),
        "--cdi-dir",
        os.path.join(top, "cdi"),
        "--device-count",
        "2000",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))}

    def main_pid() -> int:
        with open(events) as f:
            return int([json.loads(line)["pid"] for line in f if '"event": "main"' in line][-1])

    with StandinThread(os.path.join(top, "kubelet")) as k:
        k.run(lambda kk: setattr(kk, "flavor", "1.37"))
        unit = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "standin.manager",
                events,
                notify,
                "--",
                sys.executable,
                "-m",
                "hyperlight_agent",
                *common,
            ],
            env=env,
        )
        try:
            k.wait_until(lambda kk: kk.allocatable() == 2000, 15)
            since, took = time.monotonic(), []
            for _ in range(10):
                t = time.monotonic()
                subprocess.run(
                    [sys.executable, "-m", "hyperlight_agent", *common, "--upgrade-in-place", str(main_pid())],
                    check=True,
                    capture_output=True,
                    env=env,
                    timeout=90,
                )
                took.append(time.monotonic() - t)
            zeros = [at for at, counts in k.kubelet.timeline if at >= since and counts.get(R, 0) == 0]
        finally:
            unit.terminate()
            unit.wait(30)
    row(
        "in-place upgrade (--upgrade-in-place): kubelet moments at zero healthy over 10 (restart: section e)",
        str(len(zeros)),
        "0",
    )
    row("in-place upgrade: command start → old agent gone p50 / max over 10", f"{ms(pct(took, 0.5))} / {ms(max(took))}")


def first_healthy_list(plugin: Plugin) -> float:
    return next(t for t, devices in plugin.lists if devices and devices[0][1] == contracts.HEALTHY)


def bench_plugin_restart(top: str) -> None:
    """The kubelet's zero-healthy window: from the old stream's end (the kubelet marks every
    device unhealthy) to the first Healthy list on the new registration."""
    print("plugin restart and stream loss", flush=True)
    with StandinThread(os.path.join(top, "kubelet")) as k:
        windows, exits, lost = [], [], []
        agent = Agent(top, "--device-count", "2000")
        try:
            k.wait_until(lambda kk: kk.allocatable() == 2000, 15)
            for _ in range(20):
                old = k.kubelet.plugins[R]
                t = time.monotonic()
                agent.stop()
                exits.append(time.monotonic() - t)
                agent = Agent(top, "--device-count", "2000")  # as systemd or the kubelet would: after exit
                k.wait_until(lambda kk, old=old: kk.plugins[R] is not old and kk.allocatable() == 2000, 15)  # type: ignore[misc]
                assert old.stream_ended_at is not None
                windows.append(first_healthy_list(k.kubelet.plugins[R]) - old.stream_ended_at)
            # One loss per agent: losses in a row back off on purpose (a kubelet that keeps
            # dropping streams), which is not what this figure is about.
            for _ in range(20):
                old = k.kubelet.plugins[R]
                k.call(k.kubelet.drop_stream(R))
                assert old.stream_ended_at is not None
                k.wait_until(lambda kk, old=old: kk.plugins[R] is not old and kk.allocatable() == 2000, 15)  # type: ignore[misc]
                lost.append(first_healthy_list(k.kubelet.plugins[R]) - old.stream_ended_at)
                agent.stop()
                agent = Agent(top, "--device-count", "2000")
                k.wait_until(lambda kk: kk.allocatable() == 2000, 15)
        finally:
            agent.stop()
    row(
        "agent restart (SIGTERM, start again): zero-healthy window p50 / p99 over 20",
        f"{ms(pct(windows, 0.5))} / {ms(pct(windows, 0.99))}",
        "p99 ≤ 0.3 s",
    )
    row("agent restart: SIGTERM → exit p50 / max", f"{ms(pct(exits, 0.5))} / {ms(max(exits))}")
    row("stream lost → Healthy again p50 / p99 over 20", f"{ms(pct(lost, 0.5))} / {ms(pct(lost, 0.99))}", "p99 ≤ 1 s")


# Idle cost: the window measured (scaled to a minute), and the settling before it. 60 s is the
# ideal window; 30 s keeps `make bench` short (HYPERLIGHT_BENCH_IDLE_S overrides it).
IDLE_WINDOW_S = float(os.environ.pop("HYPERLIGHT_BENCH_IDLE_S", "30"))
IDLE_SETTLE_S = 5.0
# The baseline: a bare grpc.aio server on a unix socket, idle with no client, as one process.
BARE_GRPC = """
import asyncio, sys
import grpc
async def main():
    server = grpc.aio.server()
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()
    print("serving", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)
asyncio.run(main())
"""


def _task_sample(pid: int, tid: str) -> tuple[str, int, int, int]:
    """(command name, ns on CPU, utime+stime ticks, voluntary context switches) of one thread.
    schedstat's nanoseconds, not the 10 ms ticks: most threads here run well under a tick."""
    base = f"/proc/{pid}/task/{tid}"
    with open(f"{base}/comm") as f:
        comm = f.read().strip()
    with open(f"{base}/schedstat") as f:
        run_ns = int(f.read().split()[0])
    with open(f"{base}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    voluntary = 0
    with open(f"{base}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                voluntary = int(line.split()[1])
    return comm, run_ns, int(fields[11]) + int(fields[12]), voluntary


def _sample(pid: int, helpers: bool) -> dict[tuple[int, int], tuple[str, str, int, int, int]]:
    """Every thread of pid (and of its probe helpers): (pid, tid) → (part, comm, ns, ticks, wakeups),
    part being "main", "threads" (all others of pid: grpc's) or "helper"."""
    out = {}
    for p in [pid, *(procs.children(pid) if helpers else [])]:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                comm, run_ns, ticks, voluntary = _task_sample(p, tid)
            except (OSError, IndexError, ValueError):
                continue  # ended while we looked
            part = "helper" if p != pid else ("main" if int(tid) == pid else "threads")
            out[(p, int(tid))] = (part, comm, run_ns, ticks, voluntary)
    return out


def _idle_cost(
    before: dict[tuple[int, int], tuple[str, str, int, int, int]],
    after: dict[tuple[int, int], tuple[str, str, int, int, int]],
    seconds: float,
) -> dict[str, tuple[float, float]]:
    """part → (CPU ms per minute, voluntary context switches per minute); "total" and "ticks"
    (utime+stime of all, ms per minute) too. Threads that ended in the window are not counted."""
    per_minute = 60.0 / seconds
    cost: dict[str, tuple[float, float]] = {}
    ticks = 0
    tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
    for key, (part, _, run_ns, tick, wakeups) in after.items():
        _, _, run0, tick0, wakeups0 = before.get(key, (part, "", 0, 0, 0))
        ms_, w = cost.get(part, (0.0, 0.0))
        cost[part] = (ms_ + (run_ns - run0) / 1e6 * per_minute, w + (wakeups - wakeups0) * per_minute)
        ticks += tick - tick0
    cost["total"] = (sum(c[0] for c in cost.values()), sum(c[1] for c in cost.values()))
    cost["ticks"] = (ticks * tick_ms * per_minute, 0.0)
    return cost


def bench_idle(top: str) -> None:
    """CPU and wakeups of an idle agent (the real /dev/kvm, registered and streamed by the
    stand-in, default check interval), beside a bare grpc.aio server measured over the same window."""
    print(f"idle cost ({IDLE_SETTLE_S:g} s settling, {IDLE_WINDOW_S:g} s window)", flush=True)
    bare = subprocess.Popen(
        [sys.executable, "-c", BARE_GRPC, os.path.join(top, "bare.sock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    agent = Agent(top)
    try:
        assert bare.stdout is not None and bare.stdin is not None
        bare.stdout.readline()  # "serving"
        with StandinThread(os.path.join(top, "kubelet")) as k:
            k.wait_until(lambda kk: kk.allocatable() == 2000, 15)
            time.sleep(IDLE_SETTLE_S)  # benchmark settling, not synchronisation: startup's work done
            threads = sorted({comm for _, comm, *_ in _sample(agent.proc.pid, helpers=False).values()})
            t0 = time.monotonic()
            before, bare_before = _sample(agent.proc.pid, helpers=True), _sample(bare.pid, helpers=False)
            time.sleep(IDLE_WINDOW_S)  # the window measured
            after, bare_after = _sample(agent.proc.pid, helpers=True), _sample(bare.pid, helpers=False)
            seconds = time.monotonic() - t0
            assert k.kubelet.allocatable() == 2000, "the agent stayed registered and healthy"
            agent.stop()  # before the stand-in goes: its end would be a lost stream to the agent
    finally:
        agent.stop()
        if bare.stdin is not None:
            bare.stdin.close()
        bare.wait(10)
    cost, base = _idle_cost(before, after, seconds), _idle_cost(bare_before, bare_after, seconds)
    main_, grpc_, helper = (cost.get(part, (0.0, 0.0)) for part in ("main", "threads", "helper"))
    row(
        f"idle CPU per minute: agent + probe helper (ms, {seconds:.0f} s window scaled to 60 s)",
        f"{cost['total'][0]:.1f} (utime+stime ticks: {cost['ticks'][0]:.0f})",
        "≤ 10 ms",
    )
    row(
        "idle CPU per minute: main thread / grpc's threads / probe helper (ms)",
        f"{main_[0]:.1f} / {grpc_[0]:.1f} / {helper[0]:.1f}",
    )
    row(
        "idle wakeups per minute (voluntary context switches): main / grpc's threads / helper",
        f"{main_[1]:.0f} / {grpc_[1]:.0f} / {helper[1]:.0f}",
    )
    row(
        "idle CPU per minute: a bare grpc.aio server, no client (baseline, same window) (ms)",
        f"{base['total'][0]:.1f} ({base['total'][1]:.0f} wakeups)",
    )
    row(
        "idle CPU per minute, ratio agent + helper to the bare grpc.aio server",
        f"{cost['total'][0] / max(base['total'][0], 0.01):.2f}",
    )
    print(f"  (agent threads: {', '.join(threads)})", flush=True)


# Probe cost (section m): a minute per way of probing, as the chart's pods are probed (readiness
# every 10 s, liveness every 20 s), the agent and what the probes run in a cgroup of its own, as in
# a container. HYPERLIGHT_BENCH_PROBE_S shortens the window (the schedule keeps its rates).
PROBE_WINDOW_S = float(os.environ.pop("HYPERLIGHT_BENCH_PROBE_S", "60"))


def _probe_periods() -> tuple[float, float]:
    """The readiness and liveness probes' periods the manifests give the agents (the kustomize
    base, which the chart renders alike: tests/test_helm.py)."""
    import yaml

    with open(
        os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "base", "device-plugin.yaml"
        )
    ) as f:
        (container,) = yaml.safe_load(f)["spec"]["template"]["spec"]["containers"]
    return float(container["readinessProbe"]["periodSeconds"]), float(container["livenessProbe"]["periodSeconds"])


READINESS_EVERY_S, LIVENESS_EVERY_S = _probe_periods()
# The chart's exec probes before they became HTTP GETs (issue 36): readiness 10 s, liveness 20 s.
EXEC_PERIODS_BEFORE = (10.0, 20.0)
PROBE_PORT_ADDRESS = "127.0.0.1:{port}"


class Cgroup:
    """A cgroup v1 (cpuacct, memory) or v2 group for one scenario: what a container's cgroup counts
    (CPU nanoseconds, the memory high-water mark) for every process in it, probes included."""

    def __init__(self, name: str) -> None:
        v1 = os.path.isdir("/sys/fs/cgroup/cpuacct") and os.path.isdir("/sys/fs/cgroup/memory")
        self.v1 = v1
        self.dirs = (
            [f"/sys/fs/cgroup/cpuacct/{name}", f"/sys/fs/cgroup/memory/{name}"] if v1 else [f"/sys/fs/cgroup/{name}"]
        )
        for d in self.dirs:
            os.mkdir(d)

    def wrap(self, argv: list[str]) -> list[str]:
        """argv started inside the group (the shell joins it, then execs)."""
        joins = "; ".join(f"echo $$ > {d}/cgroup.procs" for d in self.dirs)
        return ["sh", "-c", f'{joins}; exec "$@"', "sh", *argv]

    def cpu_ns(self) -> int:
        if self.v1:
            with open(f"{self.dirs[0]}/cpuacct.usage") as f:
                return int(f.read())
        with open(f"{self.dirs[0]}/cpu.stat") as f:
            return int(f.readline().split()[1]) * 1000  # usage_usec

    def reset_peak(self) -> None:
        with open(f"{self.dirs[-1]}/{'memory.max_usage_in_bytes' if self.v1 else 'memory.peak'}", "w") as f:
            f.write("0")

    def peak_mib(self) -> float:
        with open(f"{self.dirs[-1]}/{'memory.max_usage_in_bytes' if self.v1 else 'memory.peak'}") as f:
            return int(f.read()) / 2**20

    def remove(self) -> None:
        for d in self.dirs:
            with contextlib.suppress(OSError):
                os.rmdir(d)


def _exec_probe(cgroup: Cgroup, kubelet_dir: str, which: str) -> None:
    """What the kubelet's exec probe ran: a fresh agent process asking the health service."""
    argv = [sys.executable, "-m", "hyperlight_agent", "--config", "/dev/null", "--kubelet-dir", kubelet_dir]
    done = subprocess.run(
        cgroup.wrap([*argv, f"--health-check={which}"]), capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _http_probe(address: str, which: str) -> None:
    """What the kubelet's httpGet probe sends, from outside the pod's cgroup (the kubelet's own)."""
    with urllib.request.urlopen(f"http://{address}/{'readyz' if which == 'readiness' else 'livez'}", timeout=5) as r:
        assert r.status == 200


# Probes timed one by one for their CPU each, spaced so that each finds the agent idle.
PER_PROBE_SAMPLES = {"exec": 20, "http": 300}
PROBE_SPACING_S = 0.05


def _probe_scenario(
    top: str, way: str, periods: tuple[float, float], idle_m: float = 0.0
) -> tuple[float, float, int, float]:
    """(millicores, memory high-water MiB, probes sent, CPU ms of one probe) of an idle agent
    probed `way` (none, exec, http) for PROBE_WINDOW_S, readiness and liveness every `periods`;
    `idle_m`: the unprobed agent's millicores, its own share of the time timing single probes."""
    directory = os.path.join(top, way)
    os.mkdir(directory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = PROBE_PORT_ADDRESS.format(port=s.getsockname()[1])
    cgroup = Cgroup(f"hl-bench-{os.getpid()}-{way}")
    kubelet_dir = os.path.join(directory, "kubelet")

    def probe(which: str) -> None:
        if way == "exec":
            _exec_probe(cgroup, kubelet_dir, which)
        elif way == "http":
            _http_probe(address, which)

    try:
        agent = Agent(directory, "--probe-address", address, wrap=cgroup.wrap)
        try:
            with StandinThread(kubelet_dir) as k:
                k.wait_until(lambda kk: kk.allocatable() == 2000, 15)
                time.sleep(IDLE_SETTLE_S)  # benchmark settling, not synchronisation: startup's work done
                cgroup.reset_peak()
                start, t0, sent = cgroup.cpu_ns(), time.monotonic(), 0
                due = [(0.0, 0), (0.0, 1)]  # (when, which period: readiness's, liveness's)
                while min(due)[0] < PROBE_WINDOW_S:
                    at, which = min(due)
                    time.sleep(max(0.0, t0 + at - time.monotonic()))  # the probes' schedule
                    probe(("readiness", "liveness")[which])
                    sent += way != "none"
                    due.remove((at, which))
                    due.append((at + periods[which], which))
                time.sleep(max(0.0, t0 + PROBE_WINDOW_S - time.monotonic()))
                used, seconds = cgroup.cpu_ns() - start, time.monotonic() - t0
                peak = cgroup.peak_mib()
                # One probe's CPU, over many (the minute's figure is near the machine's noise for
                # a cheap probe): spaced like probes, each lands on an idle agent.
                many = PER_PROBE_SAMPLES.get(way, 0)
                before, t1 = cgroup.cpu_ns(), time.monotonic()
                for _ in range(many):
                    probe("readiness")
                    time.sleep(PROBE_SPACING_S)  # benchmark pacing, not synchronisation
                idle_ms = idle_m * (time.monotonic() - t1)  # millicores × s = ms
                each = ((cgroup.cpu_ns() - before) / 1e6 - idle_ms) / many if many else 0.0
                assert k.kubelet.allocatable() == 2000, "the agent stayed registered and healthy"
                agent.stop()  # before the stand-in goes: its end would be a lost stream to the agent
        finally:
            agent.stop()
    finally:
        cgroup.remove()
    return used / 1e6 / seconds, peak, sent, each


def bench_probe_cost(top: str) -> None:
    """An agent pod's CPU and memory high-water mark, idle, with its probes as exec (a fresh
    process each) and as httpGet answered by the agent (issue 36: 2); the same agent unprobed is
    the baseline."""
    print(
        f"probe cost ({PROBE_WINDOW_S:g} s per way, readiness every {READINESS_EVERY_S:g} s, liveness every "
        f"{LIVENESS_EVERY_S:g} s)",
        flush=True,
    )
    now = (READINESS_EVERY_S, LIVENESS_EVERY_S)
    found = {"none": _probe_scenario(top, "none", now)}
    idle = found["none"][0]
    found["exec"] = _probe_scenario(top, "exec", EXEC_PERIODS_BEFORE, idle)
    found["http"] = _probe_scenario(top, "http", now, idle)
    for way, label, periods in (
        ("exec", "exec probes (before: every 10 s and 20 s)", EXEC_PERIODS_BEFORE),
        ("http", f"httpGet probes (after: every {now[0]:g} s and {now[1]:g} s)", now),
    ):
        cores, peak, sent, each = found[way]
        per_minute = sum(60 / p for p in periods)
        row(f"agent pod CPU with {label}, {sent} probes in {PROBE_WINDOW_S:g} s (millicores)", f"{cores:.2f} m")
        row(
            f"one {way} probe's CPU (ms, mean of {PER_PROBE_SAMPLES[way]}) → {per_minute:g} a minute: millicores, "
            "the share on top of the idle agent",
            f"{each:.3f} ms → {each * per_minute / 60:.3f} m, {each * per_minute / (idle * 60):.0%}",
            "≤ 10 %" if way == "http" else "",
        )
        row(f"agent pod memory high-water mark with {label} (MiB)", f"{peak:.1f}")
    row("agent pod CPU, idle and unprobed (baseline, same way): millicores", f"{idle:.2f} m")
    row("agent pod memory high-water mark, unprobed (MiB)", f"{found['none'][1]:.1f}")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_RECORD = os.path.join(ROOT, "build", "image.json")
SLIM_BASE = "python:3.13-slim"


# Run in another process (its sockets and its CPU are not the measuring process's): 1000 idle
# connections to the metrics port, "ready", then garbage requests until stdin closes.
METRICS_FLOOD = """
import socket, sys, threading
port = int(sys.argv[1])
idle = []
for _ in range(1000):
    c = socket.socket()
    c.settimeout(2)
    try:
        c.connect(("127.0.0.1", port))
        c.send(b"GET /metrics HTTP/1.1\\r\\n")  # never finished
    except OSError:
        pass
    idle.append(c)
print("ready", flush=True)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
sent = 0
while not done.is_set():
    with socket.socket() as c:
        c.settimeout(2)
        try:
            c.connect(("127.0.0.1", port))
            c.sendall(b"\\x16\\x03\\x01 garbage\\r\\n\\r\\n")
            c.recv(64)
        except OSError:
            pass
    sent += 1
print(sent, flush=True)
"""


def bench_metrics_flood(top: str) -> None:
    """Allocate as the kubelet calls it, quiet and then while 1000 idle connections and a stream
    of garbage requests hit the metrics port; the slots the kubelet counted healthy throughout."""
    print("metrics flood", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = Agent(top, "--device-count", "2000", "--metrics-address", f"127.0.0.1:{port}")
    with StandinThread(os.path.join(top, "kubelet")) as k:
        k.wait_until(lambda kk: kk.allocatable() == 2000, 15)
        plugin = k.kubelet.plugins[R]

        def allocates(n: int) -> list[float]:
            times = []
            for _ in range(n):
                t = time.perf_counter()
                k.call(k.kubelet.allocate(R, ["kvm-0"]))
                times.append(time.perf_counter() - t)
            return times

        def cpu_over(n: int) -> tuple[list[float], float]:
            """n Allocates' times, and the agent's CPU seconds a second while they ran."""
            cpu, wall = flood.cpu_seconds(agent.proc.pid), time.monotonic()
            times = allocates(n)
            return times, (flood.cpu_seconds(agent.proc.pid) - cpu) / (time.monotonic() - wall)

        quiet, cpu_quiet = cpu_over(300)
        flooder = subprocess.Popen(
            [sys.executable, "-c", METRICS_FLOOD, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert flooder.stdout is not None and flooder.stdin is not None
            flooder.stdout.readline()  # "ready": the idle connections are in place
            lists_before = len(plugin.lists)
            flooded, cpu_flooded = cpu_over(300)
            fds = len(os.listdir(f"/proc/{agent.proc.pid}/fd"))
            flooder.stdin.close()
            garbage = flooder.stdout.readline().strip()
        finally:
            if flooder.poll() is None:
                flooder.kill()
            flooder.wait(10)
        lowest = min(
            (sum(h == contracts.HEALTHY for _, h in devices) for _, devices in plugin.lists[lists_before:]),
            default=2000,
        )
        still_streamed = k.kubelet.plugins[R] is plugin and plugin.stream_open
        row(
            "Allocate p99 quiet / under a metrics flood (1000 idle + garbage requests)",
            f"{ms(pct(quiet, 0.99))} / {ms(pct(flooded, 0.99))} ({garbage} garbage requests)",
        )
        row("Allocate p99 under a metrics flood, ratio to quiet", f"{pct(flooded, 0.99) / pct(quiet, 0.99):.2f}", "≤ 2")
        row(
            "agent CPU while the Allocates ran, quiet / under the metrics flood (CPU s per s)",
            f"{cpu_quiet:.2f} / {cpu_flooded:.2f}",
        )
        row(
            "healthy slots at the lowest during the metrics flood",
            f"{lowest}{'' if still_streamed else ' (the stream was lost)'}",
            "2000",
        )
        row("agent descriptors during the metrics flood", str(fds), "< 64")
        agent.stop()


def bench_probe_flood(top: str) -> None:
    """The probe port under issue 47's flood (1000 connections a second from a local process, no
    request on any, each closed after 50 ms) while the kubelet's liveness probe is sent once a
    second for 15 s (the flood lasting until the last one's timeout, 20 s): the probes that
    failed, and the agent's CPU (utime + stime) per second of flood beside the same agent's over
    15 s of those probes alone."""
    print("probe flood", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = Agent(top, "--device-count", "1", "--probe-address", f"127.0.0.1:{port}")
    try:
        with StandinThread(os.path.join(top, "kubelet")) as k:
            k.wait_until(lambda kk: kk.allocatable() == 1, 15)
            deadline = time.monotonic() + 10
            while flood.http_probe("127.0.0.1", port, "/livez", 1) != flood.OK:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"127.0.0.1:{port}: the probe port never served")
                time.sleep(0.1)  # polled until it serves, within the deadline
            before = flood.cpu_seconds(agent.proc.pid)
            for _ in range(flood.SECONDS):  # the probes alone: the baseline
                assert flood.http_probe("127.0.0.1", port, "/livez", flood.PROBE_TIMEOUT_S) == flood.OK
                time.sleep(1)  # the kubelet's period
            quiet = (flood.cpu_seconds(agent.proc.pid) - before) / flood.SECONDS
            run = flood.under_flood("127.0.0.1", port, agent.proc.pid)
    finally:
        agent.stop()
    seconds = run.made["seconds"]
    slowest = max(p.took for p in run.probes)
    row(
        f"liveness probes failed under a probe-port flood ({flood.RATE}/s, held {flood.HOLD_S * 1000:g} ms, "
        f"{flood.SECONDS + flood.PROBE_TIMEOUT_S} s), slowest answer",
        f"{len(run.failed())} of {len(run.probes)}, {ms(slowest)}",
        "0",
    )
    row(
        "agent CPU under the probe-port flood / with its probes alone (CPU s per s)",
        f"{run.cpu / seconds:.3f} / {quiet:.3f} ({run.cpu:.2f} s over {seconds:g} s, "
        f"{run.cpu / run.made['connections'] * 1e6:.0f} µs a connection)",
    )


def bench_dra(top: str) -> None:  # noqa: PLR0915 - one scenario, start to end
    """The DRA mode (--dra) as a process: its start until the ResourceSlice is published, Prepare
    latency through the DRA stand-in, and its memory beside the device plugin's. The API server
    is the tests' fake (tests/test_dra_slices.py): v1.37's JSON on plain HTTP, on this machine."""
    import threading

    from standin.apiserver import FakeApiServer, kubeconfig, recorded
    from standin.dra_kubelet import Claim, DraKubeletStandin

    print("dynamic resource allocation", flush=True)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # type: ignore[arg-type]

    registry, plugins = os.path.join(top, "registry"), os.path.join(top, "plugins")
    os.makedirs(registry)
    os.makedirs(plugins)
    fake = FakeApiServer()
    url = call(fake.start())
    kubelet = DraKubeletStandin(registry)
    call(kubelet.__aenter__())
    started = time.monotonic()
    agent = Agent(
        top,
        "--dra",
        "--kubeconfig",
        kubeconfig(top, str(url)),
        "--node-name",
        "node1",
        "--instance",
        "bench",
        "--dra-registry-dir",
        registry,
        "--dra-plugins-dir",
        plugins,
    )
    try:
        deadline = started + 30
        while not (fake.ours() and len(fake.ours()[0]["spec"].get("devices") or []) == 128):
            if time.monotonic() > deadline:
                raise TimeoutError("no ResourceSlice published")
            time.sleep(0.005)
        published = time.monotonic() - started
        while not kubelet.instances.get(contracts.DRA_DRIVER):
            time.sleep(0.005)
        claim = recorded("resourceclaim-allocated.json")
        fresh: list[float] = []
        again: list[float] = []
        for i in range(200):
            uid = f"00000000-0000-4000-8000-{i:012d}"
            body = json.loads(
                json.dumps(claim).replace(claim["metadata"]["uid"], uid).replace("pod-hv-9x2lq", f"claim-{i}")
            )
            fake.claims[("default", f"claim-{i}")] = body
            for into in (fresh, again):  # a new claim, then the kubelet asking again (idempotent)
                t = time.perf_counter()
                answer = call(kubelet.prepare(contracts.DRA_DRIVER, [Claim("default", f"claim-{i}", uid)]))
                into.append(time.perf_counter() - t)
                assert not answer[uid].error, answer[uid].error  # type: ignore[index]
        dra_rss = agent.rss_mib()
    finally:
        agent.stop()
        call(kubelet.__aexit__(None, None, None))
        call(fake.stop())

        async def cancel_the_rest() -> None:  # the fake's open connections (the agent's watch)
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        call(cancel_the_rest())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    with StandinThread(os.path.join(top, "kubelet")):
        plugin = Agent(top, "--device-count", "2000")
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(top, "kubelet", contracts.PLUGIN_SOCKET)):
                if time.monotonic() > deadline:
                    raise TimeoutError("the device plugin did not start")
                time.sleep(0.01)
            time.sleep(0.5)  # benchmark settling, not synchronisation
            plugin_rss = plugin.rss_mib()
        finally:
            plugin.stop()
    row("DRA: process start → ResourceSlice of 128 devices published", ms(published), "≤ 1.5 s")
    row(
        "DRA: NodePrepareResources, new claim (API read + fresh check + record), p50 / p99",
        f"{ms(pct(fresh, 0.5))} / {ms(pct(fresh, 0.99))}",
        "p99 ≤ 50 ms",
    )
    row(
        "DRA: NodePrepareResources, claim already prepared, p50 / p99",
        f"{ms(pct(again, 0.5))} / {ms(pct(again, 0.99))}",
    )
    row(
        "RSS, agent + helper's private (MiB): DRA mode / device plugin mode (baseline)",
        f"{dra_rss[0] + dra_rss[2]:.1f} / {plugin_rss[0] + plugin_rss[2]:.1f}",
        "DRA ≤ 64 MiB",
    )


MOUNT_STORM = """
import asyncio, ctypes, os, sys, time
from hyperlight_agent.files import watcher
libc = ctypes.CDLL(None, use_errno=True)
top, pairs = sys.argv[1], int(sys.argv[2])
directory, outside = os.path.join(top, "dev"), os.path.join(top, "volumes")
os.makedirs(directory)
open(os.path.join(directory, "kvm"), "w").close()
for i in range(500):  # a busy node's table: hundreds of pod volumes
    os.makedirs(os.path.join(outside, str(i)))
    assert libc.mount(b"tmpfs", os.path.join(outside, str(i)).encode(), b"tmpfs", 0, None) == 0
storm_dir = os.path.join(outside, "storm").encode()
os.makedirs(storm_dir)
with open("/proc/self/mountinfo") as f:
    table = f.read()
t = time.thread_time()
for _ in range(20):
    watcher.mount_points(table)
parse_s = (time.thread_time() - t) / 20  # what every event cost when each one was parsed
seen = []
def storm():
    for _ in range(pairs):
        assert libc.mount(b"tmpfs", storm_dir, b"tmpfs", 0, None) == 0
        assert libc.umount2(storm_dir, 0) == 0
async def main():
    loop = asyncio.get_running_loop()
    w = watcher.DirectoryWatcher()
    w.watch(directory, lambda name: seen.append((name, loop.time())), {"kvm"})
    task = asyncio.ensure_future(w.run())
    while not seen:
        await asyncio.sleep(0.01)
    cpu = time.thread_time()
    await loop.run_in_executor(None, storm)
    await asyncio.sleep(0.3)  # the last coalesced read
    cpu = time.thread_time() - cpu
    latencies = []
    for i in range(20):
        await asyncio.sleep(0.15)  # quiet, then one change that matters
        before = len(seen)
        started = loop.time()
        libc.mount(b"/dev/null", os.path.join(directory, "kvm").encode(), None, 4096, None)  # MS_BIND
        while len(seen) == before:
            await asyncio.sleep(0.0005)
        latencies.append(seen[-1][1] - started)
        libc.umount2(os.path.join(directory, "kvm").encode(), 0)
        while len(seen) == before + 1:
            await asyncio.sleep(0.0005)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    latencies.sort()
    print(cpu, parse_s, latencies[len(latencies) // 2], latencies[-1])
asyncio.run(main())
"""


def bench_mount_storm(top: str) -> None:
    """The mount-table watch under a storm of pod-volume mounts outside every watched directory,
    with 500 mounts in the table: the watcher's CPU per 1000 mount changes (its own thread),
    against parsing the table once per change (how it worked before); and how soon a change that
    matters (/dev/null bound over a watched device node) is seen."""
    print("mount storm", flush=True)
    pairs = 2500
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", MOUNT_STORM, top, str(pairs)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    cpu, parse_s, p50, worst = (float(v) for v in done.stdout.split())
    events = 2 * pairs
    row(
        "mount storm, 500 mounts in the table: watcher CPU per 1000 mount changes / parsing every change (before)",
        f"{ms(cpu / events * 1000)} / {ms(parse_s * 1000)}",
        "≤ 1/10 of before",
    )
    row("a mount over a watched device node seen after, p50 / worst of 20", f"{ms(p50)} / {ms(worst)}", "≤ 100 ms")


def bench_prepared_record(top: str) -> None:
    """NodePrepareResources of new claims while the record holds 40 000 entries (a node whose
    kubelet never unprepared): latency, and the longest the event loop was held meanwhile; the
    same with an empty record as the baseline."""
    from hyperlight_agent.device.observation import Observation
    from hyperlight_agent.dra import dra_v1_pb2 as v1
    from hyperlight_agent.dra import prepared, prepared_format
    from hyperlight_agent.dra.service import Service
    from hyperlight_agent.dra.types import AllocatedDevice

    print("prepared-claims record", flush=True)

    class Claims:
        async def allocation(self, namespace: str, name: str, uid: str) -> list[AllocatedDevice]:
            return [AllocatedDevice("hv", contracts.DRA_DRIVER, "node1", "kvm-0", None)]

    def one(directory: str, entries: int) -> tuple[float, float, float]:
        os.makedirs(directory)
        claim = prepared_format.PreparedClaim(
            "ns", "c", (prepared_format.PreparedDevice("hv", "node1", "kvm-0", ("x",), None),)
        )
        raw = {
            "version": prepared_format.VERSION,
            "claims": {f"old-{i}": prepared_format.encode_claim(claim, time.time()) for i in range(entries)},
        }
        with open(os.path.join(directory, prepared.RECORD_FILE), "wb") as f:
            f.write(prepared_format.encode(raw))

        async def run() -> tuple[float, float, float]:
            service = Service(
                contracts.DRA_DRIVER, Claims(), lambda: Observation(True, "", "kvm"), prepared.Prepared(directory)
            )
            loop = asyncio.get_running_loop()
            stall = [0.0]
            stop = asyncio.Event()

            async def ticker() -> None:
                last = loop.time()
                while not stop.is_set():
                    await asyncio.sleep(0.001)
                    stall[0] = max(stall[0], loop.time() - last - 0.001)
                    last = loop.time()

            tick = asyncio.ensure_future(ticker())
            times = []
            for i in range(100):
                asked = v1.Claim(namespace="ns", name=f"n{i}", uid=f"new-{i}")
                request = v1.NodePrepareResourcesRequest(claims=[asked])
                t = time.perf_counter()
                answer = await service.NodePrepareResources(request, None, v1)  # type: ignore[arg-type]
                times.append(time.perf_counter() - t)
                assert not answer.claims[f"new-{i}"].error, answer.claims[f"new-{i}"].error
            stop.set()
            await tick
            return pct(times, 0.5), pct(times, 0.99), stall[0]

        return asyncio.run(run())

    big = one(os.path.join(top, "big"), 40000)
    empty = one(os.path.join(top, "empty"), 0)
    row(
        "DRA: Prepare of a new claim, record of 40 000 entries: p50 / p99 (empty record: p99)",
        f"{ms(big[0])} / {ms(big[1])} ({ms(empty[1])})",
        "p99 ≤ 200 ms",
    )
    row(
        "DRA: longest event-loop stall during those Prepares, 40 000 entries / empty record",
        f"{ms(big[2])} / {ms(empty[2])}",
        "≤ 50 ms",
    )


def bench_watch_hot_loop(top: str) -> None:
    """An API server that ends every watch at once: the requests the slice publisher sends in a
    minute, with its real backoff; the baseline is the same minute against a server that keeps
    the watch open (its normal cost)."""
    from hyperlight_agent.dra import client as dra_client
    from hyperlight_agent.dra.slice_spec import DeviceInfo
    from hyperlight_agent.dra.slices import SlicePublisher
    from standin.apiserver import NODE, FakeApiServer, kubeconfig

    print("watch that ends at once", flush=True)

    async def minute(ends_at_once: bool) -> int:
        fake = FakeApiServer()
        fake.end_watches = ends_at_once
        url = await fake.start()
        api = dra_client.connect(kubeconfig(top, url), environ={})
        publisher = SlicePublisher(api, NODE, contracts.DRA_DRIVER, 4)
        publisher.set_device(DeviceInfo("kvm", 12, "/dev/kvm"))
        task = asyncio.ensure_future(publisher.run())
        await asyncio.sleep(60)  # the window the figure counts requests in
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
        await fake.stop()
        return len(fake.requests)

    broken = asyncio.run(minute(True))
    normal = asyncio.run(minute(False))
    row(
        "DRA: API requests in the first minute, watches ended at once / kept open (baseline)",
        f"{broken} / {normal}",
        "≤ 20 (was ~14 000)",
    )


# DRA at fleet scale: the nodes of the measured fleet (the comparison and the fleet that restarts,
# flaps and prepares have half as many each), and its idle window. Our watches last 5-10 minutes
# (client-go's), so a window that sees each of them renewed is over 10 minutes; shorter ones (CI)
# still count every request but see few of their renewals.
FLEET_NODES = int(os.environ.pop("HYPERLIGHT_BENCH_FLEET_NODES", "200"))
FLEET_IDLE_S = float(os.environ.pop("HYPERLIGHT_BENCH_FLEET_IDLE_S", "630"))
SHORT_WATCH_S = (40.0, 50.0)  # ours before issue 40: the timeout was the liveness check


def bench_fleet(top: str) -> None:  # noqa: PLR0915 - one scenario, start to end
    """The DRA mode's cost to a real API server (etcd and kube-apiserver 1.37 from the pinned
    builds, tests/e2e/fleet.py) with hundreds of publishers, counted from the API server's audit
    log; bytes on the wire (TLS included) counted by a relay per fleet. Three fleets at once, each
    its own user: `idle` (FLEET_NODES nodes, untouched, with our 5-10 minute watches), `short` (the
    40-50 s watches we had before their liveness moved to the bookmarks: the baseline) and `active`
    (restarted, flapped, preparing claims meanwhile)."""
    from hyperlight_agent.dra import slices
    from standin.proxy import FreezingProxy
    from tests.e2e import fleet
    from tests.e2e.cluster import wait_until

    print(f"DRA at fleet scale ({FLEET_NODES} nodes, {FLEET_IDLE_S:g} s idle window)", flush=True)
    if not os.path.exists(os.path.join(fleet.BIN_DIR, "kubernetes")):
        row("DRA at fleet scale", "not run: no Kubernetes built (make e2e-components)")
        return
    plane = fleet.ControlPlane(os.path.join(top, "plane"))
    runner = fleet.LoopThread()
    groups: dict[str, tuple[fleet.Fleet, FreezingProxy]] = {}
    try:
        plane.start()
        for name, size, timeout in (
            ("idle", FLEET_NODES, slices.WATCH_TIMEOUT_S),
            ("short", FLEET_NODES // 2, SHORT_WATCH_S),
            ("active", FLEET_NODES // 2, slices.WATCH_TIMEOUT_S),
        ):
            relay = FreezingProxy("127.0.0.1", plane.cluster.api_port)
            url = runner.call(relay.start()).replace("http://", "https://")
            nodes = [f"{name}-{i:04d}" for i in range(size)]
            groups[name] = (fleet.Fleet(plane.kubeconfig(f"fleet-{name}", url), nodes, timeout), relay)
        idle, short, active = (groups[n][0] for n in ("idle", "short", "active"))

        def wire() -> dict[str, int]:
            return {n: relay.bytes_up + relay.bytes_down for n, (_, relay) in groups.items()}

        started = time.time()
        for group, _ in groups.values():
            runner.call(group.start())
        wait_until(lambda: all(g.published() for g, _ in groups.values()), 600, "every fleet published")
        wait_until(
            lambda: all(
                sum(1 for r in plane.requests() if r.user == f"fleet-{n}" and r.verb == "watch") >= len(g.nodes)
                for n, (g, _) in groups.items()
            ),
            60,
            "every node's watch",
        )
        published, bytes_published = time.time(), wire()

        # The active fleet, while the others idle: every agent restarted, the device flapped, a
        # claim prepared on each node. Each step ends when every node is done.
        phases: dict[str, tuple[float, float, int]] = {}
        t, b = time.time(), wire()["active"]
        runner.call(active.restart())
        wait_until(active.published, 300, "the restarted fleet published")
        wait_until(
            lambda: (
                sum(1 for r in plane.requests() if r.user == "fleet-active" and r.verb == "watch" and r.received >= t)
                >= len(active.nodes)
            ),
            60,
            "the restarted fleet's watches",
        )
        phases["restart"] = (t, time.time(), wire()["active"] - b)
        t, b = time.time(), wire()["active"]
        runner.call(active.set_device(None))
        wait_until(active.published, 300, "the fleet's devices out of its slices")
        runner.call(active.set_device(fleet.KVM))
        wait_until(active.published, 300, "the fleet's devices back")
        phases["flap"] = (t, time.time(), wire()["active"] - b)
        claims = [(node, *plane.create_claim(node)) for node in active.nodes]
        t, b = time.time(), wire()["active"]
        runner.call(active.prepare(claims))
        phases["prepare"] = (t, time.time(), wire()["active"] - b)

        time.sleep(max(0.0, published + FLEET_IDLE_S - time.time()))  # the idle window measured
        ended, bytes_ended = time.time(), wire()
        watches_open = plane.metric("apiserver_longrunning_requests", verb="WATCH", resource="resourceslices")
        requests = plane.requests()
    finally:
        for group, relay in groups.values():
            runner.call(group.stop())
            runner.call(relay.stop())
        runner.close()
        plane.stop()

    window = ended - published
    total_nodes = sum(len(g.nodes) for g, _ in groups.values())

    def idle_cost(name: str) -> tuple[float, float, float, float]:
        """Per node-hour: (the requests counted in the window; the same at steady state: a new watch
        per timeoutSeconds the watches asked for, and the other requests counted), and the watches'
        mean asked life and median life as the server served them (received to ended, for those
        it ended). A window shorter than a watch's life counts few renewals: the first watches all
        started together."""
        user, nodes = f"fleet-{name}", len(groups[name][0].nodes)
        counts = fleet.per_node(requests, user, nodes, published, ended)
        granted = [r for r in requests if r.user == user and r.verb == "watch" and r.code in (0, 200) and r.timeout_s]
        renewed = sum(1 for r in granted if published <= r.received < ended) / nodes
        asked = statistics.mean(r.timeout_s or 0 for r in granted)
        served = [
            r.ended - r.received
            for r in granted
            if r.ended is not None and r.ended - r.received >= (r.timeout_s or 0) - 1
        ]
        steady = 3600 / asked + (counts["all"] - renewed) * 3600 / window
        return counts["all"] * 3600 / window, steady, asked, statistics.median(served) if served else 0.0

    now, steady, life, served = idle_cost("idle")
    short_counted, short_steady, short_life, short_served = idle_cost("short")
    held = {
        n: sum(
            1
            for r in requests
            if r.user == f"fleet-{n}"
            and r.verb == "watch"
            and r.received <= ended
            and (r.ended is None or r.ended > ended)
        )
        / len(g.nodes)
        for n, (g, _) in groups.items()
    }
    first = fleet.per_node(requests, "fleet-idle", len(idle.nodes), started, published)
    row(
        "DRA fleet: first publish, requests per node (list / create / watch)",
        f"{first.get('list', 0):.2f} / {first.get('create', 0):.2f} / {first.get('watch', 0):.2f}",
    )
    row(
        "DRA fleet: first publish, bytes per node on the wire (TLS included)",
        f"{bytes_published['idle'] / len(idle.nodes):.0f}",
    )
    row(
        f"DRA fleet: idle requests per node-hour, all (renewals included), steady state (watches asked for "
        f"{life:.0f} s on average, served {served:.0f} s median) / counted in the {window:.0f} s window",
        f"{steady:.1f} / {now:.1f}",
        "≤ 12",
    )
    early = [
        r
        for r in requests
        if r.user == "fleet-idle"
        and r.verb == "watch"
        and r.ended is not None
        and published <= r.received < ended
        and r.ended - r.received < (r.timeout_s or 0) - 1
    ]
    row(
        "DRA fleet: idle watches given up before their end (no first bookmark in time, a silence), per node-hour",
        f"{len(early) / len(idle.nodes) * 3600 / window:.2f}",
    )
    others = fleet.per_node(requests, "fleet-idle", len(idle.nodes), published, ended)
    row(
        "DRA fleet: idle requests per node-hour besides the watch",
        f"{(others['all'] - others.get('watch', 0)) * 3600 / window:.1f}",
    )
    row(
        f"DRA fleet: idle requests per node-hour, 40-50 s watches as before (same run; asked {short_life:.0f} s, "
        f"served {short_served:.0f} s)",
        f"{short_steady:.1f} (counted {short_counted:.1f})",
    )
    row("DRA fleet: idle requests, ratio of ours to the 40-50 s watches (baseline)", f"{steady / short_steady:.3f}")
    row(
        "DRA fleet: idle bytes per node-hour on the wire: ours / 40-50 s watches",
        f"{(bytes_ended['idle'] - bytes_published['idle']) / len(idle.nodes) * 3600 / window:.0f} / "
        f"{(bytes_ended['short'] - bytes_published['short']) / len(short.nodes) * 3600 / window:.0f}",
    )
    row(
        "DRA fleet: bookmarks per node-hour received (the watch's heartbeat)",
        f"{idle.bookmarks / len(idle.nodes) * 3600 / (ended - started):.1f}",
    )
    row(
        "DRA fleet: watches held per node: idle / short / active (the API server's count, all fleets)",
        f"{held['idle']:.2f} / {held['short']:.2f} / {held['active']:.2f} ({watches_open:.0f} for {total_nodes})",
    )
    for phase, (t0, t1, wire_bytes) in phases.items():
        counts = fleet.per_node(requests, "fleet-active", len(active.nodes), t0, t1)
        verbs = ", ".join(f"{v} {n:.2f}" for v, n in sorted(counts.items()) if v != "all")
        row(
            f"DRA fleet: {phase}, requests per node ({verbs}) / bytes per node on the wire",
            f"{counts['all']:.2f} / {wire_bytes / len(active.nodes):.0f}",
        )
    codes = sorted({r.code for r in requests if r.ended is not None})
    row("DRA fleet: answers the fleets got (HTTP codes)", ", ".join(str(c) for c in codes))
    row(
        "DRA fleet: 5000 nodes idle: requests per second at the API server, ours / 40-50 s watches",
        f"{5000 * steady / 3600:.1f} / {5000 * short_steady / 3600:.1f}",
    )


# The Hyperlight example (deploy/examples/hyperlight): its build, and the figures it prints.
EXAMPLE_BUILD = os.path.join(ROOT, "deploy", "examples", "hyperlight", "build.sh")
EXAMPLE_OUT = os.path.join(ROOT, "build", "hyperlight-example")
EXAMPLE_RUNS = "10"


def bench_hyperlight(top: str) -> None:
    """The real client where we hand the device over (issue 48): the Hyperlight example's sandbox
    build and guest call (medians of its own --json runs) in a container given exactly what our
    Allocate answered (its DeviceSpec and environment, applied by podman as a runtime applies
    them), beside the same binary on the host right after: the ratios are the figures."""
    print("hyperlight", flush=True)
    if shutil.which("podman") is None:
        row("Hyperlight example, container / host", "not run: no podman")
        return
    built = subprocess.run([EXAMPLE_BUILD, EXAMPLE_OUT], capture_output=True, text=True, timeout=1800, check=False)
    if built.returncode != 0:
        row("Hyperlight example, container / host", f"not run: its build failed: {built.stderr.strip()[-200:]}")
        return
    host = os.path.join(EXAMPLE_OUT, "hyperlight-example")
    guest = os.path.join(EXAMPLE_OUT, "hyperlight-guest")
    agent = Agent(top)
    try:
        with StandinThread(os.path.join(top, "kubelet")) as k:
            k.wait_until(lambda kk: kk.allocatable() > 0, 15)
            device = next(i for i, health in k.kubelet.plugins[R].devices if health == contracts.HEALTHY)
            (response,) = k.call(k.kubelet.allocate(R, [device])).container_responses
    finally:
        agent.stop()
    storage = os.path.join(top, "podman")
    podman = ["podman", "--root", f"{storage}/root", "--runroot", f"{storage}/run", "--storage-driver", "vfs"]
    env = {**os.environ, "CONTAINERS_CONF": os.path.join(storage, "containers.conf")}
    os.makedirs(os.path.join(storage, "rootfs", "dev"))
    with open(env["CONTAINERS_CONF"], "w") as f:
        # These machines' settings for podman (tests/podman.py: runc, cgroupfs, ulimits it may set).
        f.write(
            '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n'
            '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
        )
    shutil.copy2(host, os.path.join(storage, "rootfs", "hyperlight-example"))
    shutil.copy2(guest, os.path.join(storage, "rootfs", "hyperlight-guest"))
    try:
        with subprocess.Popen(["tar", "-C", f"{storage}/rootfs", "-cf", "-", "."], stdout=subprocess.PIPE) as tar:
            subprocess.run(
                [*podman, "import", "-", "localhost/hl-bench:1"],
                stdin=tar.stdout,
                env=env,
                check=True,
                capture_output=True,
                timeout=120,
            )
        given = [f"--device={d.host_path}:{d.container_path}:{d.permissions}" for d in response.devices]
        given += [f"--env={name}={value}" for name, value in response.envs.items()]
        # Root in the container: DeviceSpec keeps the host node's owner and mode (0600 root here);
        # our CDI spec's owner for workloads needs a CDI-reading runtime (the e2e's figures).
        ran = subprocess.run(
            [
                *podman,
                "run",
                "--rm",
                "--network=none",
                "--cap-drop=all",
                "--read-only",
                *given,
                "localhost/hl-bench:1",
                "/hyperlight-example",
                "--json",
                "--runs",
                EXAMPLE_RUNS,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        here = subprocess.run(
            [host, "--guest", guest, "--json", "--runs", EXAMPLE_RUNS],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        subprocess.run([*podman, "rmi", "-a", "-f"], env=env, capture_output=True, check=False, timeout=120)
    if ran.returncode != 0 or here.returncode != 0:
        row("Hyperlight example, container / host", f"failed: {(ran.stderr or here.stderr).strip()[-200:]}")
        return
    there, local = json.loads(ran.stdout.splitlines()[-1]), json.loads(here.stdout.splitlines()[-1])
    row(
        "Hyperlight sandbox build, container given our Allocate / host (ms), ratio",
        f"{there['build_ms']:.1f} / {local['build_ms']:.1f}, {there['build_ms'] / local['build_ms']:.2f}",
        "≈ 1",
    )
    row(
        "Hyperlight guest call round trip, container given our Allocate / host (µs), ratio",
        f"{there['call_us']:.1f} / {local['call_us']:.1f}, {there['call_us'] / local['call_us']:.2f}",
        "≈ 1",
    )


def bench_image() -> None:
    """The last `make image`'s size (deploy/image/build.sh records it), if an image was built."""
    try:
        with open(IMAGE_RECORD) as f:
            record = json.load(f)
    except FileNotFoundError:
        row("image size", "no image built (make image)")
        return
    target = "≤ 120 MB" if SLIM_BASE in record["base"] else ""
    row(f"image size ({record['engine']}, base {record['base']})", f"{record['size'] / 1e6:.0f} MB", target)


def main() -> int:
    if not os.path.exists("/dev/kvm"):
        print("bench needs /dev/kvm")
        return 1
    # Agents start as installed ones do, from compiled bytecode (the packages compile at install):
    # compile the package and the virtualenv once, whatever PYTHONDONTWRITEBYTECODE says.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "compileall",
            "-q",
            "-j0",
            os.path.dirname(os.path.abspath(kernel.__file__)),
            *sys.path[1:],
        ],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
    )
    only = set(sys.argv[1:])  # e.g. `python -m bench e`: one section
    top = tempfile.mkdtemp(prefix="hl-bench-")
    try:
        dev = os.path.join(top, "probe-dev")
        os.mkdir(dev)
        mknod(os.path.join(dev, "kvm"), 10, 232)
        raw = bench_probe(dev)
        for name, fn in (
            ("a", lambda d: bench_allocate(d, raw)),
            ("b", bench_streams),
            ("c", bench_rss_and_start),
            ("d", bench_restart_and_cdi),
            ("e", bench_plugin_restart),
            ("f", bench_metrics_flood),
            ("p", bench_probe_flood),
            ("g", bench_idle),
            ("h", bench_dra),
            ("i", bench_mount_storm),
            ("j", bench_prepared_record),
            ("k", bench_watch_hot_loop),
            ("l", bench_upgrade_in_place),
            ("m", bench_probe_cost),
            ("fleet", bench_fleet),
            ("hyperlight", bench_hyperlight),
        ):
            if only and name not in only:
                continue
            sub = os.path.join(top, name)
            os.mkdir(sub)
            fn(sub)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    bench_image()
    print("\n| figure | value | target |\n|---|---|---|")
    for name, figure, target in ROWS:
        print(f"| {name} | {figure} | {target} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
