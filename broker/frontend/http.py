"""HTTP/1.1 front-end: one `asyncio.Protocol` per connection, parsed by httptools.

Theory of operation
-------------------
`data_received` feeds the parser; httptools calls back per request. A POST on the
RPC path is decoded (`jsonrpc.Codec`) and handed to the dispatcher as soon as its
body is complete (no task per request); the dispatcher calls back when the last
answer is in. Every request takes its place in the connection's `_responses` queue,
so pipelined requests are answered in the order they came, however their calls
finish; a response is written (status line, headers and body in one `write`) as soon
as everything before it has been written.

A request is *under way* from its first byte (`on_message_begin`, `request_started`)
until it is complete and routed; once routed it is *owed* (`owed`) until answered. A
connection with neither is idle: only idle connections are ever closed to drain
(SIGTERM) or to make room at `max_connections`. At the stop, bytes received and not read
yet (in the kernel: `unread_bytes`) make a connection busy too; it reads them, and what
arrives behind them meanwhile, until it finds none and no request under way
(`HttpFrontend.drain`, `HttpProtocol._parsed_before_stop`).

The connection's state and its life are `HttpProtocol`'s, here: its reading (what the
parser is fed, and when: turns, flow control, the bounds on an unfinished head and a
chunked body's framing), its admission past max_connections, its closing. It inherits the
rest from three mixins with no state of their own (their attributes declared once, for the
type checker, in broker/frontend/httpstate.py: `HttpState`): the parser's callbacks and
the routing of a request, with what each path answers and who may call, in
broker/frontend/httprequest.py (`Requests`); the answers, written in order, and the
lingering close, in broker/frontend/httpanswer.py (`Answers`); whether and how it gives
its place (to `make_room`, the sweep, the probes' reserve), in
broker/frontend/httpevict.py (`Eviction`).

Flow control (aiohttp and uvicorn do the same): reading pauses while the transport's
write buffer is above its high-water mark, or while more than `PIPELINE_HIGH`
requests wait for answers on one connection, and resumes below the low marks; the
requests of a read already taken (`_backlog`) wait as unread bytes do.
Work per loop turn: a read past FEED_BYTES is parsed in pieces, REQUESTS_PER_TURN
requests a turn (or fewer, past TURN_REQUEST_BYTES of them: a request can be a batch of
1000 calls), the rest kept in `_backlog` with reading paused (`_feed_turn`,
`_next_turn`; NDJSON's LINES_PER_TURN): httptools parses all it is fed at once, and
requests answered at once never fill the pipeline to pause reading.
Memory for answers: the answers a connection is owed and its client has not read stay
under `max_response_bytes` (`answers.ResponseBudget`; results past it are answered
-32603). While it is reached, or the client is not reading, requests already read wait
undispatched (`Deferred` in `_waiting`, holding their place in `_responses`), and go
one at a time once the client reads (`_busy`, `_one_by_one`).
One sweep per second for all connections, not a timer per request, closes idle
connections (nothing owed, no bytes for `keepalive_timeout` seconds, and the last answer
taken: bytes still leaving the kernel's send queue restart the clock, `taking_answer`), answers 408
to requests under way for longer than `request_timeout` (nginx's
client_header_timeout and client_body_timeout, for the whole request), and aborts
connections whose client has left its answers unread (writing paused) for longer
than `send_timeout` (nginx's send_timeout): the request clock stands still while
the broker paused reading, so this is what bounds a client that sends and never reads.

Past max_connections, connections are taken into the probes' reserve, for /healthz,
/readyz and /metrics only (PROBE_RESERVE places, PROBE_OVERFLOW more): see
broker/frontend/httpevict.py, with the connection's side of `make_room` and the sweep.
"""

from __future__ import annotations

import asyncio
import math
import time
import typing
from collections import deque

import httptools

