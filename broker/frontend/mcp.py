"""MCP, the Model Context Protocol, over the broker's workers: the protocol's logic, sans-IO (`McpServer`).

Sources: the MCP specification, revisions 2026-07-28 (stateless: basic/index "_meta",
basic/versioning, basic/transports/streamable-http and stdio, server/discover,
server/tools, server/utilities/caching and pagination) and 2025-11-25 (sessions:
basic/lifecycle, basic/transports, basic/utilities/cancellation and ping,
server/tools); https://modelcontextprotocol.io/specification.

Theory of operation
-------------------
A front-end (HTTP's `/mcp`, broker/frontend/httprequest.py; `rpc-broker mcp-stdio`,
broker/frontend/mcpstdio.py) hands `McpServer.handle` one message (an HTTP POST body, or
one stdio line) with what its transport knows of it (`Meta`: the HTTP request's MCP
headers; a `Session` on stdio or once an HTTP client has one). It returns one of:

    Reply     the answer, finished: an HTTP status, the JSON-RPC response (b"" for a
              notification accepted: 202 on HTTP, nothing on stdio) and extra HTTP headers
    ToolCall  a `tools/call` of a served tool: a JSON-RPC `Request` for the dispatcher,
              the tool's name as its method and the call's arguments as its params (raw,
              never decoded here) and the client's id; once the dispatcher answers it,
              `ToolCall.finish` makes that answer the `CallToolResult`
    Cancel    a `notifications/cancelled` naming a request of the session: the front-end
              cancels it in its worker (`Dispatcher.cancel`) and answers nothing

The era of each message is chosen as the 2026-07-28 versioning page says a dual-era
server does: a request whose `params._meta` carries
"io.modelcontextprotocol/protocolVersion" is served statelessly by 2026-07-28's rules;
`initialize` selects 2025-11-25's (or the older version the client asks for), whose
session is the stdio process, or on HTTP the `Mcp-Session-Id` minted by `initialize`
(optional: a request without one is served as a session's would be). Anything else
without `_meta` is served as a 2025-11-25 session's message.

The envelope is read by the plain face's codec (`jsonrpc.Codec`: its limits, its errors,
ids kept raw and echoed byte for byte); MCP then refuses what JSON-RPC allows and MCP
does not: batches (removed in 2025-06-18), a null id, params that are not an object.

What a call's answer becomes (`ToolCall.finish`): a result is the tool's output: its
JSON as one text content block, and as `structuredContent` when the tool declares an
`outputSchema` (wrapped `{"result": value}` when its return type is not an object). An
error is a tool execution error, `isError: true` with a readable text, so that the model
can correct itself (2025-11-25 and later: arguments that fail the input schema too),
whatever its cause: the arguments, the handler's exception or `RpcError`, a timeout, a
worker's death, the broker's overload, a rate limit. Only an unknown tool (or one the
caller's token may not call) is a protocol error, -32602. The broker's own codes
(-32000..-32005) never appear on this face: MCP reserves -32000..-32019 for legacy uses
(-32002 meant "resource not found") and -32020..-32099 for its own.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import typing

import msgspec
from msgspec import Raw

from broker import version
from broker.catalog import Catalog
from broker.floats import decode_json
from broker.frontend.mcpsessions import CALLS_PER_SESSION, Session, Sessions
from broker.jsonrpc import Codec, ErrorCode, Request, error_object, response_error, response_result
from broker.wire import MethodInfo

if typing.TYPE_CHECKING:
    from broker.answers import Exchange
    from broker.dispatch import Dispatcher

MODERN_VERSIONS = ("2026-07-28",)
"""Revisions served statelessly, their version in each request's `_meta` (2026-07-28 basic/versioning)."""
LEGACY_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
"""Revisions reached by `initialize`, newest first: the first is the counter-offer to a version not here
(2025-11-25 basic/lifecycle, "Version Negotiation")."""
SUPPORTED_VERSIONS = MODERN_VERSIONS + LEGACY_VERSIONS

