#!/usr/bin/env python3
"""Generate the rpc-broker Grafana dashboard as code.

    python grafana/generate.py           # write grafana/dashboards/rpc-broker.json
    python grafana/generate.py --check   # exit 1 if the committed JSON differs from the output

The dashboard is written against the metric contract (names, types, labels) of
`broker/metrics.py`. Every query filters on the `instance` template variable (and on no job:
the broker is found by its `rpc_broker_*` metrics, whatever the scrape job is called) and
reads through the `datasource` variable, so the JSON imports into any Grafana with a
Prometheus data source. The output is deterministic (no timestamps, fixed key and panel order), so the
committed JSON can be compared with a fresh run; a test does exactly that.

`expressions(dashboard)` returns every PromQL expression of the dashboard with Grafana's
variables replaced by concrete values, so a test can evaluate them against a real Prometheus.

Standard library only: this runs without the project's virtualenv.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

JSON = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
Panel = dict[str, JSON]

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "dashboards" / "rpc-broker.json"

DATASOURCE: JSON = {"type": "prometheus", "uid": "${datasource}"}
# Every selector carries this matcher; "All" on the variable means the regex `.*`.
INSTANCE = 'instance=~"$instance"'
# JSON-RPC codes that are the server's fault (see ErrorCode in broker/jsonrpc.py):
# -32603 a handler raised, -32000 overloaded, -32001 timed out, -32002 worker died,
# -32003 no worker, -32004 shutting down. Client mistakes (-32700 parse error, -32600
# invalid request, -32601 method not found, -32602 invalid params) and the tools' own
# application codes are not counted.
SERVER_ERROR_CODES = "-32603|-32000|-32001|-32002|-32003|-32004"
SERVER_ERRORS = f'code=~"{SERVER_ERROR_CODES}"'
READY = 'state="ready"'
# Calls to unknown methods, parse errors and invalid requests, and `rpc.discover` (the
# broker's own): answered at once, without a worker. A flood of them drags an all-methods
# latency quantile down and hides a slow tool.
NOT_OTHER = 'method!~"other|rpc\\\\.discover"'

# Concrete values for Grafana's variables, used by `expressions()`.
SUBSTITUTIONS = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
    "instance": ".*",
}

# ---- PromQL helpers ------------------------------------------------------------------


def sel(metric: str, *matchers: str) -> str:
    """`metric{instance=~"$instance", <matchers>}`."""
    return metric + "{" + ", ".join((INSTANCE, *matchers)) + "}"


def rate(metric: str, *matchers: str) -> str:
    return f"rate({sel(metric, *matchers)}[$__rate_interval])"


def quantile(q: float, histogram: str, by: str = "", *matchers: str) -> str:
    """`histogram_quantile` over the per-`le` rate of `histogram`'s buckets (those `matchers`
    select), also grouped by `by`."""
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) ({rate(histogram + '_bucket', *matchers)}))"


def ratio(numerator: str, denominator: str) -> str:
    """`numerator / denominator`, empty (not NaN) while the denominator is 0."""
    return f"{numerator} / ({denominator} > 0)"


def larger(**ratios: str) -> str:
    """The largest of `ratios` (keyword: a name for it), whichever of them exist. Each is
    labelled `limit=<name>` first: `or` keeps only one of several series with the same labels."""
    tagged = [f'label_replace({expr}, "limit", "{name}", "", "")' for name, expr in ratios.items()]
    return "max(" + " or ".join(tagged) + ")"


# The queue's fill: the fuller of its two limits, max_queue calls and max_queue_bytes of
# params (the rule RpcBrokerQueueSaturated in deploy/prometheus/alerts.yml, over all instances).
QUEUE_FILL = larger(
    max_queue=ratio(f"sum({sel('rpc_broker_calls_queued')})", f"sum({sel('rpc_broker_queue_capacity')})"),
    max_queue_bytes=ratio(f"sum({sel('rpc_broker_queued_bytes')})",
                          f"sum({sel('rpc_broker_queue_capacity_bytes')})"),
)


# ---- panel builders ------------------------------------------------------------------


def target(expr: str, legend: str, ref: str) -> Panel:
    return {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "refId": ref,
    }


def targets(queries: list[tuple[str, str]]) -> list[JSON]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def timeseries(
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    *,
    unit: str = "short",
    width: int = 12,
    bars: bool = False,
    overrides: list[JSON] | None = None,
) -> Panel:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "width": width,  # consumed by `layout()`
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "min": 0,
                "custom": {
                    "drawStyle": "bars" if bars else "line",
                    "lineWidth": 1,
                    "fillOpacity": 60 if bars else 10,
                    "showPoints": "never",
                    "spanNulls": False,
                    "stacking": {"mode": "none", "group": "A"},
                },
            },
            "overrides": overrides or [],
        },
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                       "calcs": ["mean", "max", "lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets(queries),
    }


def stat(title: str, description: str, expr: str, *, unit: str, legend: str = "",
         thresholds: list[tuple[float | None, str]] | None = None, text_mode: str = "value") -> Panel:
    steps: list[JSON] = [{"color": color, "value": value}
                         for value, color in (thresholds or [(None, "green")])]
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "width": 4,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": {"mode": "absolute", "steps": steps},
                "color": {"mode": "thresholds"},
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area" if text_mode == "value" else "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": text_mode,
        },
        "targets": targets([(expr, legend)]),
    }


def emphasised(series: str) -> JSON:
    """An override drawing `series` (its legend name) as a thick line."""
    return {
        "matcher": {"id": "byName", "options": series},
        "properties": [{"id": "custom.lineWidth", "value": 3}],
    }


def thin_dashed(series: str) -> JSON:
    """An override drawing `series` as a dashed, unfilled line in its usual color."""
    return {
        "matcher": {"id": "byName", "options": series},
        "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [4, 4]}},
            {"id": "custom.fillOpacity", "value": 0},
        ],
    }


def dashed(series: str, color: str) -> JSON:
    """An override drawing `series` (its legend name) as a dashed, unfilled line."""
    return {
        "matcher": {"id": "byName", "options": series},
        "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "custom.fillOpacity", "value": 0},
            {"id": "color", "value": {"mode": "fixed", "fixedColor": color}},
        ],
    }


# ---- the dashboard -------------------------------------------------------------------


def overview() -> list[Panel]:
    return [
        stat("Calls / s", "Requests (calls with an id) answered per second, all methods.",
             f"sum({rate('rpc_broker_calls_total')})", unit="reqps"),
        stat("Server error ratio",
             "Share of answered calls that got a server-side error (-32603, -32000..-32004). Client "
             "mistakes (parse error, invalid request, unknown method, bad params) are not counted.",
             ratio(f"sum({rate('rpc_broker_errors_total', SERVER_ERRORS)})",
                   f"sum({rate('rpc_broker_calls_total')})"),
             unit="percentunit", thresholds=[(None, "green"), (0.01, "orange"), (0.05, "red")]),
        stat("p99 latency",
             "99th percentile of the call duration (arrival to answer ready), all methods except `other` and "
             "`rpc.discover`: unknown methods, parse errors, invalid requests and the broker's own rpc.discover "
             "are answered at once, and a flood of them would hide a slow tool.",
             quantile(0.99, "rpc_broker_call_duration_seconds", "", NOT_OTHER), unit="s",
             thresholds=[(None, "green"), (0.5, "orange"), (1, "red")]),
        stat("Ready workers", "Worker slots in the ready state.",
             f"sum({sel('rpc_broker_workers', READY)})", unit="short",
             thresholds=[(None, "red"), (1, "green")]),
        stat("Queue fill",
             "How full the queue is: the larger of calls waiting / max_queue and the bytes they hold / "
             "max_queue_bytes. When either limit is reached, calls are refused with -32000 (overloaded).",
             QUEUE_FILL, unit="percentunit", thresholds=[(None, "green"), (0.5, "orange"), (0.8, "red")]),
        stat("Version", "Broker version(s) running on the selected instances.",
             f"count by (version) ({sel('rpc_broker_build_info')})", unit="none",
             legend="{{version}}", text_mode="name"),
    ]


def traffic() -> list[Panel]:
    return [
        timeseries(
            "Call rate by method",
            "Requests answered per second by method (unregistered names are `other`), and notifications "
            "received per second.",
            [(f"sum by (method) ({rate('rpc_broker_calls_total')})", "{{method}}"),
             (f"sum by (method) ({rate('rpc_broker_notifications_total')})", "{{method}} (notifications)")],
            unit="reqps",
        ),
        timeseries(
            "Error ratio by code",
            "Error objects sent per answered call, by JSON-RPC code. -32700/-32600/-32601/-32602 are the "
            "client's mistakes; -32603 and -32000..-32004 are the server's; `application` is a tool's own "
            "error code.",
            # The denominator has no labels: `on() group_left()` divides every code's rate by it.
            [(f"sum by (code) ({rate('rpc_broker_errors_total')})"
              f" / on() group_left() (sum({rate('rpc_broker_calls_total')}) > 0)", "{{code}}")],
            unit="percentunit",
        ),
        timeseries(
            "HTTP responses by path and status",
            "HTTP responses per second by path (rpc: the JSON-RPC path; mcp: MCP's; health, ready, metrics: the "
            "probes and scrapes; other: any other path, and requests unreadable as HTTP) and status code "
            "(a batch is always 200; see the README's error table).",
            [(f"sum by (path, status) ({rate('rpc_broker_http_responses_total')})", "{{path}} {{status}}")],
            unit="reqps",
        ),
        timeseries(
            "Timeouts, late replies, dropped notifications",
            "Calls answered -32001 because their deadline passed, by method; and worker replies dropped "
            "because the call had already been answered, by kind. Each timeout of a call sent to a worker "
            "normally brings one late reply: `cancelled` when the worker stopped the call on the broker's "
            "cancel (async handlers), `result` when the call ran to its end anyway (sync handlers cannot be "
            "interrupted: they held their worker past the deadline). Fewer late replies than timeouts mean "
            "calls that expired in the queue, or workers killed as hung or dead before answering (see "
            "restarts). Notifications dropped, by reason (never reached a worker; `timed_out` also those "
            "their worker never started before their deadline; `worker_died` those lost with their "
            "worker): they get no answer, so this is their only trace.",
            [(f"sum by (method) ({rate('rpc_broker_timeouts_total')})", "timeout {{method}}"),
             (f"sum by (kind) ({rate('rpc_broker_late_replies_total')})", "late reply: {{kind}}"),
             (f"sum by (reason) ({rate('rpc_broker_notifications_dropped_total')})",
              "notifications dropped: {{reason}}")],
            unit="cps",
        ),
    ]


def latency() -> list[Panel]:
    return [
        timeseries(
            "Latency by method (p50 / p90 / p99)",
            "Call duration from arrival (body read) to answer ready, by method.",
            [(quantile(q, "rpc_broker_call_duration_seconds", "method"), f"p{round(q * 100)} {{{{method}}}}")
             for q in (0.5, 0.9, 0.99)],
            unit="s",
        ),
        timeseries(
            "Queue wait vs worker service time (p99)",
            "p99 of the time a call waits in the broker before it is written to a worker, next to p99 of the "
            "time it spends inside the worker (measured by the worker). Queue wait growing while service "
            "time stays flat means too few workers. Neither counts `other` (unknown methods never reach a worker).",
            [(quantile(0.99, "rpc_broker_queue_wait_seconds"), "queue wait p99"),
             (quantile(0.99, "rpc_broker_worker_service_seconds", "", NOT_OTHER), "worker service p99")],
            unit="s",
        ),
    ]


def capacity() -> list[Panel]:
    return [
        timeseries(
            "In-flight and queued calls",
            "Calls sent to a worker and not answered yet, calls waiting for a worker, and the queue "
            "capacity (max_queue): past it, calls are refused with -32000 (overloaded). The queue's "
            "other limit, in bytes, is in \"Queued bytes\".",
            [(f"sum({sel('rpc_broker_calls_in_flight')})", "in flight"),
             (f"sum({sel('rpc_broker_calls_queued')})", "queued"),
             (f"sum({sel('rpc_broker_queue_capacity')})", "queue capacity")],
            overrides=[dashed("queue capacity", "red")],
        ),
        timeseries(
            "Queued bytes",
            "Bytes the calls waiting for a worker hold (copies of their raw params and ids), and the queue's capacity in bytes "
            "(max_queue_bytes): past it, calls are refused with -32000 (overloaded) however few are queued.",
            [(f"sum({sel('rpc_broker_queued_bytes')})", "queued bytes"),
             (f"sum({sel('rpc_broker_queue_capacity_bytes')})", "queue capacity (bytes)")],
            unit="bytes", overrides=[dashed("queue capacity (bytes)", "red")],
        ),
        timeseries(
            "Batch size",
            "Requests plus notifications per batch. The mean (sum / count, thick line) is exact. p50 and "
            "p99 are estimates from the histogram's buckets (1, 2, 5, 10, 20, 50, ...): histogram_quantile "
            "interpolates inside a bucket, so batches all of 10 show a p50 of 7.5.",
            [(ratio(f"sum({rate('rpc_broker_batch_size_sum')})", f"sum({rate('rpc_broker_batch_size_count')})"),
              "mean"),
             (quantile(0.5, "rpc_broker_batch_size"), "p50 (bucket estimate)"),
             (quantile(0.99, "rpc_broker_batch_size"), "p99 (bucket estimate)")],
            overrides=[emphasised("mean"), thin_dashed("p50 (bucket estimate)"),
                       thin_dashed("p99 (bucket estimate)")],
        ),
        timeseries(
            "Batch rate",
            "Batches received per second.",
            [(f"sum({rate('rpc_broker_batch_size_count')})", "batches")],
            unit="cps",
        ),
    ]


def workers() -> list[Panel]:
    return [
        timeseries(
            "Workers by state",
            "Worker slots by state: starting, ready, draining, dead.",
            [(f"sum by (state) ({sel('rpc_broker_workers')})", "{{state}}")],
        ),
        timeseries(
            "Worker restarts by reason",
            "Worker processes restarted per rate interval, by reason: exited, killed, hung, boot_timeout, "
            "reload (a SIGHUP reload restarts every worker on purpose), left (a worker sent SIGTERM left "
            "without losing a call and was replaced), code_changed; and SIGHUP reloads by result: "
            "reload success, or reload failure (a new worker did not start: the old code serves on); and "
            "workers recycled (max_calls_per_worker, max_worker_memory: replaced, the replacement ready "
            "first; not restarts) by reason.",
            [(f"sum by (reason) (increase({sel('rpc_broker_worker_restarts_total')}[$__rate_interval]))",
              "{{reason}}"),
             (f"sum by (result) (increase({sel('rpc_broker_reloads_total')}[$__rate_interval]))",
              "reload {{result}}"),
             (f"sum by (reason) (increase({sel('rpc_broker_worker_recycles_total')}[$__rate_interval]))",
              "recycled {{reason}}")],
            bars=True,
        ),
        timeseries(
            "Front-ends",
            "Front-end processes by state (serve --frontends N): serving, starting (not serving yet: its "
            "workers not connected), down (waiting to be started again); and those other than the first "
            "started again after they exited or were killed as hung, per rate interval.",
            [(f"sum by (state) ({sel('rpc_broker_frontends')})", "{{state}}"),
             (f"sum(increase({sel('rpc_broker_frontend_restarts_total')}[$__rate_interval]))", "restarted")],
        ),
        timeseries(
            "Methods run alone",
            "Methods whose calls run alone, one per worker, since a worker died holding calls of theirs "
            "(docs/operations.md, worker crashes): how many of their calls must still answer so. A method "
            "here for long is one whose calls keep crashing (or hanging) their worker: the log names it.",
            [(f"sum by (method) ({sel('rpc_broker_method_isolated')})", "{{method}}")],
        ),
        timeseries(
            "Worker CPU by slot",
            "CPU (user + system) of the worker process in each slot; 100 % is one core. The counter restarts "
            "with the process, which rate() handles.",
            [(f"sum by (instance, slot) ({rate('rpc_broker_worker_cpu_seconds_total')})",
              "slot {{slot}} {{instance}}")],
            unit="percentunit",
        ),
        timeseries(
            "Worker resident memory by slot",
            "Resident memory of the worker process in each slot.",
            [(f"sum by (instance, slot) ({sel('rpc_broker_worker_resident_memory_bytes')})",
              "slot {{slot}} {{instance}}")],
            unit="bytes",
        ),
    ]


def network() -> list[Panel]:
    return [
        timeseries(
            "Open connections",
            "Open connections by transport: `http`, `tcp` and `unix` (NDJSON streams), and `metrics` "
            "(the separate metrics listener, with metrics_port).",
            [(f"sum by (transport) ({sel('rpc_broker_connections')})", "{{transport}}")],
            width=8,
        ),
        timeseries(
            "Refused connections",
            "Connections closed at once per second because max_connections was reached, by transport.",
            [(f"sum by (transport) ({rate('rpc_broker_connections_refused_total')})", "{{transport}}")],
            unit="cps", width=8,
        ),
        timeseries(
            "Bytes in / out",
            "Bytes read from and written to clients per second, by transport (`metrics`: the separate "
            "metrics listener's scrapes, with metrics_port).",
            [(f"sum by (transport) ({rate('rpc_broker_received_bytes_total')})", "in {{transport}}"),
             (f"sum by (transport) ({rate('rpc_broker_sent_bytes_total')})", "out {{transport}}")],
            unit="Bps", width=8,
        ),
    ]


def mcp() -> list[Panel]:
    return [
        timeseries(
            "MCP tool calls by tool and result",
            "MCP tools/call answered per second (on mcp_path, or mcp-stdio), by tool and result: ok; "
            "tool_error, an isError result (arguments that do not fit, the handler's error, a timeout, a "
            "worker's death, the broker's overload); unknown_tool, -32602 (tool `other`: a name no worker "
            "serves). Their latency is the tool's method's, in Latency.",
            [(f"sum by (tool, result) ({rate('rpc_broker_mcp_tool_calls_total')})", "{{tool}} {{result}}")],
            unit="reqps",
        ),
        timeseries(
            "MCP requests by method and era",
            "MCP requests and notifications per second, by MCP method and protocol era: 2026-07-28 "
            "(stateless), or legacy (a session begun by initialize: 2025-11-25 and older).",
            [(f"sum by (method, era) ({rate('rpc_broker_mcp_requests_total')})", "{{method}} {{era}}")],
            unit="reqps",
        ),
        timeseries(
            "MCP sessions",
            "2025-11-25 sessions held over HTTP (Mcp-Session-Id): at most 10,000, each forgotten after an "
            "hour idle.",
            [(f"sum({sel('rpc_broker_mcp_sessions')})", "sessions")],
            unit="short",
        ),
    ]


SECTIONS = [
    ("Overview", overview),
    ("Traffic and errors", traffic),
    ("Latency", latency),
    ("Capacity and batches", capacity),
    ("Workers", workers),
    ("Connections and bytes", network),
    ("MCP", mcp),
]


def layout(sections: list[tuple[str, list[Panel]]]) -> list[JSON]:
    """Give each panel an id and a grid position: a row header per section, then its panels
    left to right, wrapping at Grafana's 24 columns; stats are 4 high, graphs 8."""
    out: list[JSON] = []
    y = 0
    next_id = 1
    for title, panels in sections:
        out.append({"type": "row", "title": title, "id": next_id, "collapsed": False, "panels": [],
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        next_id += 1
        y += 1
        x = line_height = 0
        for panel in panels:
            width = panel.pop("width")
            assert isinstance(width, int)
            height = 4 if panel["type"] == "stat" else 8
            if x + width > 24:
                x, y, line_height = 0, y + line_height, 0
            out.append({"id": next_id, "gridPos": {"h": height, "w": width, "x": x, "y": y}, **panel})
            next_id += 1
            x += width
            line_height = max(line_height, height)
        y += line_height
    return out


def build_dashboard() -> Panel:
    return {
        "uid": "rpc-broker",
        "title": "rpc-broker",
        "description": "JSON-RPC 2.0 broker: traffic, errors, latency, queueing, workers. Generated by "
                       "grafana/generate.py; edit that, not this JSON.",
        "tags": ["rpc-broker", "json-rpc"],
        "id": None,
        "version": 1,
        "schemaVersion": 39,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                },
                {
                    "name": "instance",
                    "label": "Instance",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "definition": "label_values(rpc_broker_build_info, instance)",
                    "query": {
                        "qryType": 1,
                        "query": "label_values(rpc_broker_build_info, instance)",
                        "refId": "PrometheusVariableQueryEditor-VariableQuery",
                    },
                    "current": {},
                    "hide": 0,
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "refresh": 2,
                    "regex": "",
                    "sort": 1,
                    "options": [],
                },
            ]
        },
        "panels": layout([(title, make()) for title, make in SECTIONS]),
    }


