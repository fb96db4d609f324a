"""The slow lane: connections whose turn took long wait for their next, one let go per loop iteration (`SlowLane`).

A connection's reads take a turn of the loop (broker/frontend/connection.py): past
TURN_BYTES (broker/frontend/base.py) or TURN_SECONDS of work it ends, and reading pauses
until the next loop iteration. A turn that ended for its time, or a large read that comes
once the iteration's reads took ADMIT_SECONDS, waits in the `SlowLane` of its loop
(`slow_lane`, shared by all its listeners; `Listener.next_turn` puts it there), in
start-time fair order.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
import typing
import weakref
from collections.abc import Callable

__all__ = [
    "ADMIT_SECONDS",
    "BYTE_SECONDS",
    "CHARGED_SECONDS",
    "OVERTAKEN",
    "SLOW_TURN_SECONDS",
    "SMALL_READ_BYTES",
    "TURN_SECONDS",
    "SlowLane",
    "slow_lane",
]

# Bytes are not the cost: a 2 KB body nested just past the parser's limit takes 1.5 ms to
# decode, a 3 KB batch of 1000 `{}` 2.5 ms to answer (hostile testing, round 11: 40
# connections pipelining them held /healthz 2 to 5 s, 16 requests a turn). So the time a
# connection's reads take counts too: past TURN_SECONDS of it, the turn ends after the
# request under way (the rest of the read waits in `_backlog`), and reading pauses until
# the next loop iteration; one loop iteration gives each connection about this much.
TURN_SECONDS = 0.002
# One request's work cannot be cut: a 1 MiB body nested 200,000 deep takes 18 ms to decode,
# and 16 connections pipelining them made each loop iteration 0.3 s long (hostile testing,
# round 44: /healthz p90 1.0 s, another client's call 1.6 s). And turns that end at
# TURN_SECONDS add up: 200 connections sending 1000-call batches (2-3 ms each) made
# iterations of seconds (round 45, with a lane for turns past 8 ms only: /healthz 1.7-1.9 s).
# So a connection whose turn ended for its time (past SLOW_TURN_SECONDS) waits for its next
# in the `SlowLane`, which lets one such connection go on per loop iteration: an iteration
# then does about one busy connection's turn besides the turns of those that are not busy.
SLOW_TURN_SECONDS = TURN_SECONDS
# A connection's first turn, or one after an idle while, has no slow turn before it: 32
# clients each opening a new connection for each 1 MiB body nested 200,000 deep (18 ms)
# made iterations of half a second (round 45: /healthz p90 1.0 s). Once a loop iteration's
# reads took ADMIT_SECONDS, a read that may hold more than SMALL_READ_BYTES of a request
# (what it brings and the body or line it ends) waits in the lane too; smaller ones, a
# probe's or a small call's, cost too little to wait (16 KiB of the worst shapes decode in
# about 3 ms: benchmarks/pathological.py, 45 to 180 ms a MiB at that size), so they go on.
ADMIT_SECONDS = 2 * TURN_SECONDS
SMALL_READ_BYTES = 16 * 1024
# What a read held back so is charged in the lane (`SlowLane.add`), before its turn shows
# what it costs: what decoding its bytes (and the body or line they end) may cost, at the
# rate of large bodies of the worst shapes (benchmarks/pathological.py: about 25 ms a MiB;
# small ones cost more a MiB, up to 180 ms, round 51, but a read held back is past 16 KiB).
BYTE_SECONDS = 0.025 / (1024 * 1024)
# An entry of the lane that later ones went before this many times as often as there were
# entries before it when it came goes next: it waits at most (OVERTAKEN + 1) times as many
# let-gos as in the order they came (`SlowLane`).
OVERTAKEN = 2
CHARGED_SECONDS = 0.0002  # a read's time below this is not counted in its iteration's (the hot path's reads)


class SlowLane:
    """The connections whose last turn ended for its time (SLOW_TURN_SECONDS), or whose
    read came once the loop iteration's reads had taken ADMIT_SECONDS, each waiting for its
    next turn (a callback: resume reading, or go on with a read's backlog), let go one per
    loop iteration. It also counts what the iteration's reads and turns took (`spent`,
    seconds; `charge`), zeroed at the next iteration. One per event loop (`slow_lane`),
    shared by all its listeners.

    The order is start-time fair queueing (P. Goyal, H. M. Vin and H. Cheng, "Start-time
    Fair Queuing", SIGCOMM 1996): each entry starts where the connection's previous one
    finished, or at `virtual` (the start of the entry let go last) if that is later, and
    finishes its cost later (`add`: the seconds the connection's last turn took, or for a
    read held back, what the bytes it may decode may cost, BYTE_SECONDS each); the entry
    starting first goes first, the cheaper of equal starts first, then in the order they
    came. So a connection that has cost little waits behind few (round 49: in the order
    they came, a 200 KB call on a new connection waited behind each of 64 connections
    pipelining 1 MiB bodies nested 200,000 deep, 18 ms each: 1.2-2.1 s), and busy ones
    share the lane by cost, not by turns. But new connections start at `virtual` itself,
    and a stream of them holds it still: the busy ones would wait for ever (round 50: 3.4
    s). So an entry goes next once later ones went before it OVERTAKEN times as often as
    there were entries before it when it came (in their order it would have waited for those
    alone): it waits at most OVERTAKEN + 1 times as many let-gos as in arrival order (round
    51: the bound checked on the oldest entry alone, at 5 times, held busy connections
    1.2-1.6 s where arrival order held them 0.7 s). Each connection keeps its last finish in
    its `lane_finish` (0.0 when new)."""

    __slots__ = ("_count", "_dead", "_due", "_dues", "_let_go", "_loop", "_order", "_reset_due", "_waiting", "spent",
                 "virtual")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # Each entry: [start, cost, order, callback, let go by (a count of entries let go)], in
        # `_waiting`, a heap by (start, cost, order), and in `_dues`, a heap by (let go by,
        # order); one let go from either is marked (its callback None), and dropped from the
        # other when met, or when such marked ones are more than half of it (`_compact`).
        self._waiting: list[list[typing.Any]] = []
        self._dues: list[tuple[int, int, list[typing.Any]]] = []
        self._count = 0  # entries waiting
        self._dead = 0  # marked entries still in one heap or the other
        self._let_go = 0  # entries let go so far
        self._order = itertools.count()
        self.virtual = 0.0  # s of charged cost: the start of the entry let go last
        self._due = False  # `_next` is scheduled
        self.spent = 0.0  # s: what this loop iteration's reads and turns took (`charge`), past CHARGED_SECONDS each
        self._reset_due = False

    def charge(self, seconds: float) -> None:
        """Count `seconds` of a read's or a turn's work in this loop iteration's."""
        self.spent += seconds
        if not self._reset_due:
            self._reset_due = True
            self._loop.call_soon(self._reset)  # (the next iteration's)

    def _reset(self) -> None:
        self.spent = 0.0
        self._reset_due = False

    def __len__(self) -> int:
        return self._count

    def add(self, callback: Callable[[], None], conn: typing.Any, cost: float) -> None:
        """Call `callback`, a turn of `conn` (a protocol with a `lane_finish`), in a later loop
        iteration, charged `cost` seconds: after the entries starting before it, and at the
        latest (OVERTAKEN + 1) times as many let-gos from now as there are entries before it."""
        start = conn.lane_finish
        if start < self.virtual:
            start = self.virtual
        conn.lane_finish = start + cost
        order = next(self._order)
        due = self._let_go + (OVERTAKEN + 1) * (self._count + 1) - 1
        entry = [start, cost, order, callback, due]
        heapq.heappush(self._waiting, entry)
        heapq.heappush(self._dues, (due, order, entry))
        self._count += 1
        if not self._due:
            self._due = True
            self._loop.call_soon(self._next)

    def _next(self) -> None:
        dues = self._dues
        while dues[0][2][3] is None:  # (let go by its start already)
            heapq.heappop(dues)
            self._dead -= 1
        if dues[0][0] <= self._let_go:  # overtaken enough: it goes now
            entry = heapq.heappop(dues)[2]
        else:
            waiting = self._waiting
            entry = heapq.heappop(waiting)
            while entry[3] is None:  # (let go by its due already)
                entry = heapq.heappop(waiting)
                self._dead -= 1
        start, _, _, callback, _ = entry
        entry[3] = None
        self._dead += 1  # (it is still in the other heap)
        self._count -= 1
        self._let_go += 1
        if start > self.virtual:
            self.virtual = start
        if self._dead > self._count + 64:
            self._compact()
        if self._count:
            self._loop.call_soon(self._next)
        else:
            self._due = False
        began = time.perf_counter()
        callback()
        took = time.perf_counter() - began
        if took > CHARGED_SECONDS:
            self.charge(took)

    def _compact(self) -> None:
        """Drop the marked entries from both heaps (more than those waiting, and 64)."""
        self._waiting = [entry for entry in self._waiting if entry[3] is not None]
        heapq.heapify(self._waiting)
        self._dues = [item for item in self._dues if item[2][3] is not None]
        heapq.heapify(self._dues)
        self._dead = 0


_LANES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SlowLane] = weakref.WeakKeyDictionary()


def slow_lane(loop: asyncio.AbstractEventLoop) -> SlowLane:
    """The `SlowLane` of `loop`, made at its first use."""
    lane = _LANES.get(loop)
    if lane is None:
        lane = _LANES[loop] = SlowLane(loop)
    return lane
