"""MCP over Streamable HTTP for ``rpc-broker bench --mcp`` (sans-IO): the ``tools/call``
bodies and request heads of both protocol eras, the 2025-11-25 handshake's messages, the
answer taken out of an SSE stream, and the checker of ``CallToolResult`` answers.
`mcp_http.McpLoadConnection` does the I/O.

Eras (``--mcp-era``), from the specification's revisions:

    modern  2026-07-28, stateless (basic/transports/streamable-http, "Request Metadata"):
            every POST carries ``MCP-Protocol-Version: 2026-07-28``, ``Mcp-Method:
            tools/call`` and ``Mcp-Name: <tool>``, and its body's ``params._meta`` the
            version, ``clientCapabilities`` ({}) and ``clientInfo``. No handshake.
    legacy  2025-11-25, sessions (basic/lifecycle; basic/transports, "Session
            Management"): each connection first POSTs ``initialize``, then
            ``notifications/initialized`` (answered 202), then its calls, with
            ``MCP-Protocol-Version: <the negotiated version>`` and the
            ``Mcp-Session-Id`` the ``initialize`` answer gave, if any.

Both send ``Accept: application/json, text/event-stream`` and ``Content-Type:
application/json``. An answer is either the JSON-RPC response (application/json) or an SSE
stream (text/event-stream) whose events' ``data`` carry JSON-RPC messages: notifications
(progress, log messages), requests of the server (2025-11-25), then the response; the
last response in the stream is the answer (`answer_of`).

Checking (`ToolChecker`), on top of the JSON-RPC rules of `check`: a result must be a
CallToolResult (``content`` an array of content objects, ``isError`` a boolean if given,
``resultType`` "complete": required at 2026-07-28, absent or "complete" before); a result
with ``isError: true`` is an answered call counted in `Tally.tool_errors` by its reason (the
first line of its first text content). A JSON-RPC error is counted by code, as ever.

Tool names in a ``Mcp-Name`` header: plain when printable ASCII without white space at
either end, else the spec's Base64 sentinel ``=?base64?...?=`` ("Value Encoding").
"""

from __future__ import annotations

import base64
import re
import typing

import msgspec
from msgspec import Raw

from broker import version
from broker.loadgen.check import Answer, Checker, Tally
from broker.loadgen.target import McpEra
from broker.loadgen.workload import Call, Expect, MixError

__all__ = ["CLIENT_NAME", "LEGACY_VERSION", "MODERN_VERSION", "CallToolResult", "ToolChecker", "answer_of",
           "call_head", "encode_header_value", "initialize_body", "initialized_body", "negotiated", "reason_of",
           "sse_data", "tool_calls", "tool_name_at"]

MODERN_VERSION = "2026-07-28"
LEGACY_VERSION = "2025-11-25"  # sent in `initialize`; the server's answer sets the version used after it
CLIENT_NAME = "rpc-broker-bench"
_META_VERSION = "io.modelcontextprotocol/protocolVersion"
_META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
_META_CLIENT_INFO = "io.modelcontextprotocol/clientInfo"
REASON_CHARS = 80  # a tool error's reason: the first line of its first text content, cut here

# -- bodies ---------------------------------------------------------------------------------

_NAME_AT = len(b'{"jsonrpc":"2.0","method":"tools/call","params":{"name":')  # where `tool_name_at` looks
_ARGUMENTS = b',"arguments":'


def _client_info() -> dict[str, str]:
    return {"name": CLIENT_NAME, "version": version()}


def tool_calls(calls: typing.Sequence[Call], era: McpEra) -> list[Call]:
    """The JSON-RPC ``tools/call`` calls that call each tool of ``calls`` (``method``: the
    tool's name; ``params``: its arguments, JSON text of an object, or None for {}), with
    the same weights: params ``{"name", "arguments"}`` plus, at 2026-07-28, ``"_meta"``.
    `Workload` then builds the bodies as for any call (``name`` first: `tool_name_at`).

    Raises `MixError`: a notification (a tool call is a request), an empty name, arguments
    that are not a JSON object."""
    meta = ({_META_VERSION: MODERN_VERSION, _META_CAPABILITIES: {}, _META_CLIENT_INFO: _client_info()}
            if era == "modern" else None)
    out: list[Call] = []
    for c in calls:
        if c.notification:
            raise MixError(f"tool {c.method!r}: a tool call is a request, never a notification (MCP: tools/call)")
        if not c.method:
            raise MixError("a tool call needs the tool's name")
        arguments: object = {}
        if c.params is not None:
            try:
                arguments = msgspec.json.decode(c.params.encode(), type=dict[str, object])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise MixError(f"arguments of tool {c.method!r} must be a JSON object: {exc}") from None
        params: dict[str, object] = {"name": c.method, "arguments": arguments}
        if meta is not None:
            params["_meta"] = meta
        out.append(Call("tools/call", msgspec.json.encode(params).decode(), c.weight))
    return out


