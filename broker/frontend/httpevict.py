"""HTTP/1.1 front-end: which connection gives its place, and how (`Eviction`).

`http.HttpProtocol` inherits these methods (a mixin with no state of its own: the
attributes it reads are the connection's, declared in broker/frontend/httpstate.py for the
type checker). The listener (broker/frontend/httplistener.py) closes connections to make
room at max_connections (`Listener.make_room`) and times them out (the sweep); what it
asks of a connection is here: whether closing it loses nothing (`idle`), its place in
`make_room`'s order and how it closes then (`evict_rank`, `evict`: a request under way is
answered 408 first), whether its client is still taking its last answer (`taking_answer`,
for keep-alive and send_timeout), and, past max_connections, how it stands in the probes'
reserve (`hogging`, `_claim_place`).

The probes' reserve takes connections past max_connections (not counted in it, nor closed
by `make_room`), for /healthz, /readyz and /metrics only, and is never held against a
probe. A newcomer there waits for its first request in the overflow (PROBE_OVERFLOW
connections; when it is full, the one there that looks least like a probe gives its
place, `_reserve_rank`: not taking its answers, then trickling a request in, then served
and idle, then silent, oldest first in each; a sweep idle there closes it). A probe
needs no more: /healthz and /readyz are answered at once. A GET /metrics, which may wait
for its build, claims one of PROBE_RESERVE places (`_claim_place`), and keeps it between
scrapes; when all are held, the one that looks least like a probe gives it, the claimant
included: first one not taking its answers (writing paused, answers left in the
transport's buffer, or more than one owed: pipelined), reset; then one trickling a
request in (no probe does); then one served and idle (Prometheus between scrapes: it
reconnects); last one owed its one answer (a scrape waiting for its build), the one that
has made requests fastest first (per second of its age, 1 s at least: a client scraping
in a loop, or a fresh connection, before a Prometheus on its kept connection), then the
oldest (the claimant, answered already, just stays in the overflow). So connections
opened every few ms, silent, displace one another in the overflow, never a scrape
waiting for its build nor a scraper's kept connection. The one displaced gets its scrape
answered from the last build if one waits (`HttpProtocol.answer_displaced`), else a
refused connection's 503 (or, served and idle, a close; not taking its answers, a reset).
"""

from __future__ import annotations

import typing

from broker.frontend.base import reset, trickle_rank, unsent_bytes
from broker.frontend.httplistener import PROBE_RESERVE, _reserve_rank
from broker.frontend.httpmsg import json_response
from broker.frontend.httpstate import Close, HttpState

if typing.TYPE_CHECKING:
    from broker.frontend.http import HttpProtocol

__all__ = ["Eviction"]


