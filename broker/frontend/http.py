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

Answers:
    POST rpc_path          200 with the JSON-RPC response; 204 when nothing is owed
                           (only notifications); the status in `jsonrpc.ERRORS` for a
                           single error response; 413 past `max_body_bytes` (checked
                           on Content-Length before the body arrives, and on chunks)
    GET/HEAD /healthz      200 while the process runs
    GET/HEAD /readyz       200 when at least one worker is ready, else 503
    GET/HEAD /metrics      Prometheus text format, when this listener serves metrics
    OPTIONS rpc_path       204 with CORS headers: a preflight from an allowed Origin
    other method           405 with Allow
    other path             404
    bad HTTP               400 and close; headers past 64 KiB: 431 and close

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
requests wait for answers on one connection, and resumes below the low marks.
Idle connections (nothing owed, no bytes for `keepalive_timeout` seconds) are closed
by one sweep per second for all connections, not a timer per request.
"""

from __future__ import annotations

import asyncio
import typing
from collections import deque
from http import HTTPStatus

import httptools

from broker.dispatch import Dispatcher, Exchange
from broker.frontend.base import Listener
from broker.jsonrpc import ErrorCode, error_object, response_error
from broker.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

__all__ = ["HttpFrontend", "HttpProtocol"]


PIPELINE_HIGH = 64  # requests owed on one connection before reading pauses
PIPELINE_LOW = 16  # ... and resumes
MAX_HEADER_BYTES = 64 * 1024  # request line and headers, like nginx's large buffers
PROBE_RESERVE = 8  # connections taken past max_connections, for probes and /metrics only
_PROBE_PATHS = frozenset((b"/healthz", b"/readyz", b"/metrics"))
_JSON_TYPE = b"application/json"
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")  # config.Config.allowed_hosts' default
_PREFLIGHT = (
    b"access-control-allow-methods: POST\r\naccess-control-allow-headers: content-type\r\n"
    b"access-control-max-age: 600\r\n"
)


def _status_line(code: int) -> bytes:
    return f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\n".encode()


_STATUS_LINES = {
    code: _status_line(code) for code in (200, 204, 400, 403, 404, 405, 413, 415, 421, 431, 500, 502, 503, 504)
}
_JSON_HEADERS = b"content-type: application/json\r\ncontent-length: "
_CLOSE = b"connection: close\r\n"
_KEEP_ALIVE = b"connection: keep-alive\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_TOO_MANY_BODY = b'{"error":"too many connections"}'
_TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_TOO_MANY_BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + _TOO_MANY_BODY
)
_NO_CONTENT_CLOSE = _STATUS_LINES[204] + _CLOSE + b"\r\n"
_METRICS_HEADERS = b"content-type: " + METRICS_CONTENT_TYPE.encode() + b"\r\ncontent-length: "


def _json_response(status: int, body: bytes, keep_alive: bool, extra: bytes = b"") -> bytes:
    return b"".join(
        (
            _STATUS_LINES.get(status) or _status_line(status),
            _JSON_HEADERS,
            str(len(body)).encode(),
            b"\r\n",
            extra,
            b"" if keep_alive else _CLOSE,
            b"\r\n",
            body,
        )
    )


def _error_body(code: int, data: object = None) -> bytes:
    return response_error(b"null", error_object(code, data=data))


def _is_json(content_type: bytes | None) -> bool:
    """True if a Content-Type value names application/json: the media type compared
    case-insensitively, parameters (`; charset=utf-8`) allowed (RFC 9110 8.3.1)."""
    if content_type == _JSON_TYPE:
        return True
    return content_type is not None and content_type.partition(b";")[0].strip(b" \t").lower() == _JSON_TYPE


class _Scrape:
    """A GET or HEAD /metrics owed on a connection (its answer is made when due)."""

    __slots__ = ("head", "keep_alive")

    def __init__(self, head: bool, keep_alive: bool) -> None:
        self.head = head
        self.keep_alive = keep_alive


class HttpFrontend(Listener):
    """Shared state of all HTTP connections: codec, dispatcher, limits, connections."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        rpc_path: str = "/",
        max_body_bytes: int = 1024 * 1024,
        max_batch: int = 1000,
        keepalive_timeout: float = 75.0,
        max_connections: int = 10000,
        ready: typing.Callable[[], bool] | None = None,
        metrics: typing.Callable[[], bytes] | None = None,
        serve_rpc: bool = True,
        transport: str = "http",
        allowed_hosts: typing.Iterable[str] = _LOOPBACK_NAMES,
        allowed_origins: typing.Iterable[str] = (),
    ) -> None:
        super().__init__(
            dispatcher, transport=transport, max_body_bytes=max_body_bytes, max_batch=max_batch,
            keepalive_timeout=keepalive_timeout, max_connections=max_connections,
        )  # fmt: skip
        # A metrics-only listener (metrics_port) answers no RPC path: b"" matches no URL.
        self.rpc_path = rpc_path.encode() if serve_rpc else b""
        self.metrics = metrics  # makes the /metrics body; None: 404 on /metrics
        self.ready = ready or (lambda: dispatcher.ready_workers > 0)
        # Host names (b"localhost", b"[::1]"), lower case; None: any ('*').
        self.hosts: frozenset[bytes] | None = frozenset(
            (f"[{h}]" if ":" in h and not h.startswith("[") else h).lower().encode() for h in allowed_hosts
        )
        if b"*" in self.hosts:
            self.hosts = None
        self.origins = frozenset(o.lower().encode() for o in allowed_origins)  # b"*": any
        self.good_hosts: set[bytes] = set()  # Host values seen allowed (bounded), for the fast path
        self.too_large = _json_response(
            413, _error_body(ErrorCode.INVALID_REQUEST, f"body exceeds max_body_bytes {max_body_bytes}"), False
        )

    def host_allowed(self, host: bytes) -> bool:
        """Whether a Host header value (`name[:port]`, RFC 9110 7.2) names this server:
        its name is in `allowed_hosts`, with any port. Remembers up to 64 values seen."""
        if host in self.good_hosts:
            return True
        if self.hosts is None:
            ok = True
        else:
            value = host.lower()
            if value.startswith(b"["):  # an IPv6 literal keeps its brackets
                name, _, port = value.partition(b"]")
                name += b"]"
                ok = not port or (port[:1] == b":" and port[1:].isdigit())
            else:
                name, _, port = value.partition(b":")
                ok = not port or port.isdigit()
            ok = ok and name in self.hosts
        if ok and len(self.good_hosts) < 64:
            self.good_hosts.add(host)
        return ok

    def cors_headers(self, origin: bytes) -> bytes | None:
        """The CORS answer headers for an `Origin` in `allowed_origins`; None when it is not
        allowed (compared case-insensitively, RFC 6454 6.2 serialization)."""
        if b"*" in self.origins or origin.lower() in self.origins:
            return b"access-control-allow-origin: " + origin + b"\r\nvary: origin\r\n"
        return None

    def protocol(self) -> HttpProtocol:
        """Protocol factory for `loop.create_server`."""
        self.start_sweeping()
        return HttpProtocol(self)

    def _sweep(self) -> None:
        now = self.loop.time()
        limit = self.keepalive_timeout
        for conn in list(self.connections):
            if not conn.owed and now - conn.last_active > limit:
                conn.close()
            elif conn.head_started and now - conn.head_started > limit:
                conn.close()  # a head trickling in (slowloris): nginx's client_header_timeout

    def drain(self) -> None:
        """Close idle keep-alive connections now; the others close after their next
        answer. A connection that has not sent a request yet may still have one on
        its way: it gets until `wait_closed` gives up."""
        self.draining = True
        for conn in list(self.connections):
            if not conn.owed and conn.requests and not conn.head_started:
                conn.close()


class HttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 client connection (keep-alive, pipelining, chunked bodies)."""

    __slots__ = (
        "_body",
        "_body_size",
        "_closing",
        "_content_length",
        "_content_type",
        "_expect",
        "_fe",
        "_head_bytes",
        "_head_done",
        "_header_bytes",
        "_host",
        "_keep_header",
        "_linger",
        "_origin",
        "_parser",
        "_probe_only",
        "_read_paused",
        "_responses",
        "_skip",
        "_transport",
        "_upgrade",
        "_url",
        "_write_paused",
        "head_started",
        "last_active",
        "requests",
    )

    def __init__(self, frontend: HttpFrontend) -> None:
        self._fe = frontend
        self._parser = httptools.HttpRequestParser(self)
        self._head_bytes = 0  # bytes received while a request's head is incomplete
        self._head_done = False
        self._content_length = 0
        self._linger = False  # half-close after the answer: the client may still be sending
        self._keep_header = b""  # "connection: keep-alive" for an HTTP/1.0 client that asked
        self._probe_only = False  # taken past max_connections: probes and /metrics only
        self._upgrade: tuple[bytes, bytes] | None = None  # (method, url) of an Upgrade request
        self.head_started = 0.0  # loop time a request's first byte came; 0 once its head is in
        self.requests = 0  # requests answered or owed on this connection
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._body_size = 0
        self._header_bytes = 0
        self._expect = False
        self._skip = False  # the current request was answered early (413): drop its body
        self._host: bytes | None = None  # the request's Host, Origin and Content-Type values
        self._origin: bytes | None = None
        self._content_type: bytes | None = None
        # What each request is owed, in order: an Exchange (JSON-RPC), finished bytes, or
        # a _Scrape (a /metrics answer, made only once the client reads what came before).
        self._responses: deque[Exchange | tuple[bytes, bool] | _Scrape] = deque()
        self._read_paused = False
        self._write_paused = False
        self._closing = False
        self.last_active = frontend.loop.time()

    @property
    def owed(self) -> int:
        """Requests received and not yet answered on this connection."""
        return len(self._responses)

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        fe = self._fe
        if len(fe.connections) >= fe.max_connections:  # nginx: worker_connections
            if len(fe.connections) < fe.max_connections + PROBE_RESERVE:
                # Past the limit a few connections are still taken, for /healthz, /readyz
                # and /metrics only: a full broker is alive, and must not look dead to
                # its liveness probe or to Prometheus.
                self._probe_only = True
                fe.connections.add(self)
                return
            fe.refused()
            self._closing = True
            fe.sent_bytes += len(_TOO_MANY)
            fe.statuses[b"503"] = fe.statuses.get(b"503", 0) + 1
            self._transport.write(_TOO_MANY)
            self._transport.close()
            return
        fe.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._responses.clear()
        self._fe.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        fe = self._fe
        fe.received_bytes += len(data)
        self.last_active = fe.loop.time()
        if not self._head_done:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._serve_upgrade(data[exc.args[0]:] if exc.args else b"")
        except httptools.HttpParserError as exc:
            if not self._closing:
                self._answer_and_close(400, f"bad HTTP request: {exc}".encode())
        else:
            # httptools keeps growing an unfinished header line without calling back:
            # count raw bytes until the head is complete (nginx: large_client_header_buffers).
            if not self._head_done and self._head_bytes > MAX_HEADER_BYTES and not self._closing:
                self._answer_and_close(431, b"request line and headers too large")

    def _serve_upgrade(self, rest: bytes) -> None:
        """An `Upgrade` request (h2c, websocket): answer it as plain HTTP/1.1 and
        close, as nginx does; its body, if any, is in `rest` (httptools stops there)."""
        pending, self._upgrade = self._upgrade, None
        if pending is None or len(rest) < self._content_length or self._closing:
            if not self._closing:
                self._answer_and_close(400, b"upgrade not supported")
            return
        method, url = pending
        self._body = [rest[: self._content_length]] if self._content_length else []
        self._route(method, url, False)
        self._closing = True

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._responses:
            self._flush_ready()
        self._maybe_resume()

    # -- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.head_started = self.last_active  # set by data_received, which is running
        self._content_length = 0
        self._url = b""
        self._body = []
        self._body_size = 0
        self._header_bytes = 0
        self._expect = False
        self._skip = False
        self._host = self._origin = self._content_type = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._answer_and_close(431, b"request line and headers too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._answer_and_close(431, b"request line and headers too large")
            return
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
            self._host = value if self._host is None else b""  # two: no name matches
        elif n == 12 and (name == b"Content-Type" or name.lower() == b"content-type"):
            self._content_type = value
        elif n == 6:
            name = name.lower()
            if name == b"origin":
                self._origin = value
            elif name == b"expect" and value.lower() == b"100-continue":
                self._expect = True

    def on_headers_complete(self) -> None:
        self._head_done = True
        self.head_started = 0.0
        if self._closing:
            return
        if self._skip:
            self._linger = True
            self._queue(self._fe.too_large, False)
            self._fe.dispatcher.count_refused_body()
            self._closing = True
            return
        if self._expect and self._parser.get_method() == b"POST":
            assert self._transport is not None
            self._fe.sent_bytes += len(_CONTINUE)
            self._transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self._skip or self._closing:
            return
        self._body_size += len(body)
        if self._body_size > self._fe.max_body_bytes:
            self._skip = True
            self._body = []
            self._linger = True
            self._queue(self._fe.too_large, False)
            self._fe.dispatcher.count_refused_body()
            self._closing = True
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._head_done = False
        self._head_bytes = 0
        if self._skip or self._closing:
            return
        method = self._parser.get_method()
        url = self._url
        if b"?" in url:
            url = url.partition(b"?")[0]
        if self._parser.should_upgrade():  # answered by _serve_upgrade, body and all
            self._upgrade = (method, url)
            return
        keep_alive = self._parser.should_keep_alive() and not self._fe.draining
        if keep_alive and not self._keep_header and self._parser.get_http_version() == "1.0":
            self._keep_header = _KEEP_ALIVE  # HTTP/1.0 closes unless the answer says so (RFC 9112 9.3)
        self._route(method, url, keep_alive)
        if not keep_alive:
            self._closing = True

    def _route(self, method: bytes, url: bytes, keep_alive: bool) -> None:
        fe = self._fe
        self.requests += 1
        head = method == b"HEAD"
        if self._probe_only and url not in _PROBE_PATHS:
            fe.refused()
            self._closing = True
            self._queue(_TOO_MANY, False)
            return
        if url == fe.rpc_path:
            host = self._host
            if (
                method == b"POST" and self._origin is None
                and (self._content_type == _JSON_TYPE or _is_json(self._content_type))
                and (host in fe.good_hosts or (host is not None and fe.host_allowed(host)))
            ):  # fmt: skip
                self._rpc(keep_alive)  # the common case: one test, no call
            elif not self._refused(True, keep_alive, head):
                cors = b"" if self._origin is None else typing.cast(bytes, fe.cors_headers(self._origin))
                if method == b"OPTIONS" and cors:  # a CORS preflight (Fetch standard 3.2.2)
                    self._queue(_STATUS_LINES[204] + cors + _PREFLIGHT + self._keep_header + b"\r\n", keep_alive)
                elif method != b"POST":
                    self._queue_plain(405, b"use POST for JSON-RPC", keep_alive, b"allow: POST\r\n", head)
                elif not _is_json(self._content_type):
                    self._queue_invalid(415, "Content-Type must be application/json", keep_alive)
                else:
                    self._rpc(keep_alive, cors)
        elif url == b"/healthz" or url == b"/readyz":
            if method == b"GET" or head:
                ok = url == b"/healthz" or fe.ready()
                body = b'{"status":"ok"}' if ok else b'{"status":"no worker ready"}'
                response = _json_response(200 if ok else 503, body, keep_alive, self._keep_header if keep_alive else b"")
                if head:
                    response = response[: len(response) - len(body)]
                self._queue(response, keep_alive)
            else:
                self._queue_plain(405, b"use GET", keep_alive, b"allow: GET, HEAD\r\n", head)
        elif url == b"/metrics" and fe.metrics is not None:
            if self._refused(False, keep_alive, head):
                pass
            elif method == b"GET" or head:
                scrape = _Scrape(head, keep_alive)
                if not self._responses and not self._write_paused:
                    self._write(self._scrape_response(scrape), keep_alive)
                else:
                    # A scrape is large (tens of KiB): one made for every request a client
                    # pipelines without reading would pile up in memory. Made when due.
                    self._responses.append(scrape)
                    if len(self._responses) > PIPELINE_HIGH:
                        self._pause()
            else:
                self._queue_plain(405, b"use GET", keep_alive, b"allow: GET, HEAD\r\n", head)
        else:
            self._queue_plain(404, b"not found", keep_alive, b"", head)

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
            data = f"{reason}: {value.decode('latin-1')}" if value else reason
            self._queue_invalid(status, data, keep_alive)
        else:
            self._queue_plain(status, reason.encode(), keep_alive, b"", head)
        return True

    # -- answering ---------------------------------------------------------------------

    def _rpc(self, keep_alive: bool, cors: bytes = b"") -> None:
        parts = self._body
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self._body = []
        fe = self._fe
        decoded = fe.codec.decode(body)
        exchange = fe.dispatcher.submit(decoded, self._exchange_done)
        if exchange is None:
            if not keep_alive and not cors:
                self._queue(_NO_CONTENT_CLOSE, False)
            else:
                self._queue(_STATUS_LINES[204] + cors + (self._keep_header if keep_alive else _CLOSE) + b"\r\n",
                            keep_alive)  # fmt: skip
            return
        # Read back by _answer: keep_alive, or (keep_alive, CORS headers) for a cross-origin call
        exchange.context = (keep_alive, cors) if cors else keep_alive
        if exchange.remaining == 0 and not self._responses:
            if cors:
                self._write(*self._answer(exchange))
            else:
                extra = self._keep_header if keep_alive else b""
                self._write(_json_response(exchange.status, exchange.body(), keep_alive, extra), keep_alive)
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
            if len(responses) == 1 and not self._read_paused:  # the common case: nothing else owed
                responses.popleft()
                keep_alive = exchange.context
                if type(keep_alive) is bool:  # no CORS headers: _answer inlined, for speed
                    extra = self._keep_header if keep_alive else b""
                    self._write(_json_response(exchange.status, exchange.body(), keep_alive, extra), keep_alive)
                else:
                    self._write(*self._answer(exchange))
            else:
                self._flush_ready()

    def _answer(self, exchange: Exchange) -> tuple[bytes, bool]:
        """The HTTP response to a finished exchange, and whether the connection stays open."""
        context = exchange.context
        if type(context) is tuple:  # an allowed cross-origin call: (keep_alive, CORS headers)
            keep_alive, extra = context
        else:
            keep_alive, extra = bool(context), b""
        if keep_alive:
            extra += self._keep_header
        return _json_response(exchange.status, exchange.body(), keep_alive, extra), keep_alive

    def _scrape_response(self, scrape: _Scrape) -> bytes:
        metrics = typing.cast(typing.Callable[[], bytes], self._fe.metrics)
        body = metrics()
        return b"".join((
            _STATUS_LINES[200], _METRICS_HEADERS, str(len(body)).encode(), b"\r\n",
            self._keep_header if scrape.keep_alive else _CLOSE, b"\r\n", b"" if scrape.head else body,
        ))  # fmt: skip

    def _flush_ready(self) -> None:
        responses = self._responses
        while responses:
            head = responses[0]
            if type(head) is tuple:
                data, keep_alive = head
            elif type(head) is _Scrape:
                if self._write_paused:
                    break  # resume_writing comes back here
                keep_alive = head.keep_alive
                data = self._scrape_response(head)
            else:
                exchange = typing.cast(Exchange, head)
                if exchange.remaining:
                    break
                data, keep_alive = self._answer(exchange)
            responses.popleft()
            self._write(data, keep_alive)
            if self._transport is None:
                return
        if self._read_paused and len(responses) < PIPELINE_LOW:
            self._maybe_resume()

    def _write(self, data: bytes, keep_alive: bool) -> None:
        transport = self._transport
        if transport is None:
            return
        transport.write(data)
        fe = self._fe
        fe.sent_bytes += len(data)
        status = data[9:12]
        fe.statuses[status] = fe.statuses.get(status, 0) + 1
        self.last_active = fe.loop.time()  # idle time counts from the last answer
        if not keep_alive:
            self._closing = True
            self._responses.clear()
            if self._linger and transport.can_write_eof():
                # 413 before the body was read: closing now would reset the connection
                # under a client still sending, and it would never see the answer. Half-
                # close and keep discarding its bytes (nginx's lingering close); the
                # client closes, or the idle sweep does after keepalive_timeout.
                transport.write_eof()
            else:
                transport.close()
        elif self._fe.draining and not self._responses:
            transport.close()

    def _queue(self, response: bytes, keep_alive: bool) -> None:
        """Write a finished response now, or after those owed before it."""
        if not self._responses:
            self._write(response, keep_alive)
        else:
            self._responses.append((response, keep_alive))

    def _queue_plain(
        self, status: int, message: bytes, keep_alive: bool, extra: bytes = b"", head: bool = False
    ) -> None:
        body = b'{"error":"' + message + b'"}'
        response = _json_response(status, body, keep_alive, extra + self._keep_header if keep_alive else extra)
        if head:  # a HEAD answer has the headers of the GET answer and no body (RFC 9110 9.3.2)
            response = response[: len(response) - len(body)]
        self._queue(response, keep_alive)

    def _queue_invalid(self, status: int, data: str, keep_alive: bool) -> None:
        """Queue an Invalid Request error object (id null) whose `data` says why, as `status`."""
        body = _error_body(ErrorCode.INVALID_REQUEST, data)
        self._queue(_json_response(status, body, keep_alive, self._keep_header if keep_alive else b""), keep_alive)

    def _answer_and_close(self, status: int, message: bytes) -> None:
        """Answer an unreadable request and close (lingering: it may still be sending)."""
        self._closing = True
        self._linger = True
        self._queue_plain(status, message.replace(b'"', b"'"), False)

    # -- flow control ------------------------------------------------------------------

    def _pause(self) -> None:
        if not self._read_paused and self._transport is not None:
            self._read_paused = True
            self._transport.pause_reading()

    def _maybe_resume(self) -> None:
        if (
            self._read_paused
            and not self._write_paused
            and len(self._responses) < PIPELINE_LOW
            and self._transport is not None
        ):
            self._read_paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        """Close the connection after what is already written."""
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection at once."""
        if self._transport is not None:
            self._transport.abort()
