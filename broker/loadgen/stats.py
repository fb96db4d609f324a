"""Latency histograms and the report schema ``rpc-broker-bench/1``.

`Latency` wraps an HdrHistogram (PyPI ``hdrhistogram``) of values in microseconds,
1 µs .. 60 s at 3 significant digits. Recording one value in hdrh costs ~2 µs of pure
Python, too much per request, so the hot path appends integer microseconds to a
list and `Latency.record_many` folds the list in, one `record_value` per distinct value.

`Report` is the JSON written by ``--json``; the benchmark runner reads it, so its
fields are fixed by the schema below (names, types, units):

    schema        "rpc-broker-bench/1"
    target        the URL driven
    mode          "closed" | "open"
    connections, depth, batch, processes: ints as run (depth: requests in flight
                  per connection, the larger of --depth and --pipeline)
    pipeline      --pipeline (closed loop: requests written back to back)
    rate          requests/s asked for (open loop), null for closed loop
    duration_s, warmup_s, timeout_s: seconds (--duration, --warmup, --timeout)
    ids           the --ids style; seed: the --seed of the mix draw
    workload      {"mix": the --mix file as given, or null for --method/--params;
                   "calls": [{"method", "params" (JSON array/object or null),
                   "weight", "notification"}, ...]}: what was sent
    requests      request bodies answered (a body of only notifications: written),
                  measured window only; a batch refused whole counts
    calls         calls answered, measured window only: each call that got its own
                  answer with its id, a result or a JSON-RPC error (an error with
                  "id": null to a single call included), plus the notifications
                  written in those bodies (never answered: done once written). Not
                  counted: calls whose answer is missing, has a wrong id or is
                  malformed, calls lost to the transport, and the calls of a batch
                  refused whole (none of them ran)
    calls_counted "answered" (the definition above); files written before this key
                  existed read "sent": their calls counted every call of an
                  answered body, missing answers included
    requests_per_s, calls_per_s: the above divided by duration_s plus the drain
    errors_by_code: {"<JSON-RPC code>": count}, one per error answer
    transport_errors: requests lost to resets, closes, timeouts, refused connects
    resent        HTTP requests sent again on a new connection after the server closed
                  with them unanswered between two answers: not lost, but each may have
                  run twice (absent from files written before it: 0)
    refused_batches: batches answered by one error object for the whole body (e.g.
                  past the server's batch limit), measured window only; each is
                  also one count in errors_by_code. Not a check failure.
    unsent_requests: open loop: requests that were due but never sent by the end of
                  the drain (the "never sent" of the table); 0 in closed loop
    check         {"wrong_id", "missing", "duplicate", "malformed": int, "ok": bool}
    latency_ms    {"p50", "p90", "p99", "p99.9", "max", "mean": float ms, or null
                  each when no latency was measured (no answer came back, or only
                  notifications were sent): never 0 standing for "nothing"}
    percentiles   [[percentile (0..100), ms in 0..1e12], ...] ascending: the plotted
                  curve; [] when no latency was measured

    interrupted   true when a signal (or a dead load process) stopped the run early:
                  duration_s is then the window really measured
    processes_lost: load processes that died (their counts are missing)
    mcp           null for a JSON-RPC run; for ``--mcp`` (workload's method: the tool,
                  params: its arguments): {"era": "modern" | "legacy",
                  "protocol_version": the version the calls carried ("" if none was
                  settled), "initialized": 2025-11-25 handshakes completed, "sessions":
                  those given an Mcp-Session-Id, "tool_errors": {"<reason>": count},
                  CallToolResults with isError true, measured window only (also counted
                  in calls: they are answers)}

mcp was added the same way (read as null).
refused_batches, unsent_requests and interrupted were added to version 1 without a new schema
name: they default to 0 (false) when read, so files written before them still load.
So were calls_counted (read as "sent"), pipeline, timeout_s, ids, seed and workload
(read as null: not recorded); and latency_ms figures became nullable (older files hold
floats there).
"""

