"""The dispatcher core in memory: routing.py and queueing.py (which worker a call goes to,
the fair queue and its refill), held by exact values: what `make mutate` found the other
in-memory tests did not hold. The set-up is test_dispatch_core.py's.
"""

from __future__ import annotations

import json
import logging
import typing

import pytest
import test_dispatch_core
from test_dispatch import add_worker, body, chunk_reply, first_params, req, restarted
from test_dispatch_core import Clock, codes, one_worker

from broker import wire
from broker.answers import Exchange, ResponseBudget
from broker.deadlines import TIMER_EARLY
from broker.dispatch import Dispatcher
from broker.jsonrpc import Codec, ErrorCode
from broker.metrics import CallMetrics
from broker.policy import MethodRule, Policy
from broker.ratelimit import Bucket, Rate

clock = test_dispatch_core.clock  # (the fixture: time injected)


def taken(*workers: typing.Any) -> list[list[object]]:
    """The params of the frames sent to each of `workers` since last asked, worker by worker."""
    return [[first_params(f) for f in w.channel.take()] for w in workers]


# -- queueing.py: a full queue sheds the newest calls of the connection with most waiting --


def full_queue(clock: Clock, methods: tuple[str, ...] = ("m",), **settings: typing.Any
               ) -> tuple[Dispatcher, typing.Any, Codec, list[Exchange]]:
    """A dispatcher (`settings`) with one worker of 10 places, full with one batch: what comes
    next waits (a batch in one chunk, a connection's share being every place)."""
    d, w, codec, done = one_worker(clock.loop, list(methods), 10, connection_share=1.0, **settings)
    d.submit(body(codec, [req("m", ["busy"], i) for i in range(10)]), done.append)
    assert len(w.channel.take()) == 1 and w.outstanding == 10
    done.clear()
    return d, w, codec, done


def queue_calls(d: Dispatcher, codec: Codec, owner: ResponseBudget, tags: typing.Iterable[object],
                done: list[Exchange], pad: str = "", method: str = "m") -> list[object]:
    """Submit a call of `method` for each of `tags` (its id; its params, with `pad`); the ids of
    those refused -32000 at once."""
    refused = []
    for tag in tags:
        exchange = d.submit(body(codec, req(method, [f"{tag}{pad}"], tag)), done.append, owner)
        if exchange is not None and not exchange.remaining:
            assert codes([exchange]) == [ErrorCode.OVERLOADED]
            refused.append(tag)
    return refused


def shed_ids(done: list[Exchange]) -> list[object]:
    """The ids of the queued single calls answered -32000 (shed), in order."""
    return [json.loads(e.body())["id"] for e in done if codes([e]) == [ErrorCode.OVERLOADED]]


def test_a_full_queue_sheds_by_bytes_as_many_of_the_newest_calls_as_free_the_bytes_a_call_needs(clock):
    d, _w, codec, done = full_queue(clock, max_queue=100, max_queue_bytes=400)
    flood, other = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
    queue_calls(d, codec, flood, range(4), done, pad="x" * 90)  # (96 bytes each, with its id)
    assert (d.queued_calls, flood.queued, d.queued_bytes) == (4, 4, 384)
    queue_calls(d, codec, other, ["o"], done, pad="o" * 149)  # (157 bytes: 141 to free, 2 of the flood's)
    assert shed_ids(done) == [3, 2] and (flood.queued, other.queued, d.queued_calls, d.queued_bytes) == (2, 1, 3, 349)
    assert len(d._queue) == 3


@pytest.mark.parametrize(("pad", "shed"), [(200, [3, 2]), (201, [3, 2, 1])])
def test_a_full_queue_sheds_calls_until_the_bytes_freed_are_exactly_enough(clock, pad, shed):
    metrics = CallMetrics()
    d, _w, codec, done = full_queue(clock, max_queue=100, max_queue_bytes=400, metrics=metrics)
    flood, other = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
    queue_calls(d, codec, flood, range(4), done, pad="x" * 90)  # (96 bytes each)
    queue_calls(d, codec, other, ["o"], done, pad="o" * pad)  # (208 bytes: 192 to free, 2 calls; 209: 3)
    assert shed_ids(done) == shed and d.queued_bytes == 384 - 96 * len(shed) + 8 + pad
    assert metrics.outcomes[0] == {ErrorCode.OVERLOADED: len(shed)}


def test_a_full_queue_sheds_nothing_if_the_fattest_would_keep_fewer_than_the_newcomer_has(clock):
    d, _w, codec, done = full_queue(clock, max_queue=5)
    flood = ResponseBudget(d.outgoing)
    queue_calls(d, codec, flood, range(5), done)
    refused = d.submit(body(codec, [req("m", [i], f"b{i}") for i in range(3)]), done.append)  # (5 - 3 < 3)
    assert refused is not None and refused.remaining == 0 and shed_ids(done) == []
    assert (flood.queued, d.queued_calls, len(d._queue)) == (5, 5, 5)


