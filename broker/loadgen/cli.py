"""``rpc-broker bench``: command line of the load generator.

    rpc-broker bench URL [options]          drive a JSON-RPC server, check every answer
    rpc-broker bench plot A.json ... -o out.png

URL is ``http://host:port/path`` (HTTP/1.1 keep-alive, answers in request order) or a
newline-delimited JSON stream, ``tcp://host:port`` or ``unix:///path/to.sock`` (one
request body per line; answer lines may come in any order and are matched to their
request by id).

Exit codes: 0 every answer was right; 1 check failures or transport errors (or a load
process died); 2 bad usage (bad flags, mix file, target).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import typing
from pathlib import Path

from broker.loadgen.workload import ID_MODES, Call, MixError, load_mix

__all__ = ["build_parser", "build_plot_parser", "main"]

PROG = "rpc-broker bench"


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _non_negative(text: str) -> float:
    x = float(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return x


def _positive(text: str) -> float:
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``rpc-broker bench URL [options]``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="JSON-RPC 2.0 load generator that checks every answer (status, shape, "
        "byte-exact ids, one answer per call).\n\n"
        "Targets:\n"
        "  http://host:port/path   HTTP/1.1 keep-alive POSTs\n"
        "  tcp://host:port         newline-delimited JSON (NDJSON): one request body per line,\n"
        "  unix:///path/to.sock    one answer line per body, in any order: each line is matched\n"
        "                          to its request by id (a batch by its set of ids)\n\n"
        "Run '%(prog)s plot --help' to plot saved runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="URL",
                   help="http://host:port/path, tcp://host:port or unix:///path/to.sock (see above)")
    load = p.add_argument_group("load")
    load.add_argument("-c", "--connections", type=_positive_int, default=16, metavar="C",
                      help="connections in all (split across processes; default 16)")
    load.add_argument("-d", "--depth", type=_positive_int, default=1, metavar="D",
                      help="requests in flight per connection (default 1; >1 pipelines; on tcp:// "
                      "and unix:// the answers may overtake each other)")
    load.add_argument("--pipeline", type=_positive_int, default=1, metavar="N",
                      help="closed loop: write requests N at a time, back to back (implies depth >= N)")
    load.add_argument("-R", "--rate", type=_positive, default=None, metavar="R",
                      help="open loop: R requests/s in all, latency from each request's intended "
                      "send time (no coordinated omission); default: closed loop")
    load.add_argument("-P", "--processes", type=_positive_int, default=1, metavar="P",
                      help="load processes, each with its own uvloop loop (default 1)")
    load.add_argument("--duration", type=_positive, default=10.0, metavar="S",
                      help="measured seconds (default 10)")
    load.add_argument("--warmup", type=_non_negative, default=1.0, metavar="S",
                      help="seconds of load before measuring, not recorded (default 1)")
    load.add_argument("--timeout", type=_positive, default=30.0, metavar="S",
                      help="per request; a late answer counts as a transport error (default 30; "
                      "HTTP drops the connection, a stream gives up on that request alone)")
    work = p.add_argument_group("workload")
    work.add_argument("-m", "--method", default="add", help="method to call (default add)")
    work.add_argument("--params", default="[1,2]", metavar="JSON",
                      help="params as JSON text, array or object (default [1,2])")
    work.add_argument("--mix", metavar="FILE",
                      help="TOML ([[call]] tables) or JSON list of {method, params, weight, "
                      "notification}; replaces --method/--params")
    work.add_argument("-b", "--batch", type=_positive_int, default=1, metavar="N",
                      help="calls per request body (N >= 2 sends a JSON array; default 1)")
    work.add_argument("--ids", choices=ID_MODES, default="int",
                      help="id style: int, string, large (past 2**64, exponent floats), repeated "
                      "(one id per batch; answers matched as a multiset). Every id names one request "
                      "body of its connection, so all styles work on tcp:// and unix:// too")
    work.add_argument("--seed", type=int, default=0, help="seed of the mix draw (default 0)")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the run as JSON (schema rpc-broker-bench/1)")
    out.add_argument("-q", "--quiet", action="store_true",
                     help="no live progress line (also off when stdout is not a terminal)")
    return p


def build_plot_parser() -> argparse.ArgumentParser:
    """Parser of ``rpc-broker bench plot FILE... -o OUT``."""
    p = argparse.ArgumentParser(
        prog=f"{PROG} plot",
        description="Latency percentile curves of several --json runs on one chart (PNG).")
    p.add_argument("files", nargs="+", metavar="FILE", help="--json outputs of bench runs")
    p.add_argument("-o", "--output", required=True, metavar="PNG", help="image to write")
    p.add_argument("--title", help="chart title")
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2


def main(argv: list[str] | None = None) -> int:
    """Run ``rpc-broker bench`` with ``argv`` (the words after ``bench``); return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        ns = _parse(build_plot_parser(), argv[1:])
        if isinstance(ns, int):
            return ns
        return _plot(ns)
    ns = _parse(build_parser(), argv)
    if isinstance(ns, int):
        return ns
    return _bench(ns)


