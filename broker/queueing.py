"""Queueing: the calls waiting for a worker, and how they leave the queue (`Queueing`).

`dispatch.Dispatcher` inherits these methods (a mixin with no state of its own: the
attributes it reads are the dispatcher's, declared in broker/dispatcher_state.py for the type
checker). A call no worker takes at once (`Dispatcher._start`) waits in the queue, and
`_pump` starts what waits whenever a worker frees capacity; a connection past its share of
the workers' places has its calls held out of turn until it gives places back
(`_give_back`); a full queue sheds (`_make_room`); a connection gone takes its calls with it
(`abandon`); the calls whose deadline passed while queued leave as empty shells (`_dequeue`,
`_compact`).

The queue (`broker.fairqueue.FairQueue`) is fair among connections: each connection's
calls keep their order, and the connections waiting take turns (self-clocked fair
queueing, by calls: a chunk costs its calls), so one client's flood holds another's call
behind about one call of each connection waiting, not behind the whole flood (hostile
testing, round 53: 1.8 s in arrival order). A new call never
overtakes the queue: while a live call waits there, new calls queue too (each behind
its own connection's). Whenever a worker frees capacity (a reply, a worker becoming
ready, a lost worker's calls moving on), `_pump` hands the head of the queue to the
best worker, again and again until the queue is empty or no worker is under its
limit (passing over the calls of connections that hold their share, below): every
freed slot is filled at once. A
chunk of a batch (several calls as one unit) needs what a single call needs, one
worker under its limit (a blocked worker, broker/routing.py, needs room for all of its calls),
and then overshoots that limit by its size: so a chunk at the
head is never passed over, and never waits for a worker to empty entirely. Its answers
come back part by part as its calls end (CHUNK_PART), and each part gives back the
capacity of the calls it answers, which queued calls take at once: a chunk holds only
its calls still running (its `weight`, once sent, counts those), not its worker's
whole capacity until its slowest call ends.

One connection's calls hold at most its share of the workers' places at once: the ready
workers' `worker_concurrency` added up, times `connection_share` (0.5 by default; the
connection's `answers.ResponseBudget` counts its calls in flight). Its next call waits in
the queue, and its calls there are held out of turn (`FairQueue.hold`) while the other
connections' go, until one of its calls ends and its next fits again (`_give_back`).
The rest of the places are kept for the others: without it, one batch of 250 long calls
took every place of 2 workers, and every other client waited until they ended (hostile
testing, round 53). A connection with nothing in flight may always start its next call,
whatever it weighs. A batch that does not fit in its connection's share left goes in
chunks of at most the share over the workers, which take their turns with the
connection's other calls (so a batch of 250 `sleep(3)` on 2 workers of 100 takes three
rounds, 9 s); one that fits goes in one chunk a worker (`Dispatcher._start_chunks`). The share is not
work-conserving: a client alone gets no more than its share, which is what keeps places
free for the client that comes next (a call in flight cannot be taken back). A connection
lost before its answers (`abandon`: reset, or a write that fails) has its calls owed an
answer dropped from the queue and cancelled in flight, so its places come back; its
notifications run on. (A share of all connections' notifications together, tried in stop
31, let one client's notification flood hold another client's calls behind that client's
own notification: hostile testing, round 58. It is not there.) A full queue sheds the newest calls of the connection with
the most waiting (`_make_room`), not the newcomer.

What a queued call keeps alive is bounded by `max_queue_bytes`: its raw id and params
are zero-copy views into the request body, and one small view would keep the whole
body (up to `max_body_bytes`) alive, so they are copied out when the call is queued
(`calls.hold`, in `Dispatcher._start`), and the bytes counted are those copies. `max_queue` counts calls (a chunk its weight,
a running count). A queued call whose deadline passes is answered and releases its
payload at once (`Dispatcher._on_timeout`); its empty shell stays in the queue (removing it from the middle is
O(n)) until it reaches the head, or until shells are more than half the queue and
`_compact` drops them all (amortised O(1) each): a live head with a long deadline
once kept every expired call behind it, and its params, alive.
"""

from __future__ import annotations

import logging
import time
import typing

from broker import wire
from broker.accesslog import ABANDONED
from broker.calls import held_bytes, live, owed
from broker.dispatcher_state import DispatcherState
from broker.jsonrpc import ErrorCode, error_object

if typing.TYPE_CHECKING:
    from broker.accesslog import AccessLog
    from broker.answers import Exchange, ResponseBudget
    from broker.calls import Call

__all__ = ["SHED_LOG_SECONDS", "Queueing"]

_OVERLOADED = error_object(ErrorCode.OVERLOADED, data="queue full")
SHED_LOG_SECONDS = 60.0  # calls shed or refused for a full queue: a WARNING at the first, then their count this often
log = logging.getLogger("broker.dispatch")  # (the dispatcher's logger: these are its lines)
_clock = time.perf_counter


