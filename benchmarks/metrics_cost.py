"""What counting metrics costs the dispatcher per call: metrics on vs off, in-process.

Usage: .venv/bin/python benchmarks/metrics_cost.py [--calls 200000] [--rounds 5]

Drives a real `Dispatcher` (the broker's hot path from decoded body to finished
response body) with a worker whose channel records frames; each frame is answered at
once through `Dispatcher.on_reply`, as `WorkerChannel` does. No sockets and no
worker processes, so the figures are steady on a shared machine and show only what
the metrics add: single calls, and batches of 100 (which travel in chunks). Rounds
alternate on/off; prints the median microseconds per call of each and the difference.
End-to-end figures with the network (`wrk_broker.py --metrics both`) are in
benchmarks/RESULTS.md. Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop

from broker import wire
from broker.dispatch import Dispatcher, Exchange
from broker.jsonrpc import Codec
from broker.metrics import CallMetrics
from broker.pool import Worker, WorkerState


class RecordingChannel:
    """Stands where `WorkerChannel` does: keeps the frames the dispatcher sends."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, int, int, bytes]] = []

    def send(self, kind: int, call_id: int, aux: int, payload: bytes) -> None:
        self.frames.append((kind, call_id, aux, bytes(payload)))


def answer(dispatcher: Dispatcher, worker: Worker) -> None:
    """Reply to every frame sent to `worker` as it would: RESULT `3`, or a CHUNK_REPLY
    with one RESULT entry per call of a chunk; 35 us of service time each."""
    channel = typing.cast(RecordingChannel, worker.channel)
    frames, channel.frames = channel.frames, []
    for kind, call_id, aux, _payload in frames:
        if kind == wire.Kind.CHUNK:
            reply = b"".join(wire.REPLY_ENTRY.pack(i, wire.Kind.RESULT, 1) + b"3" for i in range(aux))
            dispatcher.on_reply(worker, wire.Kind.CHUNK_REPLY, call_id, 35 * aux, reply)
        else:
            dispatcher.on_reply(worker, wire.Kind.RESULT, call_id, 35, b"3")


async def per_call_us(metrics: bool, body: bytes, calls_per_body: int, calls: int) -> float:
    """Microseconds of dispatcher work per call for `calls` calls sent as `body`."""
    loop = asyncio.get_running_loop()
    dispatcher = Dispatcher(loop, metrics=CallMetrics() if metrics else None)
    dispatcher.set_methods(["add"])
    workers = []
    for slot in range(2):
        worker = Worker(slot)
        worker.channel = RecordingChannel()  # type: ignore[assignment]
        worker.concurrency = 1 << 30
        worker.state = WorkerState.READY
        dispatcher.worker_ready(worker)
        workers.append(worker)
    decoded = Codec(1000).decode(body)
    done: list[bytes] = []

    def on_done(exchange: Exchange) -> None:
        done.append(exchange.body())

    t0 = time.perf_counter()
    for _ in range(calls // calls_per_body):
        exchange = dispatcher.submit(decoded, on_done)
        for worker in workers:
            answer(dispatcher, worker)
        assert exchange is not None and exchange.remaining == 0
    elapsed = time.perf_counter() - t0
    assert len(done) == calls // calls_per_body
    return elapsed / (len(done) * calls_per_body) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="calls per round and mode")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    single = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}).encode()
    batch = json.dumps([{"jsonrpc": "2.0", "method": "add", "params": [1, i], "id": i} for i in range(100)]).encode()
    print(f"dispatcher CPU per call, median of {args.rounds} alternating rounds of {args.calls:,} calls")
    for name, body, n in (("single add", single, 1), ("batch of 100 add", batch, 100)):
        figures: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for on in (False, True):
                figures[on].append(uvloop.run(per_call_us(on, body, n, args.calls)))
        off, on = statistics.median(figures[False]), statistics.median(figures[True])
        print(f"{name:18s} metrics off {off:6.2f} us   on {on:6.2f} us   +{on - off:.2f} us (+{(on / off - 1) * 100:.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
