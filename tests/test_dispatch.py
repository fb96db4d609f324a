"""The dispatcher in memory: its deadline wheel on real event loops (uvloop and
asyncio), and its queue, routing, memory bound and late-reply accounting driven with
real `pool.Worker` records whose channels record the frames sent to them."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import tracemalloc
import typing

import pytest
import uvloop
from msgspec import Raw

from broker import wire
from broker.answers import Outgoing
from broker.dispatch import Call, DeadlineWheel, Dispatcher, Exchange, ResponseBudget, Route
from broker.fairqueue import FairQueue
from broker.jsonrpc import Body, Codec, ErrorCode, Request
from broker.metrics import CallMetrics
from broker.pool import Pool, Worker, WorkerChannel, WorkerState

LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


def make_call(call_id: int, timeout: float) -> Call:
    return Call.of(call_id, None, -1, Request("2.0", "m"), Route(0, timeout), 0.0, ResponseBudget(Outgoing(1 << 62)))


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_deadlines_fire_in_order_once_and_not_when_removed(loop_name):
    fired: list[tuple[int, float]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wheel = DeadlineWheel(loop, lambda c: fired.append((c.call_id, loop.time() - start)), resolution=0.01)
        start = loop.time()
        calls = [make_call(1, 0.15), make_call(2, 0.05), make_call(3, 0.10), make_call(4, 0.05)]
        for c in calls:
            wheel.add(c, start)
        assert len(wheel) == 4 and all(c.tick for c in calls)
        wheel.remove(calls[3])  # answered before its deadline
        assert calls[3].tick == 0 and len(wheel) == 3
        await asyncio.sleep(0.3)
        assert len(wheel) == 0

    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(main())
    assert [cid for cid, _ in fired] == [2, 3, 1]
    for (cid, at), due in zip(fired, (0.05, 0.10, 0.15)):
        assert at >= due - 0.001, (cid, at)  # never early (rounded up to the next tick)


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_an_earlier_deadline_rearms_the_timer(loop_name):
    fired: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wheel = DeadlineWheel(loop, lambda c: fired.append(c.call_id))
        now = loop.time()
        wheel.add(make_call(1, 30.0), now)
        wheel.add(make_call(2, 0.02), now)  # must not wait behind the 30 s timer
        await asyncio.sleep(0.2)
        assert fired == [2]
        assert len(wheel) == 1

    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(main())


# -- the dispatcher in memory --------------------------------------------------------
# A real Dispatcher and real pool.Worker records; what stands in for each worker's
# socket is a channel that records the frames sent to it. Replies are fed back through
# Dispatcher.on_reply as the real WorkerChannel does.


class RecordingChannel:
    """Where a worker's frames would be written: keeps them, (kind, call id, aux, payload)."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.deadlines: dict[int, float] = {}
        self.flows: dict[int, int] = {}
        self.refused: dict[int, bytes] = {}  # calls the socket is to have refused ({call id: params}: `unsent`)

    def send(self, kind: int, call_id: int, aux: int, payload: object) -> None:
        self.frames.append((kind, call_id, aux, bytes(payload)))  # type: ignore[call-overload]

    def send_call(self, kind: int, call_id: int, aux: int, deadline: float, flow: int, params: object) -> None:
        """A call's frame: recorded as `send`'s, its deadline (CLOCK_MONOTONIC s) in `deadlines`
        and its flow (its connection's number) in `flows`."""
        self.deadlines[call_id] = deadline
        self.flows[call_id] = flow
        self.send(kind, call_id, aux, params)

    def take(self) -> list[tuple[int, int, int, bytes]]:
        frames, self.frames = self.frames, []
        return frames

    def refuse(self, frame: tuple[int, int, int, bytes]) -> None:
        """The write of a call's `frame` (as `take` gave it) failed, the worker's end first: `unsent` gives it."""
        self.refused[frame[1]] = frame[3]

    def unsent(self) -> dict[int, bytes]:
        """As `WorkerChannel.unsent`: the calls never written, {call id: params} (those `refuse` named)."""
        refused, self.refused = self.refused, {}
        return refused


def add_worker(d: Dispatcher, slot: int, concurrency: int) -> Worker:
    w = Worker(slot)
    w.channel = RecordingChannel()  # type: ignore[assignment]
    w.concurrency = concurrency
    w.state = WorkerState.READY
    d.worker_ready(w)
    return w


def isolation_setup(workers: int) -> tuple[Dispatcher, list[Worker], Codec, list[Exchange]]:
    """For the isolation tests, in a running loop: a dispatcher serving "m" and "boom" on
    `workers` ready workers of 10 places, a codec, and the list the answers go to."""
    d = Dispatcher(asyncio.get_running_loop())
    d.set_methods(["m", "boom"])
    return d, [add_worker(d, slot, concurrency=10) for slot in range(workers)], Codec(), []


def restarted(d: Dispatcher, w: Worker) -> None:
    """`w`'s process died ("exited with 1": its calls answered -32002) and its slot restarted, the
    same `Worker` with a new channel, as the pool's slots do."""
    d.worker_lost(w, "exited with 1")
    w.channel = RecordingChannel()  # type: ignore[assignment]
    d.worker_ready(w)


def body(codec: Codec, payload: object) -> Body:
    return codec.decode(json.dumps(payload).encode())


def req(method: str, params: object, id_: object) -> dict[str, object]:
    return {"jsonrpc": "2.0", "method": method, "params": params, "id": id_}


def run(main: typing.Callable[[], typing.Awaitable[None]]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def chunk_reply(frame: tuple[int, int, int, bytes], kind: int = wire.Kind.RESULT, body_: bytes = b"0") -> bytes:
    """A CHUNK_REPLY payload answering every call of a CHUNK frame with `body_`."""
    return b"".join(wire.REPLY_ENTRY.pack(i, kind, len(body_)) + body_ for i in range(frame[2]))


def first_params(frame: tuple[int, int, int, bytes]) -> object:
    """The params of a CALL frame, or of a CHUNK's first call, decoded."""
    if frame[0] == wire.Kind.CHUNK:
        _index, _flags, id_length, length = wire.CALL_ENTRY.unpack_from(frame[3], 0)
        start = wire.CALL_ENTRY.size + id_length
        return json.loads(frame[3][start : start + length])
    return json.loads(frame[3])


def test_freed_slots_are_all_filled_from_the_queue_in_fifo_order():
    """Issue 9 item 12: a chunk's reply frees many slots; every one is filled from the
    queue at once, oldest call first, and a new call joins the tail of the queue."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), connection_share=1.0)  # (one connection may take every place)
        d.set_methods(["sleep"])
        w = add_worker(d, 0, concurrency=4)
        codec = Codec()
        done: list[Exchange] = []
        d.submit(body(codec, [req("sleep", [1.0], i) for i in range(4)]), done.append)
        [chunk] = w.channel.take()
        assert chunk[0] == wire.Kind.CHUNK and w.outstanding == 4
        for n in range(8):  # (each its own connection)
            d.submit(body(codec, req("sleep", [n], n)), done.append)
        assert w.channel.take() == [] and d.queued_calls == 8
        d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 0, chunk_reply(chunk))
        started = w.channel.take()
        assert [first_params(f) for f in started] == [[0], [1], [2], [3]]  # all 4 slots, in order
        assert w.outstanding == 4 and len(done) == 1
        d.submit(body(codec, req("sleep", ["new"], "new")), done.append)  # must not overtake
        assert w.channel.take() == []
        for frame in started:
            d.on_reply(w, wire.Kind.RESULT, frame[1], 0, b"0")
        assert [first_params(f) for f in w.channel.take()] == [[4], [5], [6], [7]]
        assert d.queued_calls == 1

    run(main)


def test_a_connections_call_goes_next_however_many_another_connection_queued():
    """Round 53 (MEDIUM): the queue was first in, first out for all clients, and 16
    connections pipelining calls that each cost a worker 18 ms held another client's call
    1.8 s. It is fair among connections (broker/fairqueue.py): the call of a connection
    that has had nothing served goes at the next free place; each connection's calls keep
    their order; a connection's batch chunk costs it its calls."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), connection_share=1.0)  # (one connection may take every place)
        d.set_methods(["work"])
        w = add_worker(d, 0, concurrency=1)
        codec = Codec()
        flood, victim = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
        for i in range(30):
            d.submit(body(codec, req("work", [i], i)), lambda e: None, flood)
        d.submit(body(codec, [req("work", [100 + i], 100 + i) for i in range(10)]), lambda e: None, flood)
        d.submit(body(codec, req("work", ["v"], "v")), lambda e: None, victim)
        d.submit(body(codec, req("work", ["w"], "w")), lambda e: None, victim)
        order = []
        for _ in range(33):  # each answer frees the one place: the next call goes
            [frame] = w.channel.take()
            order.append(first_params(frame)[0])
            d.on_reply(w, wire.Kind.RESULT, frame[1], 10, b"0" if frame[0] == wire.Kind.CALL else chunk_reply(frame))
        # 0 went at once and holds the flood's share (the one place, as connection_share
        # 0.5 of 1 is at least 1): the flood's calls wait out of turn, the victim's goes;
        # then they take turns
        assert order[:5] == [0, "v", 1, "w", 2]
        flood_order = [x for x in order if x not in ("v", "w")]
        assert flood_order == sorted(flood_order)  # the flood's own calls, the chunk's included, in order

    run(main)


def test_each_frame_names_its_connection_as_its_flow():
    """A call's frame carries its connection's flow (wire.py), by which the worker takes
    turns among clients once a call takes a whole slice (hostile testing, round 60): one
    number for every call and chunk of a connection, another for each other connection."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop())
        d.set_methods(["m"])
        w = add_worker(d, 0, concurrency=100)
        codec = Codec()
        one, other = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
        d.submit(body(codec, req("m", [1], 1)), lambda e: None, one)
        d.submit(body(codec, [req("m", [i], i) for i in range(5)]), lambda e: None, one)
        d.submit(body(codec, {"jsonrpc": "2.0", "method": "m"}), lambda e: None, one)  # (a notification)
        d.submit(body(codec, req("m", [2], 2)), lambda e: None, other)
        frames = w.channel.take()
        assert [f[0] for f in frames] == [wire.Kind.CALL, wire.Kind.CHUNK, wire.Kind.NOTIFY, wire.Kind.CALL]
        flows = [w.channel.flows[f[1]] & wire.FLOW_MASK for f in frames]
        assert flows[:3] == [one.flow] * 3 and flows[3] == other.flow != one.flow
        assert 0 <= one.flow <= wire.FLOW_MASK and 0 <= other.flow <= wire.FLOW_MASK

    run(main)


def test_a_queued_chunk_goes_in_its_turn_and_is_not_starved():
    """A queued chunk needs one free slot, as a call does (then overshoots the limit). Its
    connection's calls queued behind it never pass it; another connection's single call
    queued after it goes first (the chunk costs its 5 calls: `broker.fairqueue`), and the
    chunk at the next free slot."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), connection_share=1.0)  # (one connection may take every place)
        d.set_methods(["sleep"])
        w = add_worker(d, 0, concurrency=5)
        codec = Codec()
        for name in "abxyz":  # 5 connections fill the worker
            d.submit(body(codec, req("sleep", [name], name)), lambda e: None)
        a, b, *_ = w.channel.take()
        d.submit(body(codec, [req("sleep", ["chunk"], i) for i in range(5)]), lambda e: None)
        d.submit(body(codec, req("sleep", ["c"], 3)), lambda e: None)
        assert w.channel.take() == []
        d.on_reply(w, wire.Kind.RESULT, a[1], 0, b"0")
        [c] = w.channel.take()  # another connection's single call: its turn comes first
        assert first_params(c) == ["c"]
        d.on_reply(w, wire.Kind.RESULT, b[1], 0, b"0")
        [chunk] = w.channel.take()
        assert chunk[0] == wire.Kind.CHUNK and first_params(chunk) == ["chunk"]
        assert w.outstanding == 9 and d.queued_calls == 0  # (over the limit by its size)

    run(main)


def part_of(frame: tuple[int, int, int, bytes], entries: typing.Iterable[int], body_: bytes = b"0") -> bytes:
    """A CHUNK_PART (or CHUNK_REPLY) payload answering the calls `entries` of a CHUNK frame."""
    return b"".join(wire.REPLY_ENTRY.pack(i, wire.Kind.RESULT, len(body_)) + body_ for i in entries)


def test_a_chunk_gives_its_workers_capacity_back_as_its_answers_arrive():
    """Hostile round B finding 1: a chunk held its weight of its worker's capacity until
    its CHUNK_REPLY, i.e. until its slowest call ended, although its answers came back
    part by part: one slow call in a chunk of 10 kept a worker of concurrency 4 full,
    and no queued call could start. Each CHUNK_PART now gives back the places of the
    calls it answers (the in-flight count with them), and queued calls start in them."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), connection_share=1.0)  # (one connection may take every place)
        d.set_methods(["sleep"])
        w = add_worker(d, 0, concurrency=10)
        codec = Codec()
        done: list[Exchange] = []
        d.submit(body(codec, [req("sleep", [i], i) for i in range(10)]), done.append)
        [chunk] = w.channel.take()
        for n in range(9):
            d.submit(body(codec, req("sleep", [n], f"q{n}")), done.append)
        assert (w.outstanding, d.in_flight_calls, d.queued_calls) == (10, 10, 9)
        d.on_reply(w, wire.Kind.CHUNK_PART, chunk[1], 0, part_of(chunk, range(1, 9)))  # all but 0 and 9
        started = w.channel.take()
        assert [first_params(f) for f in started] == [[n] for n in range(8)]  # the 8 places given back
        assert (w.outstanding, d.in_flight_calls, d.queued_calls) == (10, 10, 1) and done == []
        d.on_reply(w, wire.Kind.CHUNK_PART, chunk[1], 0, part_of(chunk, [9]))
        assert [first_params(f) for f in w.channel.take()] == [[8]]
        assert (w.outstanding, d.in_flight_calls, d.queued_calls) == (10, 10, 0)
        d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 5_000, part_of(chunk, [0]))  # the slow one ends the chunk
        assert (w.outstanding, d.in_flight_calls) == (9, 9) and len(done) == 1
        assert [json.loads(a)["result"] for a in done[0].answers] == [0] * 10  # type: ignore[arg-type]
        for frame in started:
            d.on_reply(w, wire.Kind.RESULT, frame[1], 0, b"0")
        assert (w.outstanding, d.in_flight_calls) == (1, 1)

    run(main)


def test_a_chunks_late_or_unowed_answers_give_capacity_back_too():
    """The parts of a chunk owed no answer (notifications only) or answered already (its
    deadline passed) free their calls' places all the same; the CHUNK_REPLY frees the
    rest, whatever the parts held."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), timeout=0.05, connection_share=1.0)
        d.set_methods(["sleep"])
        w = add_worker(d, 0, concurrency=5)
        codec = Codec()
        d.submit(body(codec, [{"jsonrpc": "2.0", "method": "sleep", "params": [i]} for i in range(5)]), lambda e: None)
        [notes] = w.channel.take()
        done: list[Exchange] = []
        d.submit(body(codec, [req("sleep", [i], i) for i in range(4)]), done.append)
        assert (w.outstanding, d.queued_calls) == (5, 4)
        d.on_reply(w, wire.Kind.CHUNK_PART, notes[1], 0, part_of(notes, range(4)))
        [calls] = w.channel.take()  # places free: the queued chunk goes
        assert calls[0] == wire.Kind.CHUNK and (w.outstanding, d.in_flight_calls, d.queued_calls) == (5, 5, 0)
        await wait_until(lambda: bool(done))  # its deadline passes: answered -32001
        assert all(b"-32001" in typing.cast(bytes, a) for a in done[0].answers)
        d.on_reply(w, wire.Kind.CHUNK_PART, calls[1], 0, part_of(calls, range(3)))  # late answers
        assert (w.outstanding, d.in_flight_calls, d.late_results_total) == (2, 2, 3)
        d.on_reply(w, wire.Kind.CHUNK_REPLY, calls[1], 0, part_of(calls, [3]))
        d.on_reply(w, wire.Kind.CHUNK_REPLY, notes[1], 0, part_of(notes, [4]))
        assert (w.outstanding, d.in_flight_calls) == (0, 0)

    run(main)


def test_queued_calls_keep_only_their_own_bytes_of_the_request_body():
    """Issue 9 item 13: a queued call's raw id and params were views pinning the whole
    body. Measured with tracemalloc: 300 queued calls, each from a body with a 256 KiB
    extra member, keep about what the queue says they hold, not 75 MiB of bodies."""
    pad = "x" * (256 * 1024)

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), max_queue_bytes=64 * 1024 * 1024)
        d.set_methods(["add", "sleep"])
        w = add_worker(d, 0, concurrency=1)
        codec = Codec()
        d.submit(body(codec, req("sleep", [60], 0)), lambda e: None)  # takes the only slot
        keep: list[Exchange | None] = []
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(300):
                raw = json.dumps({**req("add", [i, i], f"id-{i}"), "pad": pad}).encode()
                keep.append(d.submit(codec.decode(raw), lambda e: None))
                del raw
            for i in range(3):  # batches: their chunks queue too (one per batch: one worker)
                raw = json.dumps([{**req("add", [i, j], j), "pad": pad} for j in range(3)]).encode()
                keep.append(d.submit(codec.decode(raw), lambda e: None))
                del raw
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert d.queued_calls == 300 + 9 and len(w.channel.frames) == 1
        # The calls themselves (Call, Exchange, copies, deque) cost about 1.5 KiB each.
        assert held < 2 * 1024 * 1024, f"{held} bytes kept by 303 queued bodies"
        assert 300 * len(b'[0,0]"id-0"') < d.queued_bytes < 20_000  # what they hold, counted

    run(main)


def test_calls_in_flight_keep_only_their_own_bytes_of_a_large_request_body():
    """A call in flight kept its raw id (a view) and with it its whole request body: a
    55-byte call padded with 1 MiB of whitespace held 1 MiB until answered (hostile
    testing: 3 connections x 64 pipelined calls, +193 MB). Bodies past UNPIN_ABOVE give
    their requests their own copies; measured with tracemalloc over 200 calls in flight,
    single and batched, from bodies padded with 256 KiB."""
    pad = " " * (256 * 1024)

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop())
        d.set_methods(["add", "sleep"])
        w = add_worker(d, 0, concurrency=10_000)
        codec = Codec()
        keep: list[Exchange | None] = []
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(200):
                raw = (json.dumps(req("sleep", [60], f"id-{i}")) + pad).encode()
                keep.append(d.submit(codec.decode(raw), lambda e: None))
                del raw
            for _ in range(3):
                raw = (json.dumps([req("sleep", [60], j) for j in range(3)]) + pad).encode()
                keep.append(d.submit(codec.decode(raw), lambda e: None))
                del raw
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert d.in_flight_calls == 209 and d.queued_calls == 0 and w.outstanding == 209
        assert held < 2 * 1024 * 1024, f"{held} bytes kept by 203 bodies in flight"

    run(main)


