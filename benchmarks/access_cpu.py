"""The broker process's CPU per call under S1 at 64 connections, access_log "errors" against "all".

Usage: .venv/bin/python benchmarks/access_cpu.py [--repetitions 3] [--duration 3] [--against TREE]

Starts `rpc-broker serve --workers 2 --access-log MODE` (its lines to a log file under /tmp, as
run.py's runner does), drives it with the checking `rpc-broker bench -c 64` (single `add` calls,
a 0.5 s warm-up run first), and divides the CPU time the broker's own process (every thread of
it: the event loop and the log writer; not its workers, nor the load generator) spent during the
measured run by the calls answered. CPU time per call moves far less than calls/s on a shared
machine, where the other processes take the cores: this is the figure to compare. With
`--against TREE` (another checkout, e.g. an older commit's `git archive`) its broker runs too, the
order of the four alternating between repetitions. Prints the medians, and the median of each
repetition's own ratio of "all" to "errors" (the two measured back to back: steadier when the
machine's load drifts); nothing here is a test.
Ports: any free ones.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable
LOADGEN = str(Path(PY).with_name("rpc-broker"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid`, all its threads (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(tree: Path, mode: str, duration: float, logs: Path) -> tuple[float, int]:
    """One run: (the broker process's CPU seconds, the calls answered) over `duration` s."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    with open(logs / f"{tree.name}-{mode}.log", "w") as log:
        proc = subprocess.Popen(
            [PY, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "2",
             "--log-level", "warning", "--access-log", mode], cwd=tree, stdout=log, stderr=log,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "readyz", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        subprocess.run([LOADGEN, "bench", "-c", "64", "--duration", "0.5", "-q", url], timeout=60,
                       capture_output=True, check=True)  # fmt: skip
        out = logs / "bench.json"
        before = _cpu_seconds(proc.pid)
        subprocess.run([LOADGEN, "bench", "-c", "64", "--warmup", "0", "--duration", str(duration), "-q",
                        "--json", str(out), url], timeout=duration + 60, capture_output=True, check=True)  # fmt: skip
        cpu = _cpu_seconds(proc.pid) - before
        report = json.loads(out.read_text())
        if not report["check"]["ok"]:
            raise SystemExit(f"{tree} {mode}: answers failed the check: {report['check']}")
        return cpu, int(report["calls"])
    finally:
        proc.send_signal(signal.SIGTERM)  # (our own child, by its pid)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    """Run the repetitions and print the median CPU microseconds per call of each broker and mode."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per run (at most 60)")
    parser.add_argument("--against", type=Path, help="another checkout, measured alike")
    args = parser.parse_args()
    duration = min(args.duration, 60.0)
    trees = [("this", HERE.parent)] + ([("against", args.against.resolve())] if args.against else [])
    runs = [(name, tree, mode) for name, tree in trees for mode in ("errors", "all")]
    figures: dict[tuple[str, str], list[tuple[float, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="access-cpu-") as tmp:
        for rep in range(args.repetitions):
            for name, tree, mode in runs if rep % 2 == 0 else runs[::-1]:
                cpu, calls = measure(tree, mode, duration, Path(tmp))
                figures.setdefault((name, mode), []).append((cpu, calls))
                print(f"{name:8s} {mode:6s} {cpu:6.2f} s CPU, {calls} calls, {cpu / calls * 1e6:6.1f} us a call",
                      flush=True)
    print(f"broker process CPU per call, S1 at 64 connections, median of {args.repetitions}")
    for name, _tree in trees:
        errors, all_ = (statistics.median(cpu / calls * 1e6 for cpu, calls in figures[name, mode])
                        for mode in ("errors", "all"))  # fmt: skip
        ratios = sorted((a[0] / a[1]) / (e[0] / e[1]) for e, a in zip(figures[name, "errors"], figures[name, "all"]))
        print(f"{name:8s} errors {errors:6.1f} us   all {all_:6.1f} us   a line per call costs "
              f"+{all_ - errors:.1f} us (+{(all_ / errors - 1) * 100:.1f} %); all/errors of each repetition: "
              f"median {statistics.median(ratios):.3f} (from {ratios[0]:.3f} to {ratios[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
