"""The broker queue's turns by time for calls known to block: what they buy.

Usage: .venv/bin/python benchmarks/queue_turns.py [--before DIR] [--rounds 3] [--slow 0.2] [--short 0.003]

On a real broker of 1 worker serving a two-method app written to a temporary directory
(`slow(s)` and `short(s)`, each a sync `time.sleep(s)`: both block the worker), one client
sends `slow(--slow)` calls one at a time on a keep-alive connection, and another client
writes 32 `short(--short)` lines at once on an NDJSON stream. Prints how long the 32 took
(32 x --short of work); then, while 6 connections keep the worker's 100 places full of async
`poll(0.2)` calls, how long 8 pipelined `short(6 x --short)` take, on this tree and, with `--before DIR` (another checkout, for example
a `git worktree` at an older commit), on that one, alternating rounds, so that the machine's
noise hits both alike. Hostile testing, round 66: with one turn a call, the 32 went one to
each slow call (4 s for 96 ms of calls); round 68: with calls known to block costed by time and
the rest 1, the 8 went one to every 20 polls. For measuring a way of costing the queue's turns
against another (benchmarks/RESULTS.md: three were tried, and turns by call kept).

Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import ROOT, Broker, start_broker  # noqa: E402  (the same launcher the tests use)
from test_dispatch_e2e import ask_lines  # noqa: E402
from test_stream import free_port  # noqa: E402

APP = '''import time
from broker.worker import Registry
registry = Registry()


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


for name in ("slow", "short"):  # (two methods alike: the broker learns each one's time)
    registry.method(name=name)(nap)


@registry.method
async def poll(seconds: float) -> float:
    import asyncio

    await asyncio.sleep(seconds)
    return seconds
'''


def shorts(stream_port: int, seconds: float, n: int) -> float:
    """Seconds to the last answer of `n` `short(seconds)` lines written at once on a new
    NDJSON connection (each answer checked)."""
    lines = b"".join(b'{"jsonrpc":"2.0","method":"short","params":[%r],"id":%d}\n' % (seconds, k) for k in range(n))
    with socket.create_connection(("127.0.0.1", stream_port), timeout=120) as conn:
        start = time.perf_counter()
        got = ask_lines(conn, lines)
        took = time.perf_counter() - start
    assert got.count(b'"result"') == n, got
    return took


def one_round(b: Broker, stream_port: int, slow: float, short: float) -> float:
    """Seconds to the last of 32 pipelined `short` answers beside one client's `slow` calls."""
    assert b.call("slow", [slow])["result"] == slow and b.call("short", [short])["result"] == short  # (learnt)
    stop = threading.Event()
    done: list[float] = []

    def one_at_a_time() -> None:
        while not stop.is_set() and len(done) < 200:
            assert b.call("slow", [slow])["result"] == slow
            done.append(time.monotonic())

    thread = threading.Thread(target=one_at_a_time)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while len(done) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        took = shorts(stream_port, short, 32)
    finally:
        stop.set()
        thread.join(60)
    return took


def beside_polls(b: Broker, stream_port: int, short: float) -> float:
    """Seconds to the last of 8 pipelined `short(short * 6)` answers while 6 connections keep
    the worker's places full of `poll(0.2)` calls (hostile testing, round 68: costed 1 a call,
    they went 20 to one of a 20 ms call)."""
    seconds = short * 6
    assert b.call("poll", [0.2])["result"] == 0.2 and b.call("short", [seconds])["result"] == seconds  # (learnt)
    polls = b"".join(b'{"jsonrpc":"2.0","method":"poll","params":[0.2],"id":%d}\n' % k for k in range(300))
    attackers = [socket.create_connection(("127.0.0.1", stream_port), timeout=60) for _ in range(6)]
    try:
        for a in attackers:
            a.sendall(polls)
        time.sleep(0.5)
        took = shorts(stream_port, seconds, 8)
    finally:
        for a in attackers:
            a.close()
    time.sleep(1.0)  # (the polls of the closed connections end)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout, measured in alternating rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slow", type=float, default=0.2, help="seconds of each one-at-a-time call")
    parser.add_argument("--short", type=float, default=0.003, help="seconds of each of the 32 pipelined calls")
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    took: dict[str, list[float]] = {name: [] for name, _ in trees}
    polled: dict[str, list[float]] = {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "queue_turns_app.py").write_text(APP)
        streams = {name: free_port() for name, _ in trees}
        brokers = {
            name: start_broker("--workers", "1", "--timeout", "120", "--app", "queue_turns_app:registry",
                               "--stream-port", str(streams[name]), cwd=tree, env={"PYTHONPATH": tmp})
            for name, tree in trees
        }
        try:
            for _ in range(args.rounds):
                for name, _ in trees:
                    took[name].append(one_round(brokers[name], streams[name], args.slow, args.short))
                    polled[name].append(beside_polls(brokers[name], streams[name], args.short))
        finally:
            for broker in brokers.values():
                broker.stop()
    print(f"1 worker; one client's slow({args.slow}) one at a time; another's 32 short({args.short}) pipelined:")
    print(f"| tree | the 32 took s, median of {args.rounds} | max s |")
    print("|---|---|---|")
    for name, runs in took.items():
        print(f"| {name} | {statistics.median(runs):.3f} | {max(runs):.3f} |")
    if args.before:
        ratio = statistics.median(took["before"]) / statistics.median(took["this tree"])
        print(f"before / this tree = {ratio:.1f}")
    print(f"\nBeside 6 connections keeping the worker's places full of poll(0.2); 8 short({args.short * 6:g}) pipelined:")
    print(f"| tree | the 8 took s, median of {args.rounds} | max s |")
    print("|---|---|---|")
    for name, runs in polled.items():
        print(f"| {name} | {statistics.median(runs):.3f} | {max(runs):.3f} |")


if __name__ == "__main__":
    main()
