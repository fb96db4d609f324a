"""The dispatcher core in memory: the answers of the exchange an HTTP connection owes first
(`ResponseBudget.counted`) are counted against max_response_bytes with its own answers and
those its client has not taken, not with the finished answers queued behind it (hostile
testing, round 112, M1: a call owed first was refused -32603 because a 60 KB result and
42 404s pipelined behind it filled the budget, though refusing it freed none of them). Each
of the dispatcher's four checks: a single result, a single error, a chunk's answers, a
failed chunk's. The set-up is test_dispatch_core.py's; the same over a real broker is in
tests/test_response_limits.py.
"""

from __future__ import annotations

import json
import typing
from collections import deque

import pytest
from test_dispatch import body, req
from test_dispatch_core import Clock, chunk_answers, one_worker

from broker import wire
from broker.answers import Exchange, ResponseBudget
from broker.frontend.httpowed import Deferred, Ready
from broker.jsonrpc import response_error
from broker.metrics import OK, CallMetrics
from broker.wire import ERROR, RESULT

LIMIT = 1000  # max_response_bytes
BEHIND = 700  # bytes of finished answers queued behind (a Ready: 404s...)
REFUSED = {"code": -32603, "message": "Internal error",
           "data": f"responses owed on this connection exceed max_response_bytes {LIMIT}"}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> typing.Iterator[Clock]:
    c = Clock(monkeypatch)
    yield c
    c.loop.close()


class Connection:
    """One HTTP connection's answers as its front-end keeps them: a budget whose `owed` is
    the queue of what it owes in order, on a dispatcher of one worker serving "m"."""

    def __init__(self, clock: Clock, methods: tuple[str, ...] = ("m",), **settings: typing.Any) -> None:
        self.d, self.w, self.codec, self.done = one_worker(clock.loop, list(methods), max_response_bytes=LIMIT,
                                                           **settings)
        self.budget = ResponseBudget(self.d.outgoing)
        self.owed: deque[object] = deque()
        self.budget.owed = self.owed

    def send(self, payload: object) -> tuple[Exchange, tuple[typing.Any, ...]]:
        """Submit a request body, its place taken in `owed`: its exchange and its frame."""
        exchange = self.d.submit(body(self.codec, payload), self.done.append, self.budget)
        assert exchange is not None
        self.owed.append(exchange)
        [frame] = self.w.channel.take()
        return exchange, frame

    def behind(self, size: int = BEHIND) -> None:
        """A finished answer of `size` bytes queued after those owed (`HttpProtocol._queue`)."""
        self.budget.hold(size)
        self.owed.append(Ready(b"x" * size, True, "other"))


def big(n: int) -> bytes:
    return b'"%s"' % (b"r" * n)


def answer(exchange: Exchange, slot: int = 0) -> dict[str, typing.Any]:
    return json.loads(exchange.answers[slot])  # type: ignore[arg-type]


ERROR_500 = b'{"code":-32000,"message":"%s"}' % (b"e" * 500)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize(("kind", "payload", "given"), [
    (wire.Kind.RESULT, big(600), {"result": "r" * 600}),  # 636 bytes: 636 + 700 > 1000
    (wire.Kind.ERROR, ERROR_500, {"error": json.loads(ERROR_500)}),
])
def test_an_answer_owed_first_is_counted_with_its_own_answers_not_those_behind_it(clock, first, kind, payload, given):
    c = Connection(clock)
    a, frame_a = c.send(req("m", [], 1))
    b, frame_b = c.send(req("m", [], 2))
    c.behind()
    c.d.on_reply(c.w, kind, (frame_a if first else frame_b)[1], 0, payload)
    exchange = a if first else b
    if first:
        assert answer(exchange) == {"jsonrpc": "2.0", "id": 1, **given}
        assert c.d.oversize_total == 0
    else:
        assert answer(exchange) == {"jsonrpc": "2.0", "id": 2, "error": REFUSED}
        assert c.d.oversize_total == 1
    assert exchange.size == len(exchange.answers[0])  # type: ignore[arg-type]
    assert c.budget.held == BEHIND + exchange.size == c.d.outgoing.held


def test_a_result_owed_first_past_max_response_bytes_on_its_own_is_refused(clock):
    c = Connection(clock)
    a, frame = c.send(req("m", [], 1))
    c.behind()
    c.d.on_reply(c.w, wire.Kind.RESULT, frame[1], 0, big(LIMIT - 35))  # its answer alone: 1001 bytes
    assert answer(a) == {"jsonrpc": "2.0", "id": 1, "error": REFUSED} and c.d.oversize_total == 1
    c2 = Connection(clock)
    a, frame = c2.send(req("m", [], 1))
    c2.behind()
    c2.d.on_reply(c2.w, wire.Kind.RESULT, frame[1], 0, big(LIMIT - 36))  # 1000: the limit, exactly
    assert answer(a)["result"] == "r" * (LIMIT - 36) and a.size == LIMIT


