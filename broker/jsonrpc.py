"""JSON-RPC 2.0 codec, sans-IO: request bodies in, response bytes out.

Source: the JSON-RPC 2.0 specification, https://www.jsonrpc.org/specification
(sections 4 "Request object", 5 "Response object", 5.1 "Error object", 6 "Batch").

Theory of operation
-------------------
`Codec.decode(body)` turns one request body (an HTTP POST body or one NDJSON line)
into a `Body`: whether it was a batch, and its elements in order. Each element is
either a `Request` (a valid request or notification: `id` is empty for a
notification) or `bytes`: the complete error response for an element that is not a
valid Request object. Only the envelope is decoded: `params` and `id` stay
`msgspec.Raw`, i.e. the exact bytes the client sent, so ids are echoed byte for byte
(`1.5e3`, `18446744073709551617`, `"1"`) and params travel to the worker untouched.

The fast path decodes the whole body at once as `Request | list[Request]` (one
msgspec call). Only when that fails does the slow path look at the body element by
element to find which ones are bad and which ids can still be echoed.

Rules the spec leaves to us, and what we chose:

- An element that is not a valid Request object is answered with -32600 even when
  it has no `id` member: the spec's own examples answer
  `{"jsonrpc": "2.0", "method": 1, "params": "bar"}` and `{"foo": "boo"}` with
  `"id": null`. Its id is echoed when it is a valid id, else `null`.
- A *valid* request without `id` is a notification and is never answered, whatever
  happens to it later (unknown method, bad params, handler error).
- `[]` is answered with one -32600 error object, not an array (spec example).
- A batch past the batch length limit is answered with one -32600 error object
  whose `data` says so.
- Nesting past the parser's limit (msgspec stops at Python's recursion limit, about
  1000 levels) is refused per request, not per body: a request whose params (or
  another member) nest too deep gets its own -32600, with its id when that id is
  readable (even after the params), and the other elements of its batch are
  answered as usual. A too-deep body that is not JSON is a -32700 whose `data`
  names the limit (JSONTestSuite's n_structure_100000_opening_arrays).

The slow path is linear in the body: whatever msgspec cannot take (the only bodies
it cannot take are those nested past its limit) goes through `scan_json`, one
non-recursive scan whose token patterns never backtrack; it checks the body is JSON
and finds the batch's elements, which are then decoded one by one.
`benchmarks/pathological.py` measures the worst shapes found.

`response_result` / `response_error` splice a response from raw pieces without
decoding them; `error_object` builds an error object (section 5.1).
"""

from __future__ import annotations

import re
import sys
import typing
from enum import IntEnum

import msgspec
from msgspec import Raw

__all__ = [
    "ERRORS",
    "Body",
    "Codec",
    "ErrorCode",
    "NotJson",
    "Request",
    "Scanned",
    "error_object",
    "http_status",
    "response_error",
    "response_result",
    "scan_json",
]


class ErrorCode(IntEnum):
    """Every error code the broker itself puts in an error object.

    -32768..-32000 are reserved by the spec (section 5.1); -32099..-32000 are for
    "implementation-defined server errors", and the broker's own live there.
    """

    PARSE_ERROR = -32700
    INVALID_REQUEST = -32600
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603
    OVERLOADED = -32000
    TIMED_OUT = -32001
    WORKER_DIED = -32002
    NO_WORKER = -32003
    SHUTTING_DOWN = -32004


class ErrorInfo(typing.NamedTuple):
    message: str
    http_status: int
    meaning: str