def test_a_full_queue_sheds_for_a_call_only_while_the_fattest_keeps_as_many_as_it_will_have(clock):
    d, _w, codec, done = full_queue(clock, max_queue=5)
    flood, other = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
    queue_calls(d, codec, flood, range(3), done)
    queue_calls(d, codec, other, ["o0", "o1"], done)
    assert d.queued_calls == 5
    assert queue_calls(d, codec, other, ["o2"], done) == ["o2"]  # (3 against its 2 + 1: the newcomer is shed)
    assert shed_ids(done) == [] and (flood.queued, other.queued) == (3, 2)
    third = ResponseBudget(d.outgoing)
    assert queue_calls(d, codec, third, ["t"], done) == []  # (3 against 0 + 1, and 2 left: the flood's newest)
    assert shed_ids(done) == [2] and (flood.queued, other.queued, third.queued) == (2, 2, 1)


def test_a_full_queue_sheds_nothing_for_a_batch_heavier_than_max_queue(clock):
    d, _w, codec, done = full_queue(clock, max_queue=8)
    flood = ResponseBudget(d.outgoing)
    queue_calls(d, codec, flood, range(8), done)
    refused = d.submit(body(codec, [req("m", [i], i) for i in range(9)]), done.append)  # 9 calls > 8
    assert refused is not None and refused.remaining == 0 and flood.queued == 8 and shed_ids(done) == []
    assert [a["error"]["code"] for a in json.loads(refused.body())] == [ErrorCode.OVERLOADED] * 9
    d.submit(body(codec, [req("m", [i], f"b{i}") for i in range(4)]), done.append)  # 4, and the flood keeps 4
    assert shed_ids(done) == [7, 6, 5, 4] and flood.queued == 4 and d.queued_calls == 8


def test_the_connection_with_most_waiting_is_still_known_after_one_of_its_calls_leaves_the_queue(clock):
    d, w, codec, done = full_queue(clock, max_queue=5)
    flood, other, third = (ResponseBudget(d.outgoing) for _ in range(3))
    queue_calls(d, codec, flood, range(5), done)
    assert w.channel.take() == [] and flood.queued == 5
    chunk_id = next(iter(d._pending))
    d.on_reply(w, wire.Kind.CHUNK_PART, chunk_id, 0, wire.REPLY_ENTRY.pack(0, wire.Kind.RESULT, 1) + b"0")
    assert [first_params(f) for f in w.channel.take()] == [["0"]] and flood.queued == 4  # (a place: the first goes)
    queue_calls(d, codec, other, ["o"], done)
    assert queue_calls(d, codec, third, ["t"], done) == []  # (full: the flood's newest is shed for it)
    assert shed_ids(done) == [4] and (flood.queued, other.queued, third.queued) == (3, 1, 1)


def test_the_connection_with_most_waiting_is_still_known_after_the_queue_is_compacted(clock):
    d, _w, codec, done = full_queue(clock, ("m", "short"), max_queue=7, method_timeouts={"short": 1.0})
    flood = ResponseBudget(d.outgoing)
    queue_calls(d, codec, flood, ["f0"], done)
    queue_calls(d, codec, flood, ["s1", "s2", "s3", "s4"], done, method="short")
    queue_calls(d, codec, flood, ["f5", "f6"], done)
    clock.advance(1.05)  # (4 shells of 7: compacted)
    assert (len(d._queue), flood.queued) == (3, 3)
    others = [ResponseBudget(d.outgoing) for _ in range(3)]
    queue_calls(d, codec, others[0], ["o1", "o2"], done)
    queue_calls(d, codec, others[1], ["p1"], done)
    queue_calls(d, codec, others[2], ["q1"], done)
    assert queue_calls(d, codec, ResponseBudget(d.outgoing), ["t"], done) == []  # (full: the flood has most)
    assert shed_ids(done) == ["f6"] and flood.queued == 2


def test_expired_shells_among_the_newest_are_taken_out_with_the_calls_shed_and_free_nothing(clock):
    d, _w, codec, done = full_queue(clock, ("m", "short"), max_queue=6, method_timeouts={"short": 1.0})
    flood = ResponseBudget(d.outgoing)
    queue_calls(d, codec, flood, range(4), done)
    queue_calls(d, codec, flood, ["s"], done, method="short")
    queue_calls(d, codec, flood, [5], done)
    clock.advance(1.05)  # ("s" expires: a shell behind its connection's head)
    assert codes(done) == [ErrorCode.TIMED_OUT] and (d.queued_calls, len(d._queue), d._expired_queued) == (5, 6, 1)
    d.submit(body(codec, [req("m", [i], f"b{i}") for i in range(3)]), done.append)  # (2 to free: 5, the shell, 3)
    assert shed_ids(done) == [5, 3] and (flood.queued, d.queued_calls, len(d._queue), d._expired_queued) == (3, 6, 4, 0)


# -- routing.py: methods run alone, and the timer that ends their time alone ----------------


