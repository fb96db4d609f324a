"""A worker's turns among clients (wire.py's flows): what they buy and cost.

Usage: .venv/bin/python benchmarks/worker_turns.py [--before DIR] [--rounds 5] [--fib 32]

On a real broker of 2 workers (the defaults: `worker_concurrency` 100, a connection's share
100) serving the demo, each measure on this tree and, with `--before DIR` (another checkout,
for example a `git worktree` at an older commit), on that one, alternating, so that the
machine's noise hits both alike:

- buys: hostile testing, round 60. A client calls `fib(1)` once, so that the broker learns
  the sync `fib` fast, then posts one batch of 100 `fib(--fib)` (50 a worker, sent as calls
  that do not block); another client sends `add` calls one after another on its own
  connection meanwhile. Prints that client's `add` latency (p50, max) while the batch runs,
  and how long the batch took. Then the same batch beside a client that writes 64 `add`
  lines at once on an NDJSON stream (pipelined): the time to its last answer. Then beside a
  client posting one batch of 1000 `add` (round 63: past its connection's share, 100 calls a
  round trip): how long it took, and alone.
- costs: one connection posting batches of 100 `add` one after another, and 8 connections
  each posting single `add` calls one after another (threads); calls per second, and this
  tree's rate over the other's (a ratio of medians).

Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import threading
import time
import typing
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from conftest import ROOT, start_broker  # noqa: E402  (the same launcher the tests use)
from connection_share import HEADERS, batch, rate  # noqa: E402
from test_dispatch_e2e import ask_lines  # noqa: E402
from test_stream import free_port  # noqa: E402

ADD = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}).encode()


def post(port: int, body: bytes, timeout: float = 120) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/", body, HEADERS)
    answer = conn.getresponse().read()
    conn.close()
    return answer


def learn_fib_fast(port: int) -> None:
    """Call `fib(1)` until the broker counts `fib` fast again (a moving average: after a batch
    of slow ones, one cheap call is not enough)."""
    for _ in range(60):
        post(port, json.dumps({"jsonrpc": "2.0", "method": "fib", "params": [1], "id": 0}).encode())


def beside_a_steered_batch(port: int, n: int) -> dict[str, float]:
    """Another client's `add` latencies (ms) while one batch of 100 fib(n) runs, `fib` learnt fast."""
    learn_fib_fast(port)
    done = threading.Event()
    took: list[float] = []

    def flood() -> None:
        start = time.perf_counter()
        answers = json.loads(post(port, batch(100, "fib", [n])))
        took.append(time.perf_counter() - start)
        assert all("result" in a for a in answers), answers[:3]
        done.set()

    thread = threading.Thread(target=flood)
    thread.start()
    time.sleep(0.05)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    latencies: list[float] = []
    end = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < end:
        start = time.perf_counter()
        conn.request("POST", "/", ADD, HEADERS)
        conn.getresponse().read()
        latencies.append(time.perf_counter() - start)
        time.sleep(0.002)
    thread.join()
    conn.close()
    latencies.sort()
    return {"add p50 ms": latencies[len(latencies) // 2] * 1000, "add max ms": latencies[-1] * 1000,
            "n": len(latencies), "batch s": took[0]}


def pipelined_beside_a_steered_batch(port: int, stream_port: int, n: int) -> dict[str, float]:
    """Seconds to the last of 64 pipelined NDJSON `add` answers while one batch of 100 fib(n) runs."""
    learn_fib_fast(port)
    took: list[float] = []
    thread = threading.Thread(target=lambda: took.append(_timed(lambda: post(port, batch(100, "fib", [n])))))
    thread.start()
    time.sleep(0.05)
    lines = b"".join(b'{"jsonrpc":"2.0","method":"add","params":[1,2],"id":%d}\n' % k for k in range(64))
    with socket.create_connection(("127.0.0.1", stream_port), timeout=120) as conn:
        start = time.perf_counter()
        ask_lines(conn, lines)
        last = time.perf_counter() - start
    thread.join()
    return {"last s": last, "batch s": took[0]}


def batch_beside_a_steered_batch(port: int, n: int) -> dict[str, float]:
    """Seconds another client's batch of 1000 `add` takes while one batch of 100 fib(n) runs
    (hostile testing, round 63: past its share, it went 100 calls a round trip, each behind a
    slow call), and alone after it."""
    learn_fib_fast(port)
    took: list[float] = []
    thread = threading.Thread(target=lambda: took.append(_timed(lambda: post(port, batch(100, "fib", [n])))))
    thread.start()
    time.sleep(0.05)
    beside = _timed(lambda: post(port, batch(1000, "add", [1, 2])))
    thread.join()
    return {"beside s": beside, "alone s": _timed(lambda: post(port, batch(1000, "add", [1, 2]))), "batch s": took[0]}


def _timed(work: typing.Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def singles(port: int, connections: int, seconds: float) -> float:
    """Calls a second of `connections` connections each posting single `add` calls in turn."""
    counts = [0] * connections
    stop = time.monotonic() + seconds

    def one(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while time.monotonic() < stop:
            conn.request("POST", "/", ADD, HEADERS)
            conn.getresponse().read()
            counts[k] += 1
        conn.close()

    threads = [threading.Thread(target=one, args=(k,)) for k in range(connections)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout, measured in alternating rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fib", type=int, default=32, help="n of the batch's fib(n) calls (0..35)")
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    streams = {name: free_port() for name, _ in trees}
    brokers = {name: start_broker("--workers", "2", "--timeout", "120", "--stream-port", str(streams[name]), cwd=tree)
               for name, tree in trees}
    rates: dict[str, dict[str, list[float]]] = {name: {"batch": [], "singles": []} for name, _ in trees}
    beside: dict[str, dict[str, float]] = {}
    pipelined: dict[str, dict[str, float]] = {}
    batches: dict[str, dict[str, float]] = {}
    try:
        for name, _ in trees:
            beside[name] = beside_a_steered_batch(brokers[name].port, args.fib)
        for name, _ in trees:
            pipelined[name] = pipelined_beside_a_steered_batch(brokers[name].port, streams[name], args.fib)
        for name, _ in trees:
            batches[name] = batch_beside_a_steered_batch(brokers[name].port, args.fib)
        for _ in range(args.rounds):
            for name, _ in trees:
                rates[name]["batch"].append(rate(brokers[name].port, 100, 80))
                rates[name]["singles"].append(singles(brokers[name].port, 8, 2.0))
    finally:
        for broker in brokers.values():
            broker.stop()
    print(f"Beside one batch of 100 fib({args.fib}) on 2 workers, `fib` learnt fast from fib(1):")
    print("| tree | another client's add p50 ms | its max ms | adds | the batch took s |")
    print("|---|---|---|---|---|")
    for name, row in beside.items():
        print(f"| {name} | {row['add p50 ms']:.1f} | {row['add max ms']:.0f} | {row['n']:.0f} | {row['batch s']:.2f} |")
    print("\nBeside the same batch, another client's 64 pipelined NDJSON `add` lines:")
    print("| tree | its last answer s | the batch took s |")
    print("|---|---|---|")
    for name, row in pipelined.items():
        print(f"| {name} | {row['last s']:.2f} | {row['batch s']:.2f} |")
    print("\nBeside the same batch, another client's batch of 1000 `add` (past its share: 100 at a time):")
    print("| tree | it took s | alone s | the fib batch took s |")
    print("|---|---|---|---|")
    for name, row in batches.items():
        print(f"| {name} | {row['beside s']:.3f} | {row['alone s']:.3f} | {row['batch s']:.2f} |")
    print(f"\n`add` calls/s (median of {args.rounds} rounds):")
    print("| tree | one connection, batches of 100 | 8 connections, single calls |")
    print("|---|---|---|")
    for name, by in rates.items():
        print(f"| {name} | {statistics.median(by['batch']):,.0f} | {statistics.median(by['singles']):,.0f} |")
    if args.before:
        for what in ("batch", "singles"):
            ratio = statistics.median(rates["this tree"][what]) / statistics.median(rates["before"][what])
            print(f"{what}: this tree / before = {ratio:.2f}")


if __name__ == "__main__":
    main()
