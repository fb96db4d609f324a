"""The dispatcher core in memory: replies.py, deadlines.py, calls.py and chunk.py (how a
reply, a deadline or a failure becomes the call's one answer), held by exact values: what
`make mutate` found the other in-memory tests did not hold. The set-up is test_dispatch_core.py's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import typing

import pytest
from test_dispatch import _entries_from, add_worker, body, make_call, req, restarted
from test_dispatch_core import Clock, chunk_answers, one_worker

from broker import chunk, wire
from broker.answers import Exchange, ResponseBudget
from broker.calls import Route
from broker.deadlines import DeadlineWheel
from broker.dispatch import Dispatcher
from broker.jsonrpc import Codec, ErrorCode, Request
from broker.metrics import OK, CallMetrics
from broker.replies import error_code
from broker.wire import CALL_ENTRY, ERROR, RESULT


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> typing.Iterator[Clock]:
    """Time injected (test_dispatch_core.Clock)."""
    c = Clock(monkeypatch)
    yield c
    c.loop.close()


# -- error_code: the code of a worker's error object, or of a whole Response ----------


@pytest.mark.parametrize(("error", "code"), [
    (b'{"code":-32602,"message":"no"}', -32602),
    (b'"code":7,"message":""', 7),  # (found at the very start)
    (b'{"code":12}', 12),  # (no comma after it)
    (b'{"jsonrpc":"2.0","id":1,"error":{"code":-32600,"message":"x"}}', -32600),
    (b'{"message":"no code"}', ErrorCode.INTERNAL_ERROR),
    (b'{"code":"x","message":""}', ErrorCode.INTERNAL_ERROR),  # (not a number)
    (b'{"code":-32000,"message":"x","data":{"code":5}}', -32000),  # (its data's "code" comes after)
])
def test_an_error_objects_code_is_read_after_its_key_or_is_internal_error(error, code):
    assert error_code(error) == code


def test_an_error_without_a_code_to_read_gives_the_default_asked_for():
    assert error_code(b'{"message":"no code"}', 5) == 5
    assert error_code(b'{"code":null,"message":""}', -1) == -1
    assert error_code(b'{"code":3,"message":""}', -1) == 3


# -- learning a sync method's time (BLOCKING_US) from its replies -----------------------


def fast_sync(clock: Clock, **settings: typing.Any) -> tuple[Dispatcher, typing.Any, Codec, list[Exchange]]:
    """One worker of 100 places serving "q" (a sync method, learnt fast: 887 µs, from one call of
    100 µs after the unmeasured 1000) and "a" (async), a prefetch of 1."""
    d, w, codec, done = one_worker(clock.loop, ["q", "a"], sync_prefetch=1, **settings)
    d.set_methods(["q", "a"], sync_methods=["q"])
    d.submit(body(codec, req("q", [], "learn")), lambda e: None)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, frame[1], 100, b"0")
    assert d._sync_us == [887, -1, -1] and d._blocking == [0, 0, 0]
    return d, w, codec, done


def chunk_of(d: Dispatcher, w: typing.Any, codec: Codec, methods: str, done: list[Exchange]) -> tuple[int, int, int, bytes]:
    """A batch of one call of each of `methods` ("q", "a"; 3 at least), sent as one chunk: its frame."""
    d.submit(body(codec, [req({"q": "q", "a": "a"}[m], [i], i) for i, m in enumerate(methods)]), done.append)
    [frame] = w.channel.take()
    assert frame[0] == wire.Kind.CHUNK and frame[2] == len(methods)
    return frame


def all_results(n: int) -> bytes:
    return chunk_answers(*((i, RESULT, b"0") for i in range(n)))


def test_a_chunk_of_one_sync_methods_calls_teaches_its_time_per_call(clock):
    d, w, codec, done = fast_sync(clock)
    frame = chunk_of(d, w, codec, "qqqq", done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 4 * 200, all_results(4))
    assert d._sync_us[0] == 887 + ((200 - 887) >> 3) == 801 and d._blocking[0] == 0
    frame = chunk_of(d, w, codec, "qqqq", done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], wire.AWAITED | 4 * 5000, all_results(4))  # awaited: ~0 µs
    assert d._sync_us[0] == 801 + ((0 - 801) >> 3) == 700 and len(done) == 2


def test_a_chunk_left_with_one_call_by_its_worker_giving_back_the_rest_teaches_that_calls_time(clock):
    d, w, codec, done = fast_sync(clock)
    frame = chunk_of(d, w, codec, "qqqq", done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 4 * 200, all_results(4))
    frame = chunk_of(d, w, codec, "qqq", done)
    d.on_reply(w, wire.Kind.RETURN, frame[1], 1, _entries_from(frame[3], 1))  # it ran the first only
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], wire.AWAITED, all_results(1))  # awaited: ~0 µs
    assert d._sync_us[0] == 801 + ((0 - 801) >> 3) == 700


def test_a_mixed_chunk_or_an_async_methods_chunk_teaches_nothing(clock):
    d, w, codec, done = fast_sync(clock)
    mixed = chunk_of(d, w, codec, "qaq", done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, mixed[1], 3 * 50_000, all_results(3))
    frame = chunk_of(d, w, codec, "aaa", done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 3 * 50_000, all_results(3))
    frame = chunk_of(d, w, codec, "aqq", done)  # (its first an async method's)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 3 * 50_000, all_results(3))
    assert d._sync_us == [887, -1, -1] and d._blocking == [0, 0, 0] and len(done) == 3


def test_a_chunk_that_takes_a_sync_method_to_exactly_blocking_us_makes_it_blocking(clock):
    d, w, codec, done = fast_sync(clock)
    frame = chunk_of(d, w, codec, "qqqq", done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 4 * 1791, all_results(4))  # 887 + (904 >> 3) = 1000
    assert d._sync_us[0] == 1000 and d._blocking[0] == 1
    d.submit(body(codec, req("q", [], "next")), done.append)
    [single] = w.channel.take()
    assert (w.blocked, w.limit, w.sync_calls) == (True, 2, 1)  # a blocking sync call: the prefetch of 1 beside it
    assert not w.channel.flows[single[1]] & wire.RETURNABLE


def test_a_sync_method_learnt_down_to_0_us_learns_again_from_a_chunk(clock):
    d, w, codec, done = fast_sync(clock)
    for _ in range(60):  # awaited: ~0 µs each, down to 0
        d.submit(body(codec, req("q", [], 0)), done.append)
        [frame] = w.channel.take()
        d.on_reply(w, wire.Kind.RESULT, frame[1], wire.AWAITED, b"0")
    assert d._sync_us[0] == 0
    frame = chunk_of(d, w, codec, "qqq", done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 3 * 800, all_results(3))
    assert d._sync_us[0] == 100 and d._blocking[0] == 0


# -- a chunk's answers spliced into their slots (_fill_chunk) ---------------------------


def three_results(clock: Clock, max_response_bytes: int) -> list[object]:
    """A chunk of 3 calls answered 0 each on a connection allowed `max_response_bytes`: the answers' codes."""
    d, w, codec, done = one_worker(clock.loop, ["m"], max_response_bytes=max_response_bytes)
    frame = chunk_of_m(d, w, codec, 3, done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, all_results(3))
    return [json.loads(a).get("error", {}).get("code") for a in done[0].answers]  # type: ignore[arg-type]