from __future__ import annotations

import collections
import typing

import msgspec
from hdrh.histogram import HdrHistogram  # type: ignore[import-untyped]

__all__ = ["HIGHEST_US", "SCHEMA", "Check", "Latency", "LatencyMs", "McpRun", "Report", "RunWorkload",
           "WorkloadCall"]

SCHEMA: typing.Final = "rpc-broker-bench/1"
LOWEST_US = 1
HIGHEST_US = 60_000_000  # 60 s
DIGITS = 3


class Latency:
    """A latency histogram in microseconds (1 µs .. 60 s, 3 significant digits).

    encoded: an `encode()` result to start from (another process's histogram).
    Values above 60 s are recorded as 60 s; below 1 µs as 1 µs.
    """

    __slots__ = ("_h",)

    def __init__(self, encoded: bytes | None = None) -> None:
        if encoded is None:
            self._h = HdrHistogram(LOWEST_US, HIGHEST_US, DIGITS)
        else:
            self._h = HdrHistogram.decode(encoded)

    def record_many(self, values_us: list[int]) -> None:
        """Record every value of ``values_us`` (µs) and clear the list."""
        record = self._h.record_value
        for v, n in collections.Counter(values_us).items():
            record(min(max(v, LOWEST_US), HIGHEST_US), n)
        values_us.clear()

    def add(self, other: Latency) -> None:
        """Add ``other``'s counts into this histogram."""
        self._h.add(other._h)

    def encode(self) -> bytes:
        """The compressed, base64 HdrHistogram V2 encoding (for sending between processes)."""
        return bytes(self._h.encode())

    @property
    def count(self) -> int:
        """Number of recorded values."""
        return int(self._h.get_total_count())

    def percentile_ms(self, percentile: float) -> float:
        """Value at ``percentile`` (0..100) in milliseconds; 0.0 when empty."""
        if not self.count:
            return 0.0
        return int(self._h.get_value_at_percentile(percentile)) / 1000.0

    def percentiles_ms(self, percentiles: typing.Sequence[float]) -> dict[float, float]:
        """Several percentiles at once (one pass): {percentile: ms}."""
        if not self.count:
            return {p: 0.0 for p in percentiles}
        got = self._h.get_percentile_to_value_dict(list(percentiles))
        return {p: int(got[p]) / 1000.0 for p in percentiles}

    @property
    def max_ms(self) -> float:
        """Largest recorded value (ms, rounded up to the histogram's resolution)."""
        if not self.count:
            return 0.0
        return int(self._h.get_max_value()) / 1000.0

    @property
    def mean_ms(self) -> float:
        """Mean (ms)."""
        if not self.count:
            return 0.0
        return float(self._h.get_mean_value()) / 1000.0

    def curve(self, ticks_per_half_distance: int = 5) -> list[tuple[float, float]]:
        """The percentile curve [(percentile 0..100, ms), ...] as HdrHistogram's
        percentile iteration steps it (denser towards 100), ending at (100, max)."""
        if not self.count:
            return []
        out: list[tuple[float, float]] = []
        for item in self._h.get_percentile_iterator(ticks_per_half_distance):
            p = float(item.percentile_level_iterated_to)
            ms = int(item.value_iterated_to) / 1000.0
            if out and out[-1][0] == p:
                continue
            out.append((p, ms))
            if p >= 100.0:
                break
        if not out or out[-1][0] < 100.0:
            out.append((100.0, self.max_ms))
        return out


class Check(msgspec.Struct, forbid_unknown_fields=True):
    """Check failures of a run; ``ok`` is True when all four are zero."""

    wrong_id: int
    missing: int
    duplicate: int
    malformed: int
    ok: bool


