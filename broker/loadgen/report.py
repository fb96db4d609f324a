"""Turning process results into a `Report`, the final table and the live progress line."""

from __future__ import annotations

import typing

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from broker.loadgen.check import Tally
from broker.loadgen.stats import SCHEMA, Check, Latency, LatencyMs, McpRun, Report, RunWorkload, WorkloadCall
from broker.loadgen.target import ProcessResult, Progress, Spec, Target

__all__ = ["build_report", "mcp_text", "merge", "print_table", "progress_text", "tool_errors_text"]


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


def _workload(spec: Spec, mix: str | None) -> RunWorkload:
    calls = [WorkloadCall(c.method, None if c.params is None else msgspec.json.decode(c.params),
                          c.weight, c.notification) for c in spec.calls]
    return RunWorkload(mix, calls)


BEHIND_SHARE = 0.01
"""An open loop's load generator fell behind when it was late itself (`connection.LATE_S`, with room on the
connection) for, or never sent, this share or more of the window's scheduled requests."""


def build_report(spec: Spec, tally: Tally, hist: Latency, drain: float = 0.0, unsent: int = 0,
                 mix: str | None = None, sent: int = 0, behind: int = 0) -> Report:
    """The ``rpc-broker-bench/1`` record of a run. Rates are over the measured window
    plus the drain after it (`drain` s, the longest of the processes'), since answers
    to requests of the window still arrive then: in an open loop past the server's
    capacity that drain is long, and the rate is what the server really managed.
    `unsent`: open-loop requests that were due but never sent. `mix`: the --mix file
    the calls came from (recorded with them), None for --method/--params. `sent`,
    `behind`: open loop, the window's requests sent, and those the load processes were
    late for themselves (`ProcessResult.behind`): past `BEHIND_SHARE` of the schedule,
    the generator fell behind the offered rate (wrk2's and h2load's caveat: the figures
    then measure the generator)."""
    duration = spec.duration + drain if spec.duration > 0 else 0.0  # 0: interrupted in the warm-up
    failures = tally.failures
    open_loop = spec.rate is not None and spec.duration > 0
    scheduled = sent + unsent
    return Report(
        schema=SCHEMA,
        target=Target.parse(spec.target).url,
        mode="closed" if spec.rate is None else "open",
        connections=spec.connections,
        depth=max(spec.depth, spec.pipeline),
        pipeline=spec.pipeline,
        rate=spec.rate,
        batch=spec.batch,
        processes=spec.processes,
        duration_s=float(spec.duration),
        warmup_s=float(spec.warmup),
        timeout_s=float(spec.timeout),
        ids=spec.ids,
        seed=spec.seed,
        workload=_workload(spec, mix),
        requests=tally.requests,
        calls=tally.calls,
        calls_counted="answered",
        requests_per_s=tally.requests / duration if duration > 0 else 0.0,
        calls_per_s=tally.calls / duration if duration > 0 else 0.0,
        errors_by_code={str(k): v for k, v in sorted(tally.errors_by_code.items())},
        transport_errors=tally.transport_errors,
        resent=tally.resent,
        refused_batches=tally.refused_batches,
        unsent_requests=unsent,
        sent_per_s=sent / spec.duration if open_loop else None,
        generator_behind=open_loop and behind > 0 and behind >= BEHIND_SHARE * scheduled,
        generator_late_requests=behind,
        check=Check(tally.wrong_id, tally.missing, tally.duplicate, tally.malformed, failures == 0),
        latency_ms=LatencyMs.of(hist),
        percentiles=hist.curve(),
        mcp=None if spec.mcp is None else McpRun(
            era=spec.mcp, protocol_version=tally.protocol_version, initialized=tally.initialized,
            sessions=tally.sessions, tool_errors=dict(sorted(tally.tool_errors.items(), key=lambda kv: -kv[1]))),
    )


PROGRESS_WIDTH = 79  # the live line never wraps in an 80-column terminal


