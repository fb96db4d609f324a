"""`make bench`'s scenarios and the load that drives them: `rpc-broker bench` (every answer
checked), wrk (status only) and, for the open loop S5b, h2load (status only), each run's
figures as a `Measure` (benchmarks/run.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

from bench_servers import HERE, LIMIT, MCP_SERVERS, PY, ROOT, _req
from proc_cpu import Cpu, CpuWatch

# ---------------------------------------------------------------------------------------------
# Scenarios and load


@dataclasses.dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    method: str
    params: dict[str, object]
    connections: int
    batch: int = 1
    open_loop: bool = False
    rate_of: str = "reference"  # open loop: offered at half this server's S1 capacity
    servers: tuple[str, ...] = ()  # the servers it runs (empty: all)
    mcp: bool = False  # tools/call of `method` with `params` at the server's /mcp (`rpc-broker bench --mcp`)

    def body(self) -> bytes:
        if self.batch == 1:
            return json.dumps(_req(self.method, self.params, 1)).encode()
        return json.dumps([_req(self.method, self.params, i) for i in range(self.batch)]).encode()


def scenarios(fib_n: int, mcp_fib_n: int) -> list[Scenario]:
    """Every scenario; `fib_n` sized to about 2 ms a call (S3), `mcp_fib_n` to about 10 (M3)."""
    mcp = {"servers": MCP_SERVERS, "mcp": True}
    return [
        Scenario("S1-16", "S1: single `add` calls, 16 connections", "add", {"a": 1, "b": 2}, 16),
        Scenario("S1-64", "S1: single `add` calls, 64 connections", "add", {"a": 1, "b": 2}, 64),
        Scenario("S2", "S2: batches of 100 `add`, 16 connections", "add", {"a": 1, "b": 2}, 16, batch=100),
        Scenario("S3", f"S3: CPU-bound `fib({fib_n})` (about 2 ms per call here), 16 connections",
                 "fib", {"n": fib_n}, 16),
        Scenario("S4", "S4: I/O-bound `sleep(0.01)`, 1,000 connections (1,000 calls in flight)",
                 "sleep", {"seconds": 0.01}, 1000),
        Scenario("S5", "S5: open loop, single `add` calls at half the reference's S1 capacity, 64 connections",
                 "add", {"a": 1, "b": 2}, 64, open_loop=True),
        # Not a target: S5's rate is past what the broker can take on two shared cores, so
        # S5 measures its queue; this shows its latency at a rate it does sustain.
        Scenario("S5b", "S5b: open loop, single `add` calls at half broker-2w's own S1 capacity, 64 connections",
                 "add", {"a": 1, "b": 2}, 64, open_loop=True, rate_of="broker-2w",
                 servers=("reference", LIMIT, "broker-2w", "broker-1w")),
        Scenario("M1-16", "M1: MCP `tools/call` of `add`, 16 connections", "add", {"a": 1, "b": 2}, 16, **mcp),
        Scenario("M1-64", "M1: MCP `tools/call` of `add`, 64 connections", "add", {"a": 1, "b": 2}, 64, **mcp),
        Scenario("M3-4", f"M3: MCP `tools/call` of CPU-bound `fib({mcp_fib_n})` (about 10 ms per call here), "
                 "4 connections", "fib", {"n": mcp_fib_n}, 4, **mcp),
        Scenario("M3-16", f"M3: MCP `tools/call` of CPU-bound `fib({mcp_fib_n})` (about 10 ms per call here), "
                 "16 connections", "fib", {"n": mcp_fib_n}, 16, **mcp),
    ]


@dataclasses.dataclass
class Measure:
    rps: float
    cps: float
    p50: float
    p99: float
    p999: float | None
    ok: bool
    problem: str = ""
    cpu: Cpu | None = None  # the CPU the server's processes and the load tool spent in the run


def _costed(m: Measure, watch: CpuWatch, busy: float) -> Measure:
    """`m` with `watch`'s CPU, over the calls answered in `busy` seconds of load at its rate."""
    if watch.cpu is not None:
        watch.cpu.calls = m.cps * busy
    m.cpu = watch.cpu
    return m


def loadgen_command(given: str | None = None) -> list[str] | None:
    """How to run `rpc-broker bench` (`given`: the command before `bench`, shell-quoted), or None
    when there is no such command."""
    exe = Path(PY).parent / "rpc-broker"
    cmd = shlex.split(given) if given else [str(exe)] if exe.exists() else [PY, "-m", "broker"]
    try:
        done = subprocess.run([*cmd, "bench", "--help"], capture_output=True, timeout=60, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return cmd if done.returncode == 0 else None


def run_loadgen(cmd: list[str], url: str, sc: Scenario, duration: float, warmup: float,
                rate: float | None, tmp: Path, pid: int | None = None) -> Measure:
    """One run of `rpc-broker bench`; `pid`: the server's process, whose CPU (and its
    children's) is read from /proc around the run."""
    out = tmp / "loadgen.json"
    out.unlink(missing_ok=True)
    argv = [*cmd, "bench", url, "--connections", str(sc.connections), "--depth", "1",
            *(("--mcp", "--tool", sc.method, "--arguments") if sc.mcp else ("--method", sc.method, "--params")),
            json.dumps(sc.params), "--duration", str(duration), "--warmup", str(warmup), "--json", str(out), "--quiet"]
    if sc.batch > 1:
        argv += ["--batch", str(sc.batch)]
    if rate is not None:
        argv += ["--rate", str(round(rate))]
    try:
        with CpuWatch(pid) as watch:
            done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=duration + warmup + 120)
    except subprocess.TimeoutExpired:
        return Measure(0, 0, 0, 0, None, False, "rpc-broker bench did not finish in time")
    try:
        r = json.loads(out.read_text())
    except (OSError, ValueError):
        tail = (done.stderr or done.stdout).strip()[-300:]
        return Measure(0, 0, 0, 0, None, False, f"rpc-broker bench exited {done.returncode}: {tail}")
    lat = r.get("latency_ms", {})
    errors = {k: v for k, v in (r.get("errors_by_code") or {}).items() if v}
    check = r.get("check") or {}
    tool_errors = (r.get("mcp") or {}).get("tool_errors") or {}  # MCP: isError results are no success either
    ok = bool(check.get("ok")) and not errors and not tool_errors and not r.get("transport_errors")
    problem = "" if ok else json.dumps({"check": check, "errors_by_code": errors, "tool_errors": tool_errors,
                                         "transport_errors": r.get("transport_errors")})[:300]
    if lat.get("p50") is None or lat.get("p99") is None:  # nothing was answered: no latency to report
        return Measure(float(r["requests_per_s"]), float(r["calls_per_s"]), 0, 0, None, False,
                       problem or "no answer was timed")
    m = Measure(float(r["requests_per_s"]), float(r["calls_per_s"]), float(lat["p50"]), float(lat["p99"]),
                float(lat["p99.9"]) if lat.get("p99.9") is not None else None, ok, problem)
    return _costed(m, watch, warmup + duration)  # (the warm-up runs at the same rate)


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)$", text)
    if not m:
        raise ValueError(text)
    value, unit = float(m.group(1)), m.group(2)
    return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value