# One table: code -> message, the HTTP status of a *single* (non-batch) response
# carrying it, and why. A batch response is always 200: its elements may disagree.
# Errors about the envelope are the client's fault (400, as nginx/proxyd answer a
# malformed request); errors inside a well-formed exchange (unknown method, bad
# params, a handler's failure) are a normal JSON-RPC answer (200, as geth and most
# JSON-RPC servers do, so clients read the body); capacity problems use the status a
# reverse proxy would (503 overloaded, 502 upstream died, 504 upstream timed out) so
# load balancers and retry logic see them for what they are.
ERRORS: dict[int, ErrorInfo] = {
    ErrorCode.PARSE_ERROR: ErrorInfo("Parse error", 400, "the body is not valid JSON"),
    ErrorCode.INVALID_REQUEST: ErrorInfo(
        "Invalid Request", 400, "not a valid Request object, or past a size/batch/depth limit"
    ),
    ErrorCode.METHOD_NOT_FOUND: ErrorInfo(
        "Method not found", 200, "no registered method by that name (names are case-sensitive)"
    ),
    ErrorCode.INVALID_PARAMS: ErrorInfo(
        "Invalid params", 200, "params do not fit the method's signature; data says which and why"
    ),
    ErrorCode.INTERNAL_ERROR: ErrorInfo(
        "Internal error", 200, "the handler raised, or its result could not be encoded"
    ),
    ErrorCode.OVERLOADED: ErrorInfo(
        "Server overloaded", 503, "every worker is at its concurrency limit and the queue is full"
    ),
    ErrorCode.TIMED_OUT: ErrorInfo(
        "Call timed out", 504, "the call's deadline passed; the worker was told to cancel it"
    ),
    ErrorCode.WORKER_DIED: ErrorInfo(
        "Worker died", 502, "the worker process running the call exited; data has pid and status"
    ),
    ErrorCode.NO_WORKER: ErrorInfo(
        "No worker available", 503, "no worker is ready (all starting or restarting)"
    ),
    ErrorCode.SHUTTING_DOWN: ErrorInfo(
        "Shutting down", 503, "the broker is stopping and its grace period ended"
    ),
}


def http_status(code: int) -> int:
    """HTTP status for a single response whose error has `code` (200 if not ours)."""
    info = ERRORS.get(code)
    return 200 if info is None else info.http_status


class Request(msgspec.Struct, gc=False):
    """A decoded Request object (spec section 4); `params` and `id` stay raw.

    `params` is empty (`len(params) == 0`) when absent; `id` is empty when absent,
    which makes the request a notification (section 4.1).
    """

    jsonrpc: typing.Literal["2.0"]
    method: str
    params: Raw = Raw()
    id: Raw = Raw()


class _IdOnly(msgspec.Struct, gc=False):
    """What the slow path reads of an element that is not a valid Request."""

    id: Raw = Raw()


class _Lax(msgspec.Struct, gc=False):
    """Any object, its Request members kept raw: what the slow path looks at first."""

    jsonrpc: Raw = Raw()
    method: Raw = Raw()
    id: Raw = Raw()


class Body(msgspec.Struct, gc=False):
    """One decoded request body (a Struct: made per request, and a NamedTuple's
    pure-Python `__new__` costs several times a Struct's).

    batch: True when the body was a JSON array (the answer is then an array).
    items: the elements in request order, each a `Request` or the finished error
        response (bytes) for an invalid element.
    status: the HTTP status for a non-batch body answered by the codec itself
        (400 for the error cases, see `ERRORS`); 200 otherwise.
    """

    batch: bool
    items: list[Request | bytes]
    status: int = 200


_NULL = b"null"
_ID_FIRST = frozenset(b'"-0123456789n')  # string, number, null (section 4: "id")
_PARAMS_FIRST = frozenset(b"[{")  # array or object (section 4: "params")
_RESP_HEAD = b'{"jsonrpc":"2.0","id":'
_RESULT = b',"result":'
_ERROR = b',"error":'
_TAIL = b"}"


def response_result(id_: Raw | bytes, result: bytes | bytearray | memoryview | Raw) -> bytes:
    """Splice a success Response object (section 5) from the raw id and raw result."""
    return b"".join((_RESP_HEAD, id_, _RESULT, result, _TAIL))


def response_error(id_: Raw | bytes, error: bytes | bytearray | memoryview | Raw) -> bytes:
    """Splice an error Response object (section 5) from the raw id and error object."""
    return b"".join((_RESP_HEAD, id_, _ERROR, error, _TAIL))


_encode = msgspec.json.Encoder().encode