def chunk_of_m(d: Dispatcher, w: typing.Any, codec: Codec, n: int, done: list[Exchange]) -> tuple[int, int, int, bytes]:
    """A batch of `n` calls of "m" (ids 0...), sent as one chunk: its frame."""
    d.submit(body(codec, [req("m", [i], i) for i in range(n)]), done.append)
    [frame] = w.channel.take()
    assert frame[0] == wire.Kind.CHUNK and frame[2] == n
    return frame


def test_a_chunks_answers_that_fill_max_response_bytes_exactly_are_all_given(clock):
    size = len(b'{"jsonrpc":"2.0","id":0,"result":0}')
    assert three_results(clock, 3 * size) == [None, None, None]
    assert three_results(clock, 3 * size - 1) == [None, None, ErrorCode.INTERNAL_ERROR]


@pytest.mark.parametrize(("first", "answers", "outcomes"), [
    ((RESULT, b"0"), [0, 1, 2], {OK: 3}),
    # (its first answer an error: the second walk, as results do not fill the chunk, counted it)
    ((ERROR, b'{"code":-32602,"message":"no"}'), [None, 1, 2], {ErrorCode.INVALID_PARAMS: 1, OK: 2}),
])
def test_a_second_answer_to_a_chunks_call_in_the_same_reply_is_dropped_and_not_counted(clock, first, answers,
                                                                                       outcomes):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], metrics=metrics)
    frame = chunk_of_m(d, w, codec, 3, done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, *first), (1, RESULT, b"1"), (2, RESULT, b"2"), (0, RESULT, b'"again"')))
    assert [json.loads(a).get("result") for a in done[0].answers] == answers  # type: ignore[arg-type]
    assert metrics.outcomes[0] == outcomes and done[0].remaining == 0 and d.in_flight_calls == 0


def test_a_second_answer_to_a_chunks_call_answered_in_an_earlier_part_is_not_counted_again(clock):
    """_fill_chunk's second walk (some results answered before) counted every RESULT entry
    of the payload, a call's second answer too, though its slot kept the first: {OK: 4}."""
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], metrics=metrics)
    frame = chunk_of_m(d, w, codec, 3, done)
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers((0, RESULT, b'"first"')))
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, RESULT, b'"again"'), (1, RESULT, b"1"), (2, RESULT, b"2")))
    assert [json.loads(a)["result"] for a in done[0].answers] == ["first", 1, 2]  # type: ignore[arg-type]
    assert metrics.outcomes[0] == {OK: 3}


@pytest.mark.parametrize(("again", "last", "max_response_bytes", "outcomes"), [
    # (a second answer that is an error takes no result off the count)
    ((0, ERROR, b'{"code":-32602,"message":"no"}'), (2, ERROR, b'{"code":-32602,"message":"no"}'), 1 << 20,
     {OK: 2, ErrorCode.INVALID_PARAMS: 1}),
    # (a second result is taken off the count though another answer was refused past the budget)
    ((0, RESULT, b'"again"'), (2, RESULT, b'"' + b"x" * 300 + b'"'), 200, {OK: 2, ErrorCode.INTERNAL_ERROR: 1}),
])
def test_a_second_answer_is_not_counted_beside_errors_and_refusals(clock, again, last, max_response_bytes, outcomes):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], metrics=metrics, max_response_bytes=max_response_bytes)
    frame = chunk_of_m(d, w, codec, 3, done)
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers((0, RESULT, b'"first"')))
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(again, (1, RESULT, b"1"), last))
    assert json.loads(done[0].answers[0])["result"] == "first"  # type: ignore[arg-type]
    assert metrics.outcomes[0] == outcomes


