"""Calls a worker gave back unstarted (wire.RETURN): waiting again at the head of their connection's calls (`Returns`).

`dispatch.Dispatcher` inherits these methods (a mixin with no state of its own: the
attributes it reads are the dispatcher's, declared in broker/dispatcher_state.py for the type
checker). A worker gives back the calls it was sent RETURNABLE once their method turns out
slow there (`WorkerProtocol._give_back`), and any it holds unstarted when another front-end's
call is to run alone on it (RETURN_ASIDE, broker/worker/alone.py). The dispatcher takes them
back off the worker and its connection (`_returned`), a chunk's calls one by one (`_singles`),
and queues them first among their connection's calls (`_requeue`), whatever the queue's
bounds: they were admitted once.
"""

from __future__ import annotations

import logging
import typing

from msgspec import Raw

from broker.calls import Call, hold
from broker.chunk import large_params, read_call
from broker.dispatcher_state import DispatcherState
from broker.wire import CALL, NOTIFY, RETURN_ASIDE

if typing.TYPE_CHECKING:
    from broker.channel import Worker

__all__ = ["Returns"]

log = logging.getLogger("broker.dispatch")  # (the dispatcher's logger: these are its lines)


class Returns(DispatcherState):
    """`dispatch.Dispatcher`'s side of the calls given back: `_returned` and what it needs (see
    the module docstring).

    (A mixin with no state of its own: what it reads of the dispatcher's is declared in
    `dispatcher_state.DispatcherState`.)
    """

    def _returned(self, worker: Worker, call_id: int, place: int, payload: bytes) -> None:
        """`worker` gave back unstarted (wire.RETURN) a call it was sent RETURNABLE, its
        method slow there (`WorkerProtocol._give_back`): the whole call (`place` 0) or a
        chunk's calls from `place` on, whose frame `payload` is (their params; a chunk's
        entries). Their places are the worker's and their connection's again, and they wait
        at the head of its calls as blocking sync calls (`_requeue`), a chunk's one by one
        (`_singles`: as one blocking chunk they held a worker for all of them, and another
        client's call waited 3.6 s, hostile testing, round 65); a chunk given back in part
        owes only the answers of the calls before `place`. Calls answered already (their
        deadline passed, their connection gone, the drain over) are dropped, counted as late
        cancels. With `RETURN_ASIDE` in `place` they were given back, whatever they were sent
        as, for another front-end's call run alone there (broker/worker/alone.py): they wait
        as they were sent (a chunk's, each as its method is known), for another worker."""
        aside = RETURN_ASIDE if place >= RETURN_ASIDE else 0  # (aux is a u32)
        place -= aside
        call = self._pending.get(call_id)
        slots = call.slots if call is not None else None
        if call is None or call.worker is not worker or (
            place != 0 if slots is None else not (0 <= place < len(slots) and len(slots) - place <= call.weight)
        ):  # (not a call of this worker's, or places it has not)
            log.warning("worker %s gave back call %d from place %d, which it does not hold", worker, call_id, place)
            return
        owner = call.owner
        back = 1 if slots is None else len(slots) - place
        if not aside:  # (its method slow there: else not a give-back the metric counts)
            self.returned_total += back
        worker.outstanding -= back
        owner.in_flight -= back
        call.weight -= back
        again: list[Call] = []
        if slots is not None:
            if call.tick:
                again = self._singles(call, place, payload, aside)
            else:
                self.late_cancelled_total += sum(1 for slot in slots[place:] if slot >= 0)
            if place:  # (the chunk owes the answers of its calls before `place` still)
                del slots[place:], typing.cast(list[Raw], call.ids)[place:], typing.cast(list[int], call.methods)[place:]
                if not call.weight:  # (unless all of them came already, in parts: as in `on_reply`)
                    call.exchange = None
                if call.heavy:  # (the large params of those given back are not on the worker any more)
                    heavy = min(call.heavy, large_params(payload, self._heavy_bytes))
                    call.heavy -= heavy
                    worker.heavy -= heavy
                    owner.heavy -= heavy
                    if not call.heavy:
                        worker.heavy_calls.pop(call, None)
                    if owner in self._share_waiters:
                        del self._share_waiters[owner]
                        self._queue.release(owner)
        if slots is None or not place:  # nothing of it is left on the worker
            del self._pending[call_id]
            call.worker = None
            if call.heavy:
                self._unheavy(worker, call)
            if worker.overdue:
                self._not_overdue(worker, call_id)
            if call.sync > 0:  # (not sent RETURNABLE: a worker of another broker's)
                worker.sync_calls -= call.sync
                owner.blocking -= call.sync
                if not worker.sync_calls and worker.blocked:
                    worker.blocked = False
                    worker.limit = worker.concurrency
                    self._blocked -= 1
                    self._alone.pop(worker, None)  # (a call run alone is never RETURNABLE: a worker of another broker's)
            if slots is not None:  # (its calls are the singles' now, with its deadline)
                if call.tick:
                    self._deadlines.remove(call)
                call.exchange = None
            elif call.tick:  # the call itself waits again
                call.weight = 1
                call.params = payload
                call.stale = False
                again = [call]
            else:
                self.late_cancelled_total += int(call.kind != NOTIFY)
        if again:
            self._requeue(again, aside)
        self._give_back(owner)
        if (self._alone or self._alone_held) and not worker.outstanding:
            self._reserved_idle(worker)
        else:
            self._pump()

    def _singles(self, chunk: Call, place: int, payload: bytes, aside: int = 0) -> list[Call]:
        """One call (or notification) per call of `chunk` from `place` on, from the CALL_ENTRYs
        of `payload` (their params), with the chunk's ids, answer slots, method indexes (the
        method table's now, after a reload too) and deadline; `aside`: each routed as its
        method is known (blocking, sync, async), not as blocking (`_returned`)."""
        exchange = chunk.exchange
        slots = typing.cast(list[int], chunk.slots)
        ids = typing.cast(list[Raw], chunk.ids)
        methods = typing.cast(list[int], chunk.methods)
        singles = []
        pos = 0
        for i in range(place, len(slots)):
            _method, _notification, start, pos = read_call(payload, pos)
            slot = slots[i]
            single = Call(
                next(self._ids), exchange if slot >= 0 else None, slot, ids[i], CALL if slot >= 0 else NOTIFY,
                methods[i], payload[start:pos], chunk.timeout, chunk.arrival, 1, chunk.owner,
            )  # fmt: skip
            self._deadlines.add_like(single, chunk.tick)
            if aside:
                index = single.index
                single.sync = 1 if self._blocking[index] else -1 if self._sync_us[index] >= 0 else 0
            singles.append(single)
        return singles

    def _requeue(self, calls: list[Call], aside: int = 0) -> None:
        """Queue `calls` (of one connection, in order; a chunk counts its calls), given back by
        their worker (`_returned`, `Membership._again`), at the head of their connection's calls,
        as blocking sync calls (their method turned out slow), whatever the queue's bounds: they
        were admitted once. The
        replies that teach the dispatcher how slow the method is come with them, or soon after.
        `aside`: given back for another front-end's call run alone, they keep how they were sent."""
        owner = calls[0].owner
        queue = self._queue
        for call in reversed(calls):
            if not aside:  # (else given back for another front-end's call run alone: as they were sent)
                call.sync = 1
            call.again = True  # (its wait, or its going at once, was observed at its first send)
            hold(call)
            queue.appendleft(call, owner)
            self._queued_bytes += call.held
        weight = sum(call.weight for call in calls)  # (a chunk's calls: `Membership._again`; hostile
        self._queued_calls += weight  # testing, round 138: counted as one, the count drifted below 0
        owner.queued += weight  # for good, and calls queued later were left there to their deadline)
        self._largest.grew(owner)
        if owner in self._room_waiters or owner in self._share_waiters:  # (its first call is another now:
            queue.release(owner)  # the `_pump` that comes next decides again; it keeps its place)