def tool_name_at(body: bytes) -> bytes:
    """The tool's name in a body of `tool_calls` as JSON text (quotes and escapes
    included: the key of `call_head`'s heads). An unescaped quote cannot occur inside a
    JSON string, so the first ``,"arguments":`` ends the name."""
    return body[_NAME_AT:body.index(_ARGUMENTS, _NAME_AT)]


def initialize_body() -> bytes:
    """The 2025-11-25 ``initialize`` request (id "initialize"; no capabilities: the bench
    answers no server request)."""
    return msgspec.json.encode({"jsonrpc": "2.0", "id": "initialize", "method": "initialize",
                                "params": {"protocolVersion": LEGACY_VERSION, "capabilities": {},
                                           "clientInfo": _client_info()}})


def initialized_body() -> bytes:
    """The ``notifications/initialized`` notification that ends the handshake."""
    return b'{"jsonrpc":"2.0","method":"notifications/initialized"}'


class _InitializeResult(msgspec.Struct, gc=False, rename="camel"):
    protocol_version: str


class _InitializeAnswer(msgspec.Struct, gc=False):
    jsonrpc: str
    id: str
    result: _InitializeResult


def negotiated(answer: bytes) -> str:
    """The protocol version an ``initialize`` answer (the JSON-RPC response, out of its
    SSE stream if it came in one) settles on; raises ValueError saying why there is none
    (an error answer, not JSON, no ``protocolVersion``)."""
    try:
        a = msgspec.json.decode(answer, type=_InitializeAnswer)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not an InitializeResult ({exc}): {answer[:200]!r}") from None
    if a.jsonrpc != "2.0" or a.id != "initialize" or not a.result.protocol_version:
        raise ValueError(f"not the answer to initialize: {answer[:200]!r}")
    return a.result.protocol_version


# -- heads ----------------------------------------------------------------------------------

_HEADER_SAFE = re.compile(r"[\x20-\x7e]*")
_SENTINEL = re.compile(r"=\?base64\?.*\?=", re.S)


def encode_header_value(value: str) -> str:
    """``value`` as an ``Mcp-Name`` header value (2026-07-28 streamable-http, "Value
    Encoding"): as it is when printable ASCII (space included) with no white space at
    either end and not itself of the sentinel's shape, else ``=?base64?<UTF-8 in
    Base64>?=``."""
    if _HEADER_SAFE.fullmatch(value) and value == value.strip() and not _SENTINEL.fullmatch(value):
        return value
    return f"=?base64?{base64.b64encode(value.encode()).decode()}?="