HEADER_MISMATCH = -32020
"""2026-07-28 streamable-http "Server Validation": the MCP headers do not match the body, or are missing."""
UNSUPPORTED_PROTOCOL_VERSION = -32022
"""2026-07-28 basic/versioning: the request's protocol version is not served; data {supported, requested}."""
REQUEST_CANCELLED = -32800
"""The answer to an HTTP request its client cancelled by `notifications/cancelled` (2025-11-25): the
code LSP gives a cancelled request, outside JSON-RPC's reserved range. The client has stopped
waiting for it; the POST still needs an answer."""

KEY_VERSION = "io.modelcontextprotocol/protocolVersion"
KEY_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
KEY_SERVER_INFO = "io.modelcontextprotocol/serverInfo"

PAGE_SIZE = 100
"""Tools per `tools/list` page (server/utilities/pagination: the page size is the server's)."""
LIST_TTL_MS = 60_000
"""`ttlMs` of a `tools/list` and `server/discover` result (server/utilities/caching): the tools change
only at a reload, and a client whose cached list went stale is told -32602 for a tool gone."""
METHODS = ("initialize", "ping", "server/discover", "tools/list", "tools/call", "notifications/initialized",
           "notifications/cancelled", "other")
"""The `method` label of `rpc_broker_mcp_requests_total` (bounded: any other method is "other")."""
ERAS = ("2026-07-28", "legacy")
"""Its `era` label: the stateless revision, or a session's (initialize, 2025-11-25 and older)."""
TOOL_RESULTS = ("ok", "tool_error", "unknown_tool")
"""The `result` label of `rpc_broker_mcp_tool_calls_total`: a result, an `isError` result, or -32602 for a
tool not served (its `tool` label then "other", as the plain face's metrics count unknown methods)."""

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode


class Meta(typing.NamedTuple):
    """An HTTP request's MCP headers, as sent (None: absent). stdio has none."""

    protocol_version: bytes | None = None
    method: bytes | None = None
    name: bytes | None = None
    session_id: bytes | None = None


class Reply(typing.NamedTuple):
    """A finished answer: `status` for HTTP; `body` the JSON-RPC response, b"" for none (an
    accepted notification: 202 on HTTP); `headers` extra HTTP header lines, CRLF-ended."""

    status: int
    body: bytes
    headers: bytes = b""


class Cancel(typing.NamedTuple):
    """`notifications/cancelled` for the request of `session` whose raw id is `request_id`."""

    session: Session
    request_id: bytes