def test_max_queue_bytes_counts_what_a_queued_call_holds():
    """The bound covers the raw id as well as the params (both are copied and kept)."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), max_queue_bytes=1000)
        d.set_methods(["echo"])
        add_worker(d, 0, concurrency=1)
        codec = Codec()
        d.submit(body(codec, req("echo", [0], 0)), lambda e: None)
        answers: list[bytes] = []
        big_id = "i" * 600  # 602 bytes of raw id, 3 of params
        for n in range(2):
            ex = d.submit(body(codec, req("echo", [n], big_id)), lambda e: None)
            if ex is not None and ex.remaining == 0:
                answers.append(ex.body())
        assert d.queued_calls == 1 and d.queued_bytes == 605
        assert len(answers) == 1 and b"-32000" in answers[0]  # the second one is shed

    run(main)


async def wait_until(predicate: typing.Callable[[], bool], timeout: float = 5.0) -> None:
    """Let the loop run until `predicate()` holds; AssertionError after `timeout` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_late_replies_are_told_apart_cancel_acknowledgements_from_late_results():
    """Issue 9 item 15: a reply to a call that timed out is the worker's acknowledgement
    of the CANCEL (wire.CANCEL_ACK), or a result that came late; counted per call."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), timeout=0.02, metrics=CallMetrics())
        d.set_methods(["sleep"])
        w = add_worker(d, 0, concurrency=100)
        codec = Codec()
        done: list[Exchange] = []
        d.submit(body(codec, req("sleep", [1], 1)), done.append)
        d.submit(body(codec, req("sleep", [1], 2)), done.append)
        d.submit(body(codec, [req("sleep", [1], i) for i in range(3)]), done.append)
        d.submit(body(codec, [req("sleep", [1], i) for i in range(4)]), done.append)
        one, two, chunk3, chunk4 = w.channel.take()
        await wait_until(lambda: len(done) == 4)  # every one answered "timed out"
        assert all(b"-32001" in e.body() for e in done)
        assert w.channel.take() == [(wire.Kind.CANCEL, f[1], 0, b"") for f in (one, two, chunk3, chunk4)]
        d.on_reply(w, wire.Kind.ERROR, one[1], 0, wire.CANCEL_ACK)
        d.on_reply(w, wire.Kind.RESULT, two[1], 0, b"1")
        part = wire.REPLY_ENTRY.pack(0, wire.Kind.RESULT, 1) + b"1"
        d.on_reply(w, wire.Kind.CHUNK_PART, chunk3[1], 0, part)
        rest = b"".join(wire.REPLY_ENTRY.pack(i, wire.Kind.ERROR, len(wire.CANCEL_ACK)) + wire.CANCEL_ACK
                        for i in (1, 2))
        d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk3[1], 0, rest)
        d.on_reply(w, wire.Kind.ERROR, chunk4[1], 0, wire.CANCEL_ACK)  # a whole chunk, unstarted
        assert (d.late_cancelled_total, d.late_results_total) == (1 + 2 + 4, 1 + 1)
        assert d.metrics is not None and d.metrics.outcomes[0][ErrorCode.TIMED_OUT] == 2 + 3 + 4
        assert w.outstanding == 0

    run(main)


def test_each_call_goes_with_its_deadline_and_one_refused_past_it_is_answered_timed_out():
    """Hostile testing (round 19): a CANCEL can wait behind other frames while the worker's
    loop is held, and the call it cancels ran although answered -32001. Each CALL and
    CHUNK now carries its deadline: the end of its tick, when the wheel answers it, less
    the 1 ms by which a uvloop timer fires early. A worker that finds it passed answers
    CANCEL_ACK, unrun; if that comes before the timer, the client gets what the timer
    gives (its timeout in `data`), the other calls of a chunk their own answers."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = Dispatcher(loop, timeout=5.0, metrics=CallMetrics())
        d.set_methods(["m"])
        w = add_worker(d, 0, concurrency=100)
        codec = Codec()
        done: list[Exchange] = []
        before = loop.time()
        d.submit(body(codec, req("m", [1], "single")), done.append)
        d.submit(body(codec, [req("m", [i], i) for i in range(3)]), done.append)
        d.submit(body(codec, [req("m", [i], 10 + i) for i in range(3)]), done.append)
        after = loop.time()
        single, chunk, whole = w.channel.take()
        assert (single[0], chunk[0], whole[0]) == (wire.Kind.CALL, wire.Kind.CHUNK, wire.Kind.CHUNK)
        for frame in (single, chunk, whole):
            deadline = w.channel.deadlines[frame[1]]
            assert before + 5.0 - 0.001 <= deadline <= after + 5.0 + 0.01
            tick = (deadline + 0.001) / 0.01
            assert abs(tick - round(tick)) < 1e-6, deadline  # a tick's end, 1 ms early
        ack = wire.CANCEL_ACK
        d.on_reply(w, wire.Kind.ERROR, single[1], wire.NOT_RUN, ack)
        entries = wire.REPLY_ENTRY.pack(0, wire.Kind.RESULT, 1) + b"7" + b"".join(
            wire.REPLY_ENTRY.pack(i, wire.Kind.ERROR, len(ack)) + ack for i in (1, 2))
        d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 100, entries)
        d.on_reply(w, wire.Kind.ERROR, whole[1], wire.NOT_RUN, ack)  # a whole chunk, unstarted
        # ("started": false: the client may retry a call that never ran; round 60's new user)
        timed_out = {"code": -32001, "message": "Call timed out", "data": {"timeout_seconds": 5.0, "started": False}}
        assert len(done) == 3 and w.outstanding == 0
        assert json.loads(done[0].body()) == {"jsonrpc": "2.0", "id": "single", "error": timed_out}
        assert sorted(json.loads(done[1].body()), key=lambda a: a["id"]) == [
            {"jsonrpc": "2.0", "id": 0, "result": 7},
            {"jsonrpc": "2.0", "id": 1, "error": timed_out},
            {"jsonrpc": "2.0", "id": 2, "error": timed_out},
        ]
        assert [a["error"] for a in json.loads(done[2].body())] == [timed_out] * 3
        assert d.metrics is not None and d.metrics.outcomes[0][ErrorCode.TIMED_OUT] == 1 + 2 + 3
        assert (d.late_cancelled_total, d.late_results_total) == (0, 0)
        # A call whose handler ran before its deadline stopped the rest (a sync handler's
        # awaitable): CANCEL_ACK_RAN, -32001 without "started" (round 60: never false then).
        d.submit(body(codec, req("m", [1], "ran")), done.append)
        d.submit(body(codec, [req("m", [i], 20 + i) for i in range(3)]), done.append)
        single, chunk = w.channel.take()
        ran = wire.CANCEL_ACK_RAN
        d.on_reply(w, wire.Kind.ERROR, single[1], 1000, ran)
        entries = wire.REPLY_ENTRY.pack(0, wire.Kind.ERROR, len(ran)) + ran + b"".join(
            wire.REPLY_ENTRY.pack(i, wire.Kind.ERROR, len(ack)) + ack for i in (1, 2))
        d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 100, entries)
        plain = {"code": -32001, "message": "Call timed out", "data": {"timeout_seconds": 5.0}}
        assert json.loads(done[3].body()) == {"jsonrpc": "2.0", "id": "ran", "error": plain}
        assert sorted(json.loads(done[4].body()), key=lambda a: a["id"]) == [
            {"jsonrpc": "2.0", "id": 20, "error": plain},
            {"jsonrpc": "2.0", "id": 21, "error": timed_out},
            {"jsonrpc": "2.0", "id": 22, "error": timed_out},
        ]

    run(main)


def test_error_codes_outside_the_broker_table_share_one_metrics_entry():
    """Issue 9 item 14: per-method outcome state no longer grows with each distinct
    application error code; the counts are all there, as `application`."""
    from broker.metrics import APPLICATION, CallMetrics, outcome_name

    async def main() -> None:
        metrics = CallMetrics()
        d = Dispatcher(asyncio.get_running_loop(), metrics=metrics)
        d.set_methods(["fail"])
        w = add_worker(d, 0, concurrency=1 << 30)
        codec = Codec()
        codes = [*range(-32768, -32000), *range(1, 20_000)]  # reserved and free codes
        for i, code in enumerate(codes):
            d.submit(body(codec, req("fail", [code], i)), lambda e: None)
        for (_kind, call_id, _aux, params), code in zip(w.channel.take(), codes, strict=True):
            assert json.loads(params) == [code]
            d.on_reply(w, wire.Kind.ERROR, call_id, 5, b'{"code":%d,"message":"no"}' % code)
        outcomes = metrics.outcomes[0]
        broker_codes = {-32700, -32600, -32601, -32602, -32603, -32000, -32001, -32002, -32003, -32004, -32005}
        assert set(outcomes) <= broker_codes | {APPLICATION}
        assert sum(outcomes.values()) == len(codes)
        assert outcomes[APPLICATION] == len(codes) - len(broker_codes & set(codes))
        assert outcome_name(APPLICATION) == "application_error"

    run(main)


def sync_dispatcher(
    prefetch: int, workers: int = 2, concurrency: int = 100, share: float = 0.5
) -> tuple[Dispatcher, list[Worker]]:
    d = Dispatcher(asyncio.get_running_loop(), sync_prefetch=prefetch, connection_share=share)
    d.set_methods(["slow", "fast", "quick"], sync_methods=["slow", "quick"])  # fast: async
    return d, [add_worker(d, slot, concurrency) for slot in range(workers)]


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_a_worker_busy_in_a_sync_call_gets_no_more_than_the_prefetch(prefetch):
    """Issue 9 item 23: calls sent to a worker blocked in a sync handler wait behind it.
    It is the last choice, and gets at most `sync_prefetch` calls even then: the other
    worker takes calls up to its limit, then the blocked one its prefetch, then they queue."""

    async def main() -> None:
        d, (a, b) = sync_dispatcher(prefetch, concurrency=10)
        codec = Codec()
        d.submit(body(codec, req("slow", [0.2], "s")), lambda e: None)
        [slow] = a.channel.take() + b.channel.take()
        busy, other = (a, b) if a.sync_calls else (b, a)
        assert busy.sync_calls == 1 and busy.limit == 1 + prefetch
        for i in range(5):
            d.submit(body(codec, req("fast", [i], i)), lambda e: None)
        assert len(busy.channel.take()) == 0 and len(other.channel.take()) == 5
        for i in range(5, 40):
            d.submit(body(codec, req("fast", [i], i)), lambda e: None)
        assert len(other.channel.take()) == 5  # up to its limit of 10
        assert [first_params(f) for f in busy.channel.take()] == [[10 + n] for n in range(prefetch)]
        assert d.queued_calls == 40 - 10 - prefetch
        d.on_reply(busy, wire.Kind.RESULT, slow[1], 200_000, b"0.2")  # it returns
        assert (busy.sync_calls, busy.limit) == (0, 10)
        assert [first_params(f) for f in busy.channel.take()] == [[10 + n] for n in range(prefetch, 10)]

    run(main)


def test_with_the_prefetch_at_the_concurrency_sync_routing_is_off():
    """--sync-prefetch >= worker_concurrency: a worker in a sync call is picked like
    any other (the least loaded, ties in turn), as before issue 9 item 23."""

    async def main() -> None:
        d, (a, b) = sync_dispatcher(100)
        codec = Codec()
        d.submit(body(codec, req("slow", [0.2], "s")), lambda e: None)
        busy, other = (a, b) if a.outstanding else (b, a)
        for i in range(9):
            d.submit(body(codec, req("fast", [i], i)), lambda e: None)
        assert (busy.outstanding, other.outstanding, busy.limit) == (5, 5, 100)
        a.channel.take(), b.channel.take()
        d.submit(body(codec, [req("slow", [i], i) for i in range(4)]), lambda e: None)  # chunks, as before
        chunks = a.channel.take() + b.channel.take()
        assert sorted((f[0], f[2], first_params(f)[0]) for f in chunks) == [(wire.Kind.CHUNK, 2, 0), (wire.Kind.CHUNK, 2, 1)]
        assert (a.limit, b.limit) == (100, 100)

    run(main)


@pytest.mark.parametrize(("concurrency", "prefetch"), [(2, 1), (3, 2), (5, 4)])
def test_sync_routing_is_on_up_to_a_prefetch_of_one_less_than_the_concurrency(concurrency, prefetch):
    """Hostile round B finding 5: `_send` took a worker's limit down only when it was
    above 1 + sync_prefetch, so at sync_prefetch = worker_concurrency - 1 routing was
    silently off (the docs and --help say it is off only from worker_concurrency): the
    busy worker was not the last choice, and took a second slow sync call. Now it is
    blocked as with any smaller prefetch: calls go to the idle worker first, and a
    batch's slow sync calls go one by one."""

    async def main() -> None:
        d, (a, b) = sync_dispatcher(prefetch, concurrency=concurrency)
        codec = Codec()
        d.submit(body(codec, req("slow", [0.2], "s")), lambda e: None)
        busy, other = (a, b) if a.outstanding else (b, a)
        assert busy.sync_calls == 1 and busy.limit == 1 + prefetch == concurrency
        busy.channel.take()
        for i in range(concurrency):
            d.submit(body(codec, req("fast", [i], i)), lambda e: None)
        assert busy.channel.take() == [] and len(other.channel.take()) == concurrency  # the idle one first
        d.submit(body(codec, req("fast", ["p"], "p")), lambda e: None)
        assert [first_params(f) for f in busy.channel.take()] == [["p"]]  # then the prefetch
        d.submit(body(codec, req("slow", [1], "s2")), lambda e: None)
        assert busy.channel.take() == [] and busy.sync_calls == 1  # never a second slow call

    run(main)


def test_a_batch_of_slow_sync_calls_goes_one_by_one_at_a_prefetch_of_one_less_than_the_concurrency():
    """The same off-by-one in `_start_chunks`: at worker_concurrency 2, sync_prefetch 1 a
    batch of slow sync calls was cut into chunks (one per worker) instead of going one by one."""

    async def main() -> None:
        d, workers = sync_dispatcher(1, concurrency=2, share=1.0)
        d.submit(body(Codec(), [req("slow", [i], i) for i in range(6)]), lambda e: None)
        sent = [f for w in workers for f in w.channel.take()]
        assert sorted((f[0], first_params(f)) for f in sent) == [(wire.Kind.CALL, [0]), (wire.Kind.CALL, [1])]
        assert [w.sync_calls for w in workers] == [1, 1] and d.queued_calls == 4

    run(main)


def test_sync_methods_measured_fast_do_not_take_the_limit_down():
    """A sync method counts as blocking until a reply shows its calls take under 1 ms;
    a lone 3 ms outlier does not make it blocking (a moving average), a 50 ms call does."""

    async def main() -> None:
        d, (a,) = sync_dispatcher(1, workers=1)
        codec = Codec()
        d.submit(body(codec, req("quick", [], 1)), lambda e: None)
        assert a.limit == 2  # not measured yet: blocking
        [first] = a.channel.take()
        d.on_reply(a, wire.Kind.RESULT, first[1], 20, b"1")  # 20 us
        for i in range(10):
            d.submit(body(codec, req("quick", [], i)), lambda e: None)
        assert a.limit == 100 and a.sync_calls == 0 and len(a.channel.frames) == 10
        frames = a.channel.take()
        for frame in frames[:-2]:
            d.on_reply(a, wire.Kind.RESULT, frame[1], 20, b"1")
        d.on_reply(a, wire.Kind.RESULT, frames[-2][1], 3_000, b"1")  # descheduled for 3 ms
        d.submit(body(codec, req("quick", [], "o")), lambda e: None)
        assert a.sync_calls == 0 and a.limit == 100
        d.on_reply(a, wire.Kind.RESULT, frames[-1][1], 50_000, b"1")  # the last one took 50 ms
        d.submit(body(codec, req("quick", [], "q")), lambda e: None)
        assert a.sync_calls == 1 and a.limit == 2

    run(main)


def test_a_sync_methods_awaited_calls_teach_it_blocks_nothing():
    """Hostile testing (round 23): a sync-declared handler returning a coroutine (a
    decorator's wrapper made without functools.wraps) that awaits 1 s was learnt a
    blocking sync method from its calls' time, and ran one call at a time per worker (40
    calls on 2 workers: 20 s, not 1 s). Its replies say AWAITED: it blocked ~0 us; the
    rest of aux is still its service time for the metrics."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), sync_prefetch=1, metrics=CallMetrics())
        d.set_methods(["slow", "fast", "quick"], sync_methods=["slow", "quick"])
        a = add_worker(d, 0, 100)
        codec = Codec()
        d.submit(body(codec, req("quick", [], 1)), lambda e: None)
        assert a.limit == 2  # not measured yet: blocking
        [first] = a.channel.take()
        d.on_reply(a, wire.Kind.RESULT, first[1], wire.AWAITED | 1_000_000, b"1")  # awaited 1 s
        for i in range(10):
            d.submit(body(codec, req("quick", [], i)), lambda e: None)
        assert a.sync_calls == 0 and a.limit == 100 and len(a.channel.frames) == 10
        for frame in a.channel.take():
            d.on_reply(a, wire.Kind.RESULT, frame[1], wire.AWAITED | 1_000_000, b"1")
        assert d.metrics is not None
        assert sum(d.metrics.service[2].counts) == 11 and d.metrics.service[2].sum_us == 11 * 1_000_000
        # Not awaited, the same time is the worker's: blocking.
        d.submit(body(codec, req("quick", [], "s")), lambda e: None)
        [plain] = a.channel.take()
        for _ in range(12):
            d.on_reply(a, wire.Kind.RESULT, plain[1], 1_000_000, b"1")
            d.submit(body(codec, req("quick", [], "s")), lambda e: None)
            [plain] = a.channel.take()
        assert a.sync_calls == 1 and a.limit == 2

    run(main)


def test_a_batch_of_blocking_sync_calls_goes_out_one_by_one():
    """A chunk of slow sync calls would be head-of-line by itself: a batch's slow sync
    calls go one by one, in request order, one to each worker not blocked; the rest
    wait in the queue, held for their connection's share of the workers (at 1, all of them:
    every worker is blocked). A call another connection submits after them waits behind
    none of them: it goes at once as a blocked worker's prefetch (before the blocking share,
    stop 32, it waited in the queue behind the next slow call)."""

    async def main() -> None:
        d, workers = sync_dispatcher(1, share=1.0)
        codec = Codec()
        d.submit(body(codec, [req("slow", [i], i) for i in range(10)]), lambda e: None)
        sent = [w.channel.take() for w in workers]
        assert sorted(first_params(f) for frames in sent for f in frames) == [[0], [1]]
        assert all(f[0] == wire.Kind.CALL for frames in sent for f in frames)
        assert [(w.sync_calls, w.outstanding) for w in workers] == [(1, 1), (1, 1)]
        assert d.queued_calls == 8
        d.submit(body(codec, req("fast", [0], "f")), lambda e: None)
        assert d.queued_calls == 8 and d.held_calls == 8  # "f" went, as a prefetch
        assert sorted(w.outstanding for w in workers) == [1, 2]
        [frame] = sent[0]
        d.on_reply(workers[0], wire.Kind.RESULT, frame[1], 200_000, b"0")
        assert [first_params(f) for f in workers[0].channel.take()][-1:] == [[2]]
        assert workers[0].sync_calls == 1 and d.queued_calls == 7

    run(main)


def test_one_connections_blocking_sync_calls_hold_at_most_its_share_of_the_workers():
    """A blocking sync call holds its worker whole: one connection's hold at most
    connection_share of the workers (at least one), so another client's calls, slow or
    fast, find a worker free (round 60's new user: 2 slow sync calls of one client held
    both workers; round 62: another client's 64 pipelined calls waited 7.7 s, one slow
    call each). Its next goes when one of them returns."""

    async def main() -> None:
        d, workers = sync_dispatcher(1)  # (2 workers, share 0.5: one blocking call a connection)
        codec = Codec()
        greedy, other = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
        d.submit(body(codec, [req("slow", [i], i) for i in range(6)]), lambda e: None, greedy)
        sent = [f for w in workers for f in w.channel.take()]
        assert [first_params(f) for f in sent] == [[0]] and greedy.blocking == 1
        assert d.queued_calls == 5 and d.held_calls == 5
        free = next(w for w in workers if not w.sync_calls)
        d.submit(body(codec, req("slow", ["o"], "o")), lambda e: None, other)
        d.submit(body(codec, req("fast", ["f"], "f")), lambda e: None, other)
        busy = next(w for w in workers if w is not free)
        got = {w: [first_params(f) for f in w.channel.take()] for w in workers}  # (each channel taken once)
        assert got[free][:1] == [["o"]]
        assert ["f"] in got[free] + got[busy]  # (a prefetch: either, as their measured times fall)
        d.on_reply(busy, wire.Kind.RESULT, sent[0][1], 200_000, b"0")
        assert [first_params(f) for f in busy.channel.take()] == [[1]] and greedy.blocking == 1
        assert d.queued_calls == 4
        # At share 1 one connection may block every worker.
        d, workers = sync_dispatcher(1, share=1.0)
        d.submit(body(codec, [req("slow", [i], i) for i in range(6)]), lambda e: None)
        assert sorted(first_params(f) for w in workers for f in w.channel.take()) == [[0], [1]]

    run(main)


def _entries_from(payload: bytes, place: int) -> bytes:
    """A CHUNK payload's CALL_ENTRYs (and params) from its call at `place` on."""
    pos = 0
    for _ in range(place):
        _index, _flags, id_length, length = wire.CALL_ENTRY.unpack_from(payload, pos)
        pos += wire.CALL_ENTRY.size + id_length + length
    return payload[pos:]


