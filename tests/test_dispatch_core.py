"""The dispatcher core in memory, test by test (issue 10 items 2 and 14): what
`make mutate` found the other in-memory tests (test_dispatch.py, test_dispatch_states.py)
did not hold. Each test holds an exact value: an error code, a count, an order, a gauge.

As in test_dispatch.py: a real `Dispatcher` and real `pool.Worker` records whose channels
record the frames sent to them; replies go back through `Dispatcher.on_reply`; the loop is
never run, and its clock is injected where time matters.
"""

from __future__ import annotations

import asyncio
import json
import struct
import types
import typing

import pytest
from test_dispatch import _entries_from, add_worker, body, make_call, req, run

from broker import chunk, wire
from broker.answers import Exchange, ResponseBudget
from broker.calls import NO_ID, Call, Route
from broker.deadlines import DeadlineWheel
from broker.dispatch import CallState, Dispatcher
from broker.jsonrpc import Codec, ErrorCode, Request
from broker.membership import _address, _clients
from broker.metrics import OK, CallMetrics
from broker.wire import CALL_ENTRY, ERROR, NOTIFY_FLAG, REPLY_ENTRY, RESULT


@pytest.fixture
def loop() -> typing.Iterator[asyncio.AbstractEventLoop]:
    """An event loop never run: what a dispatcher needs that no test here awaits."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def codes(done: list[Exchange]) -> list[object]:
    """The error codes (None: a result) of the single-call answers made, in order."""
    return [json.loads(e.body()).get("error", {}).get("code") for e in done]

# -- broker/chunk.py: a batch chunk and its answers, byte for byte ---------------------


def test_a_chunk_is_its_entries_in_order_with_their_slots_ids_and_methods():
    entries = [
        (3, Request("2.0", "a", params=b"[1]", id=b"7"), Route(5, 1.0)),
        (-1, Request("2.0", "b", params=b"{}", id=None), Route(260, 1.0)),  # a notification
    ]
    payload, slots, ids, methods = chunk.encode_requests(entries)
    # (a call's id travels with it, for its CHUNK_RESULTS; a notification has none)
    assert payload == CALL_ENTRY.pack(5, 0, 1, 3) + b"7[1]" + CALL_ENTRY.pack(260, NOTIFY_FLAG, 0, 2) + b"{}"
    assert (slots, ids, methods) == ([3, -1], [b"7", None], [5, 260])
    first = chunk.read_call(payload, 0)
    assert first == (5, False, CALL_ENTRY.size + 1, CALL_ENTRY.size + 4)
    assert chunk.read_call(payload, first[3]) == (260, True, first[3] + CALL_ENTRY.size, len(payload))
    with pytest.raises(struct.error):
        chunk.read_call(payload, len(payload))


def test_a_reloads_method_table_rewrites_each_calls_method_index_and_keeps_the_rest():
    payload = CALL_ENTRY.pack(1, 0, 1, 3) + b"1[1]" + CALL_ENTRY.pack(2, NOTIFY_FLAG, 0, 0) + \
        CALL_ENTRY.pack(3, 0, 3, 2) + b'"x"{}'
    rewritten = chunk.with_methods(payload, [7, 0, 65535])
    assert rewritten == CALL_ENTRY.pack(7, 0, 1, 3) + b"1[1]" + CALL_ENTRY.pack(0, NOTIFY_FLAG, 0, 0) + \
        CALL_ENTRY.pack(65535, 0, 3, 2) + b'"x"{}'
    assert type(rewritten) is bytes and payload[:2] == b"\x00\x01"  # a copy: the payload is left alone


def test_a_chunks_answers_are_read_back_as_written_and_a_truncated_one_is_not():
    unsent = bytearray()
    chunk.add_answer(unsent, 2, RESULT, b'"x"')
    chunk.add_answer(unsent, 0, ERROR, b'{"code":1}')
    chunk.add_answer(unsent, 1, RESULT, b"")
    assert bytes(unsent) == REPLY_ENTRY.pack(2, RESULT, 3) + b'"x"' + REPLY_ENTRY.pack(0, ERROR, 10) + \
        b'{"code":1}' + REPLY_ENTRY.pack(1, RESULT, 0)
    size = REPLY_ENTRY.size
    expected = [(2, RESULT, size, size + 3), (0, ERROR, 2 * size + 3, 2 * size + 13),
                (1, RESULT, 3 * size + 13, 3 * size + 13)]
    assert list(chunk.answers(bytes(unsent))) == expected
    assert chunk.count_answers(bytes(unsent)) == 3
    cut = bytes(unsent) + REPLY_ENTRY.pack(3, RESULT, 1)[:-1]  # a last entry's header not all there
    assert list(chunk.answers(cut)) == expected and chunk.count_answers(cut) == 3
    assert list(chunk.answers(b"")) == [] and chunk.count_answers(b"") == 0


@pytest.mark.parametrize(("least", "total"), [(1, 3 + 5), (3, 3 + 5), (4, 5), (5, 5), (6, 0)])
def test_a_chunks_large_params_are_those_of_at_least_the_bound_added_up(least, total):
    payload = CALL_ENTRY.pack(0, 0, 4, 3) + b"1234[1]" + CALL_ENTRY.pack(0, 0, 1, 0) + b"2" + \
        CALL_ENTRY.pack(0, 0, 9, 5) + b'"a\\"b[1]"[1,2]'  # (ids of their own lengths: not params)
    assert chunk.large_params(payload, least) == total


# -- the dispatcher: what only a front-end, the pool or a timer calls -------------------


def test_a_worker_answers_within_the_longest_deadline_and_cancel_grace(loop):
    d = Dispatcher(loop, timeout=5.0, method_timeouts={"a": 7.5, "b": 3.0}, cancel_grace=2.0)
    assert d.answered_within() == 9.5
    assert Dispatcher(loop, timeout=8.0, cancel_grace=1.0).answered_within() == 9.0


def test_a_body_refused_unread_is_counted_under_other_with_its_code(loop):
    metrics = CallMetrics()
    d = Dispatcher(loop, metrics=metrics)
    d.set_methods(["m"])
    d.count_refused_body()
    d.count_refused_body(ErrorCode.OVERLOADED)
    d.count_refused_body(ErrorCode.OVERLOADED)
    assert metrics.outcomes[metrics.other] == {ErrorCode.INVALID_REQUEST: 1, ErrorCode.OVERLOADED: 2}
    assert metrics.outcomes[0] == {}
    Dispatcher(loop).count_refused_body()  # (metrics off: nothing to count, no error)


def test_a_failed_start_with_no_worker_ready_answers_no_worker_until_one_is_ready():
    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), timeout=30.0)
        d.set_methods(["m"])
        codec = Codec()
        done: list[Exchange] = []
        d.submit(body(codec, req("m", [], 1)), done.append)
        assert d.queued_calls == 1 and done == []  # no worker yet: it waits
        d.start_failed()
        assert codes(done) == [ErrorCode.NO_WORKER] and d.queued_calls == 0
        refused = d.submit(body(codec, req("m", [], 2)), done.append)  # a new call: at once
        assert refused is not None and refused.remaining == 0
        assert json.loads(refused.body())["error"]["code"] == ErrorCode.NO_WORKER
        w = add_worker(d, 0, concurrency=1)
        d.submit(body(codec, req("m", [], 3)), done.append)
        d.submit(body(codec, req("m", [], 4)), done.append)
        assert [f[0] for f in w.channel.take()] == [wire.Kind.CALL] and d.queued_calls == 1
        d.start_failed()  # another slot's start failed, this worker ready: nothing changes
        assert d.queued_calls == 1 and codes(done) == [ErrorCode.NO_WORKER]

    run(main)


def test_a_request_held_back_before_the_drain_is_still_queued_during_it_where_a_new_one_is_refused():
    async def main() -> None:
        d = Dispatcher(asyncio.get_running_loop(), timeout=30.0)
        d.set_methods(["m"])
        w = add_worker(d, 0, concurrency=1)
        codec = Codec()
        done: list[Exchange] = []
        d.submit_held(body(codec, req("m", [], 0)), done.append)  # not draining: a plain submit
        assert d.accepting and [f[1] for f in w.channel.take()] == [1]
        drain = asyncio.ensure_future(d.drain(60.0))
        await asyncio.sleep(0)
        assert not d.accepting
        refused = d.submit(body(codec, req("m", [], 1)), done.append)  # the worker is busy: not queued
        assert refused is not None and refused.remaining == 0
        assert json.loads(refused.body())["error"]["code"] == ErrorCode.SHUTTING_DOWN
        held = d.submit_held(body(codec, req("m", [], 2)), done.append)
        assert held is not None and held.remaining == 1 and d.queued_calls == 1 and not d.accepting
        d.on_reply(w, wire.Kind.RESULT, 1, 0, b"10")
        assert [(f[0], f[1]) for f in w.channel.take()] == [(wire.Kind.CALL, 3)]
        d.on_reply(w, wire.Kind.RESULT, 3, 0, b"12")
        await asyncio.wait_for(drain, 5.0)
        assert [json.loads(e.body())["result"] for e in done] == [10, 12]

    run(main)


class Clock:
    """Time injected: an asyncio loop (never run on its own) and the broker's perf_counter
    (`_clock` of the dispatcher's modules) both read `now`; `advance` moves it and runs the
    loop's timers then due (the deadline wheel's, `call_later`'s)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        self.loop = asyncio.new_event_loop()
        self.loop.time = lambda: self.now  # type: ignore[method-assign]
        for module in ("dispatch", "membership", "queueing", "replies", "routing"):
            monkeypatch.setattr(f"broker.{module}._clock", lambda: self.now)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.loop.run_until_complete(asyncio.sleep(0))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> typing.Iterator[Clock]:
    c = Clock(monkeypatch)
    yield c
    c.loop.close()


def one_worker(
    loop: asyncio.AbstractEventLoop, methods: list[str], concurrency: int = 100, **settings: typing.Any
) -> tuple[Dispatcher, typing.Any, Codec, list[Exchange]]:
    """A dispatcher (`settings`) serving `methods` on one ready worker of `concurrency` places,
    a codec, and the list the answers go to."""
    d = Dispatcher(loop, **settings)
    d.set_methods(methods)
    return d, add_worker(d, 0, concurrency=concurrency), Codec(), []


class Process:
    """A worker's process as the dispatcher sees it: it can be killed (counted)."""

    def __init__(self) -> None:
        self.kills = 0

    def kill(self) -> None:
        self.kills += 1


def hung_setup(clock: Clock, concurrency: int = 4) -> tuple[Dispatcher, typing.Any, Codec, list[Exchange]]:
    """A dispatcher (deadlines: "m" 10 s, async; "short" 5 s and "sync" 30 s, sync methods;
    cancel_grace 2 s; a prefetch of 1) with one ready worker whose process can be killed."""
    d = Dispatcher(clock.loop, timeout=10.0, method_timeouts={"sync": 30.0, "short": 5.0}, cancel_grace=2.0,
                   sync_prefetch=1)
    d.set_methods(["m", "short", "sync"], sync_methods=["short", "sync"])
    w = add_worker(d, 0, concurrency=concurrency)
    w.pid = 4242
    w.process = Process()
    return d, w, Codec(), []


def test_a_worker_that_answers_no_cancel_within_cancel_grace_is_killed_once_as_hung(clock, caplog):
    d, w, codec, done = hung_setup(clock)
    d.submit(body(codec, req("m", [], 1)), done.append)
    [(_kind, call_id, _aux, _params)] = w.channel.take()
    clock.advance(10.05)  # its deadline: answered -32001, and told to cancel
    assert codes(done) == [ErrorCode.TIMED_OUT]
    assert w.channel.take() == [(wire.Kind.CANCEL, call_id, 0, b"")]
    clock.advance(1.9)
    assert w.process.kills == 0 and w.kill_reason == ""
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        clock.advance(0.2)  # cancel_grace past: hung
    assert w.process.kills == 1 and w.kill_reason == "hung: no answer 2.0 s after a cancelled call"
    assert [r.getMessage() for r in caplog.records] == [
        f"worker 0 (pid 4242) has not answered call {call_id} (m) 2.0 s after its deadline: killing it as hung"
    ]


def test_a_hung_call_of_a_method_a_reload_removed_is_not_named_a_batch_chunk(clock, caplog):
    """Mutation testing (make mutate) found it: a single call whose method a reload removed
    (its index past the names) was logged "(a batch chunk)"."""
    d, w, codec, done = hung_setup(clock)
    d.submit(body(codec, req("m", [], 1)), done.append)
    [(_kind, call_id, _aux, _params)] = w.channel.take()
    d.set_methods(["short", "sync"], sync_methods=["short", "sync"])  # a reload without "m"
    clock.advance(10.05)
    assert codes(done) == [ErrorCode.TIMED_OUT]
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        clock.advance(2.1)
    assert w.process.kills == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"worker 0 (pid 4242) has not answered call {call_id} (of a method the reload removed) 2.0 s after its"
        " deadline: killing it as hung"
    ]


