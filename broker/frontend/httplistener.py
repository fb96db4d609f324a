"""HTTP/1.1 front-end: the listener (`HttpFrontend`), the state all its connections share.

Its connections are `broker.frontend.http.HttpProtocol`s, whose module docstrings (http.py,
httprequest.py, httpanswer.py, httpevict.py) say how a request is read, answered and closed; this one holds what they share: the limits, the
allowed hosts and origins, the connections themselves and the sweep that times them out
(once a second: keep-alive, request_timeout, send_timeout, the lingering close), the drain
at the stop, the probes' reserve past max_connections (`PROBE_RESERVE`, `PROBE_OVERFLOW`),
and the paced /metrics builds that every scraping connection shares.
"""

from __future__ import annotations

import typing

from broker.auth import Authenticator
from broker.frontend.base import (
    LINGER_TIME,
    LINGER_TIMEOUT,
    SWEEP_SECONDS,
    Limits,
    Listener,
    reset,
    unread_bytes,
)
from broker.frontend.httpmsg import JSON_HEADERS, METRICS_HEADERS, STATUS_LINES, date_header, error_body
from broker.frontend.mcp import McpServer
from broker.frontend.mcpsessions import Sessions
from broker.jsonrpc import ErrorCode
from broker.metrics import HTTP_PATHS

if typing.TYPE_CHECKING:
    from broker.dispatch import Dispatcher
    from broker.frontend.http import HttpProtocol
    from broker.frontend.httpstate import HttpState

__all__ = ["PATHS", "PROBE_OVERFLOW", "PROBE_RESERVE", "HttpFrontend"]

PROBE_RESERVE = 8  # places past max_connections for connections owed a scrape (probes and /metrics only)
PROBE_OVERFLOW = 8  # ... and connections past max_connections that need no place (see httpevict.py)
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")  # config.Config.allowed_hosts' default
PATHS = HTTP_PATHS  # the `path` label of rpc_broker_http_responses_total (bounded)