class Eviction(HttpState):
    """The side of `http.HttpProtocol` its listener sees when it makes room or sweeps:
    whether and how it gives its place (see the module docstring)."""

    __slots__ = ()

    @property
    def idle(self) -> bool:
        """No request under way, none owed or waiting its turn (`_backlog`), not closing
        (or only lingering after an error answer, see `_write`), answers not stuck unsent
        (those are for send_timeout: a close would wait for them): closing it loses nothing."""
        return (
            not self._responses and not self.request_started and not self._backlog
            and (not self._close or self.lingering_since > 0) and not self.send_stalled
        )  # fmt: skip

    def evict_rank(self, fresh: float, now: float) -> tuple[float, ...] | None:
        """Its place in `Listener.make_room`'s order, None if it is not to be closed for a
        new connection: lingering after an error answer, (0, since then); idle, and a
        request served already or no byte since loop time `fresh`, (0, last active); a
        request under way, owed nothing else, its reading not paused by the broker, (1, the
        bytes per second it has come at since it began, at loop time `now`: the slowest
        first, `trickle_rank`, those begun under 0.1 s ago last; alike, the longest open first). Never one in the probes' reserve, which makes room on its own
        (`HttpFrontend.admit_probe`)."""
        if self._probe_only:
            return None
        if self.lingering_since:  # answered and closing: what it still sends is discarded (round 78:
            return 0, self.lingering_since  # 8 such, sending a byte a second, held every place 30 s)
        if self.idle:
            return (0, self.last_active) if self.requests > 0 or self.last_active <= fresh else None
        if (
            self.request_started and not self._responses and not self._backlog and not self._close
            and not self.read_paused and not self.send_stalled and self._transport is not None
        ):  # fmt: skip
            # (its head's bytes too once it is whole: `_incoming` is its body's then; round 80's new user,
            # a head sent at once then ranked as 0 bytes a second, below any slowloris)
            received = self._head_bytes + self._incoming if self._head_done else self._incoming
            return 1, *trickle_rank(received, now - self.request_started), self.accepted_at
        return None

    def evict(self, now: float) -> None:
        """Closed to make room for a new connection (`Listener.make_room`): at once if idle,
        else its request under way is answered 408 first, saying why (loop time `now`),
        and the connection lingers out (`Listener.linger_out`), discarding what comes."""
        transport = self._transport
        if not self.request_started or transport is None:
            self.close()
            return
        waited = now - self.request_started
        self.request_started = 0.0
        self._close = self._close or Close.CLOSE
        self._drop_unfinished()
        body = b'{"error":"request still arriving after %.3g s while the broker is at max_connections"}' % waited
        response = json_response(408, body, False, b"", self._fe.json_head)
        self._write(response[: len(response) - len(body)] if self._head_request() else response, True, "other")
        if not transport.is_closing():
            self._discarding()
            self._fe.linger_out(self)

    def holding_rank(self, now: float, held: int = -1) -> tuple[int, float] | None:
        """Where its request under way goes in `Incoming.make_room`'s order (`trickle_rank`
        of the bytes received since its first, at loop time `now`; `held`: its unfinished
        bytes counted, if not `_incoming`), or None if it holds none there, or is closing."""
        incoming = self._incoming if held < 0 else held
        if not incoming or self._close or not self.request_started:
            return None
        received = self._head_bytes + incoming if self._head_done else incoming
        return trickle_rank(received, now - self.request_started)

    def evict_incoming(self, now: float) -> None:
        """Its request under way gives way to a faster one at max_incoming_bytes
        (`Incoming.make_room`): answered 408 saying why, after the answers owed before it,
        and closed, as at request_timeout; its bytes go at once."""
        waited = now - self.request_started
        self._drop_unfinished()
        self._answer_and_close(408, b"request still arriving after %.3g s, slower than another, while the broker "
                                    b"holds max_incoming_bytes %d of requests arriving" % (waited, self._fe.incoming.limit))

    def hogging(self) -> bool:
        """Whether its client is not taking its answers as a probe does: writing paused
        (or a close waiting for bytes unsent: `send_stalled`), answers left in the
        transport's buffer, or more than one owed (pipelined). For the probes' reserve."""
        transport = self._transport
        return bool(
            self.send_stalled or len(self._responses) > 1
            or (transport is not None and transport.get_write_buffer_size())
        )  # fmt: skip

    def taking_answer(self, now: float) -> bool:
        """For the sweep, on a connection owed nothing with no byte or answer for
        keepalive_timeout: whether its client is still taking its last answer (a slow
        reader of a large one), so the connection is not idle. The bytes it has not
        taken (`unsent_bytes`: the transport's buffer and the kernel's send queue) are
        compared with the last look's: fewer (or a first look at some) restart the idle
        clock, so keep-alive counts from the answer taken, not written, and restart
        send_timeout's clock too if it runs (nginx's send_timeout is between two
        successive writes). Bytes that do not move for send_timeout reset the connection
        (`reset`: a close would leave them in the kernel for a client that never reads)."""
        transport = self._transport
        if transport is None:
            return False
        unsent = unsent_bytes(transport)
        before, self._unsent = self._unsent, unsent
        if unsent < before or (unsent and not before):
            self.last_active = now
            if self.send_stalled:
                self.send_stalled = now
            return True
        if not unsent:
            return False
        if self._stuck_since < self.last_active:  # (one found stuck before its last activity: stale)
            self._stuck_since = now
        elif now - self._stuck_since > self._fe.send_timeout:
            reset(self)
        return True

    def _claim_place(self) -> None:
        """A GET /metrics came on this connection of the overflow: take one of the reserve's
        places, if one is free, else that of the connection that looks least like a probe
        (`_reserve_rank`), this one included: one not taking its answers (writing paused,
        answers in the transport's buffer, or pipelined: more than one owed), longest
        stalled first; then one with a request under way (a head or body trickling in: no
        probe does that), oldest request first; then one served and now idle (a Prometheus
        keep-alive connection between scrapes: it reconnects), least recently active
        first; last one owed its one answer (a scrape waiting for its build), the one that
        has made requests fastest first (per second of its age, 1 s at least: a client
        scraping in a loop, or a fresh connection, before Prometheus on its kept
        connection, one a scrape interval; 8 such clients, owed one nearly all the time,
        must not hold the others out), the oldest first of those as fast. The one displaced
        goes (`HttpFrontend.give_up`); if that is this one, it stays in the overflow if it
        was answered at once, else its scrape is answered from the last build and it closes.

        Only a scrape claims a place: it may wait for its build (`scrape_answer`), and must
        not be displaced meanwhile by connections that have sent nothing (an attacker's,
        opened every few ms, had Prometheus's scrape answered 503 when they could take its
        place). A probe needs none: /healthz and /readyz are answered at once."""
        this = typing.cast("HttpProtocol", self)  # (the listener's sets and `give_up` hold protocols)
        fe = self._fe
        if len(fe.probe_conns) >= PROBE_RESERVE:
            now = fe.loop.time()
            victim = min((*fe.probe_conns, this), key=lambda conn: _reserve_rank(conn, now))
            if victim is this:
                if self.owed:
                    fe.give_up(this)
                return
            fe.give_up(victim)
        del fe.probe_overflow[this]
        fe.probe_conns.add(this)
