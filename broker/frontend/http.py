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

Answers:
    POST rpc_path          200 with the JSON-RPC response; 204 when nothing is owed
                           (only notifications); the status in `jsonrpc.ERRORS` for a
                           single error response; 413 past `max_body_bytes` (checked
                           on Content-Length before the body arrives, and on chunks);
                           503 when an unfinished body would take the bytes still
                           arriving on all connections past `max_incoming_bytes`
    GET/HEAD /healthz      200 while the process runs
    GET/HEAD /readyz       200 when at least one worker is ready and answering, else 503
    GET/HEAD /metrics      Prometheus text format, when this listener serves metrics (a
                           HEAD makes no scrape and has no content-length, RFC 9110 9.3.2;
                           one GET body built answers every GET parsed before it, one copy a
                           connection; the next is built as long after as it took:
                           `HttpFrontend.scrape_answer`)
    OPTIONS rpc_path       204 with CORS headers: a preflight from an allowed Origin
    other method           405 with Allow
    other path             404
    bad HTTP               400 and close (two Host fields, a Transfer-Encoding list, a
                           chunked body of more than SMALL_CHUNKS chunks plus one per
                           MIN_CHUNK_BYTES);
                           a version not 1.0/1.1: 505; a head past 64 KiB or 100 header
                           fields, trailers counted in, or a chunked body's framing (size
                           lines, extensions, trailer section) past 64 KiB plus
                           CHUNK_FRAMING_BYTES a chunk, in the read that ends the request
                           too (`_parse_bounded`): 431 and close; a request not all in
                           within request_timeout: 408 and close
An absolute-form target (`http://host:port/path`) is served as its path, its authority
taking the Host header's place (RFC 9112 3.2.2) and checked exactly as a Host value is. Trailer fields are counted, never
merged into the header fields (RFC 9110 6.5.1). `100 Continue` goes only to an HTTP/1.1
call about to be served with nothing owed before it (RFC 9110 10.1.1).
Every answer has a `date` header (RFC 9110 6.6.1; formatted once a second by the
sweep), and every 503 a `retry-after` (RFC 9110 10.2.3).