def _chunk_reply(places: list[int], body: bytes = b'"ok"') -> bytes:
    return b"".join(wire.REPLY_ENTRY.pack(i, wire.RESULT, len(body)) + body for i in places)


def test_calls_given_back_by_their_worker_wait_again_at_their_connections_head_as_blocking():
    """Hostile testing (round 63): a sync method learnt fast, then a batch of its slow calls
    went 50 a worker and held both. A call goes RETURNABLE (wire.py) when it is not known to
    block and its worker is not blocked; a worker that finds its method slow gives back those
    not started (RETURN), and they wait at the head of their connection's calls as blocking
    sync calls, one by one (round 65: queued again as one blocking chunk, they held a worker
    for all of them), each with its chunk's deadline, sent without the flag: one connection's
    on at most its share of the workers. A chunk given back in part owes only the answers of
    the calls before. Every call is answered once, in its own slot."""

    async def main() -> None:
        d, (a, b) = sync_dispatcher(1)  # (2 workers of 100, share 0.5: one blocking call a connection)
        codec = Codec()
        d.submit(body(codec, req("quick", [0], 0)), lambda e: None)  # learnt fast from one cheap call
        [(_, first, _, _)] = a.channel.take() + b.channel.take()
        assert not (a.channel.flows.get(first, 0) | b.channel.flows.get(first, 0)) & wire.RETURNABLE  # (blocking yet)
        d.on_reply(a if first in a.channel.flows else b, wire.Kind.RESULT, first, 5, b"0")
        done: list[Exchange] = []
        greedy = ResponseBudget(d.outgoing)
        d.submit(body(codec, [req("quick", [i], i) for i in range(6)]), done.append, greedy)
        [chunk_a] = a.channel.take()
        [chunk_b] = b.channel.take()
        assert chunk_a[0] == chunk_b[0] == wire.Kind.CHUNK and chunk_a[2] == chunk_b[2] == 3
        assert a.channel.flows[chunk_a[1]] == b.channel.flows[chunk_b[1]] == greedy.flow | wire.RETURNABLE
        deadline = a.channel.deadlines[chunk_a[1]]
        # Worker a ran its chunk's first call (slow: quick(0)) and gives back the other two.
        d.on_reply(a, wire.Kind.RETURN, chunk_a[1], 1, _entries_from(chunk_a[3], 1))
        [single] = a.channel.take()  # (at once, one: the least loaded worker not blocked; a is, now)
        assert single[0] == wire.Kind.CALL and json.loads(single[3]) == [2]
        assert a.channel.deadlines[single[1]] == deadline and a.channel.flows[single[1]] == greedy.flow
        assert a.blocked and greedy.blocking == 1 and a.outstanding == 2 and d.returned_total == 2
        assert d.queued_calls == 1 and d.held_calls == 1  # (quick(4): its connection holds its share)
        # Worker b gives back its whole chunk: its three wait too, the next of its connection's.
        d.on_reply(b, wire.Kind.RETURN, chunk_b[1], 0, chunk_b[3])
        assert b.outstanding == 0 and not b.channel.take() and d.queued_calls == 4 and d.returned_total == 5
        assert chunk_b[1] not in d._pending
        other: list[Exchange] = []
        d.submit(body(codec, req("quick", ["o"], "o")), other.append)  # another client: worker b, at once
        [(_, o, _, _)] = b.channel.take()
        assert b.channel.flows[o] & wire.RETURNABLE
        d.on_reply(b, wire.Kind.RESULT, o, 5, b'"o"')
        assert other and json.loads(other[0].answers[0])["result"] == "o"
        # One at a time, each answered in its own slot; the first chunk owes only its first.
        d.on_reply(a, wire.Kind.CHUNK_REPLY, chunk_a[1], 200_000, _chunk_reply([0], b'"first"'))
        sent = [single]
        while not done:
            frame = sent[-1]
            worker = a if frame[1] in a.channel.flows else b
            d.on_reply(worker, wire.Kind.RESULT, frame[1], 200_000, b'"%d"' % json.loads(frame[3])[0])
            assert greedy.blocking <= 1
            sent += a.channel.take() + b.channel.take()
            assert len(sent) <= 5
        assert sorted(json.loads(f[3])[0] for f in sent) == [1, 2, 3, 4, 5]
        [exchange] = done
        answers = [json.loads(x) for x in exchange.answers]
        assert [x["id"] for x in answers] == list(range(6))
        assert [x["result"] for x in answers] == ["first", "1", "2", "3", "4", "5"]
        assert (a.outstanding, b.outstanding, greedy.in_flight, greedy.blocking, d.queued_calls) == (0, 0, 0, 0, 0)

    run(main)


def test_a_call_given_back_after_its_deadline_is_not_answered_again():
    """A call answered -32001 at its deadline while its worker gave it back: it is dropped
    (counted as a late cancel), never queued or answered again; so is a chunk's part given
    back after its chunk timed out."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), timeout=0.05)
        d.set_methods(["quick"], sync_methods=["quick"])
        w = add_worker(d, 0, concurrency=100)
        codec = Codec()
        d.submit(body(codec, req("quick", [0], 0)), lambda e: None)
        [(_, first, _, _)] = w.channel.take()
        d.on_reply(w, wire.Kind.RESULT, first, 5, b"0")
        done: list[Exchange] = []
        d.submit(body(codec, req("quick", [1], 1)), done.append)
        d.submit(body(codec, [req("quick", [i], i) for i in range(3)]), done.append)
        single, chunk = w.channel.take()
        assert w.channel.flows[single[1]] & w.channel.flows[chunk[1]] & wire.RETURNABLE
        await asyncio.sleep(0.1)
        assert len(done) == 2 and all(b"-32001" in x for e in done for x in e.answers)  # type: ignore[operator]
        w.channel.take()  # (the CANCELs)
        d.on_reply(w, wire.Kind.RETURN, single[1], 0, single[3])
        d.on_reply(w, wire.Kind.RETURN, chunk[1], 1, _entries_from(chunk[3], 1))
        assert d.late_cancelled_total == 3 and d.returned_total == 3
        assert not w.channel.take() and d.queued_calls == 0 and w.outstanding == 1  # (the chunk's first)
        d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 5, _chunk_reply([0]))
        assert w.outstanding == 0 and not d._pending and len(done) == 2

    run(main)


def test_a_blocked_worker_takes_no_second_sync_call_but_its_prefetch_of_others():
    """One worker, --sync-prefetch 2: a second slow call waits in the queue (at most
    one blocking sync call per worker), and so does a fast call behind it; once the
    first returns, the second starts and the fast call is prefetched behind it."""

    async def main() -> None:
        d, (w,) = sync_dispatcher(2, workers=1)
        codec = Codec()
        for params in (["s1"], ["s2"]):
            d.submit(body(codec, req("slow", params, params[0])), lambda e: None)
        d.submit(body(codec, req("fast", ["f"], "f")), lambda e: None)
        [first] = w.channel.take()
        assert first_params(first) == ["s1"] and d.queued_calls == 2 and w.limit == 3
        d.on_reply(w, wire.Kind.RESULT, first[1], 200_000, b"0")
        assert [first_params(f) for f in w.channel.take()] == [["s2"], ["f"]]
        assert (w.sync_calls, w.outstanding, d.queued_calls) == (1, 2, 0)

    run(main)


def test_with_every_worker_blocked_a_call_goes_behind_the_blocking_call_expected_to_end_first():
    """Hostile testing, round 88 (LOW): `add`, learnt blocking for a moment on a loaded
    machine, blocked one worker of 2 while the other ran a 4 s sync call; the next `add`
    went behind the 4 s call half the time (round robin among blocked workers) and
    waited 3-4 s. Now it goes where the blocking calls are expected to end first; and
    when that one has no room for it (its prefetch taken), it waits in the queue for it
    rather than go behind the longer call (round 90: the same, every time)."""

    async def main() -> None:
        d, (a, b) = sync_dispatcher(2, concurrency=10)
        codec = Codec()
        d.submit(body(codec, req("slow", [4], "learn")), lambda e: None)
        [(_, learn, _, _)] = a.channel.take() + b.channel.take()
        d.on_reply(a if a.outstanding else b, wire.Kind.RESULT, learn, 4_000_000, b"0")  # slow: 500 ms, learnt
        for round_ in range(6):  # which worker takes which blocking call is the round robin's
            d.submit(body(codec, req("slow", [4], f"s{round_}")), lambda e: None)
            long_ = a if a.blocked else b
            d.submit(body(codec, req("quick", [], f"q{round_}")), lambda e: None)  # (1 ms until learnt)
            short = b if long_ is a else a
            assert short.blocked and long_.channel.take() and short.channel.take()
            for i in range(3):
                d.submit(body(codec, req("fast", [i], f"f{round_}.{i}")), lambda e: None)
            assert (len(short.channel.take()), len(long_.channel.take())) == (2, 0)  # (short's prefetch is 2)
            assert d.queued_calls == 1  # the third waits for it (round 90), not behind the long one
            d.on_reply(short, wire.Kind.RESULT, next(c for c, call in d._pending.items() if call.index == 2), 1000, b"0")
            assert len(short.channel.take()) == 1 and d.queued_calls == 0  # quick answered: it goes there
            for w in (a, b):
                for call_id, call in [(c, call) for c, call in d._pending.items() if call.worker is w]:
                    d.on_reply(w, wire.Kind.RESULT, call_id, 4_000_000 if call.index == 0 else 1000, b"0")
                w.channel.take()

    run(main)


def test_a_blocking_call_is_expected_to_run_at_least_as_long_again_as_it_has():
    """Hostile testing, round 91 (with --sync-prefetch 1): a 4 s call of a method estimated
    at 0.5 s read ~0 ms left near 0.5 s into it, and the next fast call went behind it. A
    blocking call is expected to run at least as long again as it has, whatever its
    method's estimate says: 400 ms into a call estimated at 500 ms, a call of 300 ms just
    sent on the other worker ends first. (Of one method fast for some params and slow for
    others, two calls look alike until one has run longer than the other's estimate: the
    reason sync_prefetch is 0 by default.)"""

    async def main() -> None:
        d, (a, b) = sync_dispatcher(1, concurrency=10)
        codec = Codec()
        for method, us in (("slow", 4_000_000), ("quick", 2_400_000)):  # learnt: ~500 and ~300 ms
            d.submit(body(codec, req(method, [], "learn")), lambda e: None)
            [(_, learn, _, _)] = a.channel.take() + b.channel.take()
            d.on_reply(a if a.outstanding else b, wire.Kind.RESULT, learn, us, b"0")
        d.submit(body(codec, req("slow", [4], "long")), lambda e: None, ResponseBudget(d.outgoing))
        long_ = a if a.blocked else b
        short = b if long_ is a else a
        long_.sync_since -= 0.4  # it has run 400 ms: its estimate says ~100 ms left
        long_.sync_until -= 0.4
        d.submit(body(codec, req("quick", [], "q")), lambda e: None, ResponseBudget(d.outgoing))  # ~300 ms left
        assert short.blocked and long_.channel.take() and short.channel.take()
        d.submit(body(codec, req("fast", [], "f")), lambda e: None)
        assert (len(short.channel.take()), len(long_.channel.take())) == (1, 0)

    run(main)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_chunk_goes_to_a_blocked_worker_only_if_all_its_calls_fit_its_prefetch(prefetch):
    """Hostile round B finding 3: `_pick` tested a blocked worker's load against its
    lowered limit (1 + sync_prefetch) once per unit routed, and a chunk is one unit
    standing for many calls: with the other worker full, a batch of 40 went to the
    worker busy in a hung sync call as a chunk of 20, and all 20 died with it. A chunk
    now goes to a blocked worker only if its weight fits under that limit."""

    async def main() -> None:
        # (one connection may take every place: else a batch past its share goes in chunks of 1)
        d, (a, b) = sync_dispatcher(prefetch, concurrency=40, share=1.0)
        codec = Codec()
        d.submit(body(codec, req("slow", [60], "hung")), lambda e: None)
        busy, other = (a, b) if a.outstanding else (b, a)
        busy.channel.take()
        for i in range(40):
            d.submit(body(codec, req("fast", [i], i)), lambda e: None)
        assert len(other.channel.take()) == 40 and other.outstanding == other.limit == 40
        d.submit(body(codec, [req("fast", [i], f"b{i}") for i in range(40)]), lambda e: None)  # 2 chunks of 20
        assert busy.channel.take() == [] and d.queued_calls == 40
        # Small chunks: one fits the prefetch of 2, not of 1.
        d2, (a2, b2) = sync_dispatcher(prefetch, concurrency=4, share=1.0)
        d2.submit(body(codec, req("slow", [60], "hung")), lambda e: None)
        busy2, other2 = (a2, b2) if a2.outstanding else (b2, a2)
        busy2.channel.take()
        for i in range(4):
            d2.submit(body(codec, req("fast", [i], i)), lambda e: None)
        other2.channel.take()
        d2.submit(body(codec, [req("fast", [i], f"c{i}") for i in range(4)]), lambda e: None)  # 2 chunks of 2
        sent = busy2.channel.take()
        if prefetch == 1:
            assert sent == [] and d2.queued_calls == 4
        else:
            assert [(f[0], f[2]) for f in sent] == [(wire.Kind.CHUNK, 2)] and busy2.outstanding == 3
            assert d2.queued_calls == 2

    run(main)


def test_a_chunk_waits_for_a_lone_blocked_worker_to_return():
    """One worker busy in a slow sync call: a chunk waits in the queue (it would not fit
    the prefetch) and goes once the sync call returns."""

    async def main() -> None:
        d, (w,) = sync_dispatcher(1, workers=1, concurrency=10)
        codec = Codec()
        d.submit(body(codec, req("slow", [60], "hung")), lambda e: None)
        [slow] = w.channel.take()
        d.submit(body(codec, [req("fast", [i], i) for i in range(5)]), lambda e: None)
        assert w.channel.take() == [] and d.queued_calls == 5
        d.on_reply(w, wire.Kind.RESULT, slow[1], 200_000, b"0")
        [chunk] = w.channel.take()
        assert (chunk[0], chunk[2], w.outstanding) == (wire.Kind.CHUNK, 5, 5)

    run(main)


def test_a_call_behind_a_queued_chunk_that_expires_goes_at_once_to_the_blocked_worker_it_fits():
    """Found by the dispatcher's state machine (stop 30): a chunk waited at the head of the
    queue, too large for the prefetch of the one worker, blocked in a slow sync call; when
    its deadline passed, the single call behind it, which fits that prefetch, still waited
    (no pump ran) until the sync call returned, although the worker could take it."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), sync_prefetch=1, method_timeouts={"brief": 0.05})
        d.set_methods(["slow", "brief", "fast"], sync_methods=["slow"])
        w = add_worker(d, 0, 10)
        codec = Codec()
        answers: list[Exchange] = []
        d.submit(body(codec, req("slow", [60], "hung")), lambda e: None)
        assert len(w.channel.take()) == 1 and w.blocked and w.limit == 2
        connection = ResponseBudget(d.outgoing)  # (both on one connection: the call behind the chunk)
        d.submit(body(codec, [req("brief", [i], i) for i in range(5)]), answers.append, connection)
        d.submit(body(codec, req("fast", [7], "after")), answers.append, connection)
        assert w.channel.take() == [] and d.queued_calls == 6
        await wait_until(lambda: len(answers) == 1)  # the chunk: -32001
        await wait_until(lambda: d.queued_calls == 0)
        [sent] = w.channel.take()
        assert (sent[0], first_params(sent), w.outstanding) == (wire.Kind.CALL, [7], 2)

    run(main)


def test_a_slow_sync_call_goes_at_once_to_the_least_busy_worker_it_may_block():
    """Hostile round 6 finding 1: a slow sync call went only to a worker with at most
    sync_prefetch calls in flight, else waited with a worker held for it. It now goes
    at once to the least busy worker that is not blocked: an idle one when there is
    one, else the one with the fewest calls in flight, however many (so the calls a hang
    there would take with it are the fewest the broker could find). It is never queued
    while such a worker has room, and no worker is held: the calls after it go on."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), sync_prefetch=1)
        d.set_methods(["slow", "fast"], sync_methods=["slow"])
        a, b = add_worker(d, 0, 20), add_worker(d, 1, 20)
        codec = Codec()
        for i in range(8):
            d.submit(body(codec, req("fast", [i], f"a{i}")), lambda e: None)
        c = add_worker(d, 2, 20)  # 4, 4 and 0 in flight: ...
        d.submit(body(codec, req("slow", [1], "s1")), lambda e: None)  # ... it goes to the idle one
        assert [first_params(f) for f in c.channel.take()] == [[1]] and c.blocked
        for i in range(8, 12):  # 6 and 6 besides it
            d.submit(body(codec, req("fast", [i], f"a{i}")), lambda e: None)
        assert (a.outstanding, b.outstanding, c.outstanding) == (6, 6, 1)
        a.channel.take()
        d.on_reply(b, wire.Kind.RESULT, b.channel.take()[0][1], 0, b"0")  # 5 on b now: the fewest
        d.submit(body(codec, req("slow", [2], "s2")), lambda e: None)  # none has <= 1: at once all the same
        assert [first_params(f) for f in b.channel.take()] == [[2]] and a.channel.frames == []
        assert (b.outstanding, b.blocked, b.limit, d.queued_calls) == (6, True, 2, 0)
        for i in range(5):  # the calls after it are not held behind it: the worker not blocked takes them
            d.submit(body(codec, req("fast", [i], f"n{i}")), lambda e: None)
        assert len(a.channel.take()) == 5 and b.channel.frames == c.channel.frames == [] and d.queued_calls == 0

    run(main)


def test_with_max_queue_0_a_slow_sync_call_runs_beside_calls_in_flight():
    """Hostile round 6 finding 4 (r3_maxqueue0_sync_overloaded.py): with max_queue 0, 6
    async calls in flight on 2 workers of concurrency 100 and a slow sync call: the call
    found no worker with at most sync_prefetch calls, waited apart, and that wait counted
    against max_queue: answered -32000 "overloaded" with the workers nearly idle. It
    now runs at once on one of them."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), max_queue=0, sync_prefetch=1)
        d.set_methods(["report", "io"], sync_methods=["report"])
        a, b = add_worker(d, 0, 100), add_worker(d, 1, 100)
        codec = Codec()
        for i in range(6):
            d.submit(body(codec, req("io", [2], f"io{i}")), lambda e: None)
        assert (a.outstanding, b.outstanding) == (3, 3)
        a.channel.take(), b.channel.take()
        answers: list[Exchange] = []
        d.submit(body(codec, req("report", [0.01], "R")), answers.append)
        [frame] = a.channel.take() + b.channel.take()
        assert first_params(frame) == [0.01] and answers == []
        worker = a if a.blocked else b
        d.on_reply(worker, wire.Kind.RESULT, frame[1], 10_000, b'"done"')
        assert answers and answers[0].answers == [b'{"jsonrpc":"2.0","id":"R","result":"done"}']

    run(main)


