"""What every front-end listener shares: its connections, limits, counters and closing.

`Listener` is subclassed by `http.HttpFrontend` and `stream.StreamFrontend`; each
adds its protocol factory, its sweep (what "idle too long" means for it) and its drain.
The counters are read by `metrics.BrokerCollector` under the `transport` label.
"""

from __future__ import annotations

import asyncio
import fcntl
import heapq
import logging
import math
import operator
import socket
import struct
import termios
import typing
from collections.abc import Callable

from broker.answers import Outgoing
from broker.dispatch import Dispatcher
from broker.frontend.incoming import RESCAN_SECONDS, Incoming
from broker.frontend.slowlane import BYTE_SECONDS, SLOW_TURN_SECONDS, slow_lane
from broker.jsonrpc import Codec
from broker.ratelimit import address_of

__all__ = [
    "EVICT_BATCH",
    "LINGER_TIME",
    "LINGER_TIMEOUT",
    "PIPELINE_HIGH",
    "PIPELINE_LOW",
    "SWEEP_SECONDS",
    "TURN_BYTES",
    "Incoming",
    "Limits",
    "Listener",
    "discard_turn",
    "is_tls",
    "reset",
    "shed_outgoing",
    "unread_bytes",
    "unsent_bytes",
]

log = logging.getLogger("broker.frontend")

SWEEP_SECONDS = 1.0  # one sweep for all connections of a listener, not a timer each
LINGER_TIMEOUT = 5.0  # a half-closed connection after an error answer: closed after 5 s silent
LINGER_TIME = 30.0  # ... or 30 s in all (nginx's lingering_timeout and lingering_time)
STOP_LINGER_QUIET = 0.5  # at a stop, connections half-closed and silent this long (s) are done
EVICT_BATCH = 64  # idle connections found per scan at max_connections (closed one at a time)
OUT_LINGER = SWEEP_SECONDS  # seconds a connection closed early (refused, evicted) may keep sending, discarded
# Such connections lingering at once, per listener; past it one is closed at once (its client
# may see a reset for its answer): a flood of connections at max_connections would otherwise
# hold a descriptor each for OUT_LINGER, past what the open-files limit was sized for
# (`startup.fit_open_files`).
OUT_LINGERING = 64
# libuv reads a connection with data up to 32 times in a row (256 KiB a read in uvloop): one
# client sending 1 MiB bodies had 8 MiB parsed and decoded in one turn while everyone else
# waited (hostile testing: /healthz p50 0.5 -> 50-120 ms). Past TURN_BYTES received, a
# connection's reading pauses until the next loop iteration (each protocol's `_end_turn`); past
# TURN_SECONDS of work too, and a turn that took long waits in the slow lane (broker/frontend/slowlane.py).
TURN_BYTES = 256 * 1024
_rank = operator.itemgetter(0)
TRICKLE_FLOOR_SECONDS = 0.01  # a request (line) younger than this counts as this old in `trickle_rank`
TRICKLE_GRACE_SECONDS = 0.1  # a request (line) under way for less than this goes after all the others


def trickle_rank(received: int, elapsed: float) -> tuple[int, float]:
    """Where a request (a line) under way goes in `Listener.make_room`'s order when it must
    close connections with one: those begun under TRICKLE_GRACE_SECONDS ago last (an honest
    request is whole within it; round 80: an attacker's fresh connections, 4 KB sent at once,
    outranked honest small calls caught between their head and body, 24 answered 408), then
    the slowest first: `received` bytes in `elapsed` seconds since its first byte (at least
    TRICKLE_FLOOR_SECONDS). Ranked by how long they had been open, an honest long-lived
    connection (a proxy's pooled one) whose request came in two pieces was the first to go,
    for the attacker's fresh ones trickling requests far slower (hostile testing, round 78:
    19 of its 67 requests answered 408). To outrank it, a request must come as fast as it
    does, and be restarted no sooner than TRICKLE_GRACE_SECONDS after the last."""
    return int(elapsed < TRICKLE_GRACE_SECONDS), received / max(elapsed, TRICKLE_FLOOR_SECONDS)


# Flow control by answers owed, for both protocols: reading pauses while more than
# PIPELINE_HIGH requests (HTTP) or bodies (NDJSON lines) wait for answers on one
# connection, and resumes below PIPELINE_LOW.
PIPELINE_HIGH = 64
PIPELINE_LOW = 16
BEHIND_SHARE = 4  # a client whose unread answers reached 1/4 of max_response_bytes fell behind