def error_object(code: int, message: str | None = None, data: object = None) -> bytes:
    """Encode an Error object (section 5.1): `{"code", "message"[, "data"]}`.

    `message` defaults to the table's message for `code`; `data` is omitted when None.
    Raises `TypeError` if `data` is not JSON-encodable.
    """
    if message is None:
        info = ERRORS.get(code)
        message = info.message if info is not None else "Server error"
    if data is None:
        return _encode({"code": code, "message": message})
    return _encode({"code": code, "message": message, "data": data})


def _valid_id(raw: Raw) -> bool:
    return len(raw) == 0 or memoryview(raw)[0] in _ID_FIRST


class Codec:
    """Decodes request bodies; one instance per front-end (decoders are reused).

    max_batch: largest number of elements accepted in a batch.
    """

    __slots__ = ("_decoder", "_element", "_first", "_id_only", "_lax", "_slow", "max_batch")

    def __init__(self, max_batch: int = 1000) -> None:
        self.max_batch = max_batch
        self._decoder = msgspec.json.Decoder(Request | list[Request])
        # Not `list[Raw] | Raw`: msgspec drops `Raw` from a union, so any body that is
        # valid JSON but not an array would be reported as a parse error.
        self._slow = msgspec.json.Decoder(Raw)
        self._element = msgspec.json.Decoder(Request)
        self._id_only = msgspec.json.Decoder(_IdOnly)
        self._lax = msgspec.json.Decoder(_Lax)
        self._first: msgspec.json.Decoder[msgspec.Struct] | None = None  # see `_elements`

    def decode(self, body: bytes | bytearray | memoryview) -> Body:
        """Decode one request body into a `Body` (never raises for bad input).

        A body that cannot be a request at all (invalid JSON, a scalar, `[]`, a
        batch past `max_batch`, nesting too deep) comes back as a non-batch `Body`
        whose only item is the error response.
        """
        if type(body) is memoryview:
            body = bytes(body)
        if not body.isascii():
            # JSON text is UTF-8 (RFC 8259 section 8.1). msgspec checks the strings it
            # decodes, but not inside the Raw id and params, which would be echoed.
            try:
                body.decode()
            except UnicodeDecodeError:
                return Body(False, [_PARSE_ERROR], 400)
        try:
            decoded = self._decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return self._decode_slow(body)
        if type(decoded) is list:
            if not decoded:
                return Body(False, [_EMPTY_BATCH], 400)
            if len(decoded) > self.max_batch:
                return self._batch_too_large(len(decoded))
            if _suspect(body):
                for req in decoded:
                    if not (_valid_id(req.id) and _valid_params(req.params)):
                        return self._decode_slow(body)
            return Body(True, decoded)  # type: ignore[arg-type]
        # One request: looking at its id and params directly is cheaper than the scans.
        req = typing.cast(Request, decoded)
        id_, params = req.id, req.params
        if (not id_ or bytes(id_)[0] in _ID_FIRST) and (not params or bytes(params)[0] in _PARAMS_FIRST):
            return Body(False, [req])
        return Body(False, [self._invalid(id_)], 400)

    def _batch_too_large(self, n: int | None) -> Body:
        """One -32600 for the whole body; `n` is None when the slow path stopped
        counting past max_batch."""
        size = f"more than {self.max_batch}" if n is None else str(n)
        data = f"batch of {size} elements exceeds max_batch {self.max_batch}"
        return Body(False, [response_error(_NULL, error_object(ErrorCode.INVALID_REQUEST, data=data))], 400)

    def _decode_slow(self, body: bytes | bytearray | memoryview) -> Body:
        try:
            whole = self._slow.decode(body)  # checks the whole body is one JSON value
        except RecursionError:  # nested past the parser's limit somewhere
            return self._decode_deep(bytes(body))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Body(False, [_PARSE_ERROR], 400)
        # `Raw` skips strings without checking their UTF-8; decoding `jsonrpc` or
        # `method` as `str` does check it, and raises DecodeError: not JSON text.
        try:
            if memoryview(whole)[0] != 0x5B:  # not "[": one request
                item = self._element_item(whole)
                return Body(False, [item], 200 if type(item) is Request else 400)
            outer = self._elements(whole)
            if not isinstance(outer, list):
                return self._batch_too_large(outer)
            if not outer:
                return Body(False, [_EMPTY_BATCH], 400)
            return Body(True, [self._element_item(raw) for raw in outer])
        except msgspec.DecodeError:
            return Body(False, [_PARSE_ERROR], 400)

    def _elements(self, batch: Raw) -> list[Raw] | int | None:
        """The elements of a batch known to be valid JSON; past max_batch, how many
        there are (an int), or None when they were not all counted.

        A batch of 64 KiB or less (or of 2 * max_batch bytes or less, which cannot
        hold more than max_batch elements) is decoded as `list[Raw]`. A larger one is
        decoded as a struct of max_batch + 1 `Raw` fields (array_like): msgspec skips the
        elements past the last field without making an object for each, so refusing
        `[1,1,1,...]` of 1 MiB costs 4 ms instead of 22 (measured)."""
        if len(batch) <= max(2 * self.max_batch, 65536) or self.max_batch > _MAX_BATCH_STRUCT:
            elements = _RAW_LIST.decode(batch)
            return len(elements) if len(elements) > self.max_batch else elements
        if self._first is None:
            self._first = msgspec.json.Decoder(
                msgspec.defstruct(
                    "_Batch", [(f"e{i}", Raw, Raw()) for i in range(self.max_batch + 1)], array_like=True
                )
            )
        fields = typing.cast(tuple[Raw, ...], msgspec.structs.astuple(self._first.decode(batch)))
        if len(fields[-1]):
            return None
        return [raw for raw in fields if len(raw)]

    def _element_item(self, raw: Raw | bytes, scanned: tuple[bytes, Scanned] | None = None) -> Request | bytes:
        """The Request in one element, or the error response for it. `scanned`: the
        body that holds `raw` and its `scan_json`, when `raw` is the body's top value
        (its members need no second scan if it nests too deep)."""
        if memoryview(raw)[0] != 0x7B:  # not "{": not a Request object, no id to read
            return _INVALID_NULL
        try:
            # Every member as Raw first: no exception to raise and catch (1 us each)
            # for the usual invalid objects, `{}` or a method that is not a string.
            lax = self._lax.decode(raw)
        except RecursionError:
            return self._deep_element(*scanned) if scanned else self._deep_element(bytes(raw))
        if not (lax.jsonrpc and lax.method and bytes(lax.method)[0] == 0x22):
            return self._invalid(lax.id)
        try:
            req = self._element.decode(raw)
        except msgspec.ValidationError:
            return self._invalid(lax.id)
        if _valid_id(req.id) and _valid_params(req.params):
            return req
        return self._invalid(req.id)

    def _decode_deep(self, body: bytes) -> Body:
        """The slow path for a body nested past the parser's limit somewhere: one
        linear, non-recursive scan (`scan_json`) checks it is JSON and finds the
        batch's elements; each element then goes through `_element_item` alone, so
        only the element that nests too deep is refused, with its own id."""
        try:
            top = scan_json(body, self.max_batch + 1)
        except NotJson:
            return Body(False, [_parse_error_too_deep()], 400)
        if top.kind != 0x5B:  # one request object (a scalar is never too deep)
            try:
                item = self._element_item(body[top.start:top.end], (body, top))
            except msgspec.DecodeError:
                return Body(False, [_PARSE_ERROR], 400)
            return Body(False, [item], 200 if type(item) is Request else 400)
        if top.total > self.max_batch:
            return self._batch_too_large(top.total)
        items: list[Request | bytes] = []
        try:
            for start, end, run in top.children:
                if run:  # a run of scalars: invalid Request objects, one answer each
                    items.extend([_INVALID_NULL] * run)
                else:
                    items.append(self._element_item(body[start:end]))
        except msgspec.DecodeError:  # msgspec refuses a lone surrogate escape, scan_json not
            return Body(False, [_PARSE_ERROR], 400)
        return Body(True, items)

    def _deep_element(self, element: bytes, obj: Scanned | None = None) -> bytes:
        """The answer to one Request object whose members nest past the parser's
        limit: -32600 with its id when that id is readable and valid, else null.
        `obj`: `element` scanned already (its spans index `element`)."""
        if obj is None:
            try:
                obj = scan_json(element, 0)
            except NotJson:  # not reached: the body was scanned already
                return _parse_error_too_deep()
        id_ = Raw()
        deep_params = False
        for start, end, run in obj.children:
            piece = element[start:end]
            if run:  # `"k": scalar` members, without the braces
                found = self._id_only.decode(b"{" + piece + b"}").id
                if len(found):
                    id_ = found
                continue
            key, value = _member(piece)
            if key == "id":
                id_ = Raw(value)
            elif key == "params":
                deep_params = _too_deep(value)
        what = "params nest" if deep_params else "the request nests"
        error = error_object(
            ErrorCode.INVALID_REQUEST, data=f"{what} deeper than {_parser_limit()}"
        )
        return response_error(id_ if len(id_) and _valid_id(id_) else _NULL, error)

    @staticmethod
    def _invalid(id_: Raw) -> bytes:
        if len(id_) and _valid_id(id_):
            return response_error(id_, _INVALID_REQUEST_ERROR)
        return _INVALID_NULL