def test_a_hung_worker_is_killed_once_however_many_calls_it_holds_and_an_answered_one_never(clock):
    d, w, codec, done = hung_setup(clock)
    for i in range(3):
        d.submit(body(codec, req("m", [], i)), done.append)
    ids = [f[1] for f in w.channel.take()]
    clock.advance(10.05)
    d.on_reply(w, wire.Kind.ERROR, ids[0], wire.NOT_RUN, wire.CANCEL_ACK)  # one acknowledged: no longer held
    clock.advance(2.1)
    assert w.process.kills == 1 and w.kill_reason.startswith("hung")
    clock.advance(10.0)
    assert w.process.kills == 1
    quiet = Dispatcher(clock.loop, timeout=10.0, cancel_grace=2.0)
    quiet.set_methods(["m"])
    v = add_worker(quiet, 0, concurrency=4)
    v.process = Process()
    quiet.submit(body(codec, req("m", [], 0)), done.append)
    [frame] = v.channel.take()
    clock.advance(10.05)
    quiet.on_reply(v, wire.Kind.ERROR, frame[1], wire.NOT_RUN, wire.CANCEL_ACK)
    clock.advance(5.0)
    assert v.process.kills == 0 and v.kill_reason == ""


def learn_fast(d: Dispatcher, w: typing.Any, codec: Codec) -> None:
    """"short" answers in 100 µs: a sync method measured fast (`Route.sync` -1), sent beside others."""
    d.submit(body(codec, req("short", [], "learn")), lambda e: None)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, frame[1], 100, b"0")


@pytest.mark.parametrize(("first", "then"), [("sync", "m"), ("m", "sync"), ("sync", "short")])
def test_a_cancelled_call_behind_a_sync_call_within_its_deadline_is_killed_only_past_it(clock, caplog, first, then):
    """Hostile testing, rounds 18 and 86: a call cancelled on a worker busy in a sync call that
    came first waits for it (an async call: for any sync call there, whose loop it holds); the
    worker is hung only once that call's deadline and cancel_grace pass too."""
    d, w, codec, done = hung_setup(clock)
    learn_fast(d, w, codec)
    d.submit(body(codec, req(first, [], first)), done.append)
    clock.advance(1.0)
    d.submit(body(codec, req(then, [], then)), done.append)
    (busy_id, late_id) = (2, 3) if first == "sync" else (3, 2)
    assert [f[1] for f in w.channel.take()] == [2, 3]
    late, busy = d._pending[late_id], d._pending[busy_id]
    clock.advance(late.arrival + late.timeout - clock.now + 0.05)  # the cancelled call's deadline
    assert codes(done) == [ErrorCode.TIMED_OUT]
    clock.advance(2.1)  # ... and its cancel_grace: the sync call is within its deadline still
    assert w.process.kills == 0
    clock.advance(busy.arrival + busy.timeout + 2.0 - clock.now - 0.05)  # just before its own and cancel_grace
    assert w.process.kills == 0
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        clock.advance(0.1)
    assert w.process.kills == 1
    name = "short" if "short" in (first, then) else "m"
    assert f"has not answered call {late_id} ({name}) 2.0 s after" in caplog.text