def unqueued(method: str, concurrency: int, sync: bool = False) -> tuple[Dispatcher, Worker, Worker]:
    """In a running loop: a dispatcher with max_queue 0 serving `method` (sync: a sync method,
    unmeasured, so blocking) on two ready workers of `concurrency` places."""
    d = Dispatcher(asyncio.get_running_loop(), max_queue=0)
    d.set_methods([method], sync_methods=[method] if sync else ())
    return d, add_worker(d, 0, concurrency), add_worker(d, 1, concurrency)


def test_with_max_queue_0_a_connection_s_calls_past_its_share_go_to_idle_workers():
    """Hostile testing, round 83 (MEDIUM): with max_queue 0, a connection's calls past its
    share could not wait their turn, and were refused -32000 "queue full" by an idle broker
    (of 4 pipelined calls to 2 idle workers of concurrency 1, 3). Nothing can wait: they go
    to the workers with room; only a call no worker has room for is refused."""

    async def main() -> None:
        d, a, b = unqueued("fast", 1)
        codec = Codec()
        budget = ResponseBudget(d.outgoing)
        answers: list[Exchange] = []
        exchanges = [d.submit(body(codec, req("fast", [i], i)), answers.append, budget) for i in range(3)]
        assert len(a.channel.take()) + len(b.channel.take()) == 2  # (the share is 1 place of 2)
        assert [e.answers for e in exchanges[:2]] == [[None], [None]]  # (sent, not refused)
        assert json.loads(exchanges[2].answers[0])["error"]["code"] == -32000  # (no worker has room)

    run(main)


def test_with_max_queue_0_a_connection_past_its_share_takes_no_busy_worker_s_places():
    """Hostile testing, round 85 (MEDIUM): with max_queue 0, one connection's batches took
    every place of every worker, its calls past its share sent wherever there was room, and
    every other client's calls were refused -32000. Past its share, a call that cannot wait
    goes to an idle worker only."""

    async def main() -> None:
        d, a, b = unqueued("m", 10)
        codec = Codec()
        flood = ResponseBudget(d.outgoing)
        exchanges = [d.submit(body(codec, req("m", [i], i)), lambda e: None, flood) for i in range(20)]
        assert len(a.channel.take()) + len(b.channel.take()) == 10  # type: ignore[union-attr]  # (its share)
        assert all(json.loads(e.answers[0])["error"]["code"] == -32000 for e in exchanges[10:])
        other = d.submit(body(codec, req("m", [0], "x")), lambda e: None, ResponseBudget(d.outgoing))
        assert len(a.channel.take()) + len(b.channel.take()) == 1 and other.answers == [None]  # type: ignore[union-attr]

    run(main)


def test_with_max_queue_0_a_connection_s_blocking_sync_calls_past_its_share_are_refused():
    """Hostile testing, round 88 (MEDIUM): with max_queue 0, a connection's blocking sync calls
    past its share went to idle workers, each holding its worker whole: one connection's two
    pipelined slow calls held both workers, and every other client's sync call was refused.
    A blocking sync call keeps to its connection's share of the workers (it is refused past it)."""

    async def main() -> None:
        d, a, b = unqueued("slow", 10, sync=True)  # (unmeasured: blocking)
        codec = Codec()
        flood = ResponseBudget(d.outgoing)
        first, second = (d.submit(body(codec, req("slow", [1], i)), lambda e: None, flood) for i in range(2))
        assert len(a.channel.take()) + len(b.channel.take()) == 1  # type: ignore[union-attr]
        assert first.answers == [None] and json.loads(second.answers[0])["error"]["code"] == -32000
        other = d.submit(body(codec, req("slow", [0], "x")), lambda e: None, ResponseBudget(d.outgoing))
        assert len(a.channel.take()) + len(b.channel.take()) == 1 and other.answers == [None]  # type: ignore[union-attr]

    run(main)


def test_async_calls_are_not_held_behind_a_slow_sync_call_behind_long_polls(monkeypatch):
    """Hostile round 6 finding 1 (r4_held_worker_stalls_async.py), in memory: worker A
    runs a slow sync call, worker B two long polls; one more slow sync call came, no
    worker had at most sync_prefetch calls, so B was held for it: B took no new call
    until its long polls ended, A only its prefetch, and every other async call timed
    out. Now the slow call goes to B at once (B's loop is blocked only while it runs);
    the async calls behind it take A's prefetch, wait in the queue while it runs, and
    go to B the moment it returns. The dispatcher's clock stands still: which blocked
    worker is expected free first depends on how long their calls have run (new user,
    round 105: on a loaded machine under mutmut, half of BLOCKING_US passed between the
    two slow calls, and the async ones waited for B rather than take A's prefetch)."""
    for module in ("dispatch", "membership", "queueing", "replies", "routing"):
        monkeypatch.setattr(f"broker.{module}._clock", lambda: 1000.0)

    async def main() -> None:
        d, (a, b) = sync_dispatcher(1)
        codec = Codec()
        d.submit(body(codec, req("slow", [6], "R1")), lambda e: None)
        blocked, free = (a, b) if a.blocked else (b, a)
        for i in (1, 2):
            d.submit(body(codec, req("fast", [6], f"P{i}")), lambda e: None)
        assert (blocked.outstanding, free.outstanding) == (1, 2)
        blocked.channel.take(), free.channel.take()
        d.submit(body(codec, req("slow", [0.01], "R2")), lambda e: None)
        [r2] = free.channel.take()
        assert first_params(r2) == [0.01] and free.blocked and d.queued_calls == 0
        for i in range(1, 21):
            d.submit(body(codec, req("fast", [i], i)), lambda e: None)
        assert len(blocked.channel.take()) == 1 and free.channel.frames == []  # A's prefetch; B is busy in R2
        assert d.queued_calls == 19
        d.on_reply(free, wire.Kind.RESULT, r2[1], 10_000, b'"report"')  # R2 returns
        assert len(free.channel.take()) == 19 and d.queued_calls == 0

    run(main)


def test_the_worker_hello_names_its_sync_methods():
    """The HELLO a real WorkerProtocol writes on connecting lists the demo's sync
    methods (every one but `sleep`); a HELLO without the field still decodes."""
    from broker.demo import registry
    from broker.worker import WorkerProtocol

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        transport, _ = await loop.create_unix_connection(lambda: WorkerProtocol(registry, 3, 7), sock=theirs)
        try:
            decoder = wire.FrameDecoder()
            frames: list[tuple[int, int, int, bytes]] = []
            while not frames:
                frames += decoder.feed(await loop.sock_recv(ours, 65536))
        finally:
            transport.close()
            ours.close()
        [(kind, _, _, payload)] = frames
        hello = wire.decode_hello(payload)
        assert kind == wire.Kind.HELLO and (hello.slot, hello.concurrency) == (3, 7)
        names = [m.name for m in hello.methods]
        assert "sleep" in names and sorted(hello.sync_methods) == sorted(n for n in names if n != "sleep")
        assert hello.wire == wire.VERSION
        plain = {"pid": 1, "slot": 0, "methods": [{"name": "add"}], "concurrency": 1}
        assert wire.decode_hello(json.dumps({**plain, "wire": wire.VERSION}).encode()).sync_methods == []
        with pytest.raises(wire.WireMismatch, match="speaks wire version 1,"):  # (no version: 1's)
            wire.decode_hello(json.dumps(plain).encode())

    run(main)


def test_a_reload_that_makes_a_sync_method_async_routes_it_as_async():
    """Attack B finding 2: `m` is sync in the old code and async in the new. The old
    worker's reply to a call in flight at the swap must not teach the new async method
    an estimate (it used to become a blocking sync method for good), and the call
    queued at the swap goes out as an async call; the old worker's sync accounting
    still ends at zero."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), sync_prefetch=1)
        d.set_methods(["m"], sync_methods=["m"])
        old = add_worker(d, 0, 100)
        codec = Codec()
        d.submit(body(codec, req("m", [1], 1)), lambda e: None)
        d.submit(body(codec, req("m", [2], 2)), lambda e: None)  # a second blocking call: queued
        [in_flight] = old.channel.take()
        assert (old.sync_calls, old.limit, d.queued_calls) == (1, 2, 1)
        d.worker_unready(old)  # the swap (Pool._swap): old out, new table, new worker in
        d.set_methods(["m"], sync_methods=[])
        new = add_worker(d, 0, 100)
        [queued] = new.channel.take()
        assert first_params(queued) == [2]
        assert (new.sync_calls, new.limit) == (0, 100)
        d.on_reply(old, wire.Kind.RESULT, in_flight[1], 900_000, b"1")  # the old handler took 0.9 s
        assert (old.sync_calls, old.limit, old.outstanding) == (0, 100, 0)
        for i in range(10):
            d.submit(body(codec, req("m", [i], f"n{i}")), lambda e: None)
        assert len(new.channel.take()) == 10 and (new.sync_calls, new.limit) == (0, 100)
        d.on_reply(new, wire.Kind.RESULT, queued[1], 900_000, b"1")  # async: never measured
        d.submit(body(codec, req("m", [0], "after")), lambda e: None)
        assert new.sync_calls == 0 and new.limit == 100

    run(main)


def test_a_reload_that_makes_an_async_method_sync_blocks_its_queued_calls():
    """The other way: calls queued at the swap to a method now sync (unmeasured, so
    blocking) go out as blocking sync calls, one per worker."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), sync_prefetch=1)
        d.set_methods(["m"])
        old = add_worker(d, 0, 1)
        codec = Codec()
        for i in range(3):
            d.submit(body(codec, req("m", [i], i)), lambda e: None)
        assert len(old.channel.take()) == 1 and d.queued_calls == 2
        d.worker_unready(old)
        d.set_methods(["m"], sync_methods=["m"])
        new = add_worker(d, 0, 100)
        assert [first_params(f) for f in new.channel.take()] == [[1]]  # one blocking call, the other waits
        assert (new.sync_calls, new.limit, d.queued_calls) == (1, 2, 1)

    run(main)


def test_queued_calls_of_a_sync_method_go_out_as_what_it_is_known_to_be_when_sent():
    """Hostile testing (r2_reload_sheds_sync_batches.py): a batch's calls of an unmeasured
    sync method (blocking until its first answer) go out one per worker and the rest
    queue; they kept their blocking label after the first answer showed the method fast,
    so they went on one at a time per worker. Now its first fast answer sends them all
    at once, as the fast calls they are; a method found slow while queued waits as one."""

    async def main() -> None:
        d, workers = sync_dispatcher(1, share=1.0)
        codec = Codec()
        d.submit(body(codec, [req("quick", [i], i) for i in range(10)]), lambda e: None)
        [first], [_second] = (w.channel.take() for w in workers)
        assert d.queued_calls == 8
        d.on_reply(workers[0], wire.Kind.RESULT, first[1], 20, b"0")  # 20 us: fast
        assert d.queued_calls == 0
        assert sum(len(w.channel.take()) for w in workers) == 8
        assert workers[0].sync_calls == 0  # (the other is still in its first, blocking call)
        # The other way: `quick`, known fast, turns out slow while calls of it are queued.
        d2, (w,) = sync_dispatcher(1, workers=1, concurrency=3)
        d2.submit(body(codec, req("quick", [], "a")), lambda e: None)
        [a] = w.channel.take()
        d2.on_reply(w, wire.Kind.RESULT, a[1], 20, b"0")  # fast
        d2.submit(body(codec, req("quick", [], "b")), lambda e: None)
        for i in range(2):
            d2.submit(body(codec, req("fast", [i], i)), lambda e: None)  # (async) w at its limit, 3
        for i in range(3):
            d2.submit(body(codec, req("quick", [i], f"q{i}")), lambda e: None)
        [b, *_] = w.channel.take()
        assert d2.queued_calls == 3 and w.sync_calls == 0
        d2.on_reply(w, wire.Kind.RESULT, b[1], 900_000, b"0")  # that one took 0.9 s: blocking now
        assert len(w.channel.take()) == 1  # one queued `quick`, as the blocking call it now is
        assert (w.sync_calls, w.limit, d2.queued_calls) == (1, 2, 2)

    run(main)


def test_a_reload_keeps_what_was_learnt_of_a_method_that_stays_sync():
    """Hostile testing (r2_reload_sheds_sync_batches.py): every reload (and the SIGHUP
    of the same code) made a fast sync method blocking again until its first answer, so
    a burst of batches right after it went out one call at a time and was shed. A method
    sync before and after keeps its estimate (a batch of it goes in chunks at once); one
    made sync by the reload starts unmeasured (blocking)."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), sync_prefetch=1, connection_share=1.0)
        d.set_methods(["add", "m"], sync_methods=["add"])
        old = add_worker(d, 0, 100)
        codec = Codec()
        d.submit(body(codec, req("add", [1, 2], 0)), lambda e: None)
        [frame] = old.channel.take()
        d.on_reply(old, wire.Kind.RESULT, frame[1], 20, b"3")  # fast
        d.worker_unready(old)  # the swap (Pool._swap)
        d.set_methods(["add", "m"], sync_methods=["add", "m"])
        new = [add_worker(d, slot, 100) for slot in range(2)]
        d.submit(body(codec, [req("add", [i, 1], i) for i in range(100)]), lambda e: None)
        frames = [f for w in new for f in w.channel.take()]
        assert sorted((f[0], f[2]) for f in frames) == [(wire.Kind.CHUNK, 50), (wire.Kind.CHUNK, 50)]
        assert d.queued_calls == 0 and all(w.sync_calls == 0 for w in new)
        d.submit(body(codec, [req("m", [], i) for i in range(4)]), lambda e: None)  # async made sync
        assert [f[0] for w in new for f in w.channel.take()] == [wire.Kind.CALL, wire.Kind.CALL]
        assert d.queued_calls == 2

    run(main)


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 1e300, 0.0, -1.0])
def test_a_deadline_the_wheel_cannot_hold_is_refused_at_construction(seconds):
    """Attack B finding 4: timeout = inf passed the dispatcher and every call then
    raised OverflowError inside a front-end callback (int(inf) in DeadlineWheel.add)."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(ValueError, match="deadline of timeout"):
            Dispatcher(loop, timeout=seconds)
        with pytest.raises(ValueError, match="deadline of add"):
            Dispatcher(loop, method_timeouts={"add": seconds})
        Dispatcher(loop, timeout=86400.0, method_timeouts={"add": 86400.0})

    run(main)


def test_answers_owed_on_one_connection_share_max_response_bytes_and_are_given_back():
    """The exchanges of one connection share its ResponseBudget: a result (single call or
    in a chunk) that would take what the connection is owed past max_response_bytes is
    answered -32603 with its own id; writing an answer gives its bytes back (written), at
    once or, past the write buffer's high mark, once it drains; the budget is exact."""
    from broker.dispatch import ResponseBudget

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), max_response_bytes=1000)
        d.set_methods(["blob"])
        w = add_worker(d, 0, concurrency=100)
        codec = Codec()
        budget = ResponseBudget(d.outgoing)
        done: list[Exchange] = []
        result = b'"' + b"x" * 398 + b'"'  # 400 bytes: two fit in 1000, with the splice
        first = d.submit(body(codec, req("blob", [], 1)), done.append, budget)
        batch = d.submit(body(codec, [req("blob", [], f"b{i}") for i in range(4)]), done.append, budget)
        assert first is not None and batch is not None
        single, chunk = w.channel.take()
        d.on_reply(w, wire.Kind.RESULT, single[1], 0, result)
        assert budget.held == first.size == len(first.answers[0] or b"") > 400
        d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 0, chunk_reply(chunk, body_=result))
        answers = [json.loads(a or b"") for a in batch.answers]
        assert [a["id"] for a in answers] == ["b0", "b1", "b2", "b3"]
        assert ["result" in a for a in answers] == [True, False, False, False]  # 1 + 1 fit
        for a in answers[1:]:
            assert a["error"] == {"code": -32603, "message": "Internal error",
                                  "data": "responses owed on this connection exceed max_response_bytes 1000"}
        assert d.oversize_total == 3 and len(done) == 2
        assert budget.held == first.size + batch.size == sum(len(a or b"") for a in [*first.answers, *batch.answers])
        budget.written(first, write_paused=True)  # parked until the buffer drains
        assert budget.held == first.size + batch.size + budget.parked and first.size == 0
        budget.drained()
        budget.written(batch, write_paused=False)
        assert (budget.held, budget.parked) == (0, 0)
        again = d.submit(body(codec, req("blob", [], 2)), done.append, budget)
        assert again is not None
        [frame] = w.channel.take()
        d.on_reply(w, wire.Kind.RESULT, frame[1], 0, result)
        assert json.loads(again.answers[0] or b"")["result"] == "x" * 398  # room again

    run(main)


def test_expired_queued_calls_release_their_payload_and_their_shells_are_compacted():
    """Hostile testing (t_qmem.py): a call that expires in the queue behind a live head
    with a long deadline drops its params and ids at once, and the expired shells are
    dropped from the deque once they are more than half of it (amortised O(1) each)."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), timeout=60.0, method_timeouts={"eat": 0.02})
        d.set_methods(["sleep", "eat"])
        w = add_worker(d, 0, concurrency=1)
        codec = Codec()
        d.submit(body(codec, req("sleep", [60], "busy")), lambda e: None)
        d.submit(body(codec, req("sleep", [1], "head")), lambda e: None)  # the live head
        assert len(w.channel.take()) == 1
        answers: list[bytes] = []
        for _round in range(3):
            calls = []
            for i in range(50):
                exchange = d.submit(body(codec, req("eat", ["x" * 1000], i)), lambda e: answers.append(e.body()))
                calls.extend(c for c in d._queue if c.exchange is exchange)
            await asyncio.sleep(0.1)
            assert all(c.params == b"" and c.id == Raw() for c in calls)  # released at once
            assert len(d._queue) <= 3  # the head and fewer shells than live calls
        assert len(answers) == 150 and all(b'"code":-32001' in a for a in answers)
        assert d.queued_calls == 1 == d.queued_calls
        assert d.queued_bytes == len(b"[1]") + len(b'"head"')

    run(main)


# -- failure paths that planted bugs survived (issue 10, item 10) ----------------------


def test_every_call_of_a_chunk_on_a_worker_that_dies_is_answered_worker_died_at_once():
    """A planted bug skipped a chunk's calls when its worker died: they waited for their
    deadline (-32001) instead of -32002 at once, and the in-flight count kept them."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), timeout=30.0)
        d.set_methods(["m"])
        w = add_worker(d, 0, concurrency=100)
        codec = Codec()
        done: list[Exchange] = []
        d.submit(body(codec, [req("m", [i], i) for i in range(10)]), done.append)
        d.submit(body(codec, req("m", [], "single")), done.append)
        assert sum(f[2] if f[0] == wire.Kind.CHUNK else 1 for f in w.channel.take()) == 11
        assert d.in_flight_calls == 11
        w.pid = 4242
        d.worker_lost(w, "killed by SIGKILL")
        assert len(done) == 2 and d.in_flight_calls == 0  # at once, not at the deadline
        batch, single = (done if done[0].batch else done[::-1])
        answers = json.loads(batch.body())
        assert sorted(a["id"] for a in answers) == list(range(10))
        assert all(a["error"]["code"] == -32002 and a["error"]["data"]["pid"] == 4242 for a in answers)
        assert json.loads(single.body())["error"]["code"] == -32002

    run(main)