# msgspec checks every member but these two, which stay Raw. Rather than look at each
# element's raw id and params (0.8 us a call), C-speed scans of the whole body (0.5 us
# a call) find where an id or params member *could* have the wrong type: a key "id" or
# "params" followed by a value that cannot start a valid one. Inside a string those
# quotes would be escaped, so the scan only errs towards suspicion (a nested "id"
# key, say); a key spelled with \u escapes is caught by the `\u` test. Three scans,
# not one regex with alternatives: each then starts from a literal, which `re` and
# `bytes.find` search fast (47 us against 124 us for a batch of 100, measured).
_SUSPECT_ID = re.compile(rb'"id"\s*:\s*[^"\-0-9n\s]')
_SUSPECT_PARAMS = re.compile(rb'"params"\s*:\s*[^\[{\s]')


def _suspect(body: bytes | bytearray) -> bool:
    return (
        b"\\u" in body
        or _SUSPECT_ID.search(body) is not None
        or _SUSPECT_PARAMS.search(body) is not None
    )


def _valid_params(raw: Raw) -> bool:
    return len(raw) == 0 or memoryview(raw)[0] in _PARAMS_FIRST


_RAW_LIST = msgspec.json.Decoder(list[Raw])
_MAX_BATCH_STRUCT = 10_000  # past this max_batch, `_elements` decodes `list[Raw]`


