"""Turns among the connections' flows: the order the waiting calls run in (`FlowTurns`).

Each call and chunk carries its flow, its client connection's number (wire.py). A call (or
a chunk's calls in one go) that takes `_CHARGED_S` or more is charged to its flow
(`_charge`), and after one that took a whole slice the calls waiting are put in the order
of their flows' starts (`_next_turn`: start-time fair queueing), so that one client's slow
calls do not hold another's back. A call sent RETURNABLE that turns out slow gives back
the calls of its method waiting here (`_give_back`), and a slow sync call lets the async
calls in flight go on first (`_yield`). `WorkerProtocol` (broker/worker/runtime.py)
inherits these methods; the state they use is the protocol's, in its slots.
"""

from __future__ import annotations

import asyncio
import collections
import typing

from broker.wire import CHUNK, FLOW_MASK, RETURN, RETURNABLE
from broker.worker.alone import NO_CALL
from broker.worker.chunks import _DEADLINE_SIZE, _calls_of, _Chunk, _deadline_of

_CHARGED_S = 0.0005  # a call (or a chunk's calls in one go) this long is charged to its flow: `_next_turn`
_HISTORY_S = 0.01  # ... and a flow that arrives starts at most this far after the last call charged (`_arrival`)


def _flow_of(item: tuple[int, int, int, bytes] | _Chunk) -> int:
    """The flow (wire.py: a client connection's number) of a call or chunk waiting to run."""
    if type(item) is _Chunk:
        return item.flow & FLOW_MASK
    flow: int = _deadline_of(typing.cast("tuple[int, int, int, bytes]", item)[3])[1]
    return flow & FLOW_MASK