from broker.answers import Exchange, ResponseBudget, forget
from broker.frontend.base import (
    PIPELINE_HIGH,
    PIPELINE_LOW,
    TURN_BYTES,
    discard_turn,
    is_tls,
)
from broker.frontend.httpanswer import Answers, path_of
from broker.frontend.httpevict import Eviction
from broker.frontend.httplistener import PROBE_OVERFLOW, PROBE_RESERVE, HttpFrontend
from broker.frontend.httpmsg import CLOSE, STATUS_LINES
from broker.frontend.httpowed import Deferred, Owed
from broker.frontend.httprequest import (
    CHUNK_FRAMING_BYTES,
    MAX_HEADER_BYTES,
    MIN_CHUNK_BYTES,
    SMALL_CHUNKS,
    Requests,
    _Request,
)
from broker.frontend.httpstate import Close
from broker.frontend.mcp import ToolCall, cancel_mcp
from broker.frontend.slowlane import ADMIT_SECONDS, CHARGED_SECONDS, SMALL_READ_BYTES, TURN_SECONDS
from broker.jsonrpc import Body, ErrorCode
from broker.ratelimit import Bucket, address_of
from broker.wire import WOKE_SECONDS

__all__ = [
    "CHUNK_FRAMING_BYTES",
    "MAX_HEADER_BYTES",
    "MIN_CHUNK_BYTES",
    "PROBE_OVERFLOW",
    "PROBE_RESERVE",
    "SMALL_CHUNKS",
    "HttpFrontend",
    "HttpProtocol",
]


_perf = time.perf_counter
REQUESTS_PER_TURN = 16  # requests routed from one read per loop turn; the rest waits (NDJSON's LINES_PER_TURN)
TURN_REQUEST_BYTES = 64 * 1024  # ... or fewer: requests of this many bytes end a turn too (NDJSON's TURN_LINE_BYTES)
FEED_BYTES = 4096  # a read past this is parsed in pieces, so that a turn can end between them


class _Gone:
    """The callbacks of a lost connection's parser: none."""


class _UpgradeBody:
    """Parser callbacks for the body of an `Upgrade` request: httptools stops at the
    end of such a request's head (what follows belongs to the new protocol), so its
    body, with its own framing, is read by a second parser into this connection."""

    __slots__ = ("conn",)

    def __init__(self, conn: HttpProtocol) -> None:
        self.conn = conn

    def on_header(self, name: bytes, value: bytes) -> None:
        self.conn.on_header(name, value)  # after the head: counted, never taken (trailers)

    def on_chunk_header(self) -> None:
        self.conn.on_chunk_header()  # an unfinished trailer line is counted too

    def on_body(self, body: bytes) -> None:
        self.conn.on_body(body)

    def on_message_complete(self) -> None:
        self.conn.upgrade_body_complete()