class NotJson(ValueError):
    """`scan_json` found bytes that are not one JSON text (RFC 8259); `args[0]` is
    the byte offset where it gave up."""


class Scanned(typing.NamedTuple):
    """What `scan_json` found: the top value and its direct children.

    kind: the top value's first byte (0x5B "[" for an array, 0x7B "{" for an object).
    start, end: the top value's span in the buffer (whitespace around it excluded).
    children: one (start, end, run) per direct child, in order, up to `max_children`.
        run == 0: one child; for an object, the span runs from its key to its value.
        run > 0: `run` scalar children in a row, the span without the comma before
        the first (`1,2,3` in an array; `"a":1,"b":2` in an object).
    total: how many children the top value has (all of them, past `max_children` too).
    depth: the deepest nesting of arrays and objects (a scalar is 0).
    """

    kind: int
    start: int
    end: int
    children: list[tuple[int, int, int]]
    total: int
    depth: int


# The scanner's tokens (RFC 8259 sections 2-7), with possessive quantifiers so that no
# pattern ever backtracks: each match costs the bytes it reads, and a failed match
# (an unclosed string, say) is not retried at later offsets. That is what keeps the
# scan linear; the quadratic regex it replaces retried an unclosed string at each `"`.
_WS = rb"[ \t\n\r]*+"
_ESC = rb'|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*+"'
_STR = rb'"(?:[^"\\\x00-\x1f]++' + _ESC
_NUM_LIT = rb"-?+(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][+-]?+[0-9]++)?+|true|false|null"
# One token: 1 "[", 2 "{", 3 a run of closers, 4 a string, 5 a number or literal, 6 ",", 7 ":".
_TOKEN = re.compile(
    _WS + rb"(?:(\[)|(\{)|([\]}]++)|(" + _STR + rb")|(" + _NUM_LIT + rb")|(,)|(:))"
)
# Runs that take many levels or siblings in one step, so that the usual deep shapes cost
# a few matches per KiB. In them a "scalar" is a number, literal, string, or a flat
# array or object (one holding only those): `_push` tells its brackets from the
# levels' openers, which a run never closes.
_S0 = rb"(?:" + _NUM_LIT + rb"|" + _STR + rb")"
_FLAT = (
    # The lookahead (a char class: a few ns a byte) refuses a container that holds one
    # before the full pattern (25 ns a byte) reads it: every level of a deep body.
    rb"(?=[\[{][^\[\]{}]*+[\]}])(?:"
    rb"\[" + _WS + rb"(?:" + _S0 + rb"(?:" + _WS + rb"," + _WS + _S0 + rb")*+)?+" + _WS + rb"\]"
    rb"|\{" + _WS + rb"(?:" + _STR + _WS + rb":" + _WS + _S0
    + rb"(?:" + _WS + rb"," + _WS + _STR + _WS + rb":" + _WS + _S0 + rb")*+)?+" + _WS + rb"\})"
)