Who may call (issue 9 item 11): a web page must not be able to run a tool, cross-site
or through DNS rebinding. On rpc_path and /metrics a request whose Host name (any port)
is not in `allowed_hosts` gets 421, one with an `Origin` not in `allowed_origins` 403,
and a POST to rpc_path whose Content-Type is not application/json 415 (browsers send
only text/plain and form types cross-site without a CORS preflight). A request with no
Origin (curl, SDKs) is not affected, nor is an HTTP/1.0 one with no Host (no browser
sends one); an HTTP/1.1 one with no Host gets 400 (RFC 9112 3.2). /healthz and /readyz
are not checked: they tell nothing and change nothing, and kubelet's probes send the
pod IP as Host. The headers are kept in `on_header`; `_route` refuses in one place.

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
undispatched (`_Deferred` in `_waiting`, holding their place in `_responses`), and go
one at a time once the client reads (`_busy`, `_one_by_one`).
One sweep per second for all connections, not a timer per request, closes idle
connections (nothing owed, no bytes for `keepalive_timeout` seconds, and the last answer
taken: bytes still leaving the kernel's send queue restart the clock, `taking_answer`), answers 408
to requests under way for longer than `request_timeout` (nginx's
client_header_timeout and client_body_timeout, for the whole request), and aborts
connections whose client has left its answers unread (writing paused) for longer
than `send_timeout` (nginx's send_timeout): the request clock stands still while
the broker paused reading, so this is what bounds a client that sends and never reads.

A client that half-closes after sending (`shutdown(SHUT_WR)`, `nc -N`) gets what it is
owed, then the connection closes. After an error answer the broker half-closes and
discards (lingers, reading on) for at most LINGER_TIMEOUT silent, LINGER_TIME in all, once
its answers are taken; a lingering
connection is idle for `make_room`.

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

import asyncio
import math
import time
import typing
from collections import deque

import httptools

from broker.answers import Exchange, ResponseBudget, forget
from broker.frontend.base import (
    ADMIT_SECONDS,
    CHARGED_SECONDS,
    PIPELINE_HIGH,
    PIPELINE_LOW,
    SMALL_READ_BYTES,
    TURN_BYTES,
    TURN_SECONDS,
    discard_turn,
    fell_behind,
    reset,
    trickle_rank,
    unread_bytes,
    unsent_bytes,
)
from broker.frontend.httplistener import PROBE_OVERFLOW, PROBE_RESERVE, HttpFrontend, _reserve_rank, _Scrape
from broker.frontend.httpmsg import (
    CLOSE,
    CONTINUE,
    JSON_TYPE,
    KEEP_ALIVE,
    METRICS_TYPE,
    PREFLIGHT,
    STATUS_LINES,
    TOO_MANY_BODY,
    error_body,
    is_identity,
    is_json,
    json_response,
)
from broker.jsonrpc import ErrorCode

__all__ = ["PROBE_OVERFLOW", "PROBE_RESERVE", "HttpFrontend", "HttpProtocol"]


_perf = time.perf_counter
REQUESTS_PER_TURN = 16  # requests routed from one read per loop turn; the rest waits (NDJSON's LINES_PER_TURN)
TURN_REQUEST_BYTES = 64 * 1024  # ... or fewer: requests of this many bytes end a turn too (NDJSON's TURN_LINE_BYTES)
FEED_BYTES = 4096  # a read past this is parsed in pieces, so that a turn can end between them
MAX_HEADER_BYTES = 64 * 1024  # request line and header lines, like nginx's large buffers
MAX_HEADERS = 100  # header fields in one request (h11 and nginx allow 100 too)
_REQUEST_LINE_REST = len(b"  HTTP/1.1\r\n")  # a request line's bytes besides its method and target
# Each chunk of a chunked body costs two Python callbacks (about 0.5 µs): 1-byte chunks made
# a 1 MiB body cost 400 ms. A body may have SMALL_CHUNKS chunks, plus one per MIN_CHUNK_BYTES
# of it; one with more is refused (400): what a body's chunks cost stays under that of the
# same bytes sent as small requests. (h11 and nginx set no such bound; no client sends an
# RPC body in thousands of tiny chunks.)
SMALL_CHUNKS = 1024
MIN_CHUNK_BYTES = 64
# What a chunked body sends besides its data (size lines with their extensions, CRLFs, the
# trailer section) may take MAX_HEADER_BYTES plus CHUNK_FRAMING_BYTES a chunk (a size line of
# 16 hex digits and its CRLFs are 20 bytes): with the bound on chunks above, a body's bytes on
# the wire stay under 128 KiB plus twice its size. Chunk extensions (`5;a=xxx`) were counted
# as neither head nor body: one chunk line of 1 GB was parsed within request_timeout (node
# caps them at 16 KiB, CVE-2024-22019). Past the bound: 431 and close, as for the trailer
# section, whose unfinished line this bound has always counted: it is metadata around the
# content, held to the head's limit (not 413: the content is within max_body_bytes; node
# answers 413 to too many extensions, but 413 here means max_body_bytes).
CHUNK_FRAMING_BYTES = 64
_PROBE_PATHS = frozenset((b"/healthz", b"/readyz", b"/metrics"))
_CODED = b"\0coded"  # `_content_type` of a body with a Content-Encoding other than identity: 415
_PATH_OF_URL = {b"/healthz": "health", b"/readyz": "ready", b"/metrics": "metrics"}


class _Gone:
    """The callbacks of a lost connection's parser: none."""


class _StopParsing(Exception):
    """Raised from a parser callback to end the feed: the request is answered already."""


class _Deferred:
    """A JSON-RPC request whose body waits to be dispatched: its connection was owed
    max_response_bytes of answers, or its client was not reading (see `_gated`).
    `exchange` once dispatched; `response` if it then owed nothing (204)."""

    __slots__ = ("body", "cors", "exchange", "keep_alive", "response")

    def __init__(self, body: bytes | bytearray, keep_alive: bool, cors: bytes) -> None:
        self.body = body
        self.keep_alive = keep_alive
        self.cors = cors
        self.exchange: Exchange | None = None
        self.response = b""


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


class HttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 client connection (keep-alive, pipelining, chunked bodies)."""

    __slots__ = (
        "_backlog",
        "_backlog_forced",
        "_backlog_held",
        "_body",
        "_budget",
        "_busy",
        "_chunks",
        "_closing",
        "_content_length",
        "_content_type",
        "_eof",
        "_expect",
        "_fe",
        "_framing",
        "_head_bytes",
        "_head_done",
        "_head_held",
        "_header_bytes",
        "_headers",
        "_host",
        "_incoming",
        "_keep_header",
        "_linger",
        "_one_by_one",
        "_origin",
        "_parser",
        "_parsing",
        "_probe_only",
        "_read_at",
        "_responses",
        "_scraped",
        "_skip",
        "_stuck_since",
        "_transfer_encoding",
        "_transport",
        "_turn_bytes",
        "_turn_due",
        "_turn_seconds",
        "_unread",
        "_unsent",
        "_upgrade",
        "_url",
        "_waiting",
        "_waiting_bytes",
        "_write_paused",
        "accepted_at",
        "lane_finish",
        "last_active",
        "lingering_since",
        "read_paused",
        "request_started",
        "requests",
        "scrape_waiting",
        "send_stalled",
        "sent",
        "taken",
    )

    def __init__(self, frontend: HttpFrontend) -> None:
        self._fe = frontend
        self.lane_finish = 0.0  # its turns' last finish in the slow lane (`SlowLane.add`)
        self._parser = httptools.HttpRequestParser(self)
        self._head_bytes = 0  # raw bytes received while a request's head is incomplete
        self._head_done = False
        self._content_length = -1  # -1: no Content-Length header
        self._transfer_encoding = b""
        self._linger = False  # half-close after the answer: the client may still be sending
        self.lingering_since = 0.0  # loop time of the half-close (`_linger`); 0 when not lingering
        self._framing = -1  # raw bytes read since the head's end (the body and its framing); -1: not in a body
        self._parsing = False  # a read is being parsed (`data_received`, `_next_turn`)
        self.scrape_waiting = False  # in the listener's `_scrape_waiters`
        self._scraped = 0  # the number of the last build written here: a connection takes one copy of each
        self._keep_header = b""  # "connection: keep-alive" for an HTTP/1.0 client that asked
        self._probe_only = False  # taken past max_connections: probes and /metrics only
        self._upgrade: tuple[bytes, bytes] | None = None  # (method, url) of an Upgrade request
        self._eof = False  # the client half-closed: close once nothing is owed
        self.request_started = 0.0  # loop time a request's first byte came; 0 when none is under way
        self.requests = 0  # requests answered or owed on this connection
        self._transport: asyncio.Transport | None = None
        self._url = b""
        # The request body: the first piece as httptools gave it (no copy in the common
        # case of a body in one read), then one bytearray bounded by max_body_bytes (a
        # list of pieces cost ~50 bytes of objects per piece: 2-byte chunks, 27x).
        self._body: bytes | bytearray = b""
        self._backlog = b""  # the rest of a read past REQUESTS_PER_TURN requests: reading paused until it is done
        self._backlog_held = 0  # its bytes, counted in the listener's `Incoming` (`keep_backlog`)
        self._backlog_forced = False  # kept past max_incoming_bytes: its turn comes whatever the client does
        self._turn_due = False  # a `_next_turn` is scheduled (`_schedule_turn`: one at a time)
        self._header_bytes = 0  # request line and header lines of the current head
        self._headers = 0  # header fields of the current head
        self._expect = False
        self._skip = False  # the current request was answered early (413): drop its body
        self._chunks = 0  # chunks of the current request's body so far
        self._incoming = 0  # bytes of an unfinished head or body counted in the listener's `Incoming`
        self._head_held = 0  # bytes that may hold an unfinished head (`_parse`)
        self._turn_bytes = 0  # bytes received since the last turn's pause (TURN_BYTES)
        self._turn_seconds = 0.0  # time its reads took since then (TURN_SECONDS)
        # While draining: bytes found in the kernel, received and not read yet, to be read and
        # served (`HttpFrontend.drain`, `_parsed_before_stop`); -1 once read, some still in
        # `_backlog` or a request under way; 0: the drain does not wait for its input.
        self._unread = 0
        self._host: bytes | None = None  # the request's Host, Origin and Content-Type values
        self._origin: bytes | None = None
        self._content_type: bytes | None = None
        # What each request is owed, in order: an Exchange (JSON-RPC), finished bytes with
        # their keep-alive and path label, or a _Scrape (a /metrics answer, made only
        # once the client reads what came before).
        self._responses: deque[Exchange | tuple[bytes, bool, str] | _Scrape | _Deferred] = deque()
        # Bytes of answers owed and not yet taken by the client (see ResponseBudget).
        self._budget = ResponseBudget(frontend.dispatcher.outgoing)
        self._waiting: deque[_Deferred] = deque()  # requests not dispatched yet, in order
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
        self._closing = False
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

    @property
    def idle(self) -> bool:
        """No request under way, none owed or waiting its turn (`_backlog`), not closing
        (or only lingering after an error answer, see `_write`), answers not stuck unsent
        (those are for send_timeout: a close would wait for them): closing it loses nothing."""
        return (
            not self._responses and not self.request_started and not self._backlog
            and (not self._closing or self.lingering_since > 0) and not self.send_stalled
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
            self.request_started and not self._responses and not self._backlog and not self._closing
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
        self._closing = True
        self._drop_unfinished()
        body = b'{"error":"request still arriving after %.3g s while the broker is at max_connections"}' % waited
        response = json_response(408, body, False, b"", self._fe.json_head)
        self._write(response[: len(response) - len(body)] if self._head_request() else response, True, "other")
        if not transport.is_closing():
            self._discarding()
            self._fe.linger_out(self)

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

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection's transport; None once it is lost."""
        return self._transport

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        self._budget.peer = transport.get_extra_info("peername")  # (for the logs: `Dispatcher._blame`)
        fe = self._fe
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
        fe = self._fe
        if len(fe.probe_conns) >= PROBE_RESERVE:
            now = fe.loop.time()
            victim = min((*fe.probe_conns, self), key=lambda conn: _reserve_rank(conn, now))
            if victim is self:
                if self.owed:
                    fe.give_up(self)
                return
            fe.give_up(victim)
        del fe.probe_overflow[self]
        fe.probe_conns.add(self)

    def answer_displaced(self) -> bool:
        """Given up by the probes' reserve while owed its one scrape, waiting for its build:
        answer it from the last build, if one is kept, with `connection: close`, and close.
        That build was made before the scrape came, at most one build's pace earlier (ms),
        so its figures are that much older; a 503 would have Prometheus record the target
        down (`up` 0), which clients scraping in a loop could force (hostile testing, round
        8: 8 of them churning the places had 20 of 30 scrapes answered 503). (A scrape
        waits only while builds are paced, and a pace starts with a build, which is kept
        till it ends.) Return False if it is owed something else: refuse it then."""
        responses = self._responses
        if len(responses) != 1 or type(responses[0]) is not _Scrape:
            return False
        answer = self._fe.scrape_answer(self._fe.scrape_builds, CLOSE)
        if answer is None:
            return False
        responses.clear()
        self._write(answer, False, "metrics")
        return True

    def _refuse(self, path: str = "other") -> None:
        """Turned away at max_connections: 503 "too many connections", then close;
        `path` labels it in the statuses counter (a request it answers, else "other")."""
        self._fe.refused()
        self._closing = True
        self._write(json_response(503, TOO_MANY_BODY, False, b"", self._fe.json_head), False, path)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for owed in self._responses:  # (the answers they hold go now, not when their calls end)
            if type(owed) is Exchange:
                forget(owed)
            elif type(owed) is _Deferred and owed.exchange is not None:
                forget(owed.exchange)
        self._responses.clear()
        # The parser holds this protocol's bound methods, and it the parser: a cycle, freed
        # only by the garbage collector's rare full runs. The cycle is broken (a parser of
        # nothing takes its place: the parser's own buffers, a partial header of up to 64
        # KiB, go with it), and what is big goes now (a partial body of up to
        # max_body_bytes, a read's unparsed rest, requests never dispatched, the URL).
        self._parser = httptools.HttpRequestParser(_Gone())
        self._body = self._url = b""
        self._fe.lost(self)
        self._fe.under_way.discard(self)
        self._fe.recount()  # (a request under way, if any, is gone: `HttpFrontend.held`)
        if self._probe_only:
            self._fe.probe_conns.discard(self)
            self._fe.probe_overflow.pop(self, None)

    def data_received(self, data: bytes) -> None:
        if self._closing:  # discarded (bounded per turn); lingering, the sweep closes it after LINGER_TIMEOUT silent
            fe = self._fe
            self._turn_bytes = discard_turn(self._transport, self._turn_bytes, len(data), fe.loop)
            if self.lingering_since:
                self.last_active = fe.loop.time()
            return
        fe = self._fe
        fe.received_bytes += len(data)
        # Not `last_active`: bytes that start no request (empty lines before a request
        # line, which httptools skips, RFC 9112 2.2) keep no connection alive, nor out of
        # reach of `make_room`; a request's first byte does (`on_message_begin`).
        self._read_at = fe.loop.time()
        if (len(data) + len(self._body) > SMALL_READ_BYTES and fe.slow_lane.spent > ADMIT_SECONDS  # (the hot path: one test)
                and not self.read_paused and not fe.draining):
            # What its turn may decode, which the lane charges: the body it ends (its length
            # known), else this read (round 50: every read of a body charged for all of it)
            held = len(data)
            if (len(self._body) + len(data) >= self._content_length >= 0  # (it ends the body: its decode)
                    or (self._transfer_encoding and b"\r\n0" in data)  # (chunked: its last chunk, perhaps)
                    or not self._head_done):  # (a head's read: what follows it is unknown)
                held += len(self._body)
            forced = not fe.keep_backlog(self, data)  # (its turn is the slow lane's: `SMALL_READ_BYTES`)
            self._pause()
            if forced or not self._write_paused:  # else `resume_writing` schedules it
                self._schedule_turn(math.inf, held)
            return
        turn = self._turn_bytes = self._turn_bytes + len(data)
        ours = False  # this read ends the turn: its next is scheduled below, once its time is known
        if turn > TURN_BYTES:  # enough for this loop turn: the others' turn now
            self._turn_bytes = 0
            if not self.read_paused:
                self._pause()
                ours = True
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
        if took > CHARGED_SECONDS:
            fe.slow_lane.charge(took)
        spent = self._turn_seconds = self._turn_seconds + took
        if spent > TURN_SECONDS:  # (see TURN_SECONDS)
            self._turn_seconds = 0.0
            if not self.read_paused and not self._closing:
                self._pause()
                ours = True
        else:
            spent = 0.0
        if ours:  # (a slow turn's next is the slow lane's, TURN_BYTES's too: round 45, it was not)
            fe.next_turn(self, self._end_turn, spent)
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
        if self._fe.read_on(self, not self._closing, bool(self.request_started)):
            return
        if self._transport is not None and not self._closing and not self._responses and self.requests:
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
            if len(data) > FEED_BYTES and self._transfer_encoding and self._framing_room() < 0:
                self._framing -= len(data)  # (counted piece by piece)
                self._parse_bounded(data)
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._serve_upgrade(bytes(data[exc.args[0]:]) if exc.args else b"")
        except httptools.HttpParserError as exc:
            if not self._closing:
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
            if not self._head_done and self._head_bytes > MAX_HEADER_BYTES and not self._closing:
                self._answer_and_close(431, b"request line and headers too large")
            elif self._framing > MAX_HEADER_BYTES and not self._closing:  # (-1 once a request is complete)
                self._framing_check()
        if self.request_started and not self._head_done:  # a head left unfinished
            # (`_head_bytes` is 0 if the request before it ended in `data`: begun there too)
            held = self._head_held = len(data) if fresh or not self._head_bytes else self._head_held + len(data)
        else:
            held = len(self._body)  # a body left unfinished, grown, or taken
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
        while start < end and not self._closing and self._transport is not None:
            size = FEED_BYTES
            if self._head_done and self._transfer_encoding:
                size = max(self._framing_room(), FEED_BYTES)
            self._parse(view[start : start + size])
            start += size

    def _framing_room(self) -> int:
        """Bytes of framing (what is not body data) the chunked body under way may still
        send: MAX_HEADER_BYTES plus CHUNK_FRAMING_BYTES a chunk, less what it has sent;
        negative past the bound."""
        return MAX_HEADER_BYTES + self._chunks * CHUNK_FRAMING_BYTES - (self._framing - len(self._body))

    def _framing_check(self) -> None:
        """Answer 431 and close if the bytes read since the head's end that are not body
        data (a chunked body's size lines, extensions, CRLFs and trailer section) pass
        MAX_HEADER_BYTES plus CHUNK_FRAMING_BYTES a chunk. httptools keeps parsing an
        unfinished chunk line or trailer line without calling back: raw bytes count.
        (The feed that ends a head is counted as head, and a request whose head ends within
        a feed is counted from the next: at most one read more.)"""
        if self._framing_room() < 0:
            framing = self._framing - len(self._body)
            self._answer_and_close(431, b"chunked body framing (size lines, extensions, trailer section) of %d bytes: "
                                   b"more than %d plus %d a chunk" % (framing, MAX_HEADER_BYTES, CHUNK_FRAMING_BYTES))

    def _hold(self, held: int) -> None:
        """Count `held` bytes of the unfinished head or body in the broker's `Incoming`; past
        max_incoming_bytes, drop it and answer 503 (then close, lingering)."""
        incoming = self._fe.incoming
        if incoming.hold(self._incoming, held):
            self._incoming = held
            return
        incoming.refuse(self._incoming)
        self._incoming = 0
        self._body = b""
        self._skip = True
        if not self._closing:
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
            elif self._content_length > 0 and not self._transfer_encoding:
                stop = start + max(1, self._content_length - len(self._body))
            self._parse(view[start:stop])
            start = stop
            if self._closing or self._transport is None:
                return
            if start < end and self.requests > routed and (
                self.requests - routed >= REQUESTS_PER_TURN or start >= TURN_REQUEST_BYTES or _perf() > deadline
                or len(self._responses) > PIPELINE_HIGH  # (round 34: else one read's 3000 filled the queue)
            ):
                forced = not self._fe.keep_backlog(self, data[start:])
                self._pause()
                if forced or not self._write_paused:  # else `resume_writing` schedules it
                    self._schedule_turn(_perf() - deadline + TURN_SECONDS)
                return
            size = FEED_BYTES if self.requests != before else size * 2

    def _schedule_turn(self, spent: float = 0.0, held: int = 0) -> None:
        """Call `_next_turn` in the loop's next iteration (or the slow lane's: the turn
        took `spent` s, `Listener.next_turn`), unless it is due already: the answers that
        each let it go on (`_flush_ready`) must not each add a turn (one connection's turns
        per iteration stay one)."""
        if not self._turn_due:
            self._turn_due = True
            self._fe.next_turn(self, self._next_turn, spent, held)

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
        if not self._closing:
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
        if self.request_started:
            self.request_started = 0.0
            self._body = b""
            if self._incoming:
                self._fe.incoming.hold(self._incoming, 0)
                self._incoming = 0
            self._fe.recount()  # (`HttpFrontend.held` waits for a request under way no more)
        if self._unread:  # draining, still reading what came before the stop: nothing more comes
            self._unread = 0
            self._fe.unread.discard(self)
            self._fe.recount()
        return bool(self._responses)

    def _serve_upgrade(self, rest: bytes) -> None:
        """An `Upgrade` request (h2c, websocket): answer it as plain HTTP/1.1 and
        close, as nginx does. httptools stops at the end of its head: its body, if
        any (in `rest` and the reads to come), is read by a second parser that gets
        the same framing (Content-Length or Transfer-Encoding) and nothing else."""
        if self._upgrade is None or self._closing:
            if not self._closing:
                self._answer_and_close(400, b"upgrade not supported")
            return
        self._head_done = True  # the body is not head: no 431 for its bytes
        self._framing = 0  # (counted from the next read: `rest` went to the new parser)
        framing = b""
        if self._transfer_encoding:
            framing = b"transfer-encoding: " + self._transfer_encoding + b"\r\n"
        elif self._content_length >= 0:
            framing = b"content-length: %d\r\n" % self._content_length
        # The same HTTP version: `_refused` reads it from the parser (no Host is fine on 1.0).
        version = self._parser.get_http_version().encode()
        self._parser = httptools.HttpRequestParser(_UpgradeBody(self))
        try:
            self._parser.feed_data(b"POST / HTTP/" + version + b"\r\n" + framing + b"\r\n" + rest)
        except httptools.HttpParserError as exc:  # later reads: data_received has the same
            if not self._closing:
                self._answer_and_close(400, f"bad HTTP request: {exc}".encode())

    def upgrade_body_complete(self) -> None:
        """The Upgrade request's body is all in: answer it once, then close."""
        pending, self._upgrade = self._upgrade, None
        if self._framing > MAX_HEADER_BYTES and not self._closing:
            self._framing_check()  # (as `on_message_complete` does)
        if pending is None or self._skip or self._closing:
            return
        self.request_started = 0.0
        method, url = pending
        self._linger = True  # (as `_refuse_expected`: what the client sends after it is discarded)
        self._route(method, url, False)
        self._closing = True
        self._discarding()

    def pause_writing(self) -> None:
        self._write_paused = True
        self.send_stalled = self._fe.loop.time()
        self._pause()

    def resume_writing(self) -> None:
        self._write_paused = False
        self.send_stalled = 0.0
        # (only if it still has requests under way, read or not: round 28, set once it was owed
        # nothing, it held the client's next burst one at a time)
        self._one_by_one = fell_behind(self._budget.parked, self._fe.max_response_bytes) and bool(
            self._responses or self._backlog or (self._transport is not None and unread_bytes(self._transport))
        )
        self._budget.drained()
        if self._waiting:
            self._dispatch_waiting()
        if self._responses:
            self._flush_ready()
        if self._backlog:
            self._schedule_turn()
        self._maybe_resume()

    # -- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.request_started = self.last_active = self._read_at  # (data_received is running)
        self._content_length = -1
        self._transfer_encoding = b""
        self._url = b""
        self._body = b""
        self._header_bytes = 0
        self._headers = 0
        self._expect = False
        self._skip = False
        self._chunks = 0
        self._host = self._origin = self._content_type = None

    def on_url(self, url: bytes) -> None:
        if not self._url:  # the request line's method, spaces, version and CRLF count too (round 30)
            self._header_bytes += len(self._parser.get_method()) + _REQUEST_LINE_REST
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._answer_and_close(431, b"request line and headers too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        # The whole line counts: name, value, ": " and CRLF (20,000 fields of "X: a" are
        # 120 KB of head, not 40 KB); and so does the number of fields. Trailer fields
        # (after a chunked body) count on with the head's.
        self._header_bytes += len(name) + len(value) + 4
        self._headers += 1
        if self._header_bytes > MAX_HEADER_BYTES:
            self._answer_and_close(431, b"request line and headers too large")
            return
        if self._headers > MAX_HEADERS:
            self._answer_and_close(431, b"too many header fields (limit %d)" % MAX_HEADERS)
            return
        if self._head_done:
            return  # a trailer field: never merged into the header section (RFC 9110 6.5.1)
        n = len(name)
        if n == 14 and name.lower() == b"content-length":
            try:
                size = int(value)
            except ValueError:
                return  # httptools rejects it
            self._content_length = size
            if size > self._fe.max_body_bytes:
                self._skip = True
        # (The usual spelling is tried first: bytes.lower() costs more than the compare.)
        elif n == 4 and (name == b"Host" or name.lower() == b"host"):
            if self._host is not None:
                self._answer_and_close(400, b"more than one Host header (RFC 9112 3.2)")
                return
            self._host = value
        elif n == 12 and (name == b"Content-Type" or name.lower() == b"content-type"):
            ct = self._content_type  # two: not JSON, 415 (a coded body's 415 says why: `_CODED`)
            self._content_type = value if ct is None else ct if ct is _CODED else b""
        elif n == 16 and name.lower() == b"content-encoding" and not is_identity(value):
            self._content_type = _CODED  # (round 34: a gzip body got 400 -32700, a plain one labelled gzip ran)
        elif n == 6:
            name = name.lower()
            if name == b"origin":  # (two: none allowed, 403; the last was checked, hostile testing)
                # (its trailing whitespace is no part of it, RFC 9110 5.5: round 86, refused, as Host is not)
                self._origin = value.rstrip(b" \t") if self._origin is None else b""
            elif name == b"expect" and value.lower() == b"100-continue":
                self._expect = True
        elif n == 17 and name.lower() == b"transfer-encoding":
            # all of them, as one list (RFC 9110 5.3): checked in on_headers_complete
            te = self._transfer_encoding
            self._transfer_encoding = value if not te else te + b", " + value

    def on_headers_complete(self) -> None:
        self._head_done = True
        self._framing = 0
        if self._closing:
            return
        if self._url[:1] != b"/":
            self._absolute_form()
        if self._skip:
            self._refuse_body()
            return
        if self._transfer_encoding and b"," in self._transfer_encoding:
            # httptools takes "identity, chunked" as chunked; chunked is the only coding
            # served, once (RFC 9112 6.1): any list is refused, as nginx does.
            self._answer_and_close(400, b"unsupported Transfer-Encoding: use chunked alone")
            return
        if self._expect and not self._responses:
            # 100 only when nothing is owed before it, and never to HTTP/1.0; a request
            # about to be refused gets its final status now instead (RFC 9110 10.1.1: one
            # or the other; hostile testing, round 27: neither came until the body had,
            # and a client that waits for the 100 got 408 after request_timeout).
            if self._will_serve_rpc():
                assert self._transport is not None
                self._fe.sent_bytes += len(CONTINUE)
                self.sent += len(CONTINUE)
                self._transport.write(CONTINUE)
            elif self._parser.get_http_version() == "1.1":  # (an Upgrade one too: round 28)
                self._refuse_expected()

    def _refuse_expected(self) -> None:
        """Answer a request that expects 100-continue and will not be served (404, 405,
        415, 421, 403, 503) before its body: routed with no body, then closed, lingering,
        its body discarded as it comes (as a 413's)."""
        self.request_started = 0.0
        self._linger = True  # (before the answer is written: it half-closes, and the body the
        # client may send all the same is discarded; closed at once, that body reset the
        # connection and cut an answer still on its way: round 28)
        self._route(self._parser.get_method(), self._url.partition(b"?")[0], False)
        self._skip = True
        self._closing = True
        self._discarding()

    def _absolute_form(self) -> None:
        """An absolute-form target (`POST http://host:port/path HTTP/1.1`, RFC 9112 3.2.2):
        its path is the URL, its authority replaces the Host header (which the server
        must then ignore) and is checked exactly as a Host value is (`host_allowed`): an
        empty or odd port, userinfo, an empty authority get the same answer in either
        place. Other forms (`*`, authority-form, other schemes) are left as they are: 404."""
        scheme, sep, rest = self._url.partition(b"://")
        if not sep or scheme.lower() not in (b"http", b"https"):
            return
        end = len(rest)
        for delimiter in b"/?":  # the authority ends at the path or the query (RFC 3986 3.2)
            i = rest.find(delimiter, 0, end)
            if i >= 0:
                end = i
        self._host = rest[:end]
        path = rest[end:]
        self._url = path if path[:1] == b"/" else b"/" + path

    def _may_call(self) -> bool:
        """Whether the request whose head came passes the checks of who may call: JSON,
        an allowed Host, no Origin or an allowed one (`_refused`)."""
        fe = self._fe
        host, origin = self._host, self._origin
        return (
            is_json(self._content_type)
            and (  # (no Host: allowed on HTTP/1.0, as `_refused` has it; round 28)
                fe.hosts is None or self._parser.get_http_version() != "1.1" if host is None else fe.host_allowed(host)
            )
            and (origin is None or fe.cors_headers(origin) is not None)
        )

    def _will_serve_rpc(self) -> bool:
        """Whether the request whose head just came will be served as a JSON-RPC call,
        not refused (404, 405, 415, 421, 403, 503, 505): the test of `_route` and `_refused`,
        on HTTP/1.1 only (no 100 to an HTTP/1.0 client, RFC 9110 10.1.1)."""
        return (
            not self._probe_only
            and self._parser.get_http_version() == "1.1"
            and self._parser.get_method() == b"POST"
            and self._url.partition(b"?")[0] == self._fe.rpc_path
            and self._may_call()
        )

    def on_chunk_header(self) -> None:
        # A chunk's size line: its data comes next (on_body), or, after the last (0)
        # chunk, the trailer section. (Its bytes are counted by `_framing_check`.)
        chunks = self._chunks = self._chunks + 1
        if (chunks - SMALL_CHUNKS) * MIN_CHUNK_BYTES > len(self._body) and not self._closing:
            self._answer_and_close(400, b"chunked body in %d chunks for %d bytes: more than %d plus one per %d bytes" % (
                chunks, len(self._body), SMALL_CHUNKS, MIN_CHUNK_BYTES))
            raise _StopParsing  # httptools stops this feed (HttpParserCallbackError): _parse

    def on_body(self, body: bytes) -> None:
        if self._skip or self._closing:
            return
        buf = self._body
        if len(buf) + len(body) > self._fe.max_body_bytes:
            self._skip = True
            self._body = b""
            self._refuse_body()
            return
        if not buf:
            self._body = body
        else:
            if type(buf) is bytes:
                buf = self._body = bytearray(buf)
            buf += body

    def on_message_complete(self) -> None:
        if self._framing > MAX_HEADER_BYTES and not self._closing:  # (0 unless the body came in reads of its own)
            self._framing_check()  # with the piece it ends in (`_parse_bounded`): the feed's check would be too late
        self._head_done = False
        self._head_bytes = 0
        self._framing = -1
        if self._skip or self._closing:
            self.request_started = 0.0
            self._body = b""
            self._fe.recount()  # (the drain waits for requests under way: `HttpFrontend.held`)
            return
        version = self._parser.get_http_version()
        if version != "1.1" and version != "1.0":  # (checked here, once per request: it costs)
            self._answer_and_close(505, b"HTTP/%s not supported: use HTTP/1.1" % version.encode())
            return
        method = self._parser.get_method()
        url = self._url
        if b"?" in url:
            url = url.partition(b"?")[0]
        if self._parser.should_upgrade():  # answered once its body is in: see _serve_upgrade
            self._upgrade = (method, url)
            return
        self.request_started = 0.0
        # (While draining too: a connection busy at the stop serves every request it has,
        # pipelined or still arriving, and closes at its first idle moment, its last answer
        # saying so (`_write`); closing after the next answer dropped the rest of a read,
        # hostile testing, round 7.)
        keep_alive = self._parser.should_keep_alive()
        if keep_alive and version == "1.0":
            if self._transfer_encoding:  # its framing is to be treated as faulty: answered, then closed (RFC 9112 6.1)
                keep_alive = False
            elif not self._keep_header:
                self._keep_header = KEEP_ALIVE  # HTTP/1.0 closes unless the answer says so (RFC 9112 9.3)
        self._route(method, url, keep_alive)
        if self._body:  # a body no route took (a GET's, a 404's, a refused call's): not kept
            self._body = b""  # (nor counted in `Incoming`) while the connection idles
        if not keep_alive:
            self._closing = True
        if self._fe.draining:  # it may have been under way at the stop (`HttpFrontend.held`); now routed
            self._fe.recount()

    def _route(self, method: bytes, url: bytes, keep_alive: bool) -> None:
        fe = self._fe
        self.requests += 1
        head = method == b"HEAD"
        if url == fe.rpc_path and not self._probe_only:
            host = self._host
            if (
                method == b"POST" and self._origin is None
                and (self._content_type == JSON_TYPE or is_json(self._content_type))
                and (host in fe.good_hosts or (host is not None and fe.host_allowed(host)))
            ):  # fmt: skip
                self._rpc(keep_alive)  # the common case: one test, no call
            elif not self._refused(True, keep_alive, head):
                cors = b"" if self._origin is None else typing.cast(bytes, fe.cors_headers(self._origin))
                if method == b"OPTIONS" and cors:  # a CORS preflight (Fetch standard 3.2.2)
                    extra = self._keep_header if keep_alive else CLOSE
                    self._queue(STATUS_LINES[204] + fe.date + cors + PREFLIGHT + extra + b"\r\n", keep_alive, "rpc")
                elif method != b"POST":
                    self._queue_plain(405, b"use POST for JSON-RPC", keep_alive, "rpc", b"allow: POST\r\n", head)
                elif self._content_type is _CODED:  # (RFC 9110 15.5.16: 415, Accept-Encoding saying what is)
                    self._queue_invalid(415, "Content-Encoding is not supported: send the body as it is (identity)",
                                        keep_alive, "rpc", cors + b"accept-encoding: identity\r\n")
                elif not is_json(self._content_type):
                    self._queue_invalid(415, "Content-Type must be application/json (its charset, if given, utf-8)",
                                        keep_alive, "rpc", cors)
                else:
                    self._rpc(keep_alive, cors)
            return
        path = self._path_of(url)
        if self._probe_only and url not in _PROBE_PATHS:
            fe.refused()
            self._closing = True
            self._queue(json_response(503, TOO_MANY_BODY, False, b"", fe.json_head), False, path)
        elif url == b"/healthz" or url == b"/readyz":
            if method == b"GET" or head:
                ok = url == b"/healthz" or fe.ready()
                body = b'{"status":"ok"}' if ok else (
                    b'{"status":"stopping"}' if not fe.dispatcher.accepting else b'{"status":"no worker ready"}'
                    if not fe.dispatcher.ready_workers else b'{"status":"no worker answering"}'
                )
                response = json_response(
                    200 if ok else 503, body, keep_alive, self._keep_header if keep_alive else b"", fe.json_head
                )
                if head:
                    response = response[: len(response) - len(body)]
                self._queue(response, keep_alive, path)
            else:
                self._queue_plain(405, b"use GET", keep_alive, path, b"allow: GET, HEAD\r\n", head)
        elif url == b"/metrics" and fe.metrics is not None:
            if self._refused(False, keep_alive, head):
                pass
            elif head:  # the headers of the GET answer, with no body: none is made (RFC 9110 9.3.2)
                extra = self._keep_header if keep_alive else CLOSE
                self._queue(STATUS_LINES[200] + fe.date + METRICS_TYPE + extra + b"\r\n", keep_alive, path)
            elif method == b"GET":
                scrape = _Scrape(keep_alive, fe.scrape_builds + 1)  # (any build made from now on)
                answer = None
                if not self._responses and not self._write_paused:
                    answer = fe.scrape_answer(scrape.build, self._keep_header if keep_alive else CLOSE)
                if answer is not None:
                    self._scraped = fe.scrape_builds
                    self._write(answer, keep_alive, path)
                else:
                    # A scrape is large (tens of KiB, ms of CPU): builds are paced for the whole
                    # listener, and a connection takes one copy of each; reading waits meanwhile.
                    self._responses.append(scrape)
                    self._pause()
                    if len(self._responses) == 1 and not self._write_paused:
                        fe.wait_scrape(self)  # (due now: else _flush_ready comes to it)
                if self._probe_only and self in fe.probe_overflow:
                    self._claim_place()
            else:
                self._queue_plain(405, b"use GET", keep_alive, path, b"allow: GET, HEAD\r\n", head)
        else:
            self._queue_plain(404, b"not found", keep_alive, path, b"", head)

    def _path_of(self, url: bytes) -> str:
        """The `path` label of an answer to `url` (query string removed): one of `PATHS`."""
        return "rpc" if url == self._fe.rpc_path else _PATH_OF_URL.get(url, "other")

    def _refused(self, rpc: bool, keep_alive: bool, head: bool) -> bool:
        """Answer a request for rpc_path (`rpc`) or /metrics that comes from where it may
        not: 400 with no Host on HTTP/1.1, 421 for a Host not allowed, 403 for an Origin
        not allowed (see the module docstring). Return True if it was answered."""
        fe = self._fe
        host, origin = self._host, self._origin
        if host is None:
            if fe.hosts is None or self._parser.get_http_version() != "1.1":
                status, reason, value = 0, "", b""
            else:
                status, reason, value = 400, "Host header required (RFC 9112 3.2)", b""
        elif not fe.host_allowed(host):
            status, reason, value = 421, "Host not in allowed_hosts", host
        else:
            status, reason, value = 0, "", b""
        if not status and origin is not None and fe.cors_headers(origin) is None:
            status, reason, value = 403, "Origin not in allowed_origins", origin
        if not status:
            return False
        if rpc and not head:
            # (what was sent, cut at 200 bytes: each byte past 0x7f is 2 in UTF-8, and a
            # 30 KB Host would make an answer twice its request)
            shown = value[:200].decode("latin-1") + ("..." if len(value) > 200 else "")
            data = f"{reason}: {shown}" if value else reason
            self._queue_invalid(status, data, keep_alive, "rpc")
        else:
            self._queue_plain(status, reason.encode(), keep_alive, "rpc" if rpc else "metrics", b"", head)
        return True

    # -- answering ---------------------------------------------------------------------

    def _gated(self) -> bool:
        """Whether a request's body must wait before it is dispatched: the client is not
        taking its answers (the write buffer is above its high-water mark), or the
        answers it is owed and has not taken reach max_response_bytes. Then what it is
        owed is bounded by that, whatever it pipelines (aiohttp and uvicorn stop reading
        requests while a client does not read; nginx's proxy_buffers bound a response)."""
        return self._write_paused or self._budget.held >= self._fe.max_response_bytes

    def _rpc(self, keep_alive: bool, cors: bytes = b"") -> None:
        body = self._body
        if not body and self._content_length < 0 and not self._transfer_encoding:
            # No framing, so no body (RFC 9112 6.3): 411 says what is missing (RFC 9110 15.5.12;
            # hostile testing, round 77: `curl -X POST` with no data got a bare -32700).
            self._queue_invalid(411, "no body: send the request with Content-Length (or Transfer-Encoding: "
                                "chunked)", keep_alive, "rpc", cors)
            return
        self._body = b""
        fe = self._fe
        # (_gated, inlined. With nothing owed, the write buffer below its high mark and the
        # client not behind, it is open: `held` counts what is owed, or parked while the
        # buffer is full.)
        if (self._responses or self._write_paused or self._one_by_one) and (
            self._write_paused or self._waiting or self._one_by_one
            or self._budget.held >= fe.max_response_bytes
            or len(self._responses) > PIPELINE_HIGH  # (round 35: a backlog kept past max_incoming_bytes,
        ):  # fmt: skip  # whose turn comes whatever is owed, dispatched 235 to 396 calls of one connection)
            # Its body is kept: counted in max_incoming_bytes until it is dispatched, else
            # refused (hostile testing, round 11: 300 connections each owing a slow call
            # and then sending a 1 MiB body held 322 MiB counted nowhere).
            if not fe.incoming.hold(0, len(body)):
                fe.incoming.refuse(0)
                fe.dispatcher.count_refused_body(ErrorCode.OVERLOADED)
                extra = (self._keep_header if keep_alive else b"") + cors
                self._queue(json_response(503, fe.incoming_full_body, keep_alive, extra, fe.json_head), keep_alive, "rpc")
                return
            self._waiting_bytes += len(body)
            deferred = _Deferred(body, keep_alive, cors)
            self._waiting.append(deferred)
            self._responses.append(deferred)
            self._pause()
            if not self._gated():
                fe.loop.call_soon(self._dispatch_waiting)
            return
        decoded = fe.codec.decode(body)
        # (while draining, a request completed now was under way at the stop: `held`)
        submit = fe.dispatcher.submit_held if fe.draining else fe.dispatcher.submit
        exchange = submit(decoded, self._exchange_done, self._budget)
        if exchange is None:
            extra = self._keep_header if keep_alive else CLOSE
            self._queue(STATUS_LINES[204] + fe.date + cors + extra + b"\r\n", keep_alive, "rpc")
            return
        # Read back by _answer: keep_alive, or (keep_alive, CORS headers) for a cross-origin call
        exchange.context = (keep_alive, cors) if cors else keep_alive
        if exchange.remaining == 0 and not self._responses:
            if cors:
                data, keep_alive = self._answer(exchange)
                self._write(data, keep_alive, "rpc")
                self._budget.written(exchange, self._write_paused)
            else:
                extra = self._keep_header if keep_alive else b""
                self._write(json_response(exchange.status, exchange.body(), keep_alive, extra, fe.json_head), keep_alive, "rpc")
                self._budget.written(exchange, self._write_paused)
            return
        self._responses.append(exchange)
        if len(self._responses) > PIPELINE_HIGH:
            self._pause()
        elif exchange.remaining == 0:
            self._flush_ready()

    def _exchange_done(self, exchange: Exchange) -> None:
        if self._transport is None:
            return
        responses = self._responses
        if responses and responses[0] is exchange:
            if len(responses) == 1 and not self.read_paused:  # the common case: nothing else owed
                responses.popleft()
                keep_alive = exchange.context
                if type(keep_alive) is bool:  # no CORS headers: _answer inlined, for speed
                    extra = self._keep_header if keep_alive else b""
                    self._write(
                        json_response(exchange.status, exchange.body(), keep_alive, extra, self._fe.json_head),
                        keep_alive, "rpc",
                    )  # fmt: skip
                    if self._write_paused:  # (ResponseBudget.written, inlined)
                        self._budget.parked += exchange.size
                    else:
                        self._budget.held -= exchange.size
                        self._budget.outgoing.held -= exchange.size
                else:
                    data, keep_alive = self._answer(exchange)
                    self._write(data, keep_alive, "rpc")
            else:
                self._flush_ready()

    def _answer(self, exchange: Exchange) -> tuple[bytes, bool]:
        """The HTTP response to a finished exchange, and whether the connection stays
        open. The caller writes it, then calls `ResponseBudget.written`."""
        context = exchange.context
        if type(context) is tuple:  # an allowed cross-origin call: (keep_alive, CORS headers)
            keep_alive, extra = context
        else:
            keep_alive, extra = bool(context), b""
        if keep_alive:
            extra += self._keep_header
        return json_response(exchange.status, exchange.body(), keep_alive, extra, self._fe.json_head), keep_alive

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
            exchange = fe.dispatcher.submit_held(fe.codec.decode(body), self._deferred_done, self._budget)
            if exchange is None:
                extra = self._keep_header if deferred.keep_alive else CLOSE
                deferred.response = STATUS_LINES[204] + fe.date + deferred.cors + extra + b"\r\n"
            else:
                exchange.context = (deferred.keep_alive, deferred.cors) if deferred.cors else deferred.keep_alive
                deferred.exchange = busy = self._busy = exchange
        if self._transport is not None:
            self._flush_ready()  # (an exchange complete at once is not called back)
            self._maybe_resume()
        fe.recount()  # (the drain waits for what `_waiting` held)

    def _deferred_done(self, exchange: Exchange) -> None:
        if self._transport is not None:
            self._flush_ready()

    def scrape_built(self) -> None:
        """The build this connection's next answer waits for is made (`HttpFrontend._scrape_due`)."""
        transport = self._transport
        if transport is not None and self._responses and not transport.is_closing():
            self._flush_ready()

    def _flush_ready(self) -> None:
        if self._parsing and self._fe.draining:
            return  # (at the end of the read's parse: `_write` holds back a last answer till then)
        responses = self._responses
        taken = False  # an RPC answer written with the buffer not full after it: the client keeps up
        while responses:
            head = responses[0]
            if type(head) is tuple:
                data, keep_alive, path = head
            elif type(head) is _Scrape:
                if self._write_paused:
                    break  # resume_writing comes back here
                keep_alive = head.keep_alive
                fe = self._fe
                answer = fe.scrape_answer(max(head.build, self._scraped + 1), self._keep_header if keep_alive else CLOSE)
                if answer is None:
                    fe.wait_scrape(self)  # the next build comes back here
                    break
                self._scraped = fe.scrape_builds
                data = answer
                path = "metrics"
            else:
                if type(head) is _Deferred:
                    if head.response:  # dispatched: only notifications
                        responses.popleft()
                        self._write(head.response, head.keep_alive, "rpc")
                        if self._transport is None:
                            return
                        continue
                    if head.exchange is None:  # not dispatched yet
                        break
                    exchange = head.exchange
                else:
                    exchange = typing.cast(Exchange, head)
                if exchange.remaining:
                    break
                data, keep_alive = self._answer(exchange)
                responses.popleft()
                self._write(data, keep_alive, "rpc")
                self._budget.written(exchange, self._write_paused)
                taken = not self._write_paused
                if self._transport is None:
                    return
                continue
            responses.popleft()
            self._write(data, keep_alive, path)
            if type(head) is tuple:  # (not a scrape's answer: shared by the connections, not held)
                self._budget.release(len(data), self._write_paused)
            if self._transport is None:
                return
        busy = self._busy
        if busy is not None and not busy.remaining:
            # Done: not kept (hostile testing, round 15: kept with its answer after it
            # was written, 50 idle connections held 3 MB counted nowhere).
            self._busy = busy = None
        if self._waiting and not self._gated() and busy is None:
            # (not from inside the dispatcher's callback; and not while the one dispatched
            # last runs: its answer comes back here. Hostile testing, round 14: scheduled
            # each loop turn meanwhile, a core spun for as long as that call ran)
            self._fe.loop.call_soon(self._dispatch_waiting)
        elif not responses or taken:  # (owed nothing, or took an answer at once: round 27, not merely
            self._one_by_one = False  # "not paused now", which it always is after resume_writing)
        if len(responses) < PIPELINE_LOW:
            if self._backlog and not self._write_paused:
                self._schedule_turn()  # (held by what was owed: `_feed_turn`)
            elif self.read_paused:
                self._maybe_resume()

    def _write(self, data: bytes, keep_alive: bool, path: str) -> None:
        """Write one response; `path` is its label in the statuses counter (`PATHS`)."""
        transport = self._transport
        if transport is None:
            return
        fe = self._fe
        if (
            keep_alive and fe.draining and not self._responses and not self.request_started and not self._backlog
            and not self._unread  # (bytes received before the stop still to be read: not the last answer)
        ):  # fmt: skip
            if self._parsing:  # more requests may follow in this read: decided once it is parsed
                self._responses.append((data, keep_alive, path))
                self._budget.hold(len(data))
                return
            # The last answer before the stop closes the connection: say so (RFC 9112 9.6),
            # or a client pool would send its next request on it, to be discarded (hostile
            # testing: http.client's next POST got RemoteDisconnected, ran or not)
            data, keep_alive = self._closing_form(data), False
        transport.write(data)
        fe.sent_bytes += len(data)
        self.sent += len(data)
        counts = fe.statuses[path]  # by path, then status: no tuple per answer
        status = data[9:12]
        counts[status] = counts.get(status, 0) + 1
        self.last_active = fe.loop.time()  # idle time counts from the last answer
        if not keep_alive:
            self._closing = True
            self._responses.clear()
            self._drop_unfinished()
            fe.recount()  # (a request under way it was answered early is not waited for: `held`)
            if (self._linger or fe.draining) and not self._eof and not self._probe_only and transport.can_write_eof():
                # An answer before the request was read: closing now would reset the
                # connection under a client still sending, and it would never see the
                # answer. Half-close and keep discarding its bytes (nginx's lingering
                # close); the client closes, or the sweep does after LINGER_TIMEOUT
                # silent or LINGER_TIME in all; make_room may close it sooner. (The
                # probes' reserve is not held that long: closed at once.)
                transport.write_eof()
                self.lingering_since = self.last_active
                # Read on, discarding, even while the answers before it still leave (reading
                # was paused for them): a client still sending was left unread, looked
                # silent, and was closed with its bytes unread, a reset that cut the answer
                # it was taking at 400 KB/s (hostile testing, round 23).
                self._discarding()
            else:
                transport.close()
        elif self._eof and not self._responses and not self.request_started and not self._backlog:
            transport.close()

    def _closing_form(self, response: bytes) -> bytes:
        """`response` (a keep-alive answer: status line, headers, body) saying
        `connection: close` instead."""
        head, _, body = response.partition(b"\r\n\r\n")
        if self._keep_header:  # (HTTP/1.0: "connection: keep-alive")
            head = head.replace(b"\r\n" + self._keep_header[:-2], b"")
        return head + b"\r\n" + CLOSE + b"\r\n" + body

    def stop_close(self) -> None:
        """Close for the broker's stop. Requests may still be on their way unread
        (pipelined, or in the kernel while reading was paused), and a close with bytes
        unread resets the connection (RST), which drops the answers its client has not
        taken yet. So half-close after what is written, and read on, discarding, as a
        lingering close does: the client reads to the end, then closes."""
        transport = self._transport
        if transport is None:
            return
        if self._eof or not transport.can_write_eof():
            transport.close()
            return
        self._closing = True
        transport.write_eof()
        self.lingering_since = self.last_active
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()

    def _drop_unfinished(self) -> None:
        """The connection closes after an answer: what an unfinished request holds (its
        body, counted in max_incoming_bytes) goes now, not when the answer is written nor
        when the lingering close ends (hostile testing, round 9: 900 kB of a body answered
        400 or 408 stayed held for the 30 s of its linger; round 10: for as long as a slow
        call it waited behind)."""
        self._body = b""
        if self._incoming:
            self._fe.incoming.hold(self._incoming, 0)
            self._incoming = 0

    def _queue(self, response: bytes, keep_alive: bool, path: str) -> None:
        """Write a finished response now, or after those owed before it: then it counts in
        the connection's `ResponseBudget` (and max_outgoing_bytes) until written, and
        reading pauses past PIPELINE_HIGH owed, as for calls (hostile testing, round 9:
        1000 connections each owing a slow call, then pipelining requests answered 421
        behind it and never reading, held 500 MB counted nowhere)."""
        if not self._responses:
            self._write(response, keep_alive, path)
        else:
            self._responses.append((response, keep_alive, path))
            self._budget.hold(len(response))
            if not keep_alive:  # (an early answer: 400, 413, 431...)
                self._drop_unfinished()
            if len(self._responses) > PIPELINE_HIGH:
                self._pause()

    def _queue_plain(
        self, status: int, message: bytes, keep_alive: bool, path: str, extra: bytes = b"", head: bool = False
    ) -> None:
        body = b'{"error":"' + message + b'"}'
        if keep_alive:
            extra += self._keep_header
        response = json_response(status, body, keep_alive, extra, self._fe.json_head)
        if head:  # a HEAD answer has the headers of the GET answer and no body (RFC 9110 9.3.2)
            response = response[: len(response) - len(body)]
        self._queue(response, keep_alive, path)

    def _queue_invalid(self, status: int, data: str, keep_alive: bool, path: str, cors: bytes = b"") -> None:
        """Queue an Invalid Request error object (id null) whose `data` says why, as `status`;
        `path` is its label in the statuses counter (`PATHS`); `cors`: the CORS headers of an
        allowed Origin (round 34: a 415 to one had none, and the page could not read why)."""
        body = error_body(ErrorCode.INVALID_REQUEST, data)
        extra = (self._keep_header if keep_alive else b"") + cors
        self._queue(json_response(status, body, keep_alive, extra, self._fe.json_head), keep_alive, path)

    def _answer_and_close(self, status: int, message: bytes) -> None:
        """Answer an unreadable request and close (lingering: it may still be sending)."""
        self._closing = True
        self._linger = True
        self.request_started = 0.0
        self._queue_plain(status, message.replace(b'"', b"'"), False, "other", head=self._head_request())
        self._discarding()

    def _head_request(self) -> bool:
        """Whether the request under way is a HEAD, its request line read: its answer has
        no content, even an error's (RFC 9110 9.3.2; hostile testing, round 30: a 413, 505
        or 400 that closed the connection had one)."""
        return bool(self._url) and self._parser.get_method() == b"HEAD"

    def _discarding(self) -> None:
        """Its input is discarded from now on (`_closing`): read on, never paused again, so
        that a client blocked mid-send (a refused body it goes on uploading) can take the
        answers owed before it; paused, it took none, and send_timeout reset it, cutting
        them (hostile testing, round 24: an answer of 8 MB cut at 128 kB)."""
        if self.read_paused and self._transport is not None:
            self.read_paused = False
            self._transport.resume_reading()

    def _refuse_body(self, status: int = 413, body: bytes | None = None, code: int = ErrorCode.INVALID_REQUEST) -> None:
        """`status` with the error response `body` (413: past max_body_bytes; 503: past
        max_incoming_bytes) before the rest of the body is read, then close (lingering);
        counted as an answer `code`. To a path other than rpc_path, a plain error."""
        fe = self._fe
        self._linger = True
        self.request_started = 0.0
        path = self._path_of(self._url.partition(b"?")[0])
        if self._head_done and path == "rpc" and self._may_call():  # (round 27: one a web page sent past
            # max_body_bytes moved the JSON-RPC counters; round 28: so did a head under way, whose path
            # is not known yet, to /healthz as well)
            cors = b"" if self._origin is None else fe.cors_headers(self._origin) or b""  # (round 34: a page
            self._queue(json_response(status, body or fe.too_large_body, False, cors, fe.json_head), False, path)
            fe.dispatcher.count_refused_body(code)  # allowed to call could not read why, as for 415)
        else:  # Not JSON-RPC: a plain error, counted by its path and status only (hostile
            # testing, round 26: a body sent to /healthz got a -32600 error object, and
            # anyone could move rpc_broker_calls_total and errors_total without JSON-RPC).
            self._queue_plain(status, fe.refused_plain[status], False, path, head=self._head_request())
        self._closing = True
        self._discarding()

    def request_timed_out(self) -> None:
        """Called by the sweep: the request under way took longer than request_timeout
        to arrive; answer 408 and close (RFC 9110 15.5.9)."""
        if self._closing:  # a request pipelined after `Connection: close`: never answered
            self.request_started = 0.0
            return
        self._answer_and_close(408, b"request not received within request_timeout %g s" % self._fe.request_timeout)

    # -- flow control ------------------------------------------------------------------

    def _pause(self) -> None:
        if not self.read_paused and self._transport is not None and not self._closing:  # (`_discarding`)
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

    def close(self) -> None:
        """Close the connection after what is already written."""
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection at once."""
        if self._transport is not None:
            self._transport.abort()