def test_a_method_run_alone_is_freed_and_said_so_by_a_timer_at_the_end_of_its_time_bound(clock, caplog):
    d, w, codec, done = one_worker(clock.loop, ["m", "boom"], 10)
    d.submit(body(codec, req("boom", [], 1)), done.append)
    w.channel.take()
    start = clock.now
    restarted(d, w)  # (boom: 1 strike, 4 s alone at most)
    timer = d._isolation_handle
    assert d.isolated == {"boom": 1} and timer.when() == pytest.approx(start + 4.0 + TIMER_EARLY, abs=1e-9)
    clock.advance(1.0)
    d.submit(body(codec, req("m", [], 2)), done.append)
    w.channel.take()
    restarted(d, w)  # (m: 1 strike, to 5 s from the start: the timer stays at boom's end)
    assert d.isolated == {"boom": 1, "m": 1}
    assert d._isolation_handle.when() == pytest.approx(start + 4.0 + TIMER_EARLY, abs=1e-9)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="broker.dispatch"):
        clock.advance(3.0)
        assert d.isolated == {"boom": 1, "m": 1} and not caplog.records
        clock.advance(0.002)  # (the timer fires: boom's time is over, then m's is due)
        assert d.isolated == {"m": 1}
        assert d._isolation_handle.when() == pytest.approx(start + 5.0 + TIMER_EARLY, abs=1e-9)
        clock.advance(1.0)
    assert d.isolated == {} and d._isolation_handle is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"{name}: its calls run as any again (its time alone since its last strike is over)")
        for name in ("boom", "m")
    ]


def test_the_timer_of_methods_run_alone_is_moved_earlier_for_a_time_bound_that_ends_sooner(clock):
    d, w, codec, done = one_worker(clock.loop, ["m", "boom"], 10)
    start = clock.now
    for strike in range(3):  # (boom: 3 strikes, 16 s alone at most; the timer at its first 4 s)
        d.submit(body(codec, req("boom", [], strike)), done.append)
        assert len(w.channel.take()) == 1
        restarted(d, w)
    assert d._isolation_handle.when() == pytest.approx(start + 4.0 + TIMER_EARLY, abs=1e-9)
    clock.advance(4.002)  # (nothing ends: the timer goes to boom's end)
    late = d._isolation_handle
    assert d.isolated == {"boom": 4} and late.when() == pytest.approx(start + 16.0 + TIMER_EARLY, abs=1e-9)
    clock.advance(1.0)
    d.submit(body(codec, req("m", [], "m")), done.append)
    w.channel.take()
    restarted(d, w)  # (m: 1 strike, 4 s: sooner)
    assert d._isolation_handle.when() == pytest.approx(start + 9.002 + TIMER_EARLY, abs=1e-9) and late.cancelled()


def test_the_timer_of_methods_run_alone_is_left_as_it_is_for_a_time_bound_that_ends_later(clock):
    """_isolation_timer compared the timer's time, TIMER_EARLY past the end, with the end
    itself: with the earliest end unchanged it cancelled the timer and armed another."""
    d, w, codec, done = one_worker(clock.loop, ["m", "boom"], 10)
    d.submit(body(codec, req("boom", [], 1)), done.append)
    w.channel.take()
    restarted(d, w)
    timer = d._isolation_handle
    clock.advance(1.0)
    d.submit(body(codec, req("m", [], 2)), done.append)
    w.channel.take()
    restarted(d, w)  # (m's end is a second after boom's: the timer, at boom's, needs no change)
    assert d._isolation_handle is timer and not timer.cancelled()


# -- routing.py: room for large params (max_worker_params_bytes) -------------------------


class Room:
    """A dispatcher whose workers (`workers`, of `concurrency` places) each hold at most 200
    bytes of params of 50 bytes or more (this scale's large params), serving "a" and "b" (5 s
    deadlines); `send` submits a call whose params are `size` bytes and records where each
    call's frame went (by its tag, the first letter of its params)."""

    def __init__(self, clock: Clock, workers: int = 2, concurrency: int | tuple[int, ...] = 10,
                 **settings: typing.Any) -> None:
        self.d = d = Dispatcher(clock.loop, max_worker_params_bytes=200, timeout=5.0, **settings)
        d._heavy_bytes = 50
        d.set_methods(["a", "b"])
        places = (concurrency,) * workers if isinstance(concurrency, int) else concurrency
        self.workers = [add_worker(d, slot, n) for slot, n in enumerate(places)]
        self.codec = Codec()
        self.where: dict[str, typing.Any] = {}
        self.ids: dict[str, int] = {}
        self.done: list[Exchange] = []

    def send(self, tag: str, size: int, owner: ResponseBudget | None = None, method: str = "a") -> None:
        self.d.submit(body(self.codec, req(method, [tag * (size - 4)], tag)), self.done.append, owner)
        self.sent()

    def sent(self) -> list[str]:
        """The tags of the calls sent since last asked, in order (and where each went)."""
        tags = []
        for w in self.workers:
            for frame in w.channel.take():
                tag = str(first_params(frame)[0])[:1]  # type: ignore[index]
                self.where[tag], self.ids[tag] = w, frame[1]
                tags.append(tag)
        return tags

    def answer(self, tag: str) -> None:
        self.d.on_reply(self.where[tag], wire.Kind.RESULT, self.ids[tag], 10, b"0")


def test_a_call_waiting_for_room_past_a_share_shrunk_meanwhile_waits_for_its_own_call_to_end(clock):
    r = Room(clock)
    x = ResponseBudget(r.d.outgoing)
    r.send("x", 120, x)
    r.send("p", 150)  # (to the other, idle)
    r.send("o", 60)  # (180 with x's: no room for 60 beside p's 150)
    assert r.sent() == [] and r.where["o"] is r.where["x"] is not r.where["p"]
    r.send("y", 70, x)  # (no room on either: it waits; 190 of x's share of 200)
    assert r.sent() == [] and r.d.held_calls == 1
    r.d.worker_unready(r.where["p"])  # (one worker left: x's share of the room is 100)
    r.answer("o")  # (room for 70 beside x's 120 now, but x is past its share)
    assert r.sent() == [] and r.d.held_calls == 1
    r.answer("x")  # (its own call ends: it goes)
    assert r.sent() == ["y"] and r.d.held_calls == 0 and r.where["y"] is r.where["x"]


