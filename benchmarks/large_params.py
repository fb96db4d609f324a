"""Another client's calls beside a flood of large params: with `max_worker_params_bytes` and without.

Usage: .venv/bin/python benchmarks/large_params.py [--duration 8] [--rounds 2] [--connections 12]
                                                   [--calls 16] [--kib 1024] [--write]

Starts two real brokers, each `--workers 2` serving tests/apps/mixed.py: one with the default
`max_worker_params_bytes` (4 MiB) and one with 0 (no bound, the broker before hostile testing,
round 92). On each in turn (alternating rounds; one broker under load at a time, as two loaded
side by side disturb each other on a small machine), `--connections` NDJSON connections each
send `--calls` pipelined calls of `hold(data, 0.2)` whose `data` is `--kib` KiB of `[{},{},...]`
(the worst case to bind: one small object per 3 bytes), wait for their answers and send again,
while one honest client calls `add` back to back over HTTP keep-alive. Prints, per mode, the
honest calls' count, p50, p99 and max; the flood's answers by outcome; and the workers' largest
RSS seen (sampled every 0.2 s). `--write` also puts the table into benchmarks/RESULTS.md
(section "Large params beside another client's calls", replaced if present). Every answer is
checked. Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import Broker, free_port, start_broker  # noqa: E402  (the same launcher the tests use)
from results_md import put_section  # noqa: E402  (benchmarks/, this script's directory)

MODES = {"bounded (max_worker_params_bytes 4 MiB, the default)": [], "unbounded (max_worker_params_bytes 0)": ["0"]}


async def flood(port: int, stop: float, calls: int, data: bytes, outcomes: dict[str, int]) -> None:
    """One connection: `calls` pipelined calls of hold(data, 0.2), their answers, again, until `stop`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    loop = asyncio.get_running_loop()
    try:
        n = 0
        while loop.time() < stop:
            lines = []
            for _ in range(calls):
                n += 1
                lines.append(b'{"jsonrpc":"2.0","method":"hold","params":{"data":%s,"seconds":0.2},"id":%d}\n' % (data, n))
            writer.write(b"".join(lines))
            ids = set(range(n - calls + 1, n + 1))
            for _ in range(calls):
                answer = json.loads(await reader.readline())
                ids.remove(answer["id"])  # (KeyError: an id not sent, or answered twice)
                key = "ok" if "result" in answer else str(answer["error"]["code"])
                outcomes[key] = outcomes.get(key, 0) + 1
    finally:
        writer.close()


async def honest(b: Broker, stop: float, latencies: list[float]) -> None:
    """`add` calls back to back on one keep-alive HTTP connection until `stop`."""
    reader, writer = await asyncio.open_connection(b.host.strip("[]"), b.port)
    loop = asyncio.get_running_loop()
    try:
        i = 0
        while loop.time() < stop:
            i += 1
            body = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [i, 1], "id": i}).encode()
            started = loop.time()
            writer.write(b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            answer = json.loads(await reader.readexactly(length))
            if answer != {"jsonrpc": "2.0", "id": i, "result": i + 1}:
                raise RuntimeError(f"add: unexpected answer {answer}")
            latencies.append(loop.time() - started)
    finally:
        writer.close()


async def sample_rss(b: Broker, stop: float, peak: list[int]) -> None:
    """The workers' largest RSS (bytes), every 0.2 s until `stop`."""
    loop = asyncio.get_running_loop()
    while loop.time() < stop:
        for child in psutil.Process(b.pid).children():
            try:
                peak[0] = max(peak[0], child.memory_info().rss)
            except psutil.Error:
                pass
        await asyncio.sleep(0.2)


async def measure(b: Broker, port: int, args: argparse.Namespace, data: bytes) -> tuple[list[float], dict[str, int], int]:
    loop = asyncio.get_running_loop()
    stop = loop.time() + args.duration
    latencies: list[float] = []
    outcomes: dict[str, int] = {}
    peak = [0]
    await asyncio.gather(
        honest(b, stop, latencies), sample_rss(b, stop, peak),
        *(flood(port, stop, args.calls, data, outcomes) for _ in range(args.connections)),
    )
    return latencies, outcomes, peak[0]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per round (default 8)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating (default 2)")
    parser.add_argument("--connections", type=int, default=12, help="flooding connections (default 12)")
    parser.add_argument("--calls", type=int, default=16, help="pipelined calls per flooding connection (default 16)")
    parser.add_argument("--kib", type=int, default=1024, help="KiB of params per call (default 1024)")
    parser.add_argument("--write", action="store_true", help="put the table into benchmarks/RESULTS.md")
    args = parser.parse_args()
    data = b"[" + b"{}," * (args.kib * 1024 // 3 - 1) + b"{}]"
    brokers: dict[str, tuple[Broker, int]] = {}
    try:
        for mode, bound in MODES.items():
            port = free_port()
            flags = ["--workers", "2", "--app", "tests.apps.mixed:registry", "--log-level", "warning",
                     "--stream-port", str(port), "--max-body-bytes", str(args.kib * 1024 + 4096)]
            brokers[mode] = (start_broker(*flags, *(["--max-worker-params-bytes", *bound] if bound else [])), port)
        results: dict[str, tuple[list[float], dict[str, int], int]] = {mode: ([], {}, 0) for mode in MODES}
        for _ in range(args.rounds):
            for mode, (b, port) in brokers.items():
                latencies, outcomes, peak = asyncio.run(measure(b, port, args, data))
                total = results[mode]
                for key, n in outcomes.items():
                    total[1][key] = total[1].get(key, 0) + n
                results[mode] = (total[0] + latencies, total[1], max(total[2], peak))
                time.sleep(1)  # (the last round's calls end)
    finally:
        for b, _port in brokers.values():
            b.stop()
    header = (f"2 workers; {args.connections} NDJSON connections each keeping {args.calls} calls of `hold` with "
              f"{args.kib} KiB of `[{{}},{{}},...]` params in flight, beside one client calling `add` back to back; "
              f"{args.rounds} rounds of {args.duration:g} s per mode, alternating; {os.cpu_count()} CPUs, "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    table = ["| mode | `add` calls | p50 ms | p99 ms | max ms | flood answers | workers' largest RSS MB |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for mode, (latencies, outcomes, peak) in results.items():
        table.append(f"| {mode} | {len(latencies)} | {statistics.median(latencies) * 1e3:.1f} | "
                     f"{quantile(latencies, 0.99) * 1e3:.1f} | {max(latencies) * 1e3:.1f} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(outcomes.items()))} | {peak / 1e6:.0f} |")
    print(header)
    print("\n".join(table))
    if args.write:
        put_section("large_params", [
            "## Large params beside another client's calls", "",
            f"Written by `benchmarks/large_params.py --write` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
            + header + ". A worker binds each call's params on its loop (1 MiB of small objects: 35 to 55 ms and about "
            "24 MB); the worker's turns bound what one connection's calls cost another client, not what many "
            "connections' cost together. `max_worker_params_bytes` bounds the large params (16 KiB or more each) "
            "in one worker's calls in flight, and one connection's at half of all the workers'; past it such a "
            "call waits in the queue, its connection's calls held out of turn, and counts in `max_queue_bytes` "
            "there (past which it is refused -32000).",
            "", *table,
        ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
