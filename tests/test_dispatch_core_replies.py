"""The dispatcher core in memory: replies.py, deadlines.py, calls.py and chunk.py (how a
reply, a deadline or a failure becomes the call's one answer), held by exact values: what
`make mutate` found the other in-memory tests did not hold. The set-up is test_dispatch_core.py's.
"""

from __future__ import annotations

import json
import typing

import pytest
from test_dispatch import _entries_from, body, req
from test_dispatch_core import Clock, chunk_answers, one_worker

from broker import wire
from broker.answers import Exchange, ResponseBudget
from broker.dispatch import Dispatcher
from broker.jsonrpc import Codec, ErrorCode
from broker.metrics import OK, CallMetrics
from broker.replies import error_code
from broker.wire import RESULT


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


def test_a_second_answer_to_a_chunks_call_in_the_same_reply_is_dropped_and_counted_once(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], metrics=metrics)
    frame = chunk_of_m(d, w, codec, 3, done)
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, RESULT, b"0"), (1, RESULT, b"1"), (2, RESULT, b"2"), (0, RESULT, b'"again"')))
    assert [json.loads(a)["result"] for a in done[0].answers] == [0, 1, 2]  # type: ignore[arg-type]
    assert metrics.outcomes[0] == {OK: 3} and done[0].remaining == 0 and d.in_flight_calls == 0


@pytest.mark.xfail(strict=True, reason="_fill_chunk's second walk (some results answered before) counts every "
                   "RESULT entry of the payload, a call's second answer too, though its slot kept the first")
def test_a_second_answer_to_a_chunks_call_answered_in_an_earlier_part_is_not_counted_again(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], metrics=metrics)
    frame = chunk_of_m(d, w, codec, 3, done)
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers((0, RESULT, b'"first"')))
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, RESULT, b'"again"'), (1, RESULT, b"1"), (2, RESULT, b"2")))
    assert [json.loads(a)["result"] for a in done[0].answers] == ["first", 1, 2]  # type: ignore[arg-type]
    assert metrics.outcomes[0] == {OK: 3}


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