# (An upper bound too: a finite latency near the float limit, 1.7e308 ms, overflowed the plot's
# axis arithmetic, a traceback; hostile testing, round 11. 1e12 ms is 31 years.)
Ms = typing.Annotated[float, msgspec.Meta(ge=0, le=1e12)]
Percentile = typing.Annotated[float, msgspec.Meta(ge=0, le=100)]


class LatencyMs(msgspec.Struct, forbid_unknown_fields=True):
    """Latency summary in milliseconds; every figure None when nothing was measured."""

    p50: Ms | None
    p90: Ms | None
    p99: Ms | None
    p99_9: Ms | None = msgspec.field(name="p99.9")
    max: Ms | None = None
    mean: Ms | None = None

    @classmethod
    def of(cls, hist: Latency) -> LatencyMs:
        """The summary of ``hist``; all None when it holds no value."""
        if not hist.count:
            return cls(None, None, None, None, None, None)
        p = hist.percentiles_ms([50.0, 90.0, 99.0, 99.9])
        return cls(p[50.0], p[90.0], p[99.0], p[99.9], hist.max_ms, hist.mean_ms)


class WorkloadCall(msgspec.Struct, forbid_unknown_fields=True):
    """One kind of call sent (one entry of the mix, or --method/--params)."""

    method: str
    params: list[object] | dict[str, object] | None
    weight: float = 1.0
    notification: bool = False


class RunWorkload(msgspec.Struct, forbid_unknown_fields=True):
    """What a run sent: the mix file (None for --method/--params) and its calls."""

    mix: str | None
    calls: list[WorkloadCall]


class McpRun(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The MCP side of a ``--mcp`` run (`Report.mcp`; see the module doc)."""

    era: typing.Literal["modern", "legacy"]
    protocol_version: str
    initialized: int
    sessions: int
    tool_errors: dict[str, int]


class Report(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One run, as written by ``--json`` (schema ``rpc-broker-bench/1``; see module doc)."""

    schema: typing.Literal["rpc-broker-bench/1"]
    target: str
    mode: typing.Literal["closed", "open"]
    connections: int
    depth: int
    pipeline: int | None = None  # absent from files written before it
    rate: float | None
    batch: int
    processes: int
    duration_s: float
    warmup_s: float
    timeout_s: float | None = None  # absent from files written before it
    ids: str | None = None  # absent from files written before it
    seed: int | None = None  # absent from files written before it
    workload: RunWorkload | None = None  # absent from files written before it
    requests: int
    calls: int
    calls_counted: typing.Literal["answered", "sent"] = "sent"  # "sent" in files written before it
    requests_per_s: float
    calls_per_s: float
    errors_by_code: dict[str, int]
    transport_errors: int
    resent: int = 0  # HTTP requests sent again after a close with them unanswered; absent from files before it
    refused_batches: int = 0  # absent from files written before it
    unsent_requests: int = 0  # absent from files written before it
    # Open loop: requests of the window sent per second of it, against `rate` offered (None: closed
    # loop, or a file written before it), and whether the load generator itself fell behind the
    # offered rate (`generator_late_requests`, its own late or never-sent ones, 1 % or more of
    # those scheduled): then the rates and latencies measure the generator, not the server
    sent_per_s: float | None = None
    generator_behind: bool = False
    generator_late_requests: int = 0
    check: Check
    latency_ms: LatencyMs
    percentiles: list[tuple[Percentile, Ms]]
    interrupted: bool = False  # stopped early by a signal; absent from files written before it
    processes_lost: int = 0  # load processes that died: their counts are missing; absent before it
    mcp: McpRun | None = None  # --mcp runs only; absent from files written before it

    def to_json(self) -> bytes:
        """The report as indented JSON text (UTF-8, trailing newline)."""
        return msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> Report:
        """Decode and validate a report; raises `msgspec.ValidationError` /
        `msgspec.DecodeError` if it does not follow the schema."""
        return msgspec.json.decode(data, type=cls)