def run_wrk(url: str, sc: Scenario, duration: float, tmp: Path, pid: int | None = None) -> Measure:
    """One run of wrk (1 thread); `pid` as for `run_loadgen`."""
    body = tmp / f"{sc.key}.json"
    body.write_bytes(sc.body())
    seconds = max(1, round(duration))
    try:
        with CpuWatch(pid) as watch:
            done = subprocess.run(
                ["wrk", "-t1", f"-c{sc.connections}", f"-d{seconds}s", "--latency", "-s", str(HERE / "wrk_post.lua"),
                 url], env={**os.environ, "BODY": str(body)}, capture_output=True, text=True, timeout=duration + 120)
    except subprocess.TimeoutExpired:
        return Measure(0, 0, 0, 0, None, False, "wrk did not finish in time")
    out = done.stdout
    try:
        rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
        p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
        p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        return Measure(0, 0, 0, 0, None, False, f"wrk exited {done.returncode}: {(done.stderr or out)[-300:]}")
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    problem = " ".join(m.group(0) for m in (bad, errors) if m)
    return _costed(Measure(rps, rps * sc.batch, p50, p99, None, not bad and not errors, problem), watch, seconds)


def run_h2load(url: str, sc: Scenario, duration: float, warmup: float, rate: float, tmp: Path,
               pid: int | None = None) -> Measure:
    """One open-loop run of h2load (nghttp2's, HTTP/1.1: `--h1`) at `rate` req/s over
    `sc.connections` connections (`--rps`, per connection, rounded: the rate offered is that
    times the connections), its latencies (ms) read from its per-request log (the main
    duration's); `pid` as for `run_loadgen`. A native open-loop generator: on two shared cores
    `rpc-broker bench`'s own CPU sets the tails of an open loop (issue 14, item 4)."""
    body = tmp / f"{sc.key}.json"
    body.write_bytes(sc.body())
    log = tmp / "h2load.log"
    log.unlink(missing_ok=True)
    per = max(1, round(rate / sc.connections))
    seconds = max(1, round(duration))
    try:
        with CpuWatch(pid) as watch:
            done = subprocess.run(
                ["h2load", "--h1", f"-c{sc.connections}", f"--rps={per}", f"-D{seconds}",
                 f"--warm-up-time={max(1, round(warmup))}", "-d", str(body), "-H", "content-type: application/json",
                 f"--log-file={log}", url], capture_output=True, text=True, timeout=seconds + warmup + 120)
    except subprocess.TimeoutExpired:
        return Measure(0, 0, 0, 0, None, False, "h2load did not finish in time")
    try:
        rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
        rows = [(int(r[0]), int(r[1]), int(r[2])) for r in rows]
    except (OSError, ValueError, IndexError):
        return Measure(0, 0, 0, 0, None, False, f"h2load exited {done.returncode}: {(done.stderr or done.stdout)[-300:]}")
    if not rows:  # (the log holds the main duration's requests only, not the warm-up's)
        return Measure(0, 0, 0, 0, None, False, f"h2load timed no request: {(done.stderr or done.stdout)[-300:]}")
    ms = sorted(r[2] / 1000 for r in rows)
    bad = sum(1 for r in rows if r[1] != 200)
    failed = re.search(r"requests: .*?(\d+) failed, (\d+) errored, (\d+) timeout", done.stdout)
    problem = f"{bad} non-200" if bad else ""
    if failed and any(int(g) for g in failed.groups()):
        problem = (problem + " " + failed.group(0)).strip()

    def q(p: float) -> float:
        return ms[min(len(ms) - 1, int(p * len(ms)))]

    rps = len(rows) / seconds
    return _costed(Measure(rps, rps * sc.batch, q(0.5), q(0.99), q(0.999), not problem, problem), watch,
                   seconds + max(1, round(warmup)))


def calibrate_fib(target_ms: float = 2.0) -> int:
    """The n for which this interpreter's recursive fib takes closest to `target_ms`."""
    from broker.demo import _fib

    best_n, best_gap = 15, float("inf")
    for n in range(12, 30):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            _fib(n)
            times.append((time.perf_counter() - t0) * 1000)
        took = min(times)
        if abs(took - target_ms) < best_gap:
            best_n, best_gap = n, abs(took - target_ms)
        if took > target_ms:
            break
    return best_n

