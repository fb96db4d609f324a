"""A call run alone in its worker, whatever the other front-ends send (wire.ALONE, HOLD).

After a worker died under calls, the front-end that saw it runs their methods' calls *alone*
(broker/isolation.py): each on a worker holding nothing else, which takes nothing else until it
answers. With several front-ends (`serve --frontends N`) that is the front-end's view only: the
others' calls may be on that worker, or sent to it while the call runs, and die with it when it
crashes the worker again (hostile testing, round 130: -32002 for most of another front-end's
innocent calls). Only the worker sees every front-end's calls, so it keeps the promise:

1. The front-end sends such a call with `ALONE` in its flow. The run loop, coming to it
   (`_alone_turn`), *holds* every other connection (HOLD, aux 1: their front-ends route nothing
   new to it) and gives back unstarted (RETURN, `RETURN_ASIDE`) every call of theirs waiting here
   (of a chunk started, its calls not started: `_return`). It does not start the call yet.
2. Each front-end held answers HOLD once it routes nothing more here: frames keep their order on
   a connection, so once the worker has read that answer it holds every call that front-end sent
   before, and gives those back too. A call of another connection that arrives while the worker
   holds is given back at once (`_alone_check`, each run while holding: `_spent` stays set); but
   an `ALONE` one waits its turn here (`_alone_next`), in the order they came, and runs alone
   next (step 1 again once this one is done): given back, it went again at the release, and lost
   the race with the holder's next call there each time (hostile testing, round 132: one
   front-end's calls of a method run alone waited their whole deadline, 10 s, while the other's
   ran, the worker idle between them).
3. The call starts once every connection held has answered (or is gone, or said BYE) and no call
   of theirs runs here (those running finish first; their end runs the loop again, `_alone_wake`).
   Before it starts, its own front-end is told so (HOLD, aux `STARTS`, the call's id), and the
   frame is in the socket's buffer, not this process's (`_delivered`): a worker that dies before
   that never ran it, and the front-end sends it again rather than answer it -32002 or blame
   its method (an `ALONE` call waiting here, or its turn, when another front-end's call, run
   alone or not, crashed the worker: round 132, both died).
4. Its answer, its cancel or its deadline releases the others (HOLD, aux 0).

A front-end that does not answer a hold within `HOLD_WAIT_S` (stopped, or its loop stalled) is
not waited for any longer, nor at the next holds until it has answered every one it was sent
(`_owed`): what it sends meanwhile is given back on arrival, as any call that comes while a call
runs alone here. Before, every call run alone on the other front-ends waited for a SIGSTOPped
one until it was killed as silent, 10 s (hostile testing, round 135). What that leaves: a call
such a front-end wrote just before it answers, read after the call run alone started, dies
with the worker if that call crashes it (-32002), where an answer in time would have kept it.

With one front-end the flag changes nothing: the worker has no other connection to hold.
Connections are numbered as in broker/worker/links.py: 0 the first, 1 and up the links.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
import typing

from broker.wire import ALONE, ERROR, HEADER, HOLD, HOLD_WAIT_S, NOT_RUN, RETURN_ASIDE, STARTS
from broker.worker.chunks import _CANCELLED, _DEADLINE_SIZE, _Chunk, _deadline_of
from broker.worker.links import LINK_SHIFT, Link

__all__ = ["ALONE", "HOLD", "NO_CALL", "AloneRuns"]

NO_CALL = -1  # `_alone` when no call runs alone here
_AFTER_DEADLINE_S = 0.002  # the deadline's run comes this much late (timers fire up to 1 ms early)
_TOLD_AGAIN_S = 0.001  # a STARTS still in this process's buffer: the call starts this much later at the soonest
_pack = HEADER.pack
_Item = tuple[int, int, int, bytes] | _Chunk


def _id_of(item: _Item) -> int:
    return item.chunk_id if type(item) is _Chunk else typing.cast("tuple[int, int, int, bytes]", item)[1]


class AloneRuns:
    """`WorkerProtocol`'s methods for a call run alone (see the module docstring), and their
    state (the protocol's other attributes are declared below for the type checker):
    `_alone`: the id of the call run alone (tagged by its link), or NO_CALL; `_alone_ran`: it
    started; `_alone_told`: its front-end was told it starts (STARTS); `_alone_next`: other
    connections' calls sent ALONE, waiting their turn; `_held`: the connections told HOLD;
    `_unheld`: those whose answer is waited for; `_owed`: by connection, the HOLDs it has not
    answered yet (any of them); `_hold_since`: when the hold began (CLOCK_MONOTONIC s);
    `_woken`: the tasks whose end runs the loop again; `_alone_timer`: its deadline's run;
    `_hold_timer`: the end of the wait for the answers (`HOLD_WAIT_S`).
    """

    # (Its own slots: the other mixins have none, so the protocol's layout takes these.)
    __slots__ = ("_alone", "_alone_next", "_alone_ran", "_alone_timer", "_alone_told", "_held", "_hold_since",
                 "_hold_timer", "_owed", "_unheld", "_woken")
    _alone: int
    _alone_next: collections.deque[tuple[int, int, int, bytes]]
    _alone_ran: bool
    _alone_told: bool
    _alone_timer: asyncio.TimerHandle | None
    _held: list[int]
    _hold_since: float
    _hold_timer: asyncio.TimerHandle | None
    _owed: dict[int, int]
    _unheld: set[int]
    _woken: set[asyncio.Task[tuple[bool, object]]]

    if typing.TYPE_CHECKING:
        _backlog: collections.deque[_Item]
        _bye: bool
        _chunks: dict[int, _Chunk]
        _links: list[Link]
        _loop: asyncio.AbstractEventLoop
        _out: bytearray
        _spent: bool
        _tasks: dict[int, asyncio.Task[tuple[bool, object]]]
        _transport: asyncio.Transport | None

        def _call(self, call_id: int, index: int, params: bytes, deadline: float) -> bool: ...
        def _reply(self, kind: int, call_id: int, t0: float, body: bytes, aux: int = -1) -> int: ...
        def _return(self, item: _Item, aside: int = 0) -> None: ...
        def _schedule_flush(self) -> None: ...
        def _write_out(self) -> None: ...
        def schedule_run(self) -> None: ...

    def _alone_init(self) -> None:
        """No call runs alone here (the protocol's start)."""
        self._alone, self._alone_ran, self._alone_told, self._alone_next = NO_CALL, False, False, collections.deque()
        self._alone_timer = self._hold_timer = None
        self._held, self._unheld, self._owed, self._woken, self._hold_since = [], set(), {}, set(), 0.0

    def _alone_turn(self, item: tuple[int, int, int, bytes]) -> bool:
        """`_run` came to `item`, a call sent ALONE, at the backlog's head, with other
        connections: True if it is dealt with (started, or given back: the loop goes on), False
        if it waits (the loop stops; an answer to HOLD, a call of another connection ending, or
        its deadline runs it again)."""
        call_id = item[1]
        if self._alone != call_id:
            if self._alone != NO_CALL:  # (another call runs alone here: this one's turn is next)
                self._backlog.popleft()
                self._alone_next.append(item)
                return True
            self._hold(call_id, _deadline_of(item[3])[0])
        self._aside()
        if not self._alone_clear():
            return False
        if not self._alone_told:  # (its front-end knows from now on that it may have run: step 3)
            self._alone_told = True
            self._out += _pack(0, HOLD, call_id, STARTS)
            self._write_out()
        if not self._delivered(call_id >> LINK_SHIFT):
            self._loop.call_later(_TOLD_AGAIN_S, self.schedule_run)
            return False
        self._backlog.popleft()
        _kind, _id, index, payload = item
        deadline = _deadline_of(payload)[0]
        if deadline <= time.monotonic():  # (passed while it was told: its front-end may have timed it out as
            self._reply(ERROR, call_id, 0.0, _CANCELLED, NOT_RUN)  # unstarted, having read no STARTS: dispatch.py)
            self._release()
            return True
        self._alone_ran = True
        self._call(call_id, index, payload[_DEADLINE_SIZE:], deadline)
        task = self._tasks.get(call_id)
        if task is None:  # (a sync handler's, answered)
            self._release()
        else:
            self._wake_at_end(task)
        return True

    def _hold(self, call_id: int, deadline: float) -> None:
        """Call `call_id` runs alone from now: HOLD to every other connection that may send calls."""
        self._alone = call_id
        self._alone_ran = self._alone_told = False
        mine = call_id >> LINK_SHIFT
        held = [n for n in self._open() if n != mine]
        owed = self._owed
        for number in held:
            self._out += _pack(0, HOLD, number << LINK_SHIFT, 1)
            owed[number] = owed.get(number, 0) + 1
        self._held = held
        self._unheld = {n for n in held if owed[n] == 1}  # (one owing an earlier one is not waited for)
        self._hold_since = time.monotonic()
        if self._unheld:
            self._hold_timer = self._loop.call_later(HOLD_WAIT_S + _AFTER_DEADLINE_S, self.schedule_run)  # (uvloop: up to 1 ms early)
        self._spent = True  # type: ignore[misc]  # (each run gives back what came meanwhile: `_alone_check`)
        if deadline < math.inf:
            self._alone_timer = self._loop.call_later(
                max(0.0, deadline - time.monotonic()) + _AFTER_DEADLINE_S, self.schedule_run)

    def _delivered(self, number: int) -> bool:
        """Has connection `number` been sent all that was written to it (in the socket's buffer,
        not this process's: a crash from now on loses none of it)? True if it is gone."""
        if number:
            link = self._links[number - 1]
            if link.pending:
                return False
            transport = link.transport
        else:
            transport = self._transport
        return transport is None or transport.is_closing() or not transport.get_write_buffer_size()

    def _open(self) -> list[int]:
        """The connections that may still send calls (not gone, no BYE said): their numbers."""
        first = [] if self._bye or self._transport is None or self._transport.is_closing() else [0]
        return first + [link.number for link in self._links if not (link.bye or link.gone)]

    def _aside(self) -> None:
        """Give back (RETURN_ASIDE) every call waiting here of a connection other than the one
        whose call runs alone; of a chunk started, its calls not started. One sent ALONE waits
        its turn instead (`_alone_next`)."""
        mine = self._alone >> LINK_SHIFT
        backlog = self._backlog
        if all(_id_of(item) >> LINK_SHIFT == mine for item in backlog):
            return
        kept: collections.deque[_Item] = collections.deque()
        for item in backlog:
            if _id_of(item) >> LINK_SHIFT == mine or (type(item) is _Chunk and item.next >= item.count):
                kept.append(item)
            elif type(item) is not _Chunk and _deadline_of(typing.cast("tuple[int, int, int, bytes]", item)[3])[1] & ALONE:
                self._alone_next.append(typing.cast("tuple[int, int, int, bytes]", item))
            else:
                self._return(item, RETURN_ASIDE)
        backlog.clear()  # (in place: `_run` holds it)
        backlog.extend(kept)

    def _alone_clear(self) -> bool:
        """May the call run alone start? Every connection held answered (or is gone, or said
        BYE), and no call of another connection runs here (their ends run the loop again)."""
        if self._unheld:
            self._unheld &= set(self._open())
            left = self._hold_since + HOLD_WAIT_S - time.monotonic()
            if self._unheld and left > 0:
                timer = self._hold_timer  # (one that fired early, as uvloop's may, runs the loop again later)
                if timer is None or timer.when() <= self._loop.time():
                    self._hold_timer = self._loop.call_later(left + _AFTER_DEADLINE_S, self.schedule_run)
                return False
            self._unheld = set()  # (those left are not waited for: what they send is given back)
        mine = self._alone >> LINK_SHIFT
        running = [task for call_id, task in self._tasks.items() if call_id >> LINK_SHIFT != mine]
        running += [task for chunk in self._chunks.values() if chunk.chunk_id >> LINK_SHIFT != mine
                    for task in chunk.tasks if not task.done()]
        for task in running:
            self._wake_at_end(task)
        return not running

    def _wake_at_end(self, task: asyncio.Task[tuple[bool, object]]) -> None:
        if task not in self._woken:
            self._woken.add(task)
            task.add_done_callback(self._alone_wake)

    def _alone_wake(self, task: asyncio.Task[tuple[bool, object]]) -> None:
        """A task the call run alone waits for (or its own) ended: the loop runs again, after
        the task's answer (`_task_done`, its first done callback)."""
        self._woken.discard(task)
        if self._alone != NO_CALL:
            self._loop.call_soon(self.schedule_run)

    def _alone_check(self) -> None:
        """Each run while a call runs alone (`_next_turn`): give back what came from the other
        connections; release them once the call answered, was cancelled, or its deadline passed
        before it started (answered then as a call cancelled unstarted, `CANCEL_ACK`)."""
        call_id = self._alone
        if self._alone_ran:
            if call_id in self._tasks:
                self._aside()
                self._spent = True  # type: ignore[misc]
            else:
                self._release()
            return
        waiting = next((item for item in self._backlog if _id_of(item) == call_id), None)
        if waiting is None:  # (cancelled, its link gone, or answered at its deadline by `_run`)
            self._release()
            return
        if _deadline_of(typing.cast("tuple[int, int, int, bytes]", waiting)[3])[0] <= time.monotonic():  # (the deadlines' clock: wire.py)
            self._backlog.remove(waiting)
            self._reply(ERROR, call_id, 0.0, _CANCELLED, NOT_RUN)  # (wire.CANCEL_ACK)
            self._release()
            return
        self._aside()
        self._spent = True  # type: ignore[misc]

    def link_joined(self, number: int) -> None:
        """Link `number` connected (its HELLO written) while a call runs alone here: the HOLD
        written to it before had nowhere to go (`Link.write` drops what comes before), so it
        is told now, and waited for if the call has not started (hostile testing, round 132:
        a fresh worker took the first front-end's call before its other connection was made,
        and the call waited for an answer to a HOLD never sent, to its deadline, 10 s)."""
        if self._alone == NO_CALL or number == self._alone >> LINK_SHIFT:
            return
        if number not in self._held:
            self._held.append(number)
        self._owed[number] = 1  # (a new connection: none sent before reached it)
        if not self._alone_ran:
            self._unheld.add(number)
        self._out += _pack(0, HOLD, number << LINK_SHIFT, 1)
        self._schedule_flush()

    def held_answered(self, number: int) -> None:
        """Connection `number` answered a HOLD: once it has answered every one, it sends nothing
        more until the release."""
        owed = self._owed.get(number, 0) - 1
        self._owed[number] = max(owed, 0)
        if owed <= 0 and number in self._unheld:
            self._unheld.discard(number)
            self.schedule_run()

    def _release(self) -> None:
        """The call run alone is done: HOLD aux 0 to the connections held (their front-ends
        route to this worker again)."""
        open_now = set(self._open())
        for number in self._held:
            if number in open_now:
                self._out += _pack(0, HOLD, number << LINK_SHIFT, 0)
        self._alone = NO_CALL
        self._alone_ran = self._alone_told = False
        self._held = []
        self._unheld = set()
        if self._alone_timer is not None:
            self._alone_timer.cancel()
            self._alone_timer = None
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if self._alone_next:  # (the next call sent ALONE has its turn: at the backlog's head, in order)
            self._backlog.extendleft(reversed(self._alone_next))
            self._alone_next.clear()
            self._loop.call_soon(self.schedule_run)
        self._schedule_flush()

    def _cancel_next(self, call_id: int) -> bool:
        """CANCEL of a call waiting its turn to run alone (`_alone_next`): dropped, answered as
        one cancelled unstarted. False if it is not one."""
        for item in self._alone_next:
            if item[1] == call_id:
                self._alone_next.remove(item)
                self._reply(ERROR, call_id, 0.0, _CANCELLED, NOT_RUN)
                return True
        return False