class Queueing(DispatcherState):
    """`dispatch.Dispatcher`'s queue: `_pump` and what it needs (see the module docstring).

    (A mixin with no state of its own: what it reads of the dispatcher's is declared in
    `dispatcher_state.DispatcherState`.)
    """

    def _make_room(self, call: Call) -> bool:
        """The queue is full (`max_queue`, `max_queue_bytes`) for `call`: shed the newest
        queued calls of the connection with the most calls waiting (`_largest`), -32000, to
        make room for it, and return True; or shed nothing and return False. So a connection
        that floods the queue loses its own newest calls to another's, rather than every other
        connection's new calls being shed (the longest queue drops its tail, as FQ-CoDel's
        drop from the fattest flow does: RFC 8290 section 4.1.2). Only if the calls shed make
        room for `call` (its calls and bytes: hostile testing, round 58, shedding until the
        newcomer fitted, a call too large ever to fit shed 200 of another client's calls for
        nothing) and that connection keeps at least as many waiting as `call`'s will have. A
        queued chunk is shed whole, so one call may shed up to a chunk (share/workers calls):
        its room then takes the calls that come after it (round 59: shedding no more calls
        than came, a flood queued in chunks was never shed, and every other client's call
        was refused)."""
        owner = call.owner
        weight = call.weight
        size = held_bytes(call)
        if weight > self._max_queue or size > self._max_queue_bytes:
            return False
        queue = self._queue
        largest = self._largest
        largest.trim(len(queue))
        fattest = largest.top()
        if fattest is None or fattest is owner or fattest.queued <= owner.queued + weight:
            return False
        calls = self._queued_calls + weight - self._max_queue  # to free
        held = self._queued_bytes + size - self._max_queue_bytes
        shed = taken = 0
        for queued in queue.newest(fattest):  # (a dry run first: all or nothing)
            if calls <= 0 and held <= 0:
                break
            taken += 1
            if queued.tick:  # (an expired call's shell frees nothing: taken out with the rest)
                shed += queued.weight
                calls -= queued.weight
                held -= queued.held
        if calls > 0 or held > 0 or fattest.queued - shed < owner.queued + weight:
            return False
        for _ in range(taken):
            out = queue.pop_last(fattest)
            if out.tick:
                self._queued_bytes -= out.held
                self._queued_calls -= out.weight
                fattest.queued -= out.weight
                self._finish(out, _OVERLOADED, ErrorCode.OVERLOADED)
            else:  # an expired call's shell: counted out already
                self._expired_queued -= 1
        return True

    def abandon(self, owner: ResponseBudget) -> None:
        """`owner`'s connection is gone (closed or reset before its answers, not half-closed):
        its calls owed an answer are dropped from the queue, never run, and those in flight
        are cancelled on their worker (CANCEL, as at a deadline; a sync handler already
        running runs on, and is killed as hung only past its deadline and cancel_grace), as
        nginx aborts a proxied request whose client went (`proxy_ignore_client_abort off`).
        Their places come back: a closed connection's calls held them until they ended, and
        the next connection got a share of its own, so one client taking a connection at a
        time took every place (hostile testing, round 57: 2 sequential connections, another
        client's call waited 11.7 s). Notifications run on: nobody waits for them. Counted
        in `abandoned_total`. O(its calls queued + the calls in flight)."""
        self._drop(owner, owed)

    def cancel(self, exchange: Exchange) -> None:
        """The client cancelled the request `exchange` answers (MCP's `notifications/cancelled`,
        broker/frontend/mcp.py): its calls still queued are dropped, never run, and those in
        flight cancelled on their worker, as `abandon` does for a whole connection's; counted in
        `abandoned_total` too. Its answer, if any, is the front-end's: the exchange is not called
        back for these calls. O(its connection's calls queued + the calls in flight)."""
        self._drop(exchange.budget, lambda call: call.exchange is exchange)

    def _drop(self, owner: ResponseBudget, which: typing.Callable[[Call], bool]) -> None:
        """`owner`'s calls `which` takes, owed an answer: out of the queue, or cancelled in flight;
        each told to the access log, `abandoned` (`_abandoned`: its only line, as no answer comes)."""
        if owner.queued:
            for call in self._queue.remove(owner, which):
                if not call.tick:  # (an expired one's shell: answered and counted out already)
                    self._expired_queued -= 1
                    continue
                self._queued_bytes -= call.held
                self._queued_calls -= call.weight
                owner.queued -= call.weight
                self._deadlines.remove(call)
                if self.access is not None:
                    self._abandoned(call, self.access)
                call.exchange = None
                self.abandoned_total["queued"] += call.weight
            if self._queue.is_held(owner):  # (its notifications left: held for a call that went, maybe)
                self._queue.release(owner)
            if self._alone_held:  # (its call may have been the one waiting for a worker of its own: round 80,
                self._release_all()  # the reservation made for it outlived it; `_pump` decides again)
            self._pump()  # (the head may be another now, which a blocked worker takes; and `_check_idle`)
        if owner.in_flight:
            now = _clock()
            for call in [c for c in self._pending.values() if c.owner is owner and c.exchange is not None and which(c)]:
                if call.tick:
                    self._deadlines.remove(call)
                if self.access is not None:
                    self._abandoned(call, self.access)
                call.exchange = None
                self.abandoned_total["in_flight"] += call.weight
                worker = call.worker
                if worker is not None and worker.channel is not None:
                    worker.channel.send(wire.Kind.CANCEL, call.call_id, 0, b"")
                    wait = max(0.0, call.arrival + call.timeout - now) + self._cancel_grace
                    self._loop.call_later(wait, self._check_hung, call)

    def _abandoned(self, call: Call, access: AccessLog) -> None:
        """Tell `access` of `call` (owed an answer, its exchange still set) dropped for its client:
        a line `abandoned` (`accesslog.ABANDONED`) for it, or for each call of a chunk not answered
        yet, as an answer would have had (cold: a connection gone)."""
        duration = _clock() - call.arrival
        if call.slots is None:
            access.call(call, ABANDONED, duration)
            return
        answers = typing.cast("Exchange", call.exchange).answers
        for i, slot in enumerate(call.slots):
            if slot >= 0 and answers[slot] is None:
                access.element(call, i, ABANDONED, duration)

    def _dequeue(self) -> Call:
        """The first call of the queue, counted out of it."""
        call = self._queue.popleft()
        if call.tick:
            self._queued_bytes -= call.held
            self._queued_calls -= call.weight
            call.owner.queued -= call.weight
        else:  # expired while queued: counted out already (_on_timeout)
            self._expired_queued -= 1
        if not self._queue:
            self._largest.clear()  # (every connection has 0 waiting: round 58, stale entries kept their budgets)
        return call

    def _give_back(self, owner: ResponseBudget) -> None:
        """`owner`'s connection gave back places: if its calls wait held out of turn for
        its share, and its next fits now, put them back in turn."""
        queue = self._queue
        if queue.is_held(owner):
            head = queue.first(owner)
            if (owner.in_flight + head.weight <= self._share or not owner.in_flight) and (
                head.sync <= 0 or owner.blocking + head.sync <= self._sync_share or not owner.blocking
            ):
                queue.release(owner)

    def _release_all(self) -> None:
        """Every connection held out of turn goes back in turn (the share grew, places came
        back, or the queue is emptied, or a worker can run a call alone); `_pump` holds
        again those still past their share, or waiting for a worker to run a call alone."""
        self._queue.release_all()
        self._alone_held = False
        self._room_waiters.clear()
        self._room_heap.clear()
        self._share_waiters.clear()
        self._reserved = self._reserved_for = None

    def _pump(self, again: bool = False) -> None:
        """Start queued calls, in the queue's order (`FairQueue`), while a worker is under
        its limit. A call whose connection would go past its share of the workers' places
        (`connection_share`) is not started: its connection's calls are held out of turn
        (`FairQueue.hold`) until it gives places back (`_give_back`). A large call that joined
        those waiting for room (`Routing._pick_blocked`) goes, if the room takes it in their
        order, in a second round (`again`: once)."""
        queue = self._queue
        metrics = self.metrics
        share = self._share
        if self._isolation.alone and _clock() >= self._isolation.next_end:
            self._isolation_ends()
        if self._room_waiters:  # (those that room came for go back in turn first, oldest first)
            self._release_for_room()
        elif self._reserved is not None:  # (none waits: no worker is kept for one)
            self._reserved = self._reserved_for = None
        while True:
            call = queue.head()
            if call is None:
                break
            if call.tick:  # (else it timed out while queued: just drop it)
                owner = call.owner
                if (owner.in_flight + call.weight > share and owner.in_flight) or (
                    call.sync > 0 and owner.blocking + call.sync > self._sync_share and owner.blocking
                ):
                    queue.hold(owner)
                    continue
                worker = self._pick(call)
                if worker is None:
                    if len(call.params) >= self._heavy_bytes and self._roomless:
                        # (it waits for room for its params, and whatever else: the others go on; round
                        # 93, a call of a method run alone stopped the queue here, every client 4 s)
                        queue.hold(owner)
                        if self._roomless == 2:
                            self._share_waiters[owner] = None
                        else:  # (one let go that sent nothing keeps its place; a new one goes last)
                            if self._roomless == 3:  # (it joined those waiting: the room may take it now)
                                self._joined = True
                            self._push_waiter(owner)  # (by size: `_release_for_room`; a stale entry is passed over)
                            self._room_waiters[owner] = None
                            self._releasing.discard(owner)
                            if self._reserved is None and owner is next(iter(self._room_waiters)):
                                self._reserve(owner)  # (the oldest, fitting nowhere: see `_release_for_room`)
                        continue
                    if self._isolation.alone and call.slots is None and call.index in self._isolation.waits and (
                        self._ready
                    ):
                        # (it waits for a worker of its own, `_pick_alone`: the others go on)
                        queue.hold(owner)
                        self._alone_held = True
                        continue
                    break
                self._dequeue()
                self._send(worker, call)
                if self._releasing and owner in self._releasing:  # (it waited for room, and went: its next
                    self._releasing.discard(owner)  # large call waits behind those waiting, if any)
                    self._room_waiters.pop(owner, None)
                    if owner is self._reserved_for:
                        self._reserved = self._reserved_for = None
                elif call.heavy and self._room_waiters and owner in self._room_waiters:  # (it went another way, put
                    del self._room_waiters[owner]  # back in turn by its own answer: it waits no more; round 97)
                    if owner is self._reserved_for:
                        self._reserved = self._reserved_for = None
                if metrics is not None and not call.again:  # (a call given back was observed at its first send)
                    metrics.queue_wait.observe_us(int((_clock() - call.arrival) * 1e6), call.weight)
            else:
                self._dequeue()
        if self._releasing:  # (let go for room, and held again for something else, or with nothing left;
            for owner in self._releasing:  # one still in turn, not reached, keeps its place)
                if not owner.queued or queue.is_held(owner):
                    self._room_waiters.pop(owner, None)
            self._releasing.clear()
            if self._reserved_for is not None and self._reserved_for not in self._room_waiters:
                self._reserved = self._reserved_for = None
        if not queue:
            self._largest.clear()
        if self._joined:  # (large calls joined those waiting for room: those the room takes go now, once)
            self._joined = False
            if not again and self._room_waiters:
                self._pump(True)
                return
        if self._alone and not self._alone_held and self._unreserve() and queue.head() is not None:
            self._pump()  # (no call waits for a worker of its own: what the reservation freed is used)
            return
        self._check_idle()

    def _compact(self) -> None:
        """Drop the expired shells from the queue (more than half of it), in place."""
        self._queue.drop(live)
        self._expired_queued = 0
        if not self._queue:
            self._largest.clear()

    def _count_shed(self, calls: int, notifications: int) -> None:
        """`calls` were refused -32000 (and `notifications` dropped) for a full queue: say so in
        the log at the first, then every SHED_LOG_SECONDS while more are, with how many (new
        user, round 99: an operator tailing the log saw a healthy broker while clients got
        503s; as nginx logs "limiting requests", its rate-limited refusals). The count of an
        interval is logged at its end (`_log_shed`), or at the end of the drain, whether
        more come or not (new user, round 100: a burst of 11 was logged as 1, and the other
        10 only if another came a minute later)."""
        self._shed_unlogged += calls
        self._shed_notes += notifications
        if self._shed_timer is None:
            log.warning("queue full: %s; max_queue %d calls, max_queue_bytes %d (how many more: a line every %g s "
                        "while it goes on)", self._shed_said(), self._max_queue, self._max_queue_bytes,
                        SHED_LOG_SECONDS)
            self._shed_since = self._loop.time()
            self._shed_timer = self._loop.call_later(SHED_LOG_SECONDS, self._log_shed)

    def _shed_said(self) -> str:
        """How many were shed since the last line ("3 call(s) refused -32000 (Server
        overloaded)", and the notifications dropped, which get no answer), counted anew."""
        said = [f"{self._shed_unlogged} call(s) refused -32000 (Server overloaded)"] if self._shed_unlogged else []
        if self._shed_notes:  # (round 107: "0 call(s) refused" when a notification was the first)
            said.append(f"{self._shed_notes} notification(s) dropped")
        self._shed_unlogged = self._shed_notes = 0
        return " and ".join(said)

    def _log_shed(self, last: bool = False) -> None:
        """The end of an interval since the last "queue full" line (or of the drain, `last`):
        log how many were shed in it, if any, and wait for another interval; else the next
        one shed is logged at once."""
        self._shed_timer = None
        if self._shed_unlogged or self._shed_notes:
            now = self._loop.time()
            log.warning("queue full: %s in the last %.3g s", self._shed_said(), now - self._shed_since)
            self._shed_since = now
            if not last:
                self._shed_timer = self._loop.call_later(SHED_LOG_SECONDS, self._log_shed)
