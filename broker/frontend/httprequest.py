"""HTTP/1.1 front-end: a request from its first byte until it is routed (`Requests`).

`http.HttpProtocol` inherits these methods (a mixin with no state of its own: the
attributes it reads are the connection's, declared in broker/frontend/httpstate.py for the
type checker). httptools calls them back as it parses what `data_received` feeds it:
`on_message_begin` at a request's first byte (the request is *under way* from then,
`request_started`); `on_url` and `on_header` as its head comes, its lines and fields
counted (MAX_HEADER_BYTES, MAX_HEADERS) and the values its answer depends on kept (its
framing, Host, Origin, Content-Type, Expect); `on_headers_complete` at the head's end (an
absolute-form target made a path, a body past max_body_bytes refused before it comes,
`100 Continue` sent, or the final answer instead); `on_chunk_header` and `on_body` as its
body comes (bounded by max_body_bytes, and a chunked one by its number of chunks); and
`on_message_complete` once it is all in (an `Upgrade` request's once its body, read by a
second parser, is in too: `HttpProtocol._serve_upgrade`). Then `_route` answers it (the
probes, /metrics, a preflight, 404, 405, the refusals of who may call), or `_rpc` hands its
JSON-RPC body to the dispatcher: at once, or, while the connection is to take no more
(`_gated`, inlined there), held in `_waiting` (a `Deferred`). Either way the request is
*owed* from then until answered, in its turn among the connection's answers
(broker/frontend/httpanswer.py). What the parser is fed, and when (turns, the bounds on an
unfinished head and on a chunked body's framing), is broker/frontend/http.py's.

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
"""

from __future__ import annotations

import typing

from broker.frontend.base import PIPELINE_HIGH
from broker.frontend.httpmsg import (
    CLOSE,
    CONTINUE,
    JSON_TYPE,
    KEEP_ALIVE,
    METRICS_TYPE,
    PREFLIGHT,
    STATUS_LINES,
    TOO_MANY_BODY,
    is_identity,
    is_json,
    json_response,
    retry_after,
    status_line,
)
from broker.frontend.httpowed import Deferred, Scrape
from broker.frontend.httpstate import Close, HttpState
from broker.frontend.mcp import Cancel, Meta, Reply, ToolCall, cancel_mcp
from broker.jsonrpc import Body, ErrorCode

if typing.TYPE_CHECKING:
    from broker.answers import Exchange

__all__ = ["CHUNK_FRAMING_BYTES", "MAX_HEADERS", "MAX_HEADER_BYTES", "MIN_CHUNK_BYTES", "SMALL_CHUNKS", "Requests"]


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
_CODED = b"\0coded"  # `_Request.content_type` of a body with a Content-Encoding other than identity: 415
_PATH_OF_URL = {b"/healthz": "health", b"/readyz": "ready", b"/metrics": "metrics"}
# MCP's request headers (2026-07-28 streamable-http, "Request Metadata"; 2025-11-25's session), by their
# place in `_Request.mcp`
_MCP_HEADERS = {b"mcp-protocol-version": 0, b"mcp-method": 1, b"mcp-name": 2, b"mcp-session-id": 3}
_MCP_LENGTHS = frozenset(len(name) for name in _MCP_HEADERS) - {14}  # (14: tried beside content-length)
_MCP_PREFLIGHT = (
    b"access-control-allow-methods: POST, DELETE\r\naccess-control-allow-headers: content-type, authorization, "
    b"mcp-protocol-version, mcp-method, mcp-name, mcp-session-id\r\n"
    b"access-control-max-age: 600\r\n"
)


class _StopParsing(Exception):
    """Raised from a parser callback to end the feed: the request is answered already."""


