"""The dispatcher core in memory: dispatch.py and membership.py (a call's way from submit to
its end, workers joining, leaving, hanging and reloading), held by exact values: what
`make mutate` found the other in-memory tests did not hold. The set-up is test_dispatch_core.py's.
"""

from __future__ import annotations

import json
import typing

import pytest
import test_dispatch_core
from test_dispatch import add_worker, body, req
from test_dispatch_core import Clock, Process, codes, one_worker

from broker import chunk, wire
from broker.answers import Exchange, ResponseBudget
from broker.dispatch import Dispatcher
from broker.jsonrpc import Codec, ErrorCode
from broker.metrics import CallMetrics

Frame = tuple[int, int, int, bytes]
clock = test_dispatch_core.clock  # (the fixture: time injected)


def note(method: str, *params: object) -> dict[str, object]:
    """A notification of `method`."""
    return {"jsonrpc": "2.0", "method": method, "params": list(params)}


def error_of(exchange: Exchange | None) -> object:
    """The error object of a single call's answer."""
    assert exchange is not None
    return json.loads(exchange.body())["error"]


def params_of(frame: Frame) -> list[object]:
    """The params of each call a frame carries, in its order: a CALL's, or each of a CHUNK's."""
    if frame[0] != wire.Kind.CHUNK:
        return [json.loads(frame[3])]
    found, pos = [], 0
    while pos < len(frame[3]):
        _method, _notification, start, pos = chunk.read_call(frame[3], pos)
        found.append(json.loads(frame[3][start:pos]))
    return found


def batch(method: str, *ids: int) -> list[dict[str, object]]:
    """A batch of calls of `method`, each with its id as its params ([id])."""
    return [req(method, [i], i) for i in ids]


# -- the constructor's defaults, seen in what they do -------------------------------------


def test_by_default_a_call_times_out_in_30_s_and_its_worker_is_hung_10_s_later(clock, caplog):
    d = Dispatcher(clock.loop)
    assert d.answered_within() == 40.0
    d.set_methods(["m"])
    w = add_worker(d, 0, concurrency=4)
    w.process = Process()
    done: list[Exchange] = []
    d.submit(body(Codec(), req("m", [], 1)), done.append)
    [frame] = w.channel.take()
    clock.advance(29.9)
    assert done == []
    clock.advance(0.2)
    assert error_of(done[0]) == {"code": -32001, "message": "Call timed out", "data": {"timeout_seconds": 30.0}}
    assert w.channel.take() == [(wire.Kind.CANCEL, frame[1], 0, b"")]
    clock.advance(9.8)
    assert w.process.kills == 0
    clock.advance(0.2)
    assert w.process.kills == 1 and w.kill_reason == "hung: no answer 10.0 s after a cancelled call"


def test_by_default_10000_calls_wait_and_the_next_is_refused_and_logged_with_both_bounds(clock, caplog):
    d, w, codec, done = one_worker(clock.loop, ["m"], 1)
    budget = ResponseBudget(d.outgoing)
    for i in range(10_001):
        d.submit(body(codec, req("m", [], i)), done.append, budget)
    assert len(w.channel.take()) == 1 and d.queued_calls == 10_000 and done == []
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        refused = d.submit(body(codec, req("m", [], "one more")), done.append, budget)
    assert error_of(refused)["code"] == ErrorCode.OVERLOADED  # type: ignore[index]
    assert [r.getMessage() for r in caplog.records] == [
        "queue full: 1 call(s) refused -32000 (Server overloaded); max_queue 10000 calls, max_queue_bytes 67108864"
        " (how many more: a line every 60 s while it goes on)"
    ]