def fell_behind(parked: int, max_response_bytes: int) -> bool:
    """Whether a client whose write buffer just drained fell behind: the answers written
    while it was full (`parked` bytes) reached a quarter of its budget. Its next requests
    then go one at a time (`_one_by_one` in both protocols), each with the whole budget,
    until it takes an answer at once or is owed nothing. A client that reads at once can
    fill the buffer for a moment too (an answer larger than a Unix socket's 208 KiB of
    buffer): with any parked answer the rule held, its calls went one at a time for as
    long as it kept sending (hostile testing, round 26: 40 pipelined lines, 3.9 s against
    0.42 s over TCP)."""
    return parked * BEHIND_SHARE >= max_response_bytes


def _held_by(conn: typing.Any) -> int:
    return int(conn._budget.held)


def is_tls(transport: asyncio.BaseTransport | None) -> bool:
    """Is `transport` a TLS connection's (broker/frontend/handshake.py)? Read at EOF only."""
    return transport is not None and transport.get_extra_info("ssl_object") is not None


def shed_outgoing(outgoing: Outgoing, listeners: typing.Iterable[Listener]) -> None:
    """Answers were refused past max_outgoing_bytes (`answers.Outgoing`; called soon
    after the first refusal, by `Outgoing.on_full`): reset the connections owed the most
    answers, over all `listeners`, until all are owed at most half the limit, whatever
    their clients do (Envoy's overload manager resets the streams using the most memory
    the same way). Their answers are dropped and their budgets leave `outgoing` at once.

    Hostile testing, round 9: resetting only the connections not taking their answers
    let clients that read hold the limit with answers pipelined behind a slow call of
    theirs (finished, kept in order), and every other client's answer was -32603 for as
    long as the slow calls lasted; this resets them. Half, as a low-water mark, so that a
    broker at the limit does not shed again at once."""
    outgoing.shedding = False
    floor = outgoing.limit // 2
    if outgoing.held <= floor:
        return
    owed = sorted(
        (conn for listener in listeners for conn in listener.connections
         if conn._budget.held and conn.transport is not None),
        key=_held_by, reverse=True,
    )  # fmt: skip
    shed = freed = 0
    for conn in owed:
        if outgoing.held <= floor:
            break
        freed += conn._budget.held
        shed += 1
        conn._fe.shed_total += 1
        reset(conn)
        conn._budget.lost()
    if shed:
        log.warning("max_outgoing_bytes %d reached: reset %d connections owed the most answers (%d bytes)",
                    outgoing.limit, shed, freed)
_OUTQ = getattr(termios, "TIOCOUTQ", None)  # Linux's SIOCOUTQ: a socket's send queue, in bytes
_INQ = getattr(termios, "FIONREAD", None)  # Linux's SIOCINQ: a socket's receive queue, in bytes
_INT = struct.Struct("i")


