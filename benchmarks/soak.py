"""Soak: a broker under a steady mixed load for minutes, its memory and counts sampled, to show
that nothing grows.

Usage: .venv/bin/python benchmarks/soak.py [--minutes 10] [--warmup MIN] [--interval 10]
                                           [--load 0.7] [--workers 2] [--seed 1]
                                           [--plot FILE] [--json FILE] [--write]

Starts a real broker serving `broker.demo:faults` (its `slow` held to a 0.05 s deadline) on
loopback, HTTP and an NDJSON port, and measures its capacity first: `rpc-broker bench`'s
closed loop of `add` singles for 5 s (calls/s). Then, for `--minutes`, at `--load` (0.7) of that:

- `rpc-broker bench` over HTTP, open loop at 6/7 of the load: a mix of singles (MIX: results,
  an application error, -32601, -32602, -32001 timeouts, notifications), each answer checked;
- `rpc-broker bench` over NDJSON, batches of 10 of the same mix, at 1/7 of the load;
- client disconnects: every DISCONNECT_EVERY s a connection that sends a call (a `slow` one,
  or half an HTTP request, or an NDJSON line) and closes without reading its answer;
- a scrape of /metrics every second.

Every `--interval` s it samples the resident memory (VmRSS) and open file descriptors of the
broker and of each worker process (/proc), and the broker's event loop tasks and handles
(`rpc_broker_event_loop_tasks`, `_handles`). After `--warmup` minutes (default 1, or a third of
a run shorter than 3 minutes), each series' growth per minute is its least-squares slope over the
samples; it is judged when at least JUDGED_MINUTES (2) were measured after the warm-up (a shorter
run, `--minutes 1`, is a smoke run: its growth is printed, not judged, since a process's memory
still settles in its first minutes). A process fails if its RSS grows by 1 MiB
a minute or more; a count fails if it rises steadily: a positive slope that explains most of
its variation (r² >= 0.5) and a rise, first to last, of more than max(3, 10 %). `--plot` draws
the series (matplotlib); `--write` puts the figures into benchmarks/RESULTS.md (section "soak")
and the plot into benchmarks/soak.png. Exit status 1 if a series judged fails or a load generator's checks
failed (a wrong, missing or duplicated answer), else 0 (`make soak` then exits 2 or 0).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import Broker, children, free_port, rss_kib, start_broker  # noqa: E402  (the tests' launcher)
from results_md import put_section  # noqa: E402  (benchmarks/, this script's directory)

from broker.loadgen.stopping import run as run_stopping  # noqa: E402
from broker.loadgen.stopping import stop_on_signals  # noqa: E402

MIX = [
    {"method": "add", "params": [1, 2], "weight": 80},
    {"method": "raise_error", "params": [4001, "soak"], "weight": 4},  # an application error
    {"method": "no_such_method", "params": [], "weight": 4},  # -32601
    {"method": "add", "params": ["a", 2], "weight": 4},  # -32602
    {"method": "slow", "params": [0.2], "weight": 4},  # -32001 at its 0.05 s deadline
    {"method": "notify_hello", "params": [1], "weight": 4, "notification": True},
]
"""The calls of both load generators, by weight."""

DISCONNECT_EVERY = 0.25
"""Seconds between two client disconnects (a call sent, the connection closed unanswered)."""

MIB = 1024 * 1024
RSS_LIMIT_MIB_PER_MIN = 1.0
JUDGED_MINUTES = 2.0
"""The least minutes measured after the warm-up for growth to be judged (new user, round 104: a
one-minute run read the broker's first minutes of settling, 55 -> 62 MiB, as +2.6 MiB a minute)."""


def bench(url: str, *flags: str, out: Path) -> list[str]:
    """The argv of an `rpc-broker bench` run against `url`, writing its JSON to `out`."""
    return [sys.executable, "-m", "broker", "bench", url, "-q", "--json", str(out), *flags]


def capacity(b: Broker, tmp: Path) -> float:
    """Calls/s of a 5 s closed loop of `add` singles on 16 connections (1 s warm-up)."""
    out = tmp / "capacity.json"
    subprocess.run(bench(f"http://{b.host}:{b.port}{b.path}", "-c", "16", "--duration", "5", "--warmup", "1",
                         out=out), check=True, stdout=subprocess.DEVNULL, timeout=120)
    return float(json.loads(out.read_text())["calls_per_s"])


def disconnects(b: Broker, stream_port: int, stop: threading.Event, done: list[int]) -> None:
    """Until `stop`: a call sent and its connection closed unread, every DISCONNECT_EVERY s, in
    turn an HTTP call in flight, half an HTTP request, an NDJSON line in flight."""
    call = b'{"jsonrpc":"2.0","method":"slow","params":[0.02],"id":1}'
    shapes = [
        (b.port, b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(call), call)),
        (b.port, b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Len"),
        (stream_port, call + b"\n"),
    ]
    while not stop.wait(DISCONNECT_EVERY):
        port, data = shapes[done[0] % len(shapes)]
        try:
            with socket.create_connection((b.host, port), timeout=5) as s:
                s.sendall(data)
            done[0] += 1
        except OSError:
            done[1] += 1


def scrapes(url: str, stop: threading.Event, done: list[int]) -> None:
    """Until `stop`: GET `url` (/metrics) every second."""
    while not stop.wait(1.0):
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                answer.read()
            done[0] += 1
        except OSError:
            done[1] += 1


def metric(text: str, name: str) -> float | None:
    """The value of the unlabelled sample `name` in an exposition, or None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def open_fds(pid: int) -> int:
    """Open file descriptors of process `pid` (/proc/PID/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def sample(b: Broker, began: float) -> dict[str, float]:
    """One sample: minutes since `began`; RSS (MiB) and fds of the broker and each worker (by
    pid: a worker restarted is a new series); the broker's loop tasks and handles."""
    row: dict[str, float] = {"minute": (time.monotonic() - began) / 60}
    try:
        with urllib.request.urlopen(f"http://{b.host}:{b.port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    except OSError:  # (its gauges missing from this sample; a broker that exited ends the run: `main`)
        text = ""
    for name in ("rpc_broker_event_loop_tasks", "rpc_broker_event_loop_handles"):
        value = metric(text, name)
        if value is not None:
            row[name.removeprefix("rpc_broker_")] = value
    for label, pid in [("broker", b.pid), *((f"worker {p}", p) for p in sorted(children(b.pid)))]:
        try:
            row[f"{label} rss_mib"] = rss_kib(pid) / 1024
            row[f"{label} fds"] = open_fds(pid)
        except (OSError, AssertionError):  # (exited between the listing and the read)
            continue
    return row


def trend(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope per minute, r²) of the least-squares line through (minute, value) points."""
    if len(points) < 3:
        return 0.0, 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if statistics.pvariance(ys) == 0:
        return 0.0, 0.0
    slope, _ = statistics.linear_regression(xs, ys)
    return slope, statistics.correlation(xs, ys) ** 2


def verdicts(rows: list[dict[str, float]], warmup: float) -> dict[str, dict[str, float | bool]]:
    """Each series after `warmup` minutes: first, last, slope per minute, r², ok."""
    out: dict[str, dict[str, float | bool]] = {}
    names = sorted({k for row in rows for k in row if k != "minute"})
    for name in names:
        points = [(row["minute"], row[name]) for row in rows if row["minute"] >= warmup and name in row]
        if not points:
            continue
        slope, r2 = trend(points)
        first, last = points[0][1], points[-1][1]
        if name.endswith("rss_mib"):
            ok = slope < RSS_LIMIT_MIB_PER_MIN
        else:
            ok = not (slope > 0 and r2 >= 0.5 and last - first > max(3.0, 0.1 * first))
        out[name] = {"first": first, "last": last, "slope_per_minute": slope, "r2": r2, "samples": len(points),
                     "ok": ok}
    return out


def plot(rows: list[dict[str, float]], warmup: float, path: Path) -> None:
    """RSS (MiB) of each process, and the counts, against minutes; the warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    names = sorted({k for row in rows for k in row if k != "minute"})
    for name in names:
        points = [(row["minute"], row[name]) for row in rows if name in row]
        axes = top if name.endswith("rss_mib") else bottom
        axes.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
    for axes, label in ((top, "resident memory, MiB"), (bottom, "count")):
        axes.axvspan(0, warmup, color="0.9", label="warm-up")
        axes.set_ylabel(label)
        axes.legend(fontsize="small", loc="upper left")
        axes.grid(alpha=0.3)
    bottom.set_xlabel("minutes")
    top.set_title("rpc-broker soak: memory and counts under a steady load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_results(args: argparse.Namespace, cap: float, rate: float, results: dict[str, dict[str, float | bool]],
                  reports: list[dict[str, typing.Any] | None], dropped: int, scraped: int, stopped: int,
                  ok: bool) -> None:
    """The run's figures as benchmarks/RESULTS.md's section "soak" (results_md)."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    calls = [f"{name} {r['calls']:,} calls ({r['calls_per_s']:,.0f}/s), errors by code {r['errors_by_code']}, checks "
             f"{'ok' if r['check']['ok'] else 'FAILED'}" for name, r in zip(("HTTP", "NDJSON"), reports, strict=True)
             if r is not None]
    rows = [f"| {name} | {v['first']:.1f} | {v['last']:.1f} | {v['slope_per_minute']:+.3f} | {v['r2']:.2f} | "
            f"{'ok' if v['ok'] else 'FAIL'} |" for name, v in results.items()]
    put_section("soak", [
        "## Soak", "",
        f"Written by `benchmarks/soak.py --minutes {args.minutes:g} --seed {args.seed} --write` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (`make soak`: docs/bench.md). {args.workers} workers, "
        f"capacity measured {cap:,.0f} calls/s, load {rate:,.0f} calls/s ({args.load:.0%}); {os.cpu_count()} CPUs, "
        f"load average {load} at the end. {'; '.join(calls)}. Client disconnects {dropped:,}, scrapes {scraped:,}; "
        f"the broker stopped with status {stopped}. Growth per minute is the least-squares slope of the samples "
        f"(every {args.interval:g} s) after a warm-up of {args.warmup:g} min: RSS in MiB, the rest counts. "
        f"Verdict: {'ok' if ok else 'FAILED'}.", "",
        "| series | first | last | per minute | r² | verdict |", "|---|---:|---:|---:|---:|---|", *rows, "",
        "![soak: resident memory and counts against minutes](soak.png)",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of load (default 10)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="minutes left out of the growth (default 1, or a third of a run under 3 minutes)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the capacity measured (default 0.7)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the load generators' mix draw (default 1)")
    parser.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    parser.add_argument("--json", type=Path, help="write the samples and verdicts here")
    parser.add_argument("--write", action="store_true",
                        help="put the figures into benchmarks/RESULTS.md and the plot into benchmarks/soak.png")
    args = parser.parse_args()
    stop_on_signals()  # (its `finally` stops what it started: broker/loadgen/stopping.py)
    if args.warmup is None:  # (new user, round 104: `--minutes 1` was refused, its warm-up being 1)
        args.warmup = min(1.0, args.minutes / 3)
    if args.write and not args.plot:
        args.plot = HERE / "soak.png"
    if not (args.minutes > 0 and 0 <= args.warmup < args.minutes and args.interval > 0 and 0 < args.load <= 1):
        parser.error("need --minutes > 0, 0 <= --warmup < --minutes, --interval > 0, 0 < --load <= 1")

    inherited = sorted(var for var in os.environ if var.startswith("RPC_BROKER_"))
    for var in inherited:  # (its broker takes the run's settings only: hostile testing, round 113)
        del os.environ[var]
    if inherited:
        print(f"soak: ignoring {', '.join(inherited)} (the run's broker takes its own settings only)", flush=True)
    died: int | None = None
    stream_port = free_port()
    b = start_broker("--app", "broker.demo:faults", "--workers", str(args.workers), "--stream-port",
                     str(stream_port), "--method-timeout", "slow=0.05")
    loads: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    try:
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp_name:
            tmp = Path(tmp_name)
            cap = capacity(b, tmp)
            rate = args.load * cap
            mix = tmp / "mix.json"
            mix.write_text(json.dumps(MIX))
            seconds = str(args.minutes * 60)
            common = ["--mix", str(mix), "--duration", seconds, "--warmup", "0", "--timeout", "10",
                      "--seed", str(args.seed)]
            outs = [tmp / "http.json", tmp / "ndjson.json"]
            print(f"capacity {cap:,.0f} calls/s; soaking {args.minutes:g} min at {rate:,.0f} calls/s "
                  f"({args.load:.0%}), sampling every {args.interval:g} s", flush=True)
            began = time.monotonic()
            loads.append(subprocess.Popen(bench(f"http://{b.host}:{b.port}{b.path}", "-c", "16", "-d", "8", "-R",
                                                f"{rate * 6 / 7:.1f}", *common, out=outs[0]),
                                          stdout=subprocess.DEVNULL))
            loads.append(subprocess.Popen(bench(f"tcp://{b.host}:{stream_port}", "-c", "4", "-d", "8", "-b", "10", "-R",
                                                f"{max(rate / 7 / 10, 1):.1f}", *common, out=outs[1]),
                                          stdout=subprocess.DEVNULL))
            dropped, scraped = [0, 0], [0, 0]
            threads = [threading.Thread(target=disconnects, args=(b, stream_port, stop, dropped), daemon=True),
                       threading.Thread(target=scrapes, args=(f"http://{b.host}:{b.port}/metrics", stop, scraped),
                                        daemon=True)]
            for t in threads:
                t.start()
            rows = []
            ends = began + args.minutes * 60
            while True:
                if b.proc.poll() is not None:  # (hostile testing, round 113: a traceback, not a verdict)
                    died = b.proc.returncode
                    print(f"soak: the broker exited during the run, with status {died}", flush=True)
                    break
                rows.append(sample(b, began))
                left = ends - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(args.interval, left))
            stop.set()
            for t in threads:
                t.join(10)
            if died is not None:  # (its load, past its broker, ends now)
                for p in loads:
                    p.kill()
            statuses = [p.wait(60) for p in loads]
            reports = [json.loads(out.read_text()) if out.exists() else None for out in outs]
    finally:
        stop.set()
        for p in loads:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        stopped = b.stop()

    results = verdicts(rows, args.warmup)
    judged = args.minutes - args.warmup >= JUDGED_MINUTES
    print(f"\n{'series':<28} {'first':>10} {'last':>10} {'per minute':>12} {'r²':>6}  verdict")
    for name, v in results.items():
        print(f"{name:<28} {v['first']:>10.1f} {v['last']:>10.1f} {v['slope_per_minute']:>+12.3f} {v['r2']:>6.2f}  "
              f"{('ok' if v['ok'] else 'FAIL') if judged else '-'}")
    for name, status, report in zip(("http", "ndjson"), statuses, reports, strict=True):
        if report is None:
            print(f"{name}: no report (exit {status})")
            continue
        check = report["check"]
        print(f"{name}: {report['calls']:,} calls answered, {report['calls_per_s']:,.0f}/s; errors by code "
              f"{report['errors_by_code']}; checks {'ok' if check['ok'] else 'FAILED'} {check}; exit {status}")
    print(f"disconnects {dropped[0]:,} ({dropped[1]} could not connect); scrapes {scraped[0]:,} "
          f"({scraped[1]} failed); broker stopped with {stopped}")
    if not judged:
        print(f"growth not judged: {args.minutes - args.warmup:g} min measured after the warm-up, under "
              f"{JUDGED_MINUTES:g} (a smoke run: the load's checks and the broker's stop only)")
    ok = (not judged or all(v["ok"] for v in results.values())) and all(s == 0 for s in statuses) and stopped == 0 \
        and died is None
    if args.plot:
        plot(rows, args.warmup, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({
            "minutes": args.minutes, "warmup_minutes": args.warmup, "interval_s": args.interval,
            "load": args.load, "workers": args.workers, "judged": judged, "seed": args.seed, "capacity_calls_per_s": cap,
            "rate_calls_per_s": rate, "samples": rows, "series": results, "load_reports": reports,
            "load_exit": statuses, "disconnects": dropped[0], "scrapes": scraped[0], "broker_exit": stopped,
            "ok": ok}, indent=1))
    if args.write:
        write_results(args, cap, rate, results, reports, dropped[0], scraped[0], stopped, ok)
    print("soak: ok" if ok else "soak: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    run_stopping("soak", main)