class _Runs(typing.NamedTuple):
    descent: re.Pattern[bytes]  # going down: 1 the levels, 2 the scalar that ends them
    turn: re.Pattern[bytes]  # 1 closers, a ",", 2 a member name, 3 levels, 4 a scalar
    siblings: tuple[re.Pattern[bytes], re.Pattern[bytes]]  # ", scalar" in an array, an object


def _runs(scalar: bytes) -> _Runs:
    """The run patterns, for one kind of scalar (see `_FAST` and `_EXACT`)."""
    levels = (  # openers, each followed by the scalar members before its next opener
        rb"(?:\[" + _WS + rb"(?:" + scalar + _WS + rb"," + _WS + rb")++"
        # "[[[" in one step, but not the "[" of an empty "[]" (a scalar)
        rb"|(?:\[(?!\]))++" + _WS + rb"(?:" + scalar + _WS + rb"," + _WS + rb")*+"
        rb"|\{" + _WS + _STR + _WS + rb":" + _WS
        + rb"(?:" + scalar + _WS + rb"," + _WS + _STR + _WS + rb":" + _WS + rb")*+)"
    )
    return _Runs(
        re.compile(_WS + rb"(" + levels + rb"++)(" + scalar + rb")?+"),
        re.compile(
            rb"([\]}]*+)" + _WS + rb"," + _WS + rb"(" + _STR + _WS + rb":" + _WS + rb")?+"
            rb"(" + levels + rb"*+)(" + scalar + rb")?+"
        ),
        (
            re.compile(rb"(?:" + _WS + rb"," + _WS + scalar + rb")++"),
            re.compile(rb"(?:" + _WS + rb"," + _WS + _STR + _WS + rb":" + _WS + scalar + rb")++"),
        ),
    )


# Flat arrays and objects taken as scalars: fewer, longer runs in hostile shapes, but
# the depth then misses their level; `_EXACT` counts every level (for max_depth).
_FAST = _runs(rb"(?:" + _S0 + rb"|" + _FLAT + rb")")
_EXACT = _runs(_S0)
_STR_NB = rb'"(?:[^"\\\x00-\x1f\[\]{},:]++' + _ESC
_NB = rb"(?:" + _NUM_LIT + rb"|" + _STR_NB + rb"|\[\]|\{\})"
_CHILD_SIBLINGS = (
    re.compile(rb"(?:" + _WS + rb"," + _WS + _NB + rb")++"),
    re.compile(rb"(?:" + _WS + rb"," + _WS + _STR_NB + _WS + rb":" + _WS + _NB + rb")++"),
)
_OPEN_ARRAYS = re.compile(rb"\[\[++")
_NOT_QUOTE_OR_BRACKET = bytes(b for b in range(256) if b not in b'"[]{}')
_QUOTED = re.compile(rb'"[^"]*+"')