# -- calls a worker gives back unstarted (wire.RETURN: _returned, _singles, _requeue) ---


def test_a_chunk_of_notifications_given_back_goes_again_as_notifications_one_by_one(clock):
    d, w, codec, done = fast_sync(clock)
    assert d.submit(body(codec, [{"jsonrpc": "2.0", "method": "q", "params": [i]} for i in range(3)]),
                    done.append) is None
    [frame] = w.channel.take()
    assert frame[0] == wire.Kind.CHUNK and w.channel.flows[frame[1]] & wire.RETURNABLE
    d.on_reply(w, wire.Kind.RETURN, frame[1], 0, frame[3])
    sent = w.channel.take()
    while len(sent) < 3:
        d.on_reply(w, wire.Kind.RESULT, sent[-1][1], 5_000, b"null")
        sent += w.channel.take()
    assert [(f[0], f[2], json.loads(f[3])) for f in sent] == [(wire.Kind.NOTIFY, 0, [i]) for i in range(3)]
    assert d.returned_total == 3 and done == [] and d.late_cancelled_total == 0


def test_calls_given_back_are_observed_in_the_queue_wait_once(clock):
    """A call given back unstarted and sent again was observed in rpc_broker_queue_wait_seconds
    at each send: the histogram counted more calls than came."""
    metrics = CallMetrics()
    d, w, codec, done = fast_sync(clock, metrics=metrics)
    sent_before, waited_before = metrics.sent_at_once, sum(metrics.queue_wait.counts)
    d.submit(body(codec, [req("q", [i], i) for i in range(3)]), done.append)
    [frame] = w.channel.take()
    clock.advance(0.5)
    d.on_reply(w, wire.Kind.RETURN, frame[1], 0, frame[3])  # (all three given back, sent again one by one)
    sent = w.channel.take()
    while len(sent) < 3:
        d.on_reply(w, wire.Kind.RESULT, sent[-1][1], 5_000, b"1")
        sent += w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, sent[-1][1], 5_000, b"1")
    assert len(done) == 1 and d.returned_total == 3
    assert metrics.sent_at_once - sent_before + sum(metrics.queue_wait.counts) - waited_before == 3


def test_a_chunk_whose_large_params_were_all_given_back_holds_none_on_its_worker(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], max_worker_params_bytes=10_000)
    d._heavy_bytes = 20  # large params at this test's scale
    budget = ResponseBudget(d.outgoing)
    params = [[0], [1, "x" * 20], [2, "x" * 20]]  # 3, then 27 bytes each, as sent
    d.submit(body(codec, [req("m", p, i) for i, p in enumerate(params)]), done.append, budget)
    [frame] = w.channel.take()
    call = d._pending[frame[1]]
    assert (call.heavy, w.heavy, budget.heavy, list(w.heavy_calls)) == (54, 54, 54, [call])
    d.on_reply(w, wire.Kind.RETURN, frame[1], 1, _entries_from(frame[3], 1))  # it started the first only
    [again] = w.channel.take()
    single = d._pending[again[1]]
    assert (call.heavy, single.heavy, w.heavy, budget.heavy, list(w.heavy_calls)) == (0, 27, 27, 27, [single])


# -- a sync method's estimate crossing BLOCKING_US (_reclassify) ------------------------


def crossings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("sync method")]


def test_a_sync_method_is_logged_once_each_time_its_estimate_crosses_blocking_us(clock, caplog):
    with caplog.at_level("DEBUG", logger="broker.dispatch"):
        d, w, codec, done = fast_sync(clock)
        d.submit(body(codec, req("q", [], 1)), done.append)
        [frame] = w.channel.take()
        d.on_reply(w, wire.Kind.RESULT, frame[1], 100, b"0")  # fast still: no crossing
        d.submit(body(codec, req("q", [], 2)), done.append)
        [frame] = w.channel.take()
        d.on_reply(w, wire.Kind.RESULT, frame[1], 100_000, b"0")
    assert d._sync_us[0] == 788 + ((100_000 - 788) >> 3) == 13_189 and d._blocking[0] == 1
    assert crossings(caplog) == [
        "sync method q: its estimated time crossed 1000 us (now 887 us): not blocking",
        "sync method q: its estimated time crossed 1000 us (now 13189 us): blocking",
    ]


