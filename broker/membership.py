"""Membership: the workers the dispatcher has, as they come, go and die, and a reload's method table (`Membership`).

`dispatch.Dispatcher` inherits these methods (a mixin with no state of its own: the
attributes it reads are the dispatcher's, declared below for the type checker). The pool
(broker/pool.py) tells the dispatcher when a worker is ready (`worker_ready`), leaves the
rotation (`worker_unready`: draining, retiring), or is gone (`worker_lost`: its calls are
answered -32002 at once, and the methods they were of run alone for a while, `_blame`,
broker/routing.py); when no worker can be back soon (`start_failed`, `no_worker_before`:
the queued calls are answered -32003); and a reload's method table (`set_methods`). A worker
that holds a call past its deadline and cancel_grace is killed as hung (`_check_hung`).
"""

from __future__ import annotations

import logging
import math
import struct
import time
import typing
from collections import Counter

from broker.calls import Call, Route, timed_out
from broker.catalog import DISCOVER, Catalog
from broker.channel import STOP_KILLED, WorkerState
from broker.chunk import with_methods
from broker.dispatcher_state import DispatcherState
from broker.jsonrpc import ErrorCode, error_object
from broker.routing import BLOCKING_US
from broker.wire import HOLD, NOTIFY, RETURN_ASIDE, RETURNABLE, MethodInfo

if typing.TYPE_CHECKING:
    from broker.channel import Worker

__all__ = ["RESTART_WAIT_SECONDS", "Membership", "MembershipTap"]

log = logging.getLogger("broker.dispatch")  # (the dispatcher's logger: these are its lines)

_DIED = int(ErrorCode.WORKER_DIED)  # notifications_dropped: those lost with their worker
_NO_WORKER = error_object(ErrorCode.NO_WORKER, data="every worker is down and waiting to restart")
STRUCK_KEPT = 64  # the deaths whose strikes are kept, each struck once (`_strike_once`)
RESTART_WAIT_SECONDS = 1.0  # calls wait for a worker back within this of the outage's start (a crash's restart backoff)
_clock = time.perf_counter
_DEADLINE = struct.Struct(">d")  # a BLOCKED frame's payload: the blocking call's deadline
_HELD, _BLOCKED = 1, 2  # why a worker is out of the rotation (`Worker.benched`): HOLD, BLOCKED


def _clients(calls: list[Call]) -> str:
    """Who sent `calls`, for a log line: their connections' addresses, most calls first,
    each with its count past one ("127.0.0.1:40312 x3, [::1]:5102"), at most 3 and how many
    more (round 80's new user: the log of a worker's death named no client)."""
    counts = Counter(_address(call.owner.peer) for call in calls)
    named = [name if n == 1 else f"{name} x{n}" for name, n in counts.most_common(3)]
    if len(counts) > 3:
        named.append(f"{len(counts) - 3} more")
    return ", ".join(named)


