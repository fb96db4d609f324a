"""The bytes of requests still arriving or waiting, over every listener of a broker
(max_incoming_bytes), and who gives way at that bound (`Incoming`)."""

from __future__ import annotations

import bisect
import logging
import math
import operator
import typing

if typing.TYPE_CHECKING:
    from broker.frontend.base import Listener

__all__ = ["RESCAN_SECONDS", "Incoming"]

log = logging.getLogger("broker.frontend")

# After a scan at max_connections that found no connection to close, none for this long: a
# flood at the limit costs one O(n) scan per RESCAN_SECONDS, not one per connection; short,
# as each newcomer meanwhile is refused (hostile testing, round 77: a second let a client
# whose connections were owed an answer at the one scan keep everyone out for that second).
RESCAN_SECONDS = 0.1
_rank = operator.itemgetter(0)


class Incoming:
    """The bytes of requests a broker keeps before it dispatches them, over every listener:
    HTTP bodies and NDJSON lines whose end has not come yet, kept between reads, and whole
    ones waiting for their turn (their connection is owed max_response_bytes, or its
    client does not read: hostile testing, round 11, 300 such connections held 322 MiB
    counted nowhere). (What a read brings whole and dispatches is handled at once and
    never counted.) Each connection holds at most about max_body_bytes of them (reading
    pauses); this bounds them all together, whatever max_connections allows: a
    request whose bytes would take the total past `limit` (max_incoming_bytes) is refused,
    HTTP 503 or a -32000 line, and its bytes dropped (tower's load shedding; nginx bounds the
    same memory with client_body_buffer_size and temporary files).

    At the limit, requests still arriving slower than the one that needs room give way
    first (`make_room`), as at max_connections: else idle connections, each holding a
    request left unfinished, kept the bound full and every other client's request refused
    (hostile testing, round 102: 300 of them, 3% of max_connections, refused 89 of 90
    others' 300 KB calls for 75 s after one burst).

    held: bytes counted now. refused_total: requests refused past the limit. evicted_total:
    connections closed to make room for a faster one (`make_room`).
    listeners: the listeners whose connections count here (each adds itself).
    """

    __slots__ = ("_at", "_keys", "_ranked", "_ranked_at", "_suffix", "evicted_total", "held", "limit", "listeners",
                 "refused_total")

    def __init__(self, limit: int = 1 << 62) -> None:
        self.limit = limit
        self.held = 0
        self.refused_total = 0
        self.evicted_total = 0  # connections closed to make room (`make_room`)
        self.listeners: list[Listener] = []
        # Connections holding bytes of a request under way, the slowest last, as the last
        # scan found them (one scan every RESCAN_SECONDS at most); their ranks negated (an
        # ascending list, for `bisect`); and the bytes they held, summed from each to the
        # end (`_suffix[i]`: those of `_ranked[i:]` then): which of them are slower than a
        # newcomer, and what they hold together, are found in O(log n) (hostile testing,
        # round 103: walked one by one at each refusal, 4000 connections holding a byte
        # each, slower than a wave of newcomers but never enough, held the loop 5 s).
        # Walked, a connection leaves the list until the next scan (each walked once a scan:
        # round 104, a walk that came up short refused every newcomer until the next scan,
        # and an attacker made one come up short at each). `_at`: where each was ranked.
        self._ranked: list[typing.Any] = []
        self._keys: list[tuple[int, float]] = []
        self._suffix: list[int] = [0]
        self._at: dict[typing.Any, int] = {}
        self._ranked_at = -math.inf

    def hold(self, before: int, after: int) -> bool:
        """A connection's count goes from `before` to `after` bytes. False, with nothing
        changed, when it grows past the limit: the caller drops the bytes (`refuse`)."""
        held = self.held + after - before
        if held > self.limit and after > before:
            return False
        self.held = held
        return True

    def make_room(self, conn: typing.Any, before: int, after: int) -> bool:
        """`hold(before, after)` for `conn`'s request under way, which found no room: first
        close the requests still arriving that came slower than it (its `holding_rank`:
        `trickle_rank`, bytes per second since their first byte, those begun under
        TRICKLE_GRACE_SECONDS ago last), the slowest first, until it fits; each is answered
        why, as at request_timeout, and its connection closed (`evict_incoming`), counted in
        its listener's `evicted_total["incoming"]`. As `hold`, False if it does not fit:
        those slower would not free enough (as ranked at the last scan), and none is
        closed; some may be, if they had finished or come faster since. Cold path (only at
        the limit), and bounded there: a scan (O(n log n)) at most every RESCAN_SECONDS;
        between scans, O(log n) a refusal, and each connection walked at most once."""
        now = conn._fe.loop.time()
        own = conn.holding_rank(now, after)
        if own is None:
            return self.hold(before, after)
        if now - self._ranked_at >= RESCAN_SECONDS:
            self._rescan(now)
        need = self.held + after - before - self.limit
        ranked, suffix, end = self._ranked, self._suffix, len(self._ranked)
        first = bisect.bisect_right(self._keys, (-own[0], -own[1]))  # (`_ranked[first:]` were slower)
        if first >= end:
            return False
        slower = suffix[first] - suffix[end]
        at = self._at.get(conn)
        if at is not None and first <= at < end:  # (its own bytes free no room for it: round 104)
            slower -= suffix[at] - suffix[at + 1]
        if slower < need:
            return False  # (not enough: none is closed for nothing)
        victims = []
        i = end
        while i > first and need > 0:  # (the slowest first)
            i -= 1
            other = ranked[i]
            rank = None if other is conn else other.holding_rank(now)
            if rank is not None and rank < own:  # (else gone, done, or faster since the scan)
                victims.append(other)
                need -= other._incoming
        del ranked[i:]  # (walked: closed now, or not to be closed for a newcomer this fast)
        for other in victims:
            other.evict_incoming(now)
            other._fe.evicted_total["incoming"] += 1
            self.evicted_total += 1
            if self.evicted_total == 1 or self.evicted_total % 1000 == 0:  # (as `refuse`; round 100: not logged)
                log.warning("max_incoming_bytes %d reached: closed a connection whose request came slower than "
                            "a new one's, to make room (%d so far)", self.limit, self.evicted_total)
        return self.hold(before, after)

    def _rescan(self, now: float) -> None:
        """Rank the connections holding bytes of a request under way (loop time `now`)."""
        self._ranked_at = now
        found = sorted(
            ((rank, other._incoming, other) for fe in self.listeners for other in fe.connections
             if (rank := other.holding_rank(now)) is not None),
            key=_rank, reverse=True,
        )
        self._ranked = [other for _, _, other in found]
        self._at = {other: i for i, (_, _, other) in enumerate(found)}
        self._keys = [(-rank[0], -rank[1]) for rank, _, _ in found]
        suffix = self._suffix = [0] * (len(found) + 1)
        for i in range(len(found) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + found[i][1]

    def refuse(self, before: int) -> None:
        """A connection that held `before` bytes dropped them, refused (`hold` said no)."""
        self.held -= before
        self.refused_total += 1
        if self.refused_total == 1 or self.refused_total % 1000 == 0:
            log.warning("max_incoming_bytes %d reached: refusing requests still arriving (%d so far)",
                        self.limit, self.refused_total)