def test_a_method_turning_blocking_makes_its_queued_calls_blocking_past_an_expired_shell(clock):
    d, w, codec, done = one_worker(clock.loop, ["q", "s", "a", "short"], 8, sync_prefetch=1,
                                   method_timeouts={"short": 1.0})  # (4 places a connection)
    d.set_methods(["q", "s", "a", "short"], sync_methods=["q", "s"])
    d.submit(body(codec, req("q", [], "learn")), lambda e: None)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, frame[1], 100, b"0")  # "q" learnt fast: 887 µs
    others = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
    for n, method in enumerate("aaaqaaaa"):  # the worker full, two other connections' calls
        d.submit(body(codec, req(method, [], n)), lambda e: None, others[n // 4])
    probe = next(f for f in w.channel.take() if f[2] == 0)
    queued = ResponseBudget(d.outgoing)
    for payload in (req("a", [], "head"), req("short", [], "shell"), req("q", [], "q"), req("s", [], "s"),
                    [req("q", [], 0), req("a", [], 1), req("q", [], 2)], [req("a", [], i) for i in range(3)]):
        d.submit(body(codec, payload), done.append, queued)
    clock.advance(1.05)  # "shell" expires behind the head
    assert [(c.tick > 0, c.index if c.methods is None else c.methods, c.sync) for c in d._queue] == [
        (True, 2, 0), (False, 3, 0), (True, 0, -1), (True, 1, 1), (True, [0, 2, 0], 0), (True, [2, 2, 2], 0)]
    d.on_reply(w, wire.Kind.RESULT, probe[1], 1_000_000, b"0")  # "q" is slow: blocking now
    assert [(c.index if c.methods is None else c.methods, c.sync) for c in d._queue] == [
        (0, 1), (1, 1), ([0, 2, 0], 2), ([2, 2, 2], 0)]  # (the head went in the place freed, the shell with it)
    assert [json.loads(f[3]) for f in w.channel.take()] == [[]] and w.outstanding == 8


# -- a single call's error answer (_answer_error) and late replies (_count_late, _unrun) -----


def answered(clock: Clock, payload: bytes, **settings: typing.Any) -> tuple[Exchange, Dispatcher, CallMetrics]:
    """A call of "m" (id 1, a 30 s deadline) its worker answers ERROR `payload` 0.25 s after it came
    (`settings`: the dispatcher's): its exchange, the dispatcher and its metrics."""
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], metrics=metrics, **settings)
    d.submit(body(codec, req("m", [], 1)), done.append)
    [frame] = w.channel.take()
    clock.advance(0.25)
    d.on_reply(w, wire.Kind.ERROR, frame[1], wire.NOT_RUN, payload)
    assert d.in_flight_calls == 0 and w.outstanding == 0
    return done[0], d, metrics


TIMED_OUT_ACKS = pytest.mark.parametrize(("ack", "data"), [
    (wire.CANCEL_ACK, {"timeout_seconds": 30.0, "started": False}),  # (found past its deadline, unstarted)
    (wire.CANCEL_ACK_RAN, {"timeout_seconds": 30.0}),
])


def timed_out_answer(data: dict[str, object]) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": 1, "error": {"code": -32001, "message": "Call timed out", "data": data}}


@TIMED_OUT_ACKS
def test_a_call_its_worker_found_past_its_deadline_is_answered_timed_out_or_refused_past_max_response_bytes(
    clock, ack, data
):
    exchange, _d, metrics = answered(clock, ack)
    assert json.loads(exchange.body()) == timed_out_answer(data) and exchange.status == 504
    assert metrics.outcomes[0] == {ErrorCode.TIMED_OUT: 1} and metrics.latency[0].sum_us == 250_000
    size = len(exchange.body())
    for settings in ({"max_response_bytes": size + 1}, {"max_outgoing_bytes": size + 1}):
        exchange, d, _metrics = answered(clock, ack, **settings)
        assert json.loads(exchange.body()) == timed_out_answer(data) and exchange.budget.held == size
    exchange, d, metrics = answered(clock, ack, max_response_bytes=size - 1)
    assert json.loads(exchange.body())["error"] == {
        "code": -32603, "message": "Internal error", "data": f"responses owed on this connection exceed max_response_bytes {size - 1}"}
    assert exchange.status == 200 and metrics.outcomes[0] == {ErrorCode.INTERNAL_ERROR: 1}
    assert metrics.latency[0].sum_us == 250_000 and d.oversize_total == 1
    exchange, d, metrics = answered(clock, ack, max_response_bytes=size + 1, max_outgoing_bytes=size - 1)
    assert json.loads(exchange.body())["error"]["data"] == (
        f"responses owed on all connections exceed max_outgoing_bytes {size - 1}")
    assert (d.oversize_total, d.outgoing.refused_total) == (0, 1)


@TIMED_OUT_ACKS
def test_a_timed_out_answer_that_fills_max_response_bytes_exactly_is_given(clock, ack, data):
    """An error's answer was counted as a result's, `"result":` one byte longer than `"error":`:
    one filling max_response_bytes or max_outgoing_bytes exactly was refused -32603."""
    size = len(answered(clock, ack)[0].body())
    for settings in ({"max_response_bytes": size}, {"max_outgoing_bytes": size}):
        exchange, _d, _metrics = answered(clock, ack, **settings)
        assert json.loads(exchange.body()) == timed_out_answer(data) and exchange.budget.held == size


def test_a_workers_error_answer_that_fills_max_response_bytes_exactly_is_given(clock):
    error = b'{"code":-32602,"message":"no"}'
    size = len(answered(clock, error)[0].body())
    exchange, _d, metrics = answered(clock, error, max_response_bytes=size)
    assert json.loads(exchange.body())["error"] == {"code": -32602, "message": "no"}
    assert exchange.budget.held == size and metrics.outcomes[0] == {ErrorCode.INVALID_PARAMS: 1}
    exchange, _d, metrics = answered(clock, error, max_response_bytes=size - 1)
    assert json.loads(exchange.body())["error"]["code"] == -32603


def test_a_workers_error_answer_keeps_its_http_status_its_code_and_counts_its_latency(clock):
    exchange, _d, metrics = answered(clock, b'{"code":-32602,"message":"no","data":{"code":5}}')
    assert json.loads(exchange.body())["error"] == {"code": -32602, "message": "no", "data": {"code": 5}}
    assert exchange.status == 200 and metrics.outcomes[0] == {ErrorCode.INVALID_PARAMS: 1}
    assert metrics.latency[0].sum_us == 250_000
    exchange, _d, metrics = answered(clock, b'{"code":-32002,"message":"a worker said so"}')
    assert exchange.status == 502 and metrics.outcomes[0] == {ErrorCode.WORKER_DIED: 1}


