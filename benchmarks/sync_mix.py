"""Fast calls beside slow sync calls: their latency with sync-aware routing off and on.

Usage: .venv/bin/python benchmarks/sync_mix.py [--duration 5] [--rounds 2] [--rates 200,1000]
                                               [--slow-clients 1,2] [--write]

Starts three real brokers side by side, each `--workers 2` serving tests/apps/mixed.py
(default `worker_concurrency` 100): one with `--sync-prefetch 100` (routing off: a
worker busy in a sync call is picked like any other, the broker before issue 9 item
23), one with `--sync-prefetch 1` (routing on, a call sent behind a slow one; the
default until hostile testing, round 90) and one with the default 0 (routing on, calls
wait in the broker's queue for the first worker free). On each, in alternating
rounds so the machine's noise hits both alike: `--slow-clients` clients call the sync
`block(0.2)` back to back (each blocks a worker's whole process for 0.2 s), while fast
calls go out open loop at each of `--rates` per second, alternating the sync `add` and
the async `wait(0.005)` (5 ms of I/O), each on a free keep-alive connection. A fast call's latency runs from
the moment it was due (no coordinated omission) to its answer. Prints, per number of
slow clients, rate and mode, the fast calls' p50, p99 and max and the slow calls done
(the more fast calls are in flight, the more often routing off ties the blocked worker
with the free one and sends fast calls to wait behind `block`); `--write` also puts
the table into benchmarks/RESULTS.md (section "Slow sync calls beside fast ones",
replaced if present). Every answer is checked. Prints figures only: nothing here is a test.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import Broker, start_broker  # noqa: E402  (the same launcher the tests use)
from results_md import put_section  # noqa: E402  (benchmarks/, this script's directory)

MODES = {
    "off (--sync-prefetch 100)": ["--sync-prefetch", "100"],
    "on (--sync-prefetch 1)": ["--sync-prefetch", "1"],
    "on (--sync-prefetch 0, the default)": [],
}
SLOW_SECONDS = 0.2
FAST_WAIT = 0.005


class Connections:
    """Keep-alive HTTP/1.1 connections to one broker, lent one request at a time."""

    def __init__(self, b: Broker) -> None:
        self.host, self.port, self.path = b.host.strip("[]"), b.port, b.path
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.all: list[asyncio.StreamWriter] = []

    async def call(self, method: str, params: list[object], id_: int) -> object:
        """One call on an idle connection (a new one if none is idle); its result.
        Raises RuntimeError if the answer is not a result with that id."""
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            self.all.append(writer)
        body = json.dumps({"jsonrpc": "2.0", "method": method, "params": params, "id": id_}).encode()
        writer.write(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (self.path.encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        answer = json.loads(await reader.readexactly(length))
        self.idle.append((reader, writer))
        if answer.get("id") != id_ or "result" not in answer:
            raise RuntimeError(f"{method}: unexpected answer {answer}")
        return answer["result"]

    def close(self) -> None:
        for writer in self.all:
            writer.close()


async def measure(b: Broker, duration: float, rate: float, slow_clients: int) -> tuple[list[float], int]:
    """Run the mix on `b` for `duration` s: (fast calls' latencies in s, slow calls done)."""
    conns = Connections(b)
    loop = asyncio.get_running_loop()
    stop = loop.time() + duration
    slow_done = 0

    async def slow() -> None:
        nonlocal slow_done
        n = 0
        while loop.time() < stop:
            n += 1
            await conns.call("block", [SLOW_SECONDS], n)
            slow_done += 1

    latencies: list[float] = []

    async def fast(i: int, due: float) -> None:
        if i % 2:
            assert await conns.call("add", [i, 1], i) == i + 1
        else:
            assert await conns.call("wait", [FAST_WAIT], i) == FAST_WAIT
        latencies.append(loop.time() - due)

    try:
        for i in range(20):  # warm-up: every method answered once (the broker learns their times)
            await conns.call("add" if i % 2 else "wait", [i, 1] if i % 2 else [FAST_WAIT], i)
        await conns.call("block", [SLOW_SECONDS], 0)
        slows = [asyncio.ensure_future(slow()) for _ in range(slow_clients)]
        await asyncio.sleep(0.05)  # the slow calls under way first
        start = loop.time()
        tasks = []
        for i in range(int(duration * rate)):
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - loop.time()))
            tasks.append(asyncio.ensure_future(fast(i, due)))
        await asyncio.gather(*tasks, *slows)
    finally:
        conns.close()
    return latencies, slow_done


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per round (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating (default 2)")
    parser.add_argument("--rates", default="200,1000", help="fast calls per second, comma-separated (default 200,1000)")
    parser.add_argument("--slow-clients", default="1,2", help="comma-separated counts to run (default 1,2)")
    parser.add_argument("--write", action="store_true", help="put the table into benchmarks/RESULTS.md")
    args = parser.parse_args()
    slow_counts = [int(n) for n in args.slow_clients.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    brokers = {mode: start_broker("--workers", "2", "--app", "tests.apps.mixed:registry", "--log-level",
                                  "warning", *flags) for mode, flags in MODES.items()}
    rows = []
    try:
        for slow_clients in slow_counts:
            for rate in rates:
                results: dict[str, tuple[list[float], int]] = {mode: ([], 0) for mode in MODES}
                for _ in range(args.rounds):
                    for mode, b in brokers.items():
                        latencies, slow_done = asyncio.run(measure(b, args.duration, rate, slow_clients))
                        results[mode] = (results[mode][0] + latencies, results[mode][1] + slow_done)
                for mode, (latencies, slow_done) in results.items():
                    rows.append((slow_clients, rate, mode, len(latencies), statistics.median(latencies) * 1e3,
                                 quantile(latencies, 0.99) * 1e3, max(latencies) * 1e3,
                                 slow_done / (args.rounds * args.duration)))
    finally:
        for b in brokers.values():
            b.stop()
    header = (f"2 workers, worker_concurrency 100; fast calls (`add` sync, `wait({FAST_WAIT})` async, alternating) open loop "
              f"at a fixed rate beside clients calling the sync `block({SLOW_SECONDS})` back to back; "
              f"{args.rounds} rounds of {args.duration:g} s per mode, alternating; {os.cpu_count()} CPUs, "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    table = ["| slow clients | fast calls/s | sync routing | fast calls | p50 ms | p99 ms | max ms | slow calls/s |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    table += [f"| {s} | {rate:g} | {mode} | {n} | {p50:.2f} | {p99:.2f} | {mx:.2f} | {slow:.2f} |"
              for s, rate, mode, n, p50, p99, mx, slow in rows]
    print(header)
    print("\n".join(table))
    if args.write:
        write_results(header, table)
    return 0


def write_results(header: str, table: list[str]) -> None:
    """Put the table into RESULTS.md between its markers (appended the first time)."""
    put_section("sync_mix", [
        "## Slow sync calls beside fast ones",
        "",
        f"Written by `benchmarks/sync_mix.py --write` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        + header + ". A fast call's latency runs from when it was due to its answer.",
        "",
        "Routing off is the broker as it was before (issue 9 item 23), with the FIFO queue of item 12: a fast "
        "call whose least-loaded pick ties the worker busy in `block` with the free one goes behind `block` "
        "and waits up to 0.2 s, the more often the more fast calls are in flight. Routing on makes the busy "
        "worker the last choice, holding at most `sync_prefetch` other calls, and a `block` call goes at "
        "once to the least busy worker not blocked already (no worker is held for it: a hold let one short "
        "sync call behind two long polls stall every async call): the fast calls in flight there when it "
        "arrives wait behind it (at 1000/s of 5 ms calls a few on each worker), but of the calls sent after "
        "it at most `sync_prefetch` (0 by default since hostile testing, round 90: with 1, a fast call sent "
        "behind a sync call of unknown length, one of a method fast for other params, waited all of it "
        "while the other worker freed in 1.5 ms). With as many slow clients as workers, every worker is mostly blocked "
        "and routing cannot make room: with it on, a slow call never waits behind another slow call, so "
        "each worker takes the next `block` as soon as it is free (more slow calls/s) and fast calls get "
        "the gaps; with it off, a `block` sometimes queues behind another on the same worker and leaves the "
        "other worker free for fast calls for a while, and fast calls wait behind `block`. (With a worker "
        "held for each `block` until it was down to `sync_prefetch` calls, fast calls' p99 was 223 and "
        "264 ms at 2 slow clients (2026-12-01 22:14 UTC): the fast calls in flight were let finish first. "
        "The hold is gone all the same: it let one short sync call behind two long polls stall every "
        "async call.)",
        "",
        *table,
    ])


if __name__ == "__main__":
    sys.exit(main())
