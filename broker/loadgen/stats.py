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
    connections, depth, batch, processes: ints as run
    rate          requests/s asked for (open loop), null for closed loop
    duration_s, warmup_s: seconds
    requests, calls: answered request bodies / calls answered in them, measured
                  window only (a batch refused whole is a request with no calls)
    requests_per_s, calls_per_s: the above divided by duration_s
    errors_by_code: {"<JSON-RPC code>": count}, one per error answer
    transport_errors: requests lost to resets, closes, timeouts, refused connects
    refused_batches: batches answered by one error object for the whole body (e.g.
                  past the server's batch limit), measured window only; each is
                  also one count in errors_by_code. Not a check failure.
    unsent_requests: open loop: requests that were due but never sent by the end of
                  the drain (the "never sent" of the table); 0 in closed loop
    check         {"wrong_id", "missing", "duplicate", "malformed": int, "ok": bool}
    latency_ms    {"p50", "p90", "p99", "p99.9", "max", "mean": float ms}
    percentiles   [[percentile (0..100), ms], ...] ascending: the plotted curve

refused_batches and unsent_requests were added to version 1 without a new schema
name: they default to 0 when read, so files written before them still load.
"""

from __future__ import annotations

import collections
import typing

import msgspec
from hdrh.histogram import HdrHistogram  # type: ignore[import-untyped]

__all__ = ["HIGHEST_US", "SCHEMA", "Check", "Latency", "LatencyMs", "Report"]

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


class LatencyMs(msgspec.Struct, forbid_unknown_fields=True):
    """Latency summary in milliseconds."""

    p50: float
    p90: float
    p99: float
    p99_9: float = msgspec.field(name="p99.9")
    max: float = 0.0
    mean: float = 0.0


class Report(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One run, as written by ``--json`` (schema ``rpc-broker-bench/1``; see module doc)."""

    schema: typing.Literal["rpc-broker-bench/1"]
    target: str
    mode: typing.Literal["closed", "open"]
    connections: int
    depth: int
    rate: float | None
    batch: int
    processes: int
    duration_s: float
    warmup_s: float
    requests: int
    calls: int
    requests_per_s: float
    calls_per_s: float
    errors_by_code: dict[str, int]
    transport_errors: int
    refused_batches: int = 0  # absent from files written before it
    unsent_requests: int = 0  # absent from files written before it
    check: Check
    latency_ms: LatencyMs
    percentiles: list[tuple[float, float]]

    def to_json(self) -> bytes:
        """The report as indented JSON text (UTF-8, trailing newline)."""
        return msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> Report:
        """Decode and validate a report; raises `msgspec.ValidationError` /
        `msgspec.DecodeError` if it does not follow the schema."""
        return msgspec.json.decode(data, type=cls)