def test_replies_for_ids_not_pending_on_the_worker_count_each_answer_late(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"])
    other = add_worker(d, 1, concurrency=100)
    d.on_reply(w, wire.Kind.RESULT, 999, 0, b"0")
    assert (d.late_results_total, d.late_cancelled_total) == (1, 0)
    d.on_reply(w, wire.Kind.ERROR, 998, wire.NOT_RUN, wire.CANCEL_ACK)
    d.on_reply(w, wire.Kind.ERROR, 997, wire.NOT_RUN, wire.CANCEL_ACK_RAN)
    assert (d.late_results_total, d.late_cancelled_total) == (1, 2)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, 996, 0, chunk_answers(
        (0, RESULT, b"0"), (1, ERROR, wire.CANCEL_ACK), (5, ERROR, b'{"code":1,"message":"x"}')))
    assert (d.late_results_total, d.late_cancelled_total) == (3, 3)
    d.submit(body(codec, req("m", [], 1)), done.append)
    [frame] = w.channel.take() + other.channel.take()
    holder, stranger = (w, other) if frame[1] in w.channel.flows else (other, w)
    d.on_reply(stranger, wire.Kind.RESULT, frame[1], 0, b'"not yours"')  # another worker's call
    assert (d.late_results_total, holder.outstanding, done) == (4, 1, [])
    d.on_reply(holder, wire.Kind.RESULT, frame[1], 0, b'"mine"')
    assert json.loads(done[0].body())["result"] == "mine" and d.late_results_total == 4


def test_a_chunks_late_answers_are_counted_per_call_a_cancel_ack_or_a_late_result_whatever_their_place(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], timeout=1.0, cancel_grace=100.0)
    frame = chunk_of_m(d, w, codec, 3, done)
    clock.advance(1.05)
    assert [json.loads(a)["error"]["code"] for a in done[0].answers] == [-32001] * 3  # type: ignore[arg-type]
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers(
        (0, ERROR, b'{"code":-32602,"message":"no"}'), (3, ERROR, wire.CANCEL_ACK)))  # (3: a place it has not)
    assert (d.late_results_total, d.late_cancelled_total) == (1, 1)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers((1, ERROR, wire.CANCEL_ACK_RAN), (2, RESULT, b"2")))
    assert (d.late_results_total, d.late_cancelled_total, w.outstanding) == (2, 2, 0)


def notifications_chunk(clock: Clock) -> tuple[Dispatcher, typing.Any, tuple[int, int, int, bytes]]:
    """A chunk of 3 notifications of "m" (a 1 s deadline) on its worker, past its deadline."""
    d, w, codec, _done = one_worker(clock.loop, ["m"], timeout=1.0, cancel_grace=100.0)
    d.submit(body(codec, [{"jsonrpc": "2.0", "method": "m", "params": [i]} for i in range(3)]), lambda e: None)
    [frame] = w.channel.take()
    assert frame[0] == wire.Kind.CHUNK
    clock.advance(1.05)
    return d, w, frame


def test_a_chunk_of_notifications_answered_unstarted_whole_counts_each_dropped_and_an_error_none(clock):
    d, w, frame = notifications_chunk(clock)
    d.on_reply(w, wire.Kind.ERROR, frame[1], wire.NOT_RUN, wire.CANCEL_ACK)
    assert d.notifications_dropped == {ErrorCode.TIMED_OUT: 3} and w.outstanding == 0
    d, w, frame = notifications_chunk(clock)
    d.on_reply(w, wire.Kind.ERROR, frame[1], 0, b'{"code":-32603,"message":"boom"}')
    assert d.notifications_dropped == {} and w.outstanding == 0
    assert (d.late_results_total, d.late_cancelled_total) == (0, 0)  # (owed no answer: not late)


def test_a_chunk_of_notifications_answered_in_a_part_past_its_deadline_counts_nothing_late(clock):
    d, w, frame = notifications_chunk(clock)
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers((0, RESULT, b"null"), (1, ERROR, wire.CANCEL_ACK)))
    assert d.notifications_dropped == {ErrorCode.TIMED_OUT: 1} and w.outstanding == 1
    d.on_reply(w, wire.Kind.ERROR, frame[1], wire.NOT_RUN, wire.CANCEL_ACK)  # the rest, unstarted, whole
    assert d.notifications_dropped == {ErrorCode.TIMED_OUT: 2} and w.outstanding == 0
    assert (d.late_results_total, d.late_cancelled_total) == (0, 0)  # (owed no answer: not late)


def test_a_part_answering_a_place_a_chunk_of_notifications_has_not_counts_nothing(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"])
    d.submit(body(codec, [{"jsonrpc": "2.0", "method": "m", "params": [i]} for i in range(3)]), lambda e: None)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers((3, ERROR, wire.CANCEL_ACK)))
    assert d.notifications_dropped == {} and (d.late_results_total, d.late_cancelled_total) == (0, 0)


def test_a_chunk_of_notifications_counts_dropped_those_of_its_places_answered_unstarted(clock):
    d, w, frame = notifications_chunk(clock)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, ERROR, wire.CANCEL_ACK), (1, RESULT, b"null"), (2, ERROR, wire.CANCEL_ACK), (3, ERROR, wire.CANCEL_ACK)))
    assert d.notifications_dropped == {ErrorCode.TIMED_OUT: 2} and w.outstanding == 0


# -- on_reply: what a reply teaches and counts ---------------------------------------------