def test_calls_waiting_for_room_are_let_go_no_more_than_the_places_free(clock):
    r = Room(clock, workers=1, concurrency=3)
    r.send("f", 180)
    r.send("s", 10)  # (small: a place, no room)
    for tag in "ghi":  # (no room: they wait, g the oldest, h and i the smallest after it)
        r.send(tag, 60, ResponseBudget(r.d.outgoing))
    assert r.sent() == [] and r.d.held_calls == 3
    r.answer("f")  # (room for all three, places for two)
    assert r.sent() == ["g", "h"] and r.d.held_calls == 1
    r.answer("s")
    assert r.sent() == ["i"] and r.d.held_calls == 0


# -- routing.py: which worker a call goes to ------------------------------------------------


@pytest.mark.parametrize("pad", [0, 55], ids=["small", "large"])
def test_calls_go_to_the_least_loaded_worker_ties_taken_in_turn_from_one_further_each_time(clock, pad):
    """The same with large params (60 bytes here: 3 fit a worker's room), which `_pick_blocked` routes."""
    d = Dispatcher(clock.loop, max_worker_params_bytes=200)
    d._heavy_bytes = 50
    d.set_methods(["m"])
    workers = [add_worker(d, slot, concurrency=10) for slot in range(3)]
    codec = Codec()
    ids: dict[int, list[int]] = {w.slot: [] for w in workers}

    def call(n: int) -> list[int]:
        slots = []
        for i in range(n):
            d.submit(body(codec, req("m", [f"{i}{'x' * pad}"], i)), lambda e: None, ResponseBudget(d.outgoing))
            [w] = [w for w in workers if w.channel.frames]
            ids[w.slot] += [f[1] for f in w.channel.take()]
            slots.append(w.slot)
        return slots

    def answer(slot: int) -> None:
        d.on_reply(workers[slot], wire.Kind.RESULT, ids[slot].pop(0), 10, b"0")

    assert call(6) == [1, 2, 0, 1, 2, 0]  # (idle ones first, then the ties in turn)
    answer(0)
    answer(2)  # (loads 1, 2, 1: the scan starts at 1, then 2, then 0)
    assert call(1) == [2]
    answer(1)
    answer(1)  # (loads 1, 0, 2: the scan starts at 0, passes it for the idle one)
    assert call(2) == [1, 0]
    assert [w.heavy for w in workers] == [60 * w.outstanding if pad else 0 for w in workers]


# -- queueing.py: the queue's refill, a connection's share, a connection gone --------------


def test_the_time_a_call_waited_in_the_queue_is_observed_once_for_each_of_its_calls(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], 3, metrics=metrics, connection_share=1.0)
    d.submit(body(codec, [req("m", [i], i) for i in range(3)]), done.append)  # (every place)
    d.submit(body(codec, [req("m", [i], i) for i in range(3)]), done.append)  # (a chunk of 3, queued)
    [busy] = w.channel.take()
    clock.advance(2.0)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, busy[1], 10, chunk_reply(busy))
    assert [(f[0], f[2]) for f in w.channel.take()] == [(wire.Kind.CHUNK, 3)]
    assert (metrics.queue_wait.sum_us, sum(metrics.queue_wait.counts)) == (3 * 2_000_000, 3)
    assert metrics.queue_wait.counts[(2_000_000).bit_length()] == 3


def test_a_connection_held_for_its_share_goes_back_in_turn_as_soon_as_its_next_call_fits(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], 10)  # (a connection's share: 5 places)
    owner = ResponseBudget(d.outgoing)
    for i in range(7):
        d.submit(body(codec, req("m", [i], i)), done.append, owner)
    sent = w.channel.take()
    assert len(sent) == 5 and (owner.in_flight, d.held_calls) == (5, 2)
    d.on_reply(w, wire.Kind.RESULT, sent[0][1], 10, b"0")  # (4 + 1 <= 5: the next goes, one only)
    assert [first_params(f) for f in w.channel.take()] == [[5]] and (owner.in_flight, d.held_calls) == (5, 1)


def test_a_gone_connections_queued_calls_and_shells_are_dropped_and_counted_once(clock):
    d, w, codec, done = one_worker(clock.loop, ["m", "short"], 2, method_timeouts={"short": 1.0},
                                   connection_share=1.0, cancel_grace=100.0)
    gone = ResponseBudget(d.outgoing)
    for method, tag in (("m", "a"), ("m", "b"), ("m", "c"), ("short", "s"), ("m", "d"), ("short", "t"), ("m", "e")):
        d.submit(body(codec, req(method, [tag], tag)), done.append, gone)
    in_flight = w.channel.take()
    clock.advance(1.05)  # (s and t expire: shells behind its head)
    assert (d.queued_calls, len(d._queue), d._expired_queued) == (3, 5, 2)
    gone.lost()
    d.abandon(gone)
    assert (d.queued_calls, len(d._queue), d._expired_queued, d.queued_bytes) == (0, 0, 0, 0)
    assert d.abandoned_total == {"queued": 3, "in_flight": 2} and len(in_flight) == 2
    assert sorted(f[1] for f in w.channel.take() if f[0] == wire.Kind.CANCEL) == sorted(f[1] for f in in_flight)


