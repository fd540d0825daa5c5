"""The agent, a fully built object: construct → start() → wait() → close(), on one event loop.

Everything the agent waits on is an event on this loop: gRPC calls and streams, inotify on the
kubelet, CDI and device directories, the check timer, the probe helper's pipe. One thread of
control means the shared state needs no locks. Signals are the entry point's business (cli.py,
signals.py): it calls stop() and reload().

Construct it inside the running event loop (asyncio objects bind to it on Python 3.9).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hyperlight_agent import __version__, contracts, modes, parts, peers, readiness, waits
from hyperlight_agent.config import Settings
from hyperlight_agent.device import hypervisors
from hyperlight_agent.device.checker import Checker
from hyperlight_agent.device.helper import ProbeHelper
from hyperlight_agent.device.observation import Observation, SharedObservation
from hyperlight_agent.deviceplugin import api, handover
from hyperlight_agent.deviceplugin.registration import Registrar
from hyperlight_agent.deviceplugin.servicer import DevicePluginServicer, Endpoint
from hyperlight_agent.host.metrics import Metrics
from hyperlight_agent.host.notify import Notifier
from hyperlight_agent.node import labels
from hyperlight_agent.node.watcher import CONTENT, NAMES, DirectoryWatcher
from hyperlight_agent.reload import Reloader

if TYPE_CHECKING:
    from hyperlight_agent.dra.driver import Driver

log = logging.getLogger(__name__)

# In-flight Allocates may finish within this after a stop; streams end at once.
SHUTDOWN_GRACE_S = 1.0
# A cap on the whole of _shutdown, for a part that is stuck: after the grace come the DRA driver's
# deregistration wait (dra/registration.py, 1.5 s) and stopping the probe helper (an EOF wait and
# its reap: up to 2.5 s, device/helper.py); each bounds itself, so this is only the last resort.
SHUTDOWN_BOUND_S = SHUTDOWN_GRACE_S + 3.0
# Baked into the container image at build time (Containerfile), printed at startup.
COMMIT_ENV = "HYPERLIGHT_AGENT_COMMIT"


class Agent:
    def __init__(self, settings: Settings, device_access: bool = False,
                 reload: Optional[Callable[[], Settings]] = None,
                 notifier: Optional[Notifier] = None, dra: bool = False,
                 environ: Optional[Mapping[str, str]] = None) -> None:
        # The process environment is the entry point's to hand over (cli.main); none by default.
        self._environ: Mapping[str, str] = environ if environ is not None else {}
        self.settings = settings
        self.mode = modes.of(device_access, dra)
        self.notifier = notifier or Notifier(self._environ)
        self.metrics = Metrics(enabled=settings.metrics_address is not None)
        self.metrics_server = self.metrics.server(settings.metrics_address) if settings.metrics_address else None
        # Who we are to other instances of ours on this node (a successor, a predecessor): peers.py.
        self.identity = peers.Identity.of(settings.instance or "", self.mode.protocol, self.mode.resource)
        self.observation = SharedObservation()
        self.helper = ProbeHelper(on_timeout=self.metrics.helper_timeouts.inc)
        self.checker = Checker(parts.check_target(settings, self.mode), self.helper, self.observation,
                               on_result=self._on_check, keeper=self._newer_instance)
        self.profile = parts.profile(settings, self.mode)
        self.servicer = DevicePluginServicer(
            self.profile, self.observation, self.checker, on_streams_changed=self._on_streams,
            on_allocate=lambda outcome: self.metrics.allocations.labels(outcome).inc())
        self.health_service = health.aio.HealthServicer()  # type: ignore[attr-defined]
        # The kubelet side: the device plugin's registrar, or the DRA driver (dra/driver.py).
        self.registrar: Optional[Registrar] = None
        self.driver: Optional[Driver] = None
        if self.mode.protocol == "dra":
            self.driver = self._make_driver()
        else:
            self.registrar = Registrar(settings.kubelet_dir, self.profile.socket, self.profile.resource,
                                       self._configure_server, on_change=self._on_registrar,
                                       watched=lambda: self.watcher.watching(settings.kubelet_dir))
        # The NFD feature file: the main plugin's only (one writer).
        self.labels = (labels.Keeper(settings.nfd_features_dir)
                       if settings.nfd_features_dir and not self.mode.inventory_only else None)
        self.watcher = self._make_watcher()
        self._stop = asyncio.Event()
        self._interval_changed = asyncio.Event()
        self._tasks: list[asyncio.Future[Any]] = []
        self._stopping = False
        self._handing_over = False
        self.reloader = Reloader(reload, lambda: self.settings, self._apply_reload, self.notifier,
                                 on_refused=self._forget_status)
        self._last_status = ""
        self._serving: Optional[bool] = None
        self._health_update: Optional[asyncio.Future[None]] = None

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Begin serving: first check, registration, watches and timers run as tasks."""
        if self.driver is not None:
            log.info("starting hyperlight-agent %s (commit %s): DRA driver %s, node %s, %d device(s), socket %s, "
                     "device dir %s", __version__, self._environ.get(COMMIT_ENV, "unknown"), self.profile.resource,
                     self.driver.node_name, self.driver.devices, self.driver.registrar.service_socket,
                     self.settings.device_dir)
        else:
            assert self.registrar is not None
            log.info("starting hyperlight-agent %s (commit %s): resource %s, socket %s, %d slot(s), device dir %s",
                     __version__, self._environ.get(COMMIT_ENV, "unknown"), self.profile.resource,
                     self.registrar.socket_path, self.profile.slots, self.settings.device_dir)
        self._status_changed()
        self.checker.request()
        await self.health_service.set(modes.HEALTH_SERVICES["liveness"], health_pb2.HealthCheckResponse.SERVING)
        await self.health_service.set(modes.HEALTH_SERVICES["readiness"], health_pb2.HealthCheckResponse.NOT_SERVING)
        kubelet_side = self.driver.run() if self.driver is not None else self.registrar.run()  # type: ignore[union-attr]
        jobs = [kubelet_side, self.watcher.run(), self._periodic_checks()]
        if self.notifier.watchdog_interval is not None:
            jobs.append(self._watchdog(self.notifier.watchdog_interval))
        if self.metrics_server is not None:
            jobs.append(self.metrics_server.run())
        self._tasks = [asyncio.ensure_future(c) for c in jobs]

    def stop(self) -> None:
        """Ask wait() to return (signal handlers call this)."""
        self._stop.set()

    async def wait(self) -> None:
        """Until stop(); raises what a task that ended early raised (they run until cancelled)."""
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait([stop_wait, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
        for task in done:
            if task is not stop_wait:
                raise task.exception() or RuntimeError("an agent task ended unexpectedly")

    async def close(self) -> None:
        """Shut down, bounded: first, with handover_seconds set, serve on until a successor is ready
        (handover.py); then the kubelet's streams end and our socket goes in one moment, in-flight
        Allocates get SHUTDOWN_GRACE_S, then the helper is stopped. The CDI spec stays: containers
        created during an agent restart still resolve it."""
        if self._stopping or self._handing_over:
            return
        # Only a ready agent has something to hand over. An unready one is also one the DaemonSet
        # controller replaces only after it is gone (it surges for available pods only): waiting
        # for a successor would only delay the replacement by handover_seconds.
        if self.settings.handover_seconds > 0 and self.ready:
            self._handing_over = True
            await self._hand_over(self.settings.handover_seconds)
        self._stopping = True
        log.info("stopping")
        self.notifier.stopping()
        if self.registrar is not None:
            self.registrar.end_streams()
        # Before anything else can run: a check finishing during the shutdown would publish and
        # log after "stopping" (and a first check may still be running this early).
        self.checker.cancel()
        reloading = self.reloader.stop()
        tasks = [*self._tasks, *([reloading] if reloading else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await waits.within(self._shutdown(), SHUTDOWN_BOUND_S)

    async def run(self) -> None:
        """start → wait → close."""
        await self.start()
        try:
            await self.wait()
        finally:
            await self.close()

    async def _hand_over(self, timeout: float) -> None:
        log.info("stop requested: serving until a successor is ready (up to %g s)", timeout)
        if self.driver is not None:
            # The kubelet calls the newest connected instance; calls with us finish in the stop grace.
            successor = await self.driver.hand_over(timeout)
        else:
            successor = await handover.wait_for_successor(self.identity, self.settings.kubelet_dir, self.mode.socket,
                                                          self.profile.socket, timeout)
            if successor:
                # Its registration made the kubelet send new Allocates there; ours in flight must
                # finish before our stream ends (the kubelet then cancels them).
                await handover.drained(lambda: self.servicer.allocating, SHUTDOWN_GRACE_S)
        if successor:
            log.info("handing over to %s", successor)
        else:
            log.info("no successor within %g s", timeout)

    async def _shutdown(self) -> None:
        if self.registrar is not None:
            await self.registrar.stop(grace=SHUTDOWN_GRACE_S)
        if self.driver is not None:
            await self.driver.close()
        await self.checker.close()
        await self.helper.close()

    def reload(self) -> None:
        """Re-read the settings and apply them (SIGHUP): reload.py."""
        self.reloader.request()

    def _apply_reload(self, new: Settings) -> None:
        if new.check_interval_seconds != self.settings.check_interval_seconds:
            self._interval_changed.set()
        self.settings = new
        logging.getLogger().setLevel(new.log_level.upper())
        self.profile = parts.profile(new, self.mode)
        self.servicer.profile = self.profile
        self.checker.target = parts.check_target(new, self.mode)
        self.observation.republish()  # streams resend the list (slot count may have changed)
        self.checker.request()  # the CDI spec follows new uid/gid at once
        self._status_changed()

    # --- collaborators' wiring ------------------------------------------------------------------

    def _configure_server(self, server: grpc.aio.Server,
                          on_stream: Callable[[int, object], None]) -> Callable[[], None]:
        endpoint = Endpoint(self.servicer, on_stream)
        server.add_generic_rpc_handlers([api.device_plugin_handler(endpoint)])
        self._serve_ours(server)
        return endpoint.close

    def _serve_ours(self, server: grpc.aio.Server) -> None:
        """What every socket of ours serves beside its kubelet protocol: the gRPC health service
        (the exec probes, a successor's readiness) and Describe (peers.py)."""
        health_pb2_grpc.add_HealthServicer_to_server(self.health_service, server)
        server.add_generic_rpc_handlers([peers.describe_handler(self.identity, lambda: self.ready)])

    async def _watchdog(self, interval: float) -> None:
        """WATCHDOG=1 from the loop that does the work: if the loop wedges, systemd restarts us."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    def _make_watcher(self) -> DirectoryWatcher:
        watcher = DirectoryWatcher()
        s = self.settings
        registrar = self.registrar
        if registrar is not None:
            watcher.watch(s.kubelet_dir, lambda name: registrar.wake(), {contracts.KUBELET_SOCKET, self.profile.socket})
        driver = self.driver
        if driver is not None:
            # Our two sockets (removed by a cleanup tool: served again), and other instances'
            # registration sockets coming and going (whether a newer one keeps the slice).
            for path in self._dra_sockets():
                watcher.watch(os.path.dirname(path), lambda name: driver.sockets_changed())
        device_nodes = {h.node for h in hypervisors.HYPERVISORS}
        watcher.watch(s.device_dir, lambda name: self.checker.request(), device_nodes)
        if s.host_device_dir:
            watcher.watch(s.host_device_dir, lambda name: self.checker.request(), device_nodes)
        if self.labels is not None:
            watcher.watch(self.labels.features_dir, lambda name: self._labels_changed(), {labels.FEATURE_FILE},
                          mask=CONTENT)
        if not self.mode.inventory_only:
            # A symlink at cdi_dir is refused (cdi.py), never followed: its removal or a directory
            # replacing it shows in the parent directory.
            watcher.watch(s.cdi_dir, lambda name: self.checker.request(), {contracts.CDI_SPEC_FILE},
                          mask=CONTENT, follow=False)
            watcher.watch(os.path.dirname(s.cdi_dir), lambda name: self.checker.request(),
                          {os.path.basename(s.cdi_dir)}, mask=NAMES)
        return watcher

    async def _periodic_checks(self) -> None:
        while True:
            self._interval_changed.clear()
            if not await waits.event(self._interval_changed, self.settings.check_interval_seconds):
                self.checker.request()
            # else: a reload changed the interval; start waiting anew with the new one.

    def _on_check(self, observation: Observation, seconds: float, repaired: bool) -> None:
        self.metrics.check_done(observation, seconds, repaired)
        if self.labels is not None:
            self.labels.sync(observation.hypervisor)
        self._status_changed()

    def _labels_changed(self) -> None:
        """Someone changed the feature file: put it right (once a check has said what it says)."""
        if self.labels is not None and self.observation.version > 0 and not self._stopping:
            self.labels.sync(self.observation.current.hypervisor)

    def _on_streams(self, count: int) -> None:
        self.metrics.open_streams.set(count)

    def _make_driver(self) -> Driver:
        from hyperlight_agent.dra.driver import Driver  # the DRA mode's modules only in that mode

        t = parts.dra_target(self.settings)
        return Driver(node_name=t.node_name, instance=t.instance, devices=t.devices, kubeconfig=t.kubeconfig,
                      observation=self.observation, check=lambda timeout: self.checker.check(timeout=timeout),
                      registry_dir=t.registry_dir, plugins_dir=t.plugins_dir, environ=self._environ,
                      configure=self._serve_ours, identity=self.identity, on_change=self._status_changed,
                      watched=lambda: all(self.watcher.watching(os.path.dirname(p)) for p in self._dra_sockets()))

    def _dra_sockets(self) -> tuple[str, str]:
        assert self.driver is not None
        return self.driver.registrar.registration_socket, self.driver.registrar.service_socket

    async def _newer_instance(self) -> Optional[str]:
        """A live instance of ours for the same resource on this node that started after us: the
        CDI spec is its to keep (peers.py)."""
        if self.driver is not None:
            return await self.driver.newer_instance()
        found = await peers.newer(self.identity, handover.candidates(self.settings.kubelet_dir, self.mode.socket,
                                                                     self.profile.socket))
        return found.identity.name if found else None

    def _on_registrar(self) -> None:
        r = self.registrar
        assert r is not None
        self.metrics.registrar_totals(r.registrations, r.kubelet_restarts, r.streams_lost)
        self._status_changed()

    # --- readiness ----------------------------------------------------------------------------

    def snapshot(self) -> Union[readiness.Snapshot, readiness.DraSnapshot]:
        d = self.driver
        if d is not None:
            return readiness.DraSnapshot(self.observation.current, self.observation.version > 0, d.registered,
                                         d.registration_error, d.registrar.registration_socket, d.published,
                                         d.slice_error, d.devices)
        r = self.registrar
        assert r is not None
        return readiness.Snapshot(self.observation.current, self.observation.version > 0, r.state, r.last_error,
                                  r.kubelet_socket, r.current_streams, self.profile.slots)

    @property
    def ready(self) -> bool:
        return readiness.ready(self.snapshot())

    def status(self) -> str:
        return readiness.status(self.snapshot())

    def _forget_status(self) -> None:
        self._last_status = ""  # something else took systemd's status line: say ours again

    def _status_changed(self) -> None:
        if self._stopping:
            return  # after STOPPING=1 nothing more is said
        snapshot = self.snapshot()
        text = readiness.status(snapshot)
        if text != self._last_status:
            self._last_status = text
            log.info("status: %s", text)
            self.notifier.status(text)
        ready = readiness.ready(snapshot)
        if ready:
            self.notifier.ready()
        if ready != self._serving:
            self._serving = ready
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            self._health_update = asyncio.ensure_future(
                self.health_service.set(modes.HEALTH_SERVICES["readiness"], status))