def reply_to(d: Dispatcher, w: typing.Any, codec: Codec, method: str, kind: int, aux: int, payload: bytes) -> None:
    """One call of `method`, answered at once."""
    d.submit(body(codec, req(method, [], "x")), lambda e: None)
    [frame] = w.channel.take()
    d.on_reply(w, kind, frame[1], aux, payload)


def test_a_sync_method_learns_from_results_and_errors_but_not_from_cancels_nor_an_async_one(clock):
    d, w, codec, _done = fast_sync(clock)
    reply_to(d, w, codec, "q", ERROR, 5_000, wire.CANCEL_ACK)  # (a cancel took no time)
    reply_to(d, w, codec, "a", RESULT, 5_000, b"0")
    assert d._sync_us == [887, -1, -1]
    reply_to(d, w, codec, "q", ERROR, 7, b'{"code":-32602,"message":"no"}')
    assert d._sync_us == [887 + ((7 - 887) >> 3), -1, -1] == [777, -1, -1]
    reply_to(d, w, codec, "q", RESULT, 777 + 1784, b"0")  # 777 + (1784 >> 3): exactly BLOCKING_US
    assert d._sync_us[0] == 1000 and d._blocking[0] == 1


def test_a_sync_method_learnt_down_to_0_us_learns_again_from_a_call(clock):
    d, w, codec, _done = fast_sync(clock)
    for _ in range(60):
        reply_to(d, w, codec, "q", RESULT, wire.AWAITED, b"0")
    assert d._sync_us[0] == 0
    reply_to(d, w, codec, "q", RESULT, 800, b"0")
    assert d._sync_us[0] == 100


def test_a_chunk_in_flight_across_a_reload_or_answered_unrun_teaches_nothing(clock):
    d, w, codec, done = fast_sync(clock)
    frame = chunk_of(d, w, codec, "qqq", done)
    d.set_methods(["q", "a"], sync_methods=["q"])  # (the same code: "q" keeps its estimate)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 3 * 100_000, all_results(3))
    frame = chunk_of(d, w, codec, "qqq", done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], wire.NOT_RUN, chunk_answers(
        *((i, ERROR, wire.CANCEL_ACK) for i in range(3))))
    assert d._sync_us == [887, -1, -1] and len(done) == 2


def test_service_times_are_observed_per_reply_but_not_for_a_handler_that_never_ran(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m", "n"], metrics=metrics)
    reply_to(d, w, codec, "m", ERROR, 700, b'{"code":-32602,"message":"no"}')
    reply_to(d, w, codec, "m", ERROR, wire.NOT_RUN, wire.CANCEL_ACK)
    d.submit(body(codec, {"jsonrpc": "2.0", "method": "m", "params": []}), done.append)
    [note] = w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, note[1], 300, b"null")  # a notification's result
    assert (metrics.service[0].sum_us, sum(metrics.service[0].counts)) == (700 + 300, 2)
    d.submit(body(codec, [req("m", [], 0), req("n", [], 1), req("m", [], 2), req("m", [], 3)]), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 4 * 250, all_results(4))
    assert (metrics.service[0].sum_us, sum(metrics.service[0].counts)) == (1000 + 3 * 250, 2 + 3)
    assert (metrics.service[1].sum_us, sum(metrics.service[1].counts)) == (250, 1)


def test_a_result_that_fills_max_response_bytes_exactly_is_given(clock):
    for setting in ("max_response_bytes", "max_outgoing_bytes"):
        size = len(b'{"jsonrpc":"2.0","id":1,"result":"abc"}')
        results = []
        for limit in (size, size - 1):
            d, w, codec, done = one_worker(clock.loop, ["m"], **{setting: limit})
            d.submit(body(codec, req("m", [], 1)), done.append)
            [frame] = w.channel.take()
            d.on_reply(w, wire.Kind.RESULT, frame[1], 0, b'"abc"')
            results.append(json.loads(done[0].body()).get("result"))
        assert results == ["abc", None], setting


def test_the_answers_of_a_batchs_single_calls_are_counted_in_its_size_its_connections_and_all(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"])
    budget = ResponseBudget(d.outgoing)
    d.submit(body(codec, [req("m", [], 1), req("m", [], 2)]), done.append, budget)  # (2: not a chunk)
    first, second = w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, first[1], 0, b'"a"')
    d.on_reply(w, wire.Kind.RESULT, second[1], 0, b'"bb"')
    sizes = [len(b'{"jsonrpc":"2.0","id":1,"result":"a"}'), len(b'{"jsonrpc":"2.0","id":2,"result":"bb"}')]
    assert [len(a) for a in done[0].answers] == sizes  # type: ignore[arg-type]
    assert (done[0].size, budget.held, d.outgoing.held) == (sum(sizes),) * 3


def test_with_sync_routing_off_a_blocking_sync_calls_answer_leaves_no_worker_counted_blocked(clock):
    d, w, codec, done = one_worker(clock.loop, ["s"], 2, sync_prefetch=2)  # (1 + 2 > 2 places: routing off)
    d.set_methods(["s"], sync_methods=["s"])
    d.submit(body(codec, req("s", [], 1)), done.append)
    [frame] = w.channel.take()
    assert (w.blocked, w.sync_calls, d._blocked, w.limit) == (False, 1, 0, 2)
    d.on_reply(w, wire.Kind.RESULT, frame[1], 5_000, b"0")
    assert (w.blocked, w.sync_calls, d._blocked, w.limit) == (False, 0, 0, 2)


