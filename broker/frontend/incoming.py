"""The bytes of requests still arriving or waiting, over every listener of a broker
(max_incoming_bytes), and who gives way at that bound (`Incoming`)."""

from __future__ import annotations

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

    held: bytes counted now. refused_total: requests refused past the limit.
    listeners: the listeners whose connections count here (each adds itself).
    """

    __slots__ = ("_ranked", "_ranked_at", "held", "limit", "listeners", "refused_total")

    def __init__(self, limit: int = 1 << 62) -> None:
        self.limit = limit
        self.held = 0
        self.refused_total = 0
        self.listeners: list[Listener] = []
        # Connections holding bytes of a request under way, the slowest last, as the last
        # scan found them (at most one scan every RESCAN_SECONDS: a flood of refusals
        # costs no O(n) each)
        self._ranked: list[tuple[tuple[int, float], typing.Any]] = []
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
        those slower would not free enough, and none is closed. Cold path: only at the
        limit."""
        now = conn._fe.loop.time()
        own = conn.holding_rank(now, after)
        if own is None:
            return self.hold(before, after)
        ranked = self._ranked
        if now - self._ranked_at >= RESCAN_SECONDS:
            self._ranked_at = now
            ranked = self._ranked = sorted(
                ((rank, other) for fe in self.listeners for other in fe.connections
                 if (rank := other.holding_rank(now)) is not None),
                key=_rank, reverse=True,
            )
        need = self.held + after - before - self.limit
        victims = []
        for i in range(len(ranked) - 1, -1, -1):  # (the slowest first)
            other = ranked[i][1]
            rank = None if other is conn else other.holding_rank(now)
            if rank is None:
                continue
            if rank >= own:
                break  # (none slower left: the others came at least as fast)
            victims.append(other)
            need -= other._incoming
            if need <= 0:
                break
        if need > 0:  # (not enough: none is closed for nothing)
            return False
        for other in victims:  # (each then found closing, not ranked again: `holding_rank`)
            other.evict_incoming(now)
            other._fe.evicted_total["incoming"] += 1
        return self.hold(before, after)

    def refuse(self, before: int) -> None:
        """A connection that held `before` bytes dropped them, refused (`hold` said no)."""
        self.held -= before
        self.refused_total += 1
        if self.refused_total == 1 or self.refused_total % 1000 == 0:
            log.warning("max_incoming_bytes %d reached: refusing requests still arriving (%d so far)",
                        self.limit, self.refused_total)