def test_the_turn_among_workers_is_kept_while_one_worker_alone_is_ready(clock):
    d = Dispatcher(clock.loop)
    d.set_methods(["m"])
    w0, w1, w2 = workers = [add_worker(d, slot, concurrency=10) for slot in range(3)]
    codec = Codec()

    def call_and_answer() -> typing.Any:
        d.submit(body(codec, req("m", [], 0)), lambda e: None)
        [(w, frame)] = [(w, f) for w in workers for f in w.channel.take()]
        d.on_reply(w, wire.Kind.RESULT, frame[1], 10, b"0")
        return w

    assert call_and_answer() is w1  # (the scan starts one further: at 1)
    d.worker_unready(w0)
    d.worker_unready(w2)
    assert call_and_answer() is w1  # (the only one ready: the turn is left where it was)
    d.worker_ready(w0)
    d.worker_ready(w2)  # (ready: w1, w0, w2)
    assert call_and_answer() is w2  # (the scan starts at 2)


@pytest.mark.parametrize(("ran", "moved"), [(0.0, True), (0.4, True), (0.5, False), (0.75, False)])
def test_the_keeping_moves_to_a_worker_expected_free_more_than_a_second_and_twice_as_soon(clock, ran, moved):
    """The worker kept for the oldest call that fits no room moves to another whose large calls
    have run less than half as long, less a second (here: 2 s against `ran`); the one it moved off
    stays closed to others' large calls while that call waits, so a newer call that fits only the
    one moved to waits too; with no move, it goes there."""
    r = Room(clock, workers=3)
    for tag, size in (("l", 100), ("s", 70), ("f", 190)):  # (one a worker)
        r.send(tag, size)
    assert len({r.where[t] for t in "lsf"}) == 3
    clock.advance(2.0 - ran)
    r.send("t", 110)  # (beside s: 180)
    r.send("b", 150)  # (fits nowhere: l's worker is kept for it, its large call the fewest bytes)
    r.send("n", 60, ResponseBudget(r.d.outgoing))  # (others wait: it joins them)
    assert r.where["t"] is r.where["s"] and r.d.held_calls == 2
    clock.advance(ran)
    r.answer("s")  # (t left there, run `ran`; l has run 2 s)
    assert r.sent() == ([] if moved else ["n"])
    assert r.d.held_calls == (2 if moved else 1)


def test_a_call_of_a_method_whose_time_alone_ends_that_instant_goes_as_any(clock):
    d, w, codec, done = one_worker(clock.loop, ["m", "boom"], 10)
    d.submit(body(codec, req("boom", [], 1)), done.append)
    w.channel.take()
    restarted(d, w)  # (caught: its calls wait for a worker of their own, 4 s at most)
    d.submit(body(codec, req("m", [], "busy")), done.append)
    assert len(w.channel.take()) == 1
    clock.now += 4.0  # (its end, to the tick: before the timer, due TIMER_EARLY later)
    d.submit(body(codec, req("boom", [], 2)), done.append)
    assert [first_params(f) for f in w.channel.take()] == [[]] and d.isolated == {} and w.limit == 10


# -- routing.py: a call of a method caught crashing its worker runs alone -------------------


def caught(clock: Clock, share: float = 0.5, beside: tuple[str, ...] = ()
           ) -> tuple[Dispatcher, list[typing.Any], Codec, list[Exchange]]:
    """A dispatcher (`connection_share`) whose worker 0 died under a call of "boom" alone (its
    calls wait for a worker of their own now; or, `beside` calls of other methods, struck once
    each, they run alone only where a worker is free), with workers 1 and 2 ready after it, all
    idle; "slow" is a sync method (blocking until measured)."""
    d = Dispatcher(clock.loop, connection_share=share)
    d.set_methods(["m", "boom", "slow"], sync_methods=["slow"])
    w0 = add_worker(d, 0, concurrency=10)
    codec = Codec()
    done: list[Exchange] = []
    for method in ("boom", *beside):
        d.submit(body(codec, req(method, [], "crash")), done.append)
    w0.channel.take()
    restarted(d, w0)
    assert d.isolated == {"boom": 1, **{m: 1 for m in beside}}
    return d, [w0, add_worker(d, 1, concurrency=10), add_worker(d, 2, concurrency=10)], codec, done


def test_with_no_worker_idle_the_first_of_the_least_loaded_is_reserved_for_a_call_run_alone(clock):
    d, workers, codec, done = caught(clock)
    for i in range(3):
        d.submit(body(codec, req("m", [i], i)), done.append, ResponseBudget(d.outgoing))
    assert [w.outstanding for w in workers] == [1, 1, 1]
    d.submit(body(codec, req("boom", [], "alone")), done.append)
    assert [w.limit for w in workers] == [0, 10, 10] and d.queued_calls == 1  # (it takes nothing more)
    for w in workers:
        w.channel.take()
    d.submit(body(codec, req("m", ["x"], "x")), done.append, ResponseBudget(d.outgoing))
    assert [len(w.channel.take()) for w in workers] == [0, 1, 0]  # (not to the one reserved)