def _push(stack: bytearray, levels: bytes) -> int:
    """Push the openers of a run's levels; return the state that follows them.

    Bytes operations only (about 1 ms per MiB each) where a regex substitution costs
    a match per string: the run's strings are valid (its pattern read them), so each
    backslash starts an escape, and once escaped backslashes and quotes are gone the
    quotes pair up; with only quotes and brackets kept, a string with no bracket in
    it is `""`, and a flat scalar (no container inside) is `[]` or `{}`."""
    text = levels
    if 0x22 in text:  # '"': strings may hold brackets
        if 0x5C in text:  # "\\"
            text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
        text = text.translate(None, _NOT_QUOTE_OR_BRACKET)
        bare = text.replace(b'""', b"")
        # A quote left: some string holds a bracket (one substitution per string).
        text = bare if 0x22 not in bare else _QUOTED.sub(b"", text)
    else:
        text = text.translate(None, _NOT_QUOTE_OR_BRACKET)
    if 0x5D in text or 0x7D in text:  # "]" or "}": flat scalars, closed in the run
        text = text.replace(b"[]", b"").replace(b"{}", b"")
    stack += text
    return _VALUE_OR_CLOSE if levels.rstrip(b" \t\n\r")[-1] == 0x5B else _VALUE


_WS_ONLY = re.compile(_WS)
_OPENERS_ONLY = bytes(b for b in range(256) if b not in b"[{")
_CLOSING = bytes.maketrans(b"[{", b"]}")
# Scanner states: what may come next.
_VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER = range(6)


def scan_json(buf: bytes, max_children: int = 0, exact_depth: bool = False) -> Scanned:
    """Check that `buf` is one JSON text (RFC 8259) and find its top value's children,
    at any depth, in time linear in `len(buf)` and without recursion.

    The UTF-8 of strings is not checked here (`Codec.decode` checks the whole body).
    `max_children` caps the children listed (0: no cap); `total` counts them all.
    `depth` is exact with `exact_depth`; without, a flat array or object among the
    scalars of a run is not counted (the scan is faster on hostile shapes).
    Raises `NotJson` with the offset where `buf` stops being JSON. The cost is one
    regex match per token, and runs of levels or scalar siblings make one token:
    about 2 us per KiB for deep arrays, up to about 200 for the most hostile deep
    shapes found (benchmarks/RESULTS.md, "Pathological request bodies").
    """
    stack = bytearray()  # "[" or "{" per open container, innermost last
    state = _VALUE
    children: list[tuple[int, int, int]] = []
    count = 0
    cur = 0  # where the top value's current child starts
    top_start = -1
    depth = 0
    pos = 0
    n = len(buf)
    token = _TOKEN.match
    runs = _EXACT if exact_depth else _FAST
    descent = runs.descent.match
    while True:
        level = len(stack)
        if state == _AFTER:
            if not level:
                rest = _WS_ONLY.match(buf, pos)
                if rest is None or rest.end() != n:
                    raise NotJson(pos if rest is None else rest.end())
                break
            if level == 1:
                run = _CHILD_SIBLINGS[stack[0] == 0x7B].match(buf, pos)
                if run is not None:
                    first = buf.index(b",", pos) + 1
                    k = buf.count(b",", first, run.end()) + 1  # _NB holds no ","
                    if not max_children or count < max_children:
                        children.append((first, run.end(), k))
                    count += k
                    pos = run.end()
                    continue
            else:
                run = runs.siblings[stack[-1] == 0x7B].match(buf, pos)
                if run is not None:
                    pos = run.end()
                    continue
                run = runs.turn.match(buf, pos)
                if run is not None:
                    closers = run.group(1)
                    k = len(closers)
                    # Only while it stays below the top value's children, and only
                    # when it is right: else the one-token path says where it is wrong.
                    if (
                        level - k >= 2
                        and stack[level - k:][::-1].translate(_CLOSING) == closers
                        and (stack[level - k - 1] == 0x7B) == (run.group(2) is not None)
                    ):
                        del stack[level - k:]
                        state = _push(stack, run.group(3)) if run.group(3) else _VALUE
                        if run.group(4) is not None:
                            state = _AFTER
                        depth = max(depth, len(stack))
                        pos = run.end()
                        continue
        elif level >= 2 and state <= _VALUE_OR_CLOSE:
            run = _OPEN_ARRAYS.match(buf, pos)  # "[[[[": 300 times cheaper than a descent
            if run is not None:
                stack += run.group()
                depth = max(depth, len(stack))
                state = _VALUE_OR_CLOSE
                pos = run.end()
                continue
            run = descent(buf, pos)
            if run is not None:
                state = _push(stack, run.group(1))
                if run.group(2) is not None:
                    state = _AFTER
                depth = max(depth, len(stack))
                pos = run.end()
                continue
        m = token(buf, pos)
        if m is None:
            raise NotJson(_WS_ONLY.match(buf, pos).end())  # type: ignore[union-attr]
        kind = m.lastindex
        at = m.start(kind)  # type: ignore[arg-type]
        pos = m.end()
        if kind == 1 or kind == 2:  # "[" or "{"
            if state > _VALUE_OR_CLOSE:
                raise NotJson(at)
            if level == 0:
                top_start = at
            elif level == 1 and stack[0] == 0x5B:
                cur = at
            stack.append(0x5B if kind == 1 else 0x7B)
            depth = max(depth, level + 1)
            state = _VALUE_OR_CLOSE if kind == 1 else _KEY_OR_CLOSE
        elif kind == 3:  # "]" and "}"
            closers = m.group(3)
            k = len(closers)
            if state not in (_AFTER, _VALUE_OR_CLOSE, _KEY_OR_CLOSE) or k > level:
                raise NotJson(at)
            if stack[level - k:][::-1].translate(_CLOSING) != closers:
                raise NotJson(at)
            if level >= 2 and level - k <= 1:  # one of them closes a child of the top value
                _child(children, count, max_children, cur, at + level - 1)
                count += 1
            del stack[level - k:]
            state = _AFTER
        elif kind == 4 and state in (_KEY, _KEY_OR_CLOSE):  # a member's name
            if level == 1:
                cur = at
            state = _COLON
        elif kind == 4 or kind == 5:  # a scalar value
            if state > _VALUE_OR_CLOSE:
                raise NotJson(at)
            if level == 0:
                top_start = at
            elif level == 1:
                _child(children, count, max_children, at if stack[0] == 0x5B else cur, pos)
                count += 1
            state = _AFTER
        elif kind == 6:  # ","
            if state != _AFTER or not level:
                raise NotJson(at)
            state = _KEY if stack[-1] == 0x7B else _VALUE
        else:  # ":"
            if state != _COLON:
                raise NotJson(at)
            state = _VALUE
    end = len(buf.rstrip(b" \t\n\r"))
    return Scanned(buf[top_start], top_start, end, children, count, depth)


