"""What one connection's share of the workers' places (`connection_share`) costs and buys.

Usage: .venv/bin/python benchmarks/connection_share.py [--before DIR] [--rounds 5] [--sleep 3]

Two measures, on a real broker of 2 workers (`worker_concurrency` 100: 200 places, a
connection's share 100), each round on this tree and, with `--before DIR` (another checkout,
for example a `git worktree` at an older commit), on that one, alternating, so that the
machine's noise hits both alike:

- buys: one client posts a batch of 250 `sleep(--sleep)` calls (more long calls than the
  workers have places; hostile testing, round 53) while another client sends `add` calls one
  after another on its own connection. Prints that client's `add` latency (p50, max) while the
  batch runs, and how long the batch took.
- costs: one connection posting batches of 1000 `add` calls (past its share: cut into chunks
  of the share over the workers) and of 100 (within it: one chunk a worker, as before), one
  after another; prints calls per second, and this tree's rate over the other's (a ratio of
  medians).

Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import ROOT, start_broker  # noqa: E402  (the same launcher the tests use)

HEADERS = {"Content-Type": "application/json"}


def batch(n: int, method: str, params: list[object]) -> bytes:
    return json.dumps([{"jsonrpc": "2.0", "method": method, "params": params, "id": i} for i in range(n)]).encode()


def rate(port: int, n: int, rounds: int) -> float:
    """Calls a second of one connection posting batches of `n` `add` calls one after another."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = batch(n, "add", [1, 2])
    for _ in range(3):  # warm up
        conn.request("POST", "/", body, HEADERS)
        conn.getresponse().read()
    start = time.perf_counter()
    for _ in range(rounds):
        conn.request("POST", "/", body, HEADERS)
        conn.getresponse().read()
    conn.close()
    return n * rounds / (time.perf_counter() - start)


def beside_a_long_batch(port: int, seconds: float) -> dict[str, float]:
    """Another client's `add` latencies (ms) while one batch of 250 sleep calls runs."""
    done = threading.Event()
    took: list[float] = []

    def flood() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        start = time.perf_counter()
        conn.request("POST", "/", batch(250, "sleep", [seconds]), HEADERS)
        conn.getresponse().read()
        took.append(time.perf_counter() - start)
        done.set()

    thread = threading.Thread(target=flood)
    thread.start()
    time.sleep(0.1)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    add = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}).encode()
    latencies: list[float] = []
    end = time.monotonic() + 20 * seconds
    while not done.is_set() and time.monotonic() < end:
        start = time.perf_counter()
        conn.request("POST", "/", add, HEADERS)
        conn.getresponse().read()
        latencies.append(time.perf_counter() - start)
        time.sleep(0.002)
    thread.join()
    latencies.sort()
    return {"add p50 ms": latencies[len(latencies) // 2] * 1000, "add max ms": latencies[-1] * 1000,
            "batch s": took[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout, measured in alternating rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=3.0, help="seconds each call of the long batch sleeps")
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    brokers = {name: start_broker("--workers", "2", "--worker-concurrency", "100", "--method-timeout",
                                  f"sleep={max(30.0, 4 * args.sleep)}", cwd=tree) for name, tree in trees}
    rates: dict[str, dict[int, list[float]]] = {name: {1000: [], 100: []} for name, _ in trees}
    beside: dict[str, dict[str, float]] = {}
    try:
        for name, _ in trees:
            beside[name] = beside_a_long_batch(brokers[name].port, args.sleep)
        for _ in range(args.rounds):
            for name, _ in trees:
                rates[name][1000].append(rate(brokers[name].port, 1000, 15))
                rates[name][100].append(rate(brokers[name].port, 100, 80))
    finally:
        for broker in brokers.values():
            broker.stop()
    print(f"Beside one batch of 250 sleep({args.sleep:g}) on 2 workers of 100 places:")
    print("| tree | another client's add p50 ms | its max ms | the batch took s |")
    print("|---|---|---|---|")
    for name, row in beside.items():
        print(f"| {name} | {row['add p50 ms']:.1f} | {row['add max ms']:.0f} | {row['batch s']:.2f} |")
    print(f"\nOne connection's batches of `add`, calls/s (median of {args.rounds} rounds):")
    print("| tree | batches of 1000 | batches of 100 |")
    print("|---|---|---|")
    for name, by_size in rates.items():
        print(f"| {name} | {statistics.median(by_size[1000]):,.0f} | {statistics.median(by_size[100]):,.0f} |")
    if args.before:
        for size in (1000, 100):
            ratio = statistics.median(rates["this tree"][size]) / statistics.median(rates["before"][size])
            print(f"batches of {size}: this tree / before = {ratio:.2f}")


if __name__ == "__main__":
    main()