@pytest.mark.parametrize(("share", "goes"), [(0.5, False), (0.7, True)])
def test_a_call_run_alone_counts_in_its_connections_share_of_blocking_calls(clock, share, goes):
    d, workers, codec, done = caught(clock, share)  # (its share of blocking calls: 1 of 3 workers, or 2)
    owner = ResponseBudget(d.outgoing)
    d.submit(body(codec, req("slow", [], "slow")), done.append, owner)
    d.submit(body(codec, req("boom", [], "alone")), done.append, owner)
    frames = [[first_params(f) for f in w.channel.take()] for w in workers]
    assert sorted(len(f) for f in frames) == ([0, 1, 1] if goes else [0, 0, 1]) and owner.blocking == 1 + goes
    assert d.queued_calls == (not goes)


def test_a_call_run_alone_goes_to_an_idle_worker_past_one_running_another_alone(clock):
    d, workers, codec, done = caught(clock, share=1.0)  # (up to 3 workers may run calls alone)
    d.submit(body(codec, req("boom", [], "first")), done.append, ResponseBudget(d.outgoing))
    d.submit(body(codec, req("boom", [], "second")), done.append, ResponseBudget(d.outgoing))
    assert [len(w.channel.take()) for w in workers] == [1, 1, 0]
    assert [(w.blocked, w.limit) for w in workers] == [(True, 0), (True, 0), (False, 10)]


# -- routing.py: workers blocked in slow sync calls, or overdue -----------------------------


def two_blocked(clock: Clock, **settings: typing.Any) -> tuple[Dispatcher, list[typing.Any], Codec, list[Exchange]]:
    """Two workers (4 places; a prefetch of 1 behind a blocking sync call), each blocked in a
    call of the sync "slow": the first returned since 2.5 s, the other since 1.5 s, and full (its
    prefetch taken by a call of "m")."""
    d = Dispatcher(clock.loop, sync_prefetch=1, timeout=60.0, **settings)
    d.set_methods(["m", "slow"], sync_methods=["slow"])
    workers = [add_worker(d, slot, concurrency=4) for slot in range(2)]
    codec = Codec()
    done: list[Exchange] = []
    d.submit(body(codec, req("slow", [], "s0")), done.append, ResponseBudget(d.outgoing))
    older = next(w for w in workers if w.channel.take())
    younger = workers[1 - workers.index(older)]
    clock.advance(1.0)
    d.submit(body(codec, req("slow", [], "s1")), done.append, ResponseBudget(d.outgoing))
    d.submit(body(codec, req("m", [], "m1")), done.append, ResponseBudget(d.outgoing))  # (behind the younger)
    assert (len(older.channel.take()), len(younger.channel.take())) == (0, 2) and [w.limit for w in workers] == [2, 2]
    clock.advance(1.5)
    return d, [older, younger], codec, done


@pytest.mark.parametrize(("bounds", "waits"), [
    ({}, True), ({"max_queue": 1}, True), ({"max_queue": 0}, False),
    ({"max_queue_bytes": 6}, True), ({"max_queue_bytes": 5}, False), ({"max_queue_bytes": 0}, False),
])  # (the call holds 6 bytes queued: its params [] and its id "m2")
def test_a_call_waits_for_the_full_blocked_worker_expected_free_sooner_if_the_queue_has_room(clock, bounds, waits):
    d, workers, codec, done = two_blocked(clock, **bounds)
    refused = d.submit(body(codec, req("m", [], "m2")), done.append, ResponseBudget(d.outgoing))
    sent = [len(w.channel.take()) for w in workers]
    assert (sent, d.queued_calls, refused is None or refused.remaining) == (([0, 0], 1, 1) if waits else ([1, 0], 0, 1))


def test_with_every_worker_overdue_a_blocked_one_with_a_place_goes_before_one_only_overdue(clock):
    d = Dispatcher(clock.loop, sync_prefetch=1, timeout=60.0, method_timeouts={"slow": 1.0, "short": 1.0},
                   cancel_grace=100.0)
    d.set_methods(["m", "short", "slow"], sync_methods=["slow"])
    workers = [add_worker(d, slot, concurrency=4) for slot in range(2)]
    codec = Codec()
    done: list[Exchange] = []
    d.submit(body(codec, req("slow", [], "s")), done.append, ResponseBudget(d.outgoing))
    d.submit(body(codec, req("short", [], "t")), done.append, ResponseBudget(d.outgoing))
    blocked = next(w for w in workers if w.blocked)
    other = workers[1 - workers.index(blocked)]
    assert (len(blocked.channel.take()), len(other.channel.take())) == (1, 1)
    clock.advance(1.05)  # (both past their deadlines, unanswered: both workers overdue)
    assert codes(done) == [ErrorCode.TIMED_OUT] * 2 and blocked.overdue and other.overdue
    assert [f[0] for w in (blocked, other) for f in w.channel.take()] == [wire.Kind.CANCEL] * 2
    d.submit(body(codec, req("m", [], "m")), done.append, ResponseBudget(d.outgoing))
    assert [f[0] for f in blocked.channel.take()] == [wire.Kind.CALL]  # (behind the sync call, in its prefetch)
    assert [f[0] for f in other.channel.take()] == []


