"""`make fuzz`: run each harness for a while, in turn, and say what it did and found.

Usage: python -m fuzz.run [--seconds N] [--parallel N] [HARNESS ...] [-- LIBFUZZER_FLAGS ...]

Each harness (default: all of `HARNESSES`) runs as `python -m fuzz.HARNESS` with libFuzzer's
flags (https://llvm.org/docs/LibFuzzer.html#options): `-max_total_time` (--seconds), `-timeout`
(`TIMEOUT_SECONDS` an input: a hang), `-rss_limit_mb` (`RSS_LIMIT_MB`), `-max_len` (its own,
`HARNESSES`), `-artifact_prefix` (.fuzz/HARNESS/artifacts/: crash-*, timeout-*, oom-* files) and
`-print_final_stats=1`, on its corpus .fuzz/HARNESS/corpus (seeded from tests/data at its first
run: fuzz/harness.py `main`). Its output goes to .fuzz/HARNESS/last.log. Printed per harness: the
inputs run (`stat::number_of_executed_units`), inputs a second, the coverage (libFuzzer's last
`cov:` and `ft:`, edges and features of the broker's instrumented code) and every input it
wrote. Exit status 1 if any harness wrote one (or failed to run), else 0.

A finding is kept for good with `python -m fuzz.keep HARNESS FILE` (tests/data/fuzz/HARNESS/,
replayed by tests/test_fuzz_regressions.py).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import typing
from pathlib import Path

from broker.loadgen.stopping import run as run_stopping
from broker.loadgen.stopping import stop_on_signals
from fuzz.harness import ROOT, WORK

__all__ = ["HARNESSES", "RSS_LIMIT_MB", "TIMEOUT_SECONDS", "Outcome", "main", "run"]

# Each harness and its -max_len (bytes): a codec body up to 16 KiB reaches the slow paths of
# bodies nested past the parser's limit; the front-ends feed their input in pieces, one
# data_received call each, so shorter inputs keep them at hundreds of inputs a second.
HARNESSES = {"jsonrpc_codec": 16384, "wire_frames": 4096, "http_frontend": 2048, "ndjson_frontend": 2048}
TIMEOUT_SECONDS = 10  # an input taking longer is a hang (libFuzzer's -timeout)
RSS_LIMIT_MB = 2048  # libFuzzer's -rss_limit_mb: past it, an oom-* input


class Outcome(typing.NamedTuple):
    """What one harness's run did: inputs run, inputs a second, coverage (edges, features),
    the inputs it wrote (crashes, timeouts, slow inputs, ooms), its exit status and log."""

    harness: str
    runs: int
    per_second: int
    cov: int
    ft: int
    found: list[str]
    status: int
    log: Path


def _argv(harness: str, seconds: int, extra: list[str]) -> list[str]:
    artifacts = WORK / harness / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    return [
        sys.executable, "-m", f"fuzz.{harness}",
        f"-max_total_time={seconds}", f"-timeout={TIMEOUT_SECONDS}", f"-rss_limit_mb={RSS_LIMIT_MB}",
        f"-max_len={HARNESSES[harness]}", f"-artifact_prefix={artifacts}/", "-print_final_stats=1",
        *extra,
    ]  # fmt: skip


def _outcome(harness: str, status: int, log: Path) -> Outcome:
    text = log.read_text(errors="replace")
    runs = re.findall(r"stat::number_of_executed_units: (\d+)", text)
    rate = re.findall(r"stat::average_exec_per_sec:\s+(\d+)", text)
    cov = re.findall(r"cov: (\d+) ft: (\d+)", text)
    found = re.findall(r"Test unit written to (\S+)", text)
    last = re.findall(r"^#(\d+)\s", text, re.M)
    return Outcome(
        harness,
        int(runs[-1]) if runs else int(last[-1]) if last else 0,
        int(rate[-1]) if rate else 0,
        int(cov[-1][0]) if cov else 0,
        int(cov[-1][1]) if cov else 0,
        found,
        status,
        log,
    )


def run(harnesses: list[str], seconds: int, parallel: int = 1, extra: list[str] | None = None) -> list[Outcome]:
    """Run `harnesses` for `seconds` each, `parallel` at a time; their outcomes, in order."""
    waiting = list(harnesses)
    running: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    done: dict[str, Outcome] = {}
    try:
        _run_all(waiting, running, done, seconds, parallel, extra or [])
    finally:  # (a SIGTERM, KeyboardInterrupt: the harnesses running are stopped, not left fuzzing)
        for _, process, _ in running:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    return [done[h] for h in harnesses]


def _run_all(waiting: list[str], running: list[tuple[str, subprocess.Popen[bytes], Path]], done: dict[str, Outcome],
             seconds: int, parallel: int, extra: list[str]) -> None:
    """`run`'s loop: starts the harnesses `waiting`, `parallel` at a time, into `running`, and
    moves each that ends to `done`."""
    while waiting or running:
        while waiting and len(running) < parallel:
            harness = waiting.pop(0)
            argv = _argv(harness, seconds, extra)  # (makes .fuzz/HARNESS/: new user, round 104)
            log = WORK / harness / "last.log"
            with log.open("wb") as out:
                process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            print(f"fuzz: {harness} for {seconds} s (log: {_shown(log)})", flush=True)
            running.append((harness, process, log))
        time.sleep(0.5)
        for entry in list(running):
            harness, process, log = entry
            if process.poll() is not None:
                running.remove(entry)
                done[harness] = _outcome(harness, process.returncode, log)
                _print(done[harness])


def _shown(path: Path) -> str:
    """`path` relative to the checkout when inside it (.venv/bin/python, .fuzz/...), else whole."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _print(o: Outcome) -> None:
    print(f"fuzz: {o.harness}: {o.runs:,} inputs ({o.per_second:,}/s), cov {o.cov}, ft {o.ft}, exit {o.status}", flush=True)
    for path in o.found:
        print(f"fuzz: {o.harness}: FOUND {path} (keep it: {_shown(Path(sys.executable))} -m fuzz.keep {o.harness} {path})",
              flush=True)
    if o.status and not o.found:
        print(f"fuzz: {o.harness}: failed without an input written: see {o.log}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args:
        at = args.index("--")
        args, extra = args[:at], args[at + 1:]
    parser = argparse.ArgumentParser(prog="python -m fuzz.run", description="Run the fuzz harnesses (make fuzz).")
    parser.add_argument("--seconds", type=int, default=60, help="how long each harness runs (default 60)")
    parser.add_argument("--parallel", type=int, default=1, help="harnesses run at once (default 1: in turn)")
    parser.add_argument("harnesses", nargs="*", metavar="HARNESS", help=f"default: all ({', '.join(HARNESSES)})")
    ns = parser.parse_args(args)
    if ns.seconds < 1:  # (libFuzzer takes -max_total_time=0 as no limit: hostile testing, round 112)
        parser.error(f"--seconds {ns.seconds}: at least 1")
    stop_on_signals()  # (its `finally` stops what it started: broker/loadgen/stopping.py)
    unknown = [h for h in ns.harnesses if h not in HARNESSES]
    if unknown:
        parser.error(f"no harness {', '.join(unknown)} (there are {', '.join(HARNESSES)})")
    outcomes = run(ns.harnesses or list(HARNESSES), ns.seconds, ns.parallel, extra)
    total = sum(o.runs for o in outcomes)
    print(f"fuzz: {total:,} inputs in all; findings (if any) in {_shown(WORK)}/*/artifacts/", flush=True)
    return 1 if any(o.found or o.status for o in outcomes) else 0


if __name__ == "__main__":
    run_stopping("fuzz", main)
