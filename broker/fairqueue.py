"""The dispatcher's queue: calls waiting for a worker, served fairly among connections.

A call waits in this queue while no worker can take it (`broker.dispatch`). There is one
queue for all workers, and it is fair among the connections whose calls wait in it: each
connection's calls keep their order, and the connections take turns, by self-clocked fair
queueing (S. J. Golestani, "A Self-Clocked Fair Queueing Scheme for Broadband
Applications", INFOCOM 1994): by finish tags, with V the finish tag served. A call costs
its weight (a batch chunk: its calls; an expired call's empty shell nothing).

Each connection with calls here (a *flow*) is in a heap by the finish tag of its head,
its start tag plus its cost, where the start tag is `max(V, its last finish)` when that
call became its head, and V, the queue's virtual time, is the largest finish tag of the
calls taken out so far. Taking a call out sets its flow's next start to its finish. So
each connection waiting gets calls out in turn, in proportion to their cost (ties: the
older first), a connection with a long backlog one call a round, not all of it before
the others (hostile testing, round 53: in arrival order, 16 connections pipelining calls
that each cost a worker 18 ms held another client's call 1.8 s). A connection whose calls
all went out is forgotten: one that comes back starts at V, which has passed its last
finish. Two versions before this one were broken by hostile testing: by start tags with
V the start tag served (start-time fair queueing), connections sending one call at a
time came back at V before a backlogged one every time and V stood still, so that one
waited as long as they went on (round 54: a batch of 10 calls 5.7 s, 0.2 s in arrival
order); by start tags with V the finish tag served, a batch chunk of 500 calls, taken
out at its start tag, moved V 500 ahead, and a connection coming back waited behind 500
calls of every backlogged connection (round 55: 0.7 s at p50 where arrival order took
0.2 s). By finish tags, a chunk goes once the others have had as much (Golestani's
self-clocked fair queueing orders so). A call whose deadline passes while it waits at its
connection's head leaves at once (`expire_head`), and the connection's next call starts
at V: left in place, an expired chunk held its connection's next call behind its full
cost, then, gone at no cost, let it go first with its whole backlog (round 56).

A flow may be *held* out of turn (`hold`): its connection holds its share of the workers'
places already (`dispatch.Dispatcher`'s `connection_share`), and its calls wait, in order,
while the other flows take turns; `release` puts it back in turn at V at the earliest,
like a connection coming back (no credit for the turns it sat out). `head` and `popleft`
see only the flows in turn; `len`, iteration, `expire_head` and `drop` see every call.

Sans-IO, no clock: the dispatcher says what a call costs (`cost`) and whose it is (the
`key` of `append`: its connection's `answers.ResponseBudget`).
"""

from __future__ import annotations

import heapq
import itertools
import typing
from collections import deque
from collections.abc import Callable, Iterator

__all__ = ["FairQueue", "Largest"]

T = typing.TypeVar("T")


class _Flow(typing.Generic[T]):
    """One connection's calls in the queue, in arrival order, its head's start tag, and
    the order number of its one live heap entry (others of its are stale)."""

    __slots__ = ("calls", "entry", "start")

    def __init__(self) -> None:
        self.calls: deque[T] = deque()
        self.start = 0.0  # the start tag of its head (while it has calls)
        self.entry = -1


