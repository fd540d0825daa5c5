"""The chart's alerts and dashboard (issue 31: 5), checked by promtool built from its pinned Go
module (tests/e2e/components/promtool): the rendered rules load (`promtool check rules`); they fire
as they should on series recorded from real agents (`promtool test rules`): none for healthy
agents, each for its own fault; and the dashboard's JSON loads, its panels have what Grafana
needs, and every query parses (as a recording rule: promtool parses PromQL offline only there)
and names only series the agents serve.

Recording: each scenario scrapes real agents — the device plugin and the bootstrap agent as
processes against the kubelet stand-in (the device plugin on a device node with the real KVM's
numbers), the DRA driver in-process against the fake API server and the DRA stand-in — and turns
each scrape into one minute of promtool's input series, as Prometheus would store it: the
target's labels added (job from the DaemonSet's name, as the chart's monitors relabel it), `up` 1
for an answered scrape, and `up` 0 with every other series marked stale for a failed one. A state
that lasts (a device gone) is its last scrape repeated; the minutes are promtool's, not the wall
clock's. Only kube_pod_status_ready, kube-state-metrics' series, is not the agent's own: it is
the DRA driver's readiness, the state its readiness probe reports."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from hyperlight_agent import contracts, modes
from hyperlight_agent.agent import Agent
from hyperlight_agent.device.helper import ProbeResult
from standin.apiserver import FakeApiServer, recorded
from standin.dra_kubelet import Claim, DraKubeletStandin
from standin.kubelet import StandinThread
from tests.conftest import StartAgent, until, wait_for
from tests.e2e.tools import tool
from tests.fakes import FakeHelper, shut
from tests.test_deploy import documents
from tests.test_docs import ROOT
from tests.test_dra_side import DRIVER, UID, settings_in, with_cluster
from tests.test_helm import CHART, MODES, MONITORING_API, template
from tests.test_host_metrics import documented, free_port, scrape

# promtool, helm (build/tools).
pytestmark = pytest.mark.judge

NAMESPACE = "hyperlight-system"  # tests.test_helm renders the chart into it
RULES = ["--set", "metrics.enabled=true", "--set", "metrics.prometheusRule.enabled=true", *MONITORING_API]
DASHBOARD = os.path.join(CHART, "dashboards", "hyperlight-agent.json")


def promtool(*args: str, cwd: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd)


def rule_groups(mode: str) -> list[dict[str, Any]]:
    (rule,) = [d for d in documents(template(*RULES, "--set", f"mode={mode}").stdout) if d["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alert_names(groups: list[dict[str, Any]]) -> list[str]:
    return [r["alert"] for g in groups for r in g["rules"]]


@pytest.mark.parametrize("mode", MODES)
def test_promtool_accepts_the_rendered_rules(tmp_path: Any, mode: str) -> None:
    groups = rule_groups(mode)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    result = promtool("check", "rules", str(tmp_path / "rules.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_names(groups))} rules found" in result.stdout, result.stdout
    # Each mode alerts on what it runs: the DRA driver's alerts only where it runs.
    dra = {"HyperlightDRADriverNotReady", "HyperlightDRAPrepareErrors"}
    assert (dra <= set(alert_names(groups))) == (mode != "devicePlugin")
    assert "HyperlightNotRegisteredWithKubelet" in alert_names(groups), "the bootstrap agent runs in every mode"


# ---- recording ---------------------------------------------------------------------------

Sample = tuple[str, dict[str, str], float]


@dataclass(frozen=True)
class Target:
    """One scrape target as the chart's monitors make it: the DaemonSet's name is the job."""

    job: str
    pod: str

    def labels(self) -> dict[str, str]:
        return {"job": self.job, "namespace": NAMESPACE, "pod": self.pod, "instance": f"{self.pod}:9464"}


def parse(text: str) -> list[Sample]:
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def record(address: str) -> Optional[list[Sample]]:
    """One scrape, or None when the agent does not answer (Prometheus's up 0)."""
    try:
        return parse(scrape(address))
    except OSError:
        return None


@dataclass
class Timeline:
    """Minute by minute, what each target's scrape gave (None: it failed), and other series
    (kube-state-metrics')."""

    minutes: list[dict[str, Any]] = field(default_factory=list)

    def add(
        self, scrapes: Mapping[Target, Optional[list[Sample]]], times: int = 1, extra: Optional[list[Sample]] = None
    ) -> None:
        for _ in range(times):
            self.minutes.append({"scrapes": scrapes, "extra": extra or []})

    def input_series(self) -> list[dict[str, str]]:
        series: dict[str, list[str]] = {}
        for minute, snapshot in enumerate(self.minutes):
            seen: dict[str, str] = {}
            for target, samples in snapshot["scrapes"].items():
                seen[series_name("up", target.labels())] = "1" if samples is not None else "0"
                for name, labels, value in samples or []:
                    seen[series_name(name, {**labels, **target.labels()})] = number(value)
            for name, labels, value in snapshot["extra"]:
                seen[series_name(name, labels)] = number(value)
            for key in set(series) | set(seen):
                # A series a scrape lacks after it had one is stale (as Prometheus marks it).
                values = series.setdefault(key, ["_"] * minute)
                values.append(seen.get(key, "stale" if values and values[-1] not in ("_", "stale") else "_"))
        return [{"series": key, "values": " ".join(values)} for key, values in sorted(series.items())]


def series_name(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"


def number(value: float) -> str:
    return "NaN" if math.isnan(value) else repr(value)


# ---- the scenarios, recorded once per module ------------------------------------------------

PLUGIN = Target("hyperlight-device-plugin", "hyperlight-device-plugin-x7k2q")
ACCESS = Target("hyperlight-device-access", "hyperlight-device-access-p4m9z")
DRA = Target("hyperlight-dra-driver", "hyperlight-dra-driver-h3j8w")


@dataclass
class Recorded:
    healthy: list[Sample]
    access: list[Sample]
    cdi_tampered: list[list[Sample]]  # one scrape after each change someone else made
    device_gone: list[Sample]
    kubelet_gone: list[Sample]
    dra_ready: list[Sample]
    dra_prepare_failed: list[Sample]
    dra_unready: list[Sample]
    dra_ready_flags: tuple[bool, bool]


def scrape_until(address: str, condition: Callable[[list[Sample]], bool], what: str) -> list[Sample]:
    """The first scrape of the agent at `address` that meets `condition`."""
    found: list[list[Sample]] = []

    def met() -> bool:
        samples = record(address)
        if samples is not None and condition(samples):
            found.append(samples)
        return bool(found)

    wait_for(met, 10, what)
    return found[0]


def record_device_plugin(kubelet: StandinThread, start_agent: StartAgent, kvm_dir: str, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plugin_address, access_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    plugin = start_agent(
        "--device-count", "2", "--device-dir", kvm_dir, "--metrics-address", plugin_address, "--check-interval", "1"
    )
    access = start_agent("--device-access", "--device-dir", kvm_dir, "--metrics-address", access_address)
    kubelet.wait_until(lambda k: k.allocatable() == 2 and k.allocatable(contracts.RESOURCE_DEVICE_ACCESS) > 0, 15)
    streaming = "hyperlight_listandwatch_streams"
    out["healthy"] = scrape_until(plugin_address, lambda s: value(s, streaming) == 1, "the plugin's stream counted")
    out["access"] = scrape_until(access_address, lambda s: value(s, streaming) == 1, "the bootstrap's stream counted")
    # Someone else replaces the CDI spec (atomically, as a configuration manager would), four
    # times; the agent repairs it each time.
    spec = os.path.join(tmp, "cdi", contracts.CDI_SPEC_FILE)
    out["cdi_tampered"] = []
    for n in range(4):
        before = value(scrape_until(plugin_address, lambda s: True, "a scrape"), "hyperlight_cdi_repairs_total")
        with open(spec + ".theirs", "w") as f:
            f.write('{"cdiVersion": "0.3.0", "kind": "someone.else/device", "devices": []}\n')
        os.rename(spec + ".theirs", spec)

        def repaired(samples: list[Sample], before: float = before) -> bool:
            return value(samples, "hyperlight_cdi_repairs_total") > before

        out["cdi_tampered"].append(scrape_until(plugin_address, repaired, f"repair {n + 1}"))
    # The device goes away.
    os.unlink(os.path.join(kvm_dir, "kvm"))
    out["device_gone"] = scrape_until(
        plugin_address, lambda s: value(s, "hyperlight_device_healthy") == 0, "the device counted unhealthy"
    )
    # The kubelet goes away: no stream, registrations retried.
    kubelet.call(kubelet.kubelet.stop())
    out["kubelet_gone"] = scrape_until(plugin_address, lambda s: value(s, streaming) == 0, "no stream")
    # The agent stops: its scrape fails.
    assert plugin.stop() == 0
    assert record(plugin_address) is None
    assert access.stop() == 0
    return out


def record_dra(tmp: str, helpers: list[FakeHelper]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    async def body(fake: FakeApiServer, kubelet: DraKubeletStandin, config: str) -> None:
        address = f"127.0.0.1:{free_port()}"
        agent = Agent(settings_in(tmp, config, metrics_address=address), modes.DRA)
        await agent.start()
        loop = asyncio.get_running_loop()
        try:
            await wait_async(lambda: agent.ready)
            out["dra_ready"] = await loop.run_in_executor(None, record, address)
            ready = agent.ready
            # A claim the API server does not know: the kubelet gets an error for it.
            fake.claims[("default", "pod-hv-9x2lq")] = recorded("resourceclaim-allocated.json")
            await kubelet.prepare(DRIVER, [Claim("default", "pod-hv-9x2lq", UID), Claim("default", "gone", "u2")])
            out["dra_prepare_failed"] = await loop.run_in_executor(None, record, address)
            # The device fails its check: the driver is no longer ready (its probe says so).
            helpers[0].answers["kvm"] = ProbeResult(False, "KVM_CREATE_VM failed")
            agent.checker.request()
            await wait_async(lambda: not agent.ready)
            out["dra_unready"] = await loop.run_in_executor(None, record, address)
            out["dra_ready_flags"] = (ready, agent.ready)
        finally:
            await shut(agent)

    with_cluster(tmp, body)
    return out


async def wait_async(condition: Any, timeout: float = 15) -> None:
    await until(condition, timeout)


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    return sum(found) if found else -1.0


@pytest.fixture
def recorded_series(
    kubelet: StandinThread, start_agent: StartAgent, kvm_dir: str, tmp: str, helpers: list[FakeHelper]
) -> Recorded:
    dra_tmp = os.path.join(tmp, "dra")
    os.mkdir(dra_tmp)
    return Recorded(**record_device_plugin(kubelet, start_agent, kvm_dir, tmp), **record_dra(dra_tmp, helpers))


def ready(pod: str, flag: bool) -> Sample:
    """kube-state-metrics' series for the pod's Ready condition."""
    return (
        "kube_pod_status_ready",
        {"namespace": NAMESPACE, "pod": pod, "condition": "true", "uid": "u-1", "job": "kube-state-metrics"},
        1.0 if flag else 0.0,
    )


def expected(target: Target, **labels: str) -> dict[str, str]:
    return {**target.labels(), **labels, "severity": "warning"}


def test_the_alerts_fire_for_faults_recorded_from_real_agents(tmp_path: Any, recorded_series: Recorded) -> None:
    r = recorded_series
    assert r.dra_ready_flags == (True, False)
    assert value(r.dra_prepare_failed, "hyperlight_dra_claims_total", operation="prepare", result="error") == 1
    healthy = {PLUGIN: r.healthy, ACCESS: r.access, DRA: r.dra_ready}
    scenarios: list[tuple[str, Timeline, dict[str, list[dict[str, str]]]]] = []

    # Healthy agents, half an hour: no alert at all.
    timeline = Timeline()
    timeline.add(healthy, 30, [ready(DRA.pod, True)])
    scenarios.append(("healthy", timeline, {}))

    # The device gone for 20 minutes after 10 healthy ones. The plugin was recorded in that
    # order, after the CDI scenario's repairs: its healthy minutes are the last of those, so that
    # its repairs counter does not jump.
    repaired = {**healthy, PLUGIN: r.cdi_tampered[-1]}
    timeline = Timeline()
    timeline.add(repaired, 10, [ready(DRA.pod, True)])
    timeline.add({**healthy, PLUGIN: r.device_gone}, 20, [ready(DRA.pod, True)])
    scenarios.append(("device gone", timeline, {"HyperlightDeviceUnusable": [expected(PLUGIN)]}))

    # Then the kubelet gone too: the plugin keeps retrying, with no stream.
    timeline = Timeline()
    timeline.add(repaired, 10, [ready(DRA.pod, True)])
    timeline.add({**healthy, PLUGIN: r.kubelet_gone}, 20, [ready(DRA.pod, True)])
    scenarios.append(
        (
            "kubelet gone",
            timeline,
            {"HyperlightNotRegisteredWithKubelet": [expected(PLUGIN)], "HyperlightDeviceUnusable": [expected(PLUGIN)]},
        )
    )

    # The plugin's pod stops answering.
    timeline = Timeline()
    timeline.add(healthy, 10, [ready(DRA.pod, True)])
    timeline.add({**healthy, PLUGIN: None}, 20, [ready(DRA.pod, True)])
    scenarios.append(("agent down", timeline, {"HyperlightAgentDown": [expected(PLUGIN)]}))

    # Someone rewrites the CDI spec four times within the hour (the first write is the agent's own).
    timeline = Timeline()
    timeline.add(healthy, 10, [ready(DRA.pod, True)])
    for scrape_ in r.cdi_tampered:
        timeline.add({**healthy, PLUGIN: scrape_}, 2, [ready(DRA.pod, True)])
    timeline.add({**healthy, PLUGIN: r.cdi_tampered[-1]}, 12, [ready(DRA.pod, True)])
    scenarios.append(("CDI spec tampered", timeline, {"HyperlightCDISpecRepairedRepeatedly": [expected(PLUGIN)]}))

    # A DRA claim that cannot be prepared.
    timeline = Timeline()
    timeline.add(healthy, 25, [ready(DRA.pod, True)])
    timeline.add({**healthy, DRA: r.dra_prepare_failed}, 5, [ready(DRA.pod, True)])
    scenarios.append(
        (
            "DRA prepare error",
            timeline,
            {"HyperlightDRAPrepareErrors": [expected(DRA, operation="prepare", result="error")]},
        )
    )

    # The DRA driver's device fails: unusable, and the driver not ready.
    timeline = Timeline()
    timeline.add(healthy, 10, [ready(DRA.pod, True)])
    timeline.add({**healthy, DRA: r.dra_unready}, 20, [ready(DRA.pod, False)])
    scenarios.append(
        (
            "DRA driver unready",
            timeline,
            {
                "HyperlightDeviceUnusable": [expected(DRA)],
                "HyperlightDRADriverNotReady": [
                    {
                        "namespace": NAMESPACE,
                        "pod": DRA.pod,
                        "condition": "true",
                        "uid": "u-1",
                        "job": "kube-state-metrics",
                        "severity": "warning",
                    }
                ],
            },
        )
    )

    groups = rule_groups("both")
    # promtool compares annotations too; their templates are checked by `promtool check rules`.
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    names = alert_names(groups)
    tests = []
    for name, timeline, fires in scenarios:
        assert set(fires) <= set(names), name
        tests.append(
            {
                "name": name,
                "interval": "1m",
                "input_series": timeline.input_series(),
                "alert_rule_test": [
                    {
                        "eval_time": f"{len(timeline.minutes) - 1}m",
                        "alertname": alert,
                        "exp_alerts": [{"exp_labels": labels} for labels in fires.get(alert, [])],
                    }
                    for alert in names
                ],
            }
        )
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    result = promtool("test", "rules", "tests.yaml", cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout


# ---- the dashboard ---------------------------------------------------------------------------

# Grafana's variables in the queries, as Grafana would substitute them.
VARIABLES = {"$__rate_interval": "2m", "$namespace": NAMESPACE, "$job": ".+"}


def dashboard() -> dict[str, Any]:
    with open(DASHBOARD) as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded


def test_the_dashboard_has_what_grafana_needs() -> None:
    """The fields Grafana's dashboard model requires of a provisioned dashboard, each panel placed
    on the 24-column grid without overlap, and every query on the dashboard's data source."""
    board = dashboard()
    assert isinstance(board["title"], str) and re.fullmatch(r"[a-z0-9-]{1,40}", board["uid"])
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids, cells = set(), set()
    for panel in board["panels"]:
        assert panel["type"] in {"row", "stat", "timeseries", "table"} and panel["title"]
        assert panel["id"] not in ids
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another"
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"]


def queries() -> list[str]:
    board = dashboard()
    found = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    found += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    return found


def test_every_dashboard_query_parses_and_names_served_series(tmp_path: Any) -> None:
    rules = []
    for n, query in enumerate(queries()):
        # label_values(SELECTOR, LABEL) is Grafana's own function around a selector.
        grafana = re.fullmatch(r"label_values\((.*), \w+\)", query)
        expr = grafana.group(1) if grafana else query
        for variable, replacement in VARIABLES.items():
            expr = expr.replace(variable, replacement)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{n}", "expr": expr})
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(tmp_path / "queries.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
    served = set(documented()) | {"up"}
    for query in queries():
        for name in re.findall(r"\b([a-z_][a-z0-9_]*)\{", query):
            assert name in served or re.sub(r"_(bucket|sum|count)$", "", name) in served, f"{name} in {query}"


def test_promtool_is_the_pinned_one() -> None:
    with open(os.path.join(ROOT, "tests", "e2e", "components", "promtool", "go.mod")) as f:
        pinned = re.search(r"github\.com/prometheus/prometheus (v0\.3(\d\d)\.(\d+))", f.read())
    assert pinned
    out = subprocess.run([tool("promtool"), "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    assert f"promtool, version 3.{int(pinned.group(2))}.{pinned.group(3)}" in out, out