def test_a_cancelled_sync_call_waits_for_no_sync_call_that_came_after_it(clock):
    d, w, codec, done = hung_setup(clock)
    learn_fast(d, w, codec)
    d.submit(body(codec, req("short", [], "s")), done.append)  # deadline in 5 s
    clock.advance(1.0)
    d.submit(body(codec, req("sync", [], "l")), done.append)  # deadline in 30 s, came after: behind it
    assert [f[1] for f in w.channel.take()] == [2, 3]
    clock.advance(4.05)
    assert codes(done) == [ErrorCode.TIMED_OUT]
    clock.advance(2.0)
    assert w.process.kills == 1 and w.kill_reason.startswith("hung")


def test_answers_for_a_gone_connection_are_counted_as_the_worker_answered_and_kept_empty(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["a", "b"], 4, metrics=metrics)
    gone = ResponseBudget(d.outgoing)
    for method, id_ in (("a", 1), ("b", 2)):
        d.submit(body(codec, req(method, [], id_)), done.append, gone)
    first, second = w.channel.take()
    gone.lost()  # its connection went (its calls still run: not abandoned)
    clock.advance(0.25)
    d.on_reply(w, wire.Kind.RESULT, first[1], 1000, b'"big result"')
    d.on_reply(w, wire.Kind.ERROR, second[1], 50, b'{"code":-32602,"message":"no"}')
    assert [e.answers for e in done] == [[b""], [b""]] and gone.held == 0 and d.outgoing.held == 0
    assert metrics.outcomes[0] == {OK: 1}
    assert metrics.outcomes[1] == {ErrorCode.INVALID_PARAMS: 1}
    assert metrics.latency[0].sum_us == 250_000 and metrics.latency[1].sum_us == 250_000
    assert metrics.service[0].sum_us == 1000 and d.in_flight_calls == 0


def test_a_request_held_back_keeps_its_connections_budget_and_after_the_drain_is_refused(clock):
    d = Dispatcher(clock.loop, timeout=30.0)
    d.set_methods(["m"])
    w = add_worker(d, 0, concurrency=1)
    codec = Codec()
    budget = ResponseBudget(d.outgoing)
    done: list[Exchange] = []
    first = d.submit_held(body(codec, req("m", [], 0)), done.append, budget)
    assert first is not None and first.budget is budget
    drain = clock.loop.create_task(d.drain(60.0))
    clock.advance(0.0)
    held = d.submit_held(body(codec, req("m", [], 1)), done.append, budget)
    assert held is not None and held.budget is budget and budget.queued == 1 and d.accepting is False
    d.on_reply(w, wire.Kind.RESULT, w.channel.take()[0][1], 0, b"0")
    d.on_reply(w, wire.Kind.RESULT, w.channel.take()[0][1], 0, b"1")
    clock.advance(0.0)
    assert drain.done() and d.accepting is False
    late = d.submit_held(body(codec, req("m", [], 2)), done.append, budget)  # the drain is over
    assert late is not None and late.remaining == 0 and not w.channel.take()
    assert json.loads(late.body())["error"] == {"code": ErrorCode.SHUTTING_DOWN, "message": "Shutting down",
                                                "data": "grace period ended"}


def test_a_body_refused_unread_is_counted_with_no_latency(loop):
    metrics = CallMetrics()
    d = Dispatcher(loop, metrics=metrics)
    d.set_methods(["m"])
    d.count_refused_body()
    assert metrics.latency[metrics.other].sum_us == 0 and sum(metrics.latency[metrics.other].counts) == 1


def test_expired_shells_behind_a_live_head_are_compacted_and_the_live_calls_go_in_order(clock):
    d = Dispatcher(clock.loop, timeout=60.0, method_timeouts={"eat": 1.0})
    d.set_methods(["sleep", "eat"])
    w = add_worker(d, 0, concurrency=1)
    codec = Codec()
    budget = ResponseBudget(d.outgoing)  # one connection: the shells stay behind its head
    done: list[Exchange] = []
    for method, id_ in [("sleep", "busy"), ("sleep", "head"), *(("eat", i) for i in range(10)), ("sleep", "tail")]:
        d.submit(body(codec, req(method, [], id_)), done.append, budget)
    [busy] = w.channel.take()
    assert len(d._queue) == 12 and d.queued_calls == 12
    clock.advance(1.05)
    assert codes(done) == [ErrorCode.TIMED_OUT] * 10
    assert len(d._queue) == 2 and d._expired_queued == 0 and d.queued_calls == 2  # compacted: head and tail
    sent = [busy]
    for _ in range(3):
        d.on_reply(w, wire.Kind.RESULT, sent[-1][1], 0, b"0")
        sent += w.channel.take()
    assert [json.loads(e.body())["id"] for e in done[10:]] == ["busy", "head", "tail"]
    assert len(d._queue) == 0 and len(sent) == 3


def test_a_chunk_answered_whole_with_an_error_answers_each_of_its_calls_with_it(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"])
    d.submit(body(codec, [req("m", [], i) for i in range(4)]), done.append)
    [frame] = w.channel.take()
    assert frame[0] == wire.Kind.CHUNK and frame[2] == 4
    d.on_reply(w, wire.Kind.ERROR, frame[1], 7, b'{"code":-32603,"message":"boom"}')
    [exchange] = done
    assert [json.loads(a) for a in exchange.answers] == [
        {"jsonrpc": "2.0", "id": i, "error": {"code": -32603, "message": "boom"}} for i in range(4)
    ]
    assert d.in_flight_calls == 0 and w.outstanding == 0


def _bad_returns(
    d: Dispatcher, w: typing.Any, other: typing.Any, single: int, chunk_id: int, size: int
) -> list[tuple[int, int]]:
    """RETURNs of calls a worker does not hold (the chunk's `size` calls from past its last
    on, or from before its first): (call id, place) each, as sent."""
    returns = [(999, 0), (single, 1), (chunk_id, size), (chunk_id, -1)]
    for call_id, place in returns:
        d.on_reply(w, wire.Kind.RETURN, call_id, place, b"")
    d.on_reply(other, wire.Kind.RETURN, single, 0, b"")
    return [*returns, (single, 0)]


def test_a_worker_giving_back_calls_it_does_not_hold_is_logged_and_changes_nothing(clock, caplog):
    d = Dispatcher(clock.loop)
    d.set_methods(["m"])
    w = add_worker(d, 0, concurrency=100)
    other = add_worker(d, 1, concurrency=1)
    codec = Codec()
    d.submit(body(codec, req("m", [], "s")), lambda e: None)
    d.submit(body(codec, [req("m", [], i) for i in range(3)]), lambda e: None)
    frames = w.channel.take() + other.channel.take()
    single = next(f[1] for f in frames if f[0] == wire.Kind.CALL)
    chunk_id = next(f[1] for f in frames if f[0] == wire.Kind.CHUNK)
    holder = w if chunk_id in w.channel.flows else other
    before = (d.in_flight_calls, w.outstanding, other.outstanding, d.returned_total)
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        size = next(f[2] for f in frames if f[0] == wire.Kind.CHUNK)
        bad = _bad_returns(d, holder, other if holder is w else w, single, chunk_id, size)
    assert (d.in_flight_calls, w.outstanding, other.outstanding, d.returned_total) == before
    assert d.queued_calls == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"worker {worker} gave back call {call_id} from place {place}, which it does not hold"
        for worker, (call_id, place) in zip([holder] * 4 + [other if holder is w else w], bad)
    ]


@pytest.mark.parametrize("past", ["max_response_bytes", "max_outgoing_bytes"])
def test_answers_too_large_are_refused_counted_and_logged_at_the_first_and_every_thousandth(clock, caplog, past):
    if past == "max_response_bytes":
        d = Dispatcher(clock.loop, max_response_bytes=100)
        data = "responses owed on this connection exceed max_response_bytes 100"
        logged = "responses owed on a connection exceed max_response_bytes 100"
    else:
        d = Dispatcher(clock.loop, max_outgoing_bytes=100)
        data = logged = "responses owed on all connections exceed max_outgoing_bytes 100"
    d.set_methods(["m"])
    w = add_worker(d, 0, concurrency=1 << 20)
    codec = Codec()
    done: list[Exchange] = []
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        for i in range(2000):
            d.submit(body(codec, req("m", [], i)), done.append, ResponseBudget(d.outgoing))
            [(_kind, call_id, _aux, _params)] = w.channel.take()
            d.on_reply(w, wire.Kind.RESULT, call_id, 0, b'"%s"' % (b"x" * 200))
            d.outgoing.held = 0  # (each answer written at once)
    assert [json.loads(e.body()) for e in done[:2]] == [
        {"jsonrpc": "2.0", "id": i, "error": {"code": -32603, "message": "Internal error", "data": data}}
        for i in range(2)
    ]
    assert len(done) == 2000 and all(json.loads(e.body())["error"]["data"] == data for e in done)
    assert (d.oversize_total, d.outgoing.refused_total) == ((2000, 0) if past == "max_response_bytes" else (0, 2000))
    assert [r.getMessage() for r in caplog.records] == [
        f"answers refused: {logged} ({n} so far)" for n in (1, 1000, 2000)
    ]


