"""Newline-delimited JSON front-end: a connection's refusals, its drain and its close (`Closing`).

`stream.StreamProtocol` inherits these methods (a mixin with no state of its own: the
attributes it reads are the connection's, declared in broker/frontend/streamstate.py for
the type checker). However a connection ends, it ends here: turned away at
max_connections (`_refuse`: one "too many connections" line), closed to make room for a
new connection (`evict_rank`, `evict`), on a line of another protocol or one never
finished (`_foreign`, `line_timed_out`: answered, and closed once the lines before it
are answered), at the client's half-close (`_maybe_close`), or at the broker's stop
(`drain`). Closing a socket with bytes unread sends a reset, which can destroy answers
the client has not read yet: the connection half-closes instead and discards what still
comes (`_linger`, `_discarding`), for at most LINGER_TIMEOUT silent, LINGER_TIME in all
(`StreamFrontend._sweep`).

At the stop (SIGTERM, `StreamFrontend.drain`) a connection serves the lines it has: those
read and waiting (`_waiting`, `_backlog`), and those its kernel receive queue holds, not
read yet because the broker had paused its reading (`unread_bytes`); then what arrived
behind them meanwhile, until it finds nothing more received and no line under way (one
under way is read to its newline). The drain waits for that (`Listener.unread`), within
the grace period. Then the connection half-closes once it owes nothing, and discards what
comes: a line sent later gets no answer and is never run.
"""

from __future__ import annotations

from broker.frontend.base import TURN_BYTES, trickle_rank, unread_bytes
from broker.frontend.streamstate import StreamState
from broker.jsonrpc import ErrorCode, error_object, response_error

__all__ = ["Closing"]

_NL = b"\n"
_TOO_MANY = response_error(b"null", error_object(ErrorCode.OVERLOADED, data="too many connections")) + _NL


