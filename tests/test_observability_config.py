"""The shipped observability config: Grafana dashboard, Prometheus config, alert rules.

Checked with the real `promtool` (Debian package `prometheus`, which `make test` installs):
the config and rules load, the alert unit tests in deploy/prometheus/alerts_test.yml pass,
every dashboard expression parses as PromQL, and the committed dashboard JSON is exactly
what grafana/generate.py writes. Evaluating the expressions against a live Prometheus
scraping a live broker is the integration test's job; it gets them from
`grafana/generate.py`'s `expressions()`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from conftest import load_generator

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "grafana" / "generate.py"
DASHBOARD = ROOT / "grafana" / "dashboards" / "rpc-broker.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return load_generator()


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def promtool(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not on PATH: run `make test` (or `make prometheus-bin`), which installs "
                    "the Debian package prometheus")
    return subprocess.run([exe, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60)


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{' '.join(result.args)} failed:\n{result.stdout}\n{result.stderr}"


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every non-row panel, including those inside collapsed rows."""
    out: list[dict[str, Any]] = []
    todo = list(dashboard["panels"])
    while todo:
        panel = todo.pop(0)
        todo.extend(panel.get("panels", []))
        if panel["type"] != "row":
            out.append(panel)
    return out


# ---- dashboard -------------------------------------------------------------------------


def test_committed_dashboard_is_the_generator_output(generator: ModuleType) -> None:
    assert DASHBOARD.read_text(encoding="utf-8") == generator.render(generator.build_dashboard()), (
        "grafana/dashboards/rpc-broker.json is out of date: run `python grafana/generate.py`")
    # and the generator's own check agrees, run as the README says
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_generator_check_mode_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "rpc-broker.json"
    stale.write_text('{"uid": "rpc-broker"}\n', encoding="utf-8")
    check = [sys.executable, str(GENERATOR), "--check", "--output", str(stale)]
    result = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "out of date" in result.stderr
    # writing it makes the check pass, and a second run writes the same bytes (deterministic)
    subprocess.run([sys.executable, str(GENERATOR), "--output", str(stale)], check=True, timeout=60)
    assert stale.read_bytes() == DASHBOARD.read_bytes()
    assert subprocess.run(check, capture_output=True, timeout=60).returncode == 0