def test_a_gone_connections_call_that_ends_with_a_broker_error_keeps_an_empty_answer(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], 4, timeout=5.0, max_response_bytes=100)
    gone = ResponseBudget(d.outgoing)
    d.submit(body(codec, req("m", [], 1)), done.append, gone)
    d.submit(body(codec, req("m", [], 2)), done.append, gone)
    first, _second = w.channel.take()
    gone.lost()
    d.on_reply(w, wire.Kind.ERROR, first[1], 0, b'{"code":1,"message":"%s"}' % (b"x" * 200))
    clock.advance(5.05)  # the other's deadline
    assert [e.answers for e in done] == [[b""], [b""]]
    assert (d.oversize_total, d.outgoing.refused_total, d.outgoing.held) == (0, 0, 0)


def test_a_reload_translates_the_method_index_of_every_call_routed_and_not_answered(clock):
    """`set_methods` with a new table: calls in flight are counted under their method's new
    index (and teach no estimate: "stale"); a queued call goes with its new index, a queued
    chunk's entries too, and a sync method that kept its estimate keeps its calls RETURNABLE."""
    metrics = CallMetrics()
    d = Dispatcher(clock.loop, metrics=metrics, connection_share=1.0)
    d.set_methods(["a", "b", "s"], sync_methods=["s"])
    w = add_worker(d, 0, concurrency=4)
    codec = Codec()
    d.submit(body(codec, req("s", [], "learn")), lambda e: None)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, frame[1], 100, b"0")  # "s" is fast: sent RETURNABLE
    for method in ("a", "b", "s", "a"):
        d.submit(body(codec, req(method, [], method)), lambda e: None)
    in_flight = w.channel.take()
    assert [f[2] for f in in_flight] == [0, 1, 2, 0]
    queued = ResponseBudget(d.outgoing)
    done: list[Exchange] = []
    d.submit(body(codec, req("s", [], "q")), done.append, queued)
    d.submit(body(codec, [req("a", [], 1), req("b", [], 2), req("s", [], 3)]), done.append, queued)
    assert d.queued_calls == 4 and not w.channel.take()  # (the batch: one chunk, of 3)
    d.set_methods(["s", "b", "new", "a"], sync_methods=["s"])
    d.on_reply(w, wire.Kind.RESULT, in_flight[2][1], 5_000_000, b"0")  # 5 s: stale, it teaches nothing
    d.on_reply(w, wire.Kind.RESULT, in_flight[0][1], 10, b"0")
    d.on_reply(w, wire.Kind.ERROR, in_flight[1][1], 10, b'{"code":-32602,"message":"no"}')
    d.on_reply(w, wire.Kind.RESULT, in_flight[3][1], 10, b"0")
    assert metrics.outcomes[3] == {OK: 2} and metrics.outcomes[1] == {ErrorCode.INVALID_PARAMS: 1}
    assert metrics.outcomes[0] == {OK: 1 + 1}  # ("learn", under its old index 2 then, and "s" now)
    sent = w.channel.take()
    assert [(f[0], f[2]) for f in sent] == [(wire.Kind.CALL, 0), (wire.Kind.CHUNK, 3)]
    assert [w.channel.flows[f[1]] & wire.RETURNABLE for f in sent] == [wire.RETURNABLE, wire.RETURNABLE]
    entries, pos, methods = sent[1][3], 0, []
    while pos < len(entries):
        method, _notification, _start, pos = chunk.read_call(entries, pos)
        methods.append(method)
    assert methods == [3, 1, 0]


def chunk_answers(*answers: tuple[int, int, bytes]) -> bytes:
    """A CHUNK_PART or CHUNK_REPLY payload: (place, kind, body) each, in order."""
    unsent = bytearray()
    for place, kind, body_ in answers:
        chunk.add_answer(unsent, place, kind, body_)
    return bytes(unsent)


def test_a_chunks_answers_in_parts_fill_their_slots_and_count_each_once_in_the_metrics(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["a", "b"], metrics=metrics, max_response_bytes=12_000)
    d.submit(body(codec, [req("a", [], 0), req("b", [], 1), req("a", [], 2), req("a", [], 3), req("b", [], 4)]),
             done.append)
    [frame] = w.channel.take()
    assert frame[0] == wire.Kind.CHUNK and frame[2] == 5
    clock.advance(0.5)
    large, larger = b'"%s"' % (b"x" * 5000), b'"%s"' % (b"y" * 7000)
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers((0, RESULT, b'"r0"')))
    assert not done and d.in_flight_calls == 4
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (1, ERROR, b'{"code":-32602,"message":"no"}'), (2, RESULT, b"2"), (3, RESULT, large), (4, RESULT, larger),
    ))
    [exchange] = done
    assert [json.loads(a) for a in exchange.answers] == [
        {"jsonrpc": "2.0", "id": 0, "result": "r0"},
        {"jsonrpc": "2.0", "id": 1, "error": {"code": -32602, "message": "no"}},
        {"jsonrpc": "2.0", "id": 2, "result": 2},
        {"jsonrpc": "2.0", "id": 3, "result": "x" * 5000},
        {"jsonrpc": "2.0", "id": 4, "error": {"code": -32603, "message": "Internal error",
                                              "data": "responses owed on this connection exceed max_response_bytes 12000"}},
    ]
    assert exchange.budget.held == sum(map(len, exchange.answers))  # type: ignore[arg-type]
    assert metrics.outcomes[0] == {OK: 3}
    assert metrics.outcomes[1] == {ErrorCode.INVALID_PARAMS: 1, ErrorCode.INTERNAL_ERROR: 1}
    assert metrics.latency[0].sum_us == 3 * 500_000 and metrics.latency[1].sum_us == 2 * 500_000
    assert d.in_flight_calls == 0 and w.outstanding == 0 and d.oversize_total == 1


def test_a_chunk_answered_all_results_at_once_is_counted_by_method(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["a", "b"], metrics=metrics)
    d.submit(body(codec, [req(m, [], i) for i, m in enumerate("abaab")]), done.append)
    [frame] = w.channel.take()
    clock.advance(0.25)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(*((i, RESULT, b"%d" % i) for i in range(5))))
    assert [json.loads(a)["result"] for a in done[0].answers] == [0, 1, 2, 3, 4]  # type: ignore[arg-type]
    assert (metrics.outcomes[0], metrics.outcomes[1]) == ({OK: 3}, {OK: 2})
    assert (metrics.latency[0].sum_us, metrics.latency[1].sum_us) == (3 * 250_000, 2 * 250_000)


def test_a_gone_connections_chunk_is_answered_with_nothing_and_counted(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["a"], metrics=metrics, max_outgoing_bytes=50)
    gone = ResponseBudget(d.outgoing)
    d.submit(body(codec, [req("a", [], i) for i in range(3)]), done.append, gone)
    [frame] = w.channel.take()
    gone.lost()
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, RESULT, b'"%s"' % (b"z" * 100)), (1, ERROR, b'{"code":-32602,"message":"no"}'), (2, RESULT, b"2")))
    assert done[0].answers == [b"", b"", b""] and d.outgoing.held == 0 and d.outgoing.refused_total == 0
    assert metrics.outcomes[0] == {OK: 2, ErrorCode.INVALID_PARAMS: 1}