def render(dashboard: Panel) -> str:
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


# ---- expressions for tests -----------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def substitute(expr: str) -> str:
    """Replace Grafana's variables in `expr` by the values in SUBSTITUTIONS (ValueError if unknown)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        try:
            return SUBSTITUTIONS[name]
        except KeyError:
            raise ValueError(f"no value for Grafana variable ${name} in {expr!r}") from None

    return _VARIABLE.sub(one, expr)


def _panels(panels: object) -> Iterator[Mapping[str, object]]:
    if not isinstance(panels, list):
        return
    for panel in panels:
        if isinstance(panel, Mapping):
            yield panel
            yield from _panels(panel.get("panels"))  # a collapsed row holds its panels


def expressions(dashboard: Mapping[str, object]) -> list[str]:
    """Every PromQL expression of every panel, in panel order, with variables substituted."""
    out: list[str] = []
    for panel in _panels(dashboard.get("panels")):
        queries = panel.get("targets")
        if not isinstance(queries, list):
            continue
        for query in queries:
            if isinstance(query, Mapping) and isinstance(query.get("expr"), str):
                out.append(substitute(str(query["expr"])))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the committed JSON differs from the generator's output")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"where to write (default {OUTPUT})")
    args = parser.parse_args(argv)
    text = render(build_dashboard())
    if args.check:
        committed = args.output.read_text(encoding="utf-8") if args.output.exists() else None
        if committed != text:
            print(f"{args.output} is out of date: run `python grafana/generate.py`", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
