"""``rpc-broker bench``: command line of the load generator.

    rpc-broker bench URL [options]          drive a JSON-RPC server, check every answer
    rpc-broker bench plot A.json ... -o out.png

URL is ``http://host:port/path`` (HTTP/1.1 keep-alive, answers in request order) or a
newline-delimited JSON stream, ``tcp://host:port`` or ``unix:///path/to.sock`` (one
request body per line; answer lines may come in any order and are matched to their
request by id). With ``--mcp``, URL is an MCP server's Streamable HTTP endpoint, driven
with ``tools/call`` of ``--tool`` and ``--arguments`` (`broker.loadgen.mcp`).

Exit codes: 0 every answer was right (error answers too, a run mostly rate limited:
`report.mostly_refused`); 1 check failures or transport errors (or nothing of the measured
window was answered, every call was refused as unauthorized, a load process died, or --json
could not be written after the run); 2 bad usage (bad flags, mix file, --token-file,
target); 130 / 143 interrupted by SIGINT / SIGTERM (the table of what was measured is still
printed, and --json written).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import typing
import urllib.parse
from pathlib import Path

from broker.auth import B64TOKEN
from broker.loadgen.target import MCP_ERAS, McpEra
from broker.loadgen.workload import ID_MODES, Call, MixError, load_mix

__all__ = ["build_parser", "build_plot_parser", "main"]

PROG = "rpc-broker bench"


def _whole(text: str, low: int, high: int, what: str) -> int:
    """``text`` as an int in [low, high]; ArgumentTypeError otherwise (argparse prefixes the
    flag: "argument -c/--connections: not a whole number: 'inf'")."""
    try:
        n = int(text)
    except ValueError:  # inf, nan, 1e400, 2.5, a word, or more digits than int() reads
        raise argparse.ArgumentTypeError(f"not a whole number: {text[:40]!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"must be >= {low:,}, got {text}")
    if n > high:
        raise argparse.ArgumentTypeError(f"must be <= {high:,}{what}, got {text[:40]}")
    return n


# Upper bounds of the counts: far past a useful load, low enough that the memory a run
# builds up front (one protocol object per connection, `depth` request bodies and their
# expected ids per connection) cannot take the machine down; see also MAX_CALLS_IN_FLIGHT.
MAX_CONNECTIONS = 100_000  # also at most what RLIMIT_NOFILE allows (checked after parsing)
MAX_DEPTH = 4_096  # --depth and --pipeline: requests in flight per connection
MAX_BATCH = 100_000  # calls per request body
MAX_CALLS_IN_FLIGHT = 2_000_000  # connections x depth x batch (a few hundred bytes each)
PROCESSES_PER_CPU = 4  # --processes at most 4 x os.cpu_count(): more only adds contention
MAX_PROCESSES = PROCESSES_PER_CPU * (os.cpu_count() or 1)
FD_RESERVE = 64  # descriptors a load process needs besides its connections (pipes, loop, std streams)
MIN_DURATION = 0.01  # s: --duration below it measures nothing but the clock
SEED_LOW, SEED_HIGH = -(2**63), 2**64 - 1  # what msgpack carries to the load processes


def _connections(text: str) -> int:
    return _whole(text, 1, MAX_CONNECTIONS, "")


def _depth(text: str) -> int:
    return _whole(text, 1, MAX_DEPTH, " requests in flight per connection")


def _batch(text: str) -> int:
    return _whole(text, 1, MAX_BATCH, " calls per request body")


def _processes(text: str) -> int:
    return _whole(text, 1, MAX_PROCESSES, f" ({PROCESSES_PER_CPU} per CPU, {os.cpu_count() or 1} CPUs)")


def _seed(text: str) -> int:
    return _whole(text, SEED_LOW, SEED_HIGH, "")


MAX_RATE = 10_000_000.0  # requests/s: --rate; far past what one machine can send
MAX_SECONDS = 86_400.0  # one day: --duration, --warmup, --timeout


def _number(text: str, low: float, low_ok: bool, high: float, unit: str) -> float:
    """``text`` as a finite float in (low or [low, high]; ArgumentTypeError otherwise
    (inf and nan included: a run must end, and a schedule must be countable)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    if not (x >= low if low_ok else x > low):
        raise argparse.ArgumentTypeError(f"must be {'>=' if low_ok else '>'} {low:g}, got {text}")
    if x > high:
        raise argparse.ArgumentTypeError(f"must be <= {high:,.0f} {unit}, got {text}")
    return x


def _seconds(text: str) -> float:
    return _number(text, 0.0, False, MAX_SECONDS, "s (one day)")


def _duration(text: str) -> float:
    return _number(text, MIN_DURATION, True, MAX_SECONDS, "s (one day)")


def _seconds_or_0(text: str) -> float:
    return _number(text, 0.0, True, MAX_SECONDS, "s (one day)")


def _rate(text: str) -> float:
    return _number(text, 0.0, False, MAX_RATE, "requests/s")


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``rpc-broker bench URL [options]``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,  # (`--dur 5` is refused as unknown, not guessed, as by `serve`: round 27)
        description="JSON-RPC 2.0 load generator that checks every answer (status, shape, "
        "byte-exact ids, one answer per call).\n\n"
        "Targets:\n"
        "  http://host:port/path   HTTP/1.1 keep-alive POSTs\n"
        "  tcp://host:port         newline-delimited JSON (NDJSON): one request body per line,\n"
        "  unix:///path/to.sock    one answer line per body, in any order: each line is matched\n"
        "                          to its request by id (a batch by its set of ids)\n"
        "  --mcp http://host:port/mcp  an MCP server's Streamable HTTP endpoint: tools/call\n"
        "                          of --tool with --arguments, 2026-07-28 or (--mcp-era\n"
        "                          legacy) 2025-11-25 after initialize; JSON or SSE answers\n\n"
        "Run '%(prog)s plot --help' to plot saved runs.",
        epilog="A run lasts up to --warmup + --duration + --timeout (plus connecting): after the\n"
        "measured window it waits up to --timeout for the answers still owed.\n\n"
        "Exit codes:\n"
        "  0        every answer was checked and right (JSON-RPC errors are answers too,\n"
        "           and so are MCP tool results with isError true: a run mostly rate\n"
        "           limited or overloaded says so in its table)\n"
        "  1        a check failed (wrong id, missing, duplicate, malformed answer), a\n"
        "           transport error, nothing of the window was answered, every call was\n"
        "           refused as unauthorized (no --token-file, or a token the server does\n"
        "           not take), a load process died, or --json could not be written\n"
        "  2        bad usage: bad flags, mix file, --token-file, target or --json path\n"
        "  130/143  interrupted by SIGINT/SIGTERM (the table of what was measured is printed)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="URL",
                   help="http://host:port/path, tcp://host:port or unix:///path/to.sock (see above)")
    load = p.add_argument_group("load")
    load.add_argument("-c", "--connections", type=_connections, default=16, metavar="C",
                      help="connections in all (split across processes; default 16; at most 100,000 "
                      "and what the open-files limit allows)")
    load.add_argument("-d", "--depth", type=_depth, default=1, metavar="D",
                      help="requests in flight per connection (default 1, at most 4,096; >1 pipelines; on tcp:// "
                      "and unix:// the answers may overtake each other)")
    load.add_argument("--pipeline", type=_depth, default=None, metavar="N",
                      help="closed loop: write requests N at a time, back to back (implies depth >= N; "
                      "at most 4,096); "
                      "refused with --rate, where each request goes out when it is due")
    load.add_argument("-R", "--rate", type=_rate, default=None, metavar="R",
                      help="open loop: R requests/s in all (at most 10,000,000), latency from each "
                      "request's intended send time (no coordinated omission); default: closed loop")
    load.add_argument("-P", "--processes", type=_processes, default=1, metavar="P",
                      help="load processes, each with its own uvloop loop (default 1; at most 4 per CPU)")
    load.add_argument("--duration", type=_duration, default=10.0, metavar="S",
                      help="measured seconds (default 10; at least 0.01, at most 86400)")
    load.add_argument("--warmup", type=_seconds_or_0, default=1.0, metavar="S",
                      help="seconds of load before measuring, not recorded (default 1; at most 86400)")
    load.add_argument("--timeout", type=_seconds, default=30.0, metavar="S",
                      help="per request; a late answer counts as a transport error (default 30; at "
                      "most 86400; HTTP drops the connection, a stream gives up on that request "
                      "alone). After --duration the run waits up to --timeout for the answers "
                      "still owed, so a run lasts up to --warmup + --duration + --timeout")
    work = p.add_argument_group("workload")
    work.add_argument("-m", "--method", default=None, help="method to call (default add)")
    work.add_argument("--params", default=None, metavar="JSON",
                      help="params as JSON text, array or object (default [1,2])")
    work.add_argument("--mix", metavar="FILE",
                      help="TOML ([[call]] tables) or JSON list of {method, params, weight, "
                      "notification}; replaces --method/--params (with --mcp: method names a tool, "
                      "params are its arguments, an object, and --tool/--arguments are replaced)")
    work.add_argument("-b", "--batch", type=_batch, default=1, metavar="N",
                      help="calls per request body (N >= 2 sends a JSON array; default 1; at most 100,000)")
    work.add_argument("--ids", choices=ID_MODES, default="int",
                      help="id style: int, string, large (past 2**64, exponent floats), repeated "
                      "(one id per batch; answers matched as a multiset). Every id names one request "
                      "body of its connection, so all styles work on tcp:// and unix:// too")
    work.add_argument("--seed", type=_seed, default=0, help="seed of the mix draw (default 0)")
    mcp = p.add_argument_group("MCP (Model Context Protocol)")
    mcp.add_argument("--mcp", action="store_true",
                     help="URL is an MCP server's Streamable HTTP endpoint (http://, e.g. "
                     "http://127.0.0.1:8080/mcp): each request is one tools/call of --tool with "
                     "--arguments; a result must be a CallToolResult, one with isError true counts as a "
                     "tool error by its reason; JSON and SSE answers are read. No --batch (MCP has none)")
    mcp.add_argument("--mcp-era", choices=MCP_ERAS, default=None,
                     help="modern (default): 2026-07-28, stateless, the version and client in each "
                     "request's _meta and MCP-Protocol-Version, Mcp-Method, Mcp-Name headers; legacy: "
                     "2025-11-25, each connection first sends initialize and notifications/initialized, "
                     "then its calls with the negotiated version and the Mcp-Session-Id given, if any")
    mcp.add_argument("--tool", default=None, metavar="NAME", help="tool to call (default add)")
    mcp.add_argument("--arguments", default=None, metavar="JSON",
                     help='its arguments, a JSON object (default {"a":1,"b":2})')
    auth = p.add_argument_group("authentication")
    auth.add_argument("--token-file", metavar="PATH",
                      help="send the bearer token held in PATH (the token alone, on one line): as "
                      "'Authorization: Bearer TOKEN' over http://, in each connection's first line "
                      "(rpc.authenticate) over tcp://; not for unix:// (the socket's file mode is its "
                      "check). A file, not a flag's value, so that ps does not show the token; from a "
                      "shell variable: --token-file <(printf '%%s\\n' \"$TOKEN\")")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the run as JSON (schema rpc-broker-bench/1)")
    out.add_argument("-q", "--quiet", action="store_true",
                     help="no live progress line (also off when stdout is not a terminal); the "
                     "final table is still printed")
    return p