def test_by_default_a_worker_holds_4_mib_of_large_params_in_flight(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"])
    mib = 1024 * 1024

    def large(size: int) -> None:  # a call whose params are `size` bytes as sent, on a connection of its own
        d.submit(body(codec, req("m", ["x" * (size - 4)], size)), lambda e: None, ResponseBudget(d.outgoing))

    large(3 * mib)
    large(mib)  # 4 MiB in all: the bound, exactly
    assert [len(f[3]) for f in w.channel.take()] == [3 * mib, mib] and w.heavy == 4 * mib
    large(16 * 1024)  # past it: waits
    assert w.channel.take() == [] and d.queued_calls == 1
    large(16 * 1024 - 1)  # not large: goes
    assert [len(f[3]) for f in w.channel.take()] == [16 * 1024 - 1] and w.heavy == 4 * mib


def test_by_default_one_connection_holds_half_the_places_and_one_blocked_worker_takes_nothing_more(clock):
    d = Dispatcher(clock.loop)
    d.set_methods(["m", "s"], sync_methods=["s"])  # "s": sync, unmeasured, so blocking
    w = add_worker(d, 0, concurrency=4)
    codec = Codec()
    one, other = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
    for i in range(3):
        d.submit(body(codec, req("m", [], i)), lambda e: None, one)
    assert len(w.channel.take()) == 2 and d.queued_calls == 1  # its share: 2 of 4
    d.submit(body(codec, req("s", [], "s")), lambda e: None, other)
    d.submit(body(codec, req("m", [], "after")), lambda e: None, other)
    assert [f[2] for f in w.channel.take()] == [1] and w.limit == 1  # blocked: a prefetch of 0
    assert d.queued_calls == 2


def test_by_default_a_connection_may_be_owed_32_mib_and_all_of_them_2_to_the_62(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"])
    full, fresh = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
    full.hold(32 * 1024 * 1024 - 40)  # (answers it made itself, not written yet)
    d.submit(body(codec, req("m", [], 1)), done.append, full)
    d.submit(body(codec, req("m", [], 2)), done.append, full)
    first, second = w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, first[1], 0, b"1")  # 33 bytes: fits
    d.on_reply(w, wire.Kind.RESULT, second[1], 0, b"1")  # 40 more: past it
    assert json.loads(done[0].body())["result"] == 1
    assert error_of(done[1])["data"] == "response exceeds max_response_bytes 33554432"  # type: ignore[index]
    full.release(full.held, False)
    d.outgoing.held = (1 << 62) - 40  # (owed on other connections)
    for i in (3, 4):
        d.submit(body(codec, req("m", [], i)), done.append, fresh)
    third, fourth = w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, third[1], 0, b"1")
    d.on_reply(w, wire.Kind.RESULT, fourth[1], 0, b"1")
    assert json.loads(done[2].body())["result"] == 1
    assert error_of(done[3])["data"] == (  # type: ignore[index]
        "responses owed on all connections exceed max_outgoing_bytes 4611686018427387904")


# -- submit: what a body's elements are counted as ---------------------------------------


def test_notifications_are_counted_per_method_across_bodies_and_unknown_ones_under_other(clock):
    metrics = CallMetrics()
    d, w, codec, _done = one_worker(clock.loop, ["m"], metrics=metrics)
    assert d.submit(body(codec, [note("m", 1), note("m", 2)]), lambda e: None) is None
    assert d.submit(body(codec, note("m", 3)), lambda e: None) is None
    assert metrics.notifications[0] == 3 and len(w.channel.take()) == 3
    other = metrics.other
    assert d.submit(body(codec, note("nope")), lambda e: None) is None  # an unknown method's, alone
    assert metrics.notifications[other] == 1
    d.submit(body(codec, note("nope")), lambda e: None)
    assert metrics.notifications[other] == 2 and metrics.outcomes[other] == {}


def test_a_call_of_an_unknown_method_alone_in_its_body_is_counted_under_other(clock):
    metrics = CallMetrics()
    d, _w, codec, _done = one_worker(clock.loop, ["m"], metrics=metrics)
    refused = d.submit(body(codec, req("nope", [], 1)), lambda e: None)
    assert error_of(refused) == {"code": -32601, "message": "Method not found"}
    assert metrics.outcomes[metrics.other] == {ErrorCode.METHOD_NOT_FOUND: 1}
    assert metrics.notifications[metrics.other] == 0


# -- a batch cut into chunks ----------------------------------------------------------------