def test_a_chunk_part_for_a_chunk_the_worker_does_not_hold_is_ignored(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"])
    d.on_reply(w, wire.Kind.CHUNK_PART, 999, 0, all_results(2))
    frame = chunk_of_m(d, w, codec, 3, done)
    other = add_worker(d, 1, concurrency=1)
    d.on_reply(other, wire.Kind.CHUNK_PART, frame[1], 0, all_results(2))
    assert (w.outstanding, other.outstanding, d.in_flight_calls, d.late_results_total) == (3, 0, 3, 0)
    assert done == [] and d._pending[frame[1]].weight == 3


def test_a_chunk_part_frees_places_its_connection_held_back_for_its_share(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], 8)  # (4 places a connection)
    budget = ResponseBudget(d.outgoing)
    d.submit(body(codec, [req("m", [i], i) for i in range(4)]), done.append, budget)
    [frame] = w.channel.take()
    d.submit(body(codec, req("m", ["next"], "next")), done.append, budget)
    assert d.queued_calls == 1 and d.held_calls == 1 and not w.channel.take()
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers((0, RESULT, b"0")))
    [sent] = w.channel.take()
    assert json.loads(sent[3]) == ["next"] and (d.queued_calls, budget.in_flight, w.outstanding) == (0, 4, 4)


# -- broker/calls.py and chunk.py: what a queued call holds, a chunk's first place ---------


def test_a_queued_call_keeps_no_reference_to_its_request_body_and_a_chunk_counts_its_ids(clock):
    d, _w, codec, _done = one_worker(clock.loop, ["m"], 4, connection_share=1.0)
    for i in range(4):  # the worker full
        d.submit(body(codec, req("m", [], i)), lambda e: None)
    data = json.dumps(req("m", [1, 2], "q"), separators=(",", ":")).encode()
    unreferenced = sys.getrefcount(data)
    d.submit(codec.decode(data), lambda e: None)
    assert d.queued_calls == 1 and sys.getrefcount(data) == unreferenced  # (its id and params copied)
    assert d.queued_bytes == len(b'[1,2]"q"')
    d.submit(body(codec, [req("m", [i], f"id{i}") for i in range(3)]), lambda e: None)
    [chunk_call] = [c for c in d._queue if c.methods is not None]
    assert d.queued_bytes == len(b'[1,2]"q"') + len(chunk_call.params) + 3 * len(b'"id0"')


def test_a_chunks_call_in_slot_0_is_a_call_not_a_notification():
    entries = [(0, Request("2.0", "a", params=b"[]", id=b"1"), Route(1, 1.0))]
    assert chunk.encode_requests(entries)[0] == CALL_ENTRY.pack(1, 0, 1, 2) + b"1[]"


# -- a call run alone (broker/isolation.py) answered: _ran_alone -------------------------------


def test_a_call_run_alone_frees_its_method_only_when_its_handler_ran(clock, caplog):
    d, w, codec, done = one_worker(clock.loop, ["m", "boom"], 10)
    d.submit(body(codec, req("boom", [], "b")), done.append)
    d.submit(body(codec, req("m", [], "m")), done.append)
    assert len(w.channel.take()) == 2
    restarted(d, w)  # both die together: bystanders, each owes one answer run alone
    assert d.isolated == {"m": 1, "boom": 1}
    replies = [
        (ERROR, 0, wire.CANCEL_ACK),  # cancelled once started: it did not answer (its worker lived on)
        (ERROR, wire.NOT_RUN, b'{"code":-32602,"message":"no"}'),  # (its handler never ran)
        (ERROR, 5, b'{"code":-32602,"message":"no"}'),  # ran, and its worker lived: answered
    ]
    with caplog.at_level("INFO", logger="broker.dispatch"):
        for n, (kind, aux, payload) in enumerate(replies):
            d.submit(body(codec, req("m", [], n)), done.append)
            [frame] = w.channel.take()
            assert (w.blocked, w.limit) == (True, 0)  # (alone: it takes nothing else)
            d.on_reply(w, kind, frame[1], aux, payload)
            assert (w.blocked, w.limit, w.outstanding) == (False, 10, 0)
            assert d.isolated == ({"m": 1, "boom": 1} if n < 2 else {"boom": 1})
    assert [r.getMessage() for r in caplog.records if r.levelname == "INFO"] == [
        "m: its calls run as any again (as many of them as asked answered, run alone)"]


def test_a_call_run_alone_given_back_goes_again_at_once_alone(clock):
    d, w, codec, done = one_worker(clock.loop, ["m", "boom"], 10)
    d.submit(body(codec, req("boom", [], "b")), done.append)
    d.submit(body(codec, req("m", [], "m")), done.append)
    w.channel.take()
    restarted(d, w)
    d.submit(body(codec, req("m", ["again"], 1)), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.RETURN, frame[1], 0, frame[3])  # (a worker of another broker's would)
    [again] = w.channel.take()
    assert json.loads(again[3]) == ["again"] and d.returned_total == 1
    assert (w.blocked, w.limit, w.outstanding, d._blocked) == (True, 0, 1, 1)  # alone again
    d.on_reply(w, wire.Kind.RESULT, again[1], 5, b'"ok"')
    assert json.loads(done[-1].body())["result"] == "ok" and d.isolated == {"boom": 1}


# -- calls given back (wire.RETURN): what they free, and what they teach when they run again ----


