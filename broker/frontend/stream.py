"""Newline-delimited JSON front-end: JSON-RPC over plain TCP and Unix stream sockets.

Theory of operation
-------------------
Each line a client sends is one JSON-RPC request body: a single request, a
notification or a batch (NDJSON, https://github.com/ndjson/ndjson-spec: UTF-8, one
JSON text per line, `\\n` separated, `\\r\\n` accepted). Lines are decoded
(`jsonrpc.Codec`) and handed to the dispatcher as they complete; each answer (a
response object or a batch array) is written as one line as soon as it is ready, so
a slow call does not hold back the answers of the calls after it. Answers may
therefore come in another order than the requests: clients match them by id, as
JSON-RPC 2.0 requires (the Ethereum clients' IPC sockets work the same way). A line
of only notifications is answered with nothing; blank lines are skipped.

Limits:
    a line longer than `max_body_bytes` is answered with one -32600 error (id null)
    and skipped up to its newline; the connection stays usable (unless the line
    starts as an HTTP request line: see below)
    a line that stays incomplete for `keepalive_timeout` seconds closes the
    connection (a client trickling bytes); an idle connection with nothing owed is
    left open (streams are long-lived, like an IPC socket)
    the lines of one read are handled `LINES_PER_TURN` at a time, or `TURN_LINE_BYTES`
    of them (one line at least), a loop iteration apart (reading paused meanwhile), and
    none while the write buffer is full
    reading pauses while more than `PIPELINE_HIGH` bodies wait for answers on one
    connection, or while its write buffer is full, and so do the lines of a read
    already taken (`_backlog`) until fewer than `PIPELINE_LOW` are owed; a connection whose write buffer
    stays full (its client does not read) for `send_timeout` seconds is aborted
    the answers a connection is owed and has not read stay under `max_response_bytes`
    (`answers.ResponseBudget`: results past it are answered -32603); while it is
    reached, or the client is not reading, the lines read wait undispatched in
    `_waiting`, and go one at a time once it reads (`_busy`, `_one_by_one`); a line
    left in `_backlog` goes, in its turn, to dispatch or to the end of `_waiting`
    `max_connections` per listener, as for HTTP: at the limit the least recently active
    idle connection (nothing owed, no line under way, writing not stalled, and a line
    served or none sent for `SWEEP_SECONDS`) is closed to make room
    (`Listener.make_room`); with none idle, the new connection gets one -32000 error line
    "too many connections" (id null: HTTP answers 503) and is half-closed, its input
    discarded until it closes (or for at most `REFUSED_LINGER` seconds), so a client
    that already wrote its line reads the error rather than a reset
    a line that is an HTTP request line (`POST / HTTP/1.1`) is answered with one -32600
    error saying so, and the connection closes before anything after it is read: any web
    page can make a browser POST to this port, and the body after the headers could be
    a valid call (a cross-protocol request; Redis closes on them too). A line past
    `max_body_bytes` that starts like one (`METHOD target`: a URL megabytes long) is
    closed on as soon as it is found too long, before its newline comes
    a line whose first byte is a control character (not white space) or not ASCII, which
    no JSON text starts with (but a UTF-8 byte order mark's, which RFC 8259 section 8.1
    forbids a sender: that line is answered -32700, as over HTTP, and the connection goes
    on), is answered with one -32700 error and the connection closes
    at once, as on an HTTP request line: it is another protocol, and what follows could
    hold a valid call (a browser's TLS ClientHello sent here by DNS rebinding carries
    bytes its server chose, in a session ticket: the ALPACA attack, USENIX Security 2021)

The connection's reading (lines, turns, flow control), the dispatch of its lines and the
writing of their answers are `StreamProtocol`'s, here. It inherits the rest from a mixin
with no state of its own (its attributes declared once, for the type checker, in
broker/frontend/streamstate.py: `StreamState`): its refusals (at max_connections, a line
of another protocol or never finished), its eviction for a new connection, the drain at
the stop and its lingering close, in broker/frontend/streamclose.py (`Closing`). At the
stop (SIGTERM, `StreamFrontend.drain`) a connection serves the lines it has and those its
client sent before the stop, then half-closes once it owes nothing: see there.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import typing
from collections import deque

import msgspec

from broker.answers import Exchange, ResponseBudget, forget
from broker.dispatch import Dispatcher
from broker.frontend.base import (
    LINGER_TIME,
    LINGER_TIMEOUT,
    PIPELINE_HIGH,
    PIPELINE_LOW,
    TURN_BYTES,
    Limits,
    Listener,
    discard_turn,
    is_tls,
)
from broker.frontend.mcp import Cancel, McpServer, ToolCall
from broker.frontend.mcpsessions import Session
from broker.frontend.slowlane import ADMIT_SECONDS, SMALL_READ_BYTES, TURN_SECONDS
from broker.frontend.streamclose import Closing
from broker.jsonrpc import Body, ErrorCode, Request, error_object, response_error, response_result
from broker.ratelimit import address_of
from broker.tls import certificate_name
from broker.wire import WOKE_SECONDS

Submit = typing.Callable[[Body, typing.Callable[[Exchange], None], ResponseBudget], "Exchange | None"]

if typing.TYPE_CHECKING:
    from broker.auth import Authenticator

__all__ = ["StreamFrontend", "StreamProtocol"]


_perf = time.perf_counter
LINES_PER_TURN = 16  # lines handled per callback; the rest of a read waits a loop iteration
# ... or fewer: lines of this many bytes in all end a turn too (one line at least). A line
# can be a batch of 1000 calls (about 60 KB): 16 of them, 16,000 calls decoded and routed
# in one turn, kept /healthz waiting 100-560 ms (hostile testing); bytes go as calls do.
TURN_LINE_BYTES = 64 * 1024
_HTTP_REQUEST = response_error(
    b"null", error_object(ErrorCode.INVALID_REQUEST, data="an HTTP request: this stream speaks newline-delimited JSON-RPC")
) + b"\n"
_NOT_TEXT = response_error(b"null", error_object(
    ErrorCode.PARSE_ERROR, data="not JSON text (TLS, or another protocol?): this stream speaks newline-delimited JSON-RPC"
)) + b"\n"  # fmt: skip
_NL = b"\n"
AUTHENTICATE: typing.Final = "rpc.authenticate"  # the method of a TCP stream's first line, with tokens
_BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark: RFC 8259 section 8.1, none before JSON text sent
_BLANKS = re.compile(rb"[ \t\r\n]*")
# The start of an HTTP request line (RFC 9112 3: method SP request-target; the method is
# any token, RFC 9110 5.6.2, in any case: browsers send methods other than the six they
# normalize as written, `patch` or `M-SEARCH`, hostile testing): no JSON text starts with
# a token and white space, so a line that starts so, then a request target (RFC 9112 3.2:
# origin-form `/...`, absolute-form `scheme://...`, authority-form `host:port`, `*`), is
# one, however spaced (`POST  / HTTP/1.1`, a tab, `GET /` of HTTP/0.9: servers that parse
# leniently take them, hostile testing round 8), whole or past max_body_bytes.
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_HTTP_LINE = re.compile(_TOKEN + rb"[ \t]+(?:[/*]|[A-Za-z][A-Za-z0-9+.-]*://|[^ \t]*:[0-9])")


class _Meta(msgspec.Struct):
    token: str | None = None


class _AuthParams(msgspec.Struct):
    meta: _Meta | None = msgspec.field(default=None, name="_meta")


# rpc.authenticate's token alone, the rest of its params skipped, their numbers unread: msgspec's
# reader took 1.6-1.8 s for a MiB of `1e308` on the loop, before any token (hostile testing, round 139)
_auth_params = msgspec.json.Decoder(_AuthParams).decode


class StreamFrontend(Listener):
    """Shared state of the NDJSON connections of one listener (TCP or Unix).

    transport: the `transport` label of the metrics ("tcp" or "unix").
    auth: the bearer tokens its connections must show first (`authenticate`), or None.
    client_certs: its TLS clients may show a certificate (tls_client_ca_file) whose subject
    commonName, a token's name, authenticates them as that token (with `auth` only).
    mcp: its lines are MCP messages (stdio's framing, which MCP's stdio transport says works
    over any such stream: `rpc-broker mcp-stdio`), served by `mcp.McpServer`, each
    connection a session of its own, instead of plain JSON-RPC bodies.
    """

    # At the stop, a connection that has sent nothing yet may have its first line on its way
    # (accepted from the listen queue, or just connected): it stays open for it (`Closing.drain`).
    # False where the connection was there from the start (stdio: broker/frontend/stdio.py).
    waits_for_first_line = True

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        transport: str,
        auth: Authenticator | None = None,
        client_certs: bool = False,
        mcp: bool = False,
        **limits: typing.Unpack[Limits],
    ) -> None:
        super().__init__(dispatcher, transport=transport, **limits)
        self.auth = auth
        self.mcp = McpServer(lambda: dispatcher.catalog, self.codec, limit=self.max_response_bytes) if mcp else None
        self.client_certs = client_certs and auth is not None
        self.unauthenticated = response_error(b"null", error_object(ErrorCode.INVALID_REQUEST, data=(
            'a bearer token is required: the first line must be {"jsonrpc":"2.0","method":"rpc.authenticate",'
            '"params":{"_meta":{"token":"TOKEN"}},"id":1} (a notification too), with a token of '
            "auth_tokens_file or RPC_BROKER_AUTH_TOKENS"
            + ("; or, over TLS, a client certificate whose subject commonName is a token's name"
               if self.client_certs else "")
        ))) + _NL  # fmt: skip
        self.bad_token = response_error(b"null", error_object(ErrorCode.INVALID_REQUEST, data=(
            "the bearer token is not one of auth_tokens_file's or RPC_BROKER_AUTH_TOKENS'"))) + _NL
        self.other_token = response_error(b"null", error_object(ErrorCode.INVALID_REQUEST, data=(
            "the bearer token is not the one the TLS client certificate names (its subject commonName), which "
            "authenticates this connection: a connection has one caller; send that token, or no "
            "rpc.authenticate line"))) + _NL
        self.too_long = (
            response_error(
                b"null",
                error_object(ErrorCode.INVALID_REQUEST, data=f"line exceeds max_body_bytes {self.max_body_bytes}"),
            )
            + _NL
        )
        self.line_unfinished = (
            response_error(b"null", error_object(
                ErrorCode.INVALID_REQUEST, data=f"line unfinished after keepalive_timeout {self.keepalive_timeout:g} s"))
            + _NL
        )  # fmt: skip
        self.incoming_full = (
            response_error(b"null", error_object(
                ErrorCode.OVERLOADED, data=f"lines arriving or waiting exceed max_incoming_bytes {self.incoming.limit}"))
            + _NL
        )  # fmt: skip

    def protocol(self) -> StreamProtocol:
        """Protocol factory for `loop.create_server` / `create_unix_server`."""
        self.start_sweeping()
        return StreamProtocol(self)

    def _sweep(self) -> None:
        now = self.loop.time()
        limit = self.keepalive_timeout
        for conn in list(self.connections):
            if self.send_timed_out(conn, now):
                continue  # its client does not read its answers
            if not conn.send_stalled:
                self.watch_unsent(conn, now)  # (answers the kernel holds: HTTP's `taking_answer`)
            if conn.lingering_since:  # half-closed after a refused line (HTTP's lingering close)
                if (now - conn.last_active > LINGER_TIMEOUT or now - conn.lingering_since > LINGER_TIME) and (
                    self.all_taken(conn)  # (else its answers are still leaving: send_timeout's to end)
                ):
                    conn.close()
            # (not while the broker itself has stopped reading: the rest may be waiting)
            elif conn.line_started and not conn.read_paused and now - conn.line_started > limit:
                conn.line_timed_out()  # a line trickling in, never finished

    def drain(self) -> None:
        """Connections half-close once they owe nothing and have read what their clients
        sent before the stop: the lines read already, those still in the kernel
        (`unread_bytes`: the broker had paused its reading, or not read them yet), and
        what arrives behind them meanwhile, a line under way read to its end; the drain
        waits for them (`unread`, `StreamProtocol.drain`). Lines that come later are
        discarded."""
        self.draining = True
        for conn in list(self.connections):
            conn.drain()


class StreamProtocol(Closing, asyncio.Protocol):
    """One NDJSON client connection."""

    # The connection's state, by concern (its mixin has none of its own: streamstate.py).
    __slots__ = (  # noqa: RUF023  (grouped by concern, each group sorted)
        # its listener, transport and place: the sweep's clocks, what it sent
        "accepted_at", "_fe", "last_active", "send_stalled", "sent", "taken", "_transport",
        # reading: the unfinished line, what it holds in `Incoming`, lines served
        "_buffer", "_incoming", "line_started", "lines", "_skipping",
        # turns and flow control (connection.py): a read's rest, reading and writing paused
        "_backlog", "_backlog_forced", "_backlog_held", "lane_finish", "read_paused", "_turn_bytes", "_turn_due",
        "_turn_seconds", "_write_paused",
        # answers owed (in any order) and what they may hold (`ResponseBudget`, `_waiting`)
        "_budget", "_busy", "_one_by_one", "owed", "_owed", "_waiting", "_waiting_bytes",
        # its end: refused (input discarded), the client's EOF, the linger, the drain's unread bytes
        "_eof", "lingering_since", "_refused", "_unread",
        # who calls: its token's name ("" with no tokens asked for; None until its first line shows one),
        # and the token its TLS client certificate names ("" none), its caller from its first line on
        "caller", "_certified",
        # MCP's: the connection's session (`StreamFrontend.mcp`), None on plain JSON-RPC
        "_session",
    )  # fmt: skip

    def __init__(self, frontend: StreamFrontend) -> None:
        self._fe = frontend
        self.lane_finish = 0.0  # its turns' last finish in the slow lane (`SlowLane.add`)
        self._buffer = bytearray()  # the incomplete last line
        self._incoming = 0  # its bytes, as counted in the listener's `Incoming`
        self._turn_bytes = 0  # bytes received since the last turn's pause (TURN_BYTES)
        self._turn_seconds = 0.0  # time its reads took since then (TURN_SECONDS)
        # While draining: bytes found in the kernel, received and not read yet, to be read and
        # served (`drain`, `_read_all_before_stop`); -1 once read, a line still under way; 0:
        # not reading for the drain (what comes is discarded).
        self._unread = 0
        self._backlog = b""  # the rest of a read past LINES_PER_TURN lines: reading paused until it is done
        self._backlog_held = 0  # its bytes, counted in the listener's `Incoming` (`keep_backlog`)
        self._backlog_forced = False  # kept past max_incoming_bytes: its turn comes whatever the client does
        self._turn_due = False  # a `_next_turn` is scheduled (`_schedule_turn`: one at a time)
        self._skipping = False  # inside a line past max_body_bytes: drop up to its newline
        self.caller: str | None = "" if frontend.auth is None else None  # (`_authenticate`)
        self._certified = ""  # (`connection_made`)
        self._session = Session() if frontend.mcp is not None else None
        self._transport: asyncio.Transport | None = None
        self.read_paused = False
        self._write_paused = False
        self._eof = False  # the client half-closed: close once nothing is owed
        self.line_started = 0.0  # loop time an incomplete line's first byte came; 0 if none
        self.owed = 0  # bodies dispatched and not yet answered
        self.lines = 0  # lines served (answered, owed or waiting)
        self.last_active = self.accepted_at = frontend.loop.time()  # last line received (not an empty one) or answer sent
        self.lingering_since = 0.0  # loop time of the half-close after a refused line (`_linger`); 0 if none
        self._refused = False  # turned away at max_connections, or sent an HTTP request line: its input is discarded
        self.send_stalled = 0.0  # loop time writing paused: for `Listener.send_timed_out`
        self.sent = 0  # bytes written to its transport
        self.taken = 0  # ... that its client had taken at the last look (`Listener.send_timed_out`)
        # Bytes of answers owed and not yet taken by the client (see ResponseBudget).
        self._budget = ResponseBudget(frontend.dispatcher.outgoing, frontend.dispatcher.policy.denied[""])
        self._budget.transport = frontend.transport  # ("tcp" or "unix": the access log's)
        self._waiting: deque[bytes] = deque()  # lines not dispatched yet (see _gated), in order
        self._waiting_bytes = 0  # their bytes, counted in the listener's `Incoming`
        self._owed: set[Exchange] = set()  # exchanges owed answers (`owed` of them)
        # The last line dispatched from `_waiting`: they go one at a time, each once the one
        # before is answered, so each has the whole budget (as for HTTP).
        self._busy: Exchange | None = None
        # Set when the client fell behind: its next lines all go through `_waiting`, one
        # at a time, until it is owed nothing (as for HTTP).
        self._one_by_one = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        fe = self._fe
        # (for the logs: `Dispatcher._blame`; stdio's pipes have none: "stdio", not "unix", new user, round 112)
        peer = self._budget.peer = transport.get_extra_info("peername") if fe.transport != "stdio" else "stdio"
        if fe.auth is None:  # (with tokens, its token's: `_authenticate`)
            self._budget.bucket = fe.dispatcher.limiter.for_address(address_of(peer))
        elif fe.client_certs:  # (verified in the handshake: one that did not verify ended it)
            name = certificate_name(transport.get_extra_info("peercert"))
            if fe.auth.has_name(name):  # (one naming no token: the connection shows a token, as without)
                self._certified = name
        if fe.pool_size() >= fe.max_connections and not fe.draining:
            fe.make_room()  # idle connections, if any, give their places
        if fe.pool_size() >= fe.max_connections:
            self._refuse()
            return
        fe.connections.add(self)
        if fe.draining:  # (queued before the stop: `listening._accept_queued`; hostile testing, round
            self.drain()  # 34: refused "too many connections", counted and logged as such)

    def eof_received(self) -> bool:
        """The client shut its sending side (`nc -N`, socat at the end of input): answer
        what is owed, then close. A last line without its newline ends there, as a
        file's last line does (`printf '%s' "$call" | ...` was never answered, and its
        bytes stayed counted in max_incoming_bytes until the connection closed). (Reading
        is never paused at EOF: a read's unhandled rest, `_backlog`, is handled first.)"""
        fe = self._fe
        if self._buffer and not self._skipping and not self._refused and (not fe.draining or self._unread):
            line = bytes(self._buffer)
            self._buffer.clear()
            self._fe.incoming.hold(self._incoming, 0)
            self._incoming = 0
            self.line_started = 0.0
            if len(line) - line.endswith(b"\r") > self._fe.max_body_bytes:
                self._too_long(line[:16])
            else:
                self._line(line)
        self._unread_done()  # (draining, still reading what came before the stop: nothing more comes)
        if self.owed or self._waiting or self._backlog:  # (none on a connection refused at accept)
            self._eof = True
            # keep the transport open for writing; not over TLS, whose transport ends at the
            # client's close_notify whatever this says (asyncio's), and a True there logs a
            # WARNING a connection (hostile testing, round 115, M2: a client's way to fill the log)
            return not is_tls(self._transport)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for exchange in self._owed:  # (the answers they hold go now, not when their calls end)
            forget(exchange)
        self._owed.clear()
        self._buffer.clear()  # (a partial line, up to max_body_bytes: not kept for a collector)
        self._fe.lost(self)

    def data_received(self, data: bytes) -> None:
        fe = self._fe
        now = fe.loop.time()
        if now - fe.read_at > WOKE_SECONDS:  # (several front-ends: what the workers wrote, first)
            fe.dispatcher.woke()
        fe.read_at = now
        fe.received_bytes += len(data)
        if fe.draining or self._refused:
            if not self._refused and (self._unread or self._reads_on_owing()):
                self._read_before_stop(data)
                return
            self._turn_bytes = discard_turn(self._transport, self._turn_bytes, len(data), fe.loop)  # (discarded)
            if self.lingering_since:  # (silent for LINGER_TIMEOUT, the sweep closes it)
                self.last_active = now
            return
        transport = self._transport
        if (len(data) + len(self._buffer) > SMALL_READ_BYTES and fe.slow_lane.spent > ADMIT_SECONDS  # (the hot path: one test)
                and not self.read_paused and transport is not None):
            # What its turn may decode, which the lane charges: the line it ends, else this
            # read (round 50: every read of a line charged for all of it)
            held = len(data) + (len(self._buffer) if b"\n" in data else 0)
            transport.pause_reading()
            self._hold_back(data, math.inf, held)  # (its turn is the slow lane's: `SMALL_READ_BYTES`)
            return
        turn = self._turn_bytes = self._turn_bytes + len(data)
        ours = turn > TURN_BYTES and self._turn_full()  # this read ends the turn: its next scheduled once its time is known
        lines = self.lines
        began = _perf()
        self._lines(data)
        self._turn_took(_perf() - began, ours, TURN_SECONDS, self._refused)  # (TURN_SECONDS: this module's)
        if self.lines != lines:  # empty lines, or a line still coming, are not activity:
            self.last_active = now  # they keep no connection out of reach of `make_room`

    def _lines(self, data: bytes) -> None:
        """Handle up to LINES_PER_TURN lines of `data`; leave the rest in `_backlog`, with
        reading paused, for a later loop iteration (`_next_turn`): one read of many large
        batches would otherwise hold the loop for every other connection. No turn is
        taken while the write buffer is full (`pause_writing`): a client that does not
        read gets no more answers made than fit it."""
        fe = self._fe
        start = 0
        end = len(data)
        turn = LINES_PER_TURN
        budget = TURN_LINE_BYTES
        deadline = _perf() + TURN_SECONDS
        while start < end:
            first = data[start]
            if (first <= 32 or first >= 127) and not self._buffer and not self._skipping:
                # Empty lines, and white space before a line, in one C step: no line, and
                # no turn (hostile testing: a read of b"\n" cost 1 µs a byte, a turn each).
                skip = _BLANKS.match(data, start).end()  # type: ignore[union-attr]  # (matches "")
                if skip > start:
                    start = skip
                    continue
                if not _BOM.startswith(data[start:start + 3]):  # (a BOM, or the start of one: a bad line, as on HTTP)
                    self._foreign(_NOT_TEXT, ErrorCode.PARSE_ERROR)  # a control byte, or not ASCII: no JSON text starts so
                    return
            nl = data.find(_NL, start)
            if nl < 0:
                self._partial(data, start, end)
                return
            if self._skipping:
                self._skipping = False
            elif self._buffer:
                self._buffer += data[start:nl]
                line = bytes(self._buffer)
                self._buffer.clear()
                self._fe.incoming.hold(self._incoming, 0)
                self._incoming = 0
                if line[0] >= 127 and not line.startswith(_BOM):  # (begun as a BOM might: round 70)
                    self._foreign(_NOT_TEXT, ErrorCode.PARSE_ERROR)
                    return
                if len(line) - line.endswith(b"\r") > fe.max_body_bytes:
                    self._too_long(line)
                else:
                    self._line(line)
            elif nl - start - (nl > start and data[nl - 1] == 13) > fe.max_body_bytes:
                self._too_long(data[start:start + 16])
            else:
                self._line(data[start:nl])
            self.line_started = 0.0
            budget -= nl + 1 - start
            start = nl + 1
            if self._transport is None or self._refused:
                return
            turn -= 1
            if start < end and (not turn or budget <= 0 or _perf() > deadline or self.owed > PIPELINE_HIGH):
                # (past PIPELINE_HIGH owed, the rest waits as unread bytes do: `_next_turn`
                # goes on below PIPELINE_LOW. Hostile testing, round 34: dispatched a turn
                # at a time whatever was owed, one connection's 3000 lines filled the queue.)
                self._transport.pause_reading()
                self._hold_back(data[start:], _perf() - deadline + TURN_SECONDS)
                return

    def _next_turn(self) -> None:
        """Go on with the lines of a read left in `_backlog`; reading resumes when it is done."""
        self._turn_due = False
        transport, backlog = self._transport, self._backlog
        if transport is None or not backlog or (
            (self._write_paused or self.owed > PIPELINE_HIGH) and not self._backlog_forced
        ):  # (`resume_writing`, or `_exchange_done` below PIPELINE_LOW, comes back here)
            return  # (one past max_incoming_bytes goes on: its lines wait counted, or are refused)
        self._backlog = b""
        # Out of the count at once: its lines are counted again as they wait (hostile
        # testing, round 15: counted twice meanwhile, 7 of 100 lines refused -32000).
        self._fe.backlog_done(self)
        # (also while draining: these lines came before the stop; each is answered, served
        # or "shutting down", rather than dropped)
        self._lines(backlog)  # each line to dispatch, or after the others in `_waiting`
        if not self._backlog:  # (the drain waits for a backlog: `Listener.held`)
            self._fe.recount()
            if self._unread:
                self._read_all_before_stop()
        if not self._backlog and self._transport is not None:
            if not self.read_paused:
                self._transport.resume_reading()
            else:  # (paused meanwhile: a turn's time, answers owed)
                self._maybe_resume()
            self._maybe_close()  # (the client may have half-closed after the lines)

    def _partial(self, data: bytes, start: int, end: int) -> None:
        """Keep an unfinished line (or drop it, past the limit) until its newline."""
        fe = self._fe
        if not self.line_started:
            self.line_started = fe.loop.time()
        if self._skipping:
            return
        if len(self._buffer) + end - start > fe.max_body_bytes + 1:  # (+1: a "\r" may end it)
            line_start = bytes(self._buffer[:16]) + data[start:start + 16]
            self._buffer.clear()
            fe.incoming.hold(self._incoming, 0)
            self._incoming = 0
            self._skipping = True
            self._too_long(line_start)
            return
        self._buffer += data[start:end]
        held = len(self._buffer)
        incoming = fe.incoming
        if incoming.hold(self._incoming, held) or incoming.make_room(self, self._incoming, held):
            self._incoming = held
            return
        incoming.refuse(self._incoming)  # past max_incoming_bytes: this line is dropped
        self._incoming = 0
        self._buffer.clear()
        self._skipping = True
        self._send(fe.incoming_full)
        fe.dispatcher.count_refused_body(ErrorCode.OVERLOADED)

    def _too_long(self, line_start: bytes) -> None:
        """A line past max_body_bytes, whose first bytes are `line_start` (16 or more, or
        the whole line): one -32600 error line, and the rest of the line is skipped; if it
        starts as an HTTP request line (a URL longer than the limit), closed as `_line`
        closes on a short one: what follows it could be a valid call."""
        if _HTTP_LINE.match(line_start):
            self._foreign(_HTTP_REQUEST, ErrorCode.INVALID_REQUEST)
            return
        self._send(self._fe.too_long)
        self._fe.dispatcher.count_refused_body()

    def _line(self, line: bytes) -> None:
        if not line.strip():
            return
        first = line[0]
        if first != 123 and first != 91 and _HTTP_LINE.match(line):  # (not "{" nor "[": 2 compares)
            self._foreign(_HTTP_REQUEST, ErrorCode.INVALID_REQUEST)
            return
        if self.caller is None:  # (tokens asked for: its first line shows one)
            self._authenticate(line)
            return
        self.lines += 1
        if (
            self._write_paused or self._waiting or self._one_by_one
            or self._budget.held >= self._fe.max_response_bytes
            or self.owed > PIPELINE_HIGH  # (round 35: a backlog kept past max_incoming_bytes, whose turn
        ):  # fmt: skip  # comes whatever is owed, dispatched 235 to 396 calls of one connection)
            # (_gated, inlined) The line is kept: counted in max_incoming_bytes until it is
            # dispatched, else refused (hostile testing, round 11, as for HTTP bodies)
            fe = self._fe
            if not fe.incoming.hold(0, len(line)):
                fe.incoming.refuse(0)
                fe.dispatcher.count_refused_body(ErrorCode.OVERLOADED)
                self._send(fe.incoming_full)
                return
            self._waiting_bytes += len(line)
            self._waiting.append(line)
            self._pause()
            if not self._gated():
                self._fe.loop.call_soon(self._dispatch_waiting)
            return
        self._submit(line)

    def _authenticate(self, line: bytes) -> None:
        """The connection's first line, with tokens asked for (TCP: the Unix socket is guarded
        by its file mode): `{"jsonrpc":"2.0","method":"rpc.authenticate","params":{"_meta":
        {"token":"TOKEN"}},"id":...}` (MCP's `_meta`; `rpc.` names are the server's own,
        JSON-RPC 2.0 section 4), its token checked in constant time (`Authenticator.name_of`).
        Then its calls go under that token's policy and rate limit, and a request (with an id)
        is answered `{"token": NAME}`; else an error object (-32600, id null) saying what is
        required, and the connection closes (as HTTP's 401: nothing of the token is shown).

        A connection whose TLS client certificate names a token (`_certified`) is that token's
        caller already: a first line of anything else is served as any line is. One of
        `rpc.authenticate` is checked all the same (a client that sends it whatever its
        transport works unchanged), and must show that same token: another token's is refused
        as a bad one is (`other_token`), so that no line switches a connection's caller."""
        fe = self._fe
        certified = self._certified
        body = fe.codec.decode(line)
        request = body.items[0] if not body.batch and len(body.items) == 1 else None
        if certified and not (type(request) is Request and request.method == AUTHENTICATE):
            self._authenticated(certified)
            self._line(line)  # (decoded again there: once a connection; a batch's rpc.authenticate is -32601)
            return
        name = token = None
        if type(request) is Request and request.method == AUTHENTICATE and len(request.params):
            try:
                meta = _auth_params(request.params).meta
            except msgspec.DecodeError:  # (not an object, a `_meta` not one, a token not a string: none)
                meta = None
            token = meta.token if meta is not None else None
            if type(token) is str:
                name = typing.cast("Authenticator", fe.auth).name_of(token.encode())
        if name is None:  # (a token given but no one's said so, as on HTTP: new user, round 107)
            sent = type(token) is str
            fe.unauthorized(self._budget.peer, sent)
            # (with a certificate naming a token, not "a bearer token is required": hostile testing, round 120)
            refusal = fe.other_token if certified else fe.bad_token if sent else fe.unauthenticated
            self._foreign(refusal, ErrorCode.INVALID_REQUEST)
            return
        if certified and name != certified:
            fe.unauthorized(self._budget.peer, True, "a token other than its client certificate's")
            self._foreign(fe.other_token, ErrorCode.INVALID_REQUEST)
            return
        self._authenticated(name)
        if request.id:  # type: ignore[union-attr]
            self._send(response_result(request.id, msgspec.json.encode({"token": name})) + _NL)  # type: ignore[union-attr]

    def _authenticated(self, name: str) -> None:
        """The connection's caller is token `name`: its method policy, its rate limit, its
        name in the access log and the metrics' `token` label."""
        fe = self._fe
        self.caller = self._budget.caller = name
        self._budget.denied = fe.dispatcher.policy.denied[name]
        self._budget.bucket = fe.dispatcher.limiter.for_token(name)

    def _submit(self, line: bytes) -> Exchange | None:
        """Dispatch one line; return its exchange if answers are still owed for it.
        While draining, every line dispatched was received before the stop (it waited in
        `_waiting`, `_backlog` or the kernel), or behind those while they were read
        (`_read_all_before_stop`): `Dispatcher.submit_held` serves it as a call in flight."""
        fe = self._fe
        dispatcher = fe.dispatcher
        submit = dispatcher.submit_held if fe.draining else dispatcher.submit
        if fe.mcp is not None:
            return self._mcp(line, submit)
        exchange = submit(fe.codec.decode(line), self._exchange_done, self._budget)
        if exchange is None:
            return None
        if exchange.remaining == 0:
            self._send(exchange.body() + _NL)
            self._budget.written(exchange, self._write_paused)
            return None
        self.owed += 1
        self._owed.add(exchange)
        if self.owed > PIPELINE_HIGH:
            self._pause()
        return exchange

    def _mcp(self, line: bytes, submit: Submit) -> Exchange | None:
        """One MCP message (`StreamFrontend.mcp`): answered at once, or its tools/call dispatched
        (its answer made a CallToolResult in `_exchange_done`), or a `notifications/cancelled`
        that cancels the call it names, whose answer is then never written (MCP's stdio
        transport, "Cancellation")."""
        session = typing.cast(Session, self._session)
        outcome = typing.cast(McpServer, self._fe.mcp).handle(line, None, session, self._budget.denied)
        if isinstance(outcome, ToolCall):
            exchange = submit(Body(False, [outcome.request]), self._exchange_done, self._budget)
            assert exchange is not None  # (a request with an id: an answer is owed)
            exchange.context = outcome
            if exchange.remaining == 0:
                self._send(outcome.finish(exchange.answers[0] or b"") + _NL)
                self._budget.written(exchange, self._write_paused)
                return None
            outcome.started(exchange)
            self.owed += 1
            self._owed.add(exchange)
            if self.owed > PIPELINE_HIGH:
                self._pause()
            return exchange
        if isinstance(outcome, Cancel):
            exchange = typing.cast("Exchange | None", session.calls.pop(outcome.request_id, None))
            if exchange is not None and exchange in self._owed:
                self._fe.dispatcher.cancel(exchange)
                self._forget(exchange)
            return None
        if outcome.body:
            self._send(outcome.body + _NL)
        return None

    def _forget(self, exchange: Exchange) -> None:
        """`exchange` will not be answered (its MCP request cancelled): owed no more."""
        self.owed -= 1
        self._owed.discard(exchange)
        if exchange is self._busy:
            self._busy = None
        self._budget.written(exchange, self._write_paused)
        if self._waiting and not self._gated():
            self._fe.loop.call_soon(self._dispatch_waiting)
        elif self.owed < PIPELINE_LOW and self._backlog and not self._write_paused:
            self._schedule_turn()
        self._maybe_resume()
        self._maybe_close()

    def _gated(self) -> bool:
        """Whether a line must wait before it is dispatched: the client is not taking
        its answers (the write buffer is above its high-water mark), or the answers it
        is owed and has not taken reach max_response_bytes (as `http.HttpProtocol`)."""
        return self._write_paused or self._budget.held >= self._fe.max_response_bytes

    def _dispatch_waiting(self) -> None:
        """Dispatch the lines that wait, in order, while `_gated` allows, a turn's worth at a
        time (LINES_PER_TURN or TURN_SECONDS, as `_lines`; as for HTTP)."""
        waiting = self._waiting
        turn, deadline = LINES_PER_TURN, _perf() + TURN_SECONDS
        while waiting and not self._gated() and self._transport is not None:
            busy = self._busy
            if busy is not None and busy.remaining:
                break  # one at a time: see _busy
            if turn == 0 or _perf() > deadline:
                self._fe.next_turn(self, self._dispatch_waiting, _perf() - deadline + TURN_SECONDS)
                break
            turn -= 1
            line = waiting.popleft()
            self._fe.incoming.hold(len(line), 0)
            self._waiting_bytes -= len(line)
            self._busy = self._submit(line)
        if self._backlog and not self._waiting and not self._write_paused and self.owed < PIPELINE_LOW:
            # (round 36: a last line that is owed no answer, dispatched after the last answer
            # owed, left the rest of the read held by nothing: the connection stalled for good)
            self._schedule_turn()
        self._maybe_resume()
        self._maybe_close()
        self._fe.recount()  # (the drain waits for what `_waiting` held)

    def _exchange_done(self, exchange: Exchange) -> None:
        self.owed -= 1
        self._owed.discard(exchange)
        if exchange is self._busy:  # (not kept with its answer: as HTTP's `_flush_ready`)
            self._busy = None
        self.last_active = self._fe.loop.time()  # idle time counts from the last answer
        call = exchange.context
        self._send((exchange.body() if call is None else typing.cast(ToolCall, call).finish(
            exchange.answers[0] or b"")) + _NL)
        self._budget.written(exchange, self._write_paused)
        if self._waiting:
            if not self._gated():  # (not from inside the dispatcher's callback)
                self._fe.loop.call_soon(self._dispatch_waiting)
            return
        if not self.owed or not self._write_paused:  # (owed nothing, or took this answer at once)
            self._one_by_one = False
        if self.owed < PIPELINE_LOW:
            if self._backlog and not self._write_paused:
                self._schedule_turn()  # (held by what was owed: `_lines`)
            elif self.read_paused:
                self._maybe_resume()
        self._maybe_close()

    def _send(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._fe.sent_bytes += len(data)
        self.sent += len(data)
        transport.write(data)

    # -- flow control ------------------------------------------------------------------

    def _under_way(self) -> bool:
        """Lines dispatched and not answered, waiting, or not read yet (`resume_writing`)."""
        return bool(self.owed or self._waiting or self._backlog)

    def _write_ready(self) -> None:
        """Writing resumed: nothing waits for it (each answer is written as it comes)."""

    def _pause(self) -> None:
        if not self.read_paused and self._transport is not None and not self._refused:  # (input discarded: `_foreign`)
            self.read_paused = True
            self._transport.pause_reading()

    def _maybe_resume(self) -> None:
        if (
            self.read_paused and not self._write_paused and not self._waiting and self.owed < PIPELINE_LOW
            and not self._backlog  # (`_next_turn` resumes once it is done: lines stay in order)
            and self._transport is not None
        ):  # fmt: skip
            self.read_paused = False
            if self.line_started:  # the unfinished line's time restarts with reading
                self.line_started = self._fe.loop.time()
            if not self._backlog:  # else `_next_turn` resumes reading once it is done
                self._transport.resume_reading()

    def _end_turn(self) -> None:
        """Resume reading after a turn's pause (TURN_BYTES), unless something else holds it
        paused; the pause lasted one loop iteration, so an unfinished line's clock goes on."""
        started = self.line_started
        self._maybe_resume()
        self.line_started = started