def _two_queued_behind_a_lost_worker() -> tuple[Dispatcher, list[Exchange], Codec]:
    """A dispatcher whose only worker (one place) took call 0 and died, calls 1 and 2
    queued: the dispatcher, the exchanges answered so far (call 0's -32002), the codec."""
    d = Dispatcher(asyncio.get_running_loop(), timeout=30.0)
    d.set_methods(["m"])
    w = add_worker(d, 0, concurrency=1)
    codec = Codec()
    done: list[Exchange] = []
    for i in range(3):
        d.submit(body(codec, req("m", [], i)), done.append)
    assert d.queued_calls == 2
    d.worker_lost(w, "exited with 1")
    assert [json.loads(e.body())["error"]["code"] for e in done] == [-32002]
    return d, done, codec


@pytest.mark.parametrize("back_in", [math.inf, 2.0])
def test_queued_calls_are_answered_no_worker_when_none_is_coming(back_in: float):
    """A planted bug left queued calls waiting for their deadline when every worker was
    down and none was starting: -32003 at once, when no worker is coming, or none before
    RESTART_WAIT_SECONDS (a crash loop's longer backoffs)."""

    async def main() -> None:
        d, done, _codec = _two_queued_behind_a_lost_worker()
        d.no_worker_before(back_in)
        assert sorted(json.loads(e.body())["id"] for e in done[1:]) == [1, 2]
        assert all(json.loads(e.body())["error"]["code"] == -32003 for e in done[1:])
        assert d.queued_calls == 0 and d.in_flight_calls == 0

    run(main)


def test_queued_calls_wait_for_a_restart_due_before_their_deadline():
    """Hostile testing, round 73: a worker killed within 30 s of its start restarts after
    a 0.1 s backoff, and every other client's queued call was answered -32003 at once
    (none had run). Now only the calls whose deadline passes before the restart are; the
    others, and new calls, wait for it and run when it is back, in their order."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), timeout=30.0, method_timeouts={"quick": 0.3})
        d.set_methods(["m", "quick", "doomed"])
        w = add_worker(d, 0, concurrency=1)
        codec = Codec()
        done: list[Exchange] = []
        d.submit(body(codec, req("doomed", [], "running")), done.append)  # (its calls run alone after: not m's)
        for i in range(3):
            d.submit(body(codec, req("m", [], i)), done.append)
        d.submit(body(codec, req("quick", [], "short")), done.append)
        assert d.queued_calls == 4
        d.worker_lost(w, "killed by SIGKILL")
        back_in = 0.5
        d.worker_back_in = lambda: back_in
        d.no_worker_before(back_in)  # the pool: the slot restarts in 0.5 s
        codes = {json.loads(e.body())["id"]: json.loads(e.body())["error"]["code"] for e in done}
        assert codes == {"running": -32002, "short": -32003}  # (its deadline, 0.3 s, is before)
        at_once = d.submit(body(codec, req("quick", [], "new short")), done.append)
        assert at_once is not None and at_once.remaining == 0 and json.loads(at_once.body()) == {"jsonrpc": "2.0", "id": "new short", "error": {
            "code": -32003, "message": "No worker available", "data": "every worker is down and waiting to restart"}}
        waits = d.submit(body(codec, req("m", [], "new")), done.append)
        assert waits is not None and waits.remaining == 1  # (queued for the restarted worker)
        assert d.queued_calls == 4 and len(done) == 2
        d.worker_back_in = lambda: 0.0  # it is starting, then ready
        w2 = add_worker(d, 0, concurrency=10)
        channel = typing.cast(RecordingChannel, w2.channel)
        sent = [call_id for kind, call_id, _aux, _payload in channel.take() if kind == wire.CALL]
        assert len(sent) == 4 and sent == sorted(sent) and d.queued_calls == 0  # (ids in arrival order)
        d.no_worker_before(math.inf)  # (nothing queued: nothing to answer)
        assert len(done) == 2

    run(main)


def test_calls_wait_for_restarts_only_within_a_second_of_the_outage():
    """Hostile testing, round 74: each backoff judged alone, a crash loop's backoffs and
    failed starts one after another held calls 8 s and more. The bound is the outage's:
    a restart due past RESTART_WAIT_SECONDS from the last worker's loss is not waited
    for, however short its own backoff."""

    async def main() -> None:
        d, done, codec = _two_queued_behind_a_lost_worker()
        d.worker_back_in = lambda: 0.1
        d.no_worker_before(0.1)  # the first backoff: waited for
        assert len(done) == 1 and d.queued_calls == 2
        d._down_since -= 0.95  # the outage began 0.95 s ago: a restart in 0.1 s is past the bound
        d.no_worker_before(0.1)
        assert [json.loads(e.body())["error"]["code"] for e in done] == [-32002, -32003, -32003]
        answered = d.submit(body(codec, req("m", [], "new")), done.append)
        assert answered is not None and json.loads(answered.body())["error"]["code"] == -32003
        d.worker_back_in = lambda: 0.0  # a worker starting: calls wait for it
        waits = d.submit(body(codec, req("m", [], "after")), done.append)
        assert waits is not None and waits.remaining == 1 and d.queued_calls == 1

    run(main)


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_deadlines_fire_within_two_ticks_with_a_bounded_number_of_timer_wakeups(loop_name):
    """A planted off-by-one in the wheel's tick made its timer fire early and re-arm over
    and over (92,000 wake-ups for 20 deadlines: a busy loop). Each deadline fires once,
    no earlier than due and within two ticks (10 ms each) after, and the timer wakes
    about once per distinct tick."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fired: dict[int, float] = {}
        wakeups = [0]

        class Counted:  # the running loop, its timers counted
            def time(self) -> float:
                return loop.time()

            def call_at(self, when: float, callback: typing.Callable[[], None]) -> asyncio.TimerHandle:
                wakeups[0] += 1
                return loop.call_at(when, callback)

        wheel = DeadlineWheel(Counted(), lambda c: fired.setdefault(c.call_id, loop.time()))  # type: ignore[arg-type]
        start = loop.time()
        due = {i: start + 0.05 + 0.01 * (i % 10) for i in range(20)}  # 10 distinct ticks, 2 calls each
        for i in range(20):
            wheel.add(make_call(i, due[i] - start), start)
        await asyncio.sleep(0.4)
        assert sorted(fired) == list(range(20)) and len(wheel) == 0
        for i, at in fired.items():
            assert due[i] - 0.001 <= at <= due[i] + 0.02 + 0.05, (i, at - due[i])  # (+50 ms: a loaded machine)
        assert wakeups[0] <= 2 * 10 + 2, wakeups[0]

    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(main())


def test_calls_shed_for_a_full_queue_are_logged_at_the_first_then_counted_every_shed_log_seconds(caplog, monkeypatch):
    """New user, round 99 (LOW): calls shed or refused -32000 for a full queue left nothing in
    the log, so an operator tailing it saw a healthy broker while clients got 503s. A WARNING
    says so at the first, then how many every SHED_LOG_SECONDS while more are. Round 100
    (LOW): a burst's count waited for a call shed a minute later, and was lost if none came;
    each interval's count is logged at its end now, and the last at the end of the drain
    (round 106: said at its start, those shed in the grace period were lost), over the time
    it took, notifications dropped apart from calls refused (they were counted as calls)."""
    from broker import queueing

    monkeypatch.setattr(queueing, "SHED_LOG_SECONDS", 0.2)

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), max_queue=2)
        d.set_methods(["work"])
        add_worker(d, 0, concurrency=1)
        codec = Codec()

        def send(id_: int | None) -> None:
            request = req("work", [id_], id_)
            if id_ is None:
                del request["id"]
            d.submit(body(codec, request), lambda e: None)

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]

        for i in range(3):  # (1 in flight, 2 queued: full)
            send(i)
        with caplog.at_level(logging.WARNING, logger="broker.dispatch"):
            for i in range(3, 14):  # (a burst of 11 shed: the first logged at once)
                send(i)
            assert len(said()) == 1 and said()[0].startswith("queue full: 1 call(s) refused -32000 (Server overloaded); ")
            assert "max_queue 2 calls" in said()[0]
            await asyncio.sleep(0.3)  # (the interval is over, none shed since: its 10 logged)
            assert len(said()) == 2
            took = re.fullmatch(r"queue full: 10 call\(s\) refused -32000 \(Server overloaded\) in the last ([\d.]+) s",
                                said()[1])
            assert took and float(took[1]) >= 0.2, said()
            await asyncio.sleep(0.3)  # (none in that interval: no line; the next is logged at once)
            assert len(said()) == 2
            monkeypatch.setattr(queueing, "SHED_LOG_SECONDS", 5.0)  # (an interval the drain ends early)
            send(14)
            assert len(said()) == 3 and said()[2].startswith("queue full: 1 call(s) refused")
            draining = asyncio.ensure_future(d.drain(0.1))
            await asyncio.sleep(0.01)
            d.accepting = True  # (as `submit_held` for a request read before the stop)
            send(15)
            send(None)  # (a notification: dropped, not refused)
            d.accepting = False
            assert len(said()) == 3
            await draining  # (the end of the drain: the interval's count, over the time it took)
            assert len(said()) == 4
            took = re.fullmatch(r"queue full: 1 call\(s\) refused -32000 \(Server overloaded\) and 1 "
                                r"notification\(s\) dropped in the last ([\d.]+) s", said()[3])
            assert took and 0.1 <= float(took[1]) < 5, said()  # (since the line at send(14), not the interval)
        d = Dispatcher(asyncio.get_running_loop(), max_queue=2)  # (round 107: a notification shed first)
        d.set_methods(["work"])
        add_worker(d, 0, concurrency=1)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="broker.dispatch"):
            for i in range(3):
                send(i)
            send(None)
            assert said() == [f"queue full: 1 notification(s) dropped; max_queue 2 calls, max_queue_bytes "
                              f"{d._max_queue_bytes} (how many more: a line every 5 s while it goes on)"]

    run(main)


def test_a_full_queue_sheds_the_newest_calls_of_the_connection_with_the_most_waiting():
    """One connection could fill max_queue alone (an NDJSON stream may be owed 64 batches of
    1000 calls; past its share they wait in the queue), and then every other client's call
    was shed -32000. A full queue now sheds the newest calls of the connection with the
    most calls waiting, while it has more than the newcomer's would: the flood loses its
    own newest calls, the newcomer is queued. A connection that has the most waiting
    itself, or as many as the others, has its new call shed."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), max_queue=10)
        d.set_methods(["work"])
        w = add_worker(d, 0, concurrency=1)
        codec = Codec()
        flood, other, third = (ResponseBudget(d.outgoing) for _ in range(3))
        exchanges: dict[object, Exchange] = {}

        def send(budget: ResponseBudget, id_: object) -> None:
            exchange = d.submit(body(codec, req("work", [id_], id_)), lambda e: None, budget)
            assert exchange is not None
            exchanges[id_] = exchange

        def shed() -> list[object]:
            return [id_ for id_, e in exchanges.items() if not e.remaining and b"-32000" in e.answers[0]]  # type: ignore[operator]

        for i in range(11):  # 1 in flight, 10 queued: full
            send(flood, i)
        assert (d.queued_calls, flood.queued, flood.in_flight, shed()) == (10, 10, 1, [])
        send(other, "v")
        assert (d.queued_calls, flood.queued, other.queued, shed()) == (10, 9, 1, [10])
        assert json.loads(exchanges[10].answers[0]) == {  # type: ignore[arg-type]
            "jsonrpc": "2.0", "id": 10, "error": {"code": -32000, "message": "Server overloaded", "data": "queue full"}}
        send(flood, "f")  # the most waiting: its own new call is shed
        assert (d.queued_calls, flood.queued, shed()) == (10, 9, [10, "f"])
        for i in range(8):  # 8 more connections of one call each take the flood's newest
            send(ResponseBudget(d.outgoing), f"x{i}")
        assert (d.queued_calls, flood.queued, shed()) == (10, 1, [2, 3, 4, 5, 6, 7, 8, 9, 10, "f"])
        send(third, "t")  # every connection has 1 waiting: the newcomer is shed
        assert d.queued_calls == 10 and shed()[-1] == "t"
        sent = []
        for _ in range(11):  # what is queued runs, the victim's call among the first
            [frame] = w.channel.take()
            sent.append(first_params(frame)[0])
            d.on_reply(w, wire.Kind.RESULT, frame[1], 0, b"0")
        assert sent[0] == 0 and sent.index("v") <= 2 and set(sent) == {0, 1, "v", *(f"x{i}" for i in range(8))}

    run(main)


def test_a_gone_connections_calls_are_dropped_or_cancelled_and_its_notifications_run():
    """Round 57 (HIGH): a closed connection's calls kept their places until they ended, and
    the next connection got a share of its own: one client, one connection at a time, took
    every place. `abandon`: its calls owed an answer are dropped from the queue (never run)
    or cancelled in flight (CANCEL, their places back when the worker acknowledges); its
    notifications run on."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), cancel_grace=1000.0)
        d.set_methods(["sleep"])
        w = add_worker(d, 0, concurrency=8)  # a connection's share: 4
        codec = Codec()
        gone = ResponseBudget(d.outgoing)
        d.submit(body(codec, [req("sleep", [i], i) for i in range(6)]), lambda e: None, gone)  # 4 run, 2 wait
        d.submit(body(codec, {"jsonrpc": "2.0", "method": "sleep", "params": ["n"]}), lambda e: None, gone)
        sent = w.channel.take()
        assert (gone.in_flight, gone.queued) == (4, 3)
        gone.lost()
        d.abandon(gone)
        assert (gone.queued, d.queued_calls) == (1, 1)  # the notification stays
        assert d.abandoned_total == {"queued": 2, "in_flight": 4}
        cancels = [f for f in w.channel.take() if f[0] == wire.Kind.CANCEL]
        assert sorted(f[1] for f in cancels) == sorted(f[1] for f in sent)
        for frame in sent:  # the worker acknowledges: the places come back, the notification goes
            d.on_reply(w, wire.Kind.CHUNK_REPLY if frame[0] == wire.Kind.CHUNK else wire.Kind.ERROR, frame[1],
                       wire.NOT_RUN, chunk_reply(frame, wire.Kind.ERROR, wire.CANCEL_ACK)
                       if frame[0] == wire.Kind.CHUNK else wire.CANCEL_ACK)
        [note] = w.channel.take()
        assert note[0] == wire.Kind.NOTIFY and first_params(note) == ["n"]
        assert (gone.in_flight, w.outstanding, d.late_cancelled_total) == (1, 1, 4)

    run(main)


def test_a_batch_past_its_share_goes_in_order_in_chunks_the_share_takes():
    """Round 57's new user: a batch past its connection's share was dealt out like cards,
    so the calls that ran first, and those that timed out, were spread over the batch; and
    with connection_share 1, chunks of 84 of a 250-call batch filled 167 of 200 places. It
    goes in chunks of the share over the workers, in request order."""

    async def main() -> None:
        for share, first_two in ((0.5, [list(range(0, 5)), list(range(5, 10))]),
                                 (1.0, [list(range(0, 10)), list(range(10, 20))])):
            d = Dispatcher(asyncio.get_running_loop(), connection_share=share)
            d.set_methods(["sleep"])
            a, b = add_worker(d, 0, concurrency=10), add_worker(d, 1, concurrency=10)
            codec = Codec()
            d.submit(body(codec, [req("sleep", [i], i) for i in range(25)]), lambda e: None)
            frames = a.channel.take() + b.channel.take()
            chunks = sorted(sorted(json.loads(p)[0] for p in re.findall(rb"\[\d+\]", f[3])) for f in frames)
            assert chunks == first_two, (share, chunks)
            assert a.outstanding + b.outstanding == int(20 * share) and d.queued_calls == 25 - int(20 * share)

    run(main)


def test_an_expired_notification_chunk_at_its_connections_head_leaves_at_once():
    """Round 57 (MEDIUM): queued under its connection since 777169f, an expired chunk of
    notifications was looked for under no connection, stayed at its connection's head at
    its full cost, and the connection's next calls waited behind that cost, then went in a
    row. It leaves at once (`FairQueue.expire_head`), as an expired chunk of calls does."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), timeout=1000.0, method_timeouts={"note": 0.05},
                       connection_share=1.0)
        d.set_methods(["note", "work"])
        w = add_worker(d, 0, concurrency=1)
        codec = Codec()
        x, y = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
        d.submit(body(codec, req("work", ["busy"], "busy")), lambda e: None, y)
        [busy] = w.channel.take()
        d.submit(body(codec, [{"jsonrpc": "2.0", "method": "note", "params": [i]} for i in range(6)]), lambda e: None, x)
        for i in range(3):
            d.submit(body(codec, req("work", [f"x{i}"], f"x{i}")), lambda e: None, x)
            d.submit(body(codec, req("work", [f"y{i}"], f"y{i}")), lambda e: None, y)
        await wait_until(lambda: d._expired_queued == 0 and len(d._queue) == 6)  # out at its deadline
        order = []
        d.on_reply(w, wire.Kind.RESULT, busy[1], 0, b"0")
        for _ in range(6):
            [frame] = w.channel.take()
            order.append(first_params(frame)[0])
            d.on_reply(w, wire.Kind.RESULT, frame[1], 0, b"0")
        assert order[:2] in (["x0", "y0"], ["y0", "x0"]) and order.index("x1") <= 3, order

    run(main)


def test_calls_held_for_their_connections_share_send_no_other_call_through_the_queue():
    """Round 57 (LOW): while one connection's calls waited held for its share, every other
    client's call took the queue's path (copied, queued, pumped): 0.7 of the rate. Held
    calls hold nobody else's back: another connection's call goes at once."""

    async def main() -> None:
        metrics = CallMetrics()
        d = Dispatcher(asyncio.get_running_loop(), metrics=metrics)
        d.set_methods(["sleep"])
        w = add_worker(d, 0, concurrency=8)  # a share: 4
        codec = Codec()
        flood, other = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
        for i in range(6):
            d.submit(body(codec, req("sleep", [i], i)), lambda e: None, flood)
        assert (flood.in_flight, d.queued_calls, d.held_calls) == (4, 2, 2)
        at_once = metrics.sent_at_once
        d.submit(body(codec, req("sleep", ["o"], "o")), lambda e: None, other)
        assert metrics.sent_at_once == at_once + 1 and other.in_flight == 1
        d.submit(body(codec, req("sleep", [6], 6)), lambda e: None, flood)  # its own: behind its others
        assert metrics.sent_at_once == at_once + 1 and d.held_calls == 3
        assert len(w.channel.take()) == 5

    run(main)


def test_a_full_queue_sheds_a_chunk_for_a_call_and_nothing_for_a_call_that_cannot_fit():
    """Round 58: shedding went on until the newcomer fitted: a call larger than
    max_queue_bytes, which never fits, shed another client's 200 queued calls for nothing.
    The calls shed now make room for the newcomer (its calls and bytes), or none is shed. A
    queued chunk is shed whole: shedding no more calls than came (round 59), a flood queued
    in chunks was never shed and every other client's call was refused."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), max_queue=60, max_queue_bytes=4000, connection_share=1.0)
        d.set_methods(["work"])
        w = add_worker(d, 0, concurrency=100)
        codec = Codec()
        victim, other, big = (ResponseBudget(d.outgoing) for _ in range(3))
        d.submit(body(codec, [req("work", [i], f"busy{i}") for i in range(100)]), lambda e: None, other)  # full
        for i in range(10):  # the victim's 10 small calls wait
            d.submit(body(codec, req("work", [i], i)), lambda e: None, victim)
        d.submit(body(codec, [req("work", [i], f"c{i}") for i in range(50)]), lambda e: None, victim)  # one chunk
        assert (d.queued_calls, victim.queued) == (60, 60)
        exchange = d.submit(body(codec, req("work", ["x" * 5000], "huge")), lambda e: None, big)  # never fits
        assert exchange is not None and b"-32000" in exchange.answers[0]  # type: ignore[operator]
        assert (d.queued_calls, victim.queued) == (60, 60)  # nothing shed for it
        exchange = d.submit(body(codec, req("work", ["o"], "o")), lambda e: None, ResponseBudget(d.outgoing))
        assert exchange is not None and exchange.answers[0] is None  # queued: the victim's newest, a chunk, shed
        assert (d.queued_calls, victim.queued) == (11, 10)
        for i in range(49):  # the room it made takes the next ones without shedding more
            d.submit(body(codec, req("work", [i], f"n{i}")), lambda e: None, ResponseBudget(d.outgoing))
        assert (d.queued_calls, victim.queued) == (60, 10)
        assert len(w.channel.take()) == 1

    run(main)