class _Request:
    """The request under way on a connection, as its head and body come: what its answer
    depends on, kept by the parser's callbacks (`Requests`). One record a connection,
    reset by `on_message_begin` at each request's first byte (in place: no record made a
    request); between requests it holds
    the last one's values (its body taken: b""). What the parser's position is (head or
    body, the raw bytes counted: `_head_done`, `_head_bytes`, `_framing`) is the
    connection's, reset where a request ends, as bytes before a request's first count.

    url: the request target (bytes) as received, query string included (an absolute-form
        one made a path: `_absolute_form`).
    body: the body as received so far: the first piece as httptools gave it (no copy in
        the common case of a body in one read), then one bytearray bounded by
        max_body_bytes (a list of pieces cost ~50 bytes of objects per piece: 2-byte
        chunks, 27x); b"" once taken, refused or dropped.
    content_length: the Content-Length value, -1 if none.
    transfer_encoding: every Transfer-Encoding value, as one list (b"": none).
    header_bytes, headers: bytes of its request line and header lines, and its header
        fields, trailers counted in (MAX_HEADER_BYTES, MAX_HEADERS).
    chunks: chunks of a chunked body so far (SMALL_CHUNKS, MIN_CHUNK_BYTES).
    expect: it sent `Expect: 100-continue`.
    skip: answered early (413, 503, or a refusal before its body): its body is dropped.
    host, origin, content_type, authorization: those header values, None if absent (two
        Origin, Content-Type or Authorization fields: b""; a body coded other than
        identity: `_CODED`).
    mcp: MCP's headers (MCP-Protocol-Version, Mcp-Method, Mcp-Name, Mcp-Session-Id), as a
        list of their values in that order, None until one comes (one field twice: b"", which
        matches no body); read only on mcp_path.
    """

    __slots__ = (
        "authorization", "body", "chunks", "content_length", "content_type", "expect", "header_bytes", "headers",
        "host", "mcp", "origin", "skip", "transfer_encoding", "url",
    )  # fmt: skip

    url: bytes
    body: bytes | bytearray
    content_length: int
    transfer_encoding: bytes
    header_bytes: int
    headers: int
    chunks: int
    expect: bool
    skip: bool
    host: bytes | None
    origin: bytes | None
    content_type: bytes | None
    authorization: bytes | None
    mcp: list[bytes | None] | None

    def __init__(self) -> None:
        # (the same values as `on_message_begin`'s, which sets them again, inlined, at each
        # request's first byte)
        self.url = self.body = self.transfer_encoding = b""
        self.content_length = -1
        self.header_bytes = self.headers = self.chunks = 0
        self.expect = self.skip = False
        self.host = self.origin = self.content_type = self.authorization = self.mcp = None


