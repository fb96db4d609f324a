"""Dispatch: broker call ids, the pending table, deadlines, routing and reassembly.

Theory of operation
-------------------
A front-end decodes a request body with `jsonrpc.Codec` and hands the `Body` to
`Dispatcher.submit` together with a callback. `submit` makes one `Exchange` (the
answers owed for that body, one slot per answered element, in request order) and one
`Call` per valid request. Each call gets a fresh broker call id (a monotonic integer:
client ids collide across connections and may repeat inside a batch) and goes to the
ready worker with the fewest outstanding calls, if one is under its limit; otherwise
it waits in one bounded queue shared by all workers, and when that is full it is
answered at once with the "overloaded" error (load shedding).

How a call waits for a worker is broker/queueing.py's (`Queueing`, whose methods the
dispatcher inherits): the queue is fair among connections, a new call never overtakes it,
and every freed place is filled from it at once (`_pump`); one connection's calls hold at
most its share of the workers' places (`connection_share`); a full queue sheds the newest
calls of the connection with the most waiting (`_make_room`); a connection gone has its calls
dropped from the queue and cancelled in flight (`abandon`); and what the queued calls keep
alive is bounded (`max_queue_bytes`), those expired included.

Which worker a call goes to, and when none should take it yet, is broker/routing.py's
(`Routing`, whose methods the dispatcher inherits): a worker busy in a blocking sync call
takes little more; a method whose calls were in a worker that died runs its calls alone for a
while; and a worker holds a bounded amount of large params in its calls in flight.

A body other than one call to a registered method is walked in broker/intake.py (`Intake`,
whose methods the dispatcher inherits): the answers known at once, and a batch's calls dealt
out in chunks.

A worker's reply comes back to its call in broker/replies.py (`Replies`, whose methods the
dispatcher inherits): reassembly, chunks' parts, late replies; the calls it gives back
unstarted, in broker/returns.py (`Returns`).

The workers come and go, and die, in broker/membership.py (`Membership`, whose methods the
dispatcher inherits), which also installs a reload's method table.

Every call ends in exactly one of these ways, and only the first one answers:

    reply       the worker answered (RESULT or ERROR)
    deadline    the call's timer fired: "timed out", and CANCEL goes to the worker
    worker lost the worker died with the call in flight: "worker died"
    shed        the queue was full: "overloaded" (never queued)
    shutdown    the grace period ended with the call still queued or in flight

The stop is broker/draining.py's (`Draining`, whose methods the dispatcher inherits): the
drain (`drain`) waits until nothing is queued or in flight and the front-ends hold back no
request (`held_back`: requests received but not dispatched yet, on a connection that fell
behind, or not even read yet: in the kernel at the stop); those are dispatched in their
turn with `submit_held`, served as calls in flight are until the grace period ends.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
import typing
from collections import OrderedDict
from collections.abc import Callable

from broker import wire
from broker.accesslog import AccessLog, keep_params
from broker.answers import GONE, Exchange, Outgoing, ResponseBudget
from broker.calls import (
    NO_ID,
    TRANSITIONS,
    Call,
    CallState,
    Route,
    held_bytes,
    hold,
    queue_cost,
    timed_out,
)
from broker.catalog import Catalog
from broker.deadlines import TIMER_EARLY, DeadlineWheel
from broker.draining import _GRACE_ENDED, Draining
from broker.fairqueue import FairQueue, Largest
from broker.intake import Intake
from broker.isolation import Isolation
from broker.jsonrpc import (
    Body,
    ErrorCode,
    Request,
    error_object,
    http_status,
    response_error,
)
from broker.membership import _NO_WORKER, RESTART_WAIT_SECONDS, Membership, MembershipTap
from broker.metrics import CallMetrics
from broker.policy import Policy
from broker.queueing import _OVERLOADED, Queueing
from broker.ratelimit import Limiter
from broker.replies import Replies
from broker.returns import Returns
from broker.routing import HEAVY_BYTES, Routing
from broker.wire import (
    ALONE,
    CALL,
    NOTIFY,
    RETURNABLE,
)

if typing.TYPE_CHECKING:
    from msgspec import Raw

    from broker.channel import Worker

__all__ = ["TRANSITIONS", "Call", "CallState", "Dispatcher", "Exchange", "Outgoing", "ResponseBudget", "Route"]

log = logging.getLogger("broker.dispatch")

_INVALID = int(ErrorCode.INVALID_REQUEST)  # notifications_dropped: the codec's (too deep)
_SHUTTING_DOWN = error_object(ErrorCode.SHUTTING_DOWN)
MAX_TIMEOUT = 86400.0  # the longest deadline (s): config.DAY, the bound the config loader applies
_clock = time.perf_counter


def _queued_of(owner: ResponseBudget) -> int:
    return owner.queued


class Dispatcher(Intake, Membership, Queueing, Routing, Replies, Returns, Draining):
    """Routes calls to workers and answers them; one per broker process.

    max_queue: calls that may wait for a free worker before "overloaded" (>= 0).
    max_queue_bytes: the same bound on the bytes the waiting calls hold (their raw
        params and ids, copied out of the request body when queued).
    max_worker_params_bytes: bytes of large params (`routing.HEAVY_BYTES`, 16 KiB, or more in a call;
        a chunk's calls' that are, together) one worker may hold in the calls in flight; past
        it such a call waits for room (one always goes, to a worker with none); one connection
        may hold `connection_share` of the ready workers' room (one always goes); 0: no bound. (Hostile
        testing, round 92: a worker binds params on its loop, 35 to 55 ms and ~24 MB a MiB of
        small objects, and 12 connections' 16 calls of 1 MiB each held another client's calls
        1.8 to 4.2 s and each worker at 850 MB.)
    timeout: default deadline in seconds; `method_timeouts` overrides it per method.
        Each must be > 0 and <= `MAX_TIMEOUT` (one day), else `ValueError`: the
        deadline wheel turns deadlines into integer ticks, which inf or nan cannot be.
    cancel_grace: seconds a worker has to answer a timed-out call before it is
        killed as hung.
    sync_prefetch: calls (>= 0) a worker busy in a sync call may hold besides that
        call; see `routing`'s module docstring.
    metrics: where to count answers, latencies and batch sizes (`metrics.CallMetrics`),
        or None.
    max_response_bytes: bytes of answers one connection may be owed at once and not
        yet written (its `ResponseBudget`; an exchange with no budget has its own):
        a result or error object that would go past it is answered with -32603
        "responses owed on this connection exceed max_response_bytes N" instead
        (counted in `oversize_total`); the exchange an HTTP connection owes first counts
        only its own (`ResponseBudget.counted`).
    max_outgoing_bytes: bytes of answers all connections together may be owed and not
        yet have taken (`outgoing`, an `Outgoing`, which every connection's budget
        shares): past it, -32603 "responses owed on all connections exceed
        max_outgoing_bytes N" instead (counted in `outgoing.refused_total`).
    connection_share: the fraction (0 < x <= 1) of the workers' places (the ready
        workers' `worker_concurrency` added up) that one connection's calls may hold at
        once; its others wait in the queue, in its turn (`_pump`), so that the rest are
        there for the other connections (hostile testing, round 53: one batch of 250
        long calls held every place of 2 workers, and every other client waited 3 s).
    policy: which methods each caller may call (`policy.Policy`; None: all, for everyone).
        A call to one denied to its connection's caller (`ResponseBudget.denied`) is
        answered -32601, as one to a method that does not exist.
    limiter: the callers' rate limits (`ratelimit.Limiter`; None: none). A call its
        caller's bucket (`ResponseBudget.bucket`) has no room for is answered -32005
        (a notification dropped), each element of a batch on its own.
    access_log: where each call answered is told (`accesslog.AccessLog`: its errors, or
        every call in mode "all"), or None (access_log "off").
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        max_queue: int = 10000,
        max_queue_bytes: int = 64 * 1024 * 1024,
        max_worker_params_bytes: int = 4 * 1024 * 1024,
        timeout: float = 30.0,
        method_timeouts: typing.Mapping[str, float] | None = None,
        cancel_grace: float = 10.0,
        sync_prefetch: int = 0,
        metrics: CallMetrics | None = None,
        max_response_bytes: int = 32 * 1024 * 1024,
        max_outgoing_bytes: int = 1 << 62,
        connection_share: float = 0.5,
        policy: Policy | None = None,
        limiter: Limiter | None = None,
        access_log: AccessLog | None = None,
    ) -> None:
        if not 0 < connection_share <= 1:
            raise ValueError(f"connection_share = {connection_share!r}: it must be > 0 and <= 1")
        self._loop = loop
        self.policy = policy or Policy()
        self.limiter = limiter or Limiter()
        self.cut_off = 0  # calls answered -32004 "grace period ended" at the drain's end (`drain`)
        self._connection_share = connection_share
        self._share = 1  # places one connection's calls may hold: see `_set_share`
        self._sync_share = 1  # ... and blocking sync calls
        self._chunk_max = 1  # calls in a chunk of a batch past its connection's share
        self.max_response_bytes = max_response_bytes
        self._too_large = error_object(
            ErrorCode.INTERNAL_ERROR,
            data=f"responses owed on this connection exceed max_response_bytes {max_response_bytes}",
        )
        self.outgoing = Outgoing(max_outgoing_bytes)  # (one for all the connections: their budgets')
        self._too_much = error_object(
            ErrorCode.INTERNAL_ERROR, data=f"responses owed on all connections exceed max_outgoing_bytes {max_outgoing_bytes}"
        )
        self.oversize_total = 0  # answers refused past max_response_bytes
        self.metrics = metrics  # None: count nothing per call (metrics off)
        # The access log: told of every error answered (`access`), and of every result in mode "all"
        # (`access_ok`; else None: one test per result on the hot path); None when off
        self.access = access_log
        self.access_ok = access_log if access_log is not None and access_log.mode == "all" else None
        self._keep_params = access_log is not None and access_log.log_params  # (`_send`: kept for its line)
        self._cancel_grace = cancel_grace
        self._sync_limit = 1 + sync_prefetch  # a worker's limit while busy in a sync call
        self._sync_routing = True  # that limit is at most worker_concurrency (see worker_ready)
        self._returnable = RETURNABLE  # ... and so calls may be given back (wire.RETURNABLE), else 0
        self._blocked = 0  # workers busy in one now (`Worker.blocked`)
        self._overdue = 0  # workers with calls past their deadline not answered yet (`Worker.overdue`)
        # Methods whose calls run alone, a worker dying under them (`broker.isolation`), and
        # the workers spent on them: reserved for one (draining), running one, or dead under
        # one and not back yet (`_pick_alone`)
        self._isolation = Isolation()
        self._alone: dict[Worker, bool] = {}  # (True: dead under one, until its slot is back: `worker_ready`)
        # Calls sent ALONE to a worker with other front-ends, by id, with their params, until it says they
        # start (wire.STARTS): if it dies before, they never ran there, and go again (`worker_lost`)
        self._unstarted: dict[int, Raw | bytes] = {}
        self._alone_held = False  # a connection's calls wait out of turn for a worker to run alone
        self._held_workers: set[Worker] = set()  # out of the rotation: another front-end's call runs alone there (HOLD)
        # ... or for room for their large params (max_worker_params_bytes), oldest first (`_release_for_room`)
        self._room_waiters: OrderedDict[ResponseBudget, None] = OrderedDict()
        # ... and by their first calls' sizes, smallest first: (bytes, order, connection), some stale
        self._room_heap: list[tuple[int, int, ResponseBudget]] = []
        self._room_order = itertools.count()
        self._share_waiters: dict[ResponseBudget, None] = {}  # ... for one of their own to end (their share)
        self._releasing: set[ResponseBudget] = set()  # those `_release_for_room` let go, in this `_pump`
        # The worker kept for the oldest of them that fits nowhere, and its connection (`_release_for_room`)
        self._reserved: Worker | None = None
        self._reserved_for: ResponseBudget | None = None
        # ... and the one the keeping moved off while `_left_for` (that connection's call) waited:
        # it stays kept for that call (`Routing._moved_off`)
        self._left_kept: Worker | None = None
        self._left_for: Call | None = None
        # `_pick_blocked` found no room for a call's large params (1), or its connection holds its
        # share of the room (2), and nothing else kept it; and how large they are (`_large`)
        self._roomless = 0
        self._joined = False  # (a large call joined those waiting for room in this `_pump`)
        self._isolation_handle: asyncio.TimerHandle | None = None  # (`_isolation_timer`)
        self._max_queue = max_queue
        self._max_queue_bytes = max_queue_bytes
        # Calls refused -32000 and notifications dropped for a full queue since the last WARNING
        # saying so (`_count_shed`), the loop time of that WARNING, and the end of its interval
        self._shed_unlogged = self._shed_notes = 0
        self._shed_since = 0.0
        self._shed_timer: asyncio.TimerHandle | None = None
        self._heavy_cap = max_worker_params_bytes or 1 << 62
        self._heavy_bytes = HEAVY_BYTES if max_worker_params_bytes else 1 << 62  # (params this large count)
        self._heavy_share = 0  # one connection's large params in flight, at most (`_set_share`)
        self._queued_bytes = 0  # bytes held by the queued calls (Call.held)
        self._queued_calls = 0  # calls the live queued entries stand for (a chunk: its weight)
        self._largest: Largest[ResponseBudget] = Largest(_queued_of)  # the connection with the most calls queued
        # Queued calls whose deadline passed stay in the queue as empty shells (their
        # params and ids are released at once) until they reach its head, or until they
        # are more than half of it and `_compact` drops them all: removing one from the
        # middle is O(n), a compaction that removes more than n/2 is O(1) per shell. (One
        # that is its connection's next leaves at once: `FairQueue.expire_head`.)
        self._expired_queued = 0
        self._timeout = timeout
        self._method_timeouts = dict(method_timeouts or {})
        for name, seconds in (("timeout", timeout), *self._method_timeouts.items()):
            if not 0 < seconds <= MAX_TIMEOUT:  # (nan fails both comparisons)
                raise ValueError(f"deadline of {name} = {seconds!r} s: it must be > 0 and <= {MAX_TIMEOUT}")
        self._routes: dict[str, Route] = {}
        self._names: list[str] = []
        # The workers' methods as MCP tools and OpenRPC (broker/catalog.py): the method table's,
        # replaced with it (`set_methods`); empty until the first HELLO
        self.catalog = Catalog()
        # Per method index: the service-time estimate (µs) of a sync method, -1 for an
        # async one; and whether it counts as blocking now (its Route.sync).
        self._sync_us: list[int] = []
        self._blocking: list[int] = []
        self._one_timeout = True  # every method has the same deadline (see set_methods)
        self._pending: dict[int, Call] = {}
        self._queue: FairQueue[Call] = FairQueue(queue_cost)
        self._ready: list[Worker] = []
        self._rotation = 0
        self._deadlines = DeadlineWheel(loop, self._on_timeout)
        self._tick_seconds = self._deadlines.resolution
        self._ids = itertools.count(1)
        self.accepting = True
        # Replies to calls answered already (deadline, shutdown): the worker's
        # acknowledgement of a CANCEL, or a result (or error) that came late.
        self.late_cancelled_total = 0
        self.late_results_total = 0
        # Calls (a chunk's: each) workers gave back unstarted, their method slow (wire.RETURN)
        self.returned_total = 0
        # Calls owed an answer whose connection was gone first (`abandon`): dropped from the
        # queue, never run, or cancelled in flight
        self.abandoned_total = {"queued": 0, "in_flight": 0}
        # Notifications that never reached a worker, by the error a call would have had
        # (overloaded, timed out while queued, no worker, shutting down, invalid request:
        # nested past the parser's limit): they get no answer, so this count is their
        # only trace.
        self.notifications_dropped: dict[int, int] = {}
        self._idle = asyncio.Event()  # set once draining and nothing is owed
        self._draining = False  # in the grace period (see `submit_held`)
        self._serving = True  # until the drain ends: no call is sent to a worker after it
        # Set by the server: how many requests the front-ends hold back undispatched
        # (`Listener.held`: their `_waiting`, and more); the drain waits for them too.
        self.held_back: Callable[[], int] = lambda: 0
        # Set by the pool: is a worker on its way to READY? (else "no worker available")
        self.worker_back_in: Callable[[], float] = lambda: 0.0  # `Pool._worker_back_in`
        # ... and is one restarting now, due back as soon as it has started? (`_pick_blocked`)
        self.worker_restarting: Callable[[], bool] = lambda: False  # `Pool._worker_restarting`
        # ... and told when a worker was sent its max_calls_per_worker calls (`Pool.worker_worn`)
        self.worker_worn: Callable[[Worker], None] = lambda worker: None
        # Told of every change of the workers and their method table, after it is made here:
        # the first front-end's word to the others (`--frontends N`: broker/peers.py)
        self.membership_tap: MembershipTap | None = None
        # (--frontends N: told the methods a worker died under, by name, and whether caught, so
        # every other front-end strikes them too: `Membership.struck`, peerwire.Struck)
        self.on_struck: typing.Callable[[list[str], bool, int], None] | None = None
        # The methods struck for each dead worker's pid, the last membership.STRUCK_KEPT: a death several
        # front-ends saw strikes each method once on each (`_blame`, `struck`; new user, round 115)
        self._struck_for: collections.OrderedDict[int, set[int]] = collections.OrderedDict()
        # ... and the workers serve other front-ends too: their calls, unseen here, may hold one (`_check_hung`)
        self.shared_workers = False
        self._down_since = 0.0  # when the last ready worker went (_clock); read while none is ready
        self._start_failed = False  # a start failed since (`start_failed`): "no worker available" at once

    # -- configuration from the pool -------------------------------------------------

    def answered_within(self) -> float:
        """Seconds within which a worker answers or acknowledges every call it was sent,
        or is killed as hung: the longest deadline, plus cancel_grace."""
        return max([self._timeout, *self._method_timeouts.values()]) + self._cancel_grace

    @property
    def isolated(self) -> dict[str, int]:
        """The methods whose calls run alone now (`broker.isolation`), each with how many of
        its calls must still answer, run so, before they stop."""
        names = self._names
        return {names[i]: n for i, n in self._isolation.alone.items() if i < len(names)}

    @property
    def ready_workers(self) -> int:
        """How many workers are taking calls (one another front-end's call runs alone in, held: too)."""
        return len(self._ready) + len(self._held_workers)

    @property
    def answering_workers(self) -> int:
        """How many workers are taking calls and answering: not holding a call past its
        deadline unanswered (`Worker.overdue`: stopped or stuck, maybe). /readyz says 503 at 0
        (hostile testing, round 89: with every worker SIGSTOPped it said ready, and each call
        timed out until the workers were killed as hung, `cancel_grace` later)."""
        answering = len(self._ready) if not self._overdue else sum(1 for w in self._ready if not w.overdue)
        return answering + len(self._held_workers)  # (held: another front-end's call runs alone there)

    @property
    def in_grace(self) -> bool:
        """Whether a stop's grace period runs (`drain`): requests received before the stop
        are still served (`submit_held`)."""
        return self._draining

    @property
    def queued_calls(self) -> int:
        """Calls waiting for a worker (a queued chunk counts its calls)."""
        return self._queued_calls

    @property
    def held_calls(self) -> int:
        """Of the queued calls, those of connections held out of turn: waiting for their
        connection's share of the places, not for a free worker.
        O(connections held)."""
        return sum(typing.cast(ResponseBudget, key).queued for key in self._queue.held_keys())

    def count_refused_body(self, code: int = ErrorCode.INVALID_REQUEST) -> None:
        """A front-end answered a body it refused unread with `code` (metrics): -32600
        past max_body_bytes, -32000 past max_incoming_bytes."""
        if self.metrics is not None:
            self.metrics.answered(self.metrics.other, code, 0.0)

    @property
    def queued_bytes(self) -> int:
        """Bytes the calls waiting for a worker hold (raw params and ids)."""
        return self._queued_bytes

    @property
    def in_flight_calls(self) -> int:
        """Calls sent to a worker and not answered by it yet (those of workers being
        retired by a reload included; a chunk counts its calls not answered yet)."""
        return sum(call.weight for call in self._pending.values())

    def state_of(self, call: Call) -> CallState:
        """Where `call` is (`CallState`), read from the pending table, the queue and its
        deadline. O(queue length): for tests and debugging, not the hot path."""
        if self._pending.get(call.call_id) is call:
            return CallState.IN_FLIGHT if call.tick else CallState.ANSWERED_AWAITING_WORKER
        if call.worker is None and any(queued is call for queued in self._queue):
            return CallState.QUEUED if call.tick else CallState.ANSWERED_IN_QUEUE
        return CallState.ENDED

    # -- the hot path ------------------------------------------------------------------

    def submit(
        self, body: Body, on_done: Callable[[Exchange], None], budget: ResponseBudget | None = None
    ) -> Exchange | None:
        """Start every call of a decoded body; return its `Exchange`.

        Returns None when nothing is owed (only notifications). If the returned
        exchange has `remaining == 0` it is complete already and `on_done` will not
        be called: the caller answers at once. `budget`: the connection's (see
        `ResponseBudget`); the caller releases the exchange from it once its answer
        is written. None: the exchange gets its own (`max_response_bytes` per body).
        """
        if budget is None:
            budget = ResponseBudget(self.outgoing, self.policy.denied[""])
        if not body.batch and body.items and budget.bucket is None:  # the common case first: one call
            request = body.items[0]  # to a registered method (a caller with a rate limit takes `_entries`)
            if type(request) is Request and request.id:
                route = self._routes.get(request.method)
                if route is not None and not (budget.denied and request.method in budget.denied):
                    exchange = Exchange(False, 200, on_done, [None], 1, None, budget)
                    call = Call(  # Call.of, inline (a call less: about 0.1 µs)
                        next(self._ids), exchange, 0, request.id, CALL, route.method_index,
                        request.params, route.timeout, _clock(), route.sync, budget,
                    )  # fmt: skip
                    self._start(call, self._loop.time())
                    return exchange
        exchange = Exchange(body.batch, body.status, on_done, budget=budget)
        if body.dropped:  # too deep to forward (jsonrpc.Body.dropped): no answer, this count
            self.notifications_dropped[_INVALID] = self.notifications_dropped.get(_INVALID, 0) + body.dropped
        entries = self._entries(body, exchange)
        now = self._loop.time()  # for deadlines (uvloop: milliseconds, cached per loop turn)
        arrival = _clock()  # for latencies
        if body.batch and self.metrics is not None:
            self.metrics.batch_size.observe(len(body.items) + body.dropped)
        if body.batch and len(entries) > 2 and self._ready and self.accepting:
            self._start_chunks(entries, exchange, now, arrival)
        else:
            for slot, request, route in entries:
                if slot >= 0:
                    exchange.remaining += 1
                    self._start(Call.of(next(self._ids), exchange, slot, request, route, arrival, budget), now)
                else:
                    self._start(Call.of(next(self._ids), None, -1, request, route, arrival, budget), now)
        return exchange if exchange.answers else None

    def _start(self, call: Call, now: float) -> None:
        self._deadlines.add(call, now)
        # While a live call waits in turn, a new one queues too (behind its connection's:
        # FairQueue); so does one past its connection's share of the workers' places. Calls
        # held out of turn for their connection's share hold nobody else's back (round 57: a
        # held flood sent every other client's call through the queue, 0.7 of the rate)
        owner = call.owner
        worker = (
            self._pick(call)
            if (not self._queued_calls or (not self._queue.in_turn() and not self._queue.is_held(owner)))
            and self._serving and (owner.in_flight + call.weight <= self._share or not owner.in_flight)
            and (call.sync <= 0 or owner.blocking + call.sync <= self._sync_share or not owner.blocking)
            else None
        )
        if worker is not None:
            self._send(worker, call)
            if self.metrics is not None:
                self.metrics.sent_at_once += call.weight
        elif not self.accepting:
            # (after the grace period, with the data its calls in flight got: round 37, a
            # request completed after it had none, as if it had arrived in the drain)
            self._finish(call, _SHUTTING_DOWN if self._serving else _GRACE_ENDED, ErrorCode.SHUTTING_DOWN,
                         remaining=False)
        elif not self._ready and not self._held_workers and (self._start_failed or ((back := self.worker_back_in()) and back > min(
            RESTART_WAIT_SECONDS - (_clock() - self._down_since), call.timeout - (_clock() - call.arrival)
        ))):  # (every worker down, none back soon and before its deadline, or a start failed: `no_worker_before`)
            self._finish(call, _NO_WORKER, ErrorCode.NO_WORKER, remaining=False)
        elif (self._queued_calls + call.weight > self._max_queue or (
            self._queued_bytes + held_bytes(call) > self._max_queue_bytes
        )) and not self._make_room(call):  # (max_queue counts calls: a chunk that does not fit is shed whole)
            if not self._queued_calls and self._serving and call.sync <= 0 and (
                worker := self._pick(call)
            ) is not None and not worker.outstanding:
                # Nothing waits, and it never could (max_queue 0, or it weighs more): it goes past
                # its connection's share to an idle worker rather than be refused "overloaded" by
                # an idle broker (hostile testing, round 83: with max_queue 0, one client's
                # pipelined calls to idle workers were, all but one); to a busy one, no (round 85:
                # batches of 1000 took every place, and other clients' calls were refused); nor a
                # blocking sync call, which holds its worker whole (round 88: one connection's 2
                # pipelined slow calls held both workers, and every other sync call was refused).
                self._send(worker, call)
            else:
                self._finish(call, _OVERLOADED, ErrorCode.OVERLOADED, remaining=False)
        else:
            hold(call)
            if not owner.in_flight and self._queue.is_held(owner):  # (held for its share, and all its calls
                self._queue.release(owner)  # ended or expired since: none would bring it back; `_pump` decides)
            self._queue.append(call, owner)
            self._queued_bytes += call.held
            self._queued_calls += call.weight
            owner.queued += call.weight
            self._largest.grew(owner)
            self._largest.trim(len(self._queue))
            # It may be the head now (its connection served least), and a worker may take
            # it: one blocked, that the head before did not fit; or any, if every call
            # before it waits for its connection's share (held out of turn)
            self._pump()

    def _send(self, worker: Worker, call: Call) -> None:
        call.worker = worker
        worker.outstanding += call.weight
        if len(call.params) >= self._heavy_bytes:  # (large params: a worker holds max_worker_params_bytes at most)
            heavy = call.heavy = self._large(call)
            worker.heavy += heavy
            call.owner.heavy += heavy
            if heavy:
                worker.heavy_calls[call] = _clock()
        worker.took_calls = True  # (its exit is no boot crash loop: `Pool._failures_after`)
        calls = worker.calls = worker.calls + call.weight  # (recycling: max_calls_per_worker)
        if calls >= worker.recycle_at:  # (once a process: then out of reach, `Pool.worker_worn`)
            self.worker_worn(worker)
        call.owner.in_flight += call.weight
        # A call not known to block, to a worker not busy in one, may come back unstarted if
        # its method turns out slow there (`_returned`). Not one sent to a blocked worker: it
        # waits behind a known slow call, and given back after each it would never run.
        if call.sync <= 0 and not worker.blocked:
            flow = call.owner.flow | self._returnable
        else:
            flow = call.owner.flow
            if worker in self._alone:  # (alone in its worker, whatever the other front-ends send: wire.ALONE)
                flow |= ALONE
                if self.on_struck is not None and call.slots is None:  # (several front-ends: it may wait its
                    self._unstarted[call.call_id] = call.params  # turn there, wire.STARTS; a chunk's never does)
        if call.sync > 0:  # the worker is (or will be) blocked in it: take its limit down
            # (and when is it expected to end? the calls run one after another: `_pick_blocked`)
            est = self._sync_us[call.index] if call.methods is None else sum(
                self._sync_us[m] for m in call.methods if self._blocking[m]
            )
            now = _clock()
            if not worker.sync_calls:
                worker.sync_since = worker.sync_until = now
            worker.sync_until = max(worker.sync_until, now) + max(est, 0) * 1e-6
            worker.sync_calls += call.sync
            call.owner.blocking += call.sync
            if not worker.blocked and self._sync_routing:
                worker.blocked = True
                worker.limit = self._sync_limit
                self._blocked += 1
        self._pending[call.call_id] = call
        # With its deadline: its tick's end, when the wheel answers it -32001, less the 1 ms
        # by which uvloop's timers fire early (loop.time(): CLOCK_MONOTONIC in ms, floored,
        # so the worker's time.monotonic() reads no less). The worker starts no call past
        # it, whatever frames its CANCEL waits behind (see `wire`).
        worker.channel.send_call(  # type: ignore[union-attr]
            call.kind, call.call_id, call.index, call.tick * self._tick_seconds - TIMER_EARLY, flow, call.params,
        )
        if self._keep_params:  # (log_params: what its access line shows, `accesslog.keep_params`)
            call.kept = keep_params(call.params, call.weight)
        # Sent: its params are the worker's now. Not kept while it runs (nor the body they
        # are a view of): hostile testing, round 13, 40 batches of a long call and an echo
        # of 900 kB held their 36 MB of requests until the long calls ended.
        call.params = b""

    def _on_timeout(self, call: Call) -> None:
        queued = call.worker is None
        if not queued and self._unstarted and call.call_id in self._unstarted:
            self._loop.call_soon(self._alone_timed_out, call)  # (out of the wheel's run: it reads replies)
            return
        if queued:  # still queued: it gives up its place and bytes now
            self._expired_queued += 1
            self._queued_bytes -= call.held
            self._queued_calls -= call.weight
            call.owner.queued -= call.weight
        self._finish(call, timed_out(call, not queued), ErrorCode.TIMED_OUT)
        if not queued:
            self._cancel_overdue(call)
            return
        # ... and its payload: the shell left in the queue holds no params or ids (a
        # live head with a long deadline would keep every expired call behind it).
        call.params = b""
        call.id = NO_ID
        call.ids = call.slots = call.methods = None
        if self._queue.expire_head(call, call.owner):  # its connection's head: out at once (FairQueue)
            self._expired_queued -= 1
            if not self._queue:
                self._largest.clear()
        elif self._expired_queued * 2 > len(self._queue):
            self._compact()
        if self._alone_held:  # (it may have held its connection's calls out of turn: `_pick_alone`)
            self._release_all()
            self._pump()
        elif self._blocked or self._room_waiters or self._share_waiters:  # what waited behind it may fit
            # a blocked worker it did not (found by the state machine test, stop 30: it waited for the
            # sync call); or it waited for room for its params, and its connection's calls behind it go
            # back in turn (round 93: they waited to their deadlines)
            owner = call.owner
            if owner in self._room_waiters or owner in self._share_waiters:  # (it keeps its place)
                self._queue.release(owner)
            self._pump()

    def _alone_timed_out(self, call: Call) -> None:
        """`_on_timeout` of a call sent ALONE to a worker with other front-ends, which tells
        when such a call starts (wire.STARTS), a loop turn later: what the worker wrote is read
        first. No STARTS in it: the call never started, nor will (the worker tells STARTS before
        it starts one, and starts none past its deadline), and the client is told `"started":
        false` (hostile testing, round 135: one that timed out waiting its turn was answered
        without it). Answered meanwhile (or its worker died: `_again`), nothing is left to do."""
        worker = call.worker
        if self._pending.get(call.call_id) is not call or worker is None:
            return
        started = True  # (unless known otherwise)
        if worker.channel is not None:
            worker.channel.drain()
            if self._pending.get(call.call_id) is not call:
                return
            started = call.call_id not in self._unstarted
        self._finish(call, timed_out(call, started), ErrorCode.TIMED_OUT)
        self._cancel_overdue(call)

    def _cancel_overdue(self, call: Call) -> None:
        """`call`, sent, is past its deadline and answered: its worker is told to cancel it, and
        is overdue until it answers (killed as hung `cancel_grace` later, `_check_hung`)."""
        worker = call.worker
        if worker is not None and worker.channel is not None:
            worker.channel.send(wire.Kind.CANCEL, call.call_id, 0, b"")
            self._loop.call_later(self._cancel_grace, self._check_hung, call)
            # Until it answers, its worker is the last choice for new calls: a live one answers
            # a CANCEL at once, one that does not is stopped, or held in a sync call (hostile
            # testing, round 84: a SIGSTOPped worker was sent calls for its cancel_grace, each
            # answered -32001 after its deadline while the other worker had room).
            first = not worker.overdue
            worker.overdue.add(call.call_id)
            if first:
                self._overdue += 1
                if self._queued_calls and all(w.overdue for w in self._ready):
                    self._pump()  # (every ready worker overdue now: they take what waits, as the last choice)


    def _finish(self, call: Call, error: bytes, code: int, remaining: bool = True) -> None:
        """Answer `call` with a broker error (once); `remaining=False` when not yet counted."""
        if call.tick:
            self._deadlines.remove(call)
        dropped = 0
        if call.worker is None:  # never sent: its notifications are dropped unrun
            dropped = call.slots.count(-1) if call.slots is not None else int(call.kind == NOTIFY)
            if dropped:
                self.notifications_dropped[code] = self.notifications_dropped.get(code, 0) + dropped
        if code == ErrorCode.OVERLOADED:  # (round 106: its notifications were counted as calls refused)
            self._count_shed(call.weight - dropped, dropped)
        exchange = call.exchange
        if exchange is None:
            return
        call.exchange = None
        if call.slots is not None:  # a chunk: every call in it not yet answered
            self._fail_chunk(call, exchange, error, remaining)
            return
        self._count_error(call, call.index, code, _clock() - call.arrival)
        # (a broker error: small, counted all the same; nothing for a connection gone)
        answer = response_error(call.id, error) if exchange.budget.outgoing is not GONE else b""
        exchange.budget.keep(exchange, len(answer))
        if remaining:
            exchange.fill(call.slot, answer, http_status(code))
        else:
            exchange.remaining -= 1
            exchange.answers[call.slot] = answer
            if not exchange.batch:
                exchange.status = http_status(code)