class HttpFrontend(Listener):
    """Shared state of all HTTP connections: codec, dispatcher, limits, connections.

    request_timeout: seconds from a request's first byte until its head and body are
        all in; past it the client gets 408 and the connection closes.
    send_timeout: seconds a client may leave its answers unread (see `Listener`).
    """

    # TLS handshakes allowed past max_connections (`handshake.Handshake`): the connections
    # its probes' reserve takes (hostile testing, round 115, M1: at max_connections, over
    # TLS, /healthz and /readyz were reset before their handshake)
    handshake_overflow = PROBE_RESERVE + PROBE_OVERFLOW

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        rpc_path: str = "/",
        mcp_path: str = "",
        request_timeout: float = 30.0,
        ready: typing.Callable[[], bool] | None = None,
        metrics: typing.Callable[[], bytes] | None = None,
        gather: typing.Callable[[typing.Callable[[], None]], None] | None = None,
        serve_rpc: bool = True,
        transport: str = "http",
        allowed_hosts: typing.Iterable[str] = _LOOPBACK_NAMES,
        allowed_origins: typing.Iterable[str] = (),
        auth: Authenticator | None = None,
        auth_metrics: bool = False,
        health: bytes = b'{"status":"ok"}',
        mcp_sessions: bool = True,
        **limits: typing.Unpack[Limits],
    ) -> None:
        super().__init__(dispatcher, transport=transport, **limits)
        # A metrics-only listener (metrics_port) answers no RPC path: b"" matches no URL.
        self.rpc_path = rpc_path.encode() if serve_rpc else b""
        # MCP's endpoint (broker/frontend/mcp.py): b"" matches no URL
        self.mcp_path = mcp_path.encode() if serve_rpc else b""
        # (mcp_sessions False: MCP's 2025-11-25 initialize is answered with no Mcp-Session-Id, which a
        # server may do: with several front-ends a session held by one would be unknown to the others)
        self.mcp = McpServer(lambda: dispatcher.catalog, self.codec, private=auth is not None,
                             limit=self.max_response_bytes, sessions=None if mcp_sessions else Sessions(0))
        self.request_timeout = request_timeout
        self.statuses = {path: {} for path in PATHS}
        self.metrics = metrics  # makes the /metrics body; None: 404 on /metrics
        # With several front-ends (broker/peers.py): called before each build with a function to
        # call, later, once every front-end's series are in (`metrics` then sums them)
        self.gather = gather
        self._gathering = False  # asked `gather` for the next build
        # Ready: a worker is, and the broker is not stopping (a SIGTERM drain: the metrics
        # listener, which stays open through it, must not send health checkers traffic).
        self.ready = ready or (lambda: dispatcher.accepting and dispatcher.answering_workers > 0)
        # Host names (b"localhost", b"[::1]"), lower case; None: any ('*').
        self.hosts: frozenset[bytes] | None = frozenset(
            (f"[{h}]" if ":" in h and not h.startswith("[") else h).lower().encode() for h in allowed_hosts
        )
        if b"*" in self.hosts:
            self.hosts = None
        self.origins = frozenset(o.lower().encode() for o in allowed_origins)  # b"*": any
        self.good_hosts: set[bytes] = set()  # Host values seen allowed (bounded), for the fast path
        # Bearer tokens asked for on rpc_path (and /metrics with auth_metrics); None: none asked for
        self.auth = auth
        self.auth_metrics = auth is not None and auth_metrics
        self.health = health  # /healthz's answer: {"status":"ok"} and what runs (`server.health_body`)
        too_large = f"body exceeds max_body_bytes {self.max_body_bytes}"
        incoming_full = f"request bodies arriving or waiting exceed max_incoming_bytes {self.incoming.limit}"
        self.too_large_body = error_body(ErrorCode.INVALID_REQUEST, too_large)
        self.incoming_full_body = error_body(ErrorCode.OVERLOADED, incoming_full)
        # (the same refusals of a body sent to another path: not JSON-RPC, `_refuse_body`)
        self.refused_plain = {413: too_large.encode(), 503: incoming_full.encode()}
        self.date = b""  # the date header line, refreshed by every sweep (once a second)
        self.json_head = b""  # the date, content-type and `content-length: ` of a JSON answer
        self._refresh_date()
        # Connections taken past max_connections (probes and /metrics only): those that hold
        # one of the reserve's places (PROBE_RESERVE), and the others (PROBE_OVERFLOW), oldest first.
        self.probe_conns: set[HttpProtocol] = set()
        self.probe_overflow: dict[HttpProtocol, None] = {}
        self.under_way: set[HttpProtocol] = set()  # with a request under way at the stop (`held`)
        # A /metrics body costs ms of the loop (17-30 ms with the demo tools) and is the same for
        # every client, so one build answers every GET /metrics parsed before it was made (as
        # fresh as a build made for that request alone), each connection taking one copy of a
        # build at most. Builds are paced: at most one per loop iteration, the next no sooner
        # than the last one took (with its handing out) after it, so builds take at most half of
        # the loop's time and the iterations between them serve everyone else. A request that
        # must wait (`scrape_paced`) has its connection in `_scrape_waiters`, all served by the
        # next build (`_scrape_due`): a newcomer waits about one build, however many
        # connections scrape. (Connections taking turns, one build each, made a scrape wait
        # for as many builds as connections pipelined them: 600 made Prometheus time out.)
        self.scrape_builds = 0  # builds made so far: a `httpowed.Scrape` takes build `Scrape.build` or a later one
        self.scrape_paced = False  # a build was made, and the next one's time has not come (`_scrape_due`)
        self._scrape_body = b""  # the last build's body, until a pace ends with nobody waiting; b"": none
        self._scrape_answers: dict[bytes, bytes] = {}  # its whole answers, by connection header line
        self._scrape_waiters: list[HttpState] = []  # connections whose next answer waits for a build
        from broker.frontend.http import HttpProtocol  # (here: that module imports this one)

        self._protocol = HttpProtocol

    def host_allowed(self, host: bytes) -> bool:
        """Whether a Host header value (`name[:port]`, RFC 9110 7.2) names this server:
        its name is in `allowed_hosts`, with any port. Remembers up to 64 values seen."""
        if host in self.good_hosts:
            return True
        if self.hosts is None:
            ok = True
        else:
            value = host.strip(b" \t").lower()  # (RFC 9112 5: white space around a value is not part of it)
            if value.startswith(b"["):  # an IPv6 literal keeps its brackets
                name, bracket, port = value.partition(b"]")
                name += bracket  # ("[::1" without its "]" is no name: hostile testing, round 9)
                if port:
                    ok, port = port[:1] == b":", port[1:]
                else:
                    ok = True
            else:
                name, _, port = value.partition(b":")
                ok = True
            # RFC 3986 3.2.3: a port is digits, possibly none; at most 65535 here (round 9:
            # 99999999999999999999 was taken)
            ok = ok and (not port or (port.isdigit() and len(port) <= 5 and int(port) <= 65535))
            ok = ok and name in self.hosts
        if ok and len(self.good_hosts) < 64:
            self.good_hosts.add(host)
        return ok

    def cors_headers(self, origin: bytes) -> bytes | None:
        """The CORS answer headers for an `Origin` in `allowed_origins`; None when it is not
        allowed (compared case-insensitively, RFC 6454 6.2 serialization). They expose
        `Mcp-Session-Id` to the page: a browser reads it from the answer itself, not from a
        preflight's (Fetch, "CORS protocol": `Access-Control-Expose-Headers`; hostile testing,
        round 131: a page's MCP client never saw its session)."""
        if b"*" in self.origins or origin.lower() in self.origins:
            return (b"access-control-allow-origin: " + origin
                    + b"\r\naccess-control-expose-headers: mcp-session-id\r\nvary: origin\r\n")
        return None

    def pool_size(self) -> int:
        """Connections counted against max_connections: not those of the probes' reserve."""
        return len(self.connections) + len(self.handshakes) - len(self.probe_conns) - len(self.probe_overflow)

    def admit_probe(self, conn: HttpProtocol) -> None:
        """Take `conn`, past max_connections, into the reserve's overflow; when it is full,
        the one there that looks least like a probe gives its place (`_reserve_rank`)."""
        overflow = self.probe_overflow
        if len(overflow) >= PROBE_OVERFLOW:
            now = self.loop.time()
            self.give_up(min(overflow, key=lambda other: _reserve_rank(other, now)))
        overflow[conn] = None

    def give_up(self, conn: HttpProtocol) -> None:
        """Close `conn`, of the probes' reserve, for another: reset if it is not taking its
        answers (a close would wait for answers it does not read, out of the sweep's
        reach), a keep-alive close if it was served and is idle, else the 503 of a
        connection refused at accept (the answer to its scrape, if it is owed one)."""
        self.probe_conns.discard(conn)
        self.probe_overflow.pop(conn, None)
        self.connections.discard(conn)
        if conn.hogging() or not self.all_taken(conn):
            reset(conn)  # its unread answers are dropped with it (the sweep no longer sees it)
        elif conn.requests and not conn.request_started and not conn.owed:
            conn.close()
        elif not conn.answer_displaced():
            conn._refuse("metrics" if conn.owed else "other")

    def protocol(self) -> HttpProtocol:
        """Protocol factory for `loop.create_server`."""
        if self._sweeper is None:
            self._refresh_date()
            self.start_sweeping()
        return self._protocol(self)

    def scrape_answer(self, build: int, connection: bytes) -> bytes | None:
        """The answer to a GET /metrics parsed before build number `build`, with the
        `connection` header line (b"" for HTTP/1.1 keep-alive), from the last build if it
        is that recent, else from one made now if the pace allows; None if not
        (`wait_scrape`). The answer's bytes are shared by all the connections it goes to."""
        if build > self.scrape_builds or not self._scrape_body:
            if self.scrape_paced or self._gathering:
                return None
            if self.gather is not None:  # (the connection waits for `_built`)
                self._gathering = True
                self.gather(self._built)
                return None
            self._pace(self._build_scrape())
        answer = self._scrape_answers.get(connection)
        if answer is None:
            body = self._scrape_body
            answer = self._scrape_answers[connection] = b"".join((
                STATUS_LINES[200], self.date, METRICS_HEADERS, str(len(body)).encode(), b"\r\n",
                connection, b"\r\n", body,
            ))  # fmt: skip
        return answer

    def _build_scrape(self) -> float:
        """Make a /metrics body; the next build waits for `_scrape_due`. Return the loop
        time the build started."""
        metrics = typing.cast(typing.Callable[[], bytes], self.metrics)
        started = self.loop.time()
        self._scrape_body = metrics()
        self._scrape_answers = {}
        self.scrape_builds += 1
        self.scrape_paced = True
        return started

    def _pace(self, started: float) -> None:
        """The next build comes no sooner than the next loop iteration and as long after
        now as the last one took since `started`. (uvloop's loop.time updates its clock:
        the timer counts from now.)"""
        self.loop.call_later(self.loop.time() - started, self._scrape_due)

    def wait_scrape(self, conn: HttpState) -> None:
        """`conn`'s next answer is a scrape that needs a build not made yet, and the pace
        does not allow one now: the next build serves it (`HttpProtocol.scrape_built`)."""
        if not conn.scrape_waiting:
            conn.scrape_waiting = True
            self._scrape_waiters.append(conn)

    def _scrape_due(self) -> None:
        """The next build's time: made now if a connection waits for it (its series gathered
        first with several front-ends), and handed out to every one waiting (the time that
        takes counts in the pace); else the last build's body is dropped (memory) and the
        next request makes one at once."""
        self.scrape_paced = False
        if not self._scrape_waiters:
            self._scrape_body = b""
            self._scrape_answers = {}
        elif self.gather is None:
            self._built()
        elif not self._gathering:
            self._gathering = True
            self.gather(self._built)

    def _built(self) -> None:
        """Make the build the connections in `_scrape_waiters` wait for, and hand it out."""
        self._gathering = False
        started = self._build_scrape()
        waiters = self._scrape_waiters
        self._scrape_waiters = []
        for conn in waiters:
            conn.scrape_waiting = False
            conn.scrape_built()
        self._pace(started)

    def _refresh_date(self) -> None:
        self.date = date_header()
        self.json_head = self.date + JSON_HEADERS

    def _sweep(self) -> None:
        self._refresh_date()
        now = self.loop.time()
        keepalive = self.keepalive_timeout
        request_timeout = self.request_timeout
        for conn in list(self.connections):
            if self.send_timed_out(conn, now):
                continue  # its client does not read its answers
            if not conn.send_stalled:
                # (answers the kernel holds: round 17, found only as keep-alive ran out,
                # twice, send_timeout 210 s late with the defaults)
                self.watch_unsent(conn, now)
            started = conn.request_started
            if started:
                # The whole request, head and body, however it trickles (nginx's
                # client_header_timeout and client_body_timeout). The clock does not
                # run while the broker itself is not reading (its own backpressure).
                if now - started > request_timeout and not conn.read_paused:
                    conn.request_timed_out()
            elif conn.lingering_since:  # half-closed after an error answer (nginx's lingering close)
                if (now - conn.last_active > LINGER_TIMEOUT or now - conn.lingering_since > LINGER_TIME) and (
                    self.all_taken(conn)  # (else its answers are still leaving: send_timeout's to end)
                ):
                    conn.close()
            elif not conn.owed and now - conn.last_active > keepalive and not conn.taking_answer(now):
                conn.close()
        for conn in [conn for conn in self.probe_overflow if conn.idle and now - conn.last_active > SWEEP_SECONDS]:
            if self.all_taken(conn):
                conn.close()  # the overflow's: silent, or served and idle, for a sweep

    def drain(self) -> None:
        """Close idle keep-alive connections now; the others close at their first idle
        moment, their last answer saying `connection: close`. A connection with a request
        under way (its head or body still coming) is answered first. A connection with
        bytes received before the stop and not read yet (in the kernel, `unread_bytes`:
        pipelined while the broker had paused its reading, past the per-turn bound or
        the pipeline's, or just not read yet) is not idle: it reads them and serves their
        requests, then what arrived behind them meanwhile, and the drain waits until it
        finds nothing more (`unread`, `HttpProtocol._parsed_before_stop`). A connection
        that has not sent a request yet may still have one on its way: it gets until
        `wait_closed` gives up."""
        self.draining = True
        for conn in list(self.connections):
            self.drain_connection(conn)

    def drain_connection(self, conn: HttpProtocol) -> None:
        """`drain` of one connection: open at the stop, or queued before it and accepted
        after (`listening._accept_queued`)."""
        transport = conn.transport
        unread = 0 if transport is None or conn._close else unread_bytes(transport)
        if unread:
            conn._unread = unread
            self.unread.add(conn)
        if conn.request_started:
            self.under_way.add(conn)
        elif not unread and not conn.owed and conn.requests and not conn._backlog:
            conn.stop_close()

    def held(self) -> int:
        """`Listener.held`, plus one for each connection whose request was under way at
        the stop (its head or body still coming: `under_way`) and still is, to be
        served: it was received in part before the stop, and is answered first
        (hostile testing: its call ran, but the drain had ended and its answer was
        dropped at the close). Not a request begun after the stop, nor one on a
        connection that is closing (answered early, 413 or 431: its bytes are
        discarded), which the drain would wait for in vain; nor, in `unread`, a
        connection closing."""
        under_way = self.under_way
        if under_way:
            under_way.difference_update([conn for conn in under_way if not conn.request_started or conn._close])
        unread = self.unread  # (a connection closing discards what it reads: nothing to wait for)
        if unread:
            unread.difference_update([conn for conn in unread if conn._close])
        return super().held() + len(under_way)


def _reserve_rank(conn: HttpProtocol, now: float) -> tuple[int, float, float]:
    """The order in which the probes' reserve gives up its connections, its places
    (`HttpProtocol._claim_place`) or its overflow (`HttpFrontend.admit_probe`): not
    taking its answers, trickling, served, silent (only in the overflow), owed one answer
    (only in a place); the oldest first in each, except that of those owed an answer,
    the one that has made requests fastest goes first: requests per second of its age,
    counted as 1 s at least (a client scraping in a loop, or churning fresh connections,
    before a Prometheus that keeps its connection and scrapes every 15 s; a plain count
    put that long-lived Prometheus first)."""
    if conn.hogging():
        return 0, 0.0, conn.send_stalled or conn.last_active
    if conn.request_started:
        return 1, 0.0, conn.request_started
    if conn.owed:
        return 4, -conn.requests / max(now - conn.accepted_at, 1.0), conn.last_active
    return (2 if conn.requests else 3), 0.0, conn.last_active
