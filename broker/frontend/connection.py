"""What both protocols' connections do alike: their turns, their close, their writing paused and resumed (`Connection`).

`http.HttpProtocol` and `stream.StreamProtocol` inherit these methods (a mixin with no
state of its own: the attributes it reads are each connection's slots, declared here for
the type checker, as broker/frontend/httpstate.py and streamstate.py do for theirs).

A connection's turn (TURN_BYTES in broker/frontend/base.py, TURN_SECONDS in slowlane.py) ends
after the read that takes its bytes past TURN_BYTES (`_turn_full`, before the read is
parsed) or its reads' time past TURN_SECONDS (`_turn_took`, after): its reading pauses
until its next turn, the loop's next iteration or, after a slow one, the slow lane's
(`Listener.next_turn`), when its `_end_turn` resumes it. The rest of a read left for a
later turn (`_hold_back`) goes on in `_next_turn`, one scheduled at a time
(`_schedule_turn`). What resuming means, and what the rest of a read holds, is each
protocol's own. Writing paused (`pause_writing`) pauses reading too; once it resumes
(`resume_writing`), the protocol's hooks say what it has under way (`_under_way`) and
write what waited for it (`_write_ready`).
"""

from __future__ import annotations

import typing

from broker.frontend.base import fell_behind, unread_bytes
from broker.frontend.slowlane import CHARGED_SECONDS

if typing.TYPE_CHECKING:
    import asyncio
    from collections.abc import Sized

    from broker.answers import ResponseBudget
    from broker.frontend.base import Listener

__all__ = ["Connection"]


class Connection:
    """The turns and the close of a front-end connection (see the module docstring)."""

    if typing.TYPE_CHECKING:
        _backlog: bytes  # the rest of a read, for a later turn
        _budget: ResponseBudget
        _fe: Listener
        _one_by_one: bool
        _waiting: Sized  # requests (lines) read and not dispatched yet
        _transport: asyncio.Transport | None
        _turn_bytes: int  # bytes received since the last turn's pause (TURN_BYTES)
        _turn_due: bool  # a `_next_turn` is scheduled
        _turn_seconds: float  # time its reads took since then (TURN_SECONDS)
        _write_paused: bool
        read_paused: bool
        send_stalled: float

        # each protocol's
        def _dispatch_waiting(self) -> None: ...
        def _end_turn(self) -> None: ...
        def _maybe_resume(self) -> None: ...
        def _next_turn(self) -> None: ...
        def _pause(self) -> None: ...
        def _under_way(self) -> bool: ...
        def _write_ready(self) -> None: ...
    else:
        # (At run time only, as in httpstate.py: the attributes are the protocols' slots.)
        __slots__ = ()

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport; None once it is lost (or, NDJSON, closed on an HTTP
        request line)."""
        return self._transport

    def pause_writing(self) -> None:
        """The transport's write buffer passed its high-water mark: the client is not taking
        its answers. Reading pauses (its requests would only add answers), and the time is
        kept for send_timeout (`Listener.send_timed_out`); `resume_writing` is each
        protocol's."""
        self._write_paused = True
        self.send_stalled = self._fe.loop.time()
        self._pause()

    def resume_writing(self) -> None:
        """The write buffer drained below its low-water mark: the client takes its answers
        again. Whether it fell behind meanwhile (`fell_behind`: its next requests go one at a
        time, `_one_by_one`) is decided only if it still has requests under way, read or
        not (round 28: set once it was owed nothing, it held the client's next burst one at
        a time). Then the requests that waited for it are dispatched, the answers ready are
        written (HTTP's, in order), the rest of a read goes on, and reading resumes."""
        self._write_paused = False
        self.send_stalled = 0.0
        self._one_by_one = fell_behind(self._budget.parked, self._fe.max_response_bytes) and (
            self._under_way() or (self._transport is not None and unread_bytes(self._transport) > 0)
        )
        self._budget.drained()
        if self._waiting:
            self._dispatch_waiting()
        self._write_ready()
        if self._backlog:
            self._schedule_turn()
        self._maybe_resume()

    def _turn_full(self) -> bool:
        """A read took the turn's bytes past TURN_BYTES: enough for this loop iteration,
        the others' turn now. Pause reading (`_pause`), unless it is paused already; return
        whether this read ended the turn (its next is scheduled by `_turn_took`, once the
        read's time is known)."""
        self._turn_bytes = 0
        if not self.read_paused:
            self._pause()
            return True
        return False

    def _turn_took(self, took: float, ours: bool, turn_seconds: float, stopped: int) -> None:
        """A read was parsed in `took` seconds: charge the loop iteration's slow lane past
        CHARGED_SECONDS; past `turn_seconds` (the protocol's TURN_SECONDS) of its reads since
        the last turn's end, the turn ends, reading paused, unless it is already or its input
        is discarded (`stopped` true). If the turn ended, here or for its bytes (`ours`, from
        `_turn_full`), schedule its next: the slow lane's if it was slow (round 45: TURN_BYTES's
        were not), else the loop's next iteration."""
        fe = self._fe
        if took > CHARGED_SECONDS:
            fe.slow_lane.charge(took)
        spent = self._turn_seconds = self._turn_seconds + took
        if spent > turn_seconds:  # (see TURN_SECONDS)
            self._turn_seconds = 0.0
            if not self.read_paused and not stopped:
                self._pause()
                ours = True
        else:
            spent = 0.0
        if ours:  # (a slow turn's next is the slow lane's, TURN_BYTES's too: round 45, it was not)
            fe.next_turn(self, self._end_turn, spent)

    def _hold_back(self, rest: bytes, spent: float, held: int = 0) -> None:
        """Leave `rest`, what a read brought past its turn, for a later one (`_backlog`,
        counted in max_incoming_bytes: `Listener.keep_backlog`), its reading paused by the
        caller, and schedule that turn (`_schedule_turn`: `spent`, `held`), unless writing is
        paused (`resume_writing` schedules it then) and the rest was kept within
        max_incoming_bytes (past it, its turn comes whatever the client does: round 46)."""
        if not self._fe.keep_backlog(self, rest) or not self._write_paused:
            self._schedule_turn(spent, held)

    def _schedule_turn(self, spent: float = 0.0, held: int = 0) -> None:
        """Call `_next_turn` in the loop's next iteration (or the slow lane's: the turn
        took `spent` s, `Listener.next_turn`; `held` bytes it may decode), unless it is due
        already: the answers that each let it go on (HTTP's `_flush_ready`, NDJSON's
        `_exchange_done`) must not each add a turn (one connection's turns per iteration
        stay one)."""
        if not self._turn_due:
            self._turn_due = True
            self._fe.next_turn(self, self._next_turn, spent, held)

    def close(self) -> None:
        """Close the connection after what is already written."""
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection at once."""
        if self._transport is not None:
            self._transport.abort()
