"""What both protocols' connections do alike: their turns their close and their writing paused (`Connection`).

`http.HttpProtocol` and `stream.StreamProtocol` inherit these methods (a mixin with no
state of its own: the attributes it reads are each connection's slots, declared here for
the type checker, as broker/frontend/httpstate.py and streamstate.py do for theirs).

A connection's turn (see TURN_BYTES and TURN_SECONDS in broker/frontend/base.py) ends
after the read that takes its bytes past TURN_BYTES (`_turn_full`, before the read is
parsed) or its reads' time past TURN_SECONDS (`_turn_took`, after): its reading pauses
until its next turn, the loop's next iteration or, after a slow one, the slow lane's
(`Listener.next_turn`), when its `_end_turn` resumes it. The rest of a read left for a
later turn goes on in `_next_turn`, one scheduled at a time (`_schedule_turn`). What
resuming means, and what the rest of a read holds, is each protocol's own.
"""

from __future__ import annotations

import typing

from broker.frontend.base import CHARGED_SECONDS

if typing.TYPE_CHECKING:
    import asyncio

    from broker.frontend.base import Listener

__all__ = ["Connection"]


class Connection:
    """The turns and the close of a front-end connection (see the module docstring)."""

    if typing.TYPE_CHECKING:
        _fe: Listener
        _transport: asyncio.Transport | None
        _turn_bytes: int  # bytes received since the last turn's pause (TURN_BYTES)
        _turn_due: bool  # a `_next_turn` is scheduled
        _turn_seconds: float  # time its reads took since then (TURN_SECONDS)
        _write_paused: bool
        read_paused: bool
        send_stalled: float

        # each protocol's
        def _end_turn(self) -> None: ...
        def _next_turn(self) -> None: ...
        def _pause(self) -> None: ...
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