def test_with_sync_routing_off_a_blocking_sync_call_given_back_leaves_no_worker_counted_blocked(clock):
    d, w, codec, done = one_worker(clock.loop, ["s"], 2, sync_prefetch=2)  # (1 + 2 > 2 places: routing off)
    d.set_methods(["s"], sync_methods=["s"])
    d.submit(body(codec, req("s", [], 1)), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.RETURN, frame[1], 0, frame[3])  # (a worker of another broker's would)
    [again] = w.channel.take()
    assert (w.blocked, w.sync_calls, d._blocked, w.limit, w.outstanding) == (False, 1, 0, 2, 1)
    assert again[3] == frame[3] and d.returned_total == 1


def test_a_call_given_back_teaches_its_methods_time_when_it_runs_again(clock):
    d, w, codec, done = fast_sync(clock)
    d.submit(body(codec, req("q", [], 1)), done.append)
    [frame] = w.channel.take()
    assert w.channel.flows[frame[1]] & wire.RETURNABLE
    d.on_reply(w, wire.Kind.RETURN, frame[1], 0, frame[3])
    [again] = w.channel.take()  # (as a blocking sync call)
    d.on_reply(w, wire.Kind.RESULT, again[1], 100_000, b"0")
    assert d._sync_us[0] == 887 + ((100_000 - 887) >> 3) and d._blocking[0] == 1


def test_calls_given_back_from_a_chunk_put_their_connection_held_for_its_share_back_in_turn(clock):
    d, w, codec, done = fast_sync(clock)  # (one worker of 100 places: 50 a connection)
    budget = ResponseBudget(d.outgoing)
    d.submit(body(codec, [req("q", [i], i) for i in range(50)]), done.append, budget)
    [frame] = w.channel.take()
    d.submit(body(codec, req("a", ["next"], "next")), done.append, budget)
    assert d.held_calls == 1 and not w.channel.take()
    d.on_reply(w, wire.Kind.RETURN, frame[1], 48, _entries_from(frame[3], 48))  # its last two, unstarted
    [single] = w.channel.take()  # the first of them, at once: a blocking sync call, one a connection
    assert json.loads(single[3]) == [48] and (budget.in_flight, budget.blocking, d.queued_calls) == (49, 1, 2)


# -- broker/deadlines.py: one timer for every deadline -----------------------------------------


class TimerLoop:
    """What a DeadlineWheel asks of its loop, recorded: its clock (`now`, s) and the timers armed,
    (when, callback, handle) each; a test fires one by calling its callback."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.timers: list[tuple[float, typing.Callable[[], None], asyncio.TimerHandle]] = []

    def time(self) -> float:
        return self.now

    def get_debug(self) -> bool:  # (asyncio.TimerHandle asks)
        return False

    def call_at(self, when: float, callback: typing.Callable[[], None]) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(when, callback, (), typing.cast(asyncio.AbstractEventLoop, self))
        self.timers.append((when, callback, handle))
        return handle


def test_one_timer_wakeup_expires_every_tick_due_and_a_later_deadline_arms_the_timer_again():
    loop = TimerLoop(100.0)
    expired: list[int] = []
    wheel = DeadlineWheel(typing.cast(asyncio.AbstractEventLoop, loop), lambda c: expired.append(c.call_id), 0.5)
    first, second = make_call(1, 1.0), make_call(2, 2.0)
    wheel.add(first, loop.now)
    wheel.add(second, loop.now)
    assert (first.tick, second.tick) == (203, 205) and [t[0] for t in loop.timers] == [101.5]
    loop.now = 103.0  # the loop woke late: both due
    loop.timers[0][1]()
    assert expired == [1, 2] and (first.tick, second.tick, len(wheel)) == (0, 0, 0) and len(loop.timers) == 1
    third = make_call(3, 1.0)
    wheel.add(third, loop.now)
    assert third.tick == 209 and [t[0] for t in loop.timers[1:]] == [104.5]


def test_a_reserved_worker_that_empties_while_its_call_cannot_go_takes_calls_again(clock):
    d = Dispatcher(clock.loop, sync_prefetch=1)
    d.set_methods(["m", "boom", "s"], sync_methods=["s"])
    workers = [add_worker(d, slot, concurrency=10) for slot in range(4)]  # (2 blocking calls a connection)
    codec = Codec()
    d.submit(body(codec, req("boom", [], "caught")), lambda e: None)
    [dead] = [w for w in workers if w.channel.take()]
    restarted(d, dead)  # caught alone: its calls wait for a worker of their own
    for i in range(4):  # every worker busy
        d.submit(body(codec, req("m", [], i)), lambda e: None, ResponseBudget(d.outgoing))
    busy = {w: w.channel.take()[0][1] for w in workers}
    greedy = ResponseBudget(d.outgoing)
    d.submit(body(codec, req("s", [], "slow")), lambda e: None, greedy)  # a blocking sync call: 1 of its 2
    d.submit(body(codec, req("boom", [], "b")), lambda e: None, greedy)
    [reserved] = [w for w in workers if w.limit == 0]  # none idle: the least loaded takes nothing more
    assert d.queued_calls == 1 and greedy.blocking == 1
    d.worker_unready(next(w for w in workers if w is not reserved and not w.blocked))  # now 1 a connection
    d.on_reply(reserved, wire.Kind.RESULT, busy[reserved], 0, b"0")  # it empties: "b" may not go (greedy's 1)
    assert (reserved.limit, reserved.outstanding, d.queued_calls) == (10, 0, 1) and reserved not in d._alone
    d.submit(body(codec, req("m", [], "next")), lambda e: None, ResponseBudget(d.outgoing))
    assert len(reserved.channel.take()) == 1 and reserved.outstanding == 1  # (the idle one: the least loaded)
