"""Prometheus metrics of the broker, exported by the front-end process only.

Theory of operation
-------------------
The hot path never touches prometheus-client: its `Counter.labels(...).inc()` takes a
lock and a label lookup per call (about 1 us each), which would cost several percent
of a 30 us call. Instead the dispatcher counts into plain lists indexed by method
(`CallMetrics`, `LatencyHistogram`: an `int.bit_length` and two additions per
observation, measured at about 0.5 us per answered call in all), and one
`BrokerCollector` turns those numbers, the pool's and the front-ends', into metric
families when Prometheus scrapes (prometheus-client's "custom collector", see
https://prometheus.github.io/client_python/collector/custom/). Workers send their
service time with every reply (wire.py: `aux` of RESULT, ERROR, CHUNK_REPLY and CHUNK_RESULTS), and
their CPU and memory are read from /proc by psutil at scrape time, so there are no
multiprocess files.

Names follow https://prometheus.io/docs/practices/naming/: the `rpc_broker_` prefix,
base units (seconds, bytes), `_total` on counters. Label values are bounded: `method`
is a registered method, `rpc.discover` (the broker's own) or `other`; `code` one of the broker's own codes or
`application`; `slot` a worker slot index; `status` an HTTP status code; `kind` of a
late reply `cancelled` or `result`; `result` of a reload `success` or `failure`.

The state behind them is bounded too: an error code outside the broker's table
(`jsonrpc.ERRORS`) is folded into one `APPLICATION` entry when it is counted, not kept
per code, since it is exported only as `application` anyway. That includes the rest
of the range the spec reserves (-32768..-32000): a tool may answer any code there,
and 769 values per method would be state with no label to show it.
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import platform
import time
import typing
from collections.abc import Iterable, Iterator

import psutil
import uvloop.loop
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

import broker
from broker.catalog import DISCOVER
from broker.jsonrpc import ERRORS, OTHER, ErrorCode

if typing.TYPE_CHECKING:
    from broker.answers import Outgoing
    from broker.dispatch import Dispatcher
    from broker.frontend.http import HttpFrontend
    from broker.frontend.incoming import Incoming
    from broker.frontend.stream import StreamFrontend
    from broker.pool import Pool

__all__ = [
    "APPLICATION",
    "BATCH_BUCKETS",
    "CONTENT_TYPE",
    "FRONTEND_RESTART_REASONS",
    "OTHER",
    "SECONDS_BUCKETS",
    "BrokerCollector",
    "CallMetrics",
    "Histogram",
    "LatencyHistogram",
    "exposition",
    "outcome_name",
    "registry",
]

# Powers of two microseconds, from 128 us (a trivial call answered by a worker) to
# 33.5 s (past the 30 s default deadline): a bucket is then one `int.bit_length`, the
# cheapest bucketing Python has (Prometheus's native histograms are exponential too).
_FIRST_K, _LAST_K = 7, 25
SECONDS_BUCKETS: tuple[float, ...] = tuple(2**k / 1e6 for k in range(_FIRST_K, _LAST_K + 1))
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
# The classic text format (what generate_latest writes for these names); newer
# prometheus-client says version=1.0.0, which Prometheus 2.x servers predate.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OK = 0  # the outcome code of a result
APPLICATION = 1  # the outcome code every error code outside `jsonrpc.ERRORS` is counted as

_OUTCOMES: dict[int, str] = {
    ErrorCode.PARSE_ERROR: "parse_error",
    ErrorCode.INVALID_REQUEST: "invalid_request",
    ErrorCode.METHOD_NOT_FOUND: "method_not_found",
    ErrorCode.INVALID_PARAMS: "invalid_params",
    ErrorCode.INTERNAL_ERROR: "internal_error",
    ErrorCode.OVERLOADED: "overloaded",
    ErrorCode.TIMED_OUT: "timed_out",
    ErrorCode.WORKER_DIED: "worker_died",
    ErrorCode.NO_WORKER: "no_worker",
    ErrorCode.SHUTTING_DOWN: "shutting_down",
    ErrorCode.RATE_LIMITED: "rate_limited",
}
assert set(_OUTCOMES) == set(ERRORS), "every broker error code has an outcome name"


_OUTCOME_NAMES = ("ok", *_OUTCOMES.values(), "application_error")
# The statuses the HTTP front-end answers with (their series exist from the start).
HTTP_STATUSES = (
    b"200", b"202", b"204", b"400", b"401", b"403", b"404", b"405", b"408", b"411", b"413", b"415", b"421", b"429", b"431",
    b"500", b"502", b"503", b"504", b"505",
)
# The `path` label of the HTTP responses: rpc_path, /healthz, /readyz, /metrics, anything else.
HTTP_PATHS = ("rpc", "mcp", "health", "ready", "metrics", "other")
RESTART_REASONS = ("exited", "killed", "hung", "boot_timeout", "reload", "left", "code_changed")  # see restarts.restart_reason
# Why a notification never reached a worker (Dispatcher.notifications_dropped's keys).
# invalid_request: nested past the JSON parser's limit, so it cannot be forwarded
# (jsonrpc.Body.dropped); worker_died: it reached one, which died before it ended;
# rate_limited: past its caller's rate limit (issue 12, item 3).
DROP_REASONS = {code: _OUTCOMES[code] for code in (
    ErrorCode.OVERLOADED, ErrorCode.TIMED_OUT, ErrorCode.NO_WORKER, ErrorCode.SHUTTING_DOWN,
    ErrorCode.INVALID_REQUEST, ErrorCode.WORKER_DIED, ErrorCode.RATE_LIMITED)}
_NO_RESTARTS = dict.fromkeys(RESTART_REASONS, 0)
FRONTEND_RESTART_REASONS = ("hung", "never_served", "stopped", "killed", "exited")  # see peers.frontend_restart_reason
_NO_FRONTEND_RESTARTS = dict.fromkeys(FRONTEND_RESTART_REASONS, 0)


def outcome_name(code: int) -> str:
    """The `outcome` label of an answer: "ok" for a result (code 0), the error's name
    for one of the broker's codes (`jsonrpc.ERRORS`), else "application_error"."""
    if code == OK:
        return "ok"
    return _OUTCOMES.get(code, "application_error")