class HttpProtocol(Requests, Answers, Eviction, asyncio.Protocol):
    """One HTTP/1.1 client connection (keep-alive, pipelining, chunked bodies)."""

    # The connection's state, by concern (its mixins have none of their own: httpstate.py).
    __slots__ = (  # noqa: RUF023  (grouped by concern, each group sorted)
        # its listener, transport and place: admission, the sweep's clocks, what it sent
        "accepted_at", "_fe", "last_active", "_probe_only", "_read_at", "requests", "send_stalled", "sent",
        "_stuck_since", "taken", "_transport", "_unsent",
        # reading: the parser, the request under way and what it holds in `Incoming`
        "_framing", "_head_bytes", "_head_done", "_head_held", "_incoming", "_parser", "_parsing", "_request",
        "request_started", "_upgrade",
        # turns and flow control (connection.py): a read's rest, reading and writing paused
        "_backlog", "_backlog_forced", "_backlog_held", "lane_finish", "read_paused", "_turn_bytes", "_turn_due",
        "_turn_seconds", "_write_paused",
        # answers owed, in order, and what they may hold (`ResponseBudget`, `_waiting`)
        "_budget", "_busy", "_keep_header", "_one_by_one", "_responses", "scrape_waiting", "_scraped", "_waiting",
        "_waiting_bytes",
        # who calls: the Authorization value last accepted, and its token's name (broker/auth.py)
        "_auth_value", "_bucket", "caller", "_denied",
        # its end: the close mode, the client's EOF, the linger, the drain's unread bytes
        "_close", "_eof", "lingering_since", "_unread",
    )  # fmt: skip

    def __init__(self, frontend: HttpFrontend) -> None:
        self._fe = frontend
        self.lane_finish = 0.0  # its turns' last finish in the slow lane (`SlowLane.add`)
        self._parser = httptools.HttpRequestParser(self)
        self._request = _Request()  # the request under way (or the last one): reset by `on_message_begin`
        self._head_bytes = 0  # raw bytes received while a request's head is incomplete
        self._head_done = False
        self._close = Close.KEEP  # how it ends: kept open, closed, or closed lingering (`Close`)
        self.lingering_since = 0.0  # loop time of the half-close (`Close.LINGER`); 0 when not lingering
        self._framing = -1  # raw bytes read since the head's end (the body and its framing); -1: not in a body
        self._parsing = False  # a read is being parsed (`data_received`, `_next_turn`)
        self.scrape_waiting = False  # in the listener's `_scrape_waiters`
        self._scraped = 0  # the number of the last build written here: a connection takes one copy of each
        self._keep_header = b""  # "connection: keep-alive" for an HTTP/1.0 client that asked
        self._auth_value: bytes | None = None  # the Authorization value last accepted (`_authorized`)
        self.caller = ""  # ... its token's name ("" with no tokens, or none accepted yet)
        self._probe_only = False  # taken past max_connections: probes and /metrics only
        self._upgrade: tuple[bytes, bytes] | None = None  # (method, url) of an Upgrade request
        self._eof = False  # the client half-closed: close once nothing is owed
        self.request_started = 0.0  # loop time a request's first byte came; 0 when none is under way
        self.requests = 0  # requests answered or owed on this connection
        self._transport: asyncio.Transport | None = None
        self._backlog = b""  # the rest of a read past REQUESTS_PER_TURN requests: reading paused until it is done
        self._backlog_held = 0  # its bytes, counted in the listener's `Incoming` (`keep_backlog`)
        self._backlog_forced = False  # kept past max_incoming_bytes: its turn comes whatever the client does
        self._turn_due = False  # a `_next_turn` is scheduled (`_schedule_turn`: one at a time)
        self._incoming = 0  # bytes of an unfinished head or body counted in the listener's `Incoming`
        self._head_held = 0  # bytes that may hold an unfinished head (`_parse`)
        self._turn_bytes = 0  # bytes received since the last turn's pause (TURN_BYTES)
        self._turn_seconds = 0.0  # time its reads took since then (TURN_SECONDS)
        # While draining: bytes found in the kernel, received and not read yet, to be read and
        # served (`HttpFrontend.drain`, `_parsed_before_stop`); -1 once read, some still in
        # `_backlog` or a request under way; 0: the drain does not wait for its input.
        self._unread = 0
        # What each request is owed, in order (broker/frontend/httpowed.py).
        self._responses: deque[Owed] = deque()
        # Bytes of answers owed and not yet taken by the client (see ResponseBudget).
        self._denied = frontend.dispatcher.policy.denied[""]  # (its caller's: `_authorized`)
        self._bucket: Bucket | None = None  # ... and its rate limit (its address's without tokens)
        self._budget = ResponseBudget(frontend.dispatcher.outgoing, self._denied)
        self._budget.owed = self._responses  # (ResponseBudget.counted)
        self._waiting: deque[Deferred] = deque()  # requests not dispatched yet, in order
        self._waiting_bytes = 0  # their bodies' bytes, counted in the listener's `Incoming`
        # The last one dispatched from `_waiting`: a connection that had to wait gets its
        # waiting requests dispatched one at a time, each once the one before is answered,
        # so each has the whole budget (all at once, they would share it).
        self._busy: Exchange | None = None
        # Set when the client fell behind (answers were parked in a full write buffer):
        # its next requests all go through `_waiting`, one at a time, until it is owed
        # nothing (else those read at once when it resumes would share one budget).
        self._one_by_one = False
        self.read_paused = False
        self._write_paused = False
        self.send_stalled = 0.0  # loop time writing paused: for `Listener.send_timed_out`
        self.sent = 0  # bytes written to its transport
        self.taken = 0  # ... that its client had taken at the last look (`Listener.send_timed_out`)
        self._unsent = 0  # bytes of answers not yet taken by the client, at the sweep's last look
        self._stuck_since = 0.0  # loop time the sweep found those bytes not moving (`taking_answer`)
        self.last_active = self._read_at = self.accepted_at = frontend.loop.time()

    @property
    def owed(self) -> int:
        """Requests received and not yet answered on this connection."""
        return len(self._responses)

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        peer = self._budget.peer = transport.get_extra_info("peername")  # (for the logs: `Dispatcher._blame`)
        fe = self._fe
        if fe.auth is None:  # (with tokens, each token's: `_authorized`)
            self._bucket = self._budget.bucket = fe.dispatcher.limiter.for_address(address_of(peer))
        if fe.pool_size() >= fe.max_connections:  # nginx: worker_connections
            fe.make_room()  # idle connections, if any, give their places
        fe.connections.add(self)
        if fe.draining:
            fe.drain_connection(self)
        if fe.pool_size() > fe.max_connections:
            # Past the limit, with no idle connection to close, taken for /healthz, /readyz
            # and /metrics only: a full broker is alive, and must not look dead to its
            # liveness probe or to Prometheus. In the overflow until a scrape claims a place.
            self._probe_only = True
            fe.admit_probe(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for owed in self._responses:  # (the answers they hold go now, not when their calls end)
            exchange = owed if type(owed) is Exchange else owed.exchange if type(owed) is Deferred else None
            if exchange is not None:
                forget(exchange)
                if path_of(exchange) == "mcp":  # (its session names it no more: never answered, it would stay)
                    typing.cast(tuple[bool, bytes, ToolCall], exchange.context)[2].forgotten()
        self._responses.clear()
        # The parser holds this protocol's bound methods, and it the parser: a cycle, freed
        # only by the garbage collector's rare full runs. The cycle is broken (a parser of
        # nothing takes its place: the parser's own buffers, a partial header of up to 64
        # KiB, go with it), and what is big goes now (a partial body of up to
        # max_body_bytes, a read's unparsed rest, requests never dispatched, the URL).
        self._parser = httptools.HttpRequestParser(_Gone())
        self._request.body = self._request.url = b""
        self._fe.lost(self)
        self._fe.under_way.discard(self)
        self._fe.recount()  # (a request under way, if any, is gone: `HttpFrontend.held`)
        if self._probe_only:
            self._fe.probe_conns.discard(self)
            self._fe.probe_overflow.pop(self, None)

    def data_received(self, data: bytes) -> None:
        fe = self._fe
        now = fe.loop.time()
        if now - fe.read_at > WOKE_SECONDS:  # (several front-ends: what the workers wrote, first)
            fe.dispatcher.woke()
        fe.read_at = now
        if self._close:  # discarded (bounded per turn); lingering, the sweep closes it after LINGER_TIMEOUT silent
            self._turn_bytes = discard_turn(self._transport, self._turn_bytes, len(data), fe.loop)
            if self.lingering_since:
                self.last_active = now
            return
        fe.received_bytes += len(data)
        # Not `last_active`: bytes that start no request (empty lines before a request
        # line, which httptools skips, RFC 9112 2.2) keep no connection alive, nor out of
        # reach of `make_room`; a request's first byte does (`on_message_begin`).
        self._read_at = now
        if (len(data) + len(self._request.body) > SMALL_READ_BYTES and fe.slow_lane.spent > ADMIT_SECONDS  # (the hot path: one test)
                and not self.read_paused and not fe.draining):
            # What its turn may decode, which the lane charges: the body it ends (its length
            # known), else this read (round 50: every read of a body charged for all of it)
            held = len(data)
            req = self._request
            if (len(req.body) + len(data) >= req.content_length >= 0  # (it ends the body: its decode)
                    or (req.transfer_encoding and b"\r\n0" in data)  # (chunked: its last chunk, perhaps)
                    or not self._head_done):  # (a head's read: what follows it is unknown)
                held += len(req.body)
            self._pause()
            self._hold_back(data, math.inf, held)  # (its turn is the slow lane's: `SMALL_READ_BYTES`)
            return
        turn = self._turn_bytes = self._turn_bytes + len(data)
        ours = turn > TURN_BYTES and self._turn_full()  # this read ends the turn: its next scheduled once its time is known
        self._parsing = True
        began = _perf()
        try:
            if len(data) > FEED_BYTES:
                self._feed_turn(data)
            else:
                self._parse(data)
        finally:
            self._parsing = False
        took = _perf() - began
        if ours or took > CHARGED_SECONDS or self._turn_seconds + took > TURN_SECONDS:
            self._turn_took(took, ours, TURN_SECONDS, self._close)  # (TURN_SECONDS: this module's)
        else:  # (the hot path's reads: `_turn_took`'s common case, inline: a call less)
            self._turn_seconds += took
        if fe.draining:
            if self._unread:
                self._read_before_stop(len(data))
            if self._responses:
                self._flush_ready()  # (answers held back while the read was parsed: `_write`)

    def _read_before_stop(self, n: int) -> None:
        """While draining, `n` bytes were read (and parsed, up to a `_backlog`) on a
        connection still reading what its client sent before the stop (`_unread`)."""
        unread = self._unread
        if unread > 0:
            unread = self._unread = unread - n if unread > n else -1
        if unread < 0 and not self._backlog:
            self._parsed_before_stop()

    def _parsed_before_stop(self) -> None:
        """While draining, the bytes measured in the kernel (`_unread`) are read and parsed:
        if a request is under way, read on (`_unread` -1) until it is complete; else
        measure again (`unread_bytes`), and read on if more came meanwhile (pipelined
        requests still arriving: the client's send queue empties into the receive queue
        as it is read). At the first moment with neither, or once the grace period is over
        (`Dispatcher.in_grace`), the drain no longer waits for its input; if nothing is
        owed either, the connection is idle and closes now (`stop_close`: requests that
        come later are discarded), else at its last answer, which says `connection:
        close` (`_write`). A client that never stops sending is served until the grace
        period ends."""
        if self._fe.read_on(self, not self._close, bool(self.request_started)):
            return
        if self._transport is not None and not self._close and not self._responses and self.requests:
            self.stop_close()

    def _parse(self, data: bytes | memoryview) -> None:
        """Feed `data` to the parser, which calls back per request. Then count what an
        unfinished request holds in `Incoming` (max_incoming_bytes): its body, or, while
        its head is unfinished (its URL, and the parser's partial header line), the bytes
        that head may be: those of the reads since it began, all of the one it began in
        (hostile testing, round 8: 3000 connections each holding 63 KiB of an unfinished
        head took the broker from 57 to 232 MB past a max_incoming_bytes of 16 MiB)."""
        fresh = not self.request_started  # (a head under way after the feed began in `data`)
        if not self._head_done:
            self._head_bytes += len(data)
        else:  # a body: with its framing, which `_framing_check` bounds
            self._framing += len(data)
            if len(data) > FEED_BYTES and self._request.transfer_encoding and self._framing_room() < 0:
                self._framing -= len(data)  # (counted piece by piece)
                self._parse_bounded(data)
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._serve_upgrade(bytes(data[exc.args[0]:]) if exc.args else b"")
        except httptools.HttpParserError as exc:
            if not self._close:
                if str(exc) == "Invalid HTTP version":  # (llhttp knows 0.9, 1.x and 2.0 only: 1.2, 3.0)
                    self._answer_and_close(505, b"HTTP version not supported: use HTTP/1.1")
                elif str(exc) == "Pause on PRI/Upgrade":  # HTTP/2's connection preface (RFC 9113 3.4):
                    # prior knowledge of HTTP/2, which this server does not speak (round 26: 400)
                    self._answer_and_close(505, b"HTTP/2.0 not supported: use HTTP/1.1")
                else:
                    self._answer_and_close(400, f"bad HTTP request: {exc}".encode())
        else:
            # httptools keeps growing an unfinished header line without calling back:
            # count raw bytes until the head is complete (nginx: large_client_header_buffers).
            if not self._head_done and self._head_bytes > MAX_HEADER_BYTES and not self._close:
                self._answer_and_close(431, b"request line and headers too large")
            elif self._framing > MAX_HEADER_BYTES and not self._close:  # (-1 once a request is complete)
                self._framing_check()
        if self.request_started and not self._head_done:  # a head left unfinished
            # (`_head_bytes` is 0 if the request before it ended in `data`: begun there too)
            held = self._head_held = len(data) if fresh or not self._head_bytes else self._head_held + len(data)
        else:
            held = len(self._request.body)  # a body left unfinished, grown, or taken
        if held != self._incoming:
            self._hold(held)

    def _parse_bounded(self, data: bytes | memoryview) -> None:
        """Parse a read past FEED_BYTES that could take a chunked body's framing past its
        bound, in pieces no longer than the framing may still take (FEED_BYTES at least:
        pieces of a few bytes would cost a feed each for a large chunk's data), each
        checked after it is fed. The request may end within a piece: `on_message_complete`
        then checks its count, whole piece included, before it forgets it (checked only
        after the feed, a 100,000-byte extension in the read that ended the request was
        served). So a request within its bound is never refused, unless its framing comes
        within FEED_BYTES of the bound and the requests pipelined after it in the same
        piece are counted with it. What follows the request is parsed in pieces too
        (FEED_BYTES outside a chunked body)."""
        view = memoryview(data)
        start, end = 0, len(view)
        while start < end and not self._close and self._transport is not None:
            size = FEED_BYTES
            if self._head_done and self._request.transfer_encoding:
                size = max(self._framing_room(), FEED_BYTES)
            self._parse(view[start : start + size])
            start += size

    def _framing_room(self) -> int:
        """Bytes of framing (what is not body data) the chunked body under way may still
        send: MAX_HEADER_BYTES plus CHUNK_FRAMING_BYTES a chunk, less what it has sent;
        negative past the bound."""
        req = self._request
        return MAX_HEADER_BYTES + req.chunks * CHUNK_FRAMING_BYTES - (self._framing - len(req.body))

    def _framing_check(self) -> None:
        """Answer 431 and close if the bytes read since the head's end that are not body
        data (a chunked body's size lines, extensions, CRLFs and trailer section) pass
        MAX_HEADER_BYTES plus CHUNK_FRAMING_BYTES a chunk. httptools keeps parsing an
        unfinished chunk line or trailer line without calling back: raw bytes count.
        (The feed that ends a head is counted as head, and a request whose head ends within
        a feed is counted from the next: at most one read more.)"""
        if self._framing_room() < 0:
            framing = self._framing - len(self._request.body)
            self._answer_and_close(431, b"chunked body framing (size lines, extensions, trailer section) of %d bytes: "
                                   b"more than %d plus %d a chunk" % (framing, MAX_HEADER_BYTES, CHUNK_FRAMING_BYTES))

    def _hold(self, held: int) -> None:
        """Count `held` bytes of the unfinished head or body in the broker's `Incoming`; past
        max_incoming_bytes (slower requests under way gone first: `Incoming.make_room`),
        drop it and answer 503 (then close, lingering)."""
        req = self._request
        incoming = self._fe.incoming
        if incoming.hold(self._incoming, held) or incoming.make_room(self, self._incoming, held):
            self._incoming = held
            return
        incoming.refuse(self._incoming)
        self._incoming = 0
        req.body = b""
        req.skip = True
        if not self._close:
            self._refuse_body(503, self._fe.incoming_full_body, ErrorCode.OVERLOADED)

    def _feed_turn(self, data: bytes) -> None:
        """Parse `data` (a read past FEED_BYTES, or what the last turn left) in pieces until
        REQUESTS_PER_TURN requests are routed; leave the rest in `_backlog`, reading paused,
        for a later loop iteration (`_next_turn`), as NDJSON does with lines. httptools
        parses all it is fed at once, and libuv reads a connection up to 32 times in a row
        while it has data: 256 KB reads of tiny pipelined requests answered at once (6000
        GET /healthz, 30 ms each) held every other connection for as long as they came.
        A piece (a view: no copy) ends where a head ends; a body of known length is one
        piece, so it reaches the codec as one `bytes` as when it comes in a read of its
        own; anything else goes FEED_BYTES at a time, twice the last piece's size after
        one that completed no request (a chunked body goes in a few pieces)."""
        req = self._request
        view = memoryview(data)
        start, end = 0, len(data)
        size = FEED_BYTES
        routed = self.requests
        deadline = _perf() + TURN_SECONDS
        while start < end:
            before = self.requests
            stop = start + size
            if not self._head_done:
                head_end = data.find(b"\r\n\r\n", start, stop)
                if head_end >= 0:
                    stop = head_end + 4
            elif req.content_length > 0 and not req.transfer_encoding:
                stop = start + max(1, req.content_length - len(req.body))
            self._parse(view[start:stop])
            start = stop
            if self._close or self._transport is None:
                return
            if start < end and self.requests > routed and (
                self.requests - routed >= REQUESTS_PER_TURN or start >= TURN_REQUEST_BYTES or _perf() > deadline
                or len(self._responses) > PIPELINE_HIGH  # (round 34: else one read's 3000 filled the queue)
            ):
                self._pause()
                self._hold_back(data[start:], _perf() - deadline + TURN_SECONDS)
                return
            size = FEED_BYTES if self.requests != before else size * 2

    def _next_turn(self) -> None:
        """Go on with the requests of a read left in `_backlog`; reading resumes
        (`_maybe_resume`) once it is done."""
        self._turn_due = False
        backlog = self._backlog
        if self._transport is None or not backlog or (
            (self._write_paused or len(self._responses) > PIPELINE_HIGH) and not self._backlog_forced
        ):  # (`resume_writing`, or `_flush_ready` below PIPELINE_LOW, comes back here)
            return  # (one past max_incoming_bytes goes on: its requests wait counted, or are refused)
        self._backlog = b""
        # Out of the count at once: its requests are counted again as they wait (hostile
        # testing, round 15: counted twice meanwhile, 10 of 100 pipelined POSTs got 503).
        self._fe.backlog_done(self)
        if not self._close:
            self._parsing = True
            try:
                self._feed_turn(backlog)
            finally:
                self._parsing = False
            if self._fe.draining:
                if self._unread < 0 and not self._backlog:
                    self._parsed_before_stop()  # (the read that ended the bytes received before the stop)
                if self._responses:
                    self._flush_ready()  # (answers held back while the read was parsed: `_write`)
        if not self._backlog:
            started = self.request_started
            self._maybe_resume()
            # A turn's wait (the loop's next iteration, the slow lane) is the broker's own
            # scheduling: the request's clock goes on (round 46: `_maybe_resume` restarted it,
            # and a body trickled a byte at a time while the loop was busy, each byte's read
            # laned, got 408 after 11 to 19 s, or none, for a request_timeout of 3 s).
            self.request_started = started
            self._fe.recount()  # (the drain waits for a backlog: `Listener.held`)

    def _dispatch_waiting(self) -> None:
        """Dispatch the requests that wait (`_waiting`), in order, while `_gated` allows,
        a turn's worth at a time (REQUESTS_PER_TURN or TURN_SECONDS, as `_feed_turn`; the
        rest in a later loop iteration: hostile testing, round 13, 120 bodies answered at
        once were all decoded in one callback, 125 ms of the loop)."""
        fe = self._fe
        waiting = self._waiting
        busy = self._busy
        turn, deadline = REQUESTS_PER_TURN, _perf() + TURN_SECONDS
        while waiting and not self._gated() and self._transport is not None:
            if busy is not None and busy.remaining:
                break  # one at a time: see _busy
            if turn == 0 or _perf() > deadline:
                fe.next_turn(self, self._dispatch_waiting, _perf() - deadline + TURN_SECONDS)
                break
            turn -= 1
            deferred = waiting.popleft()
            body, deferred.body = deferred.body, b""
            fe.incoming.hold(len(body), 0)
            self._waiting_bytes -= len(body)
            # (submit_held: while draining, a request held here is served as in flight)
            self._budget.denied, self._budget.bucket, self._budget.caller = deferred.denied, deferred.bucket, deferred.caller
            mcp = deferred.mcp
            decoded = fe.codec.decode(body) if mcp is None else Body(False, [mcp.request])
            exchange = fe.dispatcher.submit_held(decoded, self._deferred_done, self._budget)
            if exchange is None:
                extra = self._keep_header if deferred.keep_alive else CLOSE
                deferred.response = STATUS_LINES[204] + fe.date + deferred.cors + extra + b"\r\n"
            else:
                exchange.context = ((deferred.keep_alive, deferred.cors, mcp) if mcp is not None else
                                    (deferred.keep_alive, deferred.cors) if deferred.cors else deferred.keep_alive)
                if mcp is not None and exchange.remaining:
                    mcp.started(exchange)
                deferred.exchange = busy = self._busy = exchange
        if self._transport is not None:
            self._flush_ready()  # (an exchange complete at once is not called back)
            self._maybe_resume()
        fe.recount()  # (the drain waits for what `_waiting` held)

    def eof_received(self) -> bool:
        """The client half-closed (`shutdown(SHUT_WR)`), or closed: keep the transport
        open to write what it is owed, then close; close at once if nothing is owed. A
        request still under way can no longer complete: its bytes go now (its body's
        count in max_incoming_bytes too), and neither the request clock nor the drain
        waits for it (hostile testing: a client that sent a slow call and 80 KB of a
        next body, then closed, held those bytes counted for the slow call's length,
        and other clients' bodies were refused 503 meanwhile). (Reading is never paused
        at EOF: a read's unparsed rest, `_backlog`, is parsed before reading resumes.)"""
        self._eof = True
        for owed in list(self._responses):
            exchange = owed if type(owed) is Exchange else owed.exchange if type(owed) is Deferred else None
            if exchange is not None and exchange.remaining and path_of(exchange) == "mcp":
                # An MCP client that closes while a tools/call's answer is owed cancels it (2026-07-28
                # streamable-http, "Cancellation": its response stream is closed): cancelled in its
                # worker, answered -32800, in its turn with the rest owed, for a client that only
                # half-closed (hostile testing, round 124: a reset lost the plain calls' answers too).
                cancel_mcp(self._fe.dispatcher, exchange)
                if self._transport is None:
                    return False
        if self.request_started:
            self.request_started = 0.0
            self._request.body = b""
            if self._incoming:
                self._fe.incoming.hold(self._incoming, 0)
                self._incoming = 0
            self._fe.recount()  # (`HttpFrontend.held` waits for a request under way no more)
        if self._unread:  # draining, still reading what came before the stop: nothing more comes
            self._unread = 0
            self._fe.unread.discard(self)
            self._fe.recount()
        # (over TLS the transport ends at the client's close_notify whatever this says, and a
        # True logs a WARNING a connection: hostile testing, round 115, M2)
        return bool(self._responses) and not is_tls(self._transport)

    def _serve_upgrade(self, rest: bytes) -> None:
        """An `Upgrade` request (h2c, websocket): answer it as plain HTTP/1.1 and
        close, as nginx does. httptools stops at the end of its head: its body, if
        any (in `rest` and the reads to come), is read by a second parser that gets
        the same framing (Content-Length or Transfer-Encoding) and nothing else."""
        req = self._request
        if self._upgrade is None or self._close:
            if not self._close:
                self._answer_and_close(400, b"upgrade not supported")
            return
        self._head_done = True  # the body is not head: no 431 for its bytes
        self._framing = 0  # (counted from the next read: `rest` went to the new parser)
        framing = b""
        if req.transfer_encoding:
            framing = b"transfer-encoding: " + req.transfer_encoding + b"\r\n"
        elif req.content_length >= 0:
            framing = b"content-length: %d\r\n" % req.content_length
        # The same HTTP version: `_refused` reads it from the parser (no Host is fine on 1.0).
        version = self._parser.get_http_version().encode()
        self._parser = httptools.HttpRequestParser(_UpgradeBody(self))
        try:
            self._parser.feed_data(b"POST / HTTP/" + version + b"\r\n" + framing + b"\r\n" + rest)
        except httptools.HttpParserError as exc:  # later reads: data_received has the same
            if not self._close:
                self._answer_and_close(400, f"bad HTTP request: {exc}".encode())

    def upgrade_body_complete(self) -> None:
        """The Upgrade request's body is all in: answer it once, then close."""
        pending, self._upgrade = self._upgrade, None
        if self._framing > MAX_HEADER_BYTES and not self._close:
            self._framing_check()  # (as `on_message_complete` does)
        if pending is None or self._request.skip or self._close:
            return
        self.request_started = 0.0
        method, url = pending
        self._close = Close.LINGER  # (as `_refuse_expected`: what the client sends after it is discarded)
        self._route(method, url, False)
        self._discarding()

    def _under_way(self) -> bool:
        """Requests read and not answered, or not parsed yet (`resume_writing`)."""
        return bool(self._responses or self._backlog)

    def _write_ready(self) -> None:
        """Writing resumed: the answers finished meanwhile go, in order (`resume_writing`)."""
        if self._responses:
            self._flush_ready()

    # -- flow control ------------------------------------------------------------------

    def _pause(self) -> None:
        if not self.read_paused and self._transport is not None and not self._close:  # (`_discarding`)
            self.read_paused = True
            self._transport.pause_reading()

    def _maybe_resume(self) -> None:
        if (
            self.read_paused
            and not self._write_paused
            and not self._waiting
            and not self._backlog  # `_next_turn` comes back here once it is done
            and len(self._responses) < PIPELINE_LOW
            and self._transport is not None
        ):
            self.read_paused = False
            if self.request_started:  # the request's clock stood still while not read
                self.request_started = self._fe.loop.time()
            if not self._eof:
                self._transport.resume_reading()

    def _end_turn(self) -> None:
        """Resume reading after a turn's pause (TURN_BYTES), unless something else holds it
        paused; the pause lasted one loop iteration, so the request's clock goes on."""
        started = self.request_started
        self._maybe_resume()
        self.request_started = started