def test_a_chunks_answers_past_max_outgoing_bytes_are_refused_from_the_first_that_does_not_fit(clock):
    d, w, codec, done = one_worker(clock.loop, ["a"], max_outgoing_bytes=100)
    d.submit(body(codec, [req("a", [], i) for i in range(3)]), done.append)
    [frame] = w.channel.take()
    d.outgoing.held = 40  # (another connection's answers owed)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, RESULT, b"0"), (1, RESULT, b'"%s"' % (b"z" * 30)), (2, RESULT, b"2")))
    answers = [json.loads(a) for a in done[0].answers]  # type: ignore[arg-type]
    assert answers[0] == {"jsonrpc": "2.0", "id": 0, "result": 0}
    assert [a["error"]["data"] for a in answers[1:]] == [
        "responses owed on all connections exceed max_outgoing_bytes 100"] * 2
    assert d.outgoing.refused_total == 2 and d.oversize_total == 0


def test_a_chunks_calls_not_answered_when_its_worker_dies_are_answered_and_counted_by_method(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["a", "b"], metrics=metrics)
    w.pid = 77
    d.submit(body(codec, [req("a", [], 0), req("b", [], 1), req("a", [], 2)]), done.append)
    [frame] = w.channel.take()
    clock.advance(0.5)
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers((0, RESULT, b'"r0"')))
    d.worker_lost(w, "killed by SIGKILL")
    died = {"code": -32002, "message": "Worker died", "data": {"pid": 77, "status": "killed by SIGKILL"}}
    assert [json.loads(a) for a in done[0].answers] == [  # type: ignore[arg-type]
        {"jsonrpc": "2.0", "id": 0, "result": "r0"},
        {"jsonrpc": "2.0", "id": 1, "error": died}, {"jsonrpc": "2.0", "id": 2, "error": died},
    ]
    assert metrics.outcomes[0] == {OK: 1, ErrorCode.WORKER_DIED: 1} and metrics.outcomes[1] == {ErrorCode.WORKER_DIED: 1}
    assert (metrics.latency[0].sum_us, metrics.latency[1].sum_us) == (2 * 500_000, 500_000)
    assert done[0].budget.held == sum(map(len, done[0].answers))  # type: ignore[arg-type]


def test_a_gone_connections_failed_chunk_is_answered_with_nothing_and_counted(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["a", "b"], metrics=metrics)
    gone = ResponseBudget(d.outgoing)
    d.submit(body(codec, [req("a", [], 0), req("b", [], 1), req("a", [], 2)]), done.append, gone)
    w.channel.take()
    gone.lost()
    clock.advance(0.25)
    d.worker_lost(w, "exited with 1")
    assert done[0].answers == [b"", b"", b""] and d.outgoing.held == 0
    assert metrics.outcomes[0] == {ErrorCode.WORKER_DIED: 2} and metrics.outcomes[1] == {ErrorCode.WORKER_DIED: 1}
    assert metrics.latency[0].sum_us == 2 * 250_000


@pytest.mark.parametrize(("limits", "data"), [
    ({"max_response_bytes": 242}, "responses owed on this connection exceed max_response_bytes 242"),
    ({"max_outgoing_bytes": 242}, "responses owed on all connections exceed max_outgoing_bytes 242"),
    ({"max_outgoing_bytes": 242, "max_response_bytes": 363},  # (the third at max_response_bytes, not past it)
     "responses owed on all connections exceed max_outgoing_bytes 242"),
])
def test_a_chunks_error_past_what_its_connection_may_be_owed_is_refused_call_by_call(clock, limits, data):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["a", "b"], metrics=metrics, **limits)
    d.submit(body(codec, [req("a", [], 0), req("b", [], 1), req("a", [], 2)]), done.append)
    [frame] = w.channel.take()
    error = b'{"code":-32000,"message":"%s"}' % (b"e" * 60)
    d.on_reply(w, wire.Kind.ERROR, frame[1], 0, error)
    assert [len(a) for a in done[0].answers[:2]] == [121, 121]  # type: ignore[arg-type]  # two: the limit, exactly
    answers = [json.loads(a) for a in done[0].answers]  # type: ignore[arg-type]
    assert answers[:2] == [{"jsonrpc": "2.0", "id": i, "error": json.loads(error)} for i in range(2)]
    assert answers[2] == {"jsonrpc": "2.0", "id": 2, "error": {"code": -32603, "message": "Internal error",
                                                                "data": data}}
    assert (d.oversize_total, d.outgoing.refused_total) == ((1, 0) if "max_response" in data else (0, 1))
    assert metrics.outcomes[0] == {-32000: 1, ErrorCode.INTERNAL_ERROR: 1} and metrics.outcomes[1] == {-32000: 1}


def test_the_drains_end_answers_what_is_left_cancels_it_on_its_worker_and_refuses_what_comes_after(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], 1, metrics=metrics)
    d.submit(body(codec, req("m", [], "running")), done.append)
    d.submit(body(codec, req("m", [], "queued")), done.append)
    [running] = w.channel.take()
    hurry = asyncio.Event()
    drain = clock.loop.create_task(d.drain(30.0, hurry))
    clock.advance(0.0)
    assert not drain.done() and not done
    hurry.set()  # (a second SIGTERM: the grace period ends now)
    clock.advance(0.0)
    clock.advance(0.0)
    assert drain.done()
    ended = {"code": ErrorCode.SHUTTING_DOWN, "message": "Shutting down", "data": "grace period ended"}
    assert sorted((json.loads(e.body())["id"], json.dumps(json.loads(e.body())["error"])) for e in done) == [
        ("queued", json.dumps(ended)), ("running", json.dumps(ended))]
    assert w.channel.take() == [(wire.Kind.CANCEL, running[1], 0, b"")]
    assert metrics.outcomes[0] == {ErrorCode.SHUTTING_DOWN: 2}
    assert (d.accepting, d._draining, d._serving) == (False, False, False)
    late = d.submit(body(codec, req("m", [], "late")), done.append)
    assert late is not None and json.loads(late.body())["error"] == ended and not w.channel.take()


def test_the_drain_counts_the_calls_its_end_cuts_off_of_a_chunk_those_unanswered_only(clock):
    """Issue 12, item 13: the stop's log says how many calls the grace period's end cut off
    (`Dispatcher.cut_off`): a chunk's calls not answered yet, a single call; no notification."""
    d, w, codec, done = one_worker(clock.loop, ["m"], 4)
    batch = d.submit(body(codec, [req("m", [], i) for i in range(4)]), done.append)
    assert batch is not None
    for single in ({"jsonrpc": "2.0", "method": "m"}, *(req("m", [], name) for name in ("one", "two", "three"))):
        d.submit(body(codec, single), done.append)  # (some queued: the worker has 4 places)
    frames = w.channel.take()
    [chunk_frame] = [f for f in frames if f[0] == wire.Kind.CHUNK]
    assert chunk_frame[2] == 2 and d.queued_calls == 4  # (the batch's other chunk and two singles)
    d.on_reply(w, wire.Kind.CHUNK_PART, chunk_frame[1], 0, chunk_answers((1, wire.RESULT, b"1")))
    hurry = asyncio.Event()
    hurry.set()
    drain = clock.loop.create_task(d.drain(30.0, hurry))
    clock.advance(0.0)
    clock.advance(0.0)
    assert drain.done() and d.cut_off == 3 + 3  # (the batch's slots 0, 2 and 3; "one", "two", "three")
    assert [json.loads(a).get("result") for a in batch.answers] == [None, 1, None, None]  # type: ignore[arg-type]


def test_a_gone_connections_calls_are_counted_one_by_one_and_its_worker_killed_if_it_never_acknowledges(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], 2, timeout=10.0, cancel_grace=2.0)
    w.process = Process()
    gone = ResponseBudget(d.outgoing)
    for i in range(4):
        d.submit(body(codec, req("m", [], i)), done.append, gone)
    sent = w.channel.take()
    assert len(sent) == 1 and d.queued_calls == 3  # (its share of the 2 places: 1)
    clock.advance(9.5)
    gone.lost()
    d.abandon(gone)
    assert d.abandoned_total == {"queued": 3, "in_flight": 1} and d.queued_calls == 0 and not done
    assert w.channel.take() == [(wire.Kind.CANCEL, sent[0][1], 0, b"")]
    clock.advance(2.4)  # not before its deadline (0.5 s on) and cancel_grace
    assert w.process.kills == 0
    clock.advance(0.2)
    assert w.process.kills == 1 and w.kill_reason.startswith("hung")