def test_the_largest_flow_heap_is_emptied_with_the_queue():
    """Round 58 (LOW): after the queue emptied, the heap of queued counts kept stale entries,
    each a closed connection's budget alive."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop())
        d.set_methods(["work"])
        w = add_worker(d, 0, concurrency=1)
        codec = Codec()
        for k in range(5):
            d.submit(body(codec, req("work", [k], k)), lambda e: None, ResponseBudget(d.outgoing))
        assert len(d._largest._heap) == 4
        for _ in range(5):
            [frame] = w.channel.take()
            d.on_reply(w, wire.Kind.RESULT, frame[1], 0, b"0")
        assert d.queued_calls == 0 and d._largest._heap == []

    run(main)


def test_the_end_of_an_old_process_socket_leaves_the_slot_s_next_process_alone():
    """Hostile testing, round 75: after a restart with no backoff, the slot's new process
    was STARTING when the old process's socket end was read: the pool made the new one
    DEAD and its HELLO was refused ("HELLO from pid N for slot 1, expected pid N"). The
    end of a socket that is no longer the slot's channel changes nothing; its own still
    takes the worker out."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop())
        d.set_methods(["m"])
        pool = Pool(d, size=1, app="broker.demo:registry")
        worker = pool.workers[0]
        old = WorkerChannel(pool)
        old.worker = worker
        worker.channel = old
        worker.state = WorkerState.READY
        d.worker_ready(worker)
        worker.move(WorkerState.DEAD)  # its exit reaped first (`Pool._watch`) ...
        d.worker_lost(worker, "killed as hung")
        worker.channel = None
        assert pool._prepare(worker)  # ... and the next process started at once: STARTING
        assert worker.state is WorkerState.STARTING
        old.connection_lost(None)
        assert worker.state is WorkerState.STARTING
        current = WorkerChannel(pool)
        current.worker = worker
        worker.channel = current
        worker.move(WorkerState.READY)
        d.worker_ready(worker)
        current.connection_lost(None)
        assert worker.state is WorkerState.DEAD and d.ready_workers == 0

    run(main)


def test_a_method_with_strikes_runs_alone_on_a_reserved_worker_while_the_others_serve():
    """Isolation (broker/isolation.py; hostile testing, round 78): a method whose calls were
    in a worker that died twice runs alone until 2 of its calls answer: with no worker idle,
    the least loaded is reserved (takes nothing more), runs the call once empty, and takes
    nothing else until it answers; the other clients' calls go to the other worker all
    along, and a call of the method after it waits (one connection's share of the workers:
    one of two)."""

    async def main() -> None:
        d, (w0, w1), codec, done = isolation_setup(2)
        for strike in range(2):  # two deaths under it: 2 answers owed
            d.submit(body(codec, req("boom", [], strike)), done.append)
            [(_, first, _, _)] = (w0.channel.take() or w1.channel.take())  # type: ignore[union-attr]
            dead = w0 if first in w0.channel.deadlines else w1  # type: ignore[union-attr]
            restarted(d, dead)  # (its slot restarted)
        assert [json.loads(e.body())["error"]["code"] for e in done] == [-32002, -32002]
        assert d.isolated == {"boom": 2}
        innocent, bad = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
        for i in range(4):  # both workers busy
            d.submit(body(codec, req("m", [], f"m{i}")), done.append, innocent)
        busy = {w: [f[1] for f in w.channel.take()] for w in (w0, w1)}  # type: ignore[union-attr]
        assert all(busy.values())
        for i in range(3):
            d.submit(body(codec, req("boom", [], f"b{i}")), done.append, bad)
        assert d.queued_calls == 3  # (no worker idle: one is reserved)
        [reserved] = [w for w in (w0, w1) if w.limit == 0]
        other = w1 if reserved is w0 else w0
        for i in range(3):  # meanwhile every innocent call goes to the other worker
            d.submit(body(codec, req("m", [], f"n{i}")), done.append, ResponseBudget(d.outgoing))
        assert len(other.channel.take()) == 3 and not reserved.channel.take()  # type: ignore[union-attr]
        for call_id in busy[reserved]:  # the reserved worker empties: b0 runs there, alone
            d.on_reply(reserved, wire.Kind.RESULT, call_id, 10, b"0")
        [(kind, b0, _, _)] = reserved.channel.take()  # type: ignore[union-attr]
        assert kind == wire.CALL and reserved.outstanding == 1 and d.queued_calls == 2  # (b1 waits: the cap)
        d.submit(body(codec, req("m", [], "late")), done.append, ResponseBudget(d.outgoing))
        assert not reserved.channel.take() and len(other.channel.take()) == 1  # type: ignore[union-attr]
        d.on_reply(reserved, wire.Kind.RESULT, b0, 10, b'"ok"')  # one answered: one more owed, b1 alone
        assert d.isolated == {"boom": 1}
        [(kind, b1, _, _)] = reserved.channel.take()  # type: ignore[union-attr]
        assert kind == wire.CALL and reserved.outstanding == 1 and d.queued_calls == 1
        d.on_reply(reserved, wire.Kind.RESULT, b1, 10, b'"ok"')  # two: free, b2 goes as any call
        assert d.isolated == {} and d.queued_calls == 0 and reserved.limit == 10

    run(main)


def test_bystanders_of_a_death_run_alone_until_one_of_their_calls_answers():
    """Calls of several methods die together: each takes a strike, its calls alone until
    one of them answers (it ran and its worker lived); then they go as any call does."""

    async def main() -> None:
        d, (w,), codec, done = isolation_setup(1)
        d.submit(body(codec, req("boom", [], "b")), done.append)
        d.submit(body(codec, req("m", [], "m")), done.append)
        assert len(w.channel.take()) == 2  # type: ignore[union-attr]
        d.worker_lost(w, "exited with 1")
        assert d.isolated == {"m": 1, "boom": 1}
        w.channel = RecordingChannel()  # type: ignore[assignment]
        d.worker_ready(w)
        for i in range(3):
            d.submit(body(codec, req("m", [], i)), done.append, ResponseBudget(d.outgoing))
        [(_, first, _, _)] = w.channel.take()  # type: ignore[union-attr]  # one alone; the others wait
        assert d.queued_calls == 2
        d.on_reply(w, wire.Kind.RESULT, first, 10, b"0")  # m answered: no longer alone
        assert len(w.channel.take()) == 2 and d.queued_calls == 0  # type: ignore[union-attr]
        # boom's first strike was shared with m's: with no worker free for it alone, it goes as any
        # (round 84: waiting for one, a bystander's calls held every worker), and is still owed
        d.submit(body(codec, req("boom", [], "b2")), done.append)
        assert len(w.channel.take()) == 1 and d.queued_calls == 0 and d.isolated == {"boom": 1}  # type: ignore[union-attr]

    run(main)


