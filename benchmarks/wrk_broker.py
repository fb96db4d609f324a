"""Throughput and latency of the broker under wrk: single calls and batches of 100.

Usage: .venv/bin/python benchmarks/wrk_broker.py [--workers 2] [--duration 10] [--runs 3]
                                                 [--metrics on|off|both] [--no-beside] [--ports LOW-HIGH]
                                                 [--frontends 1,2]

Starts `rpc-broker serve` on 127.0.0.1 (an OS-chosen port), drives it with wrk
(Debian package `wrk`) and prints, per scenario, the median and spread of requests/s,
calls/s and wrk's p50/p99 latency over `--runs` runs, and the CPU time the broker
process and its workers spent per call (from /proc: steadier than throughput on a
shared machine, so use it to compare before and after a change). Every answer's status is
checked by wrk's non-2xx count. Prints figures only: nothing here is a test. For the broker
side by side with the reference server and its peers, see `run.py` (`make bench`).

`--beside` (the default when ../shared/reference/ is beside the repository; `--no-beside`
skips it) runs issue 14's measuring sticks in the same alternation: limit_uvloop.py (the
one-process reference) and broker_proto.py --fast with 1 and 2 workers, from where they are,
each printed on the same line, with every server's requests/s as a ratio to limit_uvloop.py's.
The line also gives wrk's own CPU over its wall time (cores): what the load tool took.

`--frontends 1,2` runs one broker per count of front-end processes (`serve --frontends N`),
in the same alternation: the scaling curve on this machine's cores, and what N = 1 costs
beside the others. The front-end's CPU per call is that of all its front-end processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import bench_servers  # noqa: E402
from bench_servers import LIMIT, REFERENCE_DIR, REFERENCE_LOOKED, STICKS, Running, port_range  # noqa: E402
from conftest import start_broker  # noqa: E402  (the same launcher the tests use)
from proc_cpu import CpuWatch, children, cpu_seconds  # noqa: E402

__all__ = ["children", "cpu_seconds", "run_wrk"]  # (scripts beside it import these from here)

SCENARIOS = {
    "single add, 64 conns": (64, {"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}, 1),
    "batch of 100 add, 16 conns": (
        16,
        [{"jsonrpc": "2.0", "method": "add", "params": [1, i], "id": i} for i in range(100)],
        100,
    ),
}


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    assert m, text
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def run_wrk(url: str, body_file: str, connections: int, duration: int) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(HERE / "wrk_post.lua"), url],
        env={**os.environ, "BODY": body_file}, capture_output=True, text=True, check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    if bad or errors:
        print(f"  wrk reported problems: {bad.group(0) if bad else ''} {errors.group(0) if errors else ''}")
    return {"rps": rps, "p50": p50, "p99": p99}


def _line(label: str, runs: list[dict[str, float]], calls: int, limit: float | None) -> str:
    """One server's figures: medians over its runs, and its calls/s over limit_uvloop.py's."""
    def m(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    rps = [r["rps"] for r in runs]
    workers = f"{m('worker_us'):.1f} us" if all(r["worker_us"] >= 0 for r in runs) else "-"
    return (f"{label:36s} req/s median {m('rps'):9.0f} (min {min(rps):.0f}, max {max(rps):.0f})"
            f"  calls/s {m('rps') * calls:9.0f}  p50 {m('p50'):.2f} ms  p99 {m('p99'):.2f} ms"
            f"  CPU per call: front-end {m('front_us'):.1f} us, workers {workers}; wrk {m('wrk_cores'):.2f} cores"
            + (f"  {m('rps') / limit:.2f}x limit_uvloop.py" if limit else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=int, default=10, help="seconds per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--metrics", choices=("on", "off", "both"), default="on",
        help="metrics on (the default setting), off (--no-metrics), or both, runs alternating",
    )  # fmt: skip
    parser.add_argument(
        "--beside", action=argparse.BooleanOptionalAction, default=REFERENCE_DIR is not None,
        help="also run issue 14's measuring sticks (../shared/reference: limit_uvloop.py, broker_proto.py --fast "
             "with 1 and 2 workers) in the same alternation, with ratios to limit_uvloop.py (default: on when "
             "they are there)",
    )  # fmt: skip
    parser.add_argument("--frontends", default="1", metavar="N,...",
                        help="front-end processes (serve --frontends N), one broker per count, in the same "
                             "alternation: 1,2 gives the scaling curve on this machine's cores (default 1)")
    parser.add_argument("--ports", metavar="LOW-HIGH", type=port_range,
                        help="the sticks' ports come from this range (default: any free ones; the broker picks its own)")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    if args.beside and REFERENCE_DIR is None:
        print("--beside: the measuring sticks are not beside the repository (looked in "
              f"{', '.join(map(str, REFERENCE_LOOKED))})", file=sys.stderr)
        return 2
    bench_servers.PORTS = args.ports
    modes = ["on", "off"] if args.metrics == "both" else [args.metrics]
    # name -> (its process, its URL): the brokers, then the sticks, all stopped by their PID
    servers: dict[str, tuple[int, str]] = {}
    brokers, sticks = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            counts = [int(n) for n in args.frontends.split(",")]
            for frontends in counts:
                for mode in modes:
                    broker = start_broker("--workers", str(args.workers), "--log-level", "warning",
                                          "--frontends", str(frontends), *(["--no-metrics"] if mode == "off" else []))
                    brokers.append(broker)
                    label = (f"rpc-broker, {args.workers} workers" + ("" if len(modes) == 1 else f", metrics {mode}")
                             + ("" if counts == [1] else f", {frontends} front-end{'s' * (frontends > 1)}"))
                    servers[label] = broker.pid, f"http://{broker.host}:{broker.port}{broker.path}"
            for stick in STICKS if args.beside else []:
                running = Running(stick, Path(tmp))
                sticks.append(running)
                running.wait_ready()
                servers[stick.name] = running.proc.pid, running.url
            print(f"rpc-broker, {args.workers} workers, {os.cpu_count()} CPUs, wrk on the same machine")
            for stick in STICKS if sticks else []:
                print(f"  beside it, {stick.name}: {stick.description}")
            if REFERENCE_DIR is None:
                print("  (issue 14's measuring sticks are not beside the repository: the broker alone)")
            for name, (conns, payload, calls) in SCENARIOS.items():
                body = Path(tmp) / "body.json"
                body.write_text(json.dumps(payload))
                runs: dict[str, list[dict[str, float]]] = {label: [] for label in servers}
                for _ in range(args.runs):
                    for label, (pid, url) in servers.items():  # alternating: noise hits all alike
                        if not runs[label]:
                            run_wrk(url, str(body), conns, 2)  # warm-up
                        with CpuWatch(pid) as watch:
                            r = run_wrk(url, str(body), conns, args.duration)
                        cpu = watch.cpu
                        assert cpu is not None
                        cpu.calls = r["rps"] * args.duration * calls
                        r["front_us"] = cpu.per_call(cpu.main) or 0.0
                        r["worker_us"] = cpu.per_call(cpu.children) or -1.0  # (-1: no worker processes)
                        r["wrk_cores"] = cpu.load / cpu.wall
                        runs[label].append(r)
                limit = statistics.median(r["rps"] for r in runs[LIMIT]) if LIMIT in runs else None
                print(f"== {name}")
                for label, rs in runs.items():
                    print(_line(label, rs, calls, limit))
    finally:
        for broker in brokers:
            broker.stop()
        for running in sticks:
            running.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
