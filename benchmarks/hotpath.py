"""The front-end's CPU per call on the hot path, in-process: HTTP bytes in, HTTP bytes out.

Usage: .venv/bin/python benchmarks/hotpath.py [--rounds 7] [--requests 64000]
                                              [--metrics on|off|both] [--profile]
                                              [--access-log errors|all|off|both]
                                              [--case both|single|batch] [--batch-requests N]

Drives the broker's real code from raw HTTP request bytes to raw HTTP response bytes:
`HttpProtocol.data_received` (httptools, codec, dispatcher, `WorkerChannel.send`),
`WorkerChannel.flush`, then the workers' replies as real wire frames through
`WorkerChannel.data_received` (frame decoder, `Dispatcher.on_reply`, response splicing,
the HTTP answer's `transport.write`). 64 connections each send one request per round, as
wrk does at 64 connections; each of the 2 workers answers everything sent to it in one
read, as under load. What stands in for the kernel: transports that keep what is
written, so no syscalls and no other process are counted, and the figure is steady on a
shared machine (the network's own cost is in `wrk_broker.py`). The replies are built
outside the timed part; time is the process's CPU time. Prints the median microseconds
per call of single `add` calls and of calls in batches of 100 (with `--metrics both`,
rounds alternate between metrics on and off and the difference is what the metrics
cost); `--profile` prints cProfile's top functions instead. Use it to compare before
and after a hot-path change. Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
import types
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop

from broker import chunk, wire
from broker.accesslog import AccessLog
from broker.dispatch import Dispatcher
from broker.frontend import http
from broker.frontend.http import HttpFrontend, HttpProtocol
from broker.logpipe import LogPipe
from broker.metrics import CallMetrics
from broker.pool import Worker, WorkerChannel, WorkerState

ACCESS = ["errors"]  # the access_log of the rounds (`--access-log`): "errors" (the default setting), "all", "off"
PIPES: list[LogPipe] = []  # (stopped after each round: the writer's time is counted in it)

CONNECTIONS = 64
WORKERS = 2


class KeptTransport(asyncio.Transport):
    """Stands where the socket's transport does: keeps the bytes written."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out.append(bytes(data))

    def writelines(self, chunks: typing.Iterable[bytes | bytearray | memoryview]) -> None:  # type: ignore[override]
        self.out.extend(bytes(c) for c in chunks)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Nothing to bound: every write is taken whole."""


_CHUNK_REPLIES: dict[bytes, tuple[int, bytes]] = {}


def chunk_reply(calls: bytes, count: int) -> tuple[int, bytes]:
    """The kind and payload of a worker's answer to the `count` calls of a CHUNK payload
    (`calls`, after its deadline), all results `3`."""
    if not hasattr(wire, "CHUNK_RESULTS"):  # (a tree from before wire version 5)
        return wire.Kind.CHUNK_REPLY, b"".join(wire.REPLY_ENTRY.pack(i, wire.Kind.RESULT, 1) + b"3" for i in range(count))
    objects = []
    pos = 0
    for _ in range(count):
        _method, _notification, start, end = chunk.read_call(calls, pos)
        objects.append(b'{"jsonrpc":"2.0","id":%s,"result":3}' % calls[pos + wire.CALL_ENTRY.size : start])
        pos = end
    return wire.Kind.CHUNK_RESULTS, b"\n".join(objects)


def replies(frames: list[tuple[int, int, int, bytes]]) -> bytes:
    """What a worker writes back for `frames`: RESULT `3` per call, per chunk (its aux is its
    entry count) a CHUNK_RESULTS of its calls' Response objects with their ids as sent (or,
    driving a tree from before wire version 5, a CHUNK_REPLY of RESULT entries), 35 us of
    service time each."""
    out = bytearray()
    for kind, call_id, aux, params in frames:
        if kind == wire.Kind.CHUNK:
            # (made once per chunk's calls: what the stand-in worker does costs the same in
            # either layout, so callgrind's count of the whole process compares the front-ends)
            calls = params[wire.DEADLINE.size :]
            made = _CHUNK_REPLIES.get(calls)
            if made is None:
                made = _CHUNK_REPLIES[calls] = chunk_reply(calls, aux)
            out += wire.HEADER.pack(len(made[1]), made[0], call_id, 35 * aux) + made[1]
        elif kind == wire.Kind.CALL:
            out += wire.HEADER.pack(1, wire.Kind.RESULT, call_id, 35) + b"3"
    return bytes(out)


async def per_call_us(body: bytes, calls_per_body: int, requests: int, metrics: bool) -> float:
    """Front-end CPU microseconds per call for `requests` HTTP requests carrying `body`."""
    loop = asyncio.get_running_loop()
    access = None
    if ACCESS[0] != "off":  # (its lines through the broker's own queue and writer thread, to /dev/null)
        # (no line dropped: a loop that never waits holds the GIL from the writer for 5 ms at a time)
        pipe = LogPipe(fd=os.open(os.devnull, os.O_WRONLY), max_lines=1 << 30)
        pipe.start()
        if hasattr(pipe, "attach"):  # (rendered on this loop every FLUSH_SECONDS, as in the broker)
            pipe.attach(loop)
        PIPES.append(pipe)
        access = AccessLog(ACCESS[0], pipe.access)
    dispatcher = Dispatcher(loop, metrics=CallMetrics() if metrics else None, access_log=access)
    dispatcher.set_methods(["add"])
    pool = types.SimpleNamespace(dispatcher=dispatcher, max_frame_bytes=1 << 24, loop=loop)
    channels = []
    for slot in range(WORKERS):
        worker = Worker(slot)
        channel = WorkerChannel(pool)  # type: ignore[arg-type]
        channel.connection_made(KeptTransport())
        channel.worker = worker
        worker.channel = channel
        worker.concurrency = 1 << 30
        worker.state = WorkerState.READY
        dispatcher.worker_ready(worker)
        channels.append(channel)
    frontend = HttpFrontend(dispatcher, metrics=None)
    # A turn's time (TURN_SECONDS) is a wall clock's: under callgrind, 50 times slower, the
    # turns would end and pause reading, which this fake transport cannot, and cost what
    # they never cost natively. Off here (and harmless in a tree from before it).
    http.TURN_SECONDS = float("inf")
    protocols: list[tuple[HttpProtocol, KeptTransport]] = []
    for _ in range(CONNECTIONS):
        protocol, transport = HttpProtocol(frontend), KeptTransport()
        protocol.connection_made(transport)
        protocols.append((protocol, transport))
    request = (
        b"POST / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    answered = 0
    elapsed = 0.0
    decoder = wire.FrameDecoder()
    for _ in range(requests // CONNECTIONS):
        t0 = time.process_time()
        for protocol, _ in protocols:
            protocol.data_received(request)
        for channel in channels:
            channel.flush()
        elapsed += time.process_time() - t0
        answers = []
        for channel in channels:
            sent = channel._transport.out  # type: ignore[union-attr]
            answers.append(replies(decoder.feed(b"".join(sent))))
            sent.clear()
        t0 = time.process_time()
        for channel, data in zip(channels, answers):
            channel.data_received(data)
        elapsed += time.process_time() - t0
        t0 = time.process_time()
        await asyncio.sleep(0)  # the flushes call_soon scheduled (nothing left to write); the log's timer
        elapsed += time.process_time() - t0
        for _, transport in protocols:
            assert len(transport.out) == 1 and transport.out[0].startswith(b"HTTP/1.1 200"), transport.out
            transport.out.clear()
            answered += 1
    for protocol, _ in protocols:
        protocol.connection_lost(None)
    if PIPES and hasattr(PIPES[-1], "detach"):
        t0 = time.process_time()
        PIPES[-1].detach()  # (what is still captured rendered: counted)
        elapsed += time.process_time() - t0
    return elapsed / (answered * calls_per_body) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=64_000, help="single-call requests per round")
    parser.add_argument(
        "--metrics", choices=("on", "off", "both"), default="on",
        help="count metrics (the default setting), not, or both in alternating rounds",
    )  # fmt: skip
    parser.add_argument(
        "--access-log", choices=("errors", "all", "off", "both"), default="errors",
        help="access_log of the rounds (lines to /dev/null through the broker's queue and writer thread); both: "
             "errors and all in alternating rounds, metrics on (what a line per call costs)",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="cProfile one round of each instead")
    parser.add_argument("--case", choices=("both", "single", "batch"), default="both", help="which bodies to send")
    parser.add_argument("--batch-requests", type=int, default=0,
                        help="batch requests per round (default: requests / 50, at least 64)")
    args = parser.parse_args()
    single = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}).encode()
    batch = json.dumps([{"jsonrpc": "2.0", "method": "add", "params": [1, i], "id": i} for i in range(100)]).encode()
    batches = args.batch_requests or max(args.requests // 50, 64)
    cases = tuple(
        case for case in (("single add", single, 1, args.requests), ("batch of 100 add", batch, 100, batches))
        if args.case == "both" or case[0].startswith(args.case)
    )
    modes = [True, False] if args.metrics == "both" else [args.metrics == "on"]
    if args.access_log == "both":
        return access_cost(cases, args.rounds)
    ACCESS[0] = args.access_log
    if args.profile:
        for name, body, n, requests in cases:
            print(f"--- {name}")
            profiler = cProfile.Profile()
            profiler.enable()
            uvloop.run(per_call_us(body, n, requests, modes[0]))
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
        return 0
    label = {True: "metrics on", False: "metrics off"}
    print(f"front-end CPU per call, in-process, median of {args.rounds} rounds ({', '.join(label[m] for m in modes)})")
    for name, body, n, requests in cases:
        figures: dict[bool, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:  # alternating: the machine's noise hits both alike
                figures[mode].append(uvloop.run(per_call_us(body, n, requests, mode)))
        line = "   ".join(
            f"{label[m] + ' ' if len(modes) > 1 else ''}{statistics.median(f):6.2f} us (min {min(f):.2f}, max {max(f):.2f})"
            for m, f in figures.items()
        )
        if len(modes) > 1:
            on, off = statistics.median(figures[True]), statistics.median(figures[False])
            line += f"   metrics cost +{on - off:.2f} us (+{(on / off - 1) * 100:.1f} %)"
        print(f"{name:18s} {line}")
    return 0


def access_cost(cases: tuple[tuple[str, bytes, int, int], ...], rounds: int) -> int:
    """Rounds alternating access_log "errors" and "all" (every call a success: "errors" writes
    nothing): the median CPU per call of each, the writer thread's included, and the difference."""
    print(f"front-end CPU per call, in-process, median of {rounds} rounds (access_log errors, all; metrics on)")
    for name, body, n, requests in cases:
        figures: dict[str, list[float]] = {"errors": [], "all": []}
        for _ in range(rounds):
            for mode in figures:
                ACCESS[0] = mode
                us = uvloop.run(per_call_us(body, n, requests, True))
                began = time.process_time()
                while PIPES:  # (what is still queued written: the writer's CPU time counted too)
                    PIPES.pop().stop(timeout=30)
                figures[mode].append(us + (time.process_time() - began) * 1e6 / (requests * n))
        errors, all_ = statistics.median(figures["errors"]), statistics.median(figures["all"])
        print(f"{name:18s} errors {errors:6.2f} us (min {min(figures['errors']):.2f})   all {all_:6.2f} us "
              f"(min {min(figures['all']):.2f})   a line per call costs +{all_ - errors:.2f} us "
              f"(+{(all_ / errors - 1) * 100:.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