def build_plot_parser() -> argparse.ArgumentParser:
    """Parser of ``rpc-broker bench plot FILE... -o OUT``."""
    p = argparse.ArgumentParser(
        prog=f"{PROG} plot",
        allow_abbrev=False,
        description="Latency percentile curves of several --json runs on one chart. A run with "
        "no latency curve (no answer measured) is left out, with a warning.",
        epilog="Exit codes: 0 chart written; 2 bad usage (an unreadable or invalid input, no input "
        "with a curve, an unknown output format, an unwritable output, matplotlib missing).")
    p.add_argument("files", nargs="+", metavar="FILE", help="--json outputs of bench runs")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="image to write; its suffix picks the format: .png, .pdf, .svg")
    p.add_argument("--title", help="chart title")
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    from broker.cli import unknown_arguments

    try:
        ns, unknown = parser.parse_known_args(argv)
        if unknown:
            unknown_arguments(parser, unknown)
        return ns
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
        left_out = plot(ns.files, ns.output, ns.title)
    except ImportError as exc:  # matplotlib is the optional `plot` extra
        print(f"{PROG} plot: {exc}; install the plot extra: pip install 'rpc-broker[plot]'", file=sys.stderr)
        return 2
    except PlotError as exc:  # names the file (and the key) that is wrong
        print(f"{PROG} plot: {exc}", file=sys.stderr)
        return 2
    for path in left_out:
        print(f"{PROG} plot: warning: {path}: no latency curve (no answer was measured); "
              "left out of the chart", file=sys.stderr)
    print(f"wrote {ns.output}")
    return 0


