"""The answers owed, and the bytes they hold: one request body's (`Exchange`), one
connection's (`ResponseBudget`) and all connections' together (`Outgoing`).

The dispatcher fills an exchange's slots as its calls end and counts each answer's bytes
in its connection's budget; the front-end takes them back off as it writes them. A
connection that is gone counts in `GONE`, in which no answer fits.
"""

from __future__ import annotations

import asyncio
import itertools
import typing
from collections.abc import Callable

import msgspec

if typing.TYPE_CHECKING:
    from broker.ratelimit import Bucket

__all__ = ["GONE", "Exchange", "Outgoing", "ResponseBudget", "forget"]

_flows = itertools.count(1)  # ResponseBudget.flow


class Outgoing:
    """Bytes of answers owed on all the connections of a broker together and not yet
    taken by their clients (`held`: the sum of their `ResponseBudget`s' `held`). Each
    connection holds at most max_response_bytes; this bounds them all, whatever
    max_connections allows (hostile testing: 40 connections that never read their
    answers held 300 MiB, and 10,000 could hold 320 GiB): an answer that would take
    `held` past `limit` (max_outgoing_bytes) is answered -32603 instead, and soon after
    (`on_full`, called once per refusals in a loop iteration) the connections owed the
    most are reset until it is under half the limit (`frontend.base.shed_outgoing`).

    refused_total: answers refused past the limit.
    """

    __slots__ = ("held", "limit", "on_full", "refused_total", "shedding")

    def __init__(self, limit: int = 1 << 62) -> None:
        self.limit = limit
        self.held = 0
        self.refused_total = 0
        self.on_full: Callable[[], None] | None = None  # what sheds (the server sets it)
        self.shedding = False  # on_full is scheduled

    def over(self) -> None:
        """`held` is past `limit`: have `on_full` run soon (once until it has run), not
        while the answer that took it there is being filled in."""
        if not self.shedding and self.on_full is not None:
            self.shedding = True
            asyncio.get_running_loop().call_soon(self.on_full)


# What the budget of a lost connection counts in. No answer fits in it (limit -1): the
# dispatcher keeps nothing for such a connection (`Dispatcher._gone`), whose calls still run.
GONE = Outgoing(-1)


def forget(exchange: Exchange) -> None:
    """`exchange`'s connection is gone: drop the answers it holds now, which would be kept
    until its last call ends (hostile testing, round 13: 180 clients that sent `[a 12 s
    call, an echo of 900 kB]` and reset held 160 MB for 12 s, counted nowhere). The calls
    still running fill their slots with nothing (`GONE`)."""
    answers = exchange.answers
    for i, answer in enumerate(answers):
        if answer:
            answers[i] = b""
    exchange.size = 0