def test_a_gone_connections_expired_shells_leave_the_queue_with_its_calls(clock):
    d, _w, codec, done = one_worker(clock.loop, ["m", "short"], 1, timeout=10.0, method_timeouts={"short": 1.0})
    gone = ResponseBudget(d.outgoing)
    d.submit(body(codec, req("m", [], "busy")), done.append, gone)
    for method, id_ in (("m", 0), ("short", 1), ("short", 2), ("m", 3)):
        d.submit(body(codec, req(method, [], id_)), done.append, gone)
    clock.advance(1.05)  # the two short ones expire behind a live head: shells
    assert codes(done) == [ErrorCode.TIMED_OUT] * 2 and d._expired_queued == 2 and len(d._queue) == 4
    gone.lost()
    d.abandon(gone)
    assert d.abandoned_total == {"queued": 2, "in_flight": 1}
    assert (len(d._queue), d._expired_queued, d.queued_calls, d.queued_bytes) == (0, 0, 0, 0)


# -- broker/deadlines.py: a call armed at another's tick (a chunk's calls given back) ---


def test_calls_armed_at_a_tick_fire_there_and_an_earlier_tick_rearms_the_one_timer(clock):
    fired: list[tuple[int, float]] = []
    wheel = DeadlineWheel(clock.loop, lambda c: fired.append((c.call_id, clock.now)), resolution=0.5)
    a, b, c, late = (make_call(i, 1.0) for i in range(1, 5))
    wheel.add_like(a, 2010)  # at 1005 s, loop time
    assert (a.tick, wheel._armed, len(wheel)) == (2010, 2010, 1)
    wheel.add_like(b, 2010)
    assert (b.tick, wheel._armed, len(wheel), wheel._ticks) == (2010, 2010, 2, [2010])
    wheel.add_like(c, 2004)  # earlier: the timer is armed for it
    assert (wheel._armed, wheel._ticks) == (2004, [2004, 2010])
    wheel.add_like(late, 2020)  # later: the timer stays
    assert wheel._armed == 2004 and sorted(wheel._ticks) == [2004, 2010, 2020]
    clock.advance(1.9)
    assert fired == []
    clock.advance(0.1)
    assert fired == [(3, 1002.0)] and c.tick == 0 and wheel._armed == 2010
    clock.advance(3.0)
    assert fired == [(3, 1002.0), (1, 1005.0), (2, 1005.0)] and len(wheel) == 1


# -- notifications that never ran: counted, as they get no answer -----------------------


def test_notifications_a_worker_says_never_started_are_counted_dropped_and_no_others(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"])

    def note(n: int) -> dict[str, object]:
        return {"jsonrpc": "2.0", "method": "m", "params": [n]}

    d.submit(body(codec, note(0)), lambda e: None)
    d.submit(body(codec, note(1)), lambda e: None)
    d.submit(body(codec, [note(i) for i in range(2, 6)]), lambda e: None)  # a chunk of 4
    d.submit(body(codec, [note(i) for i in range(6, 9)]), lambda e: None)  # a chunk of 3
    d.submit(body(codec, [note(i) for i in range(9, 12)]), lambda e: None)  # a chunk of 3
    single0, single1, four, three, other = w.channel.take()
    assert [(f[0], f[2]) for f in (four, three, other)] == [(wire.Kind.CHUNK, 4), (wire.Kind.CHUNK, 3),
                                                             (wire.Kind.CHUNK, 3)]
    d.on_reply(w, wire.Kind.ERROR, single0[1], wire.NOT_RUN, wire.CANCEL_ACK)  # its deadline passed first
    d.on_reply(w, wire.Kind.ERROR, single1[1], 5, b'{"code":-32000,"message":"ran, and failed"}')
    assert d.notifications_dropped == {ErrorCode.TIMED_OUT: 1}
    d.on_reply(w, wire.Kind.CHUNK_REPLY, four[1], 0, chunk_answers(
        (0, RESULT, b"null"), (1, ERROR, wire.CANCEL_ACK), (2, ERROR, b'{"code":1,"message":"x"}'),
        (3, ERROR, wire.CANCEL_ACK)))
    assert d.notifications_dropped == {ErrorCode.TIMED_OUT: 3}
    d.on_reply(w, wire.Kind.ERROR, three[1], wire.NOT_RUN, wire.CANCEL_ACK)  # the whole chunk, unrun
    d.on_reply(w, wire.Kind.ERROR, other[1], 5, b'{"code":-32000,"message":"no"}')  # ran: not counted
    assert d.notifications_dropped == {ErrorCode.TIMED_OUT: 6}
    assert d.in_flight_calls == 0 and w.outstanding == 0


def test_replies_to_calls_answered_already_are_counted_late_results_or_late_cancels(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], timeout=1.0, cancel_grace=100.0)
    d.submit(body(codec, req("m", [], "a")), done.append)
    d.submit(body(codec, req("m", [], "b")), done.append)
    d.submit(body(codec, [req("m", [], i) for i in range(3)]), done.append)
    d.submit(body(codec, {"jsonrpc": "2.0", "method": "m", "params": []}), done.append)  # a notification
    single_a, single_b, three, note = w.channel.take()
    assert three[0] == wire.Kind.CHUNK and note[0] == wire.Kind.NOTIFY
    clock.advance(1.05)  # every deadline passes: answered -32001, told to cancel
    assert len(done) == 3 and (d.late_results_total, d.late_cancelled_total) == (0, 0)
    d.on_reply(w, wire.Kind.RESULT, single_a[1], 10, b"1")  # it ran to the end all the same
    d.on_reply(w, wire.Kind.ERROR, single_b[1], wire.NOT_RUN, wire.CANCEL_ACK)
    assert (d.late_results_total, d.late_cancelled_total) == (1, 1)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, three[1], 0, chunk_answers(
        (0, RESULT, b"0"), (1, ERROR, wire.CANCEL_ACK), (2, ERROR, wire.CANCEL_ACK_RAN)))
    assert (d.late_results_total, d.late_cancelled_total) == (2, 3)
    d.on_reply(w, wire.Kind.RESULT, note[1], 10, b"null")  # a notification's: owed nothing, not late
    assert (d.late_results_total, d.late_cancelled_total) == (2, 3)
    assert d.in_flight_calls == 0 and w.outstanding == 0 and not w.overdue


def test_a_late_whole_error_for_a_chunk_counts_each_of_its_calls(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], timeout=1.0, cancel_grace=100.0)
    d.submit(body(codec, [req("m", [], i) for i in range(3)]), done.append)
    d.submit(body(codec, [req("m", [], i) for i in range(4)]), done.append)
    three, four = w.channel.take()
    clock.advance(1.05)
    d.on_reply(w, wire.Kind.ERROR, three[1], wire.NOT_RUN, wire.CANCEL_ACK)
    assert (d.late_results_total, d.late_cancelled_total) == (0, 3)
    d.on_reply(w, wire.Kind.ERROR, four[1], 5, b'{"code":-32000,"message":"no"}')
    assert (d.late_results_total, d.late_cancelled_total) == (4, 3)


def test_calls_shed_are_logged_at_the_first_then_each_interval_that_shed_any_and_at_the_drain(clock, caplog):
    d, _w, codec, done = one_worker(clock.loop, ["m"], 1, max_queue=0, timeout=1000.0)
    d.submit(body(codec, req("m", [], "busy")), done.append)
    note = {"jsonrpc": "2.0", "method": "m", "params": []}
    refused: list[Exchange | None] = []

    def shed(payload: object) -> None:
        refused.append(d.submit(body(codec, payload), done.append, ResponseBudget(d.outgoing)))

    with caplog.at_level("WARNING", logger="broker.dispatch"):
        shed(req("m", [], 1))
        clock.advance(10.0)
        shed(req("m", [], 2))
        shed(req("m", [], 3))
        clock.advance(50.0)  # the interval ends: its 2
        clock.advance(60.0)  # one that shed nothing: no line, and the next is said at once
        shed(req("m", [], 4))
        clock.advance(30.0)
        shed(note)
        hurry = asyncio.Event()
        hurry.set()
        drain = clock.loop.create_task(d.drain(30.0, hurry))
        clock.advance(0.0)
        clock.advance(0.0)
        assert drain.done()
        clock.advance(120.0)  # (no line after the drain's)
    first = "; max_queue 0 calls, max_queue_bytes 67108864 (how many more: a line every 60 s while it goes on)"
    assert [r.getMessage() for r in caplog.records] == [
        "queue full: 1 call(s) refused -32000 (Server overloaded)" + first,
        "queue full: 2 call(s) refused -32000 (Server overloaded) in the last 60 s",
        "queue full: 1 call(s) refused -32000 (Server overloaded)" + first,
        "queue full: 1 notification(s) dropped in the last 30 s",
    ]
    assert codes([e for e in refused if e is not None]) == [ErrorCode.OVERLOADED] * 4 and refused[-1] is None