MAX_TOKEN_FILE = 64 * 1024  # bytes read of --token-file: a token is at most a few hundred


def _read_token(path: str) -> str:
    """The bearer token held in file ``path`` (--token-file): its text without the white
    space around it, which must be one RFC 6750 b64token (letters, digits, ``-._~+/``, then
    ``=`` padding: what a header can carry as it is). Raises ValueError (bad usage, exit 2)
    saying what is wrong, and never quoting the file's text (it may be a secret)."""
    try:
        with open(path, "rb") as f:  # (a pipe too: --token-file <(printf ...))
            data = f.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise ValueError(f"--token-file {path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_TOKEN_FILE:
        raise ValueError(f"--token-file {path}: larger than {MAX_TOKEN_FILE:,} bytes: not a token")
    text = data.decode("utf-8", "replace").strip()
    if not text:
        raise ValueError(f"--token-file {path}: empty: put the token in it, alone on one line")
    if len(text.split()) > 1:
        raise ValueError(f"--token-file {path}: more than one word in it: put the token alone on one line")
    if ":" in text:  # (the broker's token file holds NAME:TOKEN lines: a client sends the token alone)
        raise ValueError(f"--token-file {path}: a NAME:TOKEN line: put the token alone in it (what follows the "
                         "colon), not a line of the broker's auth_tokens_file")
    if not B64TOKEN.match(text):
        raise ValueError(f"--token-file {path}: not a bearer token: a token is letters, digits and '-._~+/',"
                         " then '=' padding (RFC 6750's b64token)")
    return text


def _writable(path: str) -> bool:
    """Open ``path`` for writing (appending: an existing file is left as it is until the
    run is over), so that a bad --json path is refused before the load, not after it;
    a file made by this probe is removed again. Prints the reason when it is not."""
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        print(f"{PROG}: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return False
    if not existed:
        try:
            os.unlink(path)
        except OSError:
            pass
    return True


def _open_files_fit(connections: int, processes: int) -> str:
    """Make room for the connections of the busiest load process in the open-files limit
    (RLIMIT_NOFILE): raise the soft limit up to the hard one if needed (spawned load
    processes inherit it). Returns "" when they fit, else the reason, naming the flag."""
    import resource

    need = -(-connections // processes) + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return ""
    if hard == resource.RLIM_INFINITY or need <= hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        except (OSError, ValueError) as exc:
            return (f"--connections: {connections:,} need {need:,} open files per load process, "
                    f"and raising the open-files limit (RLIMIT_NOFILE) from {soft:,} failed: {exc}")
        return ""
    per = f" per load process ({processes})" if processes > 1 else ""
    return (f"--connections: {connections:,} need {need:,} open files{per}, more than the open-files "
            f"limit (RLIMIT_NOFILE) allows even when raised to its hard limit ({hard:,}); use fewer "
            "connections, more --processes, or a higher hard limit (ulimit -Hn)")


def _mcp_era(ns: argparse.Namespace) -> McpEra | None:
    """The MCP era of the run (None: JSON-RPC), its flags checked against the others;
    raises ValueError (bad usage) naming the flag that does not fit."""
    if not ns.mcp:
        for flag, value in (("--tool", ns.tool), ("--arguments", ns.arguments), ("--mcp-era", ns.mcp_era)):
            if value is not None:
                raise ValueError(f"{flag} is for --mcp (an MCP server's tools); a JSON-RPC call is "
                                 "--method and --params")
        return None
    for flag, value in (("--method", ns.method), ("--params", ns.params)):
        if value is not None:
            raise ValueError(f"{flag} is for JSON-RPC: with --mcp, name the tool with --tool and give its "
                             "arguments with --arguments (a JSON object)")
    if ns.batch > 1:
        raise ValueError("--batch: MCP has no batches (neither 2025-11-25 nor 2026-07-28 allows them): "
                         "one tools/call per request")
    if ns.ids not in ("int", "string"):
        raise ValueError(f"--ids {ns.ids}: MCP request ids are strings or integers: use --ids int or string")
    return typing.cast(McpEra, ns.mcp_era or "modern")


def _bench(ns: argparse.Namespace) -> int:
    import signal

    import msgspec
    from rich.console import Console
    from rich.live import Live

    from broker.loadgen import report as rep
    from broker.loadgen.mcp import tool_calls
    from broker.loadgen.runner import ProcessDied, Progress, RunError, RunInterrupted, Spec, Target, run
    from broker.loadgen.workload import Workload

    try:
        era = _mcp_era(ns)
        if era is None:
            calls = load_mix(ns.mix) if ns.mix else [Call("add" if ns.method is None else ns.method,
                                                          "[1,2]" if ns.params is None else ns.params)]
            Workload(calls, ns.batch, ns.ids)  # validate params before starting anything
        else:
            calls = load_mix(ns.mix) if ns.mix else [Call("add" if ns.tool is None else ns.tool,
                                                          '{"a":1,"b":2}' if ns.arguments is None else ns.arguments)]
            Workload(tool_calls(calls, era), ns.batch, ns.ids)
        target = Target.parse(ns.target)
        if era is not None and target.scheme != "http":
            raise ValueError(f"--mcp drives an MCP server's Streamable HTTP endpoint: give its http:// URL "
                             f"(e.g. http://127.0.0.1:8080/mcp), not {ns.target!r}")
        if ns.token_file is not None and target.scheme == "unix":
            raise ValueError("--token-file: a unix:// socket asks for no token (its file mode says who may "
                             "connect): leave --token-file out, or use the broker's tcp:// stream_port")
        token = _read_token(ns.token_file) if ns.token_file is not None else ""
    except (MixError, RunError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if target.scheme != "unix" and urllib.parse.urlsplit(ns.target).port == 0:
        print(f"{PROG}: port 0 in {ns.target!r}: give the port the server listens on", file=sys.stderr)
        return 2
    if ns.pipeline is not None and ns.rate is not None:
        print(f"{PROG}: --pipeline is for the closed loop; with --rate each request goes out when "
              "it is due (use --depth to allow several in flight per connection)", file=sys.stderr)
        return 2
    if ns.processes > ns.connections:
        print(f"{PROG}: --processes ({ns.processes}) must not exceed --connections "
              f"({ns.connections})", file=sys.stderr)
        return 2
    depth = max(ns.depth, ns.pipeline or 1)
    if ns.connections * depth * ns.batch > MAX_CALLS_IN_FLIGHT:
        print(f"{PROG}: --connections x --depth x --batch ({ns.connections:,} x {depth:,} x "
              f"{ns.batch:,}) must be <= {MAX_CALLS_IN_FLIGHT:,} calls in flight (each holds "
              "memory until answered)", file=sys.stderr)
        return 2
    why = _open_files_fit(ns.connections, ns.processes)
    if why:
        print(f"{PROG}: {why}", file=sys.stderr)
        return 2
    if ns.json and not _writable(ns.json):  # find out now, not after the whole run
        return 2
    spec = Spec(target=ns.target, calls=calls, connections=ns.connections, depth=ns.depth,
                pipeline=ns.pipeline or 1, rate=ns.rate, batch=ns.batch, ids=ns.ids,
                processes=ns.processes, duration=ns.duration, warmup=ns.warmup, timeout=ns.timeout,
                seed=ns.seed, token=token, mcp=era)
    console = Console()
    live_on = console.is_terminal and not ns.quiet
    started = time.monotonic()
    live: Live | None = Live(console=console, auto_refresh=False, transient=True) if live_on else None
    on_progress: typing.Callable[[Progress], None] | None = None
    if live is not None:
        shown = live

        def on_progress(p: Progress) -> None:
            shown.update(rep.progress_text(p, time.monotonic() - started), refresh=True)

    died = ""
    try:
        if live is not None:
            live.start()
        try:
            results = run(spec, on_progress, want_p99=live is not None)
        finally:
            if live is not None:
                live.stop()
    except RunInterrupted as exc:  # before the load started: nothing to report
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except ProcessDied as exc:  # the other processes were stopped: report what they measured
        results, died = exc.results, str(exc)
    except RunError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the run's own handling (e.g. not the main thread)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    signum = max((r.interrupted for r in results), default=0)
    cut = bool(signum or died)
    if cut:  # the window really measured, not the one asked for
        spec = msgspec.structs.replace(spec, duration=round(max((r.window_s for r in results), default=0.0), 3))
    tally, hist, unsent, drain = rep.merge(results)
    if not cut and tally.requests == 0:  # load was offered and nothing came back in the window
        tally.problem(f"no request of the measured {spec.duration:g} s window was answered"
                      + (f" ({unsent:,} never sent: the server could not keep up)" if unsent else ""))
    # (new user, round 108: against a broker asking for tokens every call was refused, the
    # table said to check --method and --params, and the run exited 0)
    # (>=: on a stream the refusal of the token line may come before any call was sent)
    refused = tally.unauthorized > 0 and tally.unauthorized >= tally.requests
    if refused:
        how = "HTTP 401" if target.scheme == "http" else "-32600 about the token, connection closed"
        tally.first_problem = f"every call was refused as unauthorized ({how}): " + (
            f"the server does not take the token of --token-file {ns.token_file}" if token else
            "the server asks for a bearer token: give it with --token-file PATH")
    report = rep.build_report(spec, tally, hist, drain, unsent, mix=ns.mix, sent=sum(r.sent for r in results),
                              behind=sum(r.behind for r in results))
    report.interrupted = cut
    report.processes_lost = spec.processes - len(results) if died else 0
    rep.print_table(report, console, tally.first_problem, tally.unauthorized)  # -q hides only the progress line
    if cut:
        why = died or f"interrupted by {signal.Signals(signum).name}"
        abandoned = sum(r.abandoned for r in results)
        lost = (f" by the {len(results):,} surviving load process(es) (the figures of "
                f"{report.processes_lost:,} are missing)" if report.processes_lost else "")
        print(f"{PROG}: {why}: the table covers the {report.duration_s:.3g} s measured{lost} of the "
              f"{ns.duration:g} s asked for" + (f"; {abandoned:,} request(s) still in flight were "
                                                 "not awaited (not counted)" if abandoned else ""),
              file=sys.stderr)
    if ns.json:
        try:
            Path(ns.json).write_bytes(report.to_json())
        except OSError as exc:  # after the run (a full disk, /dev/full): a failure, not bad usage
            print(f"{PROG}: cannot write {ns.json}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    if died:
        return 1
    if signum:
        return 128 + signum  # as a shell reports a process killed by it: 130 SIGINT, 143 SIGTERM
    if refused or not (report.check.ok and report.transport_errors == 0 and report.requests > 0):
        print(f"{PROG}: failed; first problem: {tally.first_problem or 'see the table'}", file=sys.stderr)
        return 1
    return 0
