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
from broker.routing import BLOCKING_US

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
    assert error_of(done[1])["data"] == "responses owed on this connection exceed max_response_bytes 33554432"  # type: ignore[index]
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


def test_with_max_worker_params_bytes_0_no_params_count_as_large(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"], max_worker_params_bytes=0)
    budget = ResponseBudget(d.outgoing)
    d.submit(body(codec, req("m", ["x" * 20_000], 1)), lambda e: None, budget)
    d.submit(body(codec, req("m", [], 2)), lambda e: None, budget)
    assert len(w.channel.take()) == 2
    assert (w.heavy, budget.heavy, dict(w.heavy_calls)) == (0, 0, {})


def test_before_any_method_table_every_call_is_of_an_unknown_method(clock):
    d = Dispatcher(clock.loop)
    refused = d.submit(body(Codec(), req("m", [], 1)), lambda e: None)
    assert error_of(refused) == {"code": -32601, "message": "Method not found"}


def test_the_grace_period_is_said_to_run_from_the_drains_start_to_its_end(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"])
    assert d.in_grace is False
    d.submit(body(codec, req("m", [], 1)), lambda e: None)
    drain = clock.loop.create_task(d.drain(30.0))
    clock.advance(0.0)
    assert d.in_grace is True
    d.on_reply(w, wire.Kind.RESULT, w.channel.take()[0][1], 0, b"1")
    clock.advance(0.0)
    assert drain.done() and d.in_grace is False


@pytest.mark.parametrize("share", [0, 0.0, -0.5, 1.01, float("nan")])
def test_a_connection_share_not_above_0_and_at_most_1_is_refused_at_construction(clock, share):
    with pytest.raises(ValueError) as refused:
        Dispatcher(clock.loop, connection_share=share)
    assert str(refused.value) == f"connection_share = {share!r}: it must be > 0 and <= 1"
    assert Dispatcher(clock.loop, connection_share=1).answered_within() == 40.0


def test_a_blocking_sync_call_made_before_any_worker_is_ready_waits_for_one(clock):
    d = Dispatcher(clock.loop)
    d.set_methods(["s"], sync_methods=["s"])  # unmeasured: blocking
    exchange = d.submit(body(Codec(), req("s", [], 1)), lambda e: None)
    assert exchange is not None and exchange.remaining == 1 and d.queued_calls == 1
    w = add_worker(d, 0, concurrency=2)
    assert [f[1] for f in w.channel.take()] == [1] and w.blocked


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
    assert w.sync_until == clock.now + 3 * BLOCKING_US * 1e-6  # (expected to end: each call's estimate, added)
    assert w.channel.flows[frame[1]] == budget.flow  # (never RETURNABLE: nothing is given back)
    d.submit(body(Codec(), req("s", [], "one more")), lambda e: None, budget)
    assert len(w.channel.take()) == 1 and (w.sync_calls, budget.blocking) == (4, 4)


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


# -- _start: where a new call goes, or why not ---------------------------------------------


def test_a_connections_blocking_sync_calls_take_its_share_of_the_workers_and_its_async_calls_go_past_it(clock):
    metrics = CallMetrics()
    d = Dispatcher(clock.loop, sync_prefetch=1, metrics=metrics)  # a blocked worker takes one more call
    d.set_methods(["m", "s"], sync_methods=["s"])  # "s": blocking (unmeasured)
    workers = [add_worker(d, slot, concurrency=4) for slot in range(4)]  # its share: 2 workers
    codec = Codec()
    own = ResponseBudget(d.outgoing)
    for i in range(2):
        d.submit(body(codec, req("s", [], i)), lambda e: None, own)
    assert sorted(len(w.channel.take()) for w in workers) == [0, 0, 1, 1] and own.blocking == 2
    assert metrics.sent_at_once == 2 and sum(metrics.queue_wait.counts) == 0  # (at once: not through the queue)
    for w in workers:
        if not w.blocked:
            d.worker_unready(w)  # two leave: its share of the workers is 1 now, and it holds 2
    d.submit(body(codec, req("m", [], "async")), lambda e: None, own)  # holds no worker whole: goes
    assert [f[2] for w in workers for f in w.channel.take()] == [0] and d.queued_calls == 0
    d.submit(body(codec, req("s", [], "third")), lambda e: None, own)
    assert [f for w in workers for f in w.channel.take()] == [] and d.queued_calls == 1


def test_in_the_grace_period_a_new_call_is_refused_shutting_down_with_no_data_and_counted(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], 1, metrics=metrics)
    d.submit(body(codec, req("m", [], "running")), done.append)
    drain = clock.loop.create_task(d.drain(30.0))
    clock.advance(0.0)
    refused = d.submit(body(codec, req("m", [], "new")), done.append)
    assert error_of(refused) == {"code": ErrorCode.SHUTTING_DOWN, "message": "Shutting down"}
    assert refused is not None and (refused.remaining, refused.status) == (0, 503)
    assert metrics.outcomes[0] == {ErrorCode.SHUTTING_DOWN: 1}
    d.on_reply(w, wire.Kind.RESULT, w.channel.take()[0][1], 0, b"0")
    clock.advance(0.0)
    assert drain.done()


@pytest.mark.parametrize(("back_in", "code"), [(1.0, None), (1.0 + 1e-9, ErrorCode.NO_WORKER)])
def test_with_every_worker_down_a_call_waits_for_one_back_within_a_second_of_the_outage(clock, back_in, code):
    d, w, codec, done = one_worker(clock.loop, ["m"], 1)
    d.worker_lost(w, "exited with 1")
    d.worker_back_in = lambda: back_in  # (the pool's: its restart backoff)
    exchange = d.submit(body(codec, req("m", [], 1)), done.append)
    assert exchange is not None and d.queued_calls == (0 if code else 1)
    assert exchange.remaining == (0 if code else 1)
    if code:
        assert error_of(exchange)["code"] == code and exchange.status == 503  # type: ignore[index]


def test_a_call_holding_exactly_what_max_queue_bytes_leaves_is_queued(clock):
    d, _w, codec, done = one_worker(clock.loop, ["m"], 1, max_queue_bytes=len(b'["abc"]') + len(b'"x"'))
    d.submit(body(codec, req("m", [], "busy")), done.append)
    d.submit(body(codec, req("m", ["abc"], "x")), done.append, ResponseBudget(d.outgoing))
    assert d.queued_calls == 1 and d.queued_bytes == 10 and done == []
    refused = d.submit(body(codec, req("m", [], "y")), done.append, ResponseBudget(d.outgoing))  # 5 bytes more
    assert d.queued_calls == 1 and error_of(refused)["code"] == ErrorCode.OVERLOADED  # type: ignore[index]


# -- _send: what a worker is sent, and what it holds then -----------------------------------


def test_a_worker_sent_a_call_is_marked_as_having_taken_calls(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"])
    assert w.took_calls is False  # (the pool tells a crash loop at boot from a death under calls by it)
    d.submit(body(codec, req("m", [], 1)), lambda e: None)
    assert w.took_calls is True


def test_an_async_call_given_back_goes_again_as_blocking_expected_to_end_at_once(clock):
    d, w, codec, done = one_worker(clock.loop, ["m"], 4)
    d.submit(body(codec, req("m", [], 1)), done.append)
    [frame] = w.channel.take()
    assert w.channel.flows[frame[1]] & wire.RETURNABLE
    clock.advance(0.5)
    d.on_reply(w, wire.Kind.RETURN, frame[1], 0, frame[3])  # (an async method's: no estimate, -1)
    [again] = w.channel.take()
    assert (again[1], w.blocked, w.sync_calls) == (frame[1], True, 1)
    assert w.sync_until == clock.now  # (nothing known of how long it takes: expected to end now)


# -- membership: a worker lost, and what its calls are answered -----------------------------


def test_a_call_whose_worker_died_is_answered_502_and_counted_worker_died(clock):
    metrics = CallMetrics()
    d, w, codec, done = one_worker(clock.loop, ["m"], 4, metrics=metrics)
    w.pid = 99
    exchange = d.submit(body(codec, req("m", [], 1)), done.append)
    d.worker_lost(w, "exited with 1")
    assert exchange is not None and done == [exchange] and exchange.status == 502
    assert error_of(exchange) == {"code": -32002, "message": "Worker died", "data": {"pid": 99, "status": "exited with 1"}}
    assert metrics.outcomes[0] == {ErrorCode.WORKER_DIED: 1}


def test_a_worker_lost_in_a_blocking_sync_call_is_reset_to_take_calls_as_any_when_back(clock):
    d = Dispatcher(clock.loop)
    d.set_methods(["s"], sync_methods=["s"])
    w = add_worker(d, 0, concurrency=4)
    budget = ResponseBudget(d.outgoing)
    d.submit(body(Codec(), req("s", [], 1)), lambda e: None, budget)
    assert (w.blocked, w.limit, w.outstanding, w.sync_calls, budget.blocking) == (True, 1, 1, 1, 1)
    d.worker_lost(w, "exited with 1")
    assert (w.blocked, w.limit, w.outstanding, w.sync_calls, budget.blocking) == (False, 4, 0, 0, 0)


def test_a_fast_sync_call_lost_with_its_worker_leaves_its_connection_holding_no_blocking_call(clock):
    d = Dispatcher(clock.loop)
    d.set_methods(["s"], sync_methods=["s"])
    w = add_worker(d, 0, concurrency=4)
    codec = Codec()
    d.submit(body(codec, req("s", [], "learn")), lambda e: None)
    d.on_reply(w, wire.Kind.RESULT, w.channel.take()[0][1], 100, b"0")  # 100 µs: fast now (sync -1)
    budget = ResponseBudget(d.outgoing)
    d.submit(body(codec, req("s", [], 1)), lambda e: None, budget)
    assert not w.blocked and budget.blocking == 0
    d.worker_lost(w, "exited with 1")
    assert budget.blocking == 0 and budget.in_flight == 0


def test_a_chunk_of_notifications_lost_with_its_worker_is_counted_dropped(clock):
    d, w, codec, _done = one_worker(clock.loop, ["m"])
    d.submit(body(codec, [note("m", i) for i in range(3)]), lambda e: None)
    assert [(f[0], f[2]) for f in w.channel.take()] == [(wire.Kind.CHUNK, 3)]
    d.worker_lost(w, "exited with 1")
    assert d.notifications_dropped == {ErrorCode.WORKER_DIED: 3}


def hung_and_lost(clock: Clock, acknowledged: bool) -> Dispatcher:
    """A worker holding a call of "a" (1 s deadline) and one of "b" (10 s), killed as hung
    (cancel_grace 1 s) and gone; `acknowledged`: it answered the cancelled call first."""
    d, w, codec, _done = one_worker(clock.loop, ["a", "b"], 4, timeout=10.0, method_timeouts={"a": 1.0},
                                    cancel_grace=1.0)
    w.process = Process()
    d.submit(body(codec, req("a", [], 1)), lambda e: None)
    d.submit(body(codec, req("b", [], 2)), lambda e: None)
    a, _b = w.channel.take()
    clock.advance(1.05)  # a's deadline: cancelled
    clock.advance(1.05)  # ... and cancel_grace
    assert w.process.kills == 1 and w.kill_reason.startswith("hung")
    if acknowledged:
        d.on_reply(w, wire.Kind.ERROR, a[1], wire.NOT_RUN, wire.CANCEL_ACK)
    d.worker_lost(w, "killed by SIGKILL")
    return d


def test_a_worker_killed_as_hung_blames_only_the_methods_of_its_calls_past_their_deadline(clock):
    assert hung_and_lost(clock, acknowledged=False).isolated == {"a": 1}


def test_a_worker_killed_as_hung_that_answered_its_cancelled_call_first_blames_what_it_still_held(clock):
    assert hung_and_lost(clock, acknowledged=True).isolated == {"b": 1}


def test_a_worker_that_died_on_its_own_blames_every_method_it_held_past_its_deadline_or_not(clock):
    d, w, codec, _done = one_worker(clock.loop, ["a", "b"], 4, timeout=10.0, method_timeouts={"a": 1.0},
                                    cancel_grace=100.0)
    d.submit(body(codec, req("a", [], 1)), lambda e: None)
    d.submit(body(codec, req("b", [], 2)), lambda e: None)
    clock.advance(1.05)
    d.worker_lost(w, "exited with 1")
    assert d.isolated == {"a": 1, "b": 1}


def test_a_worker_dying_under_a_call_of_a_method_a_reload_removed_blames_no_method(clock, caplog):
    d, w, codec, done = one_worker(clock.loop, ["m", "gone"], 1)
    d.submit(body(codec, req("m", [], "busy")), done.append)
    d.submit(body(codec, req("gone", [], "queued")), done.append, ResponseBudget(d.outgoing))
    [busy] = w.channel.take()
    d.set_methods(["m"])  # a reload without "gone": its queued call goes with index 1, `other`
    d.on_reply(w, wire.Kind.RESULT, busy[1], 0, b"0")
    [(_kind, _call_id, index, _params)] = w.channel.take()
    assert index == 1
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        d.worker_lost(w, "exited with 1")
    assert d.isolated == {} and caplog.records == [] and codes(done[1:]) == [ErrorCode.WORKER_DIED]


def test_a_method_that_killed_its_worker_twice_is_logged_as_owed_two_answers(clock, caplog):
    d, w, codec, _done = one_worker(clock.loop, ["a"], 4)
    with caplog.at_level("WARNING", logger="broker.dispatch"):
        for i in range(2):
            w.pid = 7 + i  # (each process its own: one death is struck once, `_strike_once`)
            d.submit(body(codec, req("a", [], i)), lambda e: None)
            d.submit(body(codec, req("a", [], i)), lambda e: None)  # (two: not caught alone)
            w.channel.take()
            d.worker_lost(w, "exited with 1")
            w.channel = type(w.channel)()
            d.worker_ready(w)
    assert d.isolated == {"a": 2}
    assert [r.getMessage().split("passed: ")[1].split(" or ")[0] for r in caplog.records] == [
        "a: after 1 answer", "a: after 2 answers"]


# -- membership: every worker down, one due back in `back_in` -------------------------------


def down_with_a_queued_call(clock: Clock, timeout: float = 30.0) -> tuple[Dispatcher, list[Exchange]]:
    """The only worker lost at the clock's now, and a call (deadline `timeout`) queued."""
    d, w, codec, done = one_worker(clock.loop, ["m"], 1, timeout=timeout)
    d.worker_lost(w, "exited with 1")
    d.submit(body(codec, req("m", [], 1)), done.append)
    assert d.queued_calls == 1
    return d, done


def test_with_a_worker_on_its_way_a_queued_call_waits_however_long_the_outage(clock):
    d, done = down_with_a_queued_call(clock)
    clock.advance(2.0)
    d.no_worker_before(0.0)
    assert d.queued_calls == 1 and done == []


def test_a_queued_call_waits_for_a_backoff_ending_exactly_at_the_outages_second(clock):
    d, done = down_with_a_queued_call(clock)
    clock.advance(0.5)
    d.no_worker_before(0.5)
    assert d.queued_calls == 1 and done == []
    d.no_worker_before(0.5 + 1e-6)
    assert d.queued_calls == 0 and codes(done) == [ErrorCode.NO_WORKER] and done[0].status == 503


def test_a_queued_call_waits_for_a_backoff_ending_exactly_at_its_deadline(clock):
    d, done = down_with_a_queued_call(clock, timeout=0.75)
    d.no_worker_before(0.75)
    assert d.queued_calls == 1 and done == []


def test_a_connection_that_floods_the_queue_still_sheds_for_another_after_no_worker_before_dropped_some(clock):
    d, w, codec, done = one_worker(clock.loop, ["m", "short"], 1, max_queue=4, method_timeouts={"short": 0.5})
    d.worker_lost(w, "exited with 1")
    flood, other = ResponseBudget(d.outgoing), ResponseBudget(d.outgoing)
    for method, id_ in (("short", "late"), ("m", 1), ("m", 2), ("m", 3)):
        d.submit(body(codec, req(method, [], id_)), done.append, flood)
    d.no_worker_before(0.6)  # past the short call's deadline: answered now
    assert codes(done) == [ErrorCode.NO_WORKER] and d.queued_calls == 3
    d.submit(body(codec, req("m", [], "o1")), done.append, other)
    d.submit(body(codec, req("m", [], "o2")), done.append, other)  # the queue full: the flood's newest goes
    assert [json.loads(e.body())["id"] for e in done[1:]] == [3] and codes(done[1:]) == [ErrorCode.OVERLOADED]
    assert d.queued_calls == 4 and (flood.queued, other.queued) == (2, 2)


# -- membership: a reload's method table and what a sync method is known to be --------------


def test_a_sync_method_measured_at_0_us_stays_fast_across_a_reload_and_its_calls_keep_teaching_it(clock):
    d, w, codec, _done = one_worker(clock.loop, ["s"], 1)
    d.set_methods(["s"], sync_methods=["s"])
    for i in range(100):  # each answered in 0 µs: the estimate falls from 1000 µs to 0
        d.submit(body(codec, req("s", [], i)), lambda e: None)
        d.on_reply(w, wire.Kind.RESULT, w.channel.take()[0][1], 0, b"0")
    d.submit(body(codec, req("s", [], "running")), lambda e: None)
    d.submit(body(codec, req("s", [], "queued")), lambda e: None)
    [running] = w.channel.take()
    assert not w.blocked and d.queued_calls == 1
    d.set_methods(["s"], sync_methods=["s"])  # a reload of the same code: still known fast
    d.on_reply(w, wire.Kind.RESULT, running[1], 0, b"0")
    [queued] = w.channel.take()
    assert not w.blocked and w.channel.flows[queued[1]] & wire.RETURNABLE
    d.on_reply(w, wire.Kind.RESULT, queued[1], 10_000_000, b"0")  # 10 s: it teaches the method is slow now
    d.submit(body(codec, req("s", [], "after")), lambda e: None)
    assert len(w.channel.take()) == 1 and w.blocked


def test_a_sync_method_measured_fast_keeps_learning_from_its_calls_after_a_reload(clock):
    d, w, codec, _done = one_worker(clock.loop, ["s"], 4)
    d.set_methods(["s"], sync_methods=["s"])
    d.submit(body(codec, req("s", [], "learn")), lambda e: None)
    d.on_reply(w, wire.Kind.RESULT, w.channel.take()[0][1], 100, b"0")  # fast now: 888 µs
    d.set_methods(["s"], sync_methods=["s"])
    d.submit(body(codec, req("s", [], 1)), lambda e: None)
    [frame] = w.channel.take()
    assert not w.blocked
    d.on_reply(w, wire.Kind.RESULT, frame[1], 10_000_000, b"0")
    d.submit(body(codec, req("s", [], 2)), lambda e: None)
    assert len(w.channel.take()) == 1 and w.blocked


def test_a_worker_lost_while_overdue_leaves_the_others_overdue_counted_as_not_answering(clock):
    d, _w, codec, _done = one_worker(clock.loop, ["m"], 4, timeout=1.0, cancel_grace=100.0)
    workers = [_w, add_worker(d, 1, concurrency=4), add_worker(d, 2, concurrency=4)]
    for i in range(3):
        d.submit(body(codec, req("m", [], i)), lambda e: None, ResponseBudget(d.outgoing))
    held = {w: w.channel.take() for w in workers}
    assert all(len(frames) == 1 for frames in held.values())
    clock.advance(1.05)  # every call past its deadline, unanswered: every worker overdue
    assert d.answering_workers == 0
    d.worker_lost(workers[0], "exited with 1")
    assert (d.ready_workers, d.answering_workers) == (2, 0)
    d.on_reply(workers[1], wire.Kind.ERROR, held[workers[1]][0][1], wire.NOT_RUN, wire.CANCEL_ACK)
    assert (d.ready_workers, d.answering_workers) == (2, 1)


def test_a_connections_call_held_for_its_share_of_the_room_that_expires_lets_its_next_calls_go(clock):
    d, w, codec, done = one_worker(clock.loop, ["m", "short"], 10, max_worker_params_bytes=64 * 1024,
                                   method_timeouts={"short": 1.0})  # one connection's room: 32 KiB
    own = ResponseBudget(d.outgoing)
    large = ["x" * (20 * 1024)]
    d.submit(body(codec, req("m", large, "sent")), done.append, own)
    d.submit(body(codec, req("short", large, "held")), done.append, own)  # past its share of the room: waits
    d.submit(body(codec, req("m", [], "behind")), done.append, own)
    assert [json.loads(e.body())["id"] for e in done] == [] and d.queued_calls == 2
    assert [params_of(f) for f in w.channel.take()] == [[large]]
    clock.advance(1.05)  # the held call expires: its connection's next goes
    assert codes(done) == [ErrorCode.TIMED_OUT] and d.queued_calls == 0
    assert [params_of(f) for f in w.channel.take()] == [[[]]]


# -- recycling: a worker's calls counted as they are sent ----------------------------------


def test_a_worker_is_told_worn_as_it_is_sent_its_recycle_at_th_call_a_chunk_counting_its_calls(clock):
    """`_send` counts each worker's calls (a chunk: its calls) and tells the pool
    (`worker_worn`, with that worker) at the call that reaches its `recycle_at`, not after."""
    d, w, codec, _done = one_worker(clock.loop, ["m"], 10)
    worn: list[object] = []
    d.worker_worn = worn.append
    w.recycle_at = 5
    d.submit(body(codec, req("m", [], 1)), lambda e: None)
    assert (w.calls, worn) == (1, [])
    d.submit(body(codec, [req("m", [2], 2), note("m", 0), req("m", [3], 3)]), lambda e: None)
    assert [(f[0], f[2]) for f in w.channel.take()] == [(wire.Kind.CALL, 0), (wire.Kind.CHUNK, 2), (wire.Kind.NOTIFY, 0)]
    assert (w.calls, worn) == (4, [])  # (the chunk counts its two calls; the notification, run too, one)
    d.submit(body(codec, req("m", [], 4)), lambda e: None)
    assert w.calls == 5 and worn == [w]