def test_a_gone_connections_queued_chunk_of_notifications_still_runs(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"], 8)  # a connection's share: 4 places
    gone = ResponseBudget(d.outgoing)
    for i in range(8):  # the worker full, with calls of other connections
        d.submit(body(codec, req("m", [], i)), lambda e: None, ResponseBudget(d.outgoing))
    notes = d.submit(body(codec, [{"jsonrpc": "2.0", "method": "m", "params": [i]} for i in range(3)]),
                     lambda e: None, gone)
    assert notes is None and d.queued_calls == 3 and len(d._queue) == 1  # one chunk, owed nothing
    busy = w.channel.take()
    gone.lost()
    d.abandon(gone)
    assert d.abandoned_total == {"queued": 0, "in_flight": 0} and d.queued_calls == 3
    d.on_reply(w, wire.Kind.RESULT, busy[0][1], 0, b"0")
    [frame] = w.channel.take()
    assert (frame[0], frame[2], w.channel.flows[frame[1]] & ~wire.RETURNABLE) == (wire.Kind.CHUNK, 3, gone.flow)


def test_a_chunk_call_is_its_entries_and_is_owed_an_answer_unless_all_are_notifications(loop):
    budget = ResponseBudget(Dispatcher(loop).outgoing)
    exchange = Exchange(True, 200, lambda e: None, [None, None], budget=budget)
    entries = [(0, Request("2.0", "a", params=b"[1]", id=b"1"), Route(4, 5.0)),
               (-1, Request("2.0", "b", params=b"[]"), Route(2, 5.0)),
               (1, Request("2.0", "a", params=b"[2]", id=b'"x"'), Route(4, 5.0))]
    call = Call.chunk(9, exchange, entries, 5.0, 12.5)
    assert (call.call_id, call.exchange, call.slot, call.kind, call.index) == (9, exchange, -1, wire.CHUNK, 3)
    assert call.id is NO_ID
    assert (call.timeout, call.arrival, call.sync, call.owner, call.weight) == (5.0, 12.5, 0, budget, 3)
    assert (call.slots, call.methods) == ([0, -1, 1], [4, 2, 4])
    assert [bytes(id_) for id_ in call.ids or ()] == [b"1", b"", b'"x"']
    assert call.params == chunk.encode_requests(entries)[0]
    assert Call.chunk(10, exchange, entries, 5.0, 12.5, sync=True).sync == 3
    notes = [(-1, Request("2.0", "b", params=b"[]"), Route(2, 5.0))] * 2
    assert Call.chunk(11, exchange, notes, 5.0, 12.5).exchange is None


def test_a_hung_chunk_is_named_so_and_an_async_call_waits_for_nothing_when_no_sync_call_is_there(clock, caplog):
    clock.now = 0.0  # (the broker's clocks near their start: nothing to wait for is 0.0, not "later")
    d, w, codec, done = one_worker(clock.loop, ["a", "b", "c", "d"], timeout=0.2, cancel_grace=0.3)
    w.process = Process()
    d.submit(body(codec, [req("a", [], i) for i in range(3)]), done.append)  # a chunk of 3: index 3 < 4 names
    d.submit(body(codec, req("b", [], "b")), done.append)
    assert [f[0] for f in w.channel.take()] == [wire.Kind.CHUNK, wire.Kind.CALL]
    clock.advance(0.25)
    assert w.process.kills == 0
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        clock.advance(0.31)
    assert w.process.kills == 1
    assert "has not answered call 1 (a batch chunk) 0.3 s after its deadline" in caplog.records[0].getMessage()


def test_a_reload_translates_a_chunk_in_flight_and_a_queued_call_behind_an_expired_shell(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["a", "b", "short"], 3, metrics=metrics, connection_share=1.0,
                                   method_timeouts={"short": 1.0})
    d.submit(body(codec, [req("a", [], 0), req("b", [], 1), req("a", [], 2)]), done.append)  # a chunk, in flight
    budget = ResponseBudget(d.outgoing)
    for method, id_ in (("a", "head"), ("short", "shell"), ("a", "queued")):
        d.submit(body(codec, req(method, [], id_)), done.append, budget)
    [in_flight] = w.channel.take()
    clock.advance(1.05)  # "short" expires in the queue: a shell before the queued call
    assert in_flight[0] == wire.Kind.CHUNK and len(d._queue) == 3 and d._expired_queued == 1
    d.set_methods(["b", "a", "short"])
    clock.advance(0.2)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, in_flight[1], 0,
               chunk_answers((0, RESULT, b"0"), (1, RESULT, b"1"), (2, RESULT, b"2")))
    assert (metrics.outcomes[0], metrics.outcomes[1]) == ({OK: 1}, {OK: 2})  # b, a: their new indexes
    assert [(f[0], f[2], json.loads(f[3])) for f in w.channel.take()] == [(wire.Kind.CALL, 1, [])] * 2
    assert [a["result"] for a in json.loads(done[-1].body())] == [0, 1, 2]


def test_a_chunk_given_back_in_part_gives_back_the_large_params_of_those_calls(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], max_worker_params_bytes=10_000, metrics=metrics)
    d._heavy_bytes = 20  # large params at this test's scale
    budget = ResponseBudget(d.outgoing)
    params = [[i, "x" * 20] for i in range(3)]  # 27 bytes each, as sent: [0, "xx...x"]
    d.submit(body(codec, [req("m", p, i) for i, p in enumerate(params)]), done.append, budget)
    [frame] = w.channel.take()
    assert frame[0] == wire.Kind.CHUNK and frame[2] == 3 and w.channel.flows[frame[1]] & wire.RETURNABLE
    call = d._pending[frame[1]]
    assert (call.heavy, w.heavy, budget.heavy, list(w.heavy_calls)) == (81, 81, 81, [call])
    d.on_reply(w, wire.Kind.RETURN, frame[1], 1, _entries_from(frame[3], 1))  # it started the first only
    [again] = w.channel.take()  # the two given back go one by one, as blocking sync calls: one now
    single = d._pending[again[1]]
    assert (call.heavy, single.heavy, w.heavy, budget.heavy) == (27, 27, 54, 54)
    assert list(w.heavy_calls) == [call, single] and d.returned_total == 2 and d.queued_calls == 1
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers((0, RESULT, b"0")))  # (a chunk of 1 now)
    assert (w.heavy, budget.heavy, list(w.heavy_calls)) == (27, 27, [single])
    assert metrics.outcomes[0] == {OK: 1}


def test_a_blocking_sync_call_given_back_frees_its_worker_and_goes_again(clock):
    d, w, codec, done = one_worker(clock.loop, ["s"], 4)
    d.set_methods(["s"], sync_methods=["s"])  # unmeasured: blocking
    budget = ResponseBudget(d.outgoing)
    d.submit(body(codec, req("s", [], 1)), done.append, budget)
    [frame] = w.channel.take()
    assert (w.blocked, w.sync_calls, budget.blocking, d._blocked, w.limit) == (True, 1, 1, 1, 1)
    assert not w.channel.flows[frame[1]] & wire.RETURNABLE
    d.on_reply(w, wire.Kind.RETURN, frame[1], 0, frame[3])  # (a worker of another broker's would)
    [again] = w.channel.take()
    assert again[0] == wire.Kind.CALL and again[3] == frame[3] and d.returned_total == 1
    assert (w.blocked, w.sync_calls, budget.blocking, d._blocked, w.limit, w.outstanding) == (True, 1, 1, 1, 1, 1)
    d.on_reply(w, wire.Kind.RESULT, again[1], 5_000, b'"done"')
    assert json.loads(done[0].body())["result"] == "done"
    assert (w.blocked, w.sync_calls, budget.blocking, d._blocked, w.limit, w.outstanding) == (False, 0, 0, 0, 4, 0)