def _child(children: list[tuple[int, int, int]], count: int, cap: int, start: int, end: int) -> None:
    if not cap or count < cap:
        children.append((start, end, 0))


_MEMBER = re.compile(rb"(" + _STR + rb")" + _WS + rb":" + _WS)


def _member(piece: bytes) -> tuple[str, bytes]:
    """Split one `"key": value` member (as `scan_json` lists it) into key and value."""
    m = _MEMBER.match(piece)
    assert m is not None  # scanned already
    return msgspec.json.decode(m.group(1), type=str), piece[m.end():]


def _too_deep(value: bytes) -> bool:
    try:
        _RAW.decode(value)
    except RecursionError:
        return True
    return False


_RAW = msgspec.json.Decoder(Raw)


def _parser_limit() -> str:
    """The parser's nesting limit, as `data` names it: msgspec stops where Python's
    recursion limit does (less the stack already in use)."""
    return f"the JSON parser's limit of about {sys.getrecursionlimit()} levels"


def _parse_error_too_deep() -> bytes:
    return response_error(
        _NULL,
        error_object(ErrorCode.PARSE_ERROR, data=f"not JSON, and nested deeper than {_parser_limit()}"),
    )


_INVALID_REQUEST_ERROR = error_object(ErrorCode.INVALID_REQUEST)
_INVALID_NULL = response_error(_NULL, _INVALID_REQUEST_ERROR)
_PARSE_ERROR = response_error(_NULL, error_object(ErrorCode.PARSE_ERROR))
_EMPTY_BATCH = _INVALID_NULL  # spec example: `[]` gets one plain -32600

