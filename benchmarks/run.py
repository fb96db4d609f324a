"""`make bench`: the broker side by side with the servers a user would pick instead.

Usage: .venv/bin/python benchmarks/run.py [--quick] [--output FILE]
       [--repetitions 3] [--duration 4] [--warmup 0.5] [--servers NAME,...] [--probe-only] [--no-loadgen]
       [--against TREE] (adds broker-2w-against and broker-2w-access-all-against, by name in --servers)

Every server runs on 127.0.0.1 as a child process of this runner, alone, one after another;
the order alternates between repetitions (forward, backward, forward, ...), so no server always
gets the same moment of a shared machine. Each is stopped by its own PID (SIGTERM, then SIGKILL).
Before any load a server must answer a correctness probe (add, fib, sleep, a batch with its ids
echoed, an unknown method); a server that fails it is reported and not measured.

Servers: rpc-broker with 2 and 1 workers, `reference_server.py` (one uvloop + httptools +
msgspec process answering inline), aiohttp + jsonrpcserver (1 process, and 2 under gunicorn),
fastapi-jsonrpc under uvicorn (1 and 2 workers), and for the MCP scenarios the official MCP SDK's
own server (`peers/mcp_sdk_server.py`, 1 and 2 processes). Peers that are not installed (the
`bench` extra) are skipped and said so. Issue 14's measuring sticks, when `shared/reference/` is
beside the repository (bench_servers.reference_dir): limit_uvloop.py (the one-process reference
the issue's targets are ratios to) and broker_proto.py --fast with 1 and 2 workers, run from
there; they have only `add` and `echo` at /rpc, so they are probed with `add` alone and run S1,
S2 (limit_uvloop.py S5b too). Without the directory the run says so and goes on.

Scenarios: S1 single `add` calls at 16 and 64 connections; S2 batches of 100 `add`; S3 `fib(n)`
with n sized to about 2 ms per call here; S4 `sleep(0.01)` with 1,000 calls in flight; S5 an
open loop at half the reference server's S1 capacity, measured earlier in the same run; S5b
(not a target) the reference and the brokers at half broker-2w's own S1 capacity. M1 and M3
(MCP, not targets): `tools/call` of `add` at 16 and 64 connections and of `fib(n)` (about 10 ms a
call here) at 4 and 16, over Streamable HTTP at 2026-07-28, broker-2w's /mcp against the SDK's
server (`mcp_bench.py` probes both eras first; a server whose probe fails is reported, not measured).
The load comes from the bundled checking generator `rpc-broker bench` (every answer checked)
and, for closed-loop scenarios, also from wrk (status codes only: unchecked); S5b also from h2load
when it is installed (`apt-get install nghttp2-client`: a native open-loop generator, status codes
only; on two shared cores the checking generator's own CPU sets an open loop's tails). When `rpc-broker
bench` is missing, wrk alone drives S1-S4, S5 is skipped, and RESULTS.md says so.

Around every run the CPU of the server's process and its children is read from /proc, and the
load tool's from getrusage (benchmarks/proc_cpu.py).

Writes the markdown report (machine, method, probes, one table per scenario with medians and
min-max spreads and ratios to the reference server, the best peer and limit_uvloop.py, the CPU
per call of each server and of the load tool, the targets) to
`--output` (default benchmarks/RESULTS.md; a new temporary file for --quick and --probe-only) and
prints the same tables. Exit status: 0 when the broker and the reference server
answered correctly and were measured, 1 otherwise (a broker whose MCP probe fails, e.g. one
without /mcp, is not measured in the MCP scenarios, which say so; the status stays as it is)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # its modules, beside this file (also when loaded by path, as the tests do)

import bench_servers  # noqa: E402
import mcp_bench  # noqa: E402
from bench_load import (  # noqa: E402
    Measure,
    Scenario,
    calibrate_fib,
    loadgen_command,
    run_h2load,
    run_loadgen,
    run_wrk,
    scenarios,
)
from bench_report import render, s1_capacity, targets  # noqa: E402
from bench_servers import (  # noqa: E402
    MCP_SERVERS,
    QUICK_SERVERS,
    SERVERS,
    Running,
    Server,
    _broker,
    fib_value,
    free_port,
    missing_modules,
    port_range,
    probe,
)

# (the tests reach these through this module, as they did before the split)
__all__ = ["KEEP_MARK", "Measure", "Running", "Server", "bench_servers", "free_port", "main", "mcp_bench", "targets"]

# ---------------------------------------------------------------------------------------------
# Main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 s runs, 1 repetition, reference + broker-2w, S1 and S2 only")
    parser.add_argument("--output", type=Path,
                        help="markdown report (default: benchmarks/RESULTS.md; with --quick or --probe-only "
                             "a file in the temporary directory, so the committed results stay)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds of load before measuring (loadgen)")
    parser.add_argument("--servers", help="comma-separated server names (default: all, or the quick subset)")
    parser.add_argument("--scenarios", help="comma-separated scenario keys (S1-16,S1-64,S2,S3,S4,S5,S5b; S5 and S5b "
                        "need S1; MCP: M1-16,M1-64,M3-4,M3-16)")
    parser.add_argument("--probe-only", action="store_true", help="start and probe the servers; measure nothing")
    parser.add_argument("--no-loadgen", action="store_true", help="drive wrk only, as when rpc-broker bench is missing")
    parser.add_argument("--ports", metavar="LOW-HIGH", type=port_range,
                        help="take the servers' ports from this range (default: any free ports)")
    parser.add_argument("--against", metavar="TREE", type=Path,
                        help="also run broker-2w-against: `rpc-broker serve --workers 2` from another checkout "
                             "(e.g. a git worktree of an older commit), side by side with this one's")
    parser.add_argument("--loadgen", metavar="CMD",
                        help="the load generator's command before `bench` (default: this venv's rpc-broker)")
    args = parser.parse_args(argv)
    bench_servers.PORTS = args.ports
    if args.quick:
        args.repetitions, args.duration, args.warmup = 1, 1.0, 0.3
    if args.output is None:
        if args.quick or args.probe_only:  # one file per run: two users' runs never share it
            handle, name = tempfile.mkstemp(prefix="rpc-broker-bench-", suffix=".md")
            os.close(handle)
            args.output = Path(name)
        else:
            args.output = HERE / "RESULTS.md"

    if args.against is not None:
        if not (args.against / "broker" / "__main__.py").is_file():
            parser.error(f"--against {args.against}: no broker/__main__.py there (give a checkout of rpc-broker)")
        SERVERS.append(Server("broker-2w-against", "broker", f"rpc-broker serve --workers 2 from {args.against}",
                              _broker(2), tree=args.against.resolve()))
        SERVERS.append(Server("broker-2w-access-all-against", "broker", f"rpc-broker serve --workers 2 --access-log "
                              f"all from {args.against} (S1 at 64 connections only)", _broker(2, "--access-log", "all"),
                              only=("S1-64",), tree=args.against.resolve()))  # fmt: skip
    names = args.servers.split(",") if args.servers else QUICK_SERVERS if args.quick else [s.name for s in SERVERS]
    if args.against is not None and not args.servers and "broker-2w-against" not in names:
        names = [*names, "broker-2w-against"]
    unknown = set(names) - {s.name for s in SERVERS}
    if unknown:
        parser.error(f"unknown servers: {', '.join(sorted(unknown))}")
    chosen = [s for s in SERVERS if s.name in names]
    skipped = {s.name: missing_modules(s) for s in chosen if missing_modules(s)}
    servers = [s for s in chosen if s.name not in skipped]

    started = time.monotonic()
    fib_n = calibrate_fib()
    mcp_fib_n = calibrate_fib(10.0)
    all_scenarios = scenarios(fib_n, mcp_fib_n)
    if args.quick or args.scenarios:
        keys = args.scenarios.split(",") if args.scenarios else ["S1-16", "S1-64", "S2"]
        all_scenarios = [sc for sc in all_scenarios if sc.key in keys]
    loadgen = None if args.no_loadgen else loadgen_command(args.loadgen)
    has_wrk = shutil.which("wrk") is not None
    has_h2load = shutil.which("h2load") is not None  # (S5b again, open loop from a native generator)
    if loadgen is None and not has_wrk and not args.probe_only:
        print("neither `rpc-broker bench` nor wrk is available (apt-get install wrk)", file=sys.stderr)
        return 1
    if loadgen is None:
        all_scenarios = [sc for sc in all_scenarios if not sc.open_loop and not sc.mcp]
    mcp_wanted = any(sc.mcp for sc in all_scenarios)

    def uses_wrk(sc: Scenario) -> bool:
        # With the checking generator present, wrk cross-checks the throughput scenarios only
        # (the whole run must stay under ~15 minutes); without it, wrk drives every closed loop.
        return has_wrk and not sc.open_loop and not sc.mcp and (
            loadgen is None or sc.key in ("S1-64", "S2") or args.quick)

    load_avg = os.getloadavg()
    print(f"rpc-broker benchmark: {len(servers)} servers, {args.repetitions} repetition(s) of "
          f"{args.duration:g} s, fib n={fib_n}, load generator: "
          f"{('rpc-broker bench + wrk' if has_wrk else 'rpc-broker bench (wrk not installed)') if loadgen else 'wrk only (rpc-broker bench missing)'}",
          flush=True)
    if bench_servers.REFERENCE_DIR is None:
        print("  issue 14's measuring sticks (shared/reference/: limit_uvloop.py, broker_proto.py) are not beside "
              f"the repository (looked in {', '.join(map(str, bench_servers.REFERENCE_LOOKED))}): run without "
              "them, no ratios to limit_uvloop.py", flush=True)
    for name, mods in skipped.items():
        print(f"  skipping {name}: not installed ({', '.join(mods)}; pip install -e '.[bench]')", flush=True)

    probes: dict[str, tuple[list[str], list[str]]] = {}
    mcp_probes: dict[str, tuple[list[str], list[str]]] = {}  # servers of the MCP scenarios, probed at /mcp
    # results[scenario][tool][server] -> one Measure per repetition
    results: dict[str, dict[str, dict[str, list[Measure]]]] = {
        sc.key: {"loadgen": {}, "wrk": {}, "h2load": {}} for sc in all_scenarios}
    rates: dict[str, float] = {}  # open-loop scenario key -> its offered rate (req/s)
    s5_over: dict[str, float] = {}  # servers whose own S1 capacity is below S5's rate -> that capacity
    ok = True
    with tempfile.TemporaryDirectory(prefix="rpc-bench-") as tmpdir:
        tmp = Path(tmpdir)
        for rep in range(1 if args.probe_only else args.repetitions):
            order = servers if rep % 2 == 0 else servers[::-1]
            # (appended to as it goes: a server again, for the open loops whose rate, half another
            # server's S1 capacity, was not known yet when its turn came in the first repetition)
            queue: list[tuple[Server, list[Scenario] | None]] = [(server, None) for server in order]
            for server, later in queue:
                if server.name in probes and probes[server.name][0]:
                    continue  # answered wrongly before: not measured
                running = Running(server, tmp)
                postponed: list[Scenario] = []
                try:
                    mcp_probed = mcp_wanted and server.name in MCP_SERVERS
                    try:
                        running.wait_ready()
                        if server.name not in probes and server.kind == "mcp-peer":  # (its probe: the MCP one)
                            probes[server.name] = mcp_probes[server.name] = mcp_bench.probe(
                                running.port, mcp_fib_n, fib_value(mcp_fib_n))
                        elif server.name not in probes:
                            probes[server.name] = probe(running.port, fib_n, server.path, server.serves)
                        if mcp_probed and server.name not in mcp_probes:
                            mcp_probes[server.name] = mcp_bench.probe(running.port, mcp_fib_n, fib_value(mcp_fib_n))
                    except (RuntimeError, OSError) as e:
                        probes[server.name] = ([f"did not start: {e}"], [])
                    problems, notes = probes[server.name]
                    print(f"[rep {rep + 1}] {server.name}: probe "
                          + ("ok" if not problems else "FAILED: " + "; ".join(problems))
                          + (f" (notes: {'; '.join(notes)})" if notes else "")
                          + (f", again for {', '.join(sc.key for sc in later)}" if later else ""), flush=True)
                    if problems or args.probe_only:
                        continue
                    mcp_problems = mcp_probes.get(server.name, ([], []))[0]
                    if mcp_probed and mcp_problems and server.kind != "mcp-peer":
                        print(f"[rep {rep + 1}] {server.name}: MCP probe at {mcp_bench.PATH} FAILED, its MCP "
                              f"scenarios are not run: {'; '.join(mcp_problems)}", flush=True)
                    for sc in later or all_scenarios:
                        if (server.only and sc.key not in server.only) or (
                                sc.servers and server.name not in sc.servers) or (sc.mcp and mcp_problems) or (
                                server.serves and sc.method not in server.serves):  # (the sticks: add only)
                            continue
                        rate = None
                        if sc.open_loop:
                            if sc.key not in rates:
                                base = s1_capacity(results, sc.rate_of)
                                if base is None:
                                    postponed += [sc] if later is None else []
                                    continue
                                rates[sc.key] = base / 2
                            rate = rates[sc.key]
                            own = s1_capacity(results, server.name) or 0.0
                            if server.kind == "peer" and own < rate and sc.key == "S5":
                                # Open loop far past its capacity only measures a growing queue (and
                                # the generator would drain it for minutes): say so instead. The
                                # broker is always measured: its target is set at this rate.
                                s5_over[server.name] = own
                                print(f"[rep {rep + 1}] {server.name:12s} S5     not run: S1 capacity "
                                      f"{own:,.0f} req/s < offered {rate:,.0f}", flush=True)
                                continue
                        if loadgen is not None:
                            url = running.url.rstrip("/") + mcp_bench.PATH if sc.mcp else running.url
                            m = run_loadgen(loadgen, url, sc, args.duration, args.warmup, rate, tmp,
                                            running.proc.pid)
                            results[sc.key]["loadgen"].setdefault(server.name, []).append(m)
                            _progress(rep, server.name, sc.key, "rpc-broker bench", m)
                        if has_h2load and sc.key == "S5b" and rate is not None:
                            m = run_h2load(running.url, sc, args.duration, args.warmup, rate, tmp, running.proc.pid)
                            results[sc.key]["h2load"].setdefault(server.name, []).append(m)
                            _progress(rep, server.name, sc.key, "h2load", m)
                        if uses_wrk(sc):
                            m = run_wrk(running.url, sc, args.duration, tmp, running.proc.pid)
                            results[sc.key]["wrk"].setdefault(server.name, []).append(m)
                            _progress(rep, server.name, sc.key, "wrk", m)
                finally:
                    running.stop()
                if postponed:
                    queue.append((server, postponed))
        for name in ("reference", "broker-2w"):
            if name in names and (name not in probes or probes[name][0]):
                ok = False

    report = render(args, servers, skipped, probes, results, all_scenarios, fib_n, loadgen is not None, has_wrk,
                    rates, s5_over, load_avg, time.monotonic() - started, mcp_probes)
    args.output.write_text(report + kept_sections(args.output))
    print()
    print(report)
    print(f"wrote {args.output}")
    return 0 if ok else 1


KEEP_MARK = "<!-- sections below are written by other benchmark scripts; run.py keeps them -->"


def kept_sections(path: Path) -> str:
    """What `path` holds from `KEEP_MARK` on (figures of benchmarks/pathological.py,
    sync_mix.py and the like, pasted by hand), so that a run rewrites only its own part;
    "" when the file or the mark is missing."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    at = text.find(KEEP_MARK)
    return "" if at < 0 else "\n" + text[at:]



def _progress(rep: int, server: str, key: str, tool: str, m: Measure) -> None:
    state = "ok" if m.ok else f"FAILED {m.problem}"
    print(f"[rep {rep + 1}] {server:12s} {key:6s} {tool:16s} {m.rps:10,.0f} req/s {m.cps:11,.0f} calls/s "
          f"p50 {m.p50:7.2f} ms p99 {m.p99:7.2f} ms  {state}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