def test_a_result_owed_first_is_counted_in_the_metrics_as_any_result(clock):
    metrics = CallMetrics()
    c = Connection(clock, ("n", "m"), metrics=metrics)
    a, frame = c.send(req("m", [], 1))
    c.behind()
    clock.advance(0.25)
    c.d.on_reply(c.w, wire.Kind.RESULT, frame[1], 1234, big(600))  # (1234 µs in the worker)
    assert answer(a)["result"] == "r" * 600
    assert metrics.outcomes[1] == {OK: 1} and metrics.outcomes[0] == {}
    assert (metrics.latency[1].sum_us, metrics.service[1].sum_us) == (250_000, 1234)


def test_a_result_owed_first_that_fills_max_outgoing_bytes_exactly_is_given(clock):
    c = Connection(clock, max_outgoing_bytes=BEHIND + 636)
    a, frame = c.send(req("m", [], 1))
    c.behind()
    c.d.on_reply(c.w, wire.Kind.RESULT, frame[1], 0, big(600))  # 636 bytes
    assert answer(a)["result"] == "r" * 600 and c.d.outgoing.held == c.d.outgoing.limit


def test_an_error_that_fills_max_response_bytes_exactly_past_max_outgoing_bytes_says_the_latter(clock):
    error = b'{"code":-32000,"message":"%s"}' % (b"e" * (LIMIT - len(response_error(b"1", b'{"code":-32000,"message":""}'))))
    assert len(response_error(b"1", error)) == LIMIT
    c = Connection(clock, max_outgoing_bytes=LIMIT - 1)
    a, frame = c.send(req("m", [], 1))
    c.d.on_reply(c.w, wire.Kind.ERROR, frame[1], 0, error)
    assert answer(a)["error"]["data"] == f"responses owed on all connections exceed max_outgoing_bytes {LIMIT - 1}"


def test_a_result_owed_first_counts_what_its_client_has_not_taken(clock):
    """Answers written while the write buffer was full (`parked`) are the client's to take,
    not queued behind: they count for the first exchange too (else each exchange owed in
    turn could add max_response_bytes to a buffer the client never reads)."""
    c = Connection(clock)
    written, frame = c.send(req("m", [], 0))
    c.d.on_reply(c.w, wire.Kind.RESULT, frame[1], 0, big(300))
    c.owed.popleft()
    c.budget.written(written, write_paused=True)  # 330 bytes parked
    a, frame = c.send(req("m", [], 1))
    c.behind(200)
    c.d.on_reply(c.w, wire.Kind.RESULT, frame[1], 0, big(650))  # 680 + 330 > 1000
    assert answer(a) == {"jsonrpc": "2.0", "id": 1, "error": REFUSED}
    c.d.on_reply(c.w, wire.Kind.RESULT, c.send(req("m", [], 2))[1][1], 0, big(600))  # not first: 630 + 730 > 1000
    assert answer(c.owed[-1]) == {"jsonrpc": "2.0", "id": 2, "error": REFUSED}  # type: ignore[arg-type]
    c.budget.drained()
    b, frame = c.send(req("m", [], 3))
    c.owed.clear()
    c.owed.append(b)
    c.d.on_reply(c.w, wire.Kind.RESULT, frame[1], 0, big(650))  # first, nothing parked: 680
    assert answer(b)["result"] == "r" * 650


def test_a_request_dispatched_from_the_wait_is_first_through_its_place(clock):
    """Its place in `owed` is its `Deferred`, which holds its exchange once dispatched."""
    c = Connection(clock)
    deferred = Deferred(b"", True, b"")
    c.owed.append(deferred)
    exchange = c.d.submit(body(c.codec, req("m", [], "w")), c.done.append, c.budget)
    assert exchange is not None
    [frame] = c.w.channel.take()
    c.behind()
    c.d.on_reply(c.w, wire.Kind.RESULT, frame[1], 0, big(600))
    assert answer(exchange)["error"] == REFUSED  # (its Deferred not holding it yet: not first)
    deferred.exchange = exchange = c.d.submit(body(c.codec, req("m", [], "v")), c.done.append, c.budget)
    [frame] = c.w.channel.take()
    c.d.on_reply(c.w, wire.Kind.RESULT, frame[1], 0, big(600))
    assert answer(exchange) == {"jsonrpc": "2.0", "id": "v", "result": "r" * 600}