def test_dashboard_identity_and_variables(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "rpc-broker"
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["definition"] == "label_values(rpc_broker_build_info, instance)"
    assert variables["instance"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_panel_has_a_title_and_queries(dashboard: dict[str, Any]) -> None:
    found = panels(dashboard)
    assert len(found) >= 20
    ids = [p["id"] for p in found]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in found:
        assert panel["title"], panel
        assert panel["description"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        targets = panel["targets"]
        assert isinstance(targets, list) and targets, f"{panel['title']} has no query"
        for target in targets:
            assert target["expr"].strip(), panel["title"]
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_panels_cover_the_issue(dashboard: dict[str, Any]) -> None:
    titles = {p["title"] for p in panels(dashboard)}
    for wanted in ("Call rate by method", "Error ratio by code", "Latency by method (p50 / p90 / p99)",
                   "Queue wait vs worker service time (p99)", "In-flight and queued calls", "Workers by state",
                   "Worker restarts by reason", "Batch size", "Open connections", "Refused connections",
                   "Bytes in / out", "Worker CPU by slot", "Worker resident memory by slot",
                   "HTTP responses by path and status", "Queued bytes"):
        assert wanted in titles


def panel(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    (found,) = [p for p in panels(dashboard) if p["title"] == title]
    return found


# histogram_quantile(q, sum by (<labels>) (rate(rpc_broker_call_duration_seconds_bucket{<matchers>}[...])))
CALL_DURATION_QUANTILE = re.compile(
    r"histogram_quantile\([^,]+, sum by \(([^)]*)\) \(rate\((rpc_broker_(?:call_duration|worker_service)"
    r"_seconds)_bucket\{([^}]*)\}")


NOT_INSTANT = 'method!~"other|rpc\\\\.discover"'  # (PromQL: the regex other|rpc\.discover)


def test_all_methods_latency_quantiles_leave_out_other(dashboard: dict[str, Any]) -> None:
    """Unknown methods, and `rpc.discover` (the broker's own), are answered at once: over all
    methods, a flood of them would drag the p99 under any threshold. Every quantile not split by
    method leaves them out, in the dashboard and in the latency alert."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    rules = {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}
    exprs.append(rules["RpcBrokerLatencyHigh"])
    pooled = 0
    for expr in exprs:
        for by, _metric, matchers in CALL_DURATION_QUANTILE.findall(expr):
            if "method" not in [label.strip() for label in by.split(",")]:
                pooled += 1
                assert NOT_INSTANT in matchers, expr
    assert pooled >= 3  # the "p99 latency" stat, the worker service p99 and the alert
    assert NOT_INSTANT in panel(dashboard, "p99 latency")["targets"][0]["expr"]
    # the alert's "is there traffic" guard counts the same calls as its quantile
    assert f"rpc_broker_call_duration_seconds_count{{{NOT_INSTANT}}}" in rules["RpcBrokerLatencyHigh"]


def test_queue_fill_counts_both_limits(dashboard: dict[str, Any]) -> None:
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    rules = {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}
    fill = panel(dashboard, "Queue fill")["targets"][0]["expr"]
    for expr in (fill, rules["RpcBrokerQueueSaturated"]):
        for metric in ("rpc_broker_calls_queued", "rpc_broker_queue_capacity", "rpc_broker_queued_bytes",
                       "rpc_broker_queue_capacity_bytes"):
            assert metric in expr, (metric, expr)
        assert expr.lstrip().startswith("max"), expr
        assert expr.count("> 0)") == 2, f"both divisions are guarded: {expr}"
    queued_bytes = [t["expr"] for t in panel(dashboard, "Queued bytes")["targets"]]
    assert "rpc_broker_queued_bytes" in queued_bytes[0], queued_bytes
    assert "rpc_broker_queue_capacity_bytes" in queued_bytes[1], queued_bytes
    assert panel(dashboard, "Queued bytes")["fieldConfig"]["defaults"]["unit"] == "bytes"


def test_batch_size_shows_the_exact_mean_first(dashboard: dict[str, Any]) -> None:
    batch = panel(dashboard, "Batch size")
    first, *quantiles = batch["targets"]
    assert first["legendFormat"] == "mean"
    assert "rpc_broker_batch_size_sum" in first["expr"] and "rpc_broker_batch_size_count" in first["expr"]
    assert all("bucket estimate" in t["legendFormat"] for t in quantiles) and len(quantiles) == 2
    assert "bucket" in batch["description"] and "7.5" in batch["description"]
    thick = {o["matcher"]["options"] for o in batch["fieldConfig"]["overrides"]
             if {"id": "custom.lineWidth", "value": 3} in o["properties"]}
    assert thick == {"mean"}


def readme_section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n### {title}\n")
    end = min(i for i in (text.find("\n### ", start + 1), text.find("\n## ", start + 1)) if i != -1)
    return text[start:end]


def table_first_cells(section: str, column: int) -> list[str]:
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [line.split("|")[column + 1].strip() for line in rows[1:]]


def test_readme_dashboard_table_lists_every_panel(dashboard: dict[str, Any]) -> None:
    listed = table_first_cells(readme_section("Dashboard"), 1)
    assert listed == [p["title"] for p in panels(dashboard)]


def test_readme_alerts_table_lists_every_alert() -> None:
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    names = [rule["alert"] for group in groups for rule in group["rules"]]
    assert table_first_cells(readme_section("Alerts"), 0) == names


def test_expressions_substitute_every_variable(generator: ModuleType, dashboard: dict[str, Any]) -> None:
    exprs = generator.expressions(dashboard)
    assert len(exprs) == sum(len(p["targets"]) for p in panels(dashboard))
    for expr in exprs:
        assert "$" not in expr and "[[" not in expr, expr
    assert 'histogram_quantile(0.99, sum by (le, method) (rate(rpc_broker_call_duration_seconds_bucket'\
           '{instance=~".*"}[1m])))' in exprs
    with pytest.raises(ValueError, match="no value for Grafana variable"):
        generator.substitute("rate(x[$__unknown])")


def test_every_dashboard_expression_parses(generator: ModuleType, dashboard: dict[str, Any],
                                           tmp_path: Path) -> None:
    # promtool parses each rule's expr with Prometheus's own PromQL parser: one recording rule
    # per dashboard expression turns `check rules` into a syntax check of all of them.
    exprs = generator.expressions(dashboard)
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": expr} for i, expr in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    result = promtool("check", "rules", path)
    assert_ok(result)
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


# ---- Prometheus config and alerts ------------------------------------------------------


def test_prometheus_config_is_valid() -> None:
    result = promtool("check", "config", PROMETHEUS_CONFIG)
    assert_ok(result)
    assert "1 rule files found" in result.stdout
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text(encoding="utf-8"))
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "rpc-broker"
    assert job["metrics_path"] == "/metrics"
    assert (PROMETHEUS_CONFIG.parent / config["rule_files"][0]).resolve() == ALERTS


def test_alert_rules_are_valid() -> None:
    result = promtool("check", "rules", ALERTS)
    assert_ok(result)
    assert "SUCCESS: 7 rules found" in result.stdout


def test_alert_rules_unit_tests_pass() -> None:
    assert_ok(promtool("test", "rules", ALERTS_TEST.name, cwd=ALERTS_TEST.parent))


def test_every_alert_is_documented_and_tested_both_ways() -> None:
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    alerts = {rule["alert"]: rule for group in groups for rule in group["rules"]}
    assert set(alerts) == {"RpcBrokerDown", "RpcBrokerNoReadyWorkers", "RpcBrokerHighErrorRatio",
                           "RpcBrokerLatencyHigh", "RpcBrokerQueueSaturated", "RpcBrokerWorkersRestarting",
                           "RpcBrokerFrontEndDown"}
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), name
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(ALERTS_TEST.read_text(encoding="utf-8"))["tests"]:
        for check in case.get("alert_rule_test", []):
            if check.get("exp_alerts"):
                fires.add(check["alertname"])
                for alert in check["exp_alerts"]:
                    assert alert["exp_labels"]["severity"] == alerts[check["alertname"]]["labels"]["severity"]
                    assert set(alert["exp_annotations"]) == {"summary", "description", "runbook"}
            else:
                quiet.add(check["alertname"])
    assert fires == set(alerts), f"alerts never tested firing: {set(alerts) - fires}"
    assert quiet == set(alerts), f"alerts never tested quiet: {set(alerts) - quiet}"
