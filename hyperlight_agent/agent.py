"""The agent: startup → main loop → shutdown, on one asyncio event loop.

Everything the agent waits on is an event on this loop: gRPC calls and streams, inotify on the
kubelet, CDI and device directories, the check timer, the probe helper's pipe and signals. One
thread of control means the shared state needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Optional, Sequence

from . import api, contracts, hypervisors
from .checker import Checker, CheckTarget
from .config import Settings
from .health import HealthState, Observation
from .helper import ProbeHelper
from .registration import Registrar
from .servicer import DevicePluginServicer, Profile
from .watcher import CONTENT, DirectoryWatcher

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 2.0


def profile_for(settings: Settings, device_access: bool) -> Profile:
    if device_access:
        # Bootstrap mode: one grant of the raw device to the main plugin's pod, DeviceSpec only.
        return Profile(contracts.RESOURCE_DEVICE_ACCESS, contracts.DEVICE_ACCESS_SOCKET, 1, "device-spec")
    return Profile(contracts.RESOURCE_HYPERVISOR, contracts.PLUGIN_SOCKET,
                   settings.device_count, settings.allocation)


def target_for(settings: Settings, device_access: bool) -> CheckTarget:
    return CheckTarget(settings.device_dir, settings.host_device_dir, settings.cdi_dir,
                       settings.device_uid, settings.device_gid, inventory_only=device_access)


class Agent:
    def __init__(self, settings: Settings, device_access: bool = False,
                 helper_argv: Optional[Sequence[str]] = None) -> None:
        self.settings = settings
        self.device_access = device_access
        self._helper_argv = helper_argv
        self._stop: Optional[asyncio.Event] = None

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> None:
        """Serve until SIGTERM or SIGINT (or request_stop), then shut down within a bounded grace."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.state = HealthState()
        self.helper = ProbeHelper(argv=self._helper_argv)
        self.checker = Checker(target_for(self.settings, self.device_access), self.helper, self.state,
                               on_result=self._on_check)
        self.profile = profile_for(self.settings, self.device_access)
        self.servicer = DevicePluginServicer(self.profile, self.state, self.checker,
                                             on_streams_changed=lambda n: self._status_changed())
        self.registrar = Registrar(self.settings.kubelet_dir, self.profile.socket, self.profile.resource,
                                   [api.device_plugin_handler(self.servicer)],
                                   on_change=self._status_changed)
        self._last_status = ""
        # Signals, in one place: TERM and INT mean a graceful, bounded stop.
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)

        watcher = self._make_watcher()
        log.info("starting: resource %s, socket %s, %d slot(s), device dir %s",
                 self.profile.resource, self.registrar.socket_path, self.profile.slots,
                 self.settings.device_dir)
        self._status_changed()
        self.checker.request()
        tasks = [asyncio.ensure_future(c) for c in
                 (self.registrar.run(), watcher.run(), self._periodic_checks())]
        try:
            stop_wait = asyncio.ensure_future(self._stop.wait())
            done, _ = await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop_wait and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            log.info("stopping")
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.wait_for(self._shutdown(), SHUTDOWN_GRACE_S + 3)
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)

    async def _shutdown(self) -> None:
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