def test_calls_given_back_after_their_deadline_are_counted_late_cancels_from_the_first(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], timeout=1.0, cancel_grace=100.0)
    d.submit(body(codec, [req("m", [], i) for i in range(3)]), done.append)
    d.submit(body(codec, {"jsonrpc": "2.0", "method": "m", "params": []}), done.append)
    d.submit(body(codec, req("m", [], "single")), done.append)
    three, note, single = w.channel.take()
    clock.advance(1.05)
    d.on_reply(w, wire.Kind.RETURN, single[1], 0, single[3])
    assert d.late_cancelled_total == 1
    d.on_reply(w, wire.Kind.RETURN, three[1], 0, three[3])  # all of it, from its first call
    assert d.late_cancelled_total == 4
    d.on_reply(w, wire.Kind.RETURN, note[1], 0, note[3])  # a notification: owed nothing
    assert d.late_cancelled_total == 4 and d.returned_total == 5 and d.queued_calls == 0 and w.outstanding == 0


def test_a_chunk_given_back_whole_goes_again_call_by_call_each_answered_in_its_slot(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], metrics=metrics, timeout=5.0)
    budget = ResponseBudget(d.outgoing)
    d.submit(body(codec, [req("m", [i], i) for i in range(3)]), done.append, budget)
    [frame] = w.channel.take()
    clock.advance(1.0)
    d.on_reply(w, wire.Kind.RETURN, frame[1], 0, frame[3])  # none started
    for i in range(2):
        [single] = w.channel.take()  # one at a time: blocking sync calls, one a connection
        assert (single[0], json.loads(single[3]), w.sync_calls, budget.blocking) == (wire.Kind.CALL, [i], 1, 1)
        assert w.channel.deadlines[single[1]] == w.channel.deadlines.get(frame[1])  # the chunk's deadline
        d.on_reply(w, wire.Kind.RESULT, single[1], 2_000_000, b'"r%d"' % i)
    [last] = w.channel.take()
    clock.advance(4.25)  # the chunk's deadline passes
    answers = json.loads(done[0].body())
    assert answers == [{"jsonrpc": "2.0", "id": 0, "result": "r0"}, {"jsonrpc": "2.0", "id": 1, "result": "r1"},
                       {"jsonrpc": "2.0", "id": 2, "error": {"code": -32001, "message": "Call timed out",
                                                            "data": {"timeout_seconds": 5.0}}}]
    assert metrics.outcomes[0] == {OK: 2, ErrorCode.TIMED_OUT: 1}
    assert metrics.latency[0].sum_us == 2 * 1_000_000 + 5_250_000 and last[0] == wire.Kind.CALL


def test_a_calls_state_is_read_from_where_the_dispatcher_holds_it(clock):
    d, w, codec, done = one_worker(clock.loop, ["m", "short"], 1, timeout=10.0, method_timeouts={"short": 1.0},
                                   cancel_grace=100.0)
    budget = ResponseBudget(d.outgoing)
    for method, id_ in (("short", "sent"), ("m", "head"), ("short", "shell")):
        d.submit(body(codec, req(method, [], id_)), done.append, budget)
    sent, head, shell = next(iter(d._pending.values())), *d._queue
    assert [d.state_of(c) for c in (sent, head, shell)] == [CallState.IN_FLIGHT, CallState.QUEUED, CallState.QUEUED]
    clock.advance(1.05)
    assert [d.state_of(c) for c in (sent, head, shell)] == [
        CallState.ANSWERED_AWAITING_WORKER, CallState.QUEUED, CallState.ANSWERED_IN_QUEUE]
    d.on_reply(w, wire.Kind.ERROR, sent.call_id, wire.NOT_RUN, wire.CANCEL_ACK)
    assert [d.state_of(c) for c in (sent, head)] == [CallState.ENDED, CallState.IN_FLIGHT]


# -- broker/membership.py: who sent the calls a worker died under, for the log ----------


@pytest.mark.parametrize(("peer", "said"), [
    (("127.0.0.1", 40312), "127.0.0.1:40312"), (("::1", 5102, 0, 0), "[::1]:5102"),
    ("/run/rpc.sock", "unix socket"), (b"", "unix socket"), (None, "?"), (("host",), "unix socket"),
])
def test_a_peer_is_named_as_a_log_names_it(peer, said):
    assert _address(peer) == said


def test_the_clients_of_calls_are_named_most_calls_first_at_most_three_and_how_many_more():
    def calls(*peers: object) -> list[typing.Any]:
        return [types.SimpleNamespace(owner=types.SimpleNamespace(peer=p)) for p in peers]

    a, b, c, e = ("10.0.0.1", 1), ("10.0.0.2", 2), ("::1", 3), ("10.0.0.4", 4)
    assert _clients(calls(a)) == "10.0.0.1:1"
    assert _clients(calls(b, a, a, c, a, b)) == "10.0.0.1:1 x3, 10.0.0.2:2 x2, [::1]:3"
    assert _clients(calls(a, a, b, c, e)) == "10.0.0.1:1 x2, 10.0.0.2:2, [::1]:3, 1 more"
    assert _clients(calls(a, b, c, e, ("10.0.0.5", 5))) == "10.0.0.1:1, 10.0.0.2:2, [::1]:3, 2 more"


def test_a_batchs_invalid_elements_and_unknown_methods_are_answered_at_once_and_counted_once_each(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], metrics=metrics)
    batch = [1, req("m", [], 0), {"jsonrpc": "2.0"}, req("nope", [], 1), 2, {"jsonrpc": "2.0", "method": "nope"},
             {"jsonrpc": "2.0", "method": "m"}, req("nope", [], 2), {"jsonrpc": "2.0", "method": "nope"}]
    exchange = d.submit(body(codec, batch), done.append)
    assert exchange is not None and exchange.remaining == 1
    frame, note = w.channel.take()
    assert (frame[0], note[0]) == (wire.Kind.CALL, wire.Kind.NOTIFY)
    answers = exchange.answers
    assert [json.loads(a)["error"]["code"] if a else None for a in answers] == [
        -32600, None, -32600, -32601, -32600, -32601]
    assert exchange.budget.held == sum(len(a) for a in answers if a)
    other = metrics.other
    assert metrics.outcomes[other] == {ErrorCode.INVALID_REQUEST: 3, ErrorCode.METHOD_NOT_FOUND: 2}
    assert (metrics.notifications[other], metrics.notifications[0]) == (2, 1)
    assert sum(metrics.latency[other].counts) == 5 and metrics.latency[other].sum_us == 0
    d.on_reply(w, wire.Kind.RESULT, frame[1], 0, b"0")
    assert json.loads(done[0].body())[1] == {"jsonrpc": "2.0", "id": 0, "result": 0}


def test_a_worker_dying_under_calls_is_logged_with_what_it_held_whose_and_what_runs_alone_now(clock, caplog):
    d, w, codec, done = one_worker(clock.loop, ["a", "b"])
    w.pid = 4242
    budget = ResponseBudget(d.outgoing)
    budget.peer = ("10.0.0.1", 5)
    d.submit(body(codec, [req("a", [], 0), req("b", [], 1), req("a", [], 2)]), done.append, budget)
    d.submit(body(codec, {"jsonrpc": "2.0", "method": "b", "params": []}), done.append, budget)
    d.submit(body(codec, req("a", [], 3)), done.append, budget)
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        d.worker_lost(w, "killed by SIGKILL")
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (
        "worker 0 (pid 4242) died holding 4 calls and 1 notification (of 10.0.0.1:5 x3): their methods' calls now "
        "run alone, one per worker, until so many of them have answered or so long has passed: "
        "a: after 1 answer or 4 s, b: after 1 answer or 4 s")  # (x3: three records, a chunk among them)
    assert d.isolated == {"a": 1, "b": 1}