def progress_line(p: Progress, elapsed: float) -> str:
    """The live status as plain text, at most `PROGRESS_WIDTH` characters: elapsed s,
    calls answered per s so far, JSON-RPC errors, check failures, transport errors,
    p99. Shorter words (then no p99) when the figures grow too long for the line."""
    rate = p.calls / elapsed if elapsed > 0 else 0.0
    head = f"{elapsed:6.1f} s  {rate:,.0f} calls/s"
    p99 = f"  p99 {p.p99_ms:.3f} ms" if p.p99_ms else ""
    forms = (
        f"{head}  errors {p.errors:,}  check failures {p.failures:,}  "
        f"transport errors {p.transport_errors:,}{p99}",
        f"{head}  errors {p.errors:,}  failures {p.failures:,}  transport {p.transport_errors:,}{p99}",
        f"{head}  err {p.errors:,}  fail {p.failures:,}  lost {p.transport_errors:,}{p99}",
        f"{head}  err {p.errors:,}  fail {p.failures:,}  lost {p.transport_errors:,}",
    )
    for line in forms:
        if len(line) <= PROGRESS_WIDTH:
            return line
    return forms[-1][:PROGRESS_WIDTH]


def progress_text(p: Progress, elapsed: float) -> Text:
    """`progress_line`, in red once a check failure or a transport error was seen."""
    style = "bold red" if p.failures or p.transport_errors else ""
    return Text(progress_line(p, elapsed), style=style)


# Error codes that say the server turned the load itself away, not the calls: the run measured
# how fast it refuses. (Only these two: -32005 is "limit exceeded" in EIP-1474 too, while other
# JSON-RPC servers give -32001..-32004 meanings of their own; -32000 is rpc-broker's overloaded,
# and many a server's generic error, hence "on rpc-broker".)
_REFUSING = {  # (lines of at most ~60 characters: `print_table`)
    "-32005": "most calls were rate limited (-32005): the server's\n"
              "rate_limit for this caller (its token, or its address) is\n"
              "below the load: lower --rate (or --connections, --depth),\n"
              "or raise the limit",
    "-32000": "most calls were answered -32000 (on rpc-broker: server\n"
              "overloaded, its queue full): lower --rate (or\n"
              "--connections, --depth), or give it more workers",
}


def mostly_refused(report: Report) -> str:
    """Words for a run more than half of whose calls were refused by the load itself, with one
    code of `_REFUSING` (new user, round 109: 35,646 of 35,651 rate limited read as a fast
    run); "" otherwise. Calls: `Report.calls` plus its batches refused whole (one error each)."""
    answered = report.calls + report.refused_batches
    for code, words in _REFUSING.items():
        if 2 * report.errors_by_code.get(code, 0) > answered > 0:
            return words
    return ""


def _n(count: int, word: str) -> str:
    """``1 request``, ``2 requests``, ``12,000 requests``."""
    return f"{count:,} {word}" if count == 1 else f"{count:,} {word}s"


def _all_notifications(report: Report) -> bool:
    return report.workload is not None and all(c.notification for c in report.workload.calls)


def _stream(report: Report) -> bool:
    """An NDJSON target: a body of only notifications gets no line (done once written)."""
    return report.target.startswith(("tcp://", "unix://"))


LABEL_WIDTH = 16  # len("transport errors"), the longest label: never wrapped


def workload_line(workload: RunWorkload) -> str:
    """What a run sent, in a line for the table: `--mix FILE: add x3, update
    (notification)` (a weight other than 1 after an x), or the one call of
    --method/--params, its params cut at 40 characters."""
    def name(call: WorkloadCall) -> str:
        text = f"{call.method} (notification)" if call.notification else call.method
        return text if call.weight == 1 else f"{text} x{call.weight:g}"

    if workload.mix is not None:
        return f"--mix {workload.mix}: " + ", ".join(name(c) for c in workload.calls)
    [call] = workload.calls
    params = "" if call.params is None else msgspec.json.encode(call.params).decode()
    params = params if len(params) <= 40 else params[:39] + "…"
    return f"{call.method}({params})" + (" as notifications" if call.notification else "")