def test_a_call_run_alone_takes_a_worker_that_empties_before_the_reserved_one():
    """Hostile testing, round 79 (HIGH): a call of an isolated method waited for the worker
    reserved for it (draining a 6 s call) while the other worker sat idle, its connection's
    next call behind it, both until their deadline. The first worker to empty takes it, and
    the reservation ends (round 79, MEDIUM: one no call waits for any more, its call timed
    out, ends too, and the worker takes calls again)."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), method_timeouts={"boom": 0.05})
        d.set_methods(["m", "boom"])
        w0, w1 = add_worker(d, 0, concurrency=10), add_worker(d, 1, concurrency=10)
        codec = Codec()
        done: list[Exchange] = []
        for strike in range(2):  # two deaths under it: 2 answers owed
            d.submit(body(codec, req("boom", [], f"s{strike}")), done.append)
            [(_, first, _, _)] = (w0.channel.take() or w1.channel.take())  # type: ignore[union-attr]
            dead = w0 if first in w0.channel.deadlines else w1  # type: ignore[union-attr]
            restarted(d, dead)
        d.submit(body(codec, req("m", [], "long")), done.append)
        d.submit(body(codec, req("m", [], "short")), done.append)
        [(_, long_id, _, _)] = w0.channel.take()  # type: ignore[union-attr]
        [(_, short_id, _, _)] = w1.channel.take()  # type: ignore[union-attr]
        d.submit(body(codec, req("boom", [], 1)), done.append)  # no worker idle: one is reserved
        [reserved] = [w for w in (w0, w1) if w.limit == 0]
        other, other_id = (w1, short_id) if reserved is w0 else (w0, long_id)
        d.on_reply(other, wire.Kind.RESULT, other_id, 10, b"0")  # the other empties first: it takes boom
        [(kind, boom, _, _)] = other.channel.take()  # type: ignore[union-attr]
        assert kind == wire.CALL and reserved.limit == 10 and d.queued_calls == 0
        d.submit(body(codec, req("m", [], "next")), done.append)
        assert len(reserved.channel.take()) == 1  # type: ignore[union-attr]  # (it takes calls again)
        d.on_reply(other, wire.Kind.RESULT, boom, 10, b"0")  # (one more answer owed)
        d.submit(body(codec, req("m", [], "busy")), done.append)  # (to `other`: both busy again)
        assert len(other.channel.take()) == 1  # type: ignore[union-attr]
        # A call waiting for a worker of its own that times out ends the reservation made for it.
        d.submit(body(codec, req("boom", [], 2)), done.append)
        assert [w for w in (w0, w1) if w.limit == 0 and not w.blocked] == [other]  # (the least loaded)
        reserved = other
        await asyncio.sleep(0.2)  # its deadline, 0.05 s, passes while it waits
        assert json.loads(done[-1].body())["error"]["code"] == -32001
        assert reserved.limit == 10  # (no call waits for it: it takes calls again)
        d.submit(body(codec, req("m", [], "after")), done.append)
        assert len(reserved.channel.take()) == 1  # type: ignore[union-attr]

    run(main)


def test_a_bystander_s_call_run_alone_is_not_held_behind_a_crash_loop_s():
    """Hostile testing, round 79 (MEDIUM): on 2 workers one worker at a time runs calls
    alone, and a crash loop's (its worker dead until its slot is back) held every other
    isolated method's calls: a bystander's got 3 calls a second. The cap holds back every
    isolated method's calls from running alone (round 84: a first strike's took the other
    worker, and every other call waited), but a first strike shared with other methods' calls
    (a bystander's, mostly) does not wait: with no worker free for it alone, it goes as any."""

    async def main() -> None:
        d, (w0,), codec, done = isolation_setup(1)
        d.submit(body(codec, req("boom", [], 0)), done.append)  # a first death: boom and m beside it
        d.submit(body(codec, req("m", [], 0)), done.append)
        assert len(w0.channel.take()) == 2  # type: ignore[union-attr]
        restarted(d, w0)
        w1 = add_worker(d, 1, concurrency=10)
        d.submit(body(codec, req("boom", [], 1)), done.append)  # boom alone, and it dies: a second strike
        [crashing] = [w for w in (w0, w1) if w.outstanding]
        crashing.channel.take()  # type: ignore[union-attr]
        d.worker_lost(crashing, "exited with 1")  # (its slot restarting: it counts against the cap)
        assert d.isolated == {"m": 1, "boom": 2}
        other = w1 if crashing is w0 else w0
        d.submit(body(codec, req("boom", [], 2)), done.append)
        assert not other.channel.take() and d.queued_calls == 1  # type: ignore[union-attr]  # (the cap: boom waits)
        d.submit(body(codec, req("m", [], 1)), done.append)  # m, one strike: on the idle worker at once, as any
        [(kind, _m, _, _)] = other.channel.take()  # type: ignore[union-attr]
        assert kind == wire.CALL and other.limit == 10 and d.queued_calls == 1

    run(main)


def test_a_kill_beside_long_calls_never_takes_every_worker_from_the_others():
    """Hostile testing, round 84 (HIGH): a worker killed (kill -9, as the OOM killer does)
    holding long polls and fast calls: both methods' first strike had no cap; the restarted
    worker ran one long poll alone, the other worker was reserved for the next, and every
    client's fast calls waited 5 s. A first strike shared with other methods' calls takes a
    worker alone only where one is free, within the cap (one connection's share), and never
    reserves one: the other calls go as any."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop())
        d.set_methods(["asleep", "add"])
        w0, w1 = add_worker(d, 0, concurrency=10), add_worker(d, 1, concurrency=10)
        codec = Codec()
        done: list[Exchange] = []
        for i in range(6):
            d.submit(body(codec, req("asleep", [6], f"p{i}")), done.append, ResponseBudget(d.outgoing))
        d.submit(body(codec, req("add", [1, 2], "a0")), done.append, ResponseBudget(d.outgoing))
        w0.channel.take(), w1.channel.take()  # type: ignore[union-attr]
        dead = w0 if any(c.worker is w0 and c.index == 1 for c in d._pending.values()) else w1
        other = w1 if dead is w0 else w0
        restarted(d, dead)
        assert d.isolated == {"asleep": 1, "add": 1}
        d.submit(body(codec, req("asleep", [6], "q0")), done.append, ResponseBudget(d.outgoing))
        assert len(dead.channel.take()) == 1 and dead.limit == 0  # type: ignore[union-attr]  # (alone on the idle one)
        for i in range(3):  # no worker free for them alone, and no reservation: as any, at once
            d.submit(body(codec, req("asleep", [6], f"q{i + 1}")), done.append, ResponseBudget(d.outgoing))
            d.submit(body(codec, req("add", [1, 2], f"a{i + 1}")), done.append, ResponseBudget(d.outgoing))
        assert len(other.channel.take()) == 6 and other.limit == 10 and d.queued_calls == 0  # type: ignore[union-attr]

    run(main)


def test_a_worker_that_has_not_answered_a_call_past_its_deadline_is_the_last_choice():
    """Hostile testing, round 84 (MEDIUM): a worker stopped (SIGSTOP) or held in a call past
    its deadline, its CANCEL unanswered, was still sent new calls as the least loaded, each
    answered -32001 at its own deadline while the other worker had room (round 87: or was
    blocked in a sync call). Until it answers, it takes no new call while another worker is
    ready (they wait for room there); then it is chosen as any again."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), method_timeouts={"brief": 0.05})
        d.set_methods(["brief", "m"])
        w0, w1 = add_worker(d, 0, concurrency=3), add_worker(d, 1, concurrency=3)
        codec = Codec()
        done: list[Exchange] = []
        d.submit(body(codec, req("brief", [], "b")), done.append, ResponseBudget(d.outgoing))
        stuck = w0 if w0.outstanding else w1
        other = w1 if stuck is w0 else w0
        [(_, brief, _, _)] = stuck.channel.take()  # type: ignore[union-attr]
        await asyncio.sleep(0.15)  # brief's deadline passes: -32001, and CANCEL sent
        assert json.loads(done[0].body())["error"]["code"] == -32001
        assert [f[0] for f in stuck.channel.take()] == [wire.Kind.CANCEL]  # type: ignore[union-attr]
        for i in range(3):  # all to the other, however loaded (it holds 0, 1, 2 and the stuck one 1)
            d.submit(body(codec, req("m", [], f"n{i}")), done.append, ResponseBudget(d.outgoing))
        assert len(other.channel.take()) == 3 and not stuck.channel.take()  # type: ignore[union-attr]
        d.submit(body(codec, req("m", [], "n3")), done.append, ResponseBudget(d.outgoing))  # the other is full:
        assert not stuck.channel.take() and d.queued_calls == 1  # type: ignore[union-attr]  # (it waits; round 87)
        d.on_reply(stuck, wire.Kind.ERROR, brief, wire.NOT_RUN, wire.CANCEL_ACK)  # it answers: as any again
        assert len(stuck.channel.take()) == 1 and d.queued_calls == 0  # type: ignore[union-attr]  # (n3)
        d.on_reply(other, wire.Kind.RESULT, other_id(d, other), 10, b"0")
        d.submit(body(codec, req("m", [], "n4")), done.append, ResponseBudget(d.outgoing))
        assert len(stuck.channel.take()) == 1  # type: ignore[union-attr]  # (1 against 2: the least loaded)

    run(main)


def other_id(d: Dispatcher, worker: Worker) -> int:
    """The id of one of the calls `worker` holds."""
    return next(call_id for call_id, call in d._pending.items() if call.worker is worker)


def test_a_suspect_not_caught_does_not_run_alone_on_the_one_worker_open_to_the_others():
    """Round 85's new user (MEDIUM): a method struck in deaths it shared with others (not
    caught) ran a call alone on the one worker not busy in a blocking sync call; another
    client's fast call then went behind that sync call, which hung, and died with it. Such a
    suspect runs alone only while another worker is left open to the others' calls."""

    async def main() -> None:
        d, (w0,) = sync_dispatcher(1, workers=1, concurrency=10)
        codec = Codec()
        d.submit(body(codec, req("fast", [], "f0")), lambda e: None)
        d.submit(body(codec, req("quick", [], "q0")), lambda e: None)
        assert len(w0.channel.take()) == 2  # type: ignore[union-attr]
        restarted(d, w0)  # a death of two suspects: neither caught
        assert d.isolated == {"fast": 1, "quick": 1} and not d._isolation.waits
        w1 = add_worker(d, 1, concurrency=10)
        d.submit(body(codec, req("slow", [30], "s")), lambda e: None)
        blocked, other = (w0, w1) if w0.blocked else (w1, w0)
        assert blocked.channel.take() and not other.channel.take()  # type: ignore[union-attr]
        d.submit(body(codec, req("fast", [], "f1")), lambda e: None, ResponseBudget(d.outgoing))
        assert len(other.channel.take()) == 1 and not other.blocked and other.limit == 10  # type: ignore[union-attr]
        d.submit(body(codec, req("fast", [], "f2")), lambda e: None, ResponseBudget(d.outgoing))
        assert len(other.channel.take()) == 1 and not blocked.channel.take()  # type: ignore[union-attr]

    run(main)


def test_a_retired_worker_that_dies_under_a_call_run_alone_leaves_no_place_spent():
    """Hostile testing, round 85 (HIGH): a worker retired by a reload (or leaving) died
    running a call alone; its slot had a new worker, so it never came back, and its place
    counted against the cap of workers running calls alone until the next reload: no call
    ran alone again, and a crasher's calls went beside others'. Only a serving worker's
    death holds a place until its slot is back."""

    async def main() -> None:
        d, (w0, w1), codec, done = isolation_setup(2)
        for strike in range(2):  # two deaths under it: it waits for a worker of its own
            d.submit(body(codec, req("boom", [], f"s{strike}")), done.append)
            [(_, first, _, _)] = (w0.channel.take() or w1.channel.take())  # type: ignore[union-attr]
            restarted(d, w0 if first in w0.channel.deadlines else w1)  # type: ignore[union-attr]
        d.submit(body(codec, req("boom", [], "alone")), done.append)
        running = w0 if w0.channel.take() else w1  # type: ignore[union-attr]
        (w1 if running is w0 else w0).channel.take()  # type: ignore[union-attr]
        d.worker_unready(running)  # a reload retires it, and its slot's new worker is ready
        new = add_worker(d, running.slot, concurrency=10)
        d.worker_lost(running, "killed by SIGKILL", serving=False)  # it dies under the call it ran alone
        assert running not in d._alone
        d.submit(body(codec, req("boom", [], "next")), done.append)  # runs alone: a place is free
        assert len(new.channel.take()) + len((w1 if running is w0 else w0).channel.take()) == 1  # type: ignore[union-attr]
        assert d.queued_calls == 0

    run(main)


@pytest.mark.parametrize("workers", [2, 3])  # (of 4, a share of 2 run alone at once)
def test_a_worker_whose_socket_ends_before_it_dies_under_a_call_run_alone_holds_its_place(workers):
    """Hostile testing, round 90 (HIGH): a crashed worker's socket ends before its exit is
    reaped (the pool takes it out of the rotation first, `Pool.channel_lost`), so its death
    under a caught crasher's call run alone held no place against the cap; and with 2 workers
    the one left was spent on a call alone as "the only one". The crasher's next call took
    another worker at once while the first restarted, and the workers died in turn, over and
    over (honest throughput down 99 %, a ~1 s stall every second, with 2, 3 and 4 workers). A
    serving slot's death under a call alone, or a caught one, holds its place until its slot
    is back: the crasher waits for it, and the other workers serve the others."""

    async def main() -> None:
        d, ws, codec, done = isolation_setup(workers)
        d.worker_restarting = lambda: crashing.state is WorkerState.DEAD  # (the pool's: its slot restarts)
        d.submit(body(codec, req("boom", ["b"], "caught")), done.append)  # alone in its worker: caught
        [crashing] = [w for w in ws if w.channel.take()]  # type: ignore[union-attr]
        for n in range(3):
            crashing.state = WorkerState.DEAD
            d.worker_unready(crashing)  # its socket ends (the pool's channel_lost), then its exit
            d.worker_lost(crashing, "exited with 1")
            d.submit(body(codec, req("boom", ["b"], f"next{n}")), done.append)
            d.submit(body(codec, req("m", ["m"], f"m{n}")), done.append)
            frames = [(w, f) for w in ws for f in w.channel.take()]  # type: ignore[union-attr]
            assert [first_params(f) for _, f in frames] == [["m"]] and d.queued_calls == 1  # m, not boom
            assert all(w.limit == 10 for w in ws if w is not crashing)
            crashing.channel = RecordingChannel()  # type: ignore[assignment]  # its slot is back
            crashing.state = WorkerState.READY
            d.worker_ready(crashing)
            [(crashing, frame)] = [(w, f) for w in ws for f in w.channel.take()]  # type: ignore[union-attr]
            assert first_params(frame) == ["b"] and d.queued_calls == 0 and crashing.limit == 0  # (alone)
            d.on_reply(frames[0][0], wire.Kind.RESULT, frames[0][1][1], 10, b"0")  # (m answers)
        codes = [json.loads(e.body()).get("error", {}).get("code") for e in done]
        assert sorted(codes, key=str) == [-32002] * 3 + [None] * 3  # (only boom's calls died)

    run(main)


def test_a_call_run_alone_does_not_take_the_one_worker_left_while_another_slot_restarts():
    """Hostile testing, round 90: the one ready worker counted as "the only one", so spent on a
    call alone, while another slot restarted; the others' calls then waited for the restart.
    It is spent so only when no other is on its way back."""

    async def main() -> None:
        d, (w0, w1), codec, done = isolation_setup(2)
        d.worker_restarting = lambda: w1.state is WorkerState.DEAD  # (the pool's)
        d.submit(body(codec, req("boom", ["b"], "caught")), done.append)
        crashing = w0 if w0.channel.take() else w1  # type: ignore[union-attr]
        restarted(d, crashing)  # caught: boom waits for a worker of its own
        for i in range(4):
            d.submit(body(codec, req("m", ["m"], f"m{i}")), done.append)
        assert [len(w.channel.take()) for w in (w0, w1)] == [2, 2]  # type: ignore[union-attr]
        w1.state = WorkerState.DEAD  # killed holding 2 calls of m (not caught: m does not wait), its
        d.worker_unready(w1)  # slot restarting
        d.worker_lost(w1, "killed by SIGKILL")
        assert d._isolation.waits == {1}  # (boom's)
        for _ in range(2):
            d.on_reply(w0, wire.Kind.RESULT, other_id(d, w0), 10, b"0")  # w0 idle, the only one ready
        d.submit(body(codec, req("boom", ["b"], "next")), done.append)
        d.submit(body(codec, req("m", ["m"], "m2")), done.append, ResponseBudget(d.outgoing))
        assert [first_params(f) for f in w0.channel.take()] == [["m"]] and d.queued_calls == 1  # type: ignore[union-attr]
        w1.state = WorkerState.READY
        w1.channel = RecordingChannel()  # type: ignore[assignment]
        d.worker_ready(w1)  # back: boom runs alone there
        assert [first_params(f) for f in w1.channel.take()] == [["b"]] and w1.limit == 0  # type: ignore[union-attr]

    run(main)


def test_a_chunk_waiting_for_room_for_its_large_params_holds_up_no_other_connection():
    """Round 92's bound on large params in flight: a call with no worker to take its params
    waits with its connection's calls held out of turn, so that other connections' calls go
    on. A chunk's too, whatever its size (a chunk's `index` is its size, once taken for a
    method index: with the method of that index run alone, a chunk of as many calls waited
    at the head, and every other connection's call behind it)."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), max_worker_params_bytes=200)
        d._heavy_bytes = 50  # (large params at this test's scale)
        d.set_methods(["a", "b", "c", "boom"])
        w = add_worker(d, 0, concurrency=10)
        codec = Codec()
        d.submit(body(codec, req("boom", [], "caught")), lambda e: None)  # boom (index 3) caught: run alone
        restarted(d, w)
        assert d.isolated == {"boom": 1}
        d.submit(body(codec, req("a", ["x" * 150], "big")), lambda e: None, ResponseBudget(d.outgoing))
        assert len(w.channel.take()) == 1 and w.heavy > 150  # type: ignore[union-attr]
        chunk = [req("a", ["y" * 60], i) for i in range(3)]  # (a chunk of 3 large calls: ~200 bytes, no room)
        d.submit(body(codec, chunk), lambda e: None, ResponseBudget(d.outgoing))
        assert not w.channel.take() and d.queued_calls == 3 and d.held_calls == 3  # type: ignore[union-attr]
        # A chunk of calls each under the size that counts is no large params, however many (round
        # 93: a batch of 100 calls of 2 KB waited 24 to 29 s for room): it goes
        d.submit(body(codec, [req("a", ["z" * 30], i) for i in range(3)]), lambda e: None, ResponseBudget(d.outgoing))
        sent = w.channel.take()  # type: ignore[union-attr]
        assert [f[0] for f in sent] == [wire.CHUNK] and d.queued_calls == 3, sent
        d.on_reply(w, wire.Kind.CHUNK_REPLY, sent[0][1], 10, chunk_reply(sent[0]))
        d.submit(body(codec, req("b", [], "small")), lambda e: None, ResponseBudget(d.outgoing))
        assert [first_params(f) for f in w.channel.take()] == [[]]  # type: ignore[union-attr]  # (it goes)
        small = next(c for c, call in d._pending.items() if not call.heavy)
        d.on_reply(w, wire.Kind.RESULT, small, 10, b"0")  # (it answers: no room yet, the chunk waits)
        assert not w.channel.take() and d.queued_calls == 3  # type: ignore[union-attr]
        big = next(c for c, call in d._pending.items() if call.heavy)
        d.on_reply(w, wire.Kind.RESULT, big, 10, b"0")  # the big one answers: room, and the chunk goes
        assert [f[0] for f in w.channel.take()] == [wire.CHUNK] and d.queued_calls == 0  # type: ignore[union-attr]

    run(main)


def large_params_dispatcher(workers: int, **kwargs: typing.Any) -> tuple[Dispatcher, list[Worker], Codec]:
    """For the tests of the bound on large params in flight, in a running loop: a dispatcher
    whose workers each hold at most 200 bytes of params of 50 bytes or more (this scale's
    large params), serving "a", "b", "boom" and the sync method "slow"."""
    d = Dispatcher(asyncio.get_running_loop(), max_worker_params_bytes=200, **kwargs)
    d._heavy_bytes = 50
    d.set_methods(["a", "b", "boom", "slow"], sync_methods=["slow"])
    return d, [add_worker(d, slot, concurrency=10) for slot in range(workers)], Codec()


def test_a_large_call_of_a_method_struck_once_waits_for_room_without_holding_up_the_queue():
    """Hostile testing, round 93 (HIGH): a large call of a method struck once beside other
    calls (run alone when a worker is free, else as any) found no room for its params at the
    head of the queue, and the queue stopped there: every client's calls waited up to 4 s, to
    the end of the method's time alone. It waits held out of turn, as any large call does."""

    async def main() -> None:
        d, [w], codec = large_params_dispatcher(1)
        d.submit(body(codec, req("boom", [], "b1")), lambda e: None)
        d.submit(body(codec, req("b", [], "b2")), lambda e: None)
        restarted(d, w)  # (died holding both: each method struck once, not caught)
        w.channel.take()  # type: ignore[union-attr]
        assert d.isolated == {"boom": 1, "b": 1} and "boom" not in [d._names[i] for i in d._isolation.waits]
        d.submit(body(codec, req("a", ["x" * 150], "big")), lambda e: None)
        assert len(w.channel.take()) == 1  # type: ignore[union-attr]
        d.submit(body(codec, req("boom", ["x" * 150], "heavy")), lambda e: None)  # (no room: it waits)
        assert not w.channel.take() and d.held_calls == 1  # type: ignore[union-attr]
        d.submit(body(codec, req("a", [], "small")), lambda e: None)
        assert [first_params(f) for f in w.channel.take()] == [[]]  # type: ignore[union-attr]  # (it goes)
        for call_id in list(d._pending):
            d.on_reply(w, wire.Kind.RESULT, call_id, 10, b"0")
        assert [first_params(f) for f in w.channel.take()] == [["x" * 150]] and not d.queued_calls  # type: ignore[union-attr]

    run(main)


def test_a_connection_held_for_room_goes_when_a_blocked_worker_with_room_is_free():
    """Hostile testing, round 93 (HIGH): a connection held for room for its large params was
    let go only when a large call's answer gave room back; with the other worker blocked in
    a sync call and then free, its large call waited to its deadline beside the idle worker,
    and its small call behind it after that (never run). Any freed place lets it go now."""

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2)
        d.submit(body(codec, req("slow", [4], "spin")), lambda e: None)
        [spin] = w0.channel.take() + w1.channel.take()  # type: ignore[union-attr]
        blocked, other = (w0, w1) if w0.blocked else (w1, w0)
        d.submit(body(codec, req("a", ["x" * 150], "fill")), lambda e: None)
        assert len(other.channel.take()) == 1  # type: ignore[union-attr]
        x = ResponseBudget(d.outgoing)
        d.submit(body(codec, req("a", ["y" * 100], "large")), lambda e: None, x)
        d.submit(body(codec, req("b", [], "small")), lambda e: None, x)
        assert not blocked.channel.take() and not other.channel.take() and d.held_calls == 2  # type: ignore[union-attr]
        d.on_reply(blocked, wire.Kind.RESULT, spin[1], 4_000_000, b"4")  # the sync call ends
        assert [first_params(f) for f in blocked.channel.take()][:1] == [["y" * 100]]  # type: ignore[union-attr]
        assert not d.queued_calls  # (and the small call behind it, to either)

    run(main)


def test_a_connection_held_for_room_goes_on_when_its_large_call_expires():
    """Hostile testing, round 93 (HIGH): when a large call held for room passed its deadline,
    its connection stayed held, and its next call (small) waited to its own deadline too."""

    async def main() -> None:
        d, [w], codec = large_params_dispatcher(1, method_timeouts={"b": 0.05})
        d.submit(body(codec, req("a", ["x" * 150], "fill")), lambda e: None)
        assert len(w.channel.take()) == 1  # type: ignore[union-attr]
        x = ResponseBudget(d.outgoing)
        answers: list[Exchange] = []
        d.submit(body(codec, req("b", ["y" * 100], "large")), answers.append, x)
        d.submit(body(codec, req("a", [], "small")), lambda e: None, x)
        assert not w.channel.take() and d.held_calls == 2  # type: ignore[union-attr]
        await wait_until(lambda: len(answers) == 1)  # -32001
        assert [first_params(f) for f in w.channel.take()] == [[]] and not d.queued_calls  # type: ignore[union-attr]

    run(main)


def test_one_connection_holds_at_most_half_the_workers_room_for_large_params():
    """Hostile testing, round 93 (MEDIUM): one connection's 8 long calls of 1 MB took all the
    room of both workers, and every other client's large call waited 24 to 29 s for them. A
    connection holds at most half the ready workers' room (one call always goes)."""

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2)
        a = ResponseBudget(d.outgoing)
        for i in range(3):  # (96 bytes each: 2 fit in its share of 200, half of 2 x 200)
            d.submit(body(codec, req("a", ["x" * 90], i)), lambda e: None, a)
        assert len(w0.channel.take() + w1.channel.take()) == 2 and d.held_calls == 1  # type: ignore[union-attr]
        d.submit(body(codec, req("a", ["z" * 90], "other")), lambda e: None)  # another connection's: room
        [other] = w0.channel.take() + w1.channel.take()  # type: ignore[union-attr]
        assert first_params(other) == ["z" * 90]
        first = next(c for c, call in d._pending.items() if call.owner is a)
        d.on_reply(d._pending[first].worker, wire.Kind.RESULT, first, 10, b"0")  # type: ignore[arg-type]
        assert [first_params(f) for f in w0.channel.take() + w1.channel.take()] == [["x" * 90]]  # type: ignore[union-attr]

    run(main)


def test_calls_waiting_for_room_for_large_params_go_first_come_first_served():
    """Calls that wait for room for their large params go in the order they came: a new
    large call goes behind them, however small, and room freed goes to the oldest first (a
    large call is not passed over for ever by smaller ones that fit before it does)."""

    async def main() -> None:
        d, [w], codec = large_params_dispatcher(1)
        d.submit(body(codec, req("a", ["x" * 120], "fill")), lambda e: None)  # (126 of 200 bytes)
        d.submit(body(codec, req("a", ["p" * 100], "older")), lambda e: None)  # (no room: it waits)
        d.submit(body(codec, req("a", ["q" * 60], "newer")), lambda e: None)  # (it would fit: it waits behind)
        assert len(w.channel.take()) == 1 and d.held_calls == 2  # type: ignore[union-attr]
        fill = next(iter(d._pending))
        d.on_reply(w, wire.Kind.RESULT, fill, 10, b"0")
        assert [first_params(f) for f in w.channel.take()] == [["p" * 100], ["q" * 60]]  # type: ignore[union-attr]

    run(main)


def test_a_call_too_large_for_any_workers_room_left_holds_back_no_other_waiting_that_fits():
    """Hostile testing, round 94 (HIGH): behind one call too large for the room left on any
    worker (it needs one with none), every other client's large call waited, first in, first
    out, up to 19 s with 4 MB of room free on each worker. The oldest that fits nowhere has a
    worker kept for it (the one with the fewest large params: no other large call goes there),
    and those behind it that fit elsewhere go."""

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2)
        d.submit(body(codec, req("a", ["x" * 54], "fill0")), lambda e: None)  # (58 bytes on each worker)
        d.submit(body(codec, req("a", ["x" * 54], "fill1")), lambda e: None)
        assert (w0.heavy, w1.heavy) == (58, 58) and len(w0.channel.take() + w1.channel.take()) == 2  # type: ignore[union-attr]
        d.submit(body(codec, req("a", ["b" * 144], "big")), lambda e: None)  # (148 bytes: 58 + 148 > 200)
        d.submit(body(codec, req("a", ["s" * 54], "small")), lambda e: None)  # (58 bytes: it fits either)
        kept = d._reserved
        other = w1 if kept is w0 else w0
        assert kept is not None and d.held_calls == 1 and not kept.channel.take()  # type: ignore[union-attr]
        assert [first_params(f) for f in other.channel.take()] == [["s" * 54]]  # type: ignore[union-attr]
        d.submit(body(codec, req("a", ["t" * 54], "more")), lambda e: None)  # (room on the kept one: not for it)
        assert [first_params(f) for f in other.channel.take()] == [["t" * 54]]  # type: ignore[union-attr]
        fill = next(c for c, call in d._pending.items() if call.worker is kept)
        d.on_reply(kept, wire.Kind.RESULT, fill, 10, b"0")  # the kept worker empties: the big call goes there
        assert [first_params(f) for f in kept.channel.take()] == [["b" * 144]] and d._reserved is None  # type: ignore[union-attr]

    run(main)


def test_the_worker_kept_for_a_call_too_large_for_any_room_left_is_one_that_takes_calls():
    """Hostile testing, round 96 (HIGH): the worker kept for the oldest call waiting for room
    was the one with the fewest large params, which one blocked in a long sync call is: the
    call waited for that sync call (17.7 s, or to its deadline) while newer, smaller calls took
    the room freed on the other worker. A worker blocked, overdue or running a call alone is
    not kept, and one that blocks after is kept no more."""

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2)
        d.submit(body(codec, req("slow", [20], "spin")), lambda e: None)
        blocked, other = (w0, w1) if w0.blocked else (w1, w0)
        d.submit(body(codec, req("a", ["x" * 116], "fill")), lambda e: None)  # (120 bytes on the other)
        blocked.channel.take(), other.channel.take()  # type: ignore[union-attr]
        d.submit(body(codec, req("a", ["b" * 100], "big")), lambda e: None)  # (104: 120 + 104 > 200)
        assert d.held_calls == 1 and d._reserved is other
        d.submit(body(codec, req("a", ["s" * 54], "newer")), lambda e: None)  # (58: it would fit; kept)
        assert d.held_calls == 2 and not other.channel.take()  # type: ignore[union-attr]
        fill = next(c for c, call in d._pending.items() if call.worker is other)
        d.on_reply(other, wire.Kind.RESULT, fill, 10, b"0")
        assert [first_params(f) for f in other.channel.take()][:1] == [["b" * 100]]  # type: ignore[union-attr]

    run(main)