def call_head(path: str, host: str, token: str, *, version: str, tool: str | None = None,
              session_id: str = "") -> bytes:
    """The head of a POST of one call up to ``Content-Length: `` (the caller adds the
    length, CRLF CRLF and the body): ``Accept`` and ``Content-Type`` always; then
    ``MCP-Protocol-Version: version``, and with ``tool`` (2026-07-28) ``Mcp-Method:
    tools/call`` and ``Mcp-Name``; ``Mcp-Session-Id`` when given (2025-11-25). ``version``
    "" leaves the version out (the ``initialize`` request). ``host``: the Host header's
    value; ``token``: a bearer token ("" for none)."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines += ["Content-Type: application/json", "Accept: application/json, text/event-stream"]
    if version:
        lines.append(f"MCP-Protocol-Version: {version}")
    if tool is not None:
        lines += ["Mcp-Method: tools/call", f"Mcp-Name: {encode_header_value(tool)}"]
    if session_id:
        lines.append(f"Mcp-Session-Id: {session_id}")
    return ("\r\n".join(lines) + "\r\nContent-Length: ").encode()


# -- answers --------------------------------------------------------------------------------

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def sse_data(stream: bytes) -> list[bytes]:
    """The ``data`` of each event of a whole SSE stream, in order (HTML "Server-sent
    events", "Interpreting an event stream"): lines end with CRLF, LF or CR; ``data:``
    lines of one event are joined with LF (one space after the colon dropped); a blank
    line dispatches the event; comments (``:...``) and other fields (``event``, ``id``,
    ``retry``) are skipped; events with no data (a 2025-11-25 priming event) and an event
    the stream ends before dispatching are left out."""
    out: list[bytes] = []
    data: list[bytes] | None = None
    for line in _LINE_BREAK.split(stream):
        if not line:
            if data is not None:
                joined = b"\n".join(data)
                if joined:
                    out.append(joined)
                data = None
            continue
        field, colon, value = line.partition(b":")
        if field != b"data":
            continue  # a comment (empty field), event, id, retry, or unknown: ignored
        if colon and value[:1] == b" ":
            value = value[1:]
        if data is None:
            data = []
        data.append(value)
    return out


class _Message(msgspec.Struct, gc=False):
    """A JSON-RPC message's envelope, to tell a response from a request or notification."""

    method: str | None = None
    id: Raw = Raw()
    result: Raw = Raw()
    error: Raw = Raw()


_decode_message = msgspec.json.Decoder(_Message).decode


def answer_of(stream: bytes) -> bytes | None:
    """The JSON-RPC response carried by an SSE stream (`sse_data`): the last event that
    is one (an id, a result or an error, no method); None when there is none."""
    found = None
    for data in sse_data(stream):
        try:
            m = _decode_message(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if m.method is None and len(m.id) and (len(m.result) or len(m.error)):
            found = data
    return found


class _Content(msgspec.Struct, gc=False):
    """A content object of a CallToolResult: its type, and its text when of type text."""

    type: str
    text: str | None = None


class CallToolResult(msgspec.Struct, gc=False, rename="camel"):
    """The fields of a ``tools/call`` result the checker reads (2025-11-25 and 2026-07-28
    schemas, CallToolResult; ``structuredContent`` and ``_meta`` are not checked)."""

    content: list[_Content]
    is_error: bool = False
    result_type: str | None = None


def reason_of(result: CallToolResult) -> str:
    """A tool error's reason: the first line of its first text content, at most
    `REASON_CHARS` characters ("(no text content)" when it has none)."""
    for c in result.content:
        if c.type == "text" and c.text is not None:
            line = c.text.strip().split("\n", 1)[0]
            return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 1] + "…"
    return "(no text content)"


class ToolChecker(Checker):
    """A `Checker` that also checks each result as a CallToolResult (`check_tool_call`).

    modern: the answers are to 2026-07-28 requests, whose results must carry
    ``resultType``."""

    __slots__ = ("_decode_result", "_modern")

    def __init__(self, tally: Tally, modern: bool = True) -> None:
        super().__init__(tally)
        self._decode_result = msgspec.json.Decoder(CallToolResult).decode
        self._modern = modern

    def check_tool_call(self, status: int, answer: bytes, expect: Expect | Raw) -> None:
        """Check the answer to one ``tools/call`` (``answer``: the JSON-RPC response, out of
        its SSE stream if it came in one; ``status``: the HTTP status). A result with the
        call's id is checked here; anything else (an error, a wrong id, not JSON) by the
        JSON-RPC rules of `Checker.check`."""
        id_ = expect if type(expect) is Raw else Raw(expect.ids[0]) if len(expect.ids) == 1 else None
        if status == 200 and id_ is not None:
            try:
                a = self._decode_one(answer)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
            else:
                if a.jsonrpc == "2.0" and a.id == id_ and len(a.error) == 0 and len(a.result):
                    self._check_result(a, answer)
                    return
        self.check(status, answer, expect)

    def _check_result(self, a: Answer, answer: bytes) -> None:
        tally = self.tally
        try:
            result = self._decode_result(a.result)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            wrong = f"not a CallToolResult ({exc})"
        else:
            kind = result.result_type
            if kind == "complete" or (kind is None and not self._modern):
                if tally.recording:
                    tally.requests += 1
                    tally.calls += 1
                    if result.is_error:
                        tally.tool_error(reason_of(result))
                return
            wrong = ("a 2026-07-28 result without resultType" if kind is None else
                     f"resultType {kind!r}, not 'complete' (the bench answers no input request)")
        tally.malformed += 1  # an answer, but no right one: the call is not counted
        if tally.recording:
            tally.requests += 1
        tally.problem(f"bad answer: {wrong}: {answer[:120]!r}")