class Closing(StreamState):
    """The closing side of `stream.StreamProtocol`: its refusals, the drain at the stop,
    and its (lingering) close (see the module docstring)."""

    __slots__ = ()

    # -- turned away -------------------------------------------------------------------

    def _refuse(self) -> None:
        """Answer one "too many connections" error line and half-close; discard what the
        client sends (closing with its bytes unread would reset the connection and
        destroy the line) until it closes, or abort after `OUT_LINGER` seconds
        (`Listener.linger_out`)."""
        self._fe.refused()
        self._refused = True
        self._send(_TOO_MANY)
        self._fe.linger_out(self)

    def evict_rank(self, fresh: float, now: float) -> tuple[float, ...] | None:
        """Its place in `Listener.make_room`'s order, None if it is not to be closed for a
        new connection: nothing owed or waiting, open, writing not stalled, and either
        idle, a line served or no byte since loop time `fresh`, (0, last active), or a
        line under way, its reading not paused by the broker, (1, the bytes per second it
        has come at since it began, at loop time `now`: the slowest first, `trickle_rank`, those
        begun under 0.1 s ago last;
        alike, the longest open first)."""
        transport = self._transport
        if (
            self.owed or self._waiting or self._backlog or self._eof or transport is None
            or transport.is_closing() or self.send_stalled
        ):  # fmt: skip
            return None
        if self.lingering_since:  # answered and closing, what it sends discarded (round 78)
            return 0, self.lingering_since
        if not self.line_started:
            return (0, self.last_active) if self.lines > 0 or self.last_active <= fresh else None
        return None if self.read_paused else (1, *trickle_rank(self._incoming, now - self.line_started), self.accepted_at)

    def evict(self, now: float) -> None:
        """Closed to make room for a new connection (`Listener.make_room`): at once if idle,
        else its line under way is answered first, -32600 (id null) saying why (loop time
        `now`), as a line left unfinished is (`line_timed_out`), and the connection lingers
        out (`Listener.linger_out`), discarding what comes."""
        if not self.line_started or self._transport is None:
            self.close()
            return
        if not self._skipping:
            self._send(response_error(b"null", error_object(ErrorCode.INVALID_REQUEST, data=(
                f"line still arriving after {now - self.line_started:.3g} s while the broker is at max_connections"
            ))) + _NL)
            self._fe.dispatcher.count_refused_body(ErrorCode.INVALID_REQUEST)
        self._refused = True  # (its input is discarded from now on)
        self._fe.linger_out(self)

    # -- lines refused -----------------------------------------------------------------

    def holding_rank(self, now: float, held: int = -1) -> tuple[int, float] | None:
        """Where its line under way goes in `Incoming.make_room`'s order (`trickle_rank` of
        its bytes since its first, at loop time `now`; `held`: its bytes counted, if not
        `_incoming`), or None if it holds none there, or is refused or skipping."""
        incoming = self._incoming if held < 0 else held
        if not incoming or self._refused or self._skipping or not self.line_started:
            return None
        return trickle_rank(incoming, now - self.line_started)

    def evict_incoming(self, now: float) -> None:
        """Its line under way gives way to a faster one at max_incoming_bytes
        (`Incoming.make_room`): answered -32600 (id null) saying why, after the lines before
        it, and the connection closed, as a line left unfinished is (`line_timed_out`)."""
        self._foreign(response_error(b"null", error_object(ErrorCode.INVALID_REQUEST, data=(
            f"line still arriving after {now - self.line_started:.3g} s, slower than another, while the broker "
            f"holds max_incoming_bytes {self._fe.incoming.limit} of requests arriving"))) + _NL,
            ErrorCode.INVALID_REQUEST)

    def line_timed_out(self) -> None:
        """A line left unfinished for keepalive_timeout (`StreamFrontend._sweep`): answered
        with a -32600 line (id null), and the connection closed once the lines before it
        are answered, as HTTP answers 408 after the answers owed; what the client sends
        after it is discarded. (Closed at once, the answers owed to the lines before it
        were dropped, their calls run: hostile testing, round 21.)"""
        if self._skipping:  # (refused already, as too long: no second answer)
            self._foreign(b"", None)
        else:
            self._foreign(self._fe.line_unfinished, ErrorCode.INVALID_REQUEST)

    def _foreign(self, answer: bytes, code: int | None) -> None:
        """A line of another protocol (an HTTP request line: a browser's, or a client on
        the wrong port; a TLS record), or one never finished: `answer` it (an error object
        with `code`, counted as every one sent: hostile testing, round 26, the first two
        were counted nowhere), and close once the lines before it are answered."""
        self._send(answer)
        if code is not None:
            self._fe.dispatcher.count_refused_body(code)
        # Read nothing after it (what follows could be a valid call: a body), but answer
        # the lines before it, then close (`_maybe_close`).
        self._refused = True
        self._backlog = b""
        self._fe.backlog_done(self)
        self._buffer.clear()
        self.line_started = 0.0
        self._fe.incoming.hold(self._incoming, 0)
        self._incoming = 0
        # Draining, nothing after it is read: the drain waits for nothing more here (it waited
        # out the linger, 30 s: hostile testing, round 23).
        self._unread_done()
        self._discarding()
        self._maybe_close()  # (a lingering close once the lines before it are answered)

    def _discarding(self) -> None:
        """Its input is discarded from now on (`_refused`, `_linger`): read on, never paused
        again, so that a client blocked mid-send can take the answers owed before it;
        paused, it took none, and send_timeout cut them (hostile testing, round 24). As
        HTTP's `HttpProtocol._discarding`."""
        if self.read_paused and self._transport is not None:
            self.read_paused = False
            self._transport.resume_reading()

    # -- the drain ---------------------------------------------------------------------

    def drain(self) -> None:
        """Half-close now if nothing is owed and nothing was sent before the stop that is
        still to read, else once that is read (`_read_before_stop`) and the last answer
        written: the bytes in the kernel (`unread_bytes`) and the line under way at the
        stop, to its newline; the drain waits for them (`Listener.unread`)."""
        transport = self._transport
        if transport is None:
            return
        if not self._refused and not self._eof:
            unread = unread_bytes(transport)
            if unread or (self.line_started and not self._skipping):
                self._unread = unread or -1
                self._fe.unread.add(self)
                return  # (`_read_all_before_stop` half-closes it once it has read them, and owes nothing)
            if (self._fe.waits_for_first_line and not self.lines and not self._buffer and not self.owed
                    and not self._waiting):
                # Silent since it was accepted (queued at the stop, `listening._accept_queued`, or
                # just connected): its first line may be on its way, and is read and served if it
                # comes before `wait_closed` gives up, as HTTP's first request is; the drain does
                # not wait for it (not in `unread`). Half-closed at once, a client that had
                # connected and written found its line discarded and its connection ended
                # unanswered (issue 12, item 14: a handover under load, reuse_port).
                self._unread = -1
                return
        if not self.owed and not self._waiting and not self._backlog:  # (else `_maybe_close` lingers)
            self._linger()

    def _read_before_stop(self, data: bytes) -> None:
        """While draining, a read on a connection still reading what its client sent
        before the stop (`drain`): its lines are served as any (every byte of it: a
        line is never cut), and the bytes measured at the stop counted down."""
        unread = self._unread
        if unread > 0:
            self._unread = unread - len(data) if unread > len(data) else -1
        fe = self._fe
        turn = self._turn_bytes = self._turn_bytes + len(data)
        if turn > TURN_BYTES:  # (as in `data_received`)
            self._turn_bytes = 0
            if not self.read_paused:
                self._pause()
                fe.loop.call_soon(self._end_turn)
        self._lines(data)
        self._read_all_before_stop()

    def _read_all_before_stop(self) -> None:
        """While draining, once the bytes measured in the kernel (`_unread`) are read and
        handled (none left in `_backlog`): if a line is under way, read on to its end; else
        measure again (`unread_bytes`), and read on if more came meanwhile (a client's
        pipelined lines still arriving: its send queue empties into the receive queue as
        it is read). At the first moment with neither, the connection's first idle moment
        on input, or once the grace period is over (`Dispatcher.in_grace`), the drain no
        longer waits for its input: what comes next is discarded, and it half-closes once
        it owes nothing (`_maybe_close`). A client that never stops sending is served
        until the grace period ends."""
        if self._unread > 0 or self._backlog:
            return
        under_way = bool(self.line_started and not self._skipping)
        if not self._fe.read_on(self, not self._refused, under_way):
            if under_way and not self._refused and self._transport is not None:
                # Past the grace period: the line is read to its end and answered -32004, as an
                # HTTP request is (round 34: closed with no answer); `wait_closed` bounds it.
                self._unread = -1
                return
            self._maybe_close()

    def _reads_on_owing(self) -> bool:
        """Draining, input came after the connection stopped waiting for its client's
        (`_read_all_before_stop`): while it still owes answers it is not idle, and reads
        and serves it as an HTTP connection serves requests pipelined behind one in flight
        (hostile testing, round 109: lines sent on a busy connection after the stop were
        dropped unanswered, the connection open and answering). Not once it half-closed
        (`_linger`), nor past the grace period: then it is discarded unread."""
        fe = self._fe
        if (self.owed or self._waiting or self._backlog) and not self.lingering_since and fe.dispatcher.in_grace:
            self._unread = -1  # (read as a line under way: `_read_all_before_stop` measures again)
            fe.unread.add(self)
            fe.recount()
            return True
        return False

    def _unread_done(self) -> None:
        """Draining, this connection reads nothing more of what came before the stop
        (`drain`): the drain no longer waits for it."""
        if self._unread:
            self._unread = 0
            self._fe.unread.discard(self)
            self._fe.recount()

    # -- the close ---------------------------------------------------------------------

    def _maybe_close(self) -> None:
        if self.owed or self._waiting or self._backlog:
            return
        if self._eof:
            self.close()
        elif self._refused or (self._fe.draining and not self._unread):
            # A refused line's client may still be sending; a drain's has sent what came
            # before the stop (`_unread`): both half-close, their input discarded.
            self._linger()

    def _linger(self) -> None:
        """Half-close and discard what the client still sends until it closes (or
        `StreamFrontend.wait_closed` gives up, or the sweep after LINGER_TIMEOUT silent,
        LINGER_TIME in all, as HTTP's lingering close): closing a socket with unread bytes
        sends a reset, which can destroy answers the client has not read yet (hostile
        testing, round 22: after a refused line, 24 kB of 800 kB of answers owed reached a
        client still sending)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        if not self.lingering_since:
            self.lingering_since = self.last_active = self._fe.loop.time()
        transport.write_eof()
        self._discarding()