def test_a_worker_kept_for_a_call_that_waits_no_more_is_kept_no_more():
    """Hostile testing, round 97 (HIGH): under a backlog of large calls, the worker kept for
    a connection stayed kept after its large call had gone another way (or expired), while
    the connection sat in the middle of those waiting: that worker sat idle, no call at all,
    for 16 s while 53 connections waited and timed out. A worker is kept only for a
    connection whose first call is a large one still waiting."""

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2, method_timeouts={"b": 0.05})
        d.submit(body(codec, req("a", ["x" * 146], "fill1")), lambda e: None)  # (150 bytes on one worker,
        d.submit(body(codec, req("a", ["x" * 96], "fill0")), lambda e: None)  # 100 on the other, sent after)
        light = w0 if w0.heavy == 100 else w1
        w0.channel.take(), w1.channel.take()  # type: ignore[union-attr]
        answers: list[Exchange] = []
        d.submit(body(codec, req("b", ["o" * 106], "kept for")), answers.append)  # (110: fits nowhere)
        assert d._reserved is light
        d.submit(body(codec, req("a", ["c" * 76], "other")), lambda e: None)  # (80: fits the kept one only)
        assert d.held_calls == 2 and not light.channel.take()  # type: ignore[union-attr]
        d._room_waiters.move_to_end(d._reserved_for)  # type: ignore[arg-type]  # (behind the other, as round 97 saw it)
        await wait_until(lambda: len(answers) == 1)  # the first expires, -32001: the other goes
        assert [first_params(f) for f in light.channel.take()] == [["c" * 76]] and d._reserved is None  # type: ignore[union-attr]

    run(main)


def test_a_connection_put_back_in_turn_by_its_own_answer_goes_behind_those_waiting_for_room():
    """Hostile testing, round 97 (MEDIUM): under a backlog of large calls, a connection with
    calls in flight, put back in turn by its own answer (its share of places or of the room
    given back), sent its next large call into the room that answer freed, ahead of those
    waiting for room: a new connection's single call waited 17 to 21 s, 3 x the median, while
    pipelining connections passed it. A large call that comes while others wait for room
    joins them, and goes in their order (the oldest first if it fits, then the smallest)."""

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2)
        p, q, o = (ResponseBudget(d.outgoing) for _ in range(3))
        for owner, tag in ((p, "p1"), (p, "p2"), (q, "q1"), (q, "q2")):  # (100 bytes each: both workers full)
            d.submit(body(codec, req("a", ["x" * 96], tag)), lambda e: None, owner)
        assert (w0.heavy, w1.heavy) == (200, 200)
        w0.channel.take(), w1.channel.take()  # type: ignore[union-attr]
        d.submit(body(codec, req("a", ["p" * 96], "p3")), lambda e: None, p)  # (past p's share: it waits for p's own)
        d.submit(body(codec, req("a", ["o" * 96], "o1")), lambda e: None, o)  # (no room: it waits)
        assert d.held_calls == 2 and o in d._room_waiters
        p1 = next(c for c, call in d._pending.items() if call.owner is p)
        worker = d._pending[p1].worker
        d.on_reply(worker, wire.Kind.RESULT, p1, 10, b"0")  # (room for one: o's, the oldest waiting for room)
        assert [first_params(f) for f in worker.channel.take()] == [["o" * 96]]  # type: ignore[union-attr]
        assert d.held_calls == 1 and p in d._room_waiters

    run(main)


def test_the_worker_kept_for_a_call_too_large_for_any_room_left_is_one_expected_free_soonest(monkeypatch):
    """Hostile testing, round 98 (HIGH): the worker kept for the oldest call that fits no
    worker's room was the one with the fewest large params, though they were a long call's:
    the call waited 30 s, to its deadline, while the other worker served a stream of other
    clients' large calls and never emptied. The one kept is the one expected free of large
    params soonest (by how long their calls have run), and the keeping moves to another
    expected free much sooner; the one it moved off stays kept for that call (round 99,
    HIGH: opened again, it took a fresh long call each time, the keeping moved back and forth
    between two workers that never emptied, and the call waited to its deadline)."""
    from broker import routing

    monkeypatch.setattr(routing, "RESERVE_MOVE_SECONDS", 0.05)

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2)
        where = {}

        def send(tag: str, size: int) -> None:
            d.submit(body(codec, req("a", [tag[0] * (size - 4)], tag)), lambda e: None)
            for w in (w0, w1):
                frames = w.channel.take()  # type: ignore[union-attr]
                if frames:
                    where[tag] = w

        send("s1", 70)  # (to one worker, "stream")
        send("long", 100)  # (to the other: it runs long)
        stream, long_ = where["s1"], where["long"]
        assert stream is not long_
        send("s2", 110)  # (180 on the stream's worker; 210 would not fit the other)
        assert where["s2"] is stream
        send("big", 150)  # (fits neither: it waits, and the worker whose large call is younger is kept)
        assert d.held_calls == 1 and d._reserved is long_
        await asyncio.sleep(0.2)
        s1, _long, s2 = sorted(d._pending)  # (call ids, in the order sent)
        d.on_reply(stream, wire.Kind.RESULT, s1, 10, b"0")  # (110 left there: still no room for 150)
        send("s3", 80)  # (190 on the stream's worker: the other is kept)
        assert where["s3"] is stream
        d.on_reply(stream, wire.Kind.RESULT, s2, 10, b"0")  # (80 left, the youngest: the keeping moves there)
        assert d._reserved is stream and d.held_calls == 1
        send("s4", 80)  # (the one it moved off stays kept: round 99, opened again it took a fresh long
        assert "s4" not in where and d.held_calls == 2  # call each time, and the keeping flapped)
        s3 = next(c for c, pending in d._pending.items() if pending.worker is stream)
        d.on_reply(stream, wire.Kind.RESULT, s3, 10, b"0")  # (the stream's worker empties: the big call goes)
        assert [first_params(f) for f in stream.channel.take()] == [["b" * 146]]  # type: ignore[union-attr]
        assert [first_params(f) for f in long_.channel.take()] == [["s" * 76]]  # type: ignore[union-attr]  # (then s4)
        assert d._reserved is None and not d.held_calls

    run(main)


def test_a_worker_the_keeping_moved_off_is_kept_for_that_call_only(monkeypatch):
    """Hostile testing, round 100 (MEDIUM): the worker the keeping moved off stayed kept for
    the connection, not its call: when that connection's next large call waited, no move made
    for it, the worker was closed to other clients' large calls again (9 to 29 s, with room
    for them free there)."""
    from broker import routing

    monkeypatch.setattr(routing, "RESERVE_MOVE_SECONDS", 0.05)

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2, connection_share=1.0)  # (the victim may hold all the room)
        victim = ResponseBudget(d.outgoing)
        where = {}

        def send(tag: str, size: int, owner: ResponseBudget | None = None) -> None:
            d.submit(body(codec, req("a", [tag[0] * (size - 4)], tag)), lambda e: None, owner)
            for w in (w0, w1):
                if w.channel.take():  # type: ignore[union-attr]
                    where[tag] = w

        send("s1", 70)
        send("long", 100)
        stream, long_ = where["s1"], where["long"]
        send("s2", 110)
        send("big", 150, victim)  # (kept: the long call's worker, its large call younger)
        assert d._reserved is long_
        await asyncio.sleep(0.2)
        s1, _long, s2 = sorted(d._pending)
        d.on_reply(stream, wire.Kind.RESULT, s1, 10, b"0")
        send("s3", 80)
        d.on_reply(stream, wire.Kind.RESULT, s2, 10, b"0")  # (the keeping moves to the stream's worker)
        assert d._reserved is stream and long_ in d._closed(stream)
        s3 = next(c for c, pending in d._pending.items() if pending.worker is stream)
        d.on_reply(stream, wire.Kind.RESULT, s3, 10, b"0")  # (the big call goes there)
        assert [first_params(f) for f in stream.channel.take()] == [["b" * 146]]  # type: ignore[union-attr]
        assert d._reserved is None
        send("big2", 150, victim)  # (the same connection's next: fits neither; a worker kept for it, no move)
        assert d.held_calls == 1 and d._reserved is not None
        send("s5", 80)  # (room on the long call's worker: it goes there)
        assert where.get("s5") is long_, where

    run(main)


def test_a_call_behind_many_that_fit_nowhere_goes_when_room_for_it_frees():
    """Hostile testing, round 95 (MEDIUM): the waiters for room were looked at oldest first,
    at most 16 that fit nowhere each time, so a call behind 16 of them was never looked at,
    and waited 18 to 29 s with room for it free. Those that fit are found by size now."""

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2)
        d.submit(body(codec, req("a", ["x" * 126], "f1a")), lambda e: None)  # (130 + 50 bytes on one worker,
        d.submit(body(codec, req("a", ["x" * 166], "f0")), lambda e: None)  # 170 on the other)
        d.submit(body(codec, req("a", ["x" * 46], "f1b")), lambda e: None)
        assert sorted((w0.heavy, w1.heavy)) == [170, 180] and not d.queued_calls
        w0.channel.take(), w1.channel.take()  # type: ignore[union-attr]
        for i in range(20):  # (100 bytes each: they fit nowhere)
            d.submit(body(codec, req("a", ["w" * 96], i)), lambda e: None)
        d.submit(body(codec, req("a", ["h" * 46], "honest")), lambda e: None)  # (50 bytes: nowhere yet)
        assert d.held_calls == 21
        fuller = w0 if w0.heavy == 180 else w1
        small = next(c for c, call in d._pending.items() if call.heavy == 50)
        d.on_reply(fuller, wire.Kind.RESULT, small, 10, b"0")  # (50 bytes of room on it: the honest call's)
        assert [first_params(f) for f in fuller.channel.take()] == [["h" * 46]] and d.held_calls == 20  # type: ignore[union-attr]

    run(main)


def test_one_connections_share_of_the_room_for_large_params_follows_connection_share():
    """Hostile testing, round 94 (LOW): a connection's share of the room for large params was
    half the workers' whatever `connection_share` said; at 1 (a single trusted client) it may
    take all of it, as it may every place."""

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2, connection_share=1.0)
        a = ResponseBudget(d.outgoing)
        for i in range(4):  # (96 bytes each: 4 fit in 2 x 200)
            d.submit(body(codec, req("a", ["x" * 90], i)), lambda e: None, a)
        assert len(w0.channel.take() + w1.channel.take()) == 4 and not d.queued_calls  # type: ignore[union-attr]

    run(main)


def test_an_answer_puts_back_in_turn_no_connection_waiting_for_room_it_does_not_free(monkeypatch):
    """Each connection waiting for room for its large params put back in turn at every
    `_pump`, and held again, cost every answer a step per connection waiting (hundreds of
    them: milliseconds an answer, every client's): an answer that frees no room for the
    first of them lets none go; one that does lets go only what the room takes."""

    async def main() -> None:
        d, [w0, w1], codec = large_params_dispatcher(2)
        d.submit(body(codec, req("a", ["x" * 180], "fill0")), lambda e: None)
        d.submit(body(codec, req("a", ["x" * 180], "fill1")), lambda e: None)
        for i in range(50):
            d.submit(body(codec, req("a", ["w" * 60], i)), lambda e: None)
        d.submit(body(codec, req("b", [], "small")), lambda e: None)
        assert len(w0.channel.take() + w1.channel.take()) == 3 and d.held_calls == 50  # type: ignore[union-attr]
        released: list[object] = []
        release = FairQueue.release
        monkeypatch.setattr(FairQueue, "release", lambda self, key: (released.append(key), release(self, key)))
        small = next(c for c, call in d._pending.items() if not call.heavy)
        d.on_reply(d._pending[small].worker, wire.Kind.RESULT, small, 10, b"0")  # type: ignore[arg-type]
        assert released == [] and d.held_calls == 50
        fill = next(c for c, call in d._pending.items() if call.heavy)
        d.on_reply(d._pending[fill].worker, wire.Kind.RESULT, fill, 10, b"0")  # type: ignore[arg-type]
        assert len(released) == 3 and d.held_calls == 47  # (3 of 66 bytes fit in 200)

    run(main)


def test_a_worker_killed_holding_several_calls_of_one_method_does_not_make_it_wait():
    """Hostile testing, round 87 (MEDIUM): a worker holding only `add` calls was killed (kill
    -9): `add`, the one method there, was caught and waited for a worker of its own, the cap
    spent on another method's long call run alone, and every `add` waited 4 s with workers
    idle. Caught is a death with one call in it; several calls of one method are no better
    evidence against it than against another's: it runs alone where a worker is free, else as
    any."""

    async def main() -> None:
        d, workers, codec, done = isolation_setup(3)  # (cap: one of the three)
        for strike in range(2):  # m waits: two deaths, each with its one call
            d.submit(body(codec, req("m", [], f"s{strike}")), done.append)
            [dead] = [w for w in workers if w.channel.take()]  # type: ignore[union-attr]
            restarted(d, dead)
        d.submit(body(codec, req("m", [], "long")), done.append)  # alone: the cap is spent
        [alone] = [w for w in workers if w.channel.take()]  # type: ignore[union-attr]
        for i in range(4):
            d.submit(body(codec, req("boom", [], f"b{i}")), done.append)
        held = {w: len(w.channel.take()) for w in workers if w is not alone}  # type: ignore[union-attr]
        assert sorted(held.values()) == [2, 2]
        restarted(d, next(iter(held)))  # killed holding 2 calls of boom only
        assert d.isolated == {"m": 2, "boom": 1} and "boom" not in {d._names[i] for i in d._isolation.waits}
        d.submit(body(codec, req("boom", [], "after")), done.append)
        assert d.queued_calls == 0 and sum(len(w.channel.take()) for w in workers) == 1  # type: ignore[union-attr]

    run(main)


def test_a_method_runs_alone_no_longer_than_its_time_bound_whatever_is_owed(monkeypatch):
    """Hostile testing, round 80 (HIGH): a slow innocent method framed by crashes that came
    after their calls answered owed 8 answers, one call a worker at a time, and its clients
    timed out for 35 s. A method runs alone until its answers owed are paid or its time
    bound since its last strike (ALONE_SECONDS times them, MAX_ALONE_SECONDS at most) has
    passed, whichever comes first."""
    from broker import isolation

    monkeypatch.setattr(isolation, "ALONE_SECONDS", 0.05)

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop())
        d.set_methods(["m", "slow"])
        w = add_worker(d, 0, concurrency=10)
        codec = Codec()
        done: list[Exchange] = []
        for strike in range(2):  # two deaths under it: 2 answers owed, 0.1 s bound here
            d.submit(body(codec, req("slow", [], f"s{strike}")), done.append)
            w.channel.take()  # type: ignore[union-attr]
            restarted(d, w)
        assert d.isolated == {"slow": 2}
        for i in range(3):
            d.submit(body(codec, req("slow", [], i)), done.append, ResponseBudget(d.outgoing))
        [(_, first, _, _)] = w.channel.take()  # type: ignore[union-attr]  # one alone, two wait
        assert d.queued_calls == 2
        await asyncio.sleep(0.15)  # the bound passes with 2 answers still owed
        d.on_reply(w, wire.Kind.RESULT, first, 10, b"0")
        assert d.isolated == {} and d.queued_calls == 0 and len(w.channel.take()) == 2  # type: ignore[union-attr]

    run(main)


def test_a_reservation_ends_when_the_connection_of_the_call_it_was_made_for_goes():
    """Hostile testing, round 80 (MEDIUM): a worker reserved for a call run alone stayed out
    of use until it drained when that call's connection closed: the flag of calls waiting
    for a worker of their own stayed up, and nothing ended the reservation."""

    async def main() -> None:
        d, (w0,), codec, done = isolation_setup(1)
        d.submit(body(codec, req("boom", [], "s")), done.append)
        w0.channel.take()  # type: ignore[union-attr]
        restarted(d, w0)
        d.submit(body(codec, req("m", [], "busy")), done.append)  # (no worker idle)
        assert len(w0.channel.take()) == 1  # type: ignore[union-attr]
        gone = ResponseBudget(d.outgoing)
        d.submit(body(codec, req("boom", [], "b")), done.append, gone)
        assert w0.limit == 0 and d.queued_calls == 1  # reserved for it
        d.abandon(gone)
        assert w0.limit == 10 and d.queued_calls == 0
        d.submit(body(codec, req("m", [], "next")), done.append)
        assert len(w0.channel.take()) == 1  # type: ignore[union-attr]

    run(main)


def test_a_call_waiting_for_a_worker_of_its_own_goes_when_its_method_s_time_bound_ends(monkeypatch):
    """Round 80's new user (HIGH): the time bound of a method run alone was checked only at
    its next call, so a call already waiting for a worker of its own (reserved, draining a
    long call) waited to its deadline. A timer frees it when the bound ends."""
    from broker import isolation

    monkeypatch.setattr(isolation, "ALONE_SECONDS", 0.05)

    async def main() -> None:
        d, (w,), codec, done = isolation_setup(1)
        for strike in range(2):  # 2 answers owed, or 0.1 s here
            d.submit(body(codec, req("boom", [], f"s{strike}")), done.append)
            w.channel.take()  # type: ignore[union-attr]
            restarted(d, w)
        d.submit(body(codec, req("m", [], "long")), done.append)  # (no worker idle, and none answers)
        assert len(w.channel.take()) == 1  # type: ignore[union-attr]
        d.submit(body(codec, req("boom", [], "b")), done.append)
        assert w.limit == 0 and d.queued_calls == 1  # (reserved: it waits)
        await asyncio.sleep(0.3)
        assert d.isolated == {} and d.queued_calls == 0 and w.limit == 10
        assert len(w.channel.take()) == 1  # type: ignore[union-attr]

    run(main)


def test_a_chunk_answered_whole_in_parts_owes_nothing_when_its_connection_goes():
    """Found by a long run of the state machine (stop 36): a chunk whose calls were all
    answered in parts (CHUNK_PART), its final reply not yet in, kept its exchange; its
    connection then lost with nothing else in flight, `abandon` passed over it (none in
    flight) and left it owing, as far as the dispatcher could tell."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop())
        d.set_methods(["m"])
        w = add_worker(d, 0, concurrency=10)
        codec = Codec()
        budget = ResponseBudget(d.outgoing)
        done: list[Exchange] = []
        d.submit(body(codec, [req("m", [i], i) for i in range(3)]), done.append, budget)
        [frame] = w.channel.take()  # type: ignore[union-attr]
        assert frame[0] == wire.Kind.CHUNK
        d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_reply(frame))  # every call answered, in a part
        assert len(done) == 1 and budget.in_flight == 0
        budget.lost()
        d.abandon(budget)
        assert all(c.exchange is None for c in d._pending.values() if c.owner is budget)
        d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 10, b"")  # its final reply: nothing more
        assert d.in_flight_calls == 0 and not d._pending

    run(main)
