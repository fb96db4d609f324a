"""Routing: which worker a call goes to, and when none should take it yet (`Routing`).

`dispatch.Dispatcher` inherits these methods (a mixin with no state of its own: the
attributes it reads are the dispatcher's, declared below for the type checker). The queue
hands its head to `_pick` (`Dispatcher._pump`); a call that finds no worker waits there,
and one that waits for something only some calls need (a worker of its own, room for its
large params) has its connection's calls held out of turn while the others go on.

A worker's limit is `worker_concurrency`, except while it has a blocking sync call in
flight: a sync handler (`wire.Hello.sync_methods`) blocks the worker's whole process,
so anything sent to it waits behind that call, and would be taken down with it if
the call hung and the worker were killed. A worker busy in such a call gets no more
than it can start: at most one blocking sync call in flight, and its limit is
`1 + sync_prefetch` calls in flight (that call and a small prefetch of other calls,
which start the moment it returns; a chunk counts its calls there: it goes to such a
worker only if all of them fit under that limit, else it waits for another worker).
Such a worker is the last choice: it gets a call only when no unblocked worker can
take it, and of several such, the one whose blocking calls should end first (their
methods' estimates, below, from when they were sent, and never less than they have run:
one is expected to run as long again as it has; a call of `add`, briefly learnt blocking
on a loaded machine, blocked one worker of 2 and the next `add` went behind a 4 s call on
the other half the time, hostile testing, round 88). The estimate is a method's, not a
call's: of a method fast for some params and slow for others, a call may still go behind
a long call while that call has run less than the method's estimate (which is why
`sync_prefetch` is 0 by default: the call waits in the queue for the first worker free,
hostile testing, rounds 90 and 91). A batch's blocking sync calls go out one by one (a chunk of 50 of them would
be head-of-line by itself; a chunk counts its sync calls all the same).

One connection's blocking sync calls hold at most `connection_share` of the ready workers
(at least one; `ResponseBudget.blocking` counts them): each holds its worker whole, so without
it one connection's 2 slow sync calls held both workers of 2 and every other client waited
(round 60's new user; round 62: 64 pipelined calls, 7.7 s). Its next one waits held out of
turn, as a call past its share of places does.

A blocking sync call itself goes at once, as any call does, to the least loaded worker
under its limit that is not blocked already (an idle one if there is one). The calls
already in flight there wait behind it, and die with it if it hangs and the worker is
killed: it takes with it those calls (the fewest the broker could find) and at most
`sync_prefetch` sent after it. It waits in the queue only when no such worker has
room, every worker being blocked or at its limit, and then the calls behind it wait
with it, as they would for any call at the head: never longer than until a
worker returns its sync call or frees a place. It never holds a worker nor waits
while one could take it: a version that sent it only to a worker with at most
`sync_prefetch` calls in flight, and held one for it meanwhile, let one short sync
call behind two long polls stall every async call (the held worker took none, and
the other was blocked).

With `sync_prefetch` at `worker_concurrency` or more, none of this applies: every call
is routed as before. (At one less, `1 + sync_prefetch` is `worker_concurrency` itself:
the limit is not lower in number, but the worker is blocked all the same
(`Worker.blocked`): the last choice, and no second blocking sync call.)

A sync method counts as blocking while its calls take `BLOCKING_US` or more in the
worker, as the worker measures them: a moving average of each reply's service time,
moving 1/8 of the way to each new one (a 200 ms method is blocking after its first
call; a 20 µs one needs an outlier past 8 ms, a loaded machine's descheduling, to
cross for a call or two; an estimate that jumped to each slower call flipped `add` to
blocking on every such outlier). A method starts as blocking until its first reply; a
reload keeps the estimate of a method that stays sync (`Dispatcher.set_methods`). A queued call is
routed as what its method is known to be when it is sent, not when it was queued
(`Dispatcher._reclassify` updates the queued calls of a method that crosses the threshold): the
calls of a fresh fast method, queued one by one behind its first call, go out at once
when its first answer comes. Until then they wait in the queue (a burst past
`max_queue` in that moment is shed: the README says what a fresh broker's first burst
costs).
A method learnt fast can still be slow for some params (fib(1), then fib(32)): its calls
then reach a worker many at a time, and the worker takes turns among the connections whose
calls wait in it (each frame's flow, `ResponseBudget.flow`; see `wire`), so another client's
call there waits for one slow call, not for all of them (hostile testing, round 60).
A reply whose handler never ran (params that did not bind, an unknown method: the
worker says so with `wire.NOT_RUN` in its aux) teaches nothing: a -32602 in 30 µs
from the initial estimate flipped a 3 s method to fast, and the next batch was dealt
to the worker busy in it.
Below the threshold the worker runs many of its calls in one slice of its loop, and
the limit would only add round trips: routing every call of the sync `add` this way
cut single-call throughput on 2 workers from about 32,000 to 13,000 calls/s, for no
gain.

A worker that dies takes every call it held, and which of them killed it cannot be told: the
methods of those calls run alone from then on (`broker.isolation`: a strike each, and its calls
alone until 1, 2, 4... of them, as it has 1, 2, 3... strikes, have answered). A call of an
isolated method goes only to a worker holding nothing (`_pick_alone`), which then takes nothing
else until it answers (its limit 0, blocked), on at most one connection's share of the workers
at once (a worker dead under one counts until its slot is back); with no worker idle, the least
loaded is reserved (limit 0) and runs it once empty. While it waits, its connection's calls are
held out of turn (`_pump`), and the others go on: released whenever a worker empties
(`_reserved_idle`), a blocked one is freed, or a held call expires. Without it, other clients'
calls sent beside a call that crashed its worker died with it, -32002, never run (hostile
testing, round 78: a third to a half of them).

What the calls in flight cost a worker is bounded for large params too: a worker binds each
call's params on its loop before the handler runs (1 MiB of small objects: 35 to 55 ms, and
~24 MB while the call runs), and its turns among connections (`wire`) bound what one
connection's calls cost another's, not many connections' together; nor can it take turns
among calls still in the channel behind a large call's frame (hostile testing, round 92: 12
connections' 16 calls of 1 MiB each held another client's calls 1.8 to 4.2 s, and each
worker at 850 MB). Params of `HEAVY_BYTES` or more (a chunk's calls' that are, together:
`_large`) count in their worker's `heavy`, at most `max_worker_params_bytes` (one such call
always goes, to a worker with none), and in their connection's, at most `connection_share` of
the ready workers' room (one always goes). A call with no room for its params waits in the
queue, its connection's calls held out of turn (`_pump`, `_roomless`), and others go on. The
connections waiting for a worker's room are kept in the order they came (`_room_waiters`);
each `_pump` first puts back in turn those that the room and places free now can take, the
oldest first (`_release_for_room`), whatever freed them (an answer, a worker unblocked or
back, a call expired: hostile testing, round 93, a connection let go only by a large call's
answer waited to its calls' deadlines beside an idle worker), and only those: putting every
waiting connection back in turn at each `_pump` would cost each answer a step per connection
waiting. A large call that comes while others wait (a new one, or of a connection put back
in turn by its own answer) joins them, and goes in their order, in a second round of the same
`_pump` if the room takes it (round 97: connections with calls in flight, put back in turn by
their answers, took the room freed, and a new connection's single call waited 17 to 21 s, three
times the median). A large call fits a worker with no room left for it only once that worker has none
in flight, so the oldest that fits nowhere has the worker expected free of them soonest kept for it
(`_reserve`, `_keep_sooner`): no other large call goes there until it has gone, and it is not passed over for
ever by smaller ones; the others, older or newer, go where they fit (round 94: with strict
first-in, first-out, behind one such call every other client's large call waited up to 19 s
with 4 MB of room free on each worker). Those past their connection's share
(`_share_waiters`) go back when one of its large calls ends.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
import time
import typing

from broker.calls import held_bytes
from broker.chunk import large_params
from broker.deadlines import TIMER_EARLY
from broker.dispatcher_state import DispatcherState
from broker.wire import CHUNK

if typing.TYPE_CHECKING:
    from broker.answers import ResponseBudget
    from broker.calls import Call
    from broker.channel import Worker

__all__ = ["BLOCKING_US", "HEAVY_BYTES", "Routing"]

log = logging.getLogger("broker.dispatch")  # (the dispatcher's logger: these are its lines)

BLOCKING_US = 1000  # a sync method whose calls take this long (µs) blocks its worker
_BLOCKED = 1 << 40  # added to a blocked worker's load when picking (past any real count)
# Large params: a worker binds a call's params on its loop, ~50 ms and ~24 MB a MiB of small
# objects; of those this large or more, it holds at most max_worker_params_bytes in flight. (Those
# under it, at most worker_concurrency: 100 x 16 KiB bind in ~80 ms; round 93: 100 x 63 KiB
# uncounted doubled the stall the bound leaves. 4 MiB over 16 KiB: 256 calls, past the default
# concurrency, so calls just over it are never held for room.)
HEAVY_BYTES = 16 * 1024
_LEFT_MS = 1 << 24  # a blocked worker's expected wait when picking, ms, at most (4.6 h; past it, equal)
_clock = time.perf_counter
# The worker kept for the oldest call waiting for room moves to another expected free of large
# params sooner (`Routing._drains_in`) by more than this, and more than twice as soon
RESERVE_MOVE_SECONDS = 1.0


def _drains_in(worker: Worker, now: float) -> float:
    """Seconds until `worker` is expected to hold no large params: as long again as the oldest
    of its calls that hold some has run (the rule of `_pick_blocked` for sync calls; round 91);
    0 if it holds none."""
    calls = worker.heavy_calls
    return now - next(iter(calls.values())) if calls else 0.0


def _keep_order(worker: Worker, now: float) -> tuple[float, int]:
    """Which worker to keep for a call waiting for room (the least): the one expected free
    of large params soonest (`_drains_in`), then the one with the fewest."""
    return _drains_in(worker, now), worker.heavy


class Routing(DispatcherState):
    """`dispatch.Dispatcher`'s routing: `_pick` and what it needs (see the module docstring).

    (A mixin with no state of its own: what it reads of the dispatcher's is declared in
    `dispatcher_state.DispatcherState`.)
    """

    def _pick(self, call: Call) -> Worker | None:
        """The ready worker with the fewest outstanding calls under its limit (see
        the module docstring); ties go round-robin (the scan starts one further each
        time), so one-at-a-time calls spread over the workers instead of all landing
        on the first. While a worker is blocked in a slow sync call, `_pick_blocked`
        decides. (A blocking sync call needs nothing more: with no worker blocked,
        the least loaded is where it goes.)"""
        if self._blocked or self._isolation.alone or self._overdue or len(call.params) >= self._heavy_bytes:
            return self._pick_blocked(call)
        ready = self._ready
        n = len(ready)
        if n <= 1:
            if n:
                w = ready[0]
                if w.outstanding < w.limit:
                    return w
            return None
        # The usual case, kept apart from _pick_blocked: its loop without the test for
        # a blocked worker, on every call.
        i = self._rotation = (self._rotation + 1) % n
        best: Worker | None = None
        least = 1 << 62
        for _ in range(n):
            w = ready[i]
            k = w.outstanding
            if k < least and k < w.limit:
                if k == 0:
                    return w
                best, least = w, k
            i += 1
            if i == n:
                i = 0
        return best

    def _pick_blocked(self, call: Call) -> Worker | None:
        """`_pick` while a worker is blocked in a slow sync call. A blocked worker is
        picked only when no other can take the call (there it would wait), never for
        a call holding blocking sync calls (one per worker: that call goes to the
        least loaded of the others, or waits in the queue if none has room), and only
        if the call's whole weight fits under its limit: a chunk there would wait as a
        whole, and die with the sync call if that hung. Nor while a worker is on its way
        back (`worker_restarting`): the call waits in the queue for it rather
        than behind a sync call that may be what crashed the other (hostile testing,
        round 77: another client's calls, sent behind one whose every call crashed its
        worker, died with it, -32002, never run). A call of an isolated method goes
        alone (`_pick_alone`). A call with large params (`_large`) goes only where there is
        room for them (max_worker_params_bytes), and only within its connection's share of
        the room; and while others wait for room (`_room_waiters`), only if `_release_for_room`
        let its connection go (or a worker is kept for it): else it joins them. None, with
        `_roomless` set, if nothing else kept it (`_pump` holds it)."""
        heavy = 0
        if len(call.params) >= self._heavy_bytes:
            self._roomless = 0
            heavy = self._large(call)
            owner = call.owner
            if heavy and owner.heavy and owner.heavy + heavy > self._heavy_share:
                self._roomless = 2
                return None
            if heavy and self._room_waiters and owner not in self._releasing and owner is not self._reserved_for:
                self._roomless = 3  # (others wait for room: it joins them, and goes in their order; hostile
                return None  # testing, round 97 M1, put back in turn by their own answers, pipelining
                # connections took the room freed, and a new connection's call waited 3 x the median)
        isolation = self._isolation
        if isolation.alone and call.slots is None and call.index in isolation.alone:
            if _clock() >= isolation.next_end:
                self._isolation_ends()
            if call.index in isolation.alone:
                alone = self._pick_alone(call)
                if alone is not None or call.index in isolation.waits:
                    return alone
                # (a first strike beside other methods': as any, with no worker free for it alone)
        ready = self._ready
        n = len(ready)
        if not n:
            return None
        sync = call.sync
        weight = call.weight
        now = _clock()
        i = self._rotation = (self._rotation + 1) % n
        best: Worker | None = None
        least = 1 << 62
        sooner = _LEFT_MS  # how soon a blocked worker with no room for the call is expected free, ms
        for _ in range(n):
            w = ready[i]
            k = w.outstanding
            limit = w.limit
            if w.blocked and sync <= 0 and limit:  # (0: running a call alone)
                # The last choice: the one whose blocking calls should end first (by their estimate,
                # or as long again as they have run if longer), and only what fits under its limit
                # (hostile testing, round 88: `add`, briefly learnt blocking on a loaded machine,
                # blocked one worker of 2, and the next `add` went behind a 4 s call on the other)
                left = w.sync_until - now
                if left < now - w.sync_since:  # (never less than it has run: round 91, a 4 s call of a
                    left = now - w.sync_since  # method estimated at 0.5 s read ~0 ms left at 0.5 s in)
                ms = min(int(left * 1000), _LEFT_MS)
                if k + weight <= limit:
                    k += _BLOCKED + (ms << 10)
                else:
                    sooner = min(sooner, ms)
                    k = least
            elif k >= limit or w.blocked:  # (full; or blocked, and a blocking sync call: one per worker)
                k = least
            elif w.overdue:  # stuck, maybe (stopped, its loop held: `_overdue`): none while another
                # ready worker is not, whatever waits (round 87: sent calls while the other was blocked)
                k = least if any(not x.overdue for x in ready) else k + _BLOCKED + (_LEFT_MS << 10)
            if k < least:
                if heavy and ((w.heavy and w.heavy + heavy > self._heavy_cap) or (
                    (w is self._reserved or (w is self._left_kept and w is self._moved_off()))
                    and owner is not self._reserved_for
                )):  # (no room for its params, round 92; or kept for the oldest waiting, round 94)
                    self._roomless = 1
                elif k == 0:
                    return w
                else:
                    best, least = w, k
            i += 1
            if i == n:
                i = 0
        if best is not None and best.blocked:
            if self.worker_restarting():
                return None
            if sooner < (least - _BLOCKED) >> 10 and (self._queue.head() is call or (
                self._queued_calls + call.weight <= self._max_queue
                and self._queued_bytes + held_bytes(call) <= self._max_queue_bytes
            )):
                # A worker with no room for it is expected free sooner: it waits in the queue
                # for it rather than take a place behind a longer call (round 90: every `spin(4)`
                # took an `add` behind it, the other worker blocked 1.5 ms at a time but full)
                return None
        return best

    def _pick_alone(self, call: Call) -> Worker | None:
        """`_pick` for a call of an isolated method (`broker.isolation`): a ready worker
        holding nothing, not blocked, which then takes nothing else until it answers (its
        limit 0, blocked, the call counted as a blocking sync call). At most one connection's
        share of the workers (`connection_share`, at least one) are spent on such calls at
        once, whatever their strikes (round 84: a first strike's took every worker, and every
        other call waited 5 s): running one, dead under one and not back yet (its slot
        restarting), or reserved for the next one; and never the last worker open to other
        calls (`_open_besides`: nu85, a fast call of another client's was left only a worker
        busy in a hung call, and died there). A reservation is made for a method that waits
        (`Isolation.waits`: caught alone, or struck twice) only: when no worker is idle, the least loaded takes nothing
        more until it is, one reservation at a time (under load a worker is never idle, and
        the call would wait for its deadline); an idle worker found meanwhile takes the call
        and the reservation ends (round 79: a call waited 5.8 s for the reserved worker's long
        call with the other worker idle). None: a call of a method that waits waits (`_pump`
        holds its connection's calls out of turn meanwhile, so the others go on; a reservation
        no call waits for ends there, `_unreserve`); any other goes as any (`_pick_blocked`)."""
        owner = call.owner
        if owner.blocking and owner.blocking >= self._sync_share:  # (each holds a worker whole, as a blocking sync call)
            return None
        alone = self._alone
        waits = call.index in self._isolation.waits
        cap = max(1, int((len(self._ready) + sum(alone.values())) * self._connection_share))
        chosen: Worker | None = None
        least: Worker | None = None
        draining: Worker | None = None
        for w in self._ready:
            if w in alone:
                if not w.blocked:  # reserved for a call run alone
                    if not w.outstanding:
                        chosen = w
                        break
                    draining = w
                continue
            if w.blocked:
                continue
            if not w.outstanding:
                chosen = chosen or w
            elif least is None or w.outstanding < least.outstanding:
                least = w
        if chosen is not None and chosen not in alone and draining is None and not self._open_besides(chosen):
            chosen = None  # (one left open to the others' calls, or the one draining for it released:
            # nu85, alone on the one worker not stuck in a hung call, it left a fast call of another
            # client's only the hung one, where it died)
        if not waits:  # a suspect not caught: an idle worker within the cap, or as any
            if chosen is None or chosen in alone or len(alone) >= cap:
                return None
            alone[chosen] = False
        elif chosen is None or chosen not in alone:
            if chosen is not None and draining is not None:  # an idle one instead of the one draining
                del alone[draining]
                draining.limit = draining.concurrency
            elif len(alone) >= cap:
                return None
            if chosen is None:
                if least is not None and draining is None and self._open_besides(least):  # reserved: it takes nothing more
                    least.limit = 0
                    alone[least] = False
                return None
            alone[chosen] = False
        chosen.blocked = True
        chosen.limit = 0
        self._blocked += 1
        call.sync = 1  # (so its answer unblocks the worker, as a blocking sync call's does)
        return chosen

    def _open_besides(self, worker: Worker) -> bool:
        """Is a ready worker other than `worker` open to any call (not running calls alone or
        reserved for one, not blocked in a sync call)? Or is `worker` the only one, no other on
        its way back (then it is spent on a call alone all the same; not while another slot
        restarts: a caught crasher's next call took the one left while the slot it crashed
        restarted, and both died in turn, hostile testing, round 90)? (One with calls overdue
        counts: it is left only while it answers, and a reservation made meanwhile would be
        given up for `worker` at the next call, `_pick_alone`.)"""
        alone = self._alone
        ready = self._ready
        if len(ready) == 1:
            return not self.worker_restarting()
        return any(w is not worker and w not in alone and not w.blocked for w in ready)

    def _isolation_timer(self) -> None:
        """Have `_isolation_due` run at the earliest time bound of the methods run alone (a call
        waiting for a worker of its own is freed then, and the metric and log say so then, not at
        the method's next call: round 80's new user, a call waited to its deadline)."""
        end = self._isolation.next_end
        timer = self._isolation_handle
        # (the timer armed for an end fires TIMER_EARLY after it: compared with that, one for
        # this end or sooner is kept, not cancelled and armed again for the same time)
        if end == math.inf or (timer is not None and timer.when() <= self._loop.time() + end - _clock() + TIMER_EARLY):
            return
        if timer is not None:
            timer.cancel()
        self._isolation_handle = self._loop.call_later(max(0.0, end - _clock()) + TIMER_EARLY, self._isolation_due)

    def _isolation_due(self) -> None:
        self._isolation_handle = None
        if self._isolation.alone:
            self._isolation_ends()
            self._pump()
        self._isolation_timer()

    def _isolation_ends(self) -> None:
        """Methods whose calls ran alone long enough since their last strike (`Isolation.expire`)
        run as any: the calls held waiting for a worker of their own go back in turn."""
        for index in self._isolation.expire(_clock()):
            if index < len(self._names):
                log.info("%s: its calls run as any again (its time alone since its last strike is over)",
                         self._names[index])
        self._release_all()

    def _unreserve(self) -> bool:
        """End the reservations (`_pick_alone`) no call waits for any more (it timed out,
        its connection went): those workers take any call again (round 79: one stayed out
        of use until its long call ended). True if one ended."""
        ended = False
        for w, dead in list(self._alone.items()):
            if not dead and not w.blocked:
                del self._alone[w]
                ended = True
                if w in self._ready:
                    w.limit = w.concurrency
        return ended

    def _large(self, call: Call) -> int:
        """The bytes of `call`'s large params (`HEAVY_BYTES` or more; a chunk's: those of its
        calls that are, together, `chunk.large_params`: a batch's calls bind one at a time, in
        slices, and a batch of 100 calls of 2 KB waited 24 to 29 s for room, round 93); 0 if
        none, or with no bound (max_worker_params_bytes 0)."""
        size = len(call.params)
        if size < self._heavy_bytes:
            return 0
        return size if call.kind != CHUNK else large_params(call.params, self._heavy_bytes)

    def _unheavy(self, worker: Worker, call: Call) -> None:
        """`call`'s large params are no longer on `worker` (answered, given back): room for
        those that wait for it (`_release_for_room`, at the `_pump` that comes next), and its
        connection's calls held for its share of the room go back in turn."""
        worker.heavy -= call.heavy
        worker.heavy_calls.pop(call, None)
        owner = call.owner
        owner.heavy -= call.heavy
        call.heavy = 0
        if owner in self._share_waiters:
            del self._share_waiters[owner]
            self._queue.release(owner)

    def _reserve(self, owner: ResponseBudget, promised: typing.Collection[Worker] = ()) -> Worker | None:
        """Keep the ready worker expected to be free of large params soonest (`_drains_in`; of
        those as soon, the one with the fewest; not one of `promised`) for `owner`'s first call,
        which fits no worker's room (`_release_for_room`): no other large call goes there until
        it has gone. Of those that take calls now: not one blocked in a sync call, overdue, or
        spent on a call run alone (hostile testing, round 96: one blocked had none, was kept,
        and the oldest waited 17.7 s for its sync call while newer calls took the room freed
        elsewhere; `_release_for_room` moves it off one that blocks later, or to one expected
        free much sooner: round 98, kept for the fewest, a worker running one long call with
        600 KB held the oldest 30 s, to its deadline, while the other served a stream of
        others' calls and never emptied). None if there is none."""
        now = _clock()
        self._reserved = min(self._keepable(promised), key=functools.partial(_keep_order, now=now), default=None)
        self._reserved_for = owner if self._reserved is not None else None
        return self._reserved

    def _keepable(self, promised: typing.Collection[Worker] = ()) -> typing.Iterator[Worker]:
        """The ready workers that may be kept for a call waiting for room (`_reserve`): that take
        calls now, and are not of `promised`."""
        alone = self._alone
        return (w for w in self._ready if w not in promised and not w.blocked and not w.overdue and w not in alone)

    def _keep_sooner(self, reserved: Worker) -> Worker:
        """The worker to keep instead of `reserved` (itself, or another that takes calls now
        expected free of large params sooner by more than RESERVE_MOVE_SECONDS and more than
        twice as soon: `_drains_in`, by how long their large calls have run; round 98), once
        for one waiting call. The one it moves off stays kept (`_left_kept`) while that call
        waits: hostile testing, round 99, opened again it took a fresh long call each time, and
        the keeping moved back and forth between two workers that never emptied while the call
        waited to its deadline; so the call goes when the first of the two empties, and no more
        than two workers are kept for it (round 100: moving on, one call closed 3 or 4 workers
        of 4 to others' large calls, 16 to 21 s)."""
        now = _clock()
        wait = _drains_in(reserved, now)
        if wait <= RESERVE_MOVE_SECONDS or self._moved_off():
            return reserved
        sooner = min(self._keepable((reserved,)), key=functools.partial(_keep_order, now=now), default=None)
        if sooner is not None and 2 * _drains_in(sooner, now) + RESERVE_MOVE_SECONDS < wait:
            self._left_for = self._queue.first(self._reserved_for)
            self._left_kept = reserved
            return sooner
        return reserved

    def _moved_off(self) -> Worker | None:
        """The worker the keeping moved off for the call that waits now (`_left_kept`), or None:
        it is kept for that one call, `_left_for`, and let go once another waits (round 100:
        kept after it had gone, it closed a worker to others' large calls whenever the same
        connection's next call waited, 9 to 29 s)."""
        left = self._left_kept
        if left is not None:
            kept = self._reserved_for
            if kept is None or not kept.queued or self._queue.first(kept) is not self._left_for:
                left = self._left_kept = None
                self._left_for = None
        return left

    def _closed(self, reserved: Worker | None) -> typing.Collection[Worker]:
        """The workers kept for `_reserved_for` (`reserved`, if still kept, and the one the
        keeping moved off while its call waits: `_moved_off`): no other connection's large call
        goes there."""
        if reserved is None:
            return ()
        left = self._moved_off()
        return (reserved,) if left is None else (reserved, left)

    def _release_for_room(self) -> None:
        """Put back in turn the connections waiting for room for their large params
        (`_room_waiters`) whose first calls the workers that take calls now (ready, a place
        free, neither blocked nor overdue) have room for (as if each went, first fit; a worker
        with none takes one, whatever its size): the oldest first if it fits, then the smallest
        first (`_room_heap`, so that those that fit are found without looking at those that do
        not: hostile testing, round 95, a call behind 16 that fit nowhere was never looked at,
        18 to 29 s with room for it free). The oldest that fits nowhere has the worker expected
        free of large params soonest kept for it (`_reserve`, `_keep_sooner`): no other large call goes there
        until it has gone, so that smaller ones do not pass it over for ever (round 94: with
        strict first in, first out, behind one such call every other client's large call waited
        up to 19 s with 4 MB of room free on each worker). One past its connection's share of
        the room waits for one of its own calls instead (`_share_waiters`). O(workers x (those
        let go + 1) + log(waiting)) amortised."""
        waiters = self._room_waiters
        queue = self._queue
        heap = self._room_heap
        reserved = self._reserved
        kept = self._reserved_for
        if reserved is not None and (
            kept is None or reserved not in self._ready or kept not in waiters
            or not self._waiting_size(kept) or reserved.blocked or reserved.overdue or reserved in self._alone
        ):  # (kept for one that waits no more, or it takes no call now: another is kept, below; round 97:
            # kept for a connection whose large call had gone, a worker sat idle while 53 waited)
            reserved = self._reserved = self._reserved_for = None
        elif reserved is not None:  # (kept for one whose long large call holds it: one free sooner; round 98)
            reserved = self._reserved = self._keep_sooner(reserved)
        free = [  # (a worker, and [its large params, its places free], as if those let go went)
            (w, [w.heavy, w.limit - w.outstanding]) for w in self._ready
            if w.outstanding < w.limit and not w.blocked and not w.overdue
        ]
        places = sum(room[1] for _w, room in free)
        go: list[ResponseBudget] = []
        first = None  # the oldest waiting: it goes first if it fits
        while waiters:
            first = next(iter(waiters))
            size = self._waiting_size(first)
            if size and first.heavy and first.heavy + size > self._heavy_share:
                size = 0  # (past its share: it waits for a call of its own to end)
                if queue.is_held(first):
                    self._share_waiters[first] = None
            elif size:
                break
            else:  # (gone, or its first call is not large now: whatever holds it, `_pump` decides)
                queue.release(first)
            del waiters[first]
            first = None
        if first is not None and places and self._fits(free, first, size, self._closed(reserved)):
            go.append(first)
            places -= 1
            if first is self._reserved_for:  # (it goes: the worker kept for it is kept no more)
                reserved = None
        kept = self._reserved_for  # (and the one a worker is kept for, wherever it waits)
        if reserved is not None and kept is not None and places and (size := self._waiting_size(kept)) and not (
            kept.heavy and kept.heavy + size > self._heavy_share
        ) and self._fits(free, kept, size, self._closed(reserved)):
            go.append(kept)
            places -= 1
            reserved = None
        closed = self._closed(reserved)
        while heap and places:  # (then the smallest first)
            size, _order, owner = heap[0]
            if owner not in waiters or owner in go or self._waiting_size(owner) != size:
                heapq.heappop(heap)  # (stale: gone, let go, or waiting for another size now)
                if owner in waiters and owner not in go:
                    self._push_waiter(owner)
                continue
            if owner.heavy and owner.heavy + size > self._heavy_share:
                heapq.heappop(heap)  # (past its share: it waits for a call of its own to end)
                del waiters[owner]
                if queue.is_held(owner):
                    self._share_waiters[owner] = None
                continue
            if not self._fits(free, owner, size, closed):
                break  # (the smallest fits nowhere: nor does any other)
            heapq.heappop(heap)
            go.append(owner)
            places -= 1
            if owner is self._reserved_for:
                reserved = None
                closed = ()
        for owner in go:  # (each keeps its place until a call of its goes: `_pump`)
            self._releasing.add(owner)
            queue.release(owner)  # (if held)
        if self._reserved_for is not None and self._reserved_for not in waiters:
            self._reserved = self._reserved_for = None
        if reserved is None and self._reserved is None:  # (the oldest not let go fits nowhere: one is kept for it)
            oldest = next(
                (o for o in waiters if o not in self._releasing and queue.is_held(o) and self._waiting_size(o)), None)
            if oldest is not None:
                self._reserve(oldest, {w for w, room in free if room[0] != w.heavy})
        if len(heap) > 2 * len(waiters) + 64:  # (stale entries bounded)
            heap.clear()
            for owner in waiters:
                self._push_waiter(owner)

    def _fits(
        self, free: list[tuple[Worker, list[int]]], owner: ResponseBudget, size: int, closed: typing.Collection[Worker]
    ) -> bool:
        """Whether a worker of `free` (`_release_for_room`) has a place and room for `size`
        bytes of `owner`'s large params (one of `closed`, kept for another's, no); if so, they
        are counted there, first fit."""
        cap = self._heavy_cap
        for w, room in free:
            if room[1] and (not room[0] or room[0] + size <= cap) and (w not in closed or owner is self._reserved_for):
                room[0] += size
                room[1] -= 1
                return True
        return False

    def _waiting_size(self, owner: ResponseBudget) -> int:
        """The bytes of large params of `owner`'s first queued call (0: none queued, or not large)."""
        return self._large(self._queue.first(owner)) if owner.queued else 0

    def _push_waiter(self, owner: ResponseBudget) -> None:
        """(Re)enter `owner`, waiting for room, in `_room_heap` by its first call's size."""
        size = self._waiting_size(owner)
        if size:
            heapq.heappush(self._room_heap, (size, next(self._room_order), owner))
