"""How long one read of many tiny pipelined HTTP requests holds the event loop from others.

Usage: .venv/bin/python benchmarks/pipelined_reads.py [--duration 4] [--rounds 2] [--block 262144]
                                                    [--only SHAPE ...]

httptools parses a whole read in one `feed_data` call, and each request in it is routed
(answered, or dispatched) before the loop serves another connection; reading pauses past
PIPELINE_HIGH requests owed, but only after the read is done. uvloop reads up to 256 KB
at a time, so one read can hold thousands of requests. Over NDJSON, a read's lines are
handled 16 per loop turn (stream.LINES_PER_TURN).

Starts one real broker (`--workers 1`). A victim does `GET /healthz` round trips one
after another on a keep-alive connection; beside it, an attacker (a separate process,
so the victim's timing does not share its GIL) writes `--block` bytes of pipelined tiny
requests at a time on one connection, as fast as the broker takes them, and reads every
answer. Shapes: `GET /healthz` (36 bytes, answered at once), a POST to a missing path
(404), a POST of an invalid request (`{}`: answered -32600 without a worker), a POST
of an `add` call (dispatched to the worker), and, as the reference, the same `add`
calls as NDJSON lines on the stream port. Prints the victim's round trip p50, p99 and
max, and the attacker's requests per second, per shape, in alternating rounds (the
machine's noise hits all alike). The victim's max is about the longest time the loop
spent on one read. Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import Broker, start_broker  # noqa: E402  (the same launcher the tests use)


def http_request(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if method == "GET":
        return head.encode() + b"\r\n"
    return (head + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


ADD = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}, separators=(",", ":")).encode()
BIG = b'{"jsonrpc":"2.0","method":"nope","params":["' + b"a" * 1_000_000 + b'"],"id":1}'
BIG_LINE = b'{"jsonrpc":"2.0","method":"nope","params":["' + b"a" * 250_000 + b'"],"id":1}'
SHAPES = {
    "GET /healthz": ("http", http_request("GET", "/healthz")),
    "POST /nope (404)": ("http", http_request("POST", "/nope", b"{}")),
    "POST {} (-32600)": ("http", http_request("POST", "/", b"{}")),
    "POST add (worker)": ("http", http_request("POST", "/", ADD)),
    "NDJSON add (worker)": ("stream", ADD + b"\n"),
    # Large bodies (hostile testing): libuv reads a connection up to 32 times in a row, so
    # without a per-turn bound one client's 1 MiB bodies were decoded 8 at a time.
    "POST 1 MB, unknown method": ("http", http_request("POST", "/", BIG)),
    "NDJSON 256 KB lines, unknown method": ("stream", BIG_LINE + b"\n"),
}


def attack(port: int, unit: bytes, block_bytes: int, seconds: float, done: multiprocessing.Value) -> None:  # type: ignore[valid-type]
    """Write blocks of `unit` repeated on one connection for `seconds`; count the answers."""
    block = unit * max(1, block_bytes // len(unit))
    per_block = max(1, block_bytes // len(unit))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    marker = b"HTTP/1.1 " if not unit.endswith(b"\n") else b"\n"
    answers = [0]

    def read() -> None:
        tail = b""
        try:
            while chunk := sock.recv(1 << 20):
                data = tail + chunk
                answers[0] += data.count(marker)
                tail = data[-len(marker) + 1:] if len(marker) > 1 else b""
        except OSError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < deadline:
        sock.sendall(block)
        sent += per_block
        while sent - answers[0] > 4 * per_block and time.monotonic() < deadline:
            time.sleep(0.001)  # at most a few blocks in flight: the broker's reads stay full-size
    done.value = answers[0]
    sock.close()


def victim(b: Broker, seconds: float) -> list[float]:
    """`GET /healthz` round trips, one after another, for `seconds`: their durations."""
    sock = socket.create_connection(("127.0.0.1", b.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = http_request("GET", "/healthz")
    times = []
    deadline = time.monotonic() + seconds
    buf = b""
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        sock.sendall(request)
        while b'{"status":"ok"}' not in buf:
            buf += sock.recv(65536)
        times.append(time.perf_counter() - t0)
        buf = buf.partition(b'{"status":"ok"}')[2]
        time.sleep(0.002)
    sock.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per round (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per shape, alternating (default 2)")
    parser.add_argument("--block", type=int, default=262144, help="bytes the attacker writes at a time")
    parser.add_argument("--only", nargs="*", default=None, help="run only the shapes whose names contain these words")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        stream_port = s.getsockname()[1]
    b = start_broker("--workers", "1", "--stream-port", str(stream_port), "--log-level", "warning")
    shapes = [k for k in SHAPES if not args.only or any(word in k for word in args.only)]
    results: dict[str, tuple[list[float], int]] = {"no attacker": ([], 0), **{k: ([], 0) for k in shapes}}
    try:
        for _ in range(args.rounds):
            for name in results:
                answered = multiprocessing.Value("q", 0)
                proc = None
                if name in SHAPES:
                    kind, unit = SHAPES[name]
                    port = b.port if kind == "http" else stream_port
                    proc = multiprocessing.Process(target=attack, args=(port, unit, args.block, args.duration, answered))
                    proc.start()
                    time.sleep(0.3)  # the attack is under way
                times = victim(b, args.duration - 0.6)
                if proc is not None:
                    proc.join(args.duration + 10)
                old_times, old_n = results[name]
                results[name] = (old_times + times, old_n + answered.value)
    finally:
        b.stop()
    print(f"one broker, --workers 1; attacker writes {args.block} B blocks of pipelined requests on one connection; "
          f"{args.rounds} rounds of {args.duration:g} s per shape, alternating; {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    print("| attacker | bytes/request | requests per block | attacker answers/s | victim round trips | p50 ms | p99 ms | max ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (times, answered) in results.items():
        unit = SHAPES[name][1] if name in SHAPES else b""
        ordered = sorted(times)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        per_block = args.block // len(unit) if unit else 0
        rate = answered / (args.rounds * args.duration)
        print(f"| {name} | {len(unit) or '-'} | {per_block or '-'} | {rate:,.0f} | {len(times)} | "
              f"{statistics.median(times) * 1e3:.2f} | {p99 * 1e3:.2f} | {max(times) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