def _code_label(code: int) -> str:
    return str(code) if code in _OUTCOMES else "application"


class LatencyHistogram:
    """Durations in whole microseconds, bucketed by powers of two.

    counts[k]: observations with `us.bit_length() == k`, i.e. 2**(k-1) <= us < 2**k
    (k = 0: under 1 us). sum_us: their total, microseconds. `buckets()` gives the
    cumulative `SECONDS_BUCKETS` pairs at scrape time.
    """

    __slots__ = ("counts", "sum_us")

    def __init__(self) -> None:
        self.counts = [0] * 65  # any u64 fits
        self.sum_us = 0

    def observe_us(self, us: int, n: int = 1) -> None:
        """Count `n` observations of `us` microseconds (>= 0)."""
        self.counts[us.bit_length()] += n
        self.sum_us += us * n

    @property
    def sum(self) -> float:
        """Total of the observations, seconds."""
        return self.sum_us / 1e6

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs, le in seconds, ending with "+Inf"."""
        counts = self.counts
        total = sum(counts[: _FIRST_K + 1])
        out = [(repr(SECONDS_BUCKETS[0]), float(total))]
        for k in range(_FIRST_K + 1, _LAST_K + 1):
            total += counts[k]
            out.append((repr(SECONDS_BUCKETS[k - _FIRST_K]), float(total)))
        out.append(("+Inf", float(sum(counts))))
        return out


class Histogram:
    """Counts of observations per bucket, Prometheus-style (upper bounds inclusive);
    for values off the hot path (batch sizes).

    bounds: the finite upper bounds, ascending; counts has one more slot (+Inf).
    Not cumulative: `buckets()` makes the cumulative pairs at scrape time.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Count `n` observations of `value` (for n > 1: n calls that took as long)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs, ending with "+Inf", for HistogramMetricFamily."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class CallMetrics:
    """What the dispatcher counts per call, indexed by method index (the place of the
    method in the workers' HELLO list; index len(methods) is `OTHER`, and the next one
    `DISCOVER`, the broker's own `rpc.discover`).

    outcomes[m]: {code: answers}: `OK` for results, the broker's error codes, and
                 `APPLICATION` for every other code (so at most 12 entries).
    latency[m]: arrival (body decoded) to answer ready.
    service[m]: time inside the worker (its own measure); a chunk's calls are
                counted at the chunk's time divided by its number of calls.
    queue_wait: arrival to the call being written to a worker, for calls that
                waited in the queue; `sent_at_once` counts those that did not (0 s).
    batch_size: requests and notifications per batch.
    notifications[m]: notifications received.
    """

    __slots__ = (
        "batch_size", "latency", "names", "notifications", "outcomes", "queue_wait", "sent_at_once", "service",
    )  # fmt: skip

    def __init__(self) -> None:
        self.names: list[str] = [OTHER, DISCOVER]
        self.outcomes: list[dict[int, int]] = [{}, {}]
        self.latency = [LatencyHistogram(), LatencyHistogram()]
        self.service = [LatencyHistogram(), LatencyHistogram()]
        self.notifications = [0, 0]
        self.queue_wait = LatencyHistogram()
        self.sent_at_once = 0
        self.batch_size = Histogram(BATCH_BUCKETS)

    def set_methods(self, names: list[str]) -> None:
        """Size the tables for `names` (plus `OTHER`, then `DISCOVER`, last). Counts so far
        stay with their method's name (a reload may reorder the table); `OTHER`'s and
        `DISCOVER`'s stay theirs; those of a method no longer served are dropped."""
        old = {name: i for i, name in enumerate(self.names[:-2])}
        keep = [old.get(name, -1) for name in names]
        self.names = [*names, OTHER, DISCOVER]  # (no app registers "other" nor "rpc.": `Registry`)
        self.outcomes = [self.outcomes[i] if i >= 0 else {} for i in keep] + self.outcomes[-2:]
        self.latency = [self.latency[i] if i >= 0 else LatencyHistogram() for i in keep] + self.latency[-2:]
        self.service = [self.service[i] if i >= 0 else LatencyHistogram() for i in keep] + self.service[-2:]
        self.notifications = [self.notifications[i] if i >= 0 else 0 for i in keep] + self.notifications[-2:]

    @property
    def other(self) -> int:
        """The method index counted as `OTHER`: the method table's length (a reload gives a
        method it lost that index: `Dispatcher.set_methods`)."""
        return len(self.names) - 2

    @property
    def discover(self) -> int:
        """The method index `rpc.discover` is counted under (broker/catalog.py: the broker's own)."""
        return len(self.names) - 1

    def result(self, method: int, latency: float, service_us: int) -> None:
        """One call answered with a result: `latency` seconds since it arrived,
        `service_us` microseconds in the worker (the hot path: kept inline)."""
        outcomes = self.outcomes[method]
        outcomes[OK] = outcomes.get(OK, 0) + 1
        us = int(latency * 1e6)
        h = self.latency[method]
        h.counts[us.bit_length()] += 1
        h.sum_us += us
        h = self.service[method]
        h.counts[service_us.bit_length()] += 1
        h.sum_us += service_us

    def answered(self, method: int, code: int, latency: float, n: int = 1) -> None:
        """`n` answers with the error object's `code` (any integer: codes outside
        the broker's table are counted as `APPLICATION`), `latency` seconds after
        they arrived."""
        if code not in _OUTCOMES:
            code = APPLICATION
        outcomes = self.outcomes[method]
        outcomes[code] = outcomes.get(code, 0) + n
        self.latency[method].observe_us(int(latency * 1e6), n)

    def ok(self, method: int, latency: float, n: int = 1) -> None:
        """`n` answers with a result, `latency` seconds after they arrived."""
        outcomes = self.outcomes[method]
        outcomes[OK] = outcomes.get(OK, 0) + n
        self.latency[method].observe_us(int(latency * 1e6), n)