def _plot(ns: argparse.Namespace) -> int:
    from broker.loadgen.plot import PlotError, plot

    try:
        plot(ns.files, ns.output, ns.title)
    except ImportError as exc:  # matplotlib is the optional `plot` extra
        print(f"{PROG} plot: {exc}; install the plot extra: pip install 'rpc-broker[plot]'", file=sys.stderr)
        return 2
    except PlotError as exc:  # names the file (and the key) that is wrong
        print(f"{PROG} plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {ns.output}")
    return 0


def _bench(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from broker.loadgen import report as rep
    from broker.loadgen.runner import Progress, RunError, Spec, Target, run
    from broker.loadgen.workload import Workload

    try:
        calls = load_mix(ns.mix) if ns.mix else [Call(ns.method, ns.params)]
        Workload(calls, ns.batch, ns.ids)  # validate params before starting anything
        Target.parse(ns.target)
    except (MixError, RunError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if ns.json:  # find out now, not after the whole run
        parent = Path(ns.json).resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK) or Path(ns.json).is_dir():
            print(f"{PROG}: cannot write {ns.json}: not a writable file path", file=sys.stderr)
            return 2
    if ns.processes > ns.connections:
        print(f"{PROG}: --processes ({ns.processes}) must not exceed --connections "
              f"({ns.connections})", file=sys.stderr)
        return 2
    spec = Spec(target=ns.target, calls=calls, connections=ns.connections, depth=ns.depth,
                pipeline=ns.pipeline, rate=ns.rate, batch=ns.batch, ids=ns.ids,
                processes=ns.processes, duration=ns.duration, warmup=ns.warmup, timeout=ns.timeout,
                seed=ns.seed)
    console = Console()
    live_on = console.is_terminal and not ns.quiet
    started = time.monotonic()
    live: Live | None = Live(console=console, auto_refresh=False, transient=True) if live_on else None
    on_progress: typing.Callable[[Progress], None] | None = None
    if live is not None:
        shown = live

        def on_progress(p: Progress) -> None:
            shown.update(rep.progress_text(p, time.monotonic() - started), refresh=True)

    try:
        if live is not None:
            live.start()
        try:
            results = run(spec, on_progress, want_p99=live is not None)
        finally:
            if live is not None:
                live.stop()
    except RunError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    tally, hist, unsent, drain = rep.merge(results)
    report = rep.build_report(spec, tally, hist, drain, unsent)
    if not ns.quiet or not ns.json:
        rep.print_table(report, console, tally.first_problem)
    if ns.json:
        try:
            Path(ns.json).write_bytes(report.to_json())
        except OSError as exc:
            print(f"{PROG}: cannot write {ns.json}: {exc}", file=sys.stderr)
            return 2
    if not (report.check.ok and report.transport_errors == 0):
        print(f"{PROG}: failed; first problem: {tally.first_problem or 'see the table'}", file=sys.stderr)
        return 1
    return 0