class ToolCall:
    """A `tools/call` to dispatch: `request` (the tool's name as method, the arguments as params,
    the client's id), and how its answer becomes the `CallToolResult` (`finish`).

    Once dispatched (`started`) it keeps a copy of the id, not the request: the arguments are views
    of the whole body, which the dispatcher copies out of it, and would keep it alive for the call's
    length (hostile testing, round 123). `limit`: the most bytes its answer may take
    (max_response_bytes: the result is checked against it as it is, and a CallToolResult holds it
    twice, its text escaped)."""

    __slots__ = ("cancelled", "counts", "handle", "id", "limit", "modern", "name", "request", "session", "tool")

    def __init__(self, request: Request, tool: MethodInfo, modern: bool, session: Session | None,
                 counts: dict[tuple[str, str], int], limit: int) -> None:
        self.request = request
        self.id = bytes(request.id)
        self.name = request.method
        self.tool = tool
        self.modern = modern
        self.session = session
        self.counts = counts  # (McpServer.tool_calls)
        self.limit = limit
        self.handle: object = None  # (`started`)
        self.cancelled = False  # (its front-end cancelled it: answered `cancelled`, as it is)

    def started(self, handle: object) -> None:
        """The front-end dispatched it; `handle` (its `Exchange`) is what a `notifications/cancelled`
        of its session names it by (`Session.calls`, bounded: the oldest forgotten past
        `CALLS_PER_SESSION`)."""
        self.request = Request("2.0", self.name)  # (its params no more: see the class docstring)
        session = self.session
        if session is not None:
            calls = session.calls
            if len(calls) >= CALLS_PER_SESSION:
                del calls[next(iter(calls))]
            calls[self.id] = self.handle = handle

    def forgotten(self) -> None:
        """Its connection is gone before its answer: its session names it no more (else a session's
        calls whose clients left would stay, and what they hold: hostile testing, round 123, 49 MiB
        to 320 MiB)."""
        session = self.session
        if session is not None and self.handle is not None and session.calls.get(self.id) is self.handle:
            del session.calls[self.id]  # (not a later call's of the same id)

    def finish(self, answer: bytes) -> bytes:
        """The JSON-RPC response to the `tools/call`, from the dispatcher's `answer` to `request`
        (a Response object with the same id): a `CallToolResult`, `isError` for an error."""
        id_ = self.id
        self.forgotten()
        head = b'{"jsonrpc":"2.0","id":' + id_ + b',"result":'
        if answer.startswith(head) and answer.endswith(b"}"):  # (as `response_result` splices it)
            return response_result(id_, self._result(answer[len(head):-1]))
        if self.cancelled:  # (the front-end's own answer to a cancelled HTTP request; a tool's -32800 is its own)
            return cancelled(id_)
        try:
            error = _decode(answer, type=_ErrorResponse).error
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            error = _ErrorObject(ErrorCode.INTERNAL_ERROR, "Internal error", Raw(b'"unreadable answer"'))
        return response_result(id_, self._failed(_error_text(error)))  # (a tool's own codes too: round 123)

    def _count(self, result: str) -> None:
        key = (self.name, result)
        self.counts[key] = self.counts.get(key, 0) + 1

    def _result(self, value: bytes) -> bytes:
        tool = self.tool
        schema = tool.output_schema
        least = len(value) * (1 if schema is None else 2) + len(self.id)  # (its text, and its structuredContent)
        if least > self.limit:  # (known too large before its text is made: round 125, 184 ms for 15 MB)
            return self._failed(f"The tool's result, {len(value)} bytes, takes {least} bytes or more as a "
                                f"CallToolResult (its text and its structuredContent), past max_response_bytes "
                                f"{self.limit}")
        if schema is not None:
            wrong = _misfit(value, schema["properties"]["result"] if tool.wrap_result else schema)  # type: ignore[index]
            if wrong:  # (hostile testing, round 123: a `-> Pt` returning a list was structuredContent [1,2])
                return self._failed(f"The tool's result does not fit its outputSchema: {wrong}")
        text = _encode(value.decode())  # (the result's JSON, as a JSON string)
        parts = [b'{"content":[{"type":"text","text":', text, b"}]"]
        if schema is not None:
            parts += (b',"structuredContent":{"result":', value, b"}") if tool.wrap_result else (
                b',"structuredContent":', value)
        parts.append(_MODERN_OK if self.modern else b',"isError":false}')
        size = sum(map(len, parts)) + len(self.id) + 30  # (the response's envelope, the id: round 125)
        if size > self.limit:  # (round 123: 90 KB of quotes under a limit of 100 KB made 240 KB)
            return self._failed(f"The tool's result, {len(value)} bytes, takes {size} bytes as a CallToolResult "
                                f"(its text and its structuredContent), past max_response_bytes {self.limit}")
        self._count("ok")
        return b"".join(parts)

    def _failed(self, text: str) -> bytes:
        self._count("tool_error")
        tail = _MODERN_FAILED if self.modern else b'}],"isError":true}'
        encoded = _encode(text)
        room = self.limit - len(tail) - 200 - len(self.id)  # (the text's room in max_response_bytes: round 124, an error's text,
        while len(encoded) > room and len(text) > 1:  # escaped twice, took 2 times it)
            text = text[:len(text) // 2]
            encoded = _encode(text + " ... (cut at max_response_bytes)")
        return b'{"content":[{"type":"text","text":' + encoded + tail


_JSON_TYPES = {0x7B: "object", 0x5B: "array", 0x22: "string", 0x74: "boolean", 0x66: "boolean", 0x6E: "null"}
"""A JSON value's type by its first byte (numbers aside: `_misfit`)."""


def _misfit(value: bytes, schema: dict[str, object]) -> str:
    """Why `value` (compact JSON) is not of the type(s) `schema` says at its top (its "type", or its
    "anyOf" alternatives' types; "" when it fits, or when the schema says nothing there): MCP's
    "servers MUST provide structured results that conform to this schema" (server/tools, "Output
    Schema"), checked as far as a first byte tells. Deeper, the handler's return annotation is the
    tool's promise (the worker does not check it)."""
    options = schema.get("anyOf")
    alternatives = typing.cast(list[dict[str, object]], options) if isinstance(options, list) else [schema]
    allowed: set[str] = set()
    for alternative in alternatives:
        kind = alternative.get("type")
        if kind is None:
            return ""  # (any value: `{}`, a $ref, a const...)
        allowed.update([kind] if isinstance(kind, str) else typing.cast(list[str], kind))
    first = value[:1]
    got = _JSON_TYPES.get(first[0], "number") if first else "nothing"
    if got in allowed or (got == "number" and "integer" in allowed and not value.strip(b"-0123456789")):
        return ""
    return f"{got} where it declares {' or '.join(sorted(allowed))}"


_SERVER_INFO = {"name": "rpc-broker", "version": version()}
"""Who answers (MCP's `Implementation`): `serverInfo` of `initialize`, `_meta`'s of 2026-07-28 results."""
_SERVER_META = b'"_meta":{"' + KEY_SERVER_INFO.encode() + b'":' + _encode(_SERVER_INFO) + b"}"
"""Every 2026-07-28 result's `_meta` says which server answered (2026-07-28 basic, "Per-response protocol fields")."""
_MODERN_OK = b',"isError":false,"resultType":"complete",' + _SERVER_META + b"}"
_MODERN_FAILED = b'}],"isError":true,"resultType":"complete",' + _SERVER_META + b"}"


class _ErrorObject(msgspec.Struct):
    code: int
    message: str = ""
    data: Raw = Raw()


class _ErrorResponse(msgspec.Struct):
    error: _ErrorObject


_KNOWN: dict[int, str] = {
    ErrorCode.TIMED_OUT: "The tool call timed out",
    ErrorCode.WORKER_DIED: "The worker process running the tool died",
    ErrorCode.OVERLOADED: "The server is overloaded: retry later",
    ErrorCode.NO_WORKER: "No worker is ready to run the tool: retry later",
    ErrorCode.SHUTTING_DOWN: "The server is shutting down",
    ErrorCode.RATE_LIMITED: "Rate limited: retry later",
}
"""The text of a tool execution error the broker made (its own codes, which never reach an MCP client)."""


DATA_READ_BYTES = 64 * 1024
"""An error object's `data` longer than this is not decoded into a tool error's text: its first
`DATA_SHOWN_BYTES` are shown as they are (hostile testing, round 125: 15 MB of data, decoded and encoded
again on the event loop, held it 824 ms, every client waiting)."""
DATA_SHOWN_BYTES = 4096


def _error_text(error: _ErrorObject) -> str:
    """A tool execution error's text for the model: what failed and why, from the error object."""
    data: object = None
    raw = error.data
    if len(raw) > DATA_READ_BYTES:
        shown = bytes(memoryview(raw)[:DATA_SHOWN_BYTES]).decode("utf-8", "replace")
        return f"Error {error.code}: {error.message} ({shown} ... {len(raw)} bytes of data in all)"
    if raw:
        try:  # (floats as the worker reads them: 64 KiB of `1e308` took msgspec's reader 0.1 s of the loop)
            data = decode_json(raw)
        except (msgspec.DecodeError, RecursionError):
            data = None
    code = error.code
    if code == ErrorCode.INVALID_PARAMS and isinstance(data, dict) and "reason" in data:
        param = data.get("param")
        where = f"argument {param!r}: " if param else ""
        return f"Invalid arguments: {where}{data['reason']}"
    known = _KNOWN.get(code)
    text = known or (error.message if code == ErrorCode.INTERNAL_ERROR else f"Error {code}: {error.message}")
    if isinstance(data, dict) and code == ErrorCode.INTERNAL_ERROR and "type" in data:  # (a message: --debug's;
        # a reason: the worker's own words, e.g. where a result breaks the outputSchema, round 131)
        return f"{text}: {data['type']}: {data.get('message', data.get('reason', ''))}".rstrip(": ")
    if data is not None:
        text += " (" + (data if isinstance(data, str) else _encode(data).decode()) + ")"
    return text


class _Params(msgspec.Struct):
    """The members of an MCP request's params that the broker reads (others are ignored)."""

    meta: dict[str, Raw] | None = msgspec.field(default=None, name="_meta")
    name: str | None = None
    arguments: Raw = Raw()
    cursor: str | None = None
    requestId: Raw = Raw()
    protocolVersion: str | None = None


_NO_PARAMS = _Params()
_METHODS = frozenset(METHODS)


class McpServer:
    """MCP over the broker's tools: `handle` one message, get what to answer or dispatch.

    catalog: a callable returning the current `Catalog` (it changes at reloads).
    private: the tools listed depend on the caller (auth tokens with allow_methods): list
        results say `cacheScope: "private"`, else "public".
    limit: the most bytes a tools/call's answer may take (max_response_bytes: `ToolCall`).
    sessions: the HTTP sessions (broker/frontend/mcpsessions.py; tests give their own).
    """

    def __init__(self, catalog: typing.Callable[[], Catalog], codec: Codec, private: bool = False,
                 limit: int = 2**63, sessions: Sessions | None = None) -> None:
        self._catalog = catalog
        self._codec = codec
        self._scope = b'"private"' if private else b'"public"'
        self._sessions = Sessions() if sessions is None else sessions
        self._limit = limit
        self._capabilities = {"tools": {"listChanged": False}}
        self.requests: dict[tuple[str, str], int] = {}
        """Requests handled, by (`METHODS` label, `ERAS` label)."""
        self.tool_calls: dict[tuple[str, str], int] = {}
        """tools/call answered, by (tool name, `TOOL_RESULTS` label); a name no worker serves as "other"."""

    @property
    def sessions(self) -> int:
        """HTTP sessions held now."""
        return len(self._sessions)

    def handle(self, body: bytes, meta: Meta | None = None, session: Session | None = None,
               denied: typing.AbstractSet[str] = frozenset(), client: str = "") -> Reply | ToolCall | Cancel:
        """One message: an HTTP POST body with its headers (`meta`), or a stdio line (`meta`
        None, `session` the process's). `denied`: tools the caller's token may not call
        (unlisted, and unknown to it). `client`: who sends it over HTTP (its token's name, or
        its address without tokens), whose sessions alone it may name. Never raises for any input."""
        decoded = self._codec.decode(body)
        http = meta is not None
        if decoded.batch:
            return Reply(400, response_error(b"null", error_object(
                ErrorCode.INVALID_REQUEST, data="a JSON-RPC batch: MCP takes one message per request (2025-06-18 "
                "removed batches)")))
        if not decoded.items:  # (a notification nested too deep to read: accepted, never answered)
            return Reply(202, b"")
        item = decoded.items[0]
        if type(item) is bytes:  # (not a Request object: the codec's answer, -32700 or -32600)
            if _is_response(body):  # (on stdio its answer could be taken for one to the host's own request 1)
                return _RESPONSE_REFUSED if http else Reply(202, b"")
            return Reply(decoded.status, item)
        request = typing.cast(Request, item)
        if not request.method and _is_response(body):  # (`"method":""` beside a result: round 124)
            return _RESPONSE_REFUSED if http else Reply(202, b"")
        id_ = bytes(request.id)
        if id_ == b"null":
            return Reply(400, _error(b"null", ErrorCode.INVALID_REQUEST, "an MCP request's id is a string or an "
                                     "integer, never null (2025-11-25 basic, \"Requests\")"))
        params = _NO_PARAMS
        if request.params:
            if memoryview(request.params)[0] != 0x7B:  # "{"
                return self._invalid(id_, "params must be an object", http)
            try:
                params = _decode(request.params, type=_Params)
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
                return self._invalid(id_, f"params: {exc}", http)
        version_raw = params.meta.get(KEY_VERSION) if params.meta else None
        modern = version_raw is not None and request.method != "initialize"
        if meta is not None and meta.session_id is not None and not modern and request.method != "initialize":
            # (2026-07-28 streamable-http, "Backward Compatibility": a modern request's is ignored; round 123)
            session = self._sessions.find(meta.session_id, client)
            if session is None:  # (2025-11-25 transports: 404, and the client starts a new session)
                return Reply(404, _error(id_ or b"null", ErrorCode.INVALID_REQUEST, "Session not found",
                                         "no session by that Mcp-Session-Id (ended, or forgotten): initialize again"))
        self._counted(request.method, modern)
        if not id_:  # a notification: never answered (202 on HTTP)
            if request.method == "notifications/cancelled" and params.requestId and session is not None:
                return Cancel(session, bytes(params.requestId))  # (stdio, both eras; an HTTP session's)
            return Reply(202, b"")  # (notifications/initialized, and any other: accepted)
        if modern:
            return self._modern(request, id_, params, typing.cast(Raw, version_raw), meta, session, denied)
        return self._legacy(request, id_, params, meta, session, denied, client)

    def _counted(self, method: str, modern: bool) -> None:
        key = (method if method in _METHODS else "other", ERAS[0] if modern else ERAS[1])
        self.requests[key] = self.requests.get(key, 0) + 1

    # -- 2026-07-28 ---------------------------------------------------------------------

    def _modern(self, request: Request, id_: bytes, params: _Params, version_raw: Raw, meta: Meta | None,
                session: Session | None, denied: typing.AbstractSet[str]) -> Reply | ToolCall:
        http = meta is not None
        try:
            requested = _decode(version_raw, type=str)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return self._invalid(id_, f"_meta[{KEY_VERSION!r}] must be a string", http)
        if requested not in MODERN_VERSIONS:  # (a legacy one: served after initialize, not per request; round 123)
            how = (f": {requested} is served after initialize, not by a request's _meta" if requested in LEGACY_VERSIONS
                   else "")
            return Reply(400, _error(id_, UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version" + how,
                                     {"supported": list(SUPPORTED_VERSIONS), "requested": requested}))
        method = request.method
        if meta is not None:
            mismatch = _header_mismatch(meta, requested, method, params.name)
            if mismatch:
                return Reply(400, _error(id_, HEADER_MISMATCH, f"Header mismatch: {mismatch}"))
        if params.meta is None or KEY_CAPABILITIES not in params.meta:
            return self._invalid(id_, f"_meta[{KEY_CAPABILITIES!r}] is required on every request (2026-07-28 basic, "
                                 "\"Per-request protocol fields\")", http)
        if method == "tools/call":
            # (on stdio its session names it for notifications/cancelled; over HTTP, closing cancels it)
            return self._call(request, id_, params, True, None if http else session, denied, http)
        if method == "tools/list":
            return self._list(id_, params, True, denied, http)
        if method == "server/discover":
            return self._discover(id_)
        return Reply(404 if http else 200, _error(id_, ErrorCode.METHOD_NOT_FOUND, "Method not found",
                                                  f"{method!r} is not an MCP method this server serves"))

    def _discover(self, id_: bytes) -> Reply:
        """`server/discover`'s answer (2026-07-28 server/discover): the versions served, the capabilities,
        who answers; the same to a probe without `_meta` (a legacy client's)."""
        result = {"supportedVersions": list(SUPPORTED_VERSIONS), "capabilities": self._capabilities,
                  "_meta": {KEY_SERVER_INFO: _SERVER_INFO}, "resultType": "complete", "ttlMs": LIST_TTL_MS,
                  "cacheScope": "public"}
        return Reply(200, response_result(id_, _encode(result)))

    # -- 2025-11-25 and older -------------------------------------------------------------

    def _legacy(self, request: Request, id_: bytes, params: _Params, meta: Meta | None, session: Session | None,
                denied: typing.AbstractSet[str], client: str) -> Reply | ToolCall | Cancel:
        http = meta is not None
        method = request.method
        header = meta.protocol_version if meta is not None else None
        if header is not None and method != "initialize":
            value = header.decode("latin-1")
            if value in MODERN_VERSIONS:
                return self._invalid(id_, f"MCP-Protocol-Version is {value} but params._meta has no "
                                     f"{KEY_VERSION!r} (2026-07-28 requires it on every request)", True)
            if value not in LEGACY_VERSIONS:  # (2025-11-25 transports, "Protocol Version Header": 400)
                return Reply(400, _error(id_, UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                                         {"supported": list(SUPPORTED_VERSIONS), "requested": value}))
        if method == "initialize":
            return self._initialize(id_, params, session, http, client)
        if method == "ping":
            return Reply(200, response_result(id_, b"{}"))
        if method == "tools/call":
            return self._call(request, id_, params, False, session, denied, http)
        if method == "tools/list":
            return self._list(id_, params, False, denied, http)
        if method == "server/discover":  # (its answer is the same without `_meta`: a probe's)
            return self._discover(id_)
        return Reply(404 if http else 200, _error(id_, ErrorCode.METHOD_NOT_FOUND, "Method not found",
                                                  f"{method!r} is not an MCP method this server serves"))

    def _initialize(self, id_: bytes, params: _Params, session: Session | None, http: bool, client: str) -> Reply:
        asked = params.protocolVersion
        if asked is None:
            return self._invalid(id_, "initialize: params.protocolVersion (a string) is required", http)
        agreed = asked if asked in LEGACY_VERSIONS else LEGACY_VERSIONS[0]
        result = {"protocolVersion": agreed, "capabilities": self._capabilities, "serverInfo": _SERVER_INFO}
        headers = b""
        if http:
            session = self._sessions.begin(client, agreed)
            if session is not None:  # (else the table is full: served without one, mcpsessions.py says why)
                headers = b"mcp-session-id: " + session.id.encode() + b"\r\n"
        elif session is not None:
            session.version = agreed
        return Reply(200, response_result(id_, _encode(result)), headers)

    def end_session(self, session_id: bytes, client: str = "") -> bool:
        """HTTP DELETE with `Mcp-Session-Id` (2025-11-25 transports, "Session Management", item 5): the
        session ends. Returns whether it was one of `client`'s."""
        return self._sessions.end(session_id, client)

    # -- tools ---------------------------------------------------------------------------

    def _list(self, id_: bytes, params: _Params, modern: bool, denied: typing.AbstractSet[str], http: bool) -> Reply:
        tools = self._catalog().tools(denied)
        start = 0
        if params.cursor is not None:
            after = _read_cursor(params.cursor)
            if after is None:
                return self._invalid(id_, "invalid cursor: give one a tools/list result's nextCursor", http)
            start = bisect.bisect_left(tools, after, key=_name)
        page = tools[start:start + PAGE_SIZE]
        result: dict[str, object] = {"tools": page}
        if start + PAGE_SIZE < len(tools):
            result["nextCursor"] = _cursor(_name(tools[start + PAGE_SIZE]))
        body = _encode(result)
        if modern:
            body = body[:-1] + b',"resultType":"complete","ttlMs":%d,"cacheScope":%s,%s}' % (
                LIST_TTL_MS, self._scope, _SERVER_META)
        return Reply(200, response_result(id_, body))

    def _call(self, request: Request, id_: bytes, params: _Params, modern: bool, session: Session | None,
              denied: typing.AbstractSet[str], http: bool) -> Reply | ToolCall:
        name = params.name
        if name is None:
            return self._invalid(id_, "tools/call: params.name (a string) is required", http)
        tool = self._catalog().tool(name)
        if tool is None or name in denied:
            key = (name if tool is not None else "other", "unknown_tool")  # (bounded: any name could come)
            self.tool_calls[key] = self.tool_calls.get(key, 0) + 1
            return Reply(200, _error(id_, ErrorCode.INVALID_PARAMS, f"Unknown tool: {name}"))
        arguments = params.arguments
        if arguments and memoryview(arguments)[0] != 0x7B:
            if bytes(arguments) != b"null":
                return self._invalid(id_, "tools/call: params.arguments must be an object", http)
            arguments = Raw()
        return ToolCall(Request("2.0", name, arguments, request.id), tool, modern, session, self.tool_calls,
                        self._limit)

    def _invalid(self, id_: bytes, why: str, http: bool) -> Reply:
        """-32602 for a request MCP's schema refuses: HTTP 400 (2026-07-28 basic, "Per-request protocol
        fields", for a missing `_meta` field; the same for the rest of a malformed request)."""
        if not id_:  # (a notification's: never answered on stdio; on HTTP 400, its error object's id null)
            return Reply(400, _error(b"null", ErrorCode.INVALID_PARAMS, "Invalid params", why)) if http else Reply(
                202, b"")
        return Reply(400 if http else 200, _error(id_, ErrorCode.INVALID_PARAMS, "Invalid params", why))


class _Response(msgspec.Struct):
    method: Raw = Raw()
    result: Raw = Raw()
    error: Raw = Raw()


_NO_METHOD = frozenset((b"", b"null", b'""'))  # (round 124: `"method":null` beside a result is no request)


def _is_response(body: bytes) -> bool:
    """Whether `body` is a JSON-RPC Response object (a result or an error, no method): what a client never
    sends an MCP server, which makes no requests of it. On stdio it is ignored, not answered -32600 with its
    id: its host could take that for the answer to a request of its own by that id (hostile testing, round
    123)."""
    try:
        message = _decode(body, type=_Response)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return False
    return bytes(message.method) in _NO_METHOD and bool(message.result or message.error)


def cancel_mcp(dispatcher: Dispatcher, exchange: Exchange) -> None:
    """Cancel an HTTP `tools/call` (its `exchange`, context `(keep_alive, headers, ToolCall)`, owed): its
    call cancelled in its worker (`Dispatcher.cancel`), its answer -32800 (`cancelled`), which the
    front-end writes in its turn."""
    call = typing.cast(ToolCall, typing.cast(tuple[object, ...], exchange.context)[2])
    dispatcher.cancel(exchange)
    call.cancelled = True
    exchange.fill(0, cancelled(call.id))


def cancelled(id_: bytes) -> bytes:
    """The answer an HTTP request cancelled by `notifications/cancelled` gets (`REQUEST_CANCELLED`)."""
    return _error(id_, REQUEST_CANCELLED, "Request cancelled")


def _error(id_: bytes, code: int, message: str, data: object = None) -> bytes:
    return response_error(id_, error_object(code, message, data))


_RESPONSE_REFUSED = Reply(400, _error(b"null", ErrorCode.INVALID_REQUEST, "Invalid Request",
                                      "a JSON-RPC response: the server makes no request of its client"))


def _name(tool: dict[str, object]) -> str:
    return typing.cast(str, tool["name"])


def _cursor(name: str) -> str:
    """An opaque `nextCursor` (server/utilities/pagination): the name of the tool the next page starts at
    (the tools are listed by name: a reload between two pages loses no tool that stays, nor lists one
    twice)."""
    return base64.urlsafe_b64encode(name.encode()).decode()


def _read_cursor(cursor: str) -> str | None:
    """The name a cursor of `_cursor` holds, None for a cursor that is not one."""
    try:
        return base64.b64decode(cursor.encode("ascii"), altchars=b"-_", validate=True).decode()
    except (ValueError, binascii.Error, UnicodeError):
        return None


def header_value(raw: bytes) -> str | None:
    """An `Mcp-Name` (or `Mcp-Param-*`) value as the client meant it: Base64's sentinel form
    `=?base64?...?=` decoded (2026-07-28 streamable-http, "Value Encoding"); None for a value with
    a character a header may not carry (visible ASCII, space and tab only) or a bad encoding."""
    if any((b < 0x20 and b != 0x09) or b > 0x7E for b in raw):
        return None
    if raw.startswith(b"=?base64?") and raw.endswith(b"?=") and len(raw) >= 11:
        try:
            return base64.b64decode(raw[9:-2], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
    return raw.decode("ascii")


def _header_mismatch(meta: Meta, version: str, method: str, name: str | None) -> str:
    """Why a 2026-07-28 request's MCP headers do not match its body ("" when they do): 2026-07-28
    streamable-http, "Server Validation"."""
    if meta.protocol_version is None:
        return "MCP-Protocol-Version header missing"
    if meta.protocol_version.decode("latin-1") != version:
        return (f"MCP-Protocol-Version header value {_shown(meta.protocol_version)} does not match body value "
                f"{version!r}")
    if meta.method is None:
        return "Mcp-Method header missing"
    if meta.method.decode("latin-1") != method:
        return f"Mcp-Method header value {_shown(meta.method)} does not match body value {method!r}"
    if method == "tools/call":
        if meta.name is None:
            return "Mcp-Name header missing"
        value = header_value(meta.name)
        if value is None:
            return f"Mcp-Name header value {_shown(meta.name)} has invalid characters or encoding"
        if value != name:
            return f"Mcp-Name header value {value[:100]!r} does not match body value {(name or '')[:100]!r}"
    return ""


def _shown(raw: bytes) -> str:
    return repr(raw[:100].decode("latin-1"))