class FlowTurns:
    """`WorkerProtocol`'s methods that give the connections' flows their turns.

    (A mixin with no state of its own: the attributes below are the protocol's slots.)
    """

    __slots__ = ()

    if typing.TYPE_CHECKING:
        _active: set[int]
        _alone: int
        _backlog: collections.deque[tuple[int, int, int, bytes] | _Chunk]
        _chunks: dict[int, _Chunk]
        _dirty: set[_Chunk]
        _loop: asyncio.AbstractEventLoop
        _read_first: bool
        _run_scheduled: bool
        _spent: bool
        _used: dict[int, float]
        _virtual: float
        _yielded: tuple[int, int]

        def _reply(self, kind: int, call_id: int, t0: float, body: bytes, aux: int = -1) -> int: ...
        def _run(self) -> None: ...
        def _alone_check(self) -> None: ...

    def _arrival(self, start: float | None) -> float:
        """The start (`_used`) of a flow whose calls arrive here with none of its calls waiting
        or run since the last turn: its own, but no earlier than the last one charged
        (`_virtual`: no credit for the time it was away) and no later than `_HISTORY_S` after
        it; a flow not known here (`start` None) starts `_HISTORY_S` after it, so one that has
        been here before never goes behind a new connection's calls for its own history."""
        virtual = self._virtual
        if start is None:
            return virtual + _HISTORY_S
        return virtual if start < virtual else min(start, virtual + _HISTORY_S)

    def _charge(self, flow: int, seconds: float) -> None:
        """A call or chunk of `flow` took `seconds` (`_CHARGED_S` or more) while others
        waited: its flow's next start is its start plus that (`_next_turn`)."""
        used = self._used
        start = used.get(flow)
        if start is None or flow not in self._active:
            start = self._arrival(start)
            self._active.add(flow)
        if start > self._virtual:
            self._virtual = start  # type: ignore[misc]  # (a slot of WorkerProtocol's: mypy sees this class's empty ones)
        used[flow] = start + seconds

    def _next_turn(self) -> None:
        """The last slice went whole to one call or chunk of one flow (a client connection,
        wire.py), and calls wait: they are put in the order of their flows' starts, least first
        (each flow's calls in their order: a stable sort). That is start-time fair queueing
        (Goyal, Vin and Cheng, "Start-time Fair Queueing", SIGCOMM 1996) by the time calls take
        here: a flow's start (`_used`) grows by the time its calls of `_CHARGED_S` or more take
        (`_charge`), and a flow that arrives, or comes back, starts near the start of the last
        call charged (`_virtual`, `_arrival`); the flows waiting keep theirs. So a client whose calls turn out
        slow (a sync method learnt fast from a cheap call, then a batch of its slow calls: 50
        a worker) holds another client's calls back for about one of its slow calls, however
        many of its calls reached this worker first, and whatever the other client sends:
        single calls, pipelined ones, a batch chunk of many fast calls, calls of a few ms.
        (Hostile testing, round 60: every other client's call waited 10 s behind a batch of
        100 fib(32). Round 61: moving only the next flow's first call ahead left a client's 64
        pipelined calls 5.2 s behind. Round 62: turns by call rather than by time held a batch
        of 1000 `add` 1.9 s, and 32 calls of 3 ms 3.2 s; and putting only the last slow flow
        behind the others left a client's call behind one slow call of every other slow
        connection. Round 63: a flow's time here was never forgotten, and a client that had done
        3 s of work waited 2.7 s behind a new connection's slow calls. Round 64: capping every
        flow waiting at 50 ms past the least one levelled a heavy flow with the others whenever a
        flow never charged waited, and a client with 50 ms of history waited 4 s behind the
        heavy one's whole chunk.) Between calls that each take less than a slice, as fast calls do, the
        worker's order is the order they came. O(n log n) in the calls waiting, and only
        after a call (or a chunk) that took a whole slice: scanning after every slice of fast
        single calls cost 41 % more instructions per call (callgrind)."""
        self._spent = False  # type: ignore[misc]
        if self._alone != NO_CALL:  # (a call runs alone here: `_spent` stays set meanwhile, worker/alone.py)
            self._alone_check()
        backlog = self._backlog
        used = self._used
        flows = [_flow_of(item) for item in backlog]
        waiting = set(flows)
        active = self._active
        for flow in waiting:
            if flow not in active or flow not in used:  # (arrived since the last turn, not charged yet)
                used[flow] = self._arrival(used.get(flow))
        self._active = waiting  # type: ignore[misc]  # (those gone since are away: they arrive afresh)
        if len(waiting) > 1:
            items = list(backlog)
            backlog.clear()
            backlog.extend(items[i] for i in sorted(range(len(items)), key=lambda i: used[flows[i]]))
        if len(used) > 2 * len(flows) + 64:  # (flows gone: only those waiting keep their time)
            self._used = {flow: t for flow, t in used.items() if flow in waiting}  # type: ignore[misc]

    def _give_back(self, method: int) -> None:
        """A call the broker sent `RETURNABLE` (wire.py: of a method not known to block, to
        a worker not busy in a blocking one) was a sync handler's, of method index `method`,
        that blocked the loop SLOW_SYNC_US or more: give back (RETURN) every call waiting here
        that was sent RETURNABLE, has not started, and is of that method; of a chunk started,
        its calls from the next on, if one of those is. (Not every method slow here: a sync
        method counts as slow until its first call on this worker, and the broker, which
        learnt it fast on another, would route its calls one at a time.) The broker routes them
        again as blocking calls: one connection's at most its share of the workers, the
        others' calls on the rest. Kept here, a batch of them sent 50 a worker held every
        worker, and another client's batch past its share waited one of them per round trip
        (hostile testing, round 63: a sync method learnt fast from a cheap call, then a batch
        of its slow calls; another client's batch of 1000 `add` took 1.9 s, 0.007 s alone).
        O(the calls waiting, and the entries of the chunks among them)."""
        kept: collections.deque[tuple[int, int, int, bytes] | _Chunk] = collections.deque()
        for item in self._backlog:
            if type(item) is _Chunk:
                if not item.flow & RETURNABLE or item.next >= item.count or not _calls_of(item.payload, item.pos, method):
                    kept.append(item)
                else:
                    self._return(item)
                continue
            kind, _call_id, aux, payload = typing.cast("tuple[int, int, int, bytes]", item)
            if _deadline_of(payload)[1] & RETURNABLE and (
                _calls_of(payload, _DEADLINE_SIZE, method) if kind == CHUNK else aux == method
            ):
                self._return(item)
            else:
                kept.append(item)
        self._backlog.clear()  # (in place: `_run` holds it)
        self._backlog.extend(kept)

    def _return(self, item: tuple[int, int, int, bytes] | _Chunk, aside: int = 0) -> None:
        """Give back (RETURN) `item`, a call or chunk waiting here, not started; of a chunk
        started, its calls from the next on (its CHUNK_REPLY, or CHUNK_RESULTS, for those
        before comes after). `aside`: 0 (its method turned out slow, `_give_back`) or
        RETURN_ASIDE (another front-end's call runs alone here: broker/worker/alone.py).
        The caller takes it out of the backlog."""
        if type(item) is not _Chunk:
            call = typing.cast("tuple[int, int, int, bytes]", item)
            self._reply(RETURN, call[1], 0.0, call[3][_DEADLINE_SIZE:], aside)
        elif item.next == 0 and not item.waiting and not item.unsent and not item.results:  # (nothing of it ran: all of it)
            self._chunks.pop(item.chunk_id, None)
            self._dirty.discard(item)
            self._reply(RETURN, item.chunk_id, 0.0, item.payload[_DEADLINE_SIZE:], aside)
        else:
            self._reply(RETURN, item.chunk_id, 0.0, item.payload[item.pos :], item.next | aside)
            item.count = item.next
            self._dirty.add(item)

    def _yield(self, call_id: int) -> bool:
        """Before call `call_id`, of a method that blocks the loop, with async calls in
        flight: whether the loop runs a turn first (`_run` goes on in the next one), so
        that they go on before it. An async call whose wait ended, or that started and
        has not run a step yet, needs a turn for its step, and one that finished a turn
        more for its answer (a task's done callback comes a turn later); `_call` then
        writes the answers ready before the slow call runs. At most two turns a call: a
        steady flow of async calls cannot hold it back. (Hostile testing, round 13: an
        async call's answer waited behind a slow sync call sent after it, long enough to
        be answered -32001 "timed out" although its handler was done; the README says
        each answer leaves as soon as its own handler returns.)"""
        last, turns = self._yielded
        turns = turns + 1 if last == call_id else 1
        if turns > 2:
            return False
        self._yielded = (call_id, turns)  # type: ignore[misc]
        # (and reads first: a task step may hold the loop meanwhile, round 17, and a CANCEL
        # for the slow call or those behind it come then)
        self._run_scheduled = self._read_first = True  # type: ignore[misc]
        self._loop.call_soon(self._run)
        return True