def test_a_call_larger_than_a_workers_room_waits_for_one_with_none_and_goes_there(clock):
    r = Room(clock, workers=1)
    r.send("a", 100)
    r.send("x", 250, ResponseBudget(r.d.outgoing))  # (past the 200 of room: only a worker holding none takes it)
    assert r.sent() == [] and r.d.held_calls == 1
    r.answer("a")
    assert r.sent() == ["x"] and r.d.held_calls == 0 and r.workers[0].heavy == 250


def test_the_worker_kept_for_a_call_waiting_for_room_is_one_holding_no_large_params_rather_than_a_fresh_one(clock):
    r = Room(clock, concurrency=(1, 3))
    r.send("h", 150)  # (to worker 1)
    r.send("s", 10)  # (small: worker 0's one place)
    assert (r.where["h"], r.where["s"]) == (r.workers[1], r.workers[0])
    r.send("b", 100, ResponseBudget(r.d.outgoing))  # (no place on 0, no room on 1: it waits, 0 kept for it)
    r.send("n", 50, ResponseBudget(r.d.outgoing))  # (fits beside h: 1 is not kept, so it goes, after b)
    assert r.where.get("n") is r.workers[1] and "b" not in r.where and r.d.held_calls == 1


def test_a_call_waiting_for_room_beside_a_blocked_worker_has_none_kept_until_it_unblocks(clock):
    d = Dispatcher(clock.loop, max_worker_params_bytes=200, sync_prefetch=2)
    d._heavy_bytes = 50
    d.set_methods(["a", "slow"], sync_methods=["slow"])
    w = add_worker(d, 0, concurrency=10)
    codec = Codec()
    d.submit(body(codec, req("a", ["x" * 146], "fill")), lambda e: None)  # (150 bytes)
    d.submit(body(codec, req("slow", [], "slow")), lambda e: None)  # (blocked: takes no call to keep)
    fill, slow = (f[1] for f in w.channel.take())
    d.submit(body(codec, req("a", ["y" * 96], "big")), lambda e: None, ResponseBudget(d.outgoing))  # (no room)
    assert w.blocked and d.held_calls == 1 and w.channel.take() == []
    d.on_reply(w, wire.Kind.RESULT, slow, 5_000, b"0")
    assert not w.blocked and d.held_calls == 1 and w.channel.take() == []  # (still no room)
    d.on_reply(w, wire.Kind.RESULT, fill, 10, b"0")
    assert [first_params(f) for f in w.channel.take()] == [["y" * 96]] and d.held_calls == 0


@pytest.mark.parametrize(("beside", "queued"), [((), 1), (("m",), 0)], ids=["caught", "bystander"])
def test_calls_run_alone_take_at_most_one_connections_share_of_the_workers(clock, beside, queued):
    d, workers, codec, done = caught(clock, 0.5, beside)  # (half of 3 workers: 1)
    d.submit(body(codec, req("boom", [], "first")), done.append, ResponseBudget(d.outgoing))
    d.submit(body(codec, req("boom", [], "second")), done.append, ResponseBudget(d.outgoing))
    # (a caught method's second call waits; a bystander's goes as any, beside other calls)
    assert sum(len(w.channel.take()) for w in workers) == 2 - queued and d.queued_calls == queued
    assert sorted((w.blocked, w.limit) for w in workers) == [(False, 10), (False, 10), (True, 0)]


def test_a_queue_refilled_at_the_instant_a_methods_time_alone_ends_runs_it_as_any_from_then(clock):
    d, w, codec, done = one_worker(clock.loop, ["m", "boom"], 1)
    d.submit(body(codec, req("boom", [], 1)), done.append)
    w.channel.take()
    restarted(d, w)  # (boom: 4 s alone at most)
    d.submit(body(codec, req("m", [], "busy")), done.append)
    d.submit(body(codec, req("m", [], "queued")), done.append)
    [busy] = w.channel.take()
    clock.now += 4.0  # (its end, to the tick: before the timer, due TIMER_EARLY later)
    d.on_reply(w, wire.Kind.RESULT, busy[1], 10, b"0")  # (the queue is refilled: boom's time is over)
    assert d.isolated == {} and [json.loads(f[3]) for f in w.channel.take()] == [[]]


# -- method policy: a call denied to its caller (broker/policy.py) ----------------------

NOT_FOUND = {"code": -32601, "message": "Method not found"}


