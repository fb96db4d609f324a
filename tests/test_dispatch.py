"""The dispatcher in memory: its deadline wheel on real event loops (uvloop and
asyncio), and its queue, routing, memory bound and late-reply accounting driven with
real `pool.Worker` records whose channels record the frames sent to them."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
import typing

import pytest
import uvloop

from broker import wire
from broker.dispatch import Call, DeadlineWheel, Dispatcher, Exchange, Route
from broker.jsonrpc import Body, Codec, Request
from broker.pool import Worker, WorkerState

LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


def make_call(call_id: int, timeout: float) -> Call:
    return Call.of(call_id, None, -1, Request("2.0", "m"), Route(0, timeout), 0.0)


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

    def send(self, kind: int, call_id: int, aux: int, payload: object) -> None:
        self.frames.append((kind, call_id, aux, bytes(payload)))  # type: ignore[call-overload]

    def take(self) -> list[tuple[int, int, int, bytes]]:
        frames, self.frames = self.frames, []
        return frames


def add_worker(d: Dispatcher, slot: int, concurrency: int) -> Worker:
    w = Worker(slot)
    w.channel = RecordingChannel()  # type: ignore[assignment]
    w.concurrency = concurrency
    w.state = WorkerState.READY
    d.worker_ready(w)
    return w


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
        _index, _flags, length = wire.CALL_ENTRY.unpack_from(frame[3], 0)
        return json.loads(frame[3][wire.CALL_ENTRY.size : wire.CALL_ENTRY.size + length])
    return json.loads(frame[3])


def test_freed_slots_are_all_filled_from_the_queue_in_fifo_order():
    """Issue 9 item 12: a chunk's reply frees many slots; every one is filled from the
    queue at once, oldest call first, and a new call joins the tail of the queue."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop())
        d.set_methods(["sleep"])
        w = add_worker(d, 0, concurrency=4)
        codec = Codec()
        done: list[Exchange] = []
        d.submit(body(codec, [req("sleep", [1.0], i) for i in range(10)]), done.append)
        [chunk] = w.channel.take()
        assert chunk[0] == wire.Kind.CHUNK and w.outstanding == 10  # a chunk overshoots the limit
        for n in range(8):
            d.submit(body(codec, req("sleep", [n], n)), done.append)
        assert w.channel.take() == [] and d.statistics().queued == 8
        d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 0, chunk_reply(chunk))
        started = w.channel.take()
        assert [first_params(f) for f in started] == [[0], [1], [2], [3]]  # all 4 slots, in order
        assert w.outstanding == 4 and len(done) == 1
        d.submit(body(codec, req("sleep", ["new"], "new")), done.append)  # must not overtake
        assert w.channel.take() == []
        for frame in started:
            d.on_reply(w, wire.Kind.RESULT, frame[1], 0, b"0")
        assert [first_params(f) for f in w.channel.take()] == [[4], [5], [6], [7]]
        assert d.statistics().queued == 1

    run(main)


def test_a_chunk_at_the_head_of_the_queue_goes_first_and_is_not_starved():
    """A queued chunk needs one free slot, as a call does (then overshoots the limit):
    calls queued behind it never pass it, and they start once it has gone."""

    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop())
        d.set_methods(["sleep"])
        w = add_worker(d, 0, concurrency=2)
        codec = Codec()
        d.submit(body(codec, req("sleep", ["a"], 1)), lambda e: None)
        d.submit(body(codec, req("sleep", ["b"], 2)), lambda e: None)
        a, b = w.channel.take()
        d.submit(body(codec, [req("sleep", ["chunk"], i) for i in range(5)]), lambda e: None)
        d.submit(body(codec, req("sleep", ["c"], 3)), lambda e: None)
        assert w.channel.take() == []
        d.on_reply(w, wire.Kind.RESULT, a[1], 0, b"0")
        [chunk] = w.channel.take()  # the chunk, not the call behind it
        assert chunk[0] == wire.Kind.CHUNK and first_params(chunk) == ["chunk"]
        d.on_reply(w, wire.Kind.RESULT, b[1], 0, b"0")
        assert w.channel.take() == [] and w.outstanding == 5  # still over the limit
        d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 0, chunk_reply(chunk))
        assert [first_params(f) for f in w.channel.take()] == [["c"]]

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
        assert d.statistics().queued == 1 and d.queued_bytes == 605
        assert len(answers) == 1 and b"-32000" in answers[0]  # the second one is shed

    run(main)