class Requests(HttpState):
    """The request side of `http.HttpProtocol`: httptools' callbacks, and the routing of a
    request once it is all in (see the module docstring)."""

    __slots__ = ()

    # -- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.request_started = self.last_active = self._read_at  # (data_received is running)
        # `_Request.__init__`'s values, inlined: a call here, once a request, cost 0.25 % of
        # the hot path's instructions (callgrind, single calls: 119,355 to 119,056).
        req = self._request
        req.url = req.body = req.transfer_encoding = b""
        req.content_length = -1
        req.header_bytes = req.headers = req.chunks = 0
        req.expect = req.skip = False
        req.host = req.origin = req.content_type = req.authorization = req.mcp = None

    def on_url(self, url: bytes) -> None:
        req = self._request
        if not req.url:  # the request line's method, spaces, version and CRLF count too (round 30)
            req.header_bytes += len(self._parser.get_method()) + _REQUEST_LINE_REST
        req.url += url
        req.header_bytes += len(url)
        if req.header_bytes > MAX_HEADER_BYTES:
            self._answer_and_close(431, b"request line and headers too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        # The whole line counts: name, value, ": " and CRLF (20,000 fields of "X: a" are
        # 120 KB of head, not 40 KB); and so does the number of fields. Trailer fields
        # (after a chunked body) count on with the head's.
        req = self._request
        n = len(name)
        size = req.header_bytes = req.header_bytes + n + len(value) + 4
        count = req.headers = req.headers + 1
        if size > MAX_HEADER_BYTES or count > MAX_HEADERS or self._head_done:  # (one test on the hot path)
            if size > MAX_HEADER_BYTES:
                self._answer_and_close(431, b"request line and headers too large")
            elif count > MAX_HEADERS:
                self._answer_and_close(431, b"too many header fields (limit %d)" % MAX_HEADERS)
            return  # (else a trailer field: never merged into the header section, RFC 9110 6.5.1)
        # (The usual spelling is tried first: bytes.lower() costs more than the compare;
        # the most frequent lengths first: Host, Content-Type, Content-Length.)
        if n == 4 and (name == b"Host" or name.lower() == b"host"):
            if req.host is not None:
                self._answer_and_close(400, b"more than one Host header (RFC 9112 3.2)")
                return
            req.host = value
        elif n == 14 and (name == b"Content-Length" or name.lower() == b"content-length"):
            try:
                size = int(value)
            except ValueError:
                return  # httptools rejects it
            req.content_length = size
            if size > self._fe.max_body_bytes:
                req.skip = True
        elif n == 14 and name.lower() == b"mcp-session-id":
            mcp = req.mcp
            if mcp is None:
                mcp = req.mcp = [None, None, None, None]
            mcp[3] = value if mcp[3] is None else b""
        elif n == 12 and (name == b"Content-Type" or name.lower() == b"content-type"):
            ct = req.content_type  # two: not JSON, 415 (a coded body's 415 says why: `_CODED`)
            req.content_type = value if ct is None else ct if ct is _CODED else b""
        elif n == 16 and name.lower() == b"content-encoding" and not is_identity(value):
            req.content_type = _CODED  # (round 34: a gzip body got 400 -32700, a plain one labelled gzip ran)
        elif n == 6:
            name = name.lower()
            if name == b"origin":  # (two: none allowed, 403; the last was checked, hostile testing)
                # (its trailing whitespace is no part of it, RFC 9110 5.5: round 86, refused, as Host is not)
                req.origin = value.rstrip(b" \t") if req.origin is None else b""
            elif name == b"expect" and value.lower() == b"100-continue":
                req.expect = True
        elif n == 13 and name.lower() == b"authorization":  # (two: neither is taken, 401)
            req.authorization = value if req.authorization is None else b""
        elif n == 17 and name.lower() == b"transfer-encoding":
            # all of them, as one list (RFC 9110 5.3): checked in on_headers_complete
            te = req.transfer_encoding
            req.transfer_encoding = value if not te else te + b", " + value
        elif n in _MCP_LENGTHS:
            at = _MCP_HEADERS.get(name.lower())
            if at is not None:
                mcp = req.mcp
                if mcp is None:
                    mcp = req.mcp = [None, None, None, None]
                mcp[at] = value if mcp[at] is None else b""

    def on_headers_complete(self) -> None:
        req = self._request
        self._head_done = True
        self._framing = 0
        if self._close:
            return
        if req.url[:1] != b"/":
            self._absolute_form()
        if req.skip:
            self._refuse_body()
            return
        if req.transfer_encoding and b"," in req.transfer_encoding:
            # httptools takes "identity, chunked" as chunked; chunked is the only coding
            # served, once (RFC 9112 6.1): any list is refused, as nginx does.
            self._answer_and_close(400, b"unsupported Transfer-Encoding: use chunked alone")
            return
        if (self._fe.auth is not None and self._parser.get_method() == b"POST" and not self._probe_only
                and req.url.partition(b"?")[0] in (self._fe.rpc_path, self._fe.mcp_path) and not self._authorized()):
            # A call with no good token is answered (401, or what `_route` says first) before
            # its body comes, which is discarded as a 413's: a client with no token holds no
            # body, nor max_incoming_bytes (hostile testing, round 114, M5: 100 Continue, then
            # the whole body read, then the 401)
            self._refuse_expected()
            return
        if req.expect and not self._responses:
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
        415, 421, 403, 503), or a call with no good token (401), before its body: routed
        with no body, then closed, lingering, its body discarded as it comes (as a 413's)."""
        req = self._request
        self.request_started = 0.0
        self._close = Close.LINGER  # (before the answer is written: it half-closes, and the body the
        # client may send all the same is discarded; closed at once, that body reset the
        # connection and cut an answer still on its way: round 28)
        self._route(self._parser.get_method(), req.url.partition(b"?")[0], False)
        req.skip = True
        self._discarding()

    def _absolute_form(self) -> None:
        """An absolute-form target (`POST http://host:port/path HTTP/1.1`, RFC 9112 3.2.2):
        its path is the URL, its authority replaces the Host header (which the server
        must then ignore) and is checked exactly as a Host value is (`host_allowed`): an
        empty or odd port, userinfo, an empty authority get the same answer in either
        place. Other forms (`*`, authority-form, other schemes) are left as they are: 404."""
        req = self._request
        scheme, sep, rest = req.url.partition(b"://")
        if not sep or scheme.lower() not in (b"http", b"https"):
            return
        end = len(rest)
        for delimiter in b"/?":  # the authority ends at the path or the query (RFC 3986 3.2)
            i = rest.find(delimiter, 0, end)
            if i >= 0:
                end = i
        req.host = rest[:end]
        path = rest[end:]
        req.url = path if path[:1] == b"/" else b"/" + path

    def _may_call(self) -> bool:
        """Whether the request whose head came passes the checks of who may call: JSON,
        an allowed Host, no Origin or an allowed one (`_refused`)."""
        req = self._request
        fe = self._fe
        host, origin = req.host, req.origin
        return (
            is_json(req.content_type)
            and (  # (no Host: allowed on HTTP/1.0, as `_refused` has it; round 28)
                fe.hosts is None or self._parser.get_http_version() != "1.1" if host is None else fe.host_allowed(host)
            )
            and (origin is None or fe.cors_headers(origin) is not None)
        )

    def _will_serve_rpc(self) -> bool:
        """Whether the request whose head just came will be served as a JSON-RPC call,
        not refused (404, 405, 415, 421, 403, 503, 505): the test of `_route` and `_refused`,
        on HTTP/1.1 only (no 100 to an HTTP/1.0 client, RFC 9110 10.1.1)."""
        req = self._request
        return (
            not self._probe_only
            and self._parser.get_http_version() == "1.1"
            and self._parser.get_method() == b"POST"
            and req.url.partition(b"?")[0] in (self._fe.rpc_path, self._fe.mcp_path)
            and self._may_call()
        )

    def on_chunk_header(self) -> None:
        # A chunk's size line: its data comes next (on_body), or, after the last (0)
        # chunk, the trailer section. (Its bytes are counted by `_framing_check`.)
        req = self._request
        chunks = req.chunks = req.chunks + 1
        if (chunks - SMALL_CHUNKS) * MIN_CHUNK_BYTES > len(req.body) and not self._close:
            self._answer_and_close(400, b"chunked body in %d chunks for %d bytes: more than %d plus one per %d bytes" % (
                chunks, len(req.body), SMALL_CHUNKS, MIN_CHUNK_BYTES))
            raise _StopParsing  # httptools stops this feed (HttpParserCallbackError): _parse

    def on_body(self, body: bytes) -> None:
        req = self._request
        if req.skip or self._close:
            return
        buf = req.body
        if len(buf) + len(body) > self._fe.max_body_bytes:
            req.skip = True
            req.body = b""
            self._refuse_body()
            return
        if not buf:
            req.body = body
        else:
            if type(buf) is bytes:
                buf = req.body = bytearray(buf)
            buf += body

    def on_message_complete(self) -> None:
        req = self._request
        if self._framing > MAX_HEADER_BYTES and not self._close:  # (0 unless the body came in reads of its own)
            self._framing_check()  # with the piece it ends in (`_parse_bounded`): the feed's check would be too late
        self._head_done = False
        self._head_bytes = 0
        self._framing = -1
        if req.skip or self._close:
            self.request_started = 0.0
            req.body = b""
            self._fe.recount()  # (the drain waits for requests under way: `HttpFrontend.held`)
            return
        version = self._parser.get_http_version()
        if version != "1.1" and version != "1.0":  # (checked here, once per request: it costs)
            self._answer_and_close(505, b"HTTP/%s not supported: use HTTP/1.1" % version.encode())
            return
        method = self._parser.get_method()
        url = req.url
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
            if req.transfer_encoding:  # its framing is to be treated as faulty: answered, then closed (RFC 9112 6.1)
                keep_alive = False
            elif not self._keep_header:
                self._keep_header = KEEP_ALIVE  # HTTP/1.0 closes unless the answer says so (RFC 9112 9.3)
        self._route(method, url, keep_alive)
        if req.body:  # a body no route took (a GET's, a 404's, a refused call's): not kept
            req.body = b""  # (nor counted in `Incoming`) while the connection idles
        if not keep_alive:
            self._close = self._close or Close.CLOSE
        if self._fe.draining:  # it may have been under way at the stop (`HttpFrontend.held`); now routed
            self._fe.recount()

    def _route(self, method: bytes, url: bytes, keep_alive: bool) -> None:
        req = self._request
        fe = self._fe
        self.requests += 1
        head = method == b"HEAD"
        if url == fe.rpc_path and not self._probe_only:
            host = req.host
            if (
                method == b"POST" and req.origin is None
                and (req.content_type == JSON_TYPE or is_json(req.content_type))
                and (host in fe.good_hosts or (host is not None and fe.host_allowed(host)))
                and (fe.auth is None or self._authorized())
            ):  # fmt: skip
                self._rpc(keep_alive)  # the common case: one test, no call
            elif not self._refused(True, keep_alive, head):
                cors = b"" if req.origin is None else typing.cast(bytes, fe.cors_headers(req.origin))
                if method == b"OPTIONS" and cors:  # a CORS preflight (Fetch standard 3.2.2)
                    extra = self._keep_header if keep_alive else CLOSE
                    self._queue(STATUS_LINES[204] + fe.date + cors + PREFLIGHT + extra + b"\r\n", keep_alive, "rpc")
                elif method != b"POST":
                    self._queue_plain(405, b"use POST for JSON-RPC", keep_alive, "rpc", b"allow: POST\r\n", head)
                elif fe.auth is not None and not self._authorized():
                    self._unauthorized(keep_alive, cors, "rpc")
                elif req.content_type is _CODED:  # (RFC 9110 15.5.16: 415, Accept-Encoding saying what is)
                    self._queue_invalid(415, "Content-Encoding is not supported: send the body as it is (identity)",
                                        keep_alive, "rpc", cors + b"accept-encoding: identity\r\n")
                elif not is_json(req.content_type):
                    self._queue_invalid(415, "Content-Type must be application/json (its charset, if given, utf-8)",
                                        keep_alive, "rpc", cors)
                else:
                    self._rpc(keep_alive, cors)
            return
        if url == fe.mcp_path and not self._probe_only:
            self._mcp(method, keep_alive, head)
            return
        path = self._path_of(url)
        if self._probe_only and url not in _PROBE_PATHS:
            fe.refused()
            self._close = self._close or Close.CLOSE
            self._queue(json_response(503, TOO_MANY_BODY, False, b"", fe.json_head), False, path)
        elif url == b"/healthz" or url == b"/readyz":
            if method == b"GET" or head:
                ok = url == b"/healthz" or fe.ready()
                body = (fe.health if url == b"/healthz" else b'{"status":"ok"}') if ok else (
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
            elif fe.auth_metrics and not self._authorized():
                self._unauthorized(keep_alive, b"", path, head)
            elif head:  # the headers of the GET answer, with no body: none is made (RFC 9110 9.3.2)
                extra = self._keep_header if keep_alive else CLOSE
                self._queue(STATUS_LINES[200] + fe.date + METRICS_TYPE + extra + b"\r\n", keep_alive, path)
            elif method == b"GET":
                scrape = Scrape(keep_alive, fe.scrape_builds + 1)  # (any build made from now on)
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

    def _authorized(self) -> bool:
        """Whether the request carries a bearer token of `fe.auth` (broker/auth.py); its name
        is then the connection's `caller`, and its policy (`Policy.denied`) the one its calls
        are dispatched under (`_rpc`). The last value accepted on the connection is
        kept: a client sends the same one on each request, checked once."""
        value = self._request.authorization
        if value is not None and value == self._auth_value:
            return True
        name = self._fe.auth.check(value)  # type: ignore[union-attr]  # (asked only with auth on)
        if name is None:
            return False
        self._auth_value, self.caller = value, name
        self._denied = self._fe.dispatcher.policy.denied[name]
        self._bucket = self._fe.dispatcher.limiter.for_token(name)
        return True

    def _unauthorized(self, keep_alive: bool, cors: bytes, path: str, head: bool = False) -> None:
        """401 with `WWW-Authenticate: Bearer` (RFC 6750 3; `error="invalid_token"` when a
        token was sent: RFC 6750 3.1), a JSON-RPC error object on rpc_path."""
        # (a bearer token sent, not another scheme's credentials: no error code for those,
        # RFC 6750 3.1; new user, round 107: `curl -u` was told its bearer token is no one's)
        value = self._request.authorization  # (b"": two of them, or an empty one: no one's either)
        words = (value or b"").split(None, 1)
        sent = value is not None and (not words or words[0].lower() == b"bearer")
        self._fe.unauthorized(self._budget.peer, sent)
        challenge = b'www-authenticate: Bearer realm="rpc-broker"' + (b', error="invalid_token"' if sent else b"")
        why = ("the bearer token is not one of auth_tokens_file's or RPC_BROKER_AUTH_TOKENS'" if sent
               else "a bearer token is required: send Authorization: Bearer TOKEN")
        if path == "rpc" or path == "mcp":  # (a JSON-RPC error on MCP's too: new user, round 111)
            self._queue_invalid(401, why, keep_alive, path, cors + challenge + b"\r\n")
        else:
            self._queue_plain(401, why.encode(), keep_alive, path, challenge + b"\r\n", head)

    def _path_of(self, url: bytes) -> str:
        """The `path` label of an answer to `url` (query string removed): one of `PATHS`."""
        fe = self._fe
        return "rpc" if url == fe.rpc_path else "mcp" if url == fe.mcp_path else _PATH_OF_URL.get(url, "other")

    def _mcp(self, method: bytes, keep_alive: bool, head: bool) -> None:
        """A request to mcp_path: MCP's Streamable HTTP (broker/frontend/mcp.py says what is
        answered). Who may call is checked as on rpc_path (Host, Origin: 2026-07-28
        streamable-http, "Security", 403 for an Origin not allowed; Content-Type, the bearer
        token); then a POST's body goes to `McpServer.handle`, and a tools/call it makes is
        dispatched as a call on rpc_path is (`_rpc`)."""
        req = self._request
        fe = self._fe
        if self._refused(True, keep_alive, head, "mcp"):
            return
        cors = b"" if req.origin is None else typing.cast(bytes, fe.cors_headers(req.origin))
        headers = req.mcp or (None, None, None, None)
        if method == b"OPTIONS" and cors:  # a CORS preflight (Fetch standard 3.2.2)
            extra = self._keep_header if keep_alive else CLOSE
            self._queue(STATUS_LINES[204] + fe.date + cors + _MCP_PREFLIGHT + extra + b"\r\n", keep_alive, "mcp")
        elif fe.auth is not None and not self._authorized():
            self._unauthorized(keep_alive, cors, "mcp", head)
        elif method == b"DELETE" and headers[3]:  # (2025-11-25 transports, "Session Management", item 5)
            if fe.mcp.end_session(headers[3], self._mcp_client()):
                extra = self._keep_header if keep_alive else CLOSE
                self._queue(STATUS_LINES[204] + fe.date + cors + extra + b"\r\n", keep_alive, "mcp")
            else:
                self._queue_plain(404, b"no session by that Mcp-Session-Id", keep_alive, "mcp", cors)
        elif method != b"POST":  # (2026-07-28 streamable-http, "Backward Compatibility": GET and DELETE 405)
            self._queue_plain(405, b"use POST for MCP", keep_alive, "mcp", b"allow: POST\r\n" + cors, head)
        elif req.content_type is _CODED:
            self._queue_invalid(415, "Content-Encoding is not supported: send the body as it is (identity)",
                                keep_alive, "mcp", cors + b"accept-encoding: identity\r\n")
        elif not is_json(req.content_type):
            self._queue_invalid(415, "Content-Type must be application/json (its charset, if given, utf-8)",
                                keep_alive, "mcp", cors)
        elif not req.body and req.content_length < 0 and not req.transfer_encoding:
            self._queue_invalid(411, "no body: send the request with Content-Length (or Transfer-Encoding: "
                                "chunked)", keep_alive, "mcp", cors)
        else:
            if fe.auth is not None:
                self._budget.denied = self._denied
            outcome = fe.mcp.handle(bytes(req.body), Meta(*headers), None, self._denied, self._mcp_client())
            if isinstance(outcome, ToolCall):
                self._rpc(keep_alive, cors, outcome)
                return
            req.body = b""
            if isinstance(outcome, Cancel):  # (2025-11-25 basic/utilities/cancellation, in a session)
                exchange = typing.cast("Exchange | None", outcome.session.calls.pop(outcome.request_id, None))
                if exchange is not None and exchange.remaining:
                    cancel_mcp(fe.dispatcher, exchange)  # (its POST still waits for an answer: -32800)
                outcome = Reply(202, b"")
            status, body, extra = outcome
            extra += cors + (self._keep_header if keep_alive else b"")
            if body:
                self._queue(json_response(status, body, keep_alive, extra, fe.json_head), keep_alive, "mcp")
            else:  # (a notification accepted: 202 with no body, 2026-07-28 streamable-http, "Sending Messages")
                extra += b"content-length: 0\r\n" + (b"" if keep_alive else CLOSE)
                self._queue(status_line(status) + fe.date + extra + b"\r\n", keep_alive, "mcp")

    def _mcp_client(self) -> str:
        """Who sends an MCP request, whose sessions alone it may name (broker/frontend/mcpsessions.py): its
        token's name with tokens, else its address (its host, without the port)."""
        if self._fe.auth is not None:
            return "token " + self.caller
        peer = self._budget.peer
        return "address " + str(peer[0]) if isinstance(peer, tuple) and peer else "address unix"

    def _refused(self, rpc: bool, keep_alive: bool, head: bool, path: str = "rpc") -> bool:
        """Answer a request for rpc_path (`rpc`) or /metrics that comes from where it may
        not: 400 with no Host on HTTP/1.1, 421 for a Host not allowed, 403 for an Origin
        not allowed (see the module docstring). Return True if it was answered."""
        req = self._request
        fe = self._fe
        host, origin = req.host, req.origin
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
            self._queue_invalid(status, data, keep_alive, path)
        else:
            self._queue_plain(status, reason.encode(), keep_alive, path if rpc else "metrics", b"", head)
        return True

    # -- dispatching -------------------------------------------------------------------

    def _gated(self) -> bool:
        """Whether a request's body must wait before it is dispatched: the client is not
        taking its answers (the write buffer is above its high-water mark), or the
        answers it is owed and has not taken reach max_response_bytes. Then what it is
        owed is bounded by that, whatever it pipelines (aiohttp and uvicorn stop reading
        requests while a client does not read; nginx's proxy_buffers bound a response).
        But the first request waiting goes once it heads the answers owed (all before it
        written), whatever they hold: what `held` counts then is answers behind it, finished
        (a 404, a 415) and written only after its own, so waiting for them would wait for
        good (fuzzing, tests/data/fuzz/http_frontend/deferred-request-behind-finished-answers:
        with max_response_bytes of 256, two 415s behind a waiting call held it, and the
        connection, forever). Its results then meet the bound as any call's do (-32603)."""
        if self._write_paused:
            return True
        if self._budget.held < self._fe.max_response_bytes:
            return False
        waiting, responses = self._waiting, self._responses
        return not (waiting and responses and responses[0] is waiting[0])

    def _rpc(self, keep_alive: bool, cors: bytes = b"", mcp: ToolCall | None = None) -> None:
        """Dispatch the request's JSON-RPC body (`mcp`: the MCP tools/call made of it instead, its
        answer made a CallToolResult when written: `Answers._answer`), now or once the
        connection may take more (`Deferred`)."""
        req = self._request
        body = req.body
        if not body and req.content_length < 0 and not req.transfer_encoding and mcp is None:
            # No framing, so no body (RFC 9112 6.3): 411 says what is missing (RFC 9110 15.5.12;
            # hostile testing, round 77: `curl -X POST` with no data got a bare -32700).
            self._queue_invalid(411, "no body: send the request with Content-Length (or Transfer-Encoding: "
                                "chunked)", keep_alive, "rpc", cors)
            return
        req.body = b""
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
            deferred = Deferred(body, keep_alive, cors, self._denied, self._bucket, self.caller)
            deferred.mcp = mcp
            self._waiting.append(deferred)
            self._responses.append(deferred)
            self._pause()
            if not self._gated():
                fe.loop.call_soon(self._dispatch_waiting)
            return
        decoded = fe.codec.decode(body) if mcp is None else Body(False, [mcp.request])
        # (while draining, a request completed now was under way at the stop: `held`)
        submit = fe.dispatcher.submit_held if fe.draining else fe.dispatcher.submit
        if fe.auth is not None:  # (its caller's policy: a request before it may have had another token)
            self._budget.denied, self._budget.bucket, self._budget.caller = self._denied, self._bucket, self.caller
        exchange = submit(decoded, self._exchange_done, self._budget)
        if exchange is None:
            extra = self._keep_header if keep_alive else CLOSE
            self._queue(STATUS_LINES[204] + fe.date + cors + extra + b"\r\n", keep_alive, "rpc")
            return
        # Read back by _answer: keep_alive, or (keep_alive, CORS headers) for a cross-origin call, or
        # (keep_alive, CORS headers, ToolCall) for MCP's
        exchange.context = (keep_alive, cors, mcp) if mcp is not None else (keep_alive, cors) if cors else keep_alive
        if mcp is not None and exchange.remaining:
            mcp.started(exchange)
        if exchange.remaining == 0 and not self._responses:
            if cors or mcp is not None:
                data, keep_alive = self._answer(exchange)
                self._write(data, keep_alive, "rpc" if mcp is None else "mcp")
                self._budget.written(exchange, self._write_paused)
            else:
                extra = self._keep_header if keep_alive else b""
                if exchange.status == 429:  # (a rate-limited call's wait, rounded up)
                    extra += retry_after(exchange.retry_after)
                self._write(json_response(exchange.status, exchange.body(), keep_alive, extra, fe.json_head), keep_alive, "rpc")
                self._budget.written(exchange, self._write_paused)
            return
        self._responses.append(exchange)
        if len(self._responses) > PIPELINE_HIGH:
            self._pause()
        elif exchange.remaining == 0:
            self._flush_ready()