def _address(peer: object) -> str:
    """A transport's "peername" as a log names it: host:port, [v6 host]:port, or "unix socket"."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return "unix socket" if peer is not None else "?"


class MembershipTap(typing.Protocol):
    """Told of each change `Membership` makes, after it is made (`Dispatcher.membership_tap`)."""

    def methods(self, names: list[str], sync_methods: typing.Collection[str],
                infos: typing.Sequence[MethodInfo] | None) -> None: ...
    def ready(self, worker: Worker) -> None: ...
    def unready(self, worker: Worker) -> None: ...
    def lost(self, worker: Worker, reason: str) -> None: ...


class Membership(DispatcherState):
    """`dispatch.Dispatcher`'s side of the workers: ready, unready, lost, a reload's method
    table (see the module docstring).

    (A mixin with no state of its own: what it reads of the dispatcher's is declared in
    `dispatcher_state.DispatcherState`.)
    """

    def set_methods(self, names: list[str], sync_methods: typing.Collection[str] = (),
                    methods: typing.Sequence[MethodInfo] | None = None) -> None:
        """Install the method table announced by the workers' HELLO (in their order);
        `sync_methods` names those whose handlers are sync (`wire.Hello`); `methods`, the
        HELLO's `MethodInfo`s of `names`, make the `catalog` (broker/catalog.py; None: names
        alone, with no docstring, schema nor tool).

        Called again by a reload whose new workers serve another table, after the old
        workers left the rotation and before the new ones join (`Pool._swap`). Calls
        routed before carry the old table's indexes, so they are translated: a queued
        call gets its method's new index, or len(names) if the new code lost it (the
        worker answers that -32601, as for any unknown index); a call in flight on an
        old worker keeps the index it was sent with, and only the index its answer is
        counted under changes (`other` for a lost method).

        A sync method that was sync in the old table too keeps its service-time
        estimate (a reload of the same code must not make `add` slow again: a burst
        of batches right after a SIGHUP went out one call at a time and was shed,
        hostile testing); any other method starts unmeasured (a sync one as
        blocking, until its first reply; an async one made sync, or the reverse,
        starts afresh). A queued call's `sync` is recomputed from the new table (a
        chunk's: its count of blocking sync calls), and a call in flight on an old
        worker is marked `stale`: its reply still frees the worker's sync accounting
        it took, but teaches no estimate (the old handler's time says little of the
        new one, which may even be async).
        """
        old = self._names
        self.catalog = Catalog(methods if methods is not None else [MethodInfo(name) for name in names])
        self._isolation.clear()  # (new code; and the calls in flight on old workers are `stale`: no blame)
        self._alone = {w: dead for w, dead in self._alone.items() if not dead}  # (their slots have new workers)
        known = {name: self._sync_us[i] for i, name in enumerate(old) if self._sync_us[i] >= 0}
        sync = [int(name in sync_methods) for name in names]
        self._names = list(names)
        # One entry past the table too: `other`, the index a reload gives a lost method.
        self._sync_us = [*(known.get(name, BLOCKING_US) if s else -1 for name, s in zip(names, sync)), -1]
        self._blocking = [int(us >= BLOCKING_US) for us in self._sync_us]  # until a reply says otherwise
        self._routes = {
            name: Route(i, self._method_timeouts.get(name, self._timeout),
                        1 if self._blocking[i] else -1 if sync[i] else 0)
            for i, name in enumerate(names)
        }
        # When every method has the same deadline (the usual case) a batch needs no
        # grouping by deadline before it is cut into chunks.
        self._one_timeout = len({route.timeout for route in self._routes.values()}) <= 1
        if old:
            new = {name: i for i, name in enumerate(names)}
            self._translate([new.get(name, len(names)) for name in old] + [len(names)])
        if self.metrics is not None:
            self.metrics.set_methods(names)
        if self.access is not None:
            self.access.names = names
        for warning in self.policy.install([*names, DISCOVER]):  # (the broker's own: a method as any other)
            log.warning("%s", warning)
        if self.membership_tap is not None:
            self.membership_tap.methods(list(names), sync_methods, methods)

    def _translate(self, index: list[int]) -> None:
        """Old method index → new (`index`, one entry per old method plus `other`) for
        every call routed but not answered; a queued call's `sync` is recomputed from
        the new table, and a queued chunk's frame is rewritten too."""
        for call in self._pending.values():  # sent already: only their metrics index
            call.stale = True
            if call.methods is not None:
                call.methods = [index[m] for m in call.methods]
            else:
                call.index = index[call.index]
        blocking = self._blocking  # the new table's (its `other` entry is 0)
        for call in self._queue:
            if not call.tick:  # an expired shell (its payload released)
                continue
            if call.methods is None:
                call.index = index[call.index]
                call.sync = 1 if blocking[call.index] else -1 if self._sync_us[call.index] >= 0 else 0
                continue
            call.methods = [index[m] for m in call.methods]
            call.sync = sum(blocking[m] for m in call.methods)
            call.params = with_methods(call.params, call.methods)

    def worker_ready(self, worker: Worker) -> None:
        """A worker can take calls: add it to the rotation and give it queued work."""
        if worker not in self._ready and worker not in self._held_workers:
            self._start_failed = False
            worker.limit = worker.concurrency  # (a worker is ready with nothing in flight)
            self._alone.pop(worker, None)  # (back from a death under a call run alone)
            for other in [w for w, dead in self._alone.items() if dead and w.slot == worker.slot]:
                del self._alone[other]  # (its slot's, dead under one, replaced by this one: a reload's)
            # Routing around sync calls is on while a blocked worker's limit, 1 +
            # sync_prefetch, is at most its concurrency (every worker has the same).
            self._sync_routing = self._sync_limit <= worker.concurrency
            self._returnable = RETURNABLE if self._sync_routing else 0
            if worker.benched:  # (a peer: the worker said it is blocked, or holds, before the first front-end's Serve)
                self._held_workers.add(worker)
            else:
                self._ready.append(worker)
            self._set_share()
            self._release_all()  # (a larger share: those still past it are held again)
            if self.membership_tap is not None:
                self.membership_tap.ready(worker)
        self._pump()

    def woke(self) -> None:
        """The front-end read nothing from its clients for `wire.WOKE_SECONDS` (it was stopped,
        its loop stalled, or no client sent anything): with several front-ends, what the
        workers wrote meanwhile is read before the clients' bytes. A worker waits a second at
        most for a front-end to answer its HOLD (broker/worker/alone.py), then runs its call
        alone; a front-end resumed after that routed the requests its clients sent meanwhile
        before its loop read the HOLD, into a worker busy in a sync call, and each died with it
        when it crashed (-32002), never run (hostile testing, round 136). Called by the
        front-ends' protocols as a read begins, before its bytes are parsed."""
        if self.on_struck is None:  # (one front-end: no HOLD)
            return
        for worker in [*self._ready, *self._held_workers]:
            if worker.channel is not None:
                worker.channel.drain()

    def worker_held(self, worker: Worker, hold: int) -> None:
        """`worker` runs another front-end's call alone (wire.HOLD, aux `hold` 1), or is done
        with it (0): out of the rotation until then, as if full, its calls waiting there given
        back (`_returned`, RETURN_ASIDE). A hold is answered (HOLD back, after every call sent
        to it so far): nothing more comes from here until the release (broker/worker/alone.py).
        Its death ends the hold (`worker_lost`)."""
        if hold:
            worker.holds += 1
            if worker.channel is not None:
                worker.channel.send(HOLD, 0, 1, b"")
            self._bench(worker, _HELD)
        else:  # (after the rest of this read: hostile testing, round 137, a front-end resumed after a stop
            # read a release and the next hold at once, and the release routed its queued calls into the
            # worker, held again in a sync call run alone, where each died with it, -32002, unrun)
            self._loop.call_soon(self._released, worker, worker.holds)

    def _released(self, worker: Worker, holds: int) -> None:
        """`worker_held`'s release, a loop turn later: unless it held this front-end again since."""
        if worker.holds == holds:
            self._unbench(worker, _HELD)

    def worker_blocked(self, worker: Worker, call_id: int, blocked: int, payload: bytes) -> None:
        """`worker` says a handler blocks it (wire.BLOCKED, `blocked` 1; `payload` the call's
        deadline, CLOCK_MONOTONIC s as f64; `call_id` the call's if it is this front-end's, 0
        if another's), or that it returned (0). Another's: out of the rotation until then, as
        held (`worker_held`): with several front-ends, this one's calls waited behind it while
        another worker was idle (new user, round 114). And `_check_hung` knows whose call holds
        it, and until when (`Worker.blocked_until`)."""
        if blocked:
            deadline = _DEADLINE.unpack(payload)[0] if len(payload) == _DEADLINE.size else math.inf
            worker.blocked_in = call_id
            worker.blocked_until = deadline - time.monotonic() + _clock()  # (a NaN: never, as inf)
            if not call_id:
                self._bench(worker, _BLOCKED)
        else:
            worker.blocked_in = 0
            worker.blocked_until = 0.0
            self._unbench(worker, _BLOCKED)

    def _bench(self, worker: Worker, why: int) -> None:
        """Take `worker` out of the rotation for `why` (_HELD, _BLOCKED), into `_held_workers`
        (it counts as ready, and answering: `ready_workers`)."""
        worker.benched |= why
        if worker in self._ready:
            self._held_workers.add(worker)
            self._ready.remove(worker)
            self._set_share()
            if not self._ready:
                self._down_since = _clock()

    def _unbench(self, worker: Worker, why: int) -> None:
        """`why` no longer holds `worker`: back in the rotation if nothing else does."""
        worker.benched &= ~why
        if not worker.benched and worker in self._held_workers:
            self._held_workers.discard(worker)
            if worker.channel is not None and worker.state is WorkerState.READY and worker not in self._ready:
                self._ready.append(worker)
                self._set_share()
                # (a larger share: the connections held past the smaller one go again, as at
                # `worker_ready`; hostile testing, round 133: one with a long call in flight held its
                # next calls until that one ended, 7 s, after another front-end's 80 ms sync call)
                self._release_all()
                self._pump()

    def worker_unready(self, worker: Worker) -> None:
        """Take a worker out of the rotation (draining, dying); its calls stay pending. The
        other front-ends are told (`membership_tap`), held or not: new user, round 115, a worker
        a reload retired while benched here (blocked in a peer's sync call) was never retired
        by that peer, which routed to it until it was killed 42 s later, its calls with it."""
        held = worker in self._held_workers
        self._held_workers.discard(worker)  # (held for another front-end: not back at its release)
        worker.benched = 0  # (what it said blocks it stays for `worker_lost`: its socket ends first)
        try:
            self._ready.remove(worker)
        except ValueError:
            if not held:
                return
        else:
            self._set_share()
            if not self._ready:
                self._down_since = _clock()
        if self.membership_tap is not None:
            self.membership_tap.unready(worker)

    def _set_share(self) -> None:
        """One connection's share of the ready workers' places (`connection_share`; at
        least 1), and the size of a chunk of a batch that does not fit in its share: the
        share over the workers (batches of 1000 `add` calls on one connection, 2 workers,
        went at 0.73 to 0.85 of the rate of chunks as large as the batch over the workers,
        and chunks of half this size no faster: benchmarks/RESULTS.md)."""
        ready = self._ready
        places = sum(w.concurrency for w in ready)
        self._share = max(1, int(places * self._connection_share))
        self._chunk_max = max(1, self._share // len(ready)) if ready else 1
        # ... and of the workers, for blocking sync calls, each of which holds its worker whole
        # (with sync routing on): one connection's 2 slow sync calls held both workers of 2, and
        # every other client waited (round 60's new user, 1.8 s; round 62, 64 pipelined calls
        # 7.7 s behind a batch of 100 known-slow calls, a call of theirs for each slow one).
        self._sync_share = max(1, int(len(ready) * self._connection_share)) if self._sync_routing else 1 << 62
        # ... and of their room for large params: one connection's 8 long calls of 1 MB took all of
        # two workers', and every other client's large call waited for them (round 93)
        self._heavy_share = int(self._heavy_cap * len(ready) * self._connection_share)

    def worker_lost(self, worker: Worker, reason: str, serving: bool = True) -> None:
        """The worker's process is gone: answer its in-flight calls "worker died".
        `serving`: its slot's process still (its slot restarts), not one retired by a reload
        or leaving, whose slot is another's. (Not "in the rotation" now: a crashed worker's
        socket ends before its exit is reaped, `Pool.channel_lost`, so one that died under a
        call run alone never held its place, and a caught crasher's next call took the other
        worker while it restarted: both died in turn, hostile testing, round 90.)"""
        # (--frontends N: blocked in another front-end's call when it died, as it said (wire.BLOCKED):
        # none of this one's calls ran then, and that front-end blames its own, for every front-end
        # (`struck`); hostile testing, round 133: calls waiting behind another's hung call took the
        # blame for its kill, and their method ran alone on every front-end.)
        elsewhere = worker.blocked_until > 0.0 and not worker.blocked_in
        worker.blocked_in, worker.blocked_until = 0, 0.0  # (a slot's next process says anew)
        self.worker_unready(worker)
        if self.membership_tap is not None:
            self.membership_tap.lost(worker, reason)
        lost = [c for c in self._pending.values() if c.worker is worker]
        unstarted = self._unstarted
        again = [c for c in lost if c.call_id in unstarted] if unstarted and lost else []
        if again and worker.channel is not None:  # (sent ALONE and never started there, wire.STARTS: not its
            worker.channel.drain()  # death's, sent again; what it said before it died read first: a STARTS too)
            lost = [c for c in self._pending.values() if c.worker is worker]
        # Never written to it: queued for it as its end was read (hostile testing, round 137: an answer
        # read just before the end freed a place, or a release, and a call went into the dead socket)
        unsent = worker.channel.unsent() if lost and worker.channel is not None else {}
        if unstarted or unsent:
            again = [c for c in lost if c.call_id in unstarted or c.call_id in unsent]
            if again:
                lost = [c for c in lost if c.call_id not in unstarted and c.call_id not in unsent]
        if worker.overdue:
            worker.overdue.clear()
            self._overdue -= 1
        if worker in self._alone:  # dead under a call run alone: spent on them until back; else no more reserved
            if lost and worker.blocked and serving:  # (round 85: a retired one never came back, and its
                self._alone[worker] = True  # place counted against the cap until the next reload: none ran alone)
            else:
                del self._alone[worker]
        if again:
            self._again(again, unsent)
        elif not lost:
            return
        # Its notifications not yet run or ended are lost: counted, as they get no answer
        # (round 80's new user: nothing said so). A chunk's answered in parts are marked -2.
        notifications = sum(c.slots.count(-1) if c.slots is not None else c.kind == NOTIFY for c in lost)
        if notifications:
            self.notifications_dropped[_DIED] = self.notifications_dropped.get(_DIED, 0) + notifications
        if lost and elsewhere:
            log.warning("worker %d (pid %d) died blocked in another front-end's call, holding %d of this one's "
                        "(of %s): not blamed", worker.slot, worker.pid, len(lost), _clients(lost))
        elif lost:
            self._blame(worker, lost, notifications)
        if serving and len(lost) == 1 and lost[0].weight == 1 and lost[0].index in self._isolation.waits:
            self._alone[worker] = True  # (caught: it ran alone all the same; its place held until back)
        error = error_object(ErrorCode.WORKER_DIED, data={"pid": worker.pid, "status": reason})
        for call in lost:  # (none, if it held only calls sent ALONE and not started: `_again`)
            del self._pending[call.call_id]
            call.owner.in_flight -= call.weight
            call.owner.heavy -= call.heavy
            call.heavy = 0
            if call.sync > 0:
                call.owner.blocking -= call.sync
            self._finish(call, error, ErrorCode.WORKER_DIED)
        if worker.blocked:
            worker.blocked = False
            self._blocked -= 1
        worker.outstanding = worker.sync_calls = worker.heavy = 0
        worker.heavy_calls.clear()
        worker.limit = worker.concurrency
        self._release_all()  # (their connections' places are free; those still past their share are held again)
        self._check_idle()
        self._pump()

    def _again(self, calls: list[Call], unsent: dict[int, bytes]) -> None:
        """`calls` were sent to a worker now dead, which did not start them: never written to it
        (`unsent`, {call id: params}: `WorkerChannel.unsent`), or sent ALONE and not started there
        (wire.STARTS: they waited their turn, or for another front-end's calls to end). Never run,
        they wait again at the head of their connection's calls, as calls given back (`_requeue`),
        and their methods take no strike (hostile testing, round 132: one waiting beside another
        front-end's crash was answered -32002, and its method struck once more). One past its
        deadline is answered -32001, `"started": false`, unless it was already."""
        blocking = self._blocking
        by_owner: dict[object, list[Call]] = {}
        for call in calls:
            kept = self._unstarted.pop(call.call_id, b"")
            params = unsent.get(call.call_id, kept)
            del self._pending[call.call_id]
            call.worker = None
            owner = call.owner
            owner.in_flight -= call.weight
            owner.heavy -= call.heavy
            call.heavy = 0
            if call.sync > 0:
                owner.blocking -= call.sync
            if call.tick:
                if call.methods is None:
                    call.params = params
                    call.sync = 1 if blocking[call.index] else -1 if self._sync_us[call.index] >= 0 else 0
                else:  # (a chunk: its method indexes as the table's now, `_translate`)
                    call.params = with_methods(params, call.methods)
                    call.sync = sum(blocking[m] for m in call.methods)
                call.stale = False
                by_owner.setdefault(owner, []).append(call)
            elif call.exchange is not None:  # (its timeout waited to read what the worker wrote:
                self._finish(call, timed_out(call, False), ErrorCode.TIMED_OUT)  # `_alone_timed_out`)
            else:
                self.late_cancelled_total += int(call.kind != NOTIFY)
        for owned in by_owner.values():  # (each connection's in the order they were sent)
            self._requeue(owned, RETURN_ASIDE)

    def _blame(self, worker: Worker, lost: list[Call], notifications: int) -> None:
        """`worker` died holding `lost`: their methods' calls run alone from now on
        (`broker.isolation`; not those of calls sent before a reload, `stale`). Killed as
        hung, only the methods of its calls past their deadline: those behind them waited
        (round 79's new user: a slow method beside the hung one took the strike, and the
        only worker for calls run alone). `notifications`: how many of `lost` are, for the log."""
        calls = sum(call.weight for call in lost) - notifications  # (a chunk's not answered yet)
        held = " and ".join(f"{n} {word}{'' if n == 1 else 's'}" for n, word in ((calls, "call"), (notifications, "notification"))
                            if n)
        clients = _clients(lost)
        if worker.kill_reason == STOP_KILLED:  # (nothing runs after the stop: no method to strike; new user, round 117)
            log.warning("worker %d (pid %d) was killed by the stop holding %s (of %s)", worker.slot, worker.pid, held,
                        clients)
            return
        if worker.kill_reason.startswith("hung") and any(not call.tick for call in lost):
            lost = [call for call in lost if not call.tick]
        methods: set[int] = set()
        for call in lost:
            if not call.stale:
                methods.update(call.methods if call.methods is not None else (call.index,))
        methods.discard(len(self._names))  # (`other`)
        if methods and not methods - self._strike_once(worker.pid, methods):
            log.warning("worker %d (pid %d) died holding %s (of %s): their methods are struck already (another "
                        "front-end saw it die too)", worker.slot, worker.pid, held, clients)
            return
        if not methods:
            return
        isolation = self._isolation
        now = _clock()
        # (Caught: the one call there. Several calls of one method, a kill -9 of a worker serving
        # only `add` say, are no better evidence against it than against other methods': round 87,
        # `add` caught so waited 4 s for a worker of its own while the cap was spent elsewhere.)
        caught = len(lost) == 1 and lost[0].weight == 1
        owed = isolation.blame(sorted(methods), now, caught=caught)
        if self.on_struck is not None:  # (every other front-end strikes them too: `struck`)
            self.on_struck([self._names[index] for index in sorted(methods)], caught, worker.pid)
        log.warning(
            "worker %d (pid %d) died holding %s (of %s): their methods' calls now run alone, one per worker, "
            "until so many of them have answered or so long has passed: %s", worker.slot, worker.pid, held, clients,
            self._owed_text(owed, now),
        )
        self._isolation_timer()

    def _owed_text(self, owed: dict[int, int], now: float) -> str:
        """For the log: each method struck, the answers owed before it is free, or the time left."""
        return ", ".join(f"{self._names[index]}: after {n} answer{'' if n == 1 else 's'} or "
                         f"{self._isolation.ends_in(index, now):g} s" for index, n in owed.items())

    def struck(self, names: typing.Sequence[str], caught: bool, pid: int = 0) -> None:
        """Another front-end saw worker `pid` die holding calls of the methods `names`
        (peerwire.Struck): struck here too, as if this one had seen it, so that its calls of
        them run alone, sent ALONE (hostile testing, round 132: each front-end's own first crash
        of a method another already ran alone took the calls beside it). Names this one does
        not serve (a reload between) are left out, and those struck here already for that death."""
        index = {name: i for i, name in enumerate(self._names)}
        found = {index[name] for name in names if name in index}
        methods = sorted(found - self._strike_once(pid, found))
        if not methods:
            return
        now = _clock()
        owed = self._isolation.blame(methods, now, caught)
        log.warning("another front-end's worker died holding calls of %s: their calls run alone here too: %s",
                    ", ".join(self._names[i] for i in methods), self._owed_text(owed, now))
        self._isolation_timer()

    def _strike_once(self, pid: int, methods: set[int]) -> set[int]:
        """Of `methods`, those struck already for worker `pid`'s death (seen here, or told by
        another front-end: a death several front-ends saw, each holding calls of a method, struck
        it twice on each; new user, round 115); the others are recorded as struck now. The last
        STRUCK_KEPT deaths are kept. (pid 0: not known, nothing kept.)"""
        if not pid:
            return set()
        done = self._struck_for.get(pid)
        if done is None:
            done = self._struck_for[pid] = set()
            while len(self._struck_for) > STRUCK_KEPT:
                self._struck_for.popitem(last=False)
        already = methods & done
        done |= methods
        return already

    def start_failed(self) -> None:
        """A worker's start failed (it exited before its HELLO) while no worker is ready:
        calls waiting for a worker are answered "no worker available" now, and new calls at
        once, until one is ready. A crash loop costs a call one backoff and one failed start
        at most, however the slots' starts overlap (hostile testing, round 77: with two slots
        failing in turn, one always starting, calls waited 3.67 s, and until their deadline
        when the starts interleave)."""
        if self._ready or self._held_workers:
            return
        self._start_failed = True
        self.no_worker_before(math.inf)

    def no_worker_before(self, back_in: float) -> None:
        """Every worker is down and none is starting: the first is back in `back_in`
        seconds (a restart backoff; `math.inf`: none is coming). Queued calls wait for it
        if its backoff ends within RESTART_WAIT_SECONDS of the outage's start and before
        their deadline (a worker that crashed once: hostile testing, round 73, every other
        client's queued call was answered -32003 for a 0.1 s backoff); the others are
        answered "no worker available" at once rather than wait for their deadline. The
        bound is the outage's, not each backoff's: in a crash loop, backoffs and failed
        starts one after another made calls wait 8 s and more (round 74)."""
        if back_in <= 0.0:
            return
        now = _clock()
        if back_in > RESTART_WAIT_SECONDS - (now - self._down_since):
            back_in = math.inf
        late = [call for call in self._queue if call.tick and call.arrival + call.timeout - now < back_in]
        if not late:
            return
        gone = set(late)  # (calls hash by identity)
        self._queue.drop(lambda call: call not in gone)
        if not self._queue:
            self._largest.clear()
        for call in late:
            self._queued_bytes -= call.held
            self._queued_calls -= call.weight
            call.owner.queued -= call.weight
            self._finish(call, _NO_WORKER, ErrorCode.NO_WORKER)
        self._check_idle()

    def _check_hung(self, call: Call) -> None:
        """Kill the worker if it still has not answered a call cancelled long ago: a
        sync handler stuck in a loop never reads CANCEL (gunicorn's worker timeout)."""
        worker = call.worker
        if (
            self._pending.get(call.call_id) is call
            and worker is not None
            and worker.process is not None
            and not worker.kill_reason  # once per worker, however many calls it holds
        ):
            if worker.outstanding > 1:
                # It may be busy in a sync call that came before the cancelled one (which
                # waits behind it: sent there by sync_prefetch, or the other learnt fast),
                # still within its own longer deadline: hung only once that deadline and
                # cancel_grace are past too (hostile testing, round 18: a worker 5 s into
                # a legitimate 10 s call was killed). Not for an async call, which holds no
                # loop (round 19: a long poll beside a stuck sync call kept the worker
                # alive 40 s), nor, for a sync call cancelled, for one that came after it,
                # which waits behind it.
                # An async call (or chunk of them) started before a sync call came waits for that one
                # too, its loop held (hostile testing, round 86: a 15 s sync call, well within its
                # deadline, was killed as hung beside an async call whose 2 s deadline passed).
                now = _clock()
                order = (call.arrival, call.call_id) if call.sync else (math.inf, 0)
                later = max((c.arrival + c.timeout for c in self._pending.values()
                             if c.worker is worker and c.tick and c.sync and (c.arrival, c.call_id) < order),
                            default=0.0)
                if later > now:
                    self._loop.call_later(later - now + self._cancel_grace, self._check_hung, call)
                    return
            known = self.shared_workers and worker.blocked_until > 0.0
            if known:
                # (--frontends N: the worker says a handler blocks it, wire.BLOCKED: this front-end's
                # call, whose deadline passed (this one, or one before it here: hung once its deadline
                # and cancel_grace are past), or another's, hung once *its* deadline and cancel_grace
                # are: new user, round 114, a hung call was killed only past the longest deadline.)
                now = _clock()
                later = worker.blocked_until + self._cancel_grace
                if worker.blocked_in != call.call_id and later > now:
                    self._loop.call_later(min(later - now, 86400.0), self._check_hung, call)
                    return
            elif self.shared_workers:
                # (--frontends N, the worker silent (a handler holding the GIL in C, or it is stopped):
                # a sync call of another front-end's, unseen here, may hold the worker within its own
                # deadline: hostile testing, round 126, a peer killed a worker 6 s into a legitimate
                # 20 s call of the first front-end's. One that holds it now began before the worker
                # read this call's CANCEL, sent at its deadline (a free loop acknowledges it at once),
                # so it has its own deadline by this call's and the longest a call may have: hung only
                # once that and cancel_grace are past. Not by this call's arrival: an async call started
                # before it came (hostile testing, round 133: a 7.5 s call holding the GIL, well within
                # its deadline, was killed beside another front-end's async call).)
                now = _clock()
                later = call.arrival + call.timeout + max([self._timeout, *self._method_timeouts.values()])
                if later > now:
                    self._loop.call_later(later - now + self._cancel_grace, self._check_hung, call)
                    return
            past = self._cancel_grace  # (--frontends: the wait it had, not cancel_grace; new user, round 112)
            if self.shared_workers:
                past = round(max(past, _clock() - call.arrival - call.timeout), 1)
            worker.kill_reason = f"hung: no answer {past} s after a cancelled call"
            log.warning(
                "worker %d (pid %d) has not answered call %d (%s) %s s after its deadline: killing it as hung%s",
                worker.slot, worker.pid, call.call_id,
                "a batch chunk" if call.slots is not None else self._names[call.index]
                if call.index < len(self._names) else "of a method the reload removed",
                past, "" if not self.shared_workers else (
                    " (blocked in " + ("this front-end's call" if worker.blocked_in else "another front-end's call")
                    + ", its deadline and cancel_grace past)" if known else " (with several front-ends, once the"
                    " longest deadline a call may have is past: another front-end's call may hold the worker)"),
            )
            worker.process.kill()
