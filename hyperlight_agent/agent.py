"""The agent: startup → main loop → shutdown, on one asyncio event loop.

Everything the agent waits on is an event on this loop: gRPC calls and streams, inotify on the
kubelet, CDI and device directories, the check timer, the probe helper's pipe and signals. One
thread of control means the shared state needs no locks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from typing import Callable, Optional, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from . import __version__, api, atomic, config, contracts, hypervisors, labels
from .checker import Checker, CheckTarget
from .config import Settings
from .health import HealthState, Observation
from .helper import ProbeHelper
from .metrics import Metrics
from .notify import Notifier
from .registration import Registrar
from .servicer import DevicePluginServicer, Profile
from .watcher import CONTENT, DirectoryWatcher

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 2.0
_UNSYNCED = object()
# Settings a reload cannot change (they name what is watched, written or served): kept, with a warning.
RESTART_ONLY = ("device_dir", "host_device_dir", "kubelet_dir", "cdi_dir", "nfd_features_dir", "metrics_address")
# Baked into the container image at build time (Containerfile), printed at startup.
COMMIT_ENV = "HYPERLIGHT_AGENT_COMMIT"
# gRPC health service names: "" (overall) is readiness; LIVENESS is SERVING while the server runs.
LIVENESS = "liveness"


def profile_for(settings: Settings, device_access: bool) -> Profile:
    if device_access:
        # Bootstrap mode: one grant of the raw device to the main plugin's pod, DeviceSpec only.
        return Profile(contracts.RESOURCE_DEVICE_ACCESS, contracts.DEVICE_ACCESS_SOCKET, 1, "device-spec",
                       workload_env=False)
    return Profile(contracts.RESOURCE_HYPERVISOR, contracts.PLUGIN_SOCKET,
                   settings.device_count, settings.allocation)


def target_for(settings: Settings, device_access: bool) -> CheckTarget:
    return CheckTarget(settings.device_dir, settings.host_device_dir, settings.cdi_dir,
                       settings.device_uid, settings.device_gid, inventory_only=device_access)


class Agent:
    def __init__(self, settings: Settings, device_access: bool = False,
                 helper_argv: Optional[Sequence[str]] = None,
                 reload: Optional[Callable[[], Settings]] = None) -> None:
        self.settings = settings
        self.device_access = device_access
        self._helper_argv = helper_argv
        self._reload = reload  # re-reads the settings for SIGHUP; raises config.ConfigError
        self._stop: Optional[asyncio.Event] = None
        self.notifier = Notifier()

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> None:
        """Serve until SIGTERM or SIGINT (or request_stop), then shut down within a bounded grace."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.metrics = Metrics(enabled=self.settings.metrics_address is not None)
        self.state = HealthState()
        self.helper = ProbeHelper(argv=self._helper_argv, on_timeout=self.metrics.helper_timeouts.inc)
        self.checker = Checker(target_for(self.settings, self.device_access), self.helper, self.state,
                               on_result=self._on_check)
        self.profile = profile_for(self.settings, self.device_access)
        self.servicer = DevicePluginServicer(
            self.profile, self.state, self.checker, on_streams_changed=self._on_streams,
            on_allocate=lambda outcome: self.metrics.allocations.labels(outcome).inc())
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.registrar = Registrar(self.settings.kubelet_dir, self.profile.socket, self.profile.resource,
                                   self._configure_server, on_change=self._on_registrar)
        self._counted = (0, 0)
        # What the feature file says; _UNSYNCED forces the first sync.
        self._labelled: object = _UNSYNCED
        self._last_status = ""
        self._serving: Optional[bool] = None
        self._health_update: Optional[asyncio.Future[None]] = None
        # Signals, in one place:
        #   SIGTERM, SIGINT  graceful stop within SHUTDOWN_GRACE_S (systemd stop, kubelet pod deletion)
        #   SIGHUP           re-read the config file and apply it (systemctl reload)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)

        if self.settings.metrics_address:
            self.metrics.serve(self.settings.metrics_address)
        watcher = self._make_watcher()
        log.info("starting hyperlight-agent %s (commit %s): resource %s, socket %s, %d slot(s), device dir %s",
                 __version__, os.environ.get(COMMIT_ENV, "unknown"), self.profile.resource,
                 self.registrar.socket_path, self.profile.slots, self.settings.device_dir)
        self._status_changed()
        self.checker.request()
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(health.OVERALL_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
        jobs = [self.registrar.run(), watcher.run(), self._periodic_checks()]
        if self.notifier.watchdog_interval is not None:
            jobs.append(self._watchdog(self.notifier.watchdog_interval))
        # These run until cancelled: one that ends early has failed, and stops the agent.
        tasks = [asyncio.ensure_future(c) for c in jobs]
        try:
            stop_wait = asyncio.ensure_future(self._stop.wait())
            done, _ = await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop_wait:
                    error = task.exception()
                    raise error or RuntimeError("an agent task ended unexpectedly")
        finally:
            log.info("stopping")
            # No reload may start work (a check, a helper) while we take things down; a repeated
            # TERM/INT stays handled (it only sets the stop event again).
            loop.add_signal_handler(signal.SIGHUP, lambda: None)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await asyncio.wait_for(self._shutdown(), SHUTDOWN_GRACE_S + 3)
            finally:
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(signum)

    def _configure_server(self, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers([api.device_plugin_handler(self.servicer)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)

    async def _watchdog(self, interval: float) -> None:
        """WATCHDOG=1 from the loop that does the work: if the loop wedges, systemd restarts us."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    def _on_sighup(self) -> None:
        self.notifier.reloading()
        log.info("reloading configuration")
        try:
            self._apply_reload()
        finally:
            self.notifier.reloaded()  # systemd must never be left waiting in "reloading"

    def _apply_reload(self) -> None:
        try:
            new = self._reload() if self._reload else self.settings
        except config.ConfigError as exc:
            log.error("reload failed, keeping the running configuration: %s", exc)
            self._last_status = ""
            self.notifier.status(f"reload failed, kept running configuration: {exc}")
            return
        fixed = [k for k in RESTART_ONLY if getattr(new, k) != getattr(self.settings, k)]
        if fixed:
            log.warning("reload: %s change only on restart; kept", ", ".join(fixed))
            new = dataclasses.replace(new, **{k: getattr(self.settings, k) for k in fixed})
        self.settings = new
        logging.getLogger().setLevel(new.log_level.upper())
        self.profile = profile_for(new, self.device_access)
        self.servicer.profile = self.profile
        self.checker.target = target_for(new, self.device_access)
        self.state.republish()  # streams resend the list (slot count may have changed)
        self.checker.request()  # the CDI spec follows new uid/gid at once
        self._status_changed()

    async def _shutdown(self) -> None:
        self.notifier.stopping()
        # Keep the CDI spec: containers created during an agent restart still resolve it.
        await self.registrar.stop(grace=SHUTDOWN_GRACE_S)
        await self.checker.close()
        await self.helper.close()

    def _make_watcher(self) -> DirectoryWatcher:
        watcher = DirectoryWatcher()
        s = self.settings
        watcher.watch(s.kubelet_dir, lambda name: self.registrar.wake(),
                      {contracts.KUBELET_SOCKET, self.profile.socket})
        device_nodes = {h.node for h in hypervisors.HYPERVISORS}
        watcher.watch(s.device_dir, lambda name: self.checker.request(), device_nodes)
        if s.host_device_dir:
            watcher.watch(s.host_device_dir, lambda name: self.checker.request(), device_nodes)
        if not self.device_access:
            watcher.watch(s.cdi_dir, lambda name: self.checker.request(), {contracts.CDI_SPEC_FILE},
                          mask=CONTENT)
        return watcher

    async def _periodic_checks(self) -> None:
        while True:
            await asyncio.sleep(self.settings.check_interval_seconds)
            self.checker.request()

    def _on_check(self, observation: Observation, seconds: float, repaired: bool) -> None:
        self.metrics.check_done(observation, seconds, repaired)
        self._sync_labels(observation.hypervisor)
        self._status_changed()

    def _sync_labels(self, hypervisor: Optional[str]) -> None:
        """The NFD feature file follows the detected hypervisor (main plugin only: one writer)."""
        directory = self.settings.nfd_features_dir
        if directory is None or self.device_access or hypervisor == self._labelled:
            return
        try:
            labels.sync(directory, hypervisor)
            self._labelled = hypervisor
        except atomic.Refused as exc:
            log.warning("node labels not written: %s", exc)
        except OSError as exc:
            log.warning("cannot write node labels in %s: %s", directory, exc.strerror or exc)

    def _on_streams(self, count: int) -> None:
        self.metrics.streams.set(count)
        self._status_changed()

    def _on_registrar(self) -> None:
        registrar = self.registrar
        self.metrics.registrations.inc(registrar.registrations - self._counted[0])
        self.metrics.kubelet_restarts.inc(registrar.kubelet_restarts - self._counted[1])
        self._counted = (registrar.registrations, registrar.kubelet_restarts)
        self._status_changed()

    @property
    def ready(self) -> bool:
        """Registered, watched by at least one stream, and the last device check passed."""
        return (self.registrar.registered and self.servicer.streams > 0
                and self.state.current.healthy)

    def status(self) -> str:
        """One line saying what the agent is doing or waiting for."""
        obs = self.state.current
        if not obs.healthy and self.state.version > 0:
            return f"unhealthy: {obs.reason}"
        if not self.registrar.registered:
            if self.registrar.last_error:
                return f"waiting for kubelet at {self.registrar.kubelet_socket}: {self.registrar.last_error}"
            return f"waiting for kubelet at {self.registrar.kubelet_socket}"
        if self.state.version == 0:
            return "checking the device"
        streams = self.servicer.streams
        if streams == 0:
            return "registered; waiting for the kubelet's ListAndWatch stream"
        return (f"ready: {obs.hypervisor}, {self.profile.slots} slot{'s' if self.profile.slots != 1 else ''}, "
                f"{streams} stream{'s' if streams != 1 else ''}")

    def _status_changed(self) -> None:
        text = self.status()
        if text != self._last_status:
            self._last_status = text
            log.info("status: %s", text)
            self.notifier.status(text)
        ready = self.ready
        if ready:
            self.notifier.ready()
        if ready != self._serving:
            self._serving = ready
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            self._health_update = asyncio.ensure_future(self.health.set(health.OVERALL_HEALTH, status))