@pytest.mark.parametrize("first", [True, False])
def test_a_chunks_answers_owed_first_are_counted_with_their_own_not_those_behind(clock, first):
    c = Connection(clock)
    if not first:
        c.send(req("m", [], "before"))
    batch, frame = c.send([req("m", [], i) for i in range(3)])
    assert frame[0] == wire.Kind.CHUNK
    c.behind()
    c.d.on_reply(c.w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, RESULT, big(200)), (1, ERROR, b'{"code":-32602,"message":"no"}'), (2, RESULT, big(500))))
    answers = [answer(batch, i) for i in range(3)]
    if first:  # 230 + 71 + 530 of its own: all fit
        assert answers == [{"jsonrpc": "2.0", "id": 0, "result": "r" * 200},
                           {"jsonrpc": "2.0", "id": 1, "error": {"code": -32602, "message": "no"}},
                           {"jsonrpc": "2.0", "id": 2, "result": "r" * 500}]
        assert c.d.oversize_total == 0
    else:  # 700 behind: the first fits, the next fits, the third does not
        assert [a.get("error") for a in answers] == [None, {"code": -32602, "message": "no"}, REFUSED]
        assert c.d.oversize_total == 1
    assert batch.size == sum(map(len, batch.answers))  # type: ignore[arg-type]
    assert c.budget.held == BEHIND + batch.size == c.d.outgoing.held


def test_a_chunk_owed_first_whose_answers_fill_max_response_bytes_exactly_is_all_given(clock):
    c = Connection(clock)
    batch, frame = c.send([req("m", [], i) for i in range(3)])
    c.behind()
    c.d.on_reply(c.w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, RESULT, big(400)), (1, RESULT, big(400)), (2, RESULT, big(LIMIT - 2 * 436 - 36))))
    assert [answer(batch, i)["id"] for i in range(3) if "result" in answer(batch, i)] == [0, 1, 2]
    assert batch.size == LIMIT and c.budget.held == LIMIT + BEHIND
    c = Connection(clock)  # the answer that does not fit in `held` fills it exactly on its own
    batch, frame = c.send([req("m", [], i) for i in range(3)])
    c.behind()
    c.d.on_reply(c.w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, RESULT, big(LIMIT - 36)), (1, RESULT, b"1"), (2, RESULT, b"2")))
    assert answer(batch, 0)["result"] == "r" * (LIMIT - 36)
    assert answer(batch, 1)["error"] == answer(batch, 2)["error"] == REFUSED


def test_a_chunk_owed_first_is_refused_past_its_own_max_response_bytes(clock):
    c = Connection(clock)
    batch, frame = c.send([req("m", [], i) for i in range(3)])
    c.behind()
    c.d.on_reply(c.w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(
        (0, RESULT, big(400)), (1, RESULT, big(400)), (2, RESULT, big(100))))
    answers = [answer(batch, i) for i in range(3)]
    assert [a.get("error") for a in answers] == [None, None, REFUSED]  # 430 + 430 + 130 > 1000
    assert c.d.oversize_total == 1


def test_answers_owed_first_past_max_outgoing_bytes_say_so(clock):
    """All connections' bound holds for the first exchange as for any."""
    c = Connection(clock, max_outgoing_bytes=1200)
    batch = c.d.submit(body(c.codec, [req("m", [], i) for i in range(2)]), c.done.append, c.budget)
    assert batch is not None
    c.owed.append(batch)
    frames = c.w.channel.take()  # (two calls: so small a bound leaves a connection one place)
    c.behind()  # 700 of the 1200 held
    for frame in frames:
        c.d.on_reply(c.w, wire.Kind.RESULT, frame[1], 0, big(300))
    assert answer(batch, 0)["result"] == "r" * 300
    assert answer(batch, 1)["error"]["data"] == "responses owed on all connections exceed max_outgoing_bytes 1200"
    assert (c.d.oversize_total, c.d.outgoing.refused_total) == (0, 1)


@pytest.mark.parametrize("first", [True, False])
def test_a_failed_chunks_answers_owed_first_are_counted_with_their_own(clock, first):
    c = Connection(clock)
    if not first:
        c.send(req("m", [], "before"))
    batch, frame = c.send([req("m", [], i) for i in range(3)])
    c.behind(900)
    error = b'{"code":-32000,"message":"%s"}' % (b"e" * 60)  # 121 bytes each
    c.d.on_reply(c.w, wire.Kind.ERROR, frame[1], 0, error)
    answers = [answer(batch, i)["error"] for i in range(3)]
    assert answers == ([json.loads(error)] * 3 if first else [REFUSED] * 3)
    assert c.budget.held == 900 + batch.size