def mcp_text(run: McpRun) -> Text:
    """The table's MCP row: the era, the version the calls carried, the handshakes."""
    if run.era == "modern":
        return Text(f"{run.protocol_version}, stateless: each tools/call carries _meta\n"
                    "and MCP-Protocol-Version, Mcp-Method, Mcp-Name headers")
    if not run.initialized:
        return Text("2025-11-25: no initialize handshake completed\n(see the first problem)", style="bold red")
    return Text(f"{run.protocol_version} after initialize: {_n(run.initialized, 'handshake')}\n"
                f"(one per connection made), {run.sessions:,} with an Mcp-Session-Id")


def tool_errors_text(run: McpRun, calls: int) -> Text:
    """The table's "tool errors" row: CallToolResults with isError true, by reason."""
    total = sum(run.tool_errors.values())
    if not total:
        return Text("none")
    lines = "\n".join(f"{n:,}: {reason}" for reason, n in run.tool_errors.items())
    if total >= calls:
        lines += ("\nevery call was answered isError: check --tool and --arguments\n"
                  "(tool errors are answers: the exit status stays 0)")
    return Text(lines, style="yellow")


def print_table(report: Report, console: Console, first_problem: str = "", unauthorized: int = 0) -> None:
    """Print the final summary of a run (with the first problem's words, if any;
    `unauthorized`: answers that refused the run's token, `Tally.unauthorized`).

    Readable at 80 columns, in a terminal or a pipe: labels never wrap, and each
    value is laid out in lines of at most ~60 characters (the load and the
    latencies take two lines), so that a figure is never split; only free text (the
    first problem, a long list of error codes) wraps, inside the value column.
    """
    t = Table(title=f"rpc-broker bench: {report.target}", title_justify="left", show_header=False,
              box=None, padding=(0, 1), pad_edge=False)
    t.add_column(style="bold", no_wrap=True, min_width=LABEL_WIDTH)
    t.add_column(overflow="fold")
    load = (f"closed loop, {_n(report.connections, 'connection')} x depth {report.depth}"
            if report.mode == "closed"
            else f"open loop at {report.rate:,.0f} req/s offered"
            + (f" ({report.sent_per_s:,.0f} sent)" if report.sent_per_s is not None else "")
            + f", {_n(report.connections, 'connection')}")
    processes = f"{report.processes:,} {'process' if report.processes == 1 else 'processes'}"
    t.add_row("load", f"{load}, batch {report.batch}\n{processes}, "
              f"{report.duration_s:g} s measured after {report.warmup_s:g} s warm-up")
    if report.workload is not None:  # (a new user, round 76: the table did not say what ran)
        t.add_row("workload", Text(workload_line(report.workload)))  # (Text: no markup in it)
    if report.mcp is not None:
        t.add_row("MCP", mcp_text(report.mcp))
    if report.processes_lost:
        t.add_row("processes lost", Text(
            f"{report.processes_lost:,} of {report.processes:,} load processes died: the figures\n"
            "below miss what they sent and measured", style="bold red"))
    notifications = _all_notifications(report)
    if notifications and _stream(report):  # no line answers them: the rates are of bodies written
        t.add_row("requests/s", f"{report.requests_per_s:,.1f}  ({_n(report.requests, 'request')} "
                  "written;\nnotifications only: no answer is expected)")
        t.add_row("calls/s", f"{report.calls_per_s:,.1f}  ({_n(report.calls, 'notification')} written)")
    elif notifications:  # HTTP answers each body with an empty 204 (its latency is measured)
        t.add_row("requests/s", f"{report.requests_per_s:,.1f}  ({_n(report.requests, 'request')} "
                  "answered,\nempty: notifications only)")
        t.add_row("calls/s", f"{report.calls_per_s:,.1f}  ({_n(report.calls, 'notification')})")
    elif report.duration_s <= 0:  # interrupted in the warm-up: no rate to give
        t.add_row("requests/s", f"n/a (0 s measured; {_n(report.requests, 'request')} answered)")
        t.add_row("calls/s", f"n/a (0 s measured; {_n(report.calls, 'call')} answered)")
    else:
        t.add_row("requests/s", f"{report.requests_per_s:,.1f}  ({_n(report.requests, 'request')} answered)")
        t.add_row("calls/s", f"{report.calls_per_s:,.1f}  ({_n(report.calls, 'call')} answered)")
    errors = ", ".join(f"{code}: {n:,}" for code, n in report.errors_by_code.items()) or "none"
    if unauthorized and unauthorized >= report.requests:  # (not the hint below: --method was not the fault)
        t.add_row("JSON-RPC errors", Text(f"{errors}\nevery call was refused as unauthorized: no token, or\n"
                                          "one the server does not take (--token-file)", style="bold red"))
    elif unauthorized:
        t.add_row("JSON-RPC errors", Text(f"{errors}\n{unauthorized:,} refused as unauthorized", style="yellow"))
    elif refusing := mostly_refused(report):  # (before the next: --method was not the fault)
        t.add_row("JSON-RPC errors", Text(f"{errors}\n{refusing}\n(errors are answers: the exit status stays 0)",
                                          style="yellow"))
    elif report.calls and sum(report.errors_by_code.values()) >= report.calls:
        # (a new user's check, round 26: a mistyped --params measured 8,185 errors/s, all green)
        words = ("every call was answered with an error: check --method and --params" if report.mcp is None
                 else "every tools/call was answered -32601: is the URL an MCP\nendpoint (the broker's: /mcp)?"
                 if set(report.errors_by_code) == {"-32601"}  # (new user, round 111: --mcp at the JSON-RPC path)
                 else "every tools/call was answered with an error: check\n--tool and --arguments")
        t.add_row("JSON-RPC errors", Text(f"{errors}\n{words}\n(errors are answers: the exit status stays 0)",
                                          style="yellow"))
    else:
        t.add_row("JSON-RPC errors", errors)
    if report.mcp is not None:
        t.add_row("tool errors", tool_errors_text(report.mcp, report.calls))
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
    if report.resent:  # (new user, round 112: a front-end killed with calls in flight showed nothing)
        t.add_row("sent again", Text(f"{report.resent:,} requests, on a new connection: the server closed with "
                                     "them unanswered\n(not lost, but each may have run twice)", style="yellow"))
    if first_problem:
        t.add_row("first problem", Text(first_problem, style="bold red"))
    if report.generator_behind and report.rate is not None and report.sent_per_s is not None:
        t.add_row("load generator", Text(
            f"fell behind: sent {report.sent_per_s:,.0f} req/s of the {report.rate:,.0f}\n"
            f"offered; {report.generator_late_requests:,} requests were late (10 ms or more)\n"
            "or never sent with room on their connection: the rates\n"
            "and latencies measure the load generator, not the server\n"
            "(lower --rate, or add --processes)", style="bold red"))
    if report.unsent_requests:
        who = "the load generator fell behind" if report.generator_behind else "the server could not keep up"
        t.add_row("never sent", Text(f"{report.unsent_requests:,} scheduled requests ({who})", style="yellow"))
    lat = report.latency_ms
    if lat.p50 is not None and lat.p90 is not None and lat.p99 is not None and lat.p99_9 is not None \
            and lat.max is not None and lat.mean is not None:
        t.add_row("latency ms", f"p50 {lat.p50:.3f}  p90 {lat.p90:.3f}  p99 {lat.p99:.3f}\n"
                  f"p99.9 {lat.p99_9:.3f}  max {lat.max:.3f}  mean {lat.mean:.3f}")
    elif _all_notifications(report):
        t.add_row("latency ms", "n/a (notifications only: no answer to time)")
    else:
        t.add_row("latency ms", "n/a (no answer was measured)")
    if console.is_terminal:
        console.print(t)
        return
    with console.capture() as captured:  # (a pipe or a file: no line padded with spaces to the width)
        console.print(t)
    console.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    console.file.flush()
