"""How long probes and other clients wait while many connections send requests whose work
cannot be cut (hostile testing, round 44).

Usage: .venv/bin/python benchmarks/slow_turns.py [--connections 16] [--duration 8] [--rounds 2]
                                               [--shape deep|batch|deep300k] [--churn] [--before DIR]
                                               [--port P] [--victim-bytes 200000]

A connection's turn ends after TURN_SECONDS (2 ms) of its reads' work, but one request's
decode cannot be cut: a 1 MiB body nested 200,000 deep (`[{},[{},...]]` params, valid
JSON, answered -32600 with its id) takes about 18 ms. With 16 connections pipelining
them, each took such a turn in every loop iteration. A connection whose turn took longer
than SLOW_TURN_SECONDS now waits in the slow lane (`frontend.slowlane.SlowLane`), which lets
one go on per iteration.

Shapes (`--shape`): `deep` the 1 MiB body above, `deep300k` one of 300 KB (about 5 ms), `batch`
a batch of 1000 `{}` (3 KB, 1000 -32600 answers, about 2.5 ms); two that reach the workers, where
the dispatcher's queue orders them (fair among connections since round 53): `addbatch` a
batch of 1000 `add` calls, `bigint` an `add` of a 1 MB integer (refused -32602 in about 18 ms
of a worker). Turns that end for their time
(TURN_SECONDS) wait in the lane too, and once a loop iteration's reads took ADMIT_SECONDS, a
read that may hold more than SMALL_READ_BYTES of a request waits there: `--churn` opens a new
connection for each request (the lane delayed only a connection's next turn: hostile testing,
round 45).

Starts a real broker (`--workers 2`) per round. An attacker process opens `--connections`
keep-alive connections, each writing those bodies two at a time as fast as the broker
takes them and reading every answer; beside it the victim does, one after another, a
`GET /healthz` on a new connection, an `add` call on a new connection and an `echo` call of
`--victim-bytes` (200 KB: a call past SMALL_READ_BYTES waits in the lane too, where it came
after every busy connection until the lane's order became fair: hostile testing, round 49)
on a new connection, 50 ms apart.
Prints the victim's p50, p90 and max of each, and the attacker's bodies answered per
second. `--before DIR`: a checkout of another commit (its `broker` package) measured in
alternating rounds with this one, so that the machine's noise hits both alike. Prints
figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import ROOT, start_broker  # noqa: E402  (the same launcher the tests use)

SIZE = 1024 * 1024 - 300
UNITS = SIZE // 5


def deep(size: int) -> bytes:
    units = size // 5
    return b'{"jsonrpc":"2.0","method":"nope","params":' + b"[{}," * units + b"{}" + b"]" * units + b',"id":1}'


SHAPES = {
    "deep": deep(SIZE), "deep300k": deep(300_000), "batch": b"[" + b",".join([b"{}"] * 1000) + b"]",
    "addbatch": b"[" + b",".join(b'{"jsonrpc":"2.0","method":"add","params":[1,2],"id":%d}' % i for i in range(1000)) + b"]",
    "bigint": b'{"jsonrpc":"2.0","method":"add","params":[1' + b"0" * 1_000_000 + b',2],"id":1}',
}
ADD = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}).encode()


def post(body: bytes) -> bytes:
    return (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


def attack(port: int, connections: int, seconds: float, answered: multiprocessing.Value,  # type: ignore[valid-type]
           body: bytes, churn: bool) -> None:
    """`connections` threads each pipelining `body` two at a time for `seconds`, or (`churn`)
    sending it on a new connection each time and reading its answer."""
    request = post(body) * 2
    stop = time.monotonic() + seconds

    def renew() -> None:
        while time.monotonic() < stop:
            try:
                round_trip(port, post(body).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
            except OSError:
                continue
            with answered.get_lock():
                answered.value += 1

    def one() -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.settimeout(30)

        def read() -> None:
            try:
                while time.monotonic() < stop + 5 and (chunk := sock.recv(1 << 20)):
                    with answered.get_lock():
                        answered.value += chunk.count(b"HTTP/1.1 ")
            except OSError:
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while time.monotonic() < stop:
                sock.sendall(request)
        except OSError:
            pass
        sock.shutdown(socket.SHUT_WR)
        reader.join(10)
        sock.close()

    threads = [threading.Thread(target=renew if churn else one, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 20)


def round_trip(port: int, request: bytes) -> float:
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        got = b""
        while b"\r\n\r\n" not in got or not got.endswith((b"}", b"\n")):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            got += chunk
            if b"Content-Length: " in got:
                head, _, body = got.partition(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    break
    return time.perf_counter() - began


def measure(tree: Path, connections: int, seconds: float, body: bytes, churn: bool, port: int,
            victim_bytes: int) -> dict[str, float]:
    broker = start_broker("--workers", "2", "--port", str(port), cwd=tree)  # (the last --port is the one)
    try:
        answered = multiprocessing.Value("q", 0)
        attacker = multiprocessing.Process(target=attack, args=(broker.port, connections, seconds, answered, body, churn))
        attacker.start()
        time.sleep(0.5)
        probes: list[float] = []
        calls: list[float] = []
        echoes: list[float] = []
        echo = json.dumps({"jsonrpc": "2.0", "method": "echo", "params": ["z" * victim_bytes], "id": 1}).encode()
        end = time.monotonic() + seconds - 0.8
        while time.monotonic() < end:
            probes.append(round_trip(broker.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"))
            calls.append(round_trip(broker.port, post(ADD)[:-len(ADD)].replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + ADD))
            echoes.append(round_trip(broker.port, post(echo)[:-len(echo)].replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + echo))
            time.sleep(0.05)
        attacker.join(seconds + 30)
        if attacker.is_alive():
            attacker.kill()
    finally:
        broker.stop()

    def q(values: list[float], p: float) -> float:
        return sorted(values)[min(len(values) - 1, int(len(values) * p))] * 1000

    return {"healthz p50": q(probes, 0.5), "healthz p90": q(probes, 0.9), "healthz max": max(probes) * 1000,
            "add p50": q(calls, 0.5), "add p90": q(calls, 0.9), "add max": max(calls) * 1000,
            "echo p50": q(echoes, 0.5), "echo p90": q(echoes, 0.9), "echo max": max(echoes) * 1000,
            "bodies/s": answered.value / seconds, "n": len(probes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deep")
    parser.add_argument("--churn", action="store_true", help="a new connection for each request")
    parser.add_argument("--port", type=int, default=0, help="the brokers' port (default: one the OS picks)")
    parser.add_argument("--before", type=Path, help="another checkout, measured in alternating rounds")
    parser.add_argument("--victim-bytes", type=int, default=200_000, help="the size of the victim's echo call")
    args = parser.parse_args()
    trees = ([("before", args.before.resolve())] if args.before else []) + [("this tree", ROOT)]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, tree in trees:
            results[name].append(measure(tree, args.connections, args.duration, SHAPES[args.shape], args.churn,
                                         args.port, args.victim_bytes))
    how = "each opening a new connection for each" if args.churn else "pipelining"
    print(f"{args.connections} clients {how} `{args.shape}` requests ({len(SHAPES[args.shape])} bytes),"
          f" {args.duration:g} s a round, {args.rounds} rounds; ms (median of the rounds)")
    keys = list(next(iter(results.values()))[0])
    print("| tree | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, rows in results.items():
        cells = [statistics.median(row[k] for row in rows) for k in keys]
        print(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