class FairQueue(typing.Generic[T]):
    """Calls waiting for a worker: `append(call, key)` (`key`: whose it is, hashable), `appendleft`,
    `head()` (the next out, or None), `popleft()`, `expire_head(call, key)`, `hold(key)`,
    `release(key)`, `pop_last(key)`, `remove(key, which)`, `first(key)`, `len()`, iteration (every call, flow by flow in finish-tag order, the
    held flows last), `drop(keep)`. `cost(call)`: what taking `call` out costs its flow
    (>= 0). `popleft` raises IndexError when no flow is in turn (`head()` is None)."""

    __slots__ = ("_cost", "_flows", "_heap", "_held", "_len", "_order", "_virtual")

    def __init__(self, cost: Callable[[T], float]) -> None:
        self._cost = cost
        self._flows: dict[typing.Hashable, _Flow[T]] = {}
        # (finish tag of its head, order, key): a flow's live entry has its `entry` order;
        # others are stale (`expire_head`) and skipped where met
        self._heap: list[tuple[float, int, typing.Hashable]] = []
        self._order = itertools.count()
        self._virtual = 0.0
        self._len = 0
        self._held: dict[typing.Hashable, None] = {}  # flows out of turn (`hold`), in the order held

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[T]:
        """Every call: the flows in turn by their heads' finish tags (ties: the older
        first), then the held ones, each flow's calls in order; so the first call is
        `head()` when a flow is in turn. O(n + flows log flows)."""
        for _finish, order, key in sorted(self._heap):
            flow = self._flows.get(key)
            if flow is not None and flow.entry == order:
                yield from flow.calls
        for key in self._held:
            yield from self._flows[key].calls

    def _enter(self, key: typing.Hashable, flow: _Flow[T]) -> None:
        """Put `flow` in the heap by its head's finish tag (its older entry goes stale)."""
        flow.entry = order = next(self._order)
        heapq.heappush(self._heap, (flow.start + self._cost(flow.calls[0]), order, key))

    def _top(self) -> tuple[typing.Hashable, _Flow[T]] | None:
        """The flow whose head goes next (None: no flow in turn), its stale heap entries
        dropped on the way."""
        heap = self._heap
        while heap:
            _finish, order, key = heap[0]
            flow = self._flows.get(key)
            if flow is not None and flow.entry == order:
                return key, flow
            heapq.heappop(heap)
        return None

    def append(self, call: T, key: typing.Hashable) -> None:
        """Queue `call` at the tail of `key`'s calls (held or in turn, as its flow is)."""
        flow = self._flows.get(key)
        if flow is None:
            flow = self._flows[key] = _Flow()
            flow.start = self._virtual
            flow.calls.append(call)
            self._enter(key, flow)
        else:
            flow.calls.append(call)
        self._len += 1

    def appendleft(self, call: T, key: typing.Hashable) -> None:
        """Queue `call` at the head of `key`'s calls: taken out, it did not go (a worker gave
        it back unstarted, `dispatch.Dispatcher._requeue`). Its flow is not given back the
        turn it took: `call` costs it again."""
        flow = self._flows.get(key)
        if flow is None:
            self.append(call, key)
            return
        flow.calls.appendleft(call)
        self._len += 1
        if key not in self._held:
            self._enter(key, flow)  # (by its new head's finish tag; the entry before goes stale)
            if len(self._heap) > 2 * len(self._flows) + 64:  # (stale entries bounded)
                self._rebuild()

    def head(self) -> T | None:
        """The call `popleft` would take out; None when no flow is in turn."""
        top = self._top()
        return None if top is None else top[1].calls[0]

    def popleft(self) -> T:
        """Take the next call out: the head with the smallest finish tag (ties: the flow
        that took its place in the heap first) among the flows in turn."""
        top = self._top()
        if top is None:
            raise IndexError("no flow is in turn")
        key, flow = top
        heapq.heappop(self._heap)
        call = flow.calls.popleft()
        self._len -= 1
        finish = flow.start + self._cost(call)  # (its cost now: an expired call's shell costs nothing)
        if finish > self._virtual:
            self._virtual = finish
        if flow.calls:
            flow.start = finish
            self._enter(key, flow)
        else:
            del self._flows[key]
            if not self._len:
                self._heap.clear()  # (stale entries only)
        return call

    def expire_head(self, call: T, key: typing.Hashable) -> bool:
        """`call`, of `key`'s calls, will not run (its deadline passed while it waited): if
        it is its connection's head, take it out now, and return True; its connection's next
        call starts at V at the earliest. (Hostile testing, round 56: a chunk of 1000 calls
        expiring at its connection's head kept its place by its full cost, and the next call
        waited 5-10 s behind every other connection's 1000 more; once out, at no cost, its
        connection was 1000 calls ahead and went first with up to 200 in a row.) Else False:
        it stays, a shell, and costs nothing when it comes out."""
        flow = self._flows.get(key)
        if flow is None or flow.calls[0] is not call:
            return False
        flow.calls.popleft()
        self._len -= 1
        if flow.calls:
            if flow.start < self._virtual:
                flow.start = self._virtual
            if key not in self._held:
                self._enter(key, flow)
        else:
            del self._flows[key]
            self._held.pop(key, None)
        if len(self._heap) > 2 * len(self._flows) + 64:  # (stale entries bounded)
            self._rebuild()
        return True

    def hold(self, key: typing.Hashable) -> None:
        """Take `key`'s flow (it has calls here) out of turn: its calls stay, in order, and
        `head` and `popleft` pass them by until `release(key)`."""
        if key not in self._held:
            self._held[key] = None
            self._flows[key].entry = -1  # (its heap entry goes stale)

    def remove(self, key: typing.Hashable, which: Callable[[T], bool]) -> list[T]:
        """Take out `key`'s calls for which `which` is true, in order, and return them; its
        others stay in order (a flow left with none is forgotten; one whose head went starts
        at V at the earliest, as after `expire_head`). O(its calls)."""
        flow = self._flows.get(key)
        if flow is None:
            return []
        gone = [call for call in flow.calls if which(call)]
        if not gone:
            return gone
        kept = [call for call in flow.calls if not which(call)]
        self._len -= len(gone)
        if not kept:
            del self._flows[key]
            self._held.pop(key, None)
            return gone
        head = flow.calls[0]
        flow.calls = deque(kept)
        if kept[0] is not head and key not in self._held:
            if flow.start < self._virtual:
                flow.start = self._virtual
            self._enter(key, flow)
        return gone

    def newest(self, key: typing.Hashable) -> Iterator[T]:
        """`key`'s calls here, the newest first (none if it has none)."""
        flow = self._flows.get(key)
        return reversed(flow.calls) if flow is not None else iter(())

    def pop_last(self, key: typing.Hashable) -> T:
        """Take out the last of `key`'s calls (KeyError: it has none); its flow, left with
        none, is forgotten. The turns stay as they were: a flow's head keeps its tag."""
        flow = self._flows[key]
        call = flow.calls.pop()
        self._len -= 1
        if not flow.calls:
            del self._flows[key]
            self._held.pop(key, None)
        return call

    def first(self, key: typing.Hashable) -> T:
        """The first of `key`'s calls here (KeyError: it has none)."""
        return self._flows[key].calls[0]

    def in_turn(self) -> int:
        """How many flows have calls here and are in turn (not held)."""
        return len(self._flows) - len(self._held)

    def held_keys(self) -> list[typing.Hashable]:
        """The keys of the flows held out of turn."""
        return list(self._held)

    def is_held(self, key: typing.Hashable) -> bool:
        """Whether `key`'s flow is out of turn (`hold`)."""
        return key in self._held

    def release(self, key: typing.Hashable) -> None:
        """Put `key`'s held flow back in turn, its head's start tag at V at the earliest:
        it gets no credit for the turns it sat out (as a connection coming back)."""
        if self._held.pop(key, 0) is None:
            flow = self._flows[key]
            if flow.start < self._virtual:
                flow.start = self._virtual
            self._enter(key, flow)
            if len(self._heap) > 2 * len(self._flows) + 64:  # (stale entries bounded)
                self._rebuild()

    def release_all(self) -> None:
        """`release` every held flow, in the order they were held."""
        for key in list(self._held):
            self.release(key)

    def _rebuild(self) -> None:
        self._heap = []
        for key, flow in self._flows.items():
            if key in self._held:
                continue
            flow.entry = order = next(self._order)
            self._heap.append((flow.start + self._cost(flow.calls[0]), order, key))
        heapq.heapify(self._heap)

    def drop(self, keep: Callable[[T], bool]) -> None:
        """Keep only the calls for which `keep` is true (in order); a flow left with none
        is forgotten; one whose head was dropped starts at V at the earliest, as after
        `expire_head` (no credit for calls that never ran). O(n)."""
        for key, flow in list(self._flows.items()):
            kept = [call for call in flow.calls if keep(call)]
            self._len -= len(flow.calls) - len(kept)
            if not kept:
                del self._flows[key]
                self._held.pop(key, None)
                continue
            if kept[0] is not flow.calls[0] and flow.start < self._virtual:
                flow.start = self._virtual
            flow.calls = deque(kept)
        self._rebuild()