def test_a_batch_of_calls_and_notifications_goes_in_chunks_of_calls_and_chunks_of_notifications(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"])
    exchange = d.submit(body(codec, [req("m", [0], 0), note("m", 1), req("m", [2], 2), note("m", 3)]),
                        lambda e: None)
    assert exchange is not None and exchange.remaining == 2
    assert [(f[0], f[2], params_of(f)) for f in w.channel.take()] == [
        (wire.Kind.CHUNK, 2, [[0], [2]]), (wire.Kind.CHUNK, 2, [[1], [3]])]


@pytest.mark.parametrize("sync_prefetch", [0, 10])  # (10: a blocked worker's limit past the concurrency, no sync routing)
def test_a_batch_of_an_isolated_methods_calls_goes_one_by_one_each_to_run_alone(clock, sync_prefetch):
    d, w, codec, done = one_worker(clock.loop, ["m", "n"], 10, sync_prefetch=sync_prefetch)
    d.submit(body(codec, req("m", [], "died")), done.append)
    w.channel.take()
    d.worker_lost(w, "killed by SIGKILL")
    w.channel = type(w.channel)()
    d.worker_ready(w)
    assert d.isolated == {"m": 1}
    exchange = d.submit(body(codec, batch("m", 0, 1, 2)), done.append)
    assert exchange is not None and exchange.remaining == 3
    assert [(f[0], params_of(f)) for f in w.channel.take()] == [(wire.Kind.CALL, [[0]])]
    assert d.queued_calls == 2


def two_workers(clock: Clock, **settings: typing.Any) -> tuple[Dispatcher, list[typing.Any], Codec]:
    """A dispatcher (`settings`) serving "a" and "b" on two ready workers of 4 places: one
    connection's share is 4 places, a chunk past it 2 calls."""
    d = Dispatcher(clock.loop, **settings)
    d.set_methods(["a", "b"])
    return d, [add_worker(d, slot, concurrency=4) for slot in range(2)], Codec()


def sent(workers: list[typing.Any]) -> list[list[object]]:
    """The params of the calls of each frame sent to `workers`, in order of their call ids."""
    frames = sorted((f for w in workers for f in w.channel.take()), key=lambda f: f[1])
    return [params_of(f) for f in frames]


def test_a_batch_that_fits_its_connections_share_exactly_is_dealt_out_over_the_workers(clock):
    d, workers, codec = two_workers(clock)
    d.submit(body(codec, batch("a", 0, 1, 2, 3)), lambda e: None)
    assert sent(workers) == [[[0], [2]], [[1], [3]]]


def test_a_batch_past_what_its_connection_has_left_of_its_share_goes_in_order(clock):
    d, workers, codec = two_workers(clock)
    budget = ResponseBudget(d.outgoing)
    for i in (10, 11):
        d.submit(body(codec, req("a", [i], i)), lambda e: None, budget)
    d.submit(body(codec, batch("a", 0, 1, 2, 3)), lambda e: None, budget)  # 2 places left of 4
    assert sent(workers) == [[[10]], [[11]], [[0], [1]]] and d.queued_calls == 2


def test_a_batchs_second_deadline_group_has_what_the_first_left_of_the_share(clock):
    d, workers, codec = two_workers(clock, method_timeouts={"b": 5.0})
    budget = ResponseBudget(d.outgoing)
    d.submit(body(codec, [*batch("a", 0, 1, 2), *batch("b", 3, 4)]), lambda e: None, budget)
    first = sorted((f for w in workers for f in w.channel.take()), key=lambda f: f[1])
    assert [params_of(f) for f in first] == [[[0], [2]], [[1]]] and d.queued_calls == 2
    chunk_frame = first[0]
    holder = next(w for w in workers if chunk_frame[1] in w.channel.deadlines)
    d.on_reply(holder, wire.Kind.ERROR, chunk_frame[1], 0, b'{"code":1,"message":"x"}')
    assert sent(workers) == [[[3], [4]]]  # "b"'s 2 past the 1 place left: one chunk, in order


def test_a_chunk_of_blocking_sync_calls_without_sync_routing_counts_each_on_its_worker(clock):
    d = Dispatcher(clock.loop, sync_prefetch=4, connection_share=1.0)  # a blocked worker's limit 5 > 4: no sync routing
    d.set_methods(["s"], sync_methods=["s"])
    w = add_worker(d, 0, concurrency=4)
    budget = ResponseBudget(d.outgoing)
    d.submit(body(Codec(), batch("s", 0, 1, 2)), lambda e: None, budget)
    [frame] = w.channel.take()
    assert (frame[0], frame[2]) == (wire.Kind.CHUNK, 3)
    assert (w.sync_calls, budget.blocking, w.blocked, w.limit) == (3, 3, False, 4)


# -- a call's end: timed out, shed -------------------------------------------------------------


def test_a_call_that_timed_out_queued_is_said_never_to_have_started(clock):
    d, _w, codec, done = one_worker(clock.loop, ["m"], 1, timeout=1.0)
    budget = ResponseBudget(d.outgoing)
    d.submit(body(codec, req("m", [], "sent")), done.append, budget)
    d.submit(body(codec, req("m", [], "queued")), done.append, budget)
    clock.advance(1.05)
    assert [(json.loads(e.body())["id"], error_of(e)["data"]) for e in done] == [  # type: ignore[index]
        ("sent", {"timeout_seconds": 1.0}), ("queued", {"timeout_seconds": 1.0, "started": False})]


def test_notifications_that_expire_queued_are_counted_dropped_a_chunk_by_its_notifications(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"], 4, timeout=1.0, connection_share=1.0)
    for i in range(4):
        d.submit(body(codec, req("m", [], i)), lambda e: None)
    budget = ResponseBudget(d.outgoing)
    assert d.submit(body(codec, [note("m", i) for i in range(3)]), lambda e: None, budget) is None
    assert d.submit(body(codec, note("m", 3)), lambda e: None, budget) is None
    assert len(w.channel.take()) == 4 and d.queued_calls == 4 and len(d._queue) == 2  # (a chunk of 3, and 1)
    clock.advance(1.05)
    assert d.notifications_dropped == {ErrorCode.TIMED_OUT: 4} and d.queued_calls == 0


def test_a_connection_that_floods_the_queue_still_sheds_for_another_after_its_head_expired(clock):
    d, _w, codec, done = one_worker(clock.loop, ["m", "short"], 1, max_queue=5, timeout=10.0,
                                   method_timeouts={"short": 1.0})
    d.submit(body(codec, req("m", [], "busy")), done.append)
    flood, other = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
    for method, id_ in (("short", "head"), ("m", 1), ("m", 2), ("m", 3), ("m", 4)):
        d.submit(body(codec, req(method, [], id_)), done.append, flood)
    clock.advance(1.05)  # its head expires, and leaves the queue at once
    assert codes(done) == [ErrorCode.TIMED_OUT] and d.queued_calls == 4
    d.submit(body(codec, req("m", [], "o1")), done.append, other)
    d.submit(body(codec, req("m", [], "o2")), done.append, other)  # the queue full: the flood's newest goes
    assert [(json.loads(e.body())["id"], error_of(e)["code"]) for e in done[1:]] == [  # type: ignore[index]
        (4, ErrorCode.OVERLOADED)]
    assert d.queued_calls == 5 and (flood.queued, other.queued) == (3, 2)


def shed_setup(clock: Clock) -> tuple[Dispatcher, typing.Callable[[object], None]]:
    """A dispatcher whose one worker is busy and whose queue takes nothing (max_queue 0), and
    a function that submits a body there, on a connection of its own: shed."""
    d, _w, codec, _done = one_worker(clock.loop, ["m"], 1, max_queue=0, timeout=1000.0)
    d.submit(body(codec, req("m", [], "busy")), lambda e: None)

    def shed(payload: object) -> None:
        d.submit(body(codec, payload), lambda e: None, ResponseBudget(d.outgoing))

    return d, shed


def test_each_interval_that_shed_calls_logs_them_at_its_end_and_starts_another(clock, caplog):
    _d, shed = shed_setup(clock)
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        shed(req("m", [], 1))  # said at once
        clock.advance(10.0)
        shed(req("m", [], 2))
        clock.advance(50.0)  # (at 60: its 1)
        clock.advance(5.0)
        shed(req("m", [], 3))
        clock.advance(55.0)  # (at 120: its 1)
        shed(req("m", [], 4))
        shed(note("m"))
        shed(note("m"))
        clock.advance(60.0)  # (at 180: its 1 and 2)
    assert [r.getMessage() for r in caplog.records] == [
        "queue full: 1 call(s) refused -32000 (Server overloaded); max_queue 0 calls, max_queue_bytes 67108864"
        " (how many more: a line every 60 s while it goes on)",
        "queue full: 1 call(s) refused -32000 (Server overloaded) in the last 60 s",
        "queue full: 1 call(s) refused -32000 (Server overloaded) in the last 60 s",
        "queue full: 1 call(s) refused -32000 (Server overloaded) and 2 notification(s) dropped in the last 60 s",
    ]


# -- submit: a body's exchange and its status ---------------------------------------------


def test_a_single_calls_exchange_says_200_when_answered_and_its_error_status_when_not(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], 1, timeout=1.0, max_queue=1)
    answered = d.submit(body(codec, req("m", [], 1)), done.append)
    d.on_reply(w, wire.Kind.RESULT, w.channel.take()[0][1], 0, b"1")
    assert answered is not None and done == [answered] and answered.status == 200
    d.submit(body(codec, req("m", [], "busy")), done.append)
    expired = d.submit(body(codec, req("m", [], "expired")), done.append)  # queued, then timed out
    refused = d.submit(body(codec, req("m", [], "refused")), done.append)  # the queue full: at once
    assert refused is not None and refused.remaining == 0 and refused.status == 503
    clock.advance(1.05)
    assert expired is not None and expired.status == 504 and error_of(expired)["code"] == -32001  # type: ignore[index]


def test_a_single_invalid_request_is_answered_at_once_with_its_400(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"])
    refused = d.submit(body(codec, {"jsonrpc": "2.0", "id": 1}), done.append)
    assert refused is not None and (refused.remaining, refused.status) == (0, 400)
    assert error_of(refused)["code"] == ErrorCode.INVALID_REQUEST and w.channel.take() == []  # type: ignore[index]


def test_a_batch_of_two_calls_goes_as_two_calls_and_its_exchange_says_200(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"])
    exchange = d.submit(body(codec, batch("m", 0, 1)), done.append)
    frames = w.channel.take()
    assert [(f[0], params_of(f)) for f in frames] == [(wire.Kind.CALL, [[0]]), (wire.Kind.CALL, [[1]])]
    d.on_reply(w, wire.Kind.RESULT, frames[0][1], 0, b"0")
    d.on_reply(w, wire.Kind.ERROR, frames[1][1], 0, b'{"code":-32602,"message":"no"}')
    assert exchange is not None and done == [exchange] and exchange.status == 200


def test_notifications_too_deep_to_forward_are_counted_dropped_and_in_their_batchs_size(clock):
    metrics = CallMetrics()
    d, w, codec, _done = one_worker(clock.loop, ["m"], metrics=metrics)
    deep = b'{"jsonrpc":"2.0","method":"m","params":' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert d.submit(codec.decode(deep), lambda e: None) is None
    assert d.notifications_dropped == {ErrorCode.INVALID_REQUEST: 1}
    call = json.dumps(req("m", [], 1)).encode()
    exchange = d.submit(codec.decode(b"[" + deep + b"," + call + b"]"), lambda e: None)
    assert exchange is not None and exchange.remaining == 1 and len(w.channel.take()) == 1
    assert d.notifications_dropped == {ErrorCode.INVALID_REQUEST: 2}
    assert (metrics.batch_size.sum, sum(metrics.batch_size.counts)) == (2.0, 1)