def _family_counter(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def _family_gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


class BrokerCollector(Collector):
    """Builds every `rpc_broker_*` metric family from the live objects at scrape time.

    dispatcher: its `metrics` (a `CallMetrics`) and counters; pool: workers and
    restarts; frontends: HTTP listeners (the RPC one, and the metrics one if separate);
    log_dropped: the log lines dropped for a full queue, {"access": n, "broker": n, "worker": n}
    (`logpipe.LogPipe.dropped`), or None when the process logs another way.

    With `serve --frontends N` (broker/peers.py): a peer front-end's collector has no pool
    (None): it leaves out the workers', the event loop's and the build's families, which are
    the first front-end's; the first front-end's has `peer_samples`, the last `samples` of
    each peer, which it adds to its own series (counters, gauges and histograms alike: the
    broker's totals), so that every front-end's /metrics is one view.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        pool: Pool | None,
        frontends: list[HttpFrontend | StreamFrontend],
        max_queue: int,
        max_queue_bytes: int = 0,
        log_dropped: typing.Mapping[str, int] | None = None,
        peer_samples: typing.Callable[[], Iterable[list[Flat]]] | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.peer_samples = peer_samples
        self.log_dropped = log_dropped  # lines dropped for a full log queue (`logpipe.LogPipe.dropped`)
        self.pool = pool
        self.frontends = frontends
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self._processes: dict[int, psutil.Process] = {}
        self._handles = 0  # live_handles()
        self._handles_at: float | None = None  # when its count began, monotonic s
        self._counting = False  # a count runs in a thread (`_event_loop`)
        self._build = [broker.version(), platform.python_version()]
        self._high: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # `add_samples`' highest sums

    def collect(self) -> Iterator[Metric]:
        """Yield the families (called by the registry on every scrape), the peers' series
        added to this process's (`peer_samples`)."""
        if self.peer_samples is None:
            yield from self._own()
            return
        families = list(self._own())
        add_samples(families, self.peer_samples(), self._high)
        yield from families

    def _own(self) -> Iterator[Metric]:
        d = self.dispatcher
        m = d.metrics
        if m is not None:
            yield from self._calls(m)
        # The families of one unlabelled series: (kind, name, help, value)
        for family, name, doc, value in (
            (_family_gauge, "rpc_broker_calls_in_flight", "Calls sent to a worker and not answered yet.",
             d.in_flight_calls),
            (_family_gauge, "rpc_broker_calls_queued", "Calls waiting for a worker.", d.queued_calls),
            (_family_gauge, "rpc_broker_calls_held", "Of the calls waiting, those held for their connection's "
             "share of the places (connection_share), for a worker of their own (a method run alone), or for a "
             "worker with room for their large params (max_worker_params_bytes), not for a free place.",
             d.held_calls),
            (_family_gauge, "rpc_broker_queue_capacity", "Calls the queue holds before answering overloaded "
             "(max_queue).", self.max_queue),
            (_family_gauge, "rpc_broker_queued_bytes", "Bytes the calls waiting for a worker hold (raw params "
             "and ids).", d.queued_bytes),
            (_family_gauge, "rpc_broker_queue_capacity_bytes", "Bytes the queue holds before answering "
             "overloaded (max_queue_bytes).", self.max_queue_bytes),
            (_family_counter, "rpc_broker_calls_returned", "Calls a worker gave back unstarted, their method "
             "(sync, measured fast) found slow there, and routed again as blocking calls.", d.returned_total),
            (_family_counter, "rpc_broker_responses_oversize", "Results (or error objects) answered -32603 "
             "instead, because they would take the answers their connection is owed past max_response_bytes.",
             d.oversize_total),
        ):
            yield family(name, doc, [], [([], value)])
        yield _family_counter(
            "rpc_broker_rate_limited", "Calls (and notifications) refused past their caller's rate limit "
            "(rate_limit, -32005), by token (\"\": the callers without one, by client address).", ["token"],
            [([name], n) for name, n in d.limiter.refused().items()],
        )
        if self.log_dropped is not None:
            yield _family_counter(
                "rpc_broker_log_lines_dropped", "Log lines dropped, not written: stderr took them slower than they "
                "came and the log's queue was full (the event loop never waits for stderr), by log: access (the "
                "access log's), broker (the broker's own) or worker (the workers', read from their stderr).", ["log"],
                [([name], n) for name, n in sorted(self.log_dropped.items())],
            )
        yield _family_gauge(
            "rpc_broker_method_isolated", "Methods whose calls run alone, one per worker, since a worker died "
            "holding calls of theirs: how many of their calls must still answer so (absent: none).", ["method"],
            [([name], n) for name, n in d.isolated.items()],
        )
        yield _family_counter(
            "rpc_broker_late_replies", "Worker replies dropped: the call had been answered already (deadline, "
            "shutdown) or its client had gone. kind: cancelled (the worker acknowledged the cancel) or result (the call finished late).",
            ["kind"], [(["cancelled"], d.late_cancelled_total), (["result"], d.late_results_total)],
        )  # fmt: skip
        yield _family_counter(
            "rpc_broker_calls_abandoned", "Calls owed an answer whose client's connection closed first: dropped "
            "from the queue, never run (where=queued), or cancelled on their worker (where=in_flight).",
            ["where"], [([where], n) for where, n in d.abandoned_total.items()],
        )  # fmt: skip
        yield _family_counter(
            "rpc_broker_notifications_dropped", "Notifications that never reached a worker, or whose worker died "
            "before they ended (reason worker_died), by reason (they get no answer, so this is their only trace).", ["reason"],
            [([reason], d.notifications_dropped.get(code, 0)) for code, reason in DROP_REASONS.items()],
        )  # fmt: skip
        yield from self._http()
        yield from self._mcp()
        if self.pool is None:  # (a peer front-end's: the rest is the first front-end's)
            return
        yield from self._workers()
        yield from self._event_loop()
        yield _family_gauge(
            "rpc_broker_build_info", "The running broker's version and Python; always 1.", ["version", "python"],
            [(self._build, 1)],
        )  # fmt: skip

    def _calls(self, m: CallMetrics) -> Iterator[Metric]:
        names = m.names
        calls = CounterMetricFamily(
            "rpc_broker_calls", "Requests answered, by method and outcome (ok or the error's name).",
            labels=["method", "outcome"],
        )  # fmt: skip
        # Series that exist from the first scrape, at 0: a counter that appears only at
        # its first event loses that event to rate() and increase().
        errors: dict[str, int] = {_code_label(code): 0 for code in _OUTCOMES}
        errors["application"] = 0
        timeouts = CounterMetricFamily(
            "rpc_broker_timeouts", "Calls answered -32001: their deadline passed.", labels=["method"]
        )
        for name, outcomes in zip(names, m.outcomes):
            by_outcome = dict.fromkeys(_OUTCOME_NAMES, 0)
            for code, count in outcomes.items():
                label = outcome_name(code)
                by_outcome[label] = by_outcome.get(label, 0) + count
                if code != OK:
                    key = _code_label(code)
                    errors[key] = errors.get(key, 0) + count
            for label, count in sorted(by_outcome.items()):
                calls.add_metric([name, label], count)
            timeouts.add_metric([name], outcomes.get(ErrorCode.TIMED_OUT, 0))
        yield calls
        yield timeouts
        yield _family_counter(
            "rpc_broker_errors", "Error objects sent, by code (the broker's codes, or 'application').",
            ["code"], (([code], n) for code, n in sorted(errors.items())),
        )  # fmt: skip
        yield _family_counter(
            "rpc_broker_notifications", "Notifications received (never answered), by method.", ["method"],
            (([name], n) for name, n in zip(names, m.notifications)),
        )  # fmt: skip
        for family, doc, hists in (
            ("rpc_broker_call_duration_seconds", "From a call's arrival to its answer ready.", m.latency),
            ("rpc_broker_worker_service_seconds", "Time inside the worker, as the worker measured it.", m.service),
        ):
            h = HistogramMetricFamily(family, doc, labels=["method"])
            for name, hist in zip(names, hists):
                h.add_metric([name], hist.buckets(), hist.sum)
            yield h
        wait = m.queue_wait
        h = HistogramMetricFamily("rpc_broker_queue_wait_seconds", "From a call's arrival to its writing to a worker.")
        h.add_metric([], [(le, n + m.sent_at_once) for le, n in wait.buckets()], wait.sum)
        yield h
        h = HistogramMetricFamily("rpc_broker_batch_size", "Requests and notifications per batch.")
        h.add_metric([], m.batch_size.buckets(), m.batch_size.sum)
        yield h

    def _mcp(self) -> Iterator[Metric]:
        """MCP's families (broker/frontend/mcp.py), summed over the listeners that serve it."""
        from broker.frontend.mcp import ERAS, METHODS, TOOL_RESULTS

        servers = [fe.mcp for fe in self.frontends if fe.mcp is not None]
        requests = {(method, era): 0 for method in METHODS for era in ERAS}
        tools = {(typing.cast(str, t["name"]), result): 0 for t in self.dispatcher.catalog.tools() for result in TOOL_RESULTS}
        for server in servers:
            for key, n in server.requests.items():
                requests[key] += n
            for key, n in server.tool_calls.items():
                tools[key] = tools.get(key, 0) + n
        yield _family_counter(
            "rpc_broker_mcp_requests", "MCP requests and notifications (on mcp_path, or mcp-stdio), by MCP method "
            "(\"other\": any other) and era: 2026-07-28's stateless requests, or a session's (legacy: initialize, "
            "2025-11-25 and older).", ["method", "era"],
            (([method, era], n) for (method, era), n in requests.items()),
        )  # fmt: skip
        yield _family_counter(
            "rpc_broker_mcp_tool_calls", "MCP tools/call answered, by tool and result: ok, tool_error (isError: "
            "its arguments, its handler's error, a timeout, a worker's death, the broker's overload), or "
            "unknown_tool (-32602; tool \"other\" for a name no worker serves).", ["tool", "result"],
            (([tool, result], n) for (tool, result), n in sorted(tools.items())),
        )  # fmt: skip
        yield _family_gauge("rpc_broker_mcp_sessions", "MCP sessions (2025-11-25, HTTP: Mcp-Session-Id) held.", [],
                            [([], sum(server.sessions for server in servers))])

    def _http(self) -> Iterator[Metric]:
        statuses = {(path, status): 0 for path in HTTP_PATHS for status in HTTP_STATUSES}
        # per transport: [connections, refused, received bytes, sent bytes, shed]
        by_transport: dict[str, list[int]] = {}
        for fe in self.frontends:
            for path, counts in fe.statuses.items():
                for status, count in counts.items():
                    statuses[path, status] = statuses.get((path, status), 0) + count
            row = by_transport.setdefault(fe.transport, [0, 0, 0, 0, 0, 0, 0])
            row[0] += len(fe.connections) + len(fe.handshakes)
            row[1] += fe.refused_total
            row[2] += fe.received_bytes
            row[3] += fe.sent_bytes
            row[4] += fe.shed_total
            row[5] += fe.send_timed_out_total
            row[6] += fe.handshake_failed_total
        evicted = {(t, state): 0 for t in sorted(by_transport) for state in ("idle", "trickling", "incoming", "handshake")}
        for fe in self.frontends:
            for state, n in fe.evicted_total.items():
                evicted[fe.transport, state] += n
        yield _family_counter(
            "rpc_broker_connections_evicted", "Connections closed to make room for a new one at max_connections, by "
            "their state: idle (keep-alive, or silent), or trickling (a request or line under way, answered 408 or "
            "-32600); or incoming: a request or line under way that came slower than another needing room at "
            "max_incoming_bytes (answered 408 or -32600); or handshake: a TLS handshake begun the longest ago, not "
            "finished.", ["transport", "state"], (([t, state], n) for (t, state), n in sorted(evicted.items())),
        )  # fmt: skip
        yield _family_counter(
            "rpc_broker_http_responses", "HTTP responses, by path and status code.", ["path", "status"],
            (([path, status.decode()], n) for (path, status), n in sorted(statuses.items())),
        )  # fmt: skip
        for i, (family, doc, counter) in enumerate((
            ("rpc_broker_connections", "Open client connections.", False),
            ("rpc_broker_connections_refused", "Connections closed at once: max_connections was reached.", True),
            ("rpc_broker_received_bytes", "Bytes read from clients.", True),
            ("rpc_broker_sent_bytes", "Bytes written to clients.", True),
            ("rpc_broker_connections_shed", "Connections reset, those owed the most answers, when the answers "
             "owed on all connections passed max_outgoing_bytes.", True),
            ("rpc_broker_connections_send_timed_out", "Connections reset because their client took none of the "
             "answers sent to it for send_timeout.", True),
            ("rpc_broker_tls_handshakes_failed", "TLS handshakes that failed: a client certificate refused "
             "(tls_client_ca_file), a protocol or cipher the broker does not take, or no TLS at all.", True),
        )):  # fmt: skip
            make = _family_counter if counter else _family_gauge
            yield make(family, doc, ["transport"], (([t], row[i]) for t, row in sorted(by_transport.items())))
        # The bytes budgets over all connections together: each its bytes held, its limit and
        # what it refused. (family, doc) of each.
        budgets: list[tuple[Incoming | Outgoing, tuple[str, str], tuple[str, str], tuple[str, str]]] = []
        if self.frontends:
            budgets.append((
                self.frontends[0].incoming,  # (one for all the listeners)
                ("rpc_broker_incoming_bytes", "Bytes of requests still arriving (HTTP heads and bodies, NDJSON lines "
                 "not finished yet) or waiting to be dispatched, all connections together."),
                ("rpc_broker_incoming_capacity_bytes", "Bytes of requests still arriving or waiting the broker holds "
                 "before refusing more (max_incoming_bytes)."),
                ("rpc_broker_incoming_refused", "Requests refused while arriving: they would have taken the bytes "
                 "still arriving past max_incoming_bytes."),
            ))  # fmt: skip
        budgets.append((
            self.dispatcher.outgoing,
            ("rpc_broker_outgoing_bytes", "Bytes of answers owed and not yet taken by their clients, all "
             "connections together."),
            ("rpc_broker_outgoing_capacity_bytes", "Bytes of answers owed the broker holds before refusing more "
             "(max_outgoing_bytes)."),
            ("rpc_broker_outgoing_refused", "Answers refused (-32603): they would have taken the answers owed "
             "on all connections past max_outgoing_bytes."),
        ))  # fmt: skip
        for budget, (held, held_doc), (capacity, capacity_doc), (refused, refused_doc) in budgets:
            yield _family_gauge(held, held_doc, [], [([], budget.held)])
            yield _family_gauge(capacity, capacity_doc, [], [([], budget.limit)])
            yield _family_counter(refused, refused_doc, [], [([], budget.refused_total)])

    def _workers(self) -> Iterator[Metric]:
        pool = typing.cast("Pool", self.pool)
        states: dict[str, int] = {state: 0 for state in ("starting", "ready", "draining", "dead")}
        for w in pool.workers:
            states[w.state.value] += 1
        states["draining"] += len(pool.retiring)  # replaced by a reload, finishing their calls
        states["starting"] += len(pool.incoming)  # a reload's, until they all are ready
        states["starting"] += len(pool.replacements)  # a recycle's, until it takes its slot
        yield _family_gauge("rpc_broker_workers", "Worker slots by state.", ["state"], (([s], n) for s, n in states.items()))
        peers = pool.peers  # (--frontends N; new user, round 112: nothing showed how many served)
        yield _family_gauge("rpc_broker_frontends", "Front-end processes by state (serve --frontends N): serving, "
                            "starting (running, not serving yet: its workers not connected), down (waiting to "
                            "be started again); they add up to N.", ["state"],
                            (([s], n) for s, n in (peers.states() if peers else {"serving": 1, "starting": 0,
                                                                                  "down": 0}).items()))
        yield _family_counter("rpc_broker_frontend_restarts", "Front-end processes other than the first started "
                              "again, by why the one before ended: hung (killed as silent), never_served (exited "
                              "before it served), stopped (exit 0: a SIGTERM to it alone), killed (by another "
                              "signal), exited (with an error).", ["reason"],
                              (([r], n) for r, n in (peers.restarts if peers else _NO_FRONTEND_RESTARTS).items()))
        yield _family_counter(
            "rpc_broker_reloads", "Reloads (SIGHUP) by result: success (the new code serves) or failure "
            "(a new worker did not start; the old code serves on).", ["result"],
            (([result], n) for result, n in sorted(pool.reloads.items())),
        )  # fmt: skip
        yield _family_counter(
            "rpc_broker_worker_restarts", "Worker processes restarted, by reason.", ["reason"],
            (([reason], n) for reason, n in sorted({**_NO_RESTARTS, **pool.restarts_by_reason}.items())),
        )  # fmt: skip
        yield _family_counter(
            "rpc_broker_worker_recycles", "Workers recycled (replaced by a new process, ready before the old one"
            " drained), by reason: max_calls (max_calls_per_worker) or max_memory (max_worker_memory).", ["reason"],
            (([reason], n) for reason, n in sorted(pool.recycles.items())),
        )  # fmt: skip
        yield _family_counter(
            "rpc_broker_worker_recycle_failures", "Recycles whose replacement failed to start (the old worker"
            " serves on; the slot is tried again after a backoff).", [], [([], pool.recycle_failures)],
        )  # fmt: skip
        cpu = CounterMetricFamily(
            "rpc_broker_worker_cpu_seconds", "CPU (user + system) of the worker process in a slot; resets on restart.",
            labels=["slot"],
        )  # fmt: skip
        rss = GaugeMetricFamily(
            "rpc_broker_worker_resident_memory_bytes", "Resident memory of the worker process in a slot.",
            labels=["slot"],
        )  # fmt: skip
        alive: dict[int, psutil.Process] = {}
        for w in pool.workers:
            if not w.pid or w.process is None or w.process.returncode is not None:
                continue
            proc = self._processes.get(w.pid) or psutil.Process(w.pid)
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    resident = proc.memory_info().rss
            except psutil.Error:  # exited between the check and the read
                continue
            alive[w.pid] = proc
            cpu.add_metric([str(w.slot)], times.user + times.system)
            rss.add_metric([str(w.slot)], resident)
        self._processes = alive
        yield cpu
        yield rss

    def _event_loop(self) -> Iterator[Metric]:
        """The broker's event loop: its tasks (asyncio.all_tasks: not done) and its handles
        (callbacks and timers, `loop.call_soon`/`call_later`'s, not cancelled), counted for
        leaks (a soak's "no count may rise steadily", issue 11). No loop runs in this thread
        (a collector called outside the broker): neither family."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        yield _family_gauge("rpc_broker_event_loop_tasks", "Tasks of the front-end process's event loop not done.",
                            [], [([], len(asyncio.all_tasks(loop)))])
        now = time.monotonic()
        if not self._counting and (self._handles_at is None or now - self._handles_at >= HANDLES_EVERY_SECONDS):
            # (in a thread: on the loop, the walk stalled every client 100-170 ms with 8,000
            # connections held, hostile testing, round 112; in a thread the loop runs between
            # its GIL switches, and the scrape gives the last count finished)
            self._handles_at, self._counting = now, True
            loop.run_in_executor(None, live_handles).add_done_callback(self._counted)
        yield _family_gauge("rpc_broker_event_loop_handles", "Callbacks and timers of the front-end process's event "
                            f"loop not cancelled (counted in a thread at most once in {HANDLES_EVERY_SECONDS:g} s; "
                            "the last count finished, 0 before the first).", [], [([], self._handles)])

    def _counted(self, done: asyncio.Future[int]) -> None:
        """`live_handles`' count, from its thread, is the gauge's value from now on."""
        self._counting = False
        if not done.cancelled() and done.exception() is None:
            self._handles = done.result()


HANDLES_EVERY_SECONDS = 10.0
"""How often a scrape counts the event loop's handles (`live_handles` walks every object the
garbage collector tracks, ~1 ms per 10k objects, in a thread); the scrapes between give the last
count, so that a flood of scrapes costs no more walks."""

_HANDLE_TYPES: tuple[type, ...] = (
    asyncio.Handle, uvloop.loop.Handle, uvloop.loop.TimerHandle)  # type: ignore[attr-defined]
"""asyncio's Handle (TimerHandle is one) and uvloop's two, which are not subclasses of each other."""


def live_handles() -> int:
    """The event-loop handles alive in this process and not cancelled: pending callbacks and
    timers (the loop holds them), and any a program keeps after they ran. A count that rises
    steadily under a steady load is a leak of timers (each holds its callback's objects)."""
    return sum(1 for obj in gc.get_objects()
               if isinstance(obj, _HANDLE_TYPES) and not typing.cast("asyncio.Handle", obj).cancelled())


Flat = tuple[str, str, dict[str, str], float]
"""One series' sample as a peer sends it (`samples`): its family's name, the sample's name
(a histogram's `_bucket`, `_sum`, `_count`; a counter's `_total`), its labels, its value."""


def samples(collector: BrokerCollector) -> list[Flat]:
    """Every sample of `collector`'s families, flat (what a peer front-end sends: `add_samples`)."""
    return [(family.name, sample.name, dict(sample.labels), float(sample.value))
            for family in collector.collect() for sample in family.samples]


ACCUMULATED: typing.Final = ("_total", "_bucket", "_count", "_sum")  # counters' and histograms' samples


def add_samples(families: list[Metric], others: Iterable[list[Flat]],
                high: dict[tuple[str, tuple[tuple[str, str], ...]], float] | None = None) -> None:
    """Add each of `others`' samples (the peers' `samples`) to the series of `families` with
    the same family, sample name and labels, or as a new series of that family; a family
    `families` does not have is left out (the first front-end's view decides which exist).
    With `high` (kept from one call to the next), a counter's or histogram's sum is never
    less than the last it gave: the same counts added in another order may differ in the last
    bit, and a dead peer's counts move to the end of `others` (hostile testing, round 130: a
    `_sum` 342.13013300000006 then 342.130133, which Prometheus reads as a reset). O(samples)."""
    by_name = {family.name: family for family in families}
    at: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}  # a sample's place in its family's list
    touched: dict[tuple[str, tuple[tuple[str, str], ...]], Metric] = {}  # the sums made here, by key
    for family in families:
        for i, sample in enumerate(family.samples):
            at[(sample.name, tuple(sorted(sample.labels.items())))] = i
    for flat in others:
        for family_name, name, labels, value in flat:
            found = by_name.get(family_name)
            if found is None:
                continue
            key = (name, tuple(sorted(labels.items())))
            touched[key] = found
            place = at.get(key)
            if place is None:
                at[key] = len(found.samples)
                found.add_sample(name, labels, value)
            else:
                sample = found.samples[place]
                found.samples[place] = sample._replace(value=sample.value + value)
    if high is None:
        return
    for key, family in touched.items():
        if key[0].endswith(ACCUMULATED):
            place = at[key]
            sample = family.samples[place]
            last = high.get(key, 0.0)
            if sample.value < last:
                family.samples[place] = sample._replace(value=last)
            else:
                high[key] = sample.value


def registry(collector: BrokerCollector) -> CollectorRegistry:
    """A registry with the broker's collector and prometheus-client's process, platform
    and GC collectors for the front-end process itself (process_*, python_*)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    """The text exposition of everything in `reg` (what GET /metrics answers)."""
    return generate_latest(reg)