K = typing.TypeVar("K")


class Largest(typing.Generic[K]):
    """Which key is the largest by `size(key)` (an int >= 0), where a size grows only
    through `grew(key)`, said each time, and may shrink at any time unsaid: a lazy max-heap
    of (size when it grew, key). Every entry is at least its key's size now, so the first
    entry still exact is the largest (stale ones are put back at their size on the way).
    O(log n) a growth; `top` amortised O(log n). The dispatcher sheds from the connection
    with the most calls queued with it (`dispatch.Dispatcher._make_room`)."""

    __slots__ = ("_heap", "_order", "_size")

    def __init__(self, size: Callable[[K], int]) -> None:
        self._size = size
        self._heap: list[tuple[int, int, K]] = []
        self._order = itertools.count()

    def grew(self, key: K) -> None:
        """`key`'s size went up."""
        heapq.heappush(self._heap, (-self._size(key), next(self._order), key))

    def top(self) -> K | None:
        """The key of the largest size (> 0), or None."""
        heap = self._heap
        size = self._size
        while heap:
            was, _order, key = heap[0]
            now = size(key)
            if now == -was:
                return key if now > 0 else None
            heapq.heappop(heap)
            if now > 0:  # (stale: back at its size now)
                heapq.heappush(heap, (-now, next(self._order), key))
        return None

    def clear(self) -> None:
        """Forget every key (every size is 0)."""
        self._heap.clear()

    def trim(self, live: int) -> None:
        """Drop the stale entries if there are more than about `live` (the keys with a
        size > 0 at most): one entry a key, at its size now."""
        if len(self._heap) > 2 * live + 64:
            keys = {id(key): key for _was, _order, key in self._heap}
            self._heap = [(-n, next(self._order), key) for key in keys.values() if (n := self._size(key)) > 0]
            heapq.heapify(self._heap)