class ResponseBudget:
    """Bytes of answers owed on one connection and not yet written to it (`held`).

    Shared by the `Exchange`s of one connection: the dispatcher adds each answer it
    puts in a slot (`Exchange.size` too) and refuses one that would take `held` past
    `max_response_bytes`, or `outgoing.held` past its limit; the front-end takes an
    exchange's `size` back off when it writes (or drops) its answer. So the answers a
    connection is owed at once, whether one response, one batch array or several
    pipelined bodies, hold at most `max_response_bytes` (nginx's proxy_buffers play
    the same part for a proxy). Every change to `held` is made to `outgoing.held` too.

    Being one per connection, it is also what the dispatcher keys the connection's calls
    by: its flow in the queue (`fairqueue.FairQueue`), and `in_flight`, the calls of the
    connection that hold a worker's place now (`dispatch.Dispatcher`'s connection share),
    `blocking`, those of them that are blocking sync calls (each holds its worker whole),
    and `queued`, its calls waiting in the queue (the fattest flow sheds first).

    `owed`: on HTTP, the connection's answers in the order they will be written (the
    front-end's queue, `HttpProtocol._responses`), for `counted`; None on a stream, whose
    answers go in any order.

    `peer`, `transport` and `caller`: who the connection's client is, for the logs
    (broker/accesslog.py).

    `denied`: the methods its caller may not call (`policy.Policy.denied`: the set of the
    caller's token, or of callers with none, kept current by each method table), and
    `bucket`, its caller's rate limit (`ratelimit.Bucket`, or None); on HTTP set before
    each request is dispatched (pipelined requests may carry other tokens).
    """

    __slots__ = (
        "blocking", "bucket", "caller", "denied", "flow", "heavy", "held", "in_flight", "outgoing", "owed", "parked", "peer",
        "queued", "transport",
    )

    def __init__(self, outgoing: Outgoing, denied: typing.AbstractSet[str] = frozenset()) -> None:
        # The connection's number in its calls' frames (wire.py: the worker takes turns
        # among the flows waiting in it); 30 bits (the 31st and 32nd are wire.ALONE and
        # wire.RETURNABLE), so a number comes again after 2**30 connections.
        self.flow = next(_flows) & 0x3FFFFFFF  # (wire.FLOW_MASK)
        self.held = 0
        self.in_flight = 0  # the connection's calls sent to workers and not answered by them
        self.blocking = 0  # ... of which blocking sync calls (each holds a whole worker)
        self.queued = 0  # the connection's calls waiting in the dispatcher's queue (live ones)
        self.heavy = 0  # bytes of large params of its calls in flight (`dispatch.Dispatcher._large`)
        self.parked = 0  # (in `held`) answers written while the write buffer was past its high mark
        self.outgoing = outgoing
        # The client's address, for logs: its transport's "peername" (a (host, port) tuple,
        # IPv6 with two more; "" or None on a Unix socket), set by the front-end.
        self.peer: object = None
        # ... its transport ("http", "tcp", "unix": the front-end's), and its caller's token name ("" with
        # no tokens; on HTTP set before each request is dispatched, as `denied`), for the access log
        self.transport = "http"
        self.caller = ""
        self.owed: typing.Sequence[object] | None = None
        self.denied = denied
        self.bucket: Bucket | None = None

    def counted(self, exchange: Exchange) -> int:
        """The bytes an answer of `exchange` is counted with against max_response_bytes:
        `held`, but for the first of the answers its connection is owed, all before it
        written (first in `owed`: itself, or the waiting request, `httpowed.Deferred`, it
        was dispatched from), only its own answers and those written and not yet taken
        (`parked`). The rest of `held` is then answers queued behind it, written only
        after it: refusing its answer for them would free nothing (hostile testing, round
        112, M1: a call owed first was refused -32603 because a 60 KB result and 42 404s
        pipelined behind it filled the budget). So a connection holds at most twice
        max_response_bytes: its first answers with what its client has not taken, and
        the answers behind them that fit beside them. Off the hot path: asked only for an
        answer that does not fit in `held`."""
        owed = self.owed
        if owed:
            first = owed[0]
            if first is exchange or getattr(first, "exchange", None) is exchange:
                return exchange.size + self.parked
        return self.held

    def written(self, exchange: Exchange, write_paused: bool) -> None:
        """The answer of `exchange` was written: its bytes leave `held` now, or when the
        transport's buffer drains (`drained`) if it was past its high-water mark."""
        if write_paused:
            self.parked += exchange.size
        else:
            self.held -= exchange.size
            self.outgoing.held -= exchange.size
        exchange.size = 0

    def drained(self) -> None:
        """The write buffer went below its low-water mark (`resume_writing`): the client
        took the answers written while it was full."""
        self.held -= self.parked
        self.outgoing.held -= self.parked
        self.parked = 0

    def keep(self, exchange: Exchange, size: int) -> None:
        """Count `size` bytes of answers put in `exchange`'s slots. Past max_outgoing_bytes
        they are kept all the same (a refusal echoes its id too), and the shedding runs
        (`Outgoing.over`). Every answer the dispatcher makes is counted here, but a
        worker's result, whose bound is tested first on the hot path (inline there)."""
        self.held += size
        outgoing = self.outgoing
        outgoing.held += size
        exchange.size += size
        if outgoing.held > outgoing.limit:
            outgoing.over()

    def hold(self, size: int) -> None:
        """Count `size` bytes of a finished answer the front-end made itself (a 404, a
        421...) that waits behind the answers owed before it."""
        self.held += size
        outgoing = self.outgoing
        outgoing.held += size
        if outgoing.held > outgoing.limit:
            outgoing.over()

    def release(self, size: int, write_paused: bool) -> None:
        """Such an answer was written (as `written`)."""
        if write_paused:
            self.parked += size
        else:
            self.held -= size
            self.outgoing.held -= size

    def lost(self) -> None:
        """Its connection is gone: what it held leaves `outgoing`, and the answers still
        to come for it (calls in flight, answered then dropped) count in none."""
        self.outgoing.held -= self.held
        self.outgoing = GONE
        self.held = self.parked = 0


class Exchange(msgspec.Struct, eq=False):
    """The answers owed for one request body: a single response or a batch array.

    batch: True when the body was a batch (the answer is an array).
    status: HTTP status of the whole answer (a non-batch error may change it).
    on_done: called once, with this exchange, when the last slot is filled.
    answers: one entry per answered element, in request order; None until filled.
    remaining: slots still waiting for a worker.
    context: the front-end's own per-request state.
    budget: the connection's `ResponseBudget` (its own when the caller gave none).
    size: bytes of the answers the dispatcher filled (counted in `budget.held`).
    retry_after: a rate-limited single call's wait, seconds (its 429's `Retry-After`).

    A Struct (as `Call`): one is made per request, and a Struct's C `__init__` costs
    a fraction of a Python one's.
    """

    batch: bool
    status: int
    on_done: Callable[[Exchange], None]
    answers: list[bytes | None] = []
    remaining: int = 0
    context: object = None
    budget: ResponseBudget = None  # type: ignore[assignment]  # (submit always gives one)
    size: int = 0
    retry_after: float = 0.0

    def fill(self, slot: int, answer: bytes, status: int = 200) -> None:
        """Put one response in its slot; call back if it was the last one."""
        self.answers[slot] = answer
        if status != 200 and not self.batch:
            self.status = status
        self.remaining -= 1
        if self.remaining == 0:
            self.on_done(self)

    def filled(self, count: int) -> None:
        """`count` slots were filled directly (a chunk's answers); call back if last."""
        self.remaining -= count
        if self.remaining == 0 and count:
            self.on_done(self)

    def body(self) -> bytes:
        """The response body: one Response object, or an array of them."""
        if self.batch:
            return b"[" + b",".join(typing.cast(list[bytes], self.answers)) + b"]"
        return typing.cast(bytes, self.answers[0])
