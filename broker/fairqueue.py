"""The dispatcher's queue: calls waiting for a worker, served fairly among connections.

A call waits in this queue while no worker can take it (`broker.dispatch`). There is one
queue for all workers, and it is fair among the connections whose calls wait in it: each
connection's calls keep their order, and the connections take turns, by self-clocked fair
queueing (S. J. Golestani, "A Self-Clocked Fair Queueing Scheme for Broadband
Applications", INFOCOM 1994): by finish tags, with V the finish tag served. A call costs its weight (a batch chunk: its calls; an
expired call's empty shell nothing).

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
self-clocked fair queueing orders so).

Sans-IO, no clock: the dispatcher says what a call costs (`cost`) and whose it is (the
`key` of `append`: its connection's `answers.ResponseBudget`).
"""

from __future__ import annotations

import heapq
import itertools
import typing
from collections import deque
from collections.abc import Callable, Iterator

__all__ = ["FairQueue"]

T = typing.TypeVar("T")


class _Flow(typing.Generic[T]):
    """One connection's calls in the queue, in arrival order, and its head's start tag."""

    __slots__ = ("calls", "start")

    def __init__(self) -> None:
        self.calls: deque[T] = deque()
        self.start = 0.0  # the start tag of its head (while it has calls)


class FairQueue(typing.Generic[T]):
    """Calls waiting for a worker: `append(call, key)` (`key`: whose it is, hashable),
    `head()` (the next out), `popleft()`, `len()`, iteration (every call, flow by flow
    in start-tag order), `drop(keep)`. `cost(call)`: what taking `call` out costs its flow (>= 0).
    `head` and `popleft` raise IndexError when the queue is empty."""

    __slots__ = ("_cost", "_flows", "_heap", "_len", "_order", "_virtual")

    def __init__(self, cost: Callable[[T], float]) -> None:
        self._cost = cost
        self._flows: dict[typing.Hashable, _Flow[T]] = {}
        self._heap: list[tuple[float, int, typing.Hashable]] = []  # (start tag, order, key): one per flow
        self._order = itertools.count()
        self._virtual = 0.0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[T]:
        """Every call: the flows by their heads' finish tags (ties: the older first), each
        flow's calls in order; so the first call is `head()`. O(n + flows log flows)."""
        for _start, _order, key in sorted(self._heap):
            yield from self._flows[key].calls

    def append(self, call: T, key: typing.Hashable) -> None:
        """Queue `call` at the tail of `key`'s calls."""
        flow = self._flows.get(key)
        if flow is None:
            flow = self._flows[key] = _Flow()
            flow.start = self._virtual
            heapq.heappush(self._heap, (flow.start + self._cost(call), next(self._order), key))
        flow.calls.append(call)
        self._len += 1

    def head(self) -> T:
        """The call `popleft` would take out."""
        return self._flows[self._heap[0][2]].calls[0]

    def popleft(self) -> T:
        """Take the next call out: the head with the smallest finish tag (ties: the flow
    that took its place in the heap first)."""
        _finish, _order, key = heapq.heappop(self._heap)
        flow = self._flows[key]
        call = flow.calls.popleft()
        self._len -= 1
        finish = flow.start + self._cost(call)  # (its cost now: an expired call's shell costs nothing)
        if finish > self._virtual:
            self._virtual = finish
        if flow.calls:
            flow.start = finish
            heapq.heappush(self._heap, (finish + self._cost(flow.calls[0]), next(self._order), key))
        else:
            del self._flows[key]
        return call

    def drop(self, keep: Callable[[T], bool]) -> None:
        """Keep only the calls for which `keep` is true (in order); a flow left with none
        is forgotten, the others keep their start tags. O(n)."""
        self._heap = []
        for key, flow in list(self._flows.items()):
            kept = [call for call in flow.calls if keep(call)]
            self._len -= len(flow.calls) - len(kept)
            if kept:
                flow.calls = deque(kept)
                self._heap.append((flow.start + self._cost(kept[0]), next(self._order), key))
            else:
                del self._flows[key]
        heapq.heapify(self._heap)
