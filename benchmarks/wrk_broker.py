"""Throughput and latency of the broker under wrk: single calls and batches of 100.

Usage: .venv/bin/python benchmarks/wrk_broker.py [--workers 2] [--duration 10] [--runs 3]
                                                 [--metrics on|off|both]

Starts `rpc-broker serve` on 127.0.0.1 (an OS-chosen port), drives it with wrk
(Debian package `wrk`) and prints, per scenario, the median and spread of requests/s,
calls/s and wrk's p50/p99 latency over `--runs` runs, and the CPU time the broker
process and its workers spent per call (from /proc: steadier than throughput on a
shared machine, so use it to compare before and after a change). Every answer's status is
checked by wrk's non-2xx count. Prints figures only: nothing here is a test. For the broker
side by side with the reference server and its peers, see `run.py` (`make bench`).
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

from conftest import start_broker  # noqa: E402  (the same launcher the tests use)
from proc_cpu import children, cpu_seconds  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=int, default=10, help="seconds per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--metrics", choices=("on", "off", "both"), default="on",
        help="metrics on (the default setting), off (--no-metrics), or both, runs alternating",
    )  # fmt: skip
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    modes = ["on", "off"] if args.metrics == "both" else [args.metrics]
    brokers = {
        mode: start_broker("--workers", str(args.workers), "--log-level", "warning",
                           *(["--no-metrics"] if mode == "off" else []))
        for mode in modes
    }  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"rpc-broker, {args.workers} workers, {os.cpu_count()} CPUs, wrk on the same machine")
            for name, (conns, payload, calls) in SCENARIOS.items():
                body = Path(tmp) / "body.json"
                body.write_text(json.dumps(payload))
                runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
                for _ in range(args.runs):
                    for mode, broker in brokers.items():  # alternating: noise hits both alike
                        url = f"http://{broker.host}:{broker.port}{broker.path}"
                        if not runs[mode]:
                            run_wrk(url, str(body), conns, 2)  # warm-up
                        workers = children(broker.pid)
                        before = cpu_seconds([broker.pid]), cpu_seconds(workers)
                        r = run_wrk(url, str(body), conns, args.duration)
                        total = r["rps"] * args.duration * calls
                        r["broker_us"] = (cpu_seconds([broker.pid]) - before[0]) / total * 1e6
                        r["worker_us"] = (cpu_seconds(workers) - before[1]) / total * 1e6
                        runs[mode].append(r)
                for mode in modes:
                    rps = [r["rps"] for r in runs[mode]]
                    label = name if len(modes) == 1 else f"{name}, metrics {mode}"
                    print(
                        f"{label:40s} req/s median {statistics.median(rps):9.0f} (min {min(rps):.0f}, max {max(rps):.0f})"
                        f"  calls/s {statistics.median(rps) * calls:9.0f}"
                        f"  p50 {statistics.median(r['p50'] for r in runs[mode]):.2f} ms"
                        f"  p99 {statistics.median(r['p99'] for r in runs[mode]):.2f} ms"
                        f"  CPU per call: broker {statistics.median(r['broker_us'] for r in runs[mode]):.1f} us,"
                        f" workers {statistics.median(r['worker_us'] for r in runs[mode]):.1f} us"
                    )
    finally:
        for broker in brokers.values():
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
