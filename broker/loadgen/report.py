"""Turning process results into a `Report`, the final table and the live progress line."""

from __future__ import annotations

import typing

from rich.console import Console
from rich.table import Table
from rich.text import Text

from broker.loadgen.check import Tally
from broker.loadgen.runner import ProcessResult, Progress, Spec, Target
from broker.loadgen.stats import SCHEMA, Check, Latency, LatencyMs, Report

__all__ = ["build_report", "merge", "print_table", "progress_text"]


def merge(results: typing.Sequence[ProcessResult]) -> tuple[Tally, Latency, int, float]:
    """Add the processes' tallies and histograms: (tally, histogram, unsent, drain s)."""
    tally = Tally()
    hist = Latency()
    unsent = 0
    drain = 0.0
    problem = ""
    for r in results:
        tally.add(r.tally())
        hist.add(Latency(r.histogram))
        unsent += r.unsent
        drain = max(drain, r.drain_s)
        problem = problem or r.first_problem
    tally.first_problem = problem
    return tally, hist, unsent, drain


def build_report(spec: Spec, tally: Tally, hist: Latency, drain: float = 0.0, unsent: int = 0) -> Report:
    """The ``rpc-broker-bench/1`` record of a run. Rates are over the measured window
    plus the drain after it (`drain` s, the longest of the processes'), since answers
    to requests of the window still arrive then: in an open loop past the server's
    capacity that drain is long, and the rate is what the server really managed.
    `unsent`: open-loop requests that were due but never sent."""
    duration = spec.duration + drain
    failures = tally.failures
    p = hist.percentiles_ms([50.0, 90.0, 99.0, 99.9])
    return Report(
        schema=SCHEMA,
        target=Target.parse(spec.target).url,
        mode="closed" if spec.rate is None else "open",
        connections=spec.connections,
        depth=max(spec.depth, spec.pipeline),
        rate=spec.rate,
        batch=spec.batch,
        processes=spec.processes,
        duration_s=float(spec.duration),
        warmup_s=float(spec.warmup),
        requests=tally.requests,
        calls=tally.calls,
        requests_per_s=tally.requests / duration if duration > 0 else 0.0,
        calls_per_s=tally.calls / duration if duration > 0 else 0.0,
        errors_by_code={str(k): v for k, v in sorted(tally.errors_by_code.items())},
        transport_errors=tally.transport_errors,
        refused_batches=tally.refused_batches,
        unsent_requests=unsent,
        check=Check(tally.wrong_id, tally.missing, tally.duplicate, tally.malformed, failures == 0),
        latency_ms=LatencyMs(p[50.0], p[90.0], p[99.0], p[99.9], hist.max_ms, hist.mean_ms),
        percentiles=hist.curve(),
    )


def progress_text(p: Progress, elapsed: float) -> Text:
    """The one-line live status: elapsed s, calls/s so far, errors, failures, p99."""
    rate = p.calls / elapsed if elapsed > 0 else 0.0
    style = "bold red" if p.failures or p.transport_errors else ""
    line = (f"{elapsed:6.1f} s  {rate:12,.0f} calls/s  errors {p.errors:,}  "
            f"check failures {p.failures:,}  transport errors {p.transport_errors:,}")
    if p.p99_ms:
        line += f"  p99 {p.p99_ms:.3f} ms"
    return Text(line, style=style)


LABEL_WIDTH = 16  # len("transport errors"), the longest label: never wrapped


def print_table(report: Report, console: Console, first_problem: str = "") -> None:
    """Print the final summary of a run (with the first problem's words, if any).

    Readable at 80 columns, in a terminal or a pipe: labels never wrap, and each
    value is laid out in lines of at most ~60 characters (the load and the
    latencies take two lines), so that a figure is never split; only free text (the
    first problem, a long list of error codes) wraps, inside the value column.
    """
    t = Table(title=f"rpc-broker bench: {report.target}", title_justify="left", show_header=False,
              box=None, padding=(0, 1), pad_edge=False)
    t.add_column(style="bold", no_wrap=True, min_width=LABEL_WIDTH)
    t.add_column(overflow="fold")
    load = (f"closed loop, {report.connections} connections x depth {report.depth}"
            if report.mode == "closed"
            else f"open loop at {report.rate:,.0f} req/s, {report.connections} connections")
    t.add_row("load", f"{load}, batch {report.batch}\n{report.processes} "
              f"{'process' if report.processes == 1 else 'processes'}, "
              f"{report.duration_s:g} s measured after {report.warmup_s:g} s warm-up")
    t.add_row("requests/s", f"{report.requests_per_s:,.1f}  ({report.requests:,} requests)")
    t.add_row("calls/s", f"{report.calls_per_s:,.1f}  ({report.calls:,} calls)")
    errors = ", ".join(f"{code}: {n:,}" for code, n in report.errors_by_code.items()) or "none"
    t.add_row("JSON-RPC errors", errors)
    if report.refused_batches:
        t.add_row("refused batches", Text(
            f"{report.refused_batches:,} (each answered by one error for the whole\n"
            "batch: its calls did not run, and calls/s leaves them out)", style="yellow"))
    c = report.check
    bad = "green" if c.ok else "bold red"
    t.add_row("check failures", Text(f"wrong id {c.wrong_id:,}, missing {c.missing:,}, duplicate "
                                     f"{c.duplicate:,}, malformed {c.malformed:,}", style=bad))
    t.add_row("transport errors", Text(f"{report.transport_errors:,}",
                                       style="bold red" if report.transport_errors else "green"))
    if first_problem:
        t.add_row("first problem", Text(first_problem, style="bold red"))
    if report.unsent_requests:
        t.add_row("never sent", Text(f"{report.unsent_requests:,} scheduled requests "
                                     "(the server could not keep up)", style="yellow"))
    lat = report.latency_ms
    if report.requests:
        t.add_row("latency ms", f"p50 {lat.p50:.3f}  p90 {lat.p90:.3f}  p99 {lat.p99:.3f}\n"
                  f"p99.9 {lat.p99_9:.3f}  max {lat.max:.3f}  mean {lat.mean:.3f}")
    else:
        t.add_row("latency ms", "n/a (no answer was measured)")
    console.print(t)