def test_a_call_denied_to_its_caller_is_answered_as_one_to_no_method_single_or_in_a_batch(clock):
    policy = Policy(by_caller={"ci": MethodRule(deny=("b",))}, callers=["ci"])
    d, w, codec, done = one_worker(clock.loop, ["a", "b"], policy=policy)
    budget = ResponseBudget(d.outgoing, policy.denied["ci"])
    single = d.submit(body(codec, req("b", [], 1)), done.append, budget)
    absent = d.submit(body(codec, req("z", [], 1)), done.append, budget)
    assert single is not None and absent is not None and single.answers == absent.answers
    assert json.loads(single.body()) == {"jsonrpc": "2.0", "id": 1, "error": NOT_FOUND}
    batch = d.submit(body(codec, [req("a", [], 1), req("b", [], 2), req("a", [], 3), {"jsonrpc": "2.0",
                                                                                       "method": "b"}]),
                     done.append, budget)
    assert batch is not None
    assert [json.loads(a) if a else None for a in batch.answers] == [
        None, {"jsonrpc": "2.0", "id": 2, "error": NOT_FOUND}, None]  # (the notification: not run, no answer)
    frames = w.channel.take()
    assert sum(f[2] if f[0] == 4 else 1 for f in frames) == 2  # (the two calls of "a" only went to the worker)
    other = ResponseBudget(d.outgoing, policy.denied[""])  # (another caller: "b" is served)
    exchange: Exchange | None = d.submit(body(codec, req("b", [], 9)), done.append, other)
    assert exchange is not None and exchange.answers == [None] and w.channel.take()


# -- rate limits: calls past their caller's bucket (broker/ratelimit.py) -----------------


def test_calls_past_their_callers_rate_are_answered_rate_limited_each_batch_element_on_its_own(clock, monkeypatch):
    monkeypatch.setattr("broker.ratelimit._clock", lambda: 50.0)  # (no refill)
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["a"], metrics=metrics)
    budget = ResponseBudget(d.outgoing)
    budget.bucket = Bucket(Rate(0.5, 3))
    batch = d.submit(body(codec, [req("a", [], 1), req("nope", [], 2), {"jsonrpc": "2.0", "method": "a"},
                                  req("a", [], 3), req("a", [], 4), {"jsonrpc": "2.0", "method": "a"},
                                  {"jsonrpc": "2.0", "method": "a"}]),
                     done.append, budget)
    assert batch is not None and batch.status == 200 and batch.retry_after == 0.0  # (a batch: 200, no Retry-After)
    limited = {"code": -32005, "message": "Rate limited", "data": {"retry_after_seconds": 2.0}}
    assert [json.loads(a) if a else None for a in batch.answers] == [
        None, {"jsonrpc": "2.0", "id": 2, "error": NOT_FOUND},  # (an unknown method's call takes one too)
        {"jsonrpc": "2.0", "id": 3, "error": limited}, {"jsonrpc": "2.0", "id": 4, "error": limited},
    ]
    assert d.notifications_dropped == {ErrorCode.RATE_LIMITED: 2} and budget.bucket.refused_total == 4
    assert metrics.outcomes[metrics.other] == {ErrorCode.METHOD_NOT_FOUND: 1}
    assert metrics.outcomes[0] == {ErrorCode.RATE_LIMITED: 2}  # (under their method: "a", index 0)
    assert metrics.latency[metrics.other].sum_us == 0 and metrics.latency[0].sum_us == 0  # (answered at once)
    assert budget.held == sum(len(a) for a in batch.answers if a)
    single = d.submit(body(codec, req("a", [], "s")), done.append, budget)
    assert single is not None and single.status == 429 and single.remaining == 0
    assert single.retry_after == 2.0  # (its 429's Retry-After: the wait its error object gives)
    assert json.loads(single.body()) == {"jsonrpc": "2.0", "id": "s", "error": limited}
    sent = w.channel.take()
    assert len(sent) == 2  # (the first call, and the notification: the rest never went)


def test_a_rate_limited_call_counts_under_its_method_unless_unknown_or_denied_to_its_caller(clock, monkeypatch):
    """New user, round 107: every rate-limited call counted under method="other"; now under
    its method, but "other" still for one that does not exist or its caller may not call
    (the policy shows nothing of what exists)."""
    monkeypatch.setattr("broker.ratelimit._clock", lambda: 50.0)  # (no refill)
    metrics = CallMetrics()
    d, _w, codec, done = one_worker(clock.loop, ["a", "b"], metrics=metrics, policy=Policy(MethodRule(deny=("b",))))
    budget = ResponseBudget(d.outgoing)
    budget.denied = d.policy.denied[""]
    budget.bucket = Bucket(Rate(0.5, 1))
    batch = d.submit(body(codec, [req("a", [], 1), req("b", [], 2), req("nope", [], 3), req("a", [], 4)]),
                     done.append, budget)
    assert batch is not None and budget.bucket.refused_total == 3
    assert metrics.outcomes[metrics.other] == {ErrorCode.RATE_LIMITED: 2}
    assert metrics.outcomes[0] == {ErrorCode.RATE_LIMITED: 1} and metrics.outcomes[1] == {}


def test_a_global_policy_holds_for_a_body_submitted_without_a_connections_budget(clock, caplog):
    """`submit` with no budget makes one: under the global lists (`Policy.denied[""]`). And
    each method table's patterns that match no method are warned about (`set_methods`)."""
    policy = Policy(MethodRule(deny=("b", "slep")))
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        d, _w, codec, done = one_worker(clock.loop, ["a", "b", "sleep"], policy=policy)
    assert [r.getMessage() for r in caplog.records] == [
        "allow_methods/deny_methods: 'slep' matches no method the workers registered (did you mean 'sleep'?)"]
    exchange = d.submit(body(codec, req("b", [], 1)), done.append)
    assert exchange is not None and json.loads(exchange.body())["error"] == NOT_FOUND
