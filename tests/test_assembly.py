"""assembly.py: the agent's parts built and wired to each other, without the agent."""

from __future__ import annotations

import os
from typing import Any, Optional, cast

from prometheus_client import CollectorRegistry

from hyperlight_agent import modes
from hyperlight_agent.assembly import AgentHooks, assemble
from hyperlight_agent.config import Settings
from hyperlight_agent.device.helper import ProbeResult
from hyperlight_agent.files import labels
from tests.fakes import FakeHelper, RecordingNotifier, device_dir


def checks(registry: CollectorRegistry, result: str) -> Optional[float]:
    return registry.get_sample_value("hyperlight_checks_total", {"result": result})


def hooks(said: list[str]) -> AgentHooks:
    return AgentHooks(
        status_changed=lambda: said.append("status"),
        ready=lambda: False,
        described=dict,
        predecessor=lambda: None,
        upgrading=lambda: False,
    )


async def test_a_completed_check_is_counted_named_in_the_labels_and_changes_the_status(
    tmp: str, helpers: list[FakeHelper]
) -> None:
    features = os.path.join(tmp, "features.d")
    os.makedirs(features)
    settings = Settings.defaults(
        kubelet_dir=os.path.join(tmp, "kubelet"),
        cdi_dir=os.path.join(tmp, "cdi"),
        device_dir=device_dir(tmp, "kvm"),
        nfd_features_dir=features,
        metrics_address="127.0.0.1:9",  # series kept (nothing listens before the agent starts)
    )
    said: list[str] = []
    built = assemble(settings, modes.PLUGIN, RecordingNotifier(), {}, hooks(said))
    try:
        assert len(helpers) == 1 and built.helper is cast(Any, helpers[0]) and built.labels is not None
        await built.checker.check()
        assert said == ["status"]
        assert checks(built.face.metrics.registry, "ok") == 1
        with open(os.path.join(features, labels.FEATURE_FILE)) as f:
            assert "kvm" in f.read()

        helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
        await built.checker.check()
        assert said == ["status", "status"]
        assert checks(built.face.metrics.registry, "failed") == 1
        assert built.observation.current.healthy is False
    finally:
        await built.checker.close()
        await built.side.close()


async def test_without_an_nfd_directory_there_is_no_labels_keeper_and_no_newer_instance_is_found(
    tmp: str, helpers: list[FakeHelper]
) -> None:
    settings = Settings.defaults(
        kubelet_dir=os.path.join(tmp, "kubelet"), cdi_dir=os.path.join(tmp, "cdi"), device_dir=device_dir(tmp, "kvm")
    )
    built = assemble(settings, modes.PLUGIN, RecordingNotifier(), {}, hooks([]))
    try:
        assert built.labels is None
        # The checker asks the side's succession who keeps the CDI spec: nobody else runs here.
        assert await built.checker._keeper() is None  # type: ignore[misc]
    finally:
        await built.checker.close()
        await built.side.close()