def unsent_bytes(transport: asyncio.WriteTransport) -> int:
    """Bytes written to `transport` that its peer has not taken yet: those in the
    transport's buffer, and those in the kernel's send queue (SIOCOUTQ, tcp(7) and
    unix(7): not yet acknowledged on TCP, not yet read on a Unix socket; counted as 0
    where the ioctl is not available). One system call: for sweeps, not per write."""
    n = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if _OUTQ is not None and sock is not None:
        try:
            n += _INT.unpack(fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
        except OSError:
            pass
    return n


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes its peer sent on `transport` that the kernel holds and the broker has not
    read yet (SIOCINQ, tcp(7) and unix(7): a stream socket's receive queue; 0 where the
    ioctl is not available or fails, as on a socket already closed). One system call:
    for the stop and a close, not per read."""
    sock = transport.get_extra_info("socket")
    if _INQ is None or sock is None:
        return 0
    try:
        return int(_INT.unpack(fcntl.ioctl(sock.fileno(), _INQ, b"\0\0\0\0"))[0])
    except OSError:
        return 0


_LINGER_0 = struct.pack("ii", 1, 0)


def discard_turn(transport: asyncio.Transport | None, turn: int, n: int, loop: asyncio.AbstractEventLoop) -> int:
    """Count `n` more bytes read and discarded (a refused request's, a lingering close's)
    on top of `turn`, this loop turn's; return the new count. Past TURN_BYTES reading
    pauses for one loop turn, as for bytes served: 40 clients flooding discarded bytes
    took /healthz's p99 to 1.36 s (hostile testing, round 24). Never longer: a client
    blocked mid-send must be read to take the answers it is owed."""
    turn += n
    if turn <= TURN_BYTES:
        return turn
    if transport is not None and not transport.is_closing():
        transport.pause_reading()
        loop.call_soon(_resume_reading, transport)
    return 0


def _resume_reading(transport: asyncio.Transport) -> None:
    if not transport.is_closing():
        transport.resume_reading()


def reset(conn: typing.Any) -> None:
    """Abort `conn`, dropping what its kernel send queue still holds (SO_LINGER 0: the
    close sends RST, socket(7)): for a client that does not read. An abort alone drops
    only the transport's buffer; the kernel would keep trying to send the rest, and
    hold it (up to tcp_wmem's 4 MiB), long after the connection is gone."""
    transport = conn.transport
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
        except OSError:
            pass
    conn.abort()


class Limits(typing.TypedDict, total=False):
    """The keywords every listener takes, as `Listener` does (its defaults there), which
    `http.HttpFrontend` and `stream.StreamFrontend` pass on as they are."""

    max_body_bytes: int
    max_batch: int
    keepalive_timeout: float
    max_connections: int
    send_timeout: float
    incoming: Incoming | None


class Listener:
    """Shared state of the connections of one listening socket.

    transport: the metrics' label ("http", "metrics", "tcp", "unix").
    max_connections: connections at once; the subclass decides what happens past it
        (`refused` counts and logs those turned away).
    keepalive_timeout: seconds, for the subclass's sweep.
    send_timeout: seconds a connection's answers may stay unsent (its client not reading)
        before `send_timed_out` aborts it (nginx's send_timeout).
    incoming: the bytes of requests still arriving (`Incoming`), one for all the
        broker's listeners; by default one of its own, with no limit.
    """

    handshake_overflow = 0  # TLS handshakes allowed past max_connections (HTTP: its probes')

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        transport: str,
        max_body_bytes: int = 1024 * 1024,
        max_batch: int = 1000,
        keepalive_timeout: float = 75.0,
        max_connections: int = 10000,
        send_timeout: float = 60.0,
        incoming: Incoming | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.incoming = Incoming() if incoming is None else incoming  # shared by a broker's listeners
        self.incoming.listeners.append(self)
        self.transport = transport
        self.codec = Codec(max_batch)
        self.max_body_bytes = max_body_bytes
        self.max_response_bytes = dispatcher.max_response_bytes  # (read per request: one lookup)
        self.keepalive_timeout = keepalive_timeout
        self.max_connections = max_connections
        self.send_timeout = send_timeout
        self.connections: set[typing.Any] = set()  # the subclass's protocol objects
        # TLS handshakes under way (`handshake.Handshake`), oldest first: counted in `pool_size`
        self.handshakes: dict[typing.Any, None] = {}
        self.refused_total = 0
        self.unauthorized_total = 0  # requests refused for want of a good token (`unauthorized`)
        self.handshake_failed_total = 0  # TLS handshakes that failed (`handshake_failed`)
        self.received_bytes = 0
        self.sent_bytes = 0
        # HTTP responses by path label, then status: {"rpc": {b"200": 5}}; empty for streams
        self.statuses: dict[str, dict[bytes, int]] = {}
        self.draining = False
        # While draining: connections still reading what their clients sent before the stop
        # (the subclass's `drain` finds bytes in their kernel receive queue, `unread_bytes`,
        # and they read on until they find none and no request is under way): the drain
        # waits for them (`held`).
        self.unread: set[typing.Any] = set()
        self.loop = asyncio.get_running_loop()
        self.slow_lane = slow_lane(self.loop)  # (one for all the loop's listeners)
        self._sweeper: asyncio.TimerHandle | None = None
        self._evictable: list[typing.Any] = []  # idle connections found by the last scan, most idle last
        self._rescan_at = 0.0  # loop time before which a scan that found none is not repeated
        self._recount_due = False  # `recount` is scheduled
        self.shed_total = 0  # connections reset by `shed_outgoing`
        # connections closed by `make_room`, by their state, or by `Incoming.make_room` ("incoming")
        self.evicted_total = {"idle": 0, "trickling": 0, "incoming": 0, "handshake": 0}
        self.send_timed_out_total = 0  # connections reset by `send_timed_out`
        self.lingering = 0  # connections closed early still lingering (`linger_out`)
        self.read_at = 0.0  # the loop's time of the last read from a client (`Membership.woke`)

    def refused(self) -> None:
        """Count a connection turned away at max_connections (logged now and then)."""
        self.refused_total += 1
        if self.refused_total == 1 or self.refused_total % 1000 == 0:
            log.warning("%s: max_connections %d reached: refusing connections (%d so far)",
                        self.transport, self.max_connections, self.refused_total)

    def unauthorized(self, peer: object, sent: bool, why: str = "") -> None:
        """Count a request (or NDJSON first line) refused for want of a good bearer token,
        from `peer` (its address), `sent`: a token was given but is no one's (or `why` it
        was refused, said instead). Logged (a WARNING) at the first and each thousandth, with
        the last one's address, as `refused` is: an operator sees guessing without a line per
        attempt (new user, round 106: none was logged)."""
        n = self.unauthorized_total = self.unauthorized_total + 1
        if n == 1 or n % 1000 == 0:
            log.warning("%s: refused %d request(s) without a good bearer token so far (the last from %s: %s)",
                        self.transport, n, address_of(peer), why or ("a token no one has" if sent else "no token"))

    def handshake_failed(self, peer: object, reason: str) -> None:
        """Count a TLS handshake that failed (`reason`: OpenSSL's, e.g. PEER_DID_NOT_RETURN_A_CERTIFICATE
        or CERTIFICATE_VERIFY_FAILED: a client certificate refused, or plain TCP sent to TLS), from
        `peer`; logged (a WARNING) at the first and each thousandth, as `unauthorized` is (new
        user, round 110: a refused client certificate left no trace)."""
        n = self.handshake_failed_total = self.handshake_failed_total + 1
        if n == 1 or n % 1000 == 0:
            log.warning("%s: %d TLS handshake(s) failed so far (the last from %s: %s)", self.transport, n,
                        address_of(peer), reason)

    def _evicted(self, state: str) -> None:
        """Count a connection closed by `make_room` in `state` ("idle" or "trickling"); logged
        at the first and each thousandth, as `refused` is (new user, round 100: none was)."""
        n = self.evicted_total[state] = self.evicted_total[state] + 1
        if n == 1 or n % 1000 == 0:
            why = {"idle": "idle, the least recently active", "handshake": "its TLS handshake the oldest under way"}.get(
                state, "its request coming slowest")
            log.warning("%s: max_connections %d reached: closed a connection to make room (%s; %d so far)",
                        self.transport, self.max_connections, why, n)

    def pool_size(self) -> int:
        """Connections counted against `max_connections`, TLS handshakes under way included
        (HTTP's probes' reserve is not)."""
        return len(self.connections) + len(self.handshakes)

    def make_room(self) -> None:
        """At `max_connections`: close connections that wait on their client until a new
        one fits under the limit, or none is left: first the least recently active idle
        ones (nginx reuses keep-alive connections the same way when worker_connections
        run out), then those with a request (a line, on a stream) under way and owed
        nothing else, the slowest coming first (`trickle_rank`), each told why (`evict`,
        `linger_out`), then TLS handshakes, the oldest first (`_evict_handshake`): one client holding every place with requests it never finishes
        (slowloris) no longer shuts the others out until request_timeout (hostile testing,
        round 76: 237 of 246 of another client's calls refused), nor one that starts a
        request as it finishes the last (round 77: a request's age was the rank, and one
        restarted every 0.8 s was never a second old). Their `evict_rank(fresh, now)` orders them; None is not
        evictable. A connection just accepted that has sent nothing, whose first request
        may be on its way, is not idle until `fresh` (`SWEEP_SECONDS` ago): a burst of
        new connections does not close its own members before they can send. Counted in
        `evicted_total` by the state they were in.

        One scan of all connections finds up to `EVICT_BATCH` candidates, used one by
        one (each checked to be still evictable); a scan that finds none is not repeated
        for `RESCAN_SECONDS`, so a flood of connections at the limit costs no O(n) each.
        """
        evictable = self._evictable
        connections = self.connections
        while self.pool_size() >= self.max_connections:
            now = self.loop.time()
            fresh = now - SWEEP_SECONDS
            if evictable:
                conn = evictable.pop()
                if conn in connections and (rank := conn.evict_rank(fresh, now)) is not None and self.all_taken(conn):
                    connections.discard(conn)
                    self._evicted("trickling" if rank[0] else "idle")
                    conn.evict(now)
                continue
            if now < self._rescan_at:
                if self._evict_handshake(now):
                    continue
                return
            # (all taken here too: one found idle but not, popped, would be found again and
            # again, and the loop spun for good; hostile testing, round 19)
            ranked = [(rank, conn) for conn in connections
                      if (rank := conn.evict_rank(fresh, now)) is not None and self.all_taken(conn)]
            if not ranked:
                self._rescan_at = now + RESCAN_SECONDS
                if self._evict_handshake(now):
                    continue
                return
            evictable[:] = [conn for _, conn in heapq.nsmallest(EVICT_BATCH, ranked, key=_rank)]
            evictable.reverse()

    def _evict_handshake(self, now: float) -> bool:
        """For `make_room`, when no connection can go: abort the oldest TLS handshake under
        way (`handshake.Handshake`) if it began TRICKLE_GRACE_SECONDS ago or more (a client
        that has not finished one by then is slow, or an attacker's); True if one went."""
        oldest = next(iter(self.handshakes), None)
        if oldest is None or now - oldest.started < TRICKLE_GRACE_SECONDS:
            return False
        oldest.abort()
        self._evicted("handshake")
        return True

    def linger_out(self, conn: typing.Any) -> None:
        """Close `conn`, whose last answer is written, taken out of `connections` (refused
        or evicted at max_connections): half-close, so its client reads the answer
        rather than a reset, and discard what it still sends (`conn` does) for
        `OUT_LINGER` seconds, then abort; past `OUT_LINGERING` at once, closed at once
        (hostile testing, round 77: closed at once, an evicted client mid-upload got
        EPIPE and never read its 408)."""
        transport = conn.transport
        if transport.can_write_eof() and self.lingering < OUT_LINGERING:
            transport.write_eof()
            self.lingering += 1
            self.loop.call_later(OUT_LINGER, self._lingered, conn)
        else:
            transport.close()

    def _lingered(self, conn: typing.Any) -> None:
        self.lingering -= 1
        if conn.transport is not None:
            conn.transport.abort()

    def start_sweeping(self) -> None:
        """Start the periodic `_sweep` (once; called by the protocol factory)."""
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(SWEEP_SECONDS, self._sweep_and_rearm)

    def _sweep_and_rearm(self) -> None:
        self._sweep()
        self._sweeper = self.loop.call_later(SWEEP_SECONDS, self._sweep_and_rearm)

    def _sweep(self) -> None:
        """Close connections idle or stalled too long (the subclass says which)."""

    def send_timed_out(self, conn: typing.Any, now: float) -> bool:
        """For the sweep: abort `conn` (`reset`) if its client has not taken its answers
        for `send_timeout` seconds, and return True. `conn.sent`: bytes written to it;
        `conn.taken`: those its client had taken at the last look. Stalled since
        `conn.send_stalled` (or the last look that found more bytes taken): set by
        its `pause_writing` (the write buffer above its high-water mark), cleared by
        `resume_writing`; or, found here, since a close began with bytes still unsent
        (`close` waits for them forever). Aborting drops the unsent answers (the
        transport's buffer and the kernel's send queue) and frees them; calls still
        running complete and their answers are dropped."""
        since = conn.send_stalled
        transport = conn.transport
        if not since:
            if transport is None or not transport.is_closing() or not transport.get_write_buffer_size():
                return False
            conn.send_stalled = now
            conn.taken = conn.sent - unsent_bytes(transport)
            return False
        if transport is not None:
            # A client that took some of its answers since the last look is reading: the
            # clock restarts (nginx's send_timeout is between two successive writes).
            # Bytes taken, not bytes left: answers keep coming while it reads (hostile
            # testing, round 11: a client reading 40 pipelined answers of 900 kB at 120
            # KB/s was reset after send_timeout, its buffer never below the low mark).
            unsent = unsent_bytes(transport)
            taken = conn.sent - unsent
            if not unsent:  # it took them all (`watch_unsent`'s clock, or a close's, ends)
                conn.taken, conn.send_stalled = taken, 0.0
                return False
            if taken > conn.taken:
                conn.taken = taken
                conn.send_stalled = now
                return False
        if now - since <= self.send_timeout:
            return False
        reset(conn)
        self.send_timed_out_total += 1
        if self.send_timed_out_total == 1 or self.send_timed_out_total % 1000 == 0:  # (as nginx's "client
            # timed out while sending to client", at info: the client's doing, not the broker's)
            log.info("%s: reset a connection whose client took none of its answers for send_timeout %g s (%d so far)",
                     self.transport, self.send_timeout, self.send_timed_out_total)
        return True

    def all_taken(self, conn: typing.Any) -> bool:
        """Whether `conn`'s client took every byte it was sent, the kernel's send queue
        included: else it is not idle, whatever its writing says (hostile testing, round
        18: connections closed to make room with answers still in the kernel, a few MB
        each, escaped send_timeout and every count). One system call, only for a
        connection sent more than was seen taken."""
        transport = conn.transport
        if conn.sent == conn.taken or transport is None:
            return True
        conn.taken = conn.sent - unsent_bytes(transport)
        return bool(conn.sent == conn.taken)

    def watch_unsent(self, conn: typing.Any, now: float) -> None:
        """For the sweep, on a connection whose writing is not paused: start send_timeout's
        clock (`send_stalled`) if its client has not taken all it was sent, the kernel's
        send queue included. The transport's buffer may be empty while the kernel holds
        megabytes (its send buffer grows to tcp_wmem's 4 MiB; hostile testing, round 16:
        40 NDJSON clients that asked for two 900 kB answers each and read nothing held
        72 MB there, never reset, counted nowhere). One system call, only for a
        connection sent more than was seen taken (`conn.sent`, `conn.taken`: `all_taken`)."""
        if not self.all_taken(conn):
            conn.send_stalled = now

    def next_turn(self, conn: typing.Any, callback: Callable[[], None], spent: float, held: int = 0) -> None:
        """Call `callback`, the next turn of `conn`, in the next loop iteration, or in the
        `SlowLane` if this one took longer than SLOW_TURN_SECONDS (`spent`, seconds; inf
        for a read held back at ADMIT_SECONDS, charged by the `held` bytes it may decode)."""
        if spent > SLOW_TURN_SECONDS:
            self.slow_lane.add(callback, conn, spent if spent != math.inf else held * BYTE_SECONDS)
        else:
            self.loop.call_soon(callback)

    def keep_backlog(self, conn: typing.Any, rest: bytes) -> bool:
        """Keep `rest`, the part of a read left for a later turn (`conn._backlog`), counted
        in `incoming` (`conn._backlog_held`: one read, up to 256 KiB a connection; hostile
        testing, round 12: 50 NDJSON clients not reading their answers, which pauses the
        turns, held 9.5 MB that way past a max_incoming_bytes of 64 KiB). Past
        max_incoming_bytes it is kept all the same, counted (so requests arriving are
        refused meanwhile), and False says so (`conn._backlog_forced`): its turn must come
        (the next loop iteration's, or the slow lane's: `Listener.next_turn`; round 46)
        whether or not the client reads (its requests then
        wait, each counted, or are refused, each in its place). Refusing it (one error
        and a close, round 16) left its requests unanswered; handling it at once (round
        17) let a client that filled the bound end every connection's fair turns."""
        before = conn._backlog_held
        kept = self.incoming.hold(before, len(rest))
        if not kept:
            self.incoming.held += len(rest) - before
        conn._backlog, conn._backlog_held, conn._backlog_forced = rest, len(rest), not kept
        return kept

    def backlog_done(self, conn: typing.Any) -> None:
        """`conn`'s backlog was handled (or dropped): what it held leaves `incoming`."""
        if conn._backlog_held and not conn._backlog:
            self.incoming.hold(conn._backlog_held, 0)
            conn._backlog_held = 0
            conn._backlog_forced = False

    def lost(self, conn: typing.Any) -> None:
        """A connection is gone: forget it, have the dispatcher drop or cancel its calls
        owed an answer (`Dispatcher.abandon`), and drop what it held (its requests waiting
        or not parsed yet, or its input, which the drain may be waiting for, its bytes counted in
        `incoming`, and its answers owed counted in the dispatcher's `Outgoing`). `conn`
        has `_waiting` (a deque) and `_waiting_bytes` (int, the bytes it holds counted in
        `incoming`), `_backlog` (bytes) and `_backlog_held` (`keep_backlog`), `_incoming` (int), `_budget` (a
        `ResponseBudget`)."""
        self.connections.discard(conn)
        conn._budget.lost()
        self.dispatcher.abandon(conn._budget)  # (its calls owed an answer: dropped, or cancelled)
        if conn._waiting or conn._backlog:
            conn._backlog = b""
            self.backlog_done(conn)
            conn._waiting.clear()
            self.incoming.hold(conn._waiting_bytes, 0)
            conn._waiting_bytes = 0
            self.recount()  # (the drain waits for what was held: `held`)
        if self.unread and conn in self.unread:
            self.unread.discard(conn)
            self.recount()
        if conn._incoming:
            self.incoming.hold(conn._incoming, 0)
            conn._incoming = 0

    def read_on(self, conn: typing.Any, reading: bool, under_way: bool) -> bool:
        """While draining, once `conn` has read and handled the bytes measured in its
        kernel receive queue (`conn._unread`, see `drain`): whether it reads on, within
        the grace period and while `reading` (not closing): a request or line `under_way`
        (its end may be in the kernel already: `_unread` -1), or more bytes came meanwhile
        (`unread_bytes`: the client's send queue empties into the receive queue as it is
        read). If not, it leaves `unread`: the drain no longer waits for its input."""
        transport = conn.transport
        if transport is not None and reading and self.dispatcher.in_grace:
            if under_way:
                conn._unread = -1
                return True
            unread = unread_bytes(transport)
            if unread:
                conn._unread = unread
                return True
        conn._unread = 0
        self.unread.discard(conn)
        self.recount()
        return False

    def recount(self) -> None:
        """While draining: what the drain waits for (`held`) may have changed; the
        dispatcher counts it again (`Dispatcher.check_idle`) once, at this loop
        iteration's end, however many connections changed in it (`held` is
        O(connections): a count per connection lost would be quadratic)."""
        if self.draining and not self._recount_due:
            self._recount_due = True
            self.loop.call_soon(self._recount)

    def _recount(self) -> None:
        self._recount_due = False
        self.dispatcher.check_idle()

    def held(self) -> int:
        """Requests its connections hold back undispatched (their `_waiting`), plus one
        for each connection with received bytes not parsed yet (a read's rest past the
        per-turn bound, `_backlog`), and one for each connection still reading what its
        client sent before the stop (`unread`: bytes in the kernel, because the broker had
        paused its reading, and what arrives behind them): the drain waits for them
        (`Dispatcher.held_back`). O(connections): read while draining only."""
        return sum(len(conn._waiting) + (1 if conn._backlog else 0) for conn in self.connections) + len(self.unread)

    async def wait_closed(self, timeout: float, taking: float | None = None,
                          hurry: asyncio.Event | None = None) -> None:
        """Wait up to `timeout` s for connections to finish writing and close; end those
        still open, and stop sweeping. With `taking` (s, more than `timeout`), wait that
        long while some connection's client is still taking answers already written
        (`unsent_bytes`: a slow reader), not for connections that owe nothing; `hurry`
        (a second stop signal) ends the wait at once. A connection ended with answers
        unsent is reset (RST: its client can tell it was cut, not finished, which over
        NDJSON, whose answers come in any order, it could not from an orderly close);
        one with nothing unsent is closed at once. The wait ends sooner once every
        connection left has nothing unsent and has been half-closed (lingering) and silent
        for STOP_LINGER_QUIET: its client has all its answers and the end of them, and
        sends nothing more (hostile testing, round 73: one idle keep-alive connection whose
        client kept it open made every stop 2 s long)."""
        now = self.loop.time()
        deadline = now + timeout
        quiet = now + STOP_LINGER_QUIET
        longest = now + max(timeout, taking or 0.0)
        while self.connections and not (hurry is not None and hurry.is_set()):
            now = self.loop.time()
            if now >= longest or (not any(
                conn.transport is not None and unsent_bytes(conn.transport) for conn in self.connections
            ) and (now >= deadline or (now >= quiet and all(
                conn.lingering_since and now - conn.last_active >= STOP_LINGER_QUIET for conn in self.connections
            )))):  # fmt: skip
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            transport = conn.transport
            if transport is not None and unsent_bytes(transport):
                reset(conn)
            else:
                conn.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
