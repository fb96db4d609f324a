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
- A too-deep element whose envelope still reads as a valid notification
  (`jsonrpc` "2.0", `method` a string, `params` absent, an array or an object, no
  `id` member) *is* a notification: it is not answered (section 4.1), and since the
  broker cannot forward what the parser cannot read, it is dropped: left out of
  `Body.items` and counted in `Body.dropped` (the dispatcher counts it as a
  notification dropped as invalid_request). An id member too deep is an invalid id:
  that element is answered, with id null.

The slow path is linear in the body: whatever msgspec cannot take (the only bodies
it cannot take are those nested past its limit) goes through `scan_json` (broker/jsonscan.py):
a constant number of passes in C (numpy, then msgspec on parts cut under its limit)
check the body is JSON and find the batch's elements, which are then decoded one by one,
but for those nested too deep: their members are found for all of them at once by array
work on the scan's structure, and they are read in one decode (`_deep_items`).
`benchmarks/pathological.py` measures the worst shapes found.

`response_result` / `response_error` splice a response from raw pieces without
decoding them; `error_object` builds an error object (section 5.1).
"""

from __future__ import annotations

import re
import secrets
import sys
import typing
from enum import IntEnum

import msgspec
from msgspec import Raw

from broker.jsonscan import (
    Members,
    NotJson,
    Scanned,
    batch_members,
    deep_members,
    nesting,
    refused_members,
    scan_json,
)

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


OTHER = "other"  # the metrics' `method` label of calls to no registered method (no app registers it)


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
    RATE_LIMITED = -32005


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
    ErrorCode.RATE_LIMITED: ErrorInfo(
        "Rate limited", 429, "its caller (token, or client address) is past rate_limit; data has retry_after_seconds"
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


class _Envelope(msgspec.Struct, gc=False):
    """The members a too-deep Request object's answer looks at: its id and params
    for the answer, and all four for whether it is a notification (no answer)."""

    jsonrpc: Raw = Raw()
    method: Raw = Raw()
    id: Raw = Raw()
    params: Raw = Raw()


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
    dropped: notifications left out of `items`: valid ones whose params (or another
        member) nest past the parser's limit, which the broker cannot forward and
        must not answer (so a body of only such notifications has no items at all).
    """

    batch: bool
    items: list[Request | bytes]
    status: int = 200
    dropped: int = 0


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


UNPIN_ABOVE = 64 * 1024  # bytes: a larger body's requests get their own copies of id and params


def _unpinned(body: Body) -> Body:
    """Give each request of a large body its own copy of its raw id and params.

    `Raw` values are zero-copy views: a call would otherwise keep its whole request
    body alive until it is answered (a small call padded with 1 MiB of whitespace held
    1 MiB in flight). Bodies up to `UNPIN_ABOVE` are left alone (the copy would cost
    more than it frees), so what calls in flight pin is at most that per call.
    """
    for item in body.items:
        if type(item) is Request:
            item.params = item.params.copy()
            item.id = item.id.copy()
    return body


class Codec:
    """Decodes request bodies; one instance per front-end (decoders are reused).

    max_batch: largest number of elements accepted in a batch.
    """

    __slots__ = ("_decoder", "_element", "_envelope", "_first", "_lax", "_slow", "max_batch")

    def __init__(self, max_batch: int = 1000) -> None:
        self.max_batch = max_batch
        self._decoder = msgspec.json.Decoder(Request | list[Request])
        # Not `list[Raw] | Raw`: msgspec drops `Raw` from a union, so any body that is
        # valid JSON but not an array would be reported as a parse error.
        self._slow = msgspec.json.Decoder(Raw)
        self._element = msgspec.json.Decoder(Request)
        self._lax = msgspec.json.Decoder(_Lax)
        self._envelope = msgspec.json.Decoder(_Envelope)
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
        size = len(body)  # (one len() for the whole call: the hint's check costs no more)
        if size >= _DEEP_HINT_BYTES and _deep_hinted(body):
            hinted = self._decode_hinted(bytes(body))
            if hinted is not None:
                return _unpinned(hinted) if size > UNPIN_ABOVE else hinted
        try:
            decoded = self._decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return _unpinned(self._decode_slow(body)) if size > UNPIN_ABOVE else self._decode_slow(body)
        except RecursionError:  # nested past the parser's limit: so would `_slow` be
            deep = self._decode_deep(bytes(body))
            return _unpinned(deep) if size > UNPIN_ABOVE else deep
        if type(decoded) is list:
            if not decoded:
                return Body(False, [_EMPTY_BATCH], 400)
            if len(decoded) > self.max_batch:
                return self._batch_too_large(len(decoded))
            if _suspect(body):
                # Each element is a Request already: one with an id or params of the wrong
                # type is answered as `_element_item` would, with no second parse (hostile
                # testing, round 8: 1000 ids nested 484 deep, 1 MiB, were parsed three
                # times, 78 ms of the loop; 28 ms now).
                decoded = [
                    req if _valid_id(req.id) and _valid_params(req.params) else _bad_member(req)  # type: ignore[misc]
                    for req in decoded
                ]
            if size > UNPIN_ABOVE:
                return _unpinned(Body(True, decoded))  # type: ignore[arg-type]
            return Body(True, decoded)  # type: ignore[arg-type]
        # One request: looking at its id and params directly is cheaper than the scans.
        req = typing.cast(Request, decoded)
        id_, params = req.id, req.params
        if (not id_ or bytes(id_)[0] in _ID_FIRST) and (not params or bytes(params)[0] in _PARAMS_FIRST):
            return Body(False, [req]) if size <= UNPIN_ABOVE else _unpinned(Body(False, [req]))
        return Body(False, [_bad_member(req)], 400)

    def _decode_hinted(self, body: bytes) -> Body | None:
        """A body with a long run of `[` (see `_DEEP_HINT`), likely nested past the
        parser's limit: msgspec would read up to the deep part before it failed, twice
        (in `decode` and `_decode_slow`), 6 ms each for 1 MiB of members before deep
        params (measured). One scan tells, and is what the deep path needs anyway.
        None when msgspec may read the body after all (the usual path then)."""
        scanned = _scan(body, self.max_batch + 1)
        if type(scanned) is Scanned:
            if scanned.depth > sys.getrecursionlimit() + 1:  # msgspec would fail
                return self._decode_deep(body, scanned)  # and its failures lead here
            return None
        # Not JSON: msgspec's attempts tell which parse error (the one naming the limit
        # when it stops at the limit first), as on the usual path, without a second scan.
        try:
            self._decoder.decode(body)
        except RecursionError:
            return self._decode_deep(body, scanned)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return self._decode_slow(body, scanned)
        return None  # (not reached: msgspec and the scan agree on what is JSON)

    def _batch_too_large(self, n: int | None) -> Body:
        """One -32600 for the whole body; `n` is None when the slow path stopped
        counting past max_batch."""
        size = f"more than {self.max_batch}" if n is None else str(n)
        data = f"batch of {size} elements exceeds max_batch {self.max_batch}"
        return Body(False, [response_error(_NULL, error_object(ErrorCode.INVALID_REQUEST, data=data))], 400)

    def _decode_slow(self, body: bytes | bytearray | memoryview, scanned: Scanned | NotJson | None = None) -> Body:
        """`scanned`: the body's `_scan` when `decode` made one (then not made again)."""
        try:
            whole = self._slow.decode(body)  # checks the whole body is one JSON value
        except RecursionError:  # nested past the parser's limit somewhere
            return self._decode_deep(bytes(body), scanned)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Body(False, [_PARSE_ERROR], 400)
        # `Raw` skips strings without checking their UTF-8; decoding `jsonrpc` or
        # `method` as `str` does check it, and raises DecodeError: not JSON text.
        try:
            if memoryview(whole)[0] != 0x5B:  # not "[": one request
                return _single(self._element_item(whole))
            outer = self._elements(whole)
            if not isinstance(outer, list):
                return self._batch_too_large(outer)
            if not outer:
                return Body(False, [_EMPTY_BATCH], 400)
            return _batch([self._element_item(raw) for raw in outer])
        except RecursionError:  # `_elements` reads the batch a frame deeper than `_slow` did
            return self._decode_deep(bytes(body), scanned)
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

    @typing.overload
    def _element_item(
        self, raw: Raw | bytes, parent: Scanned | None = None, offset: int = 0, defer: typing.Literal[False] = False
    ) -> Request | bytes: ...

    @typing.overload
    def _element_item(
        self, raw: Raw | bytes, parent: Scanned | None, offset: int, defer: typing.Literal[True]
    ) -> Request | bytes | None: ...

    # (`defer` positional: a keyword-only default costs about 40 ns a call, 10 % of
    # answering `{}`, measured.)
    def _element_item(
        self, raw: Raw | bytes, parent: Scanned | None = None, offset: int = 0, defer: bool = False
    ) -> Request | bytes | None:
        """The Request in one element, or the error response for it; `parent` and
        `offset`: the scan of the body that holds `raw`, and where (see `deep_members`).
        `defer`: None for an element msgspec finds nested too deep, whose answer the
        caller makes (`_deep_items`, with the other such elements of its batch)."""
        if memoryview(raw)[0] != 0x7B:  # not "{": not a Request object, no id to read
            return _NOT_AN_OBJECT
        if parent is not None:  # msgspec takes a step of the recursion limit per level
            limit = sys.getrecursionlimit() + 1
            if len(raw) > 2 * limit and nesting(parent, offset, offset + len(raw)) > limit:
                return self._deep_element(bytes(raw), parent, offset)  # spares a decode that fails late
        try:
            # Every member as Raw first: no exception to raise and catch (1 us each)
            # for the usual invalid objects, `{}` or a method that is not a string.
            lax = self._lax.decode(raw)
        except RecursionError:
            return None if defer else self._deep_element(bytes(raw), parent, offset)
        if not (lax.jsonrpc and lax.method and bytes(lax.method)[0] == 0x22):
            return _invalid(lax.id, _envelope_error(lax))
        try:
            req = self._element.decode(raw)
        except msgspec.ValidationError as exc:
            return _invalid(lax.id, _envelope_error(lax, exc))
        if _valid_id(req.id) and _valid_params(req.params):
            return req
        return _bad_member(req)

    def _decode_deep(self, body: bytes, scanned: Scanned | NotJson | None = None) -> Body:
        """The slow path for a body nested past the parser's limit somewhere: one
        linear, non-recursive scan (`scan_json`) checks it is JSON and finds the
        batch's elements; each element then goes through `_element_item` alone, so
        only the element that nests too deep is refused, with its own id.
        `scanned`: the body's `_scan` when `decode` made one already."""
        top = _scan(body, self.max_batch + 1) if scanned is None else scanned
        if type(top) is not Scanned:
            return Body(False, [_parse_error_too_deep()], 400)
        if top.kind != 0x5B:  # one request object (a scalar is never too deep)
            try:
                return _single(self._element_item(body[top.start:top.end], top, top.start))
            except msgspec.DecodeError:
                return Body(False, [_PARSE_ERROR], 400)
        if top.total > self.max_batch:
            return self._batch_too_large(top.total)
        # (No object among the elements: none to read, and no array pass over the body.)
        members = batch_members(top) if any(body[a] == 0x7B for a, _, _ in top.children) else None
        items: list[Request | bytes] = []
        try:
            if members is None:  # no per-byte structure: the elements one by one
                for start, end, run in top.children:
                    if run:  # a run of scalars: invalid Request objects, one answer each
                        items.extend([_NOT_AN_OBJECT] * run)
                    else:
                        items.append(self._element_item(body[start:end], top, start))
                return _batch(items)
            # The elements msgspec reads are decoded one by one; the too-deep ones are
            # answered together (`_deep_items`), and their places filled after.
            limit = sys.getrecursionlimit() + 1
            deep: list[int] = []  # their indexes in top.children
            places: list[int] = []  # and in items
            for k, (start, end, run) in enumerate(top.children):
                if run:
                    items.extend([_NOT_AN_OBJECT] * run)
                    continue
                # An object nested past the limit: no decode, which would fail late.
                if members.depth[k] <= limit:
                    read = self._element_item(body[start:end], None, 0, True)
                    if read is not None:
                        items.append(read)
                        continue
                deep.append(k)
                places.append(len(items))
                items.append(_INVALID_NULL)
        except msgspec.DecodeError:  # msgspec refuses a lone surrogate escape, scan_json not
            return Body(False, [_PARSE_ERROR], 400)
        if deep:
            for place, answer in zip(places, self._deep_items(body, top, members, deep), strict=True):
                items[place] = answer
        return _batch(items)

    def _deep_items(self, body: bytes, top: Scanned, members: Members, deep: list[int]) -> list[bytes]:
        """`_deep_element` for the elements `deep` of a batch (indexes into
        `top.children`, in order), all at once: their members from `members`, one
        array pass for which ones msgspec refuses (`refused_members`), then the
        elements with their deep values replaced, joined into one array for one
        decode; a few Python slices an element (`_deep_element` alone: 140 us an
        element, mostly numpy calls on each element's span)."""
        starts, ends, refused, _ = refused_members(body, members, deep)
        fill = _fill(body)
        children = top.children
        firsts = [children[k][0] for k in deep]
        lasts = [children[k][1] for k in deep]
        # The kept pieces: from an element's start or a replaced value's end, to a
        # replaced value's start or the element's end (all sorted: spans are apart).
        froms = sorted([*firsts, *ends])
        tos = sorted([*starts, *lasts])
        after = dict(zip(starts, [fill if no else b"[]" for no in refused], strict=True))
        joined: list[bytes] = [b""] * (2 * len(froms) - 1)
        joined[0::2] = [body[a:b] for a, b in zip(froms, tos, strict=True)]
        joined[1::2] = [after.get(b, b",") for b in tos[:-1]]
        try:
            found = _ENVELOPES.decode(b"[" + b"".join(joined) + b"]")
        except (RecursionError, msgspec.DecodeError):  # not reached: one at a time, as before
            return [self._deep_element(body[children[k][0]:children[k][1]], top, children[k][0]) for k in deep]
        return [_too_deep_answer(one, fill) for one in found]

    def _deep_element(self, element: bytes, parent: Scanned | None = None, offset: int = 0) -> bytes:
        """The answer to one Request object whose members nest past the parser's
        limit: -32600 with its id when that id is readable and valid, else null;
        `_DROP` (none) when it is a notification (see `_too_deep_answer`).
        The too-deep values are replaced by one string found nowhere in `element` (a
        random one), the other values over 64 levels deep by `[]` (an invalid id, and
        params that do not nest too deep, as they were): msgspec reads the rest, and an
        id or params that reads as that string was too deep (one decode, by msgspec's
        rules for duplicate and escaped names)."""
        starts, ends, refused = deep_members(element, parent, offset)
        fill = _fill(element)
        # The kept pieces with the replacements between them: list work, no loop with
        # a step per member in Python (thousands of members: 4 ms in the loop, measured).
        pieces: list[bytes] = [b""] * (2 * len(starts) + 1)
        pieces[0::2] = [element[a:b] for a, b in zip([0, *ends], [*starts, len(element)], strict=True)]
        pieces[1::2] = [fill if no else b"[]" for no in refused]
        try:
            members = self._envelope.decode(b"".join(pieces))
        except (RecursionError, msgspec.DecodeError):  # not reached: checked already
            return _parse_error_too_deep()
        return _too_deep_answer(members, fill)



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


# A run of `[` this long nests past the parser's default limit unless it is in a string
# (`Codec.decode` then scans before msgspec tries; a quote count tells which). Only a body at
# least this long pays the search (the single-call hot path pays one length check).
_DEEP_HINT = b"[" * 1000
_DEEP_HINT_BYTES = len(_DEEP_HINT)
# The search is for the first run of 99, then whether it goes on to 1000: `bytes.find`
# skips by the needle's length, and from 100 bytes on it prepares the needle each call
# (0.4 us for a batch of 100 calls, 5.5 KB, against 2.3 us for the whole run: measured).
_HINT_START = b"[" * 99


def _deep_hinted(body: bytes | bytearray) -> bool:
    """Whether the body's first run of 99 `[` is one of 1000 (see `_DEEP_HINT`) outside
    strings: an even number of quotes before it, escaped ones not counted (as
    `jsonscan` blanks them). Brackets in a string do not nest: a flat 1 MiB call with
    1000 `[` in a string paid the whole scan before msgspec (19-21 ms against 4-6,
    hostile testing). A body that is not JSON may be judged wrong here: it only
    decides which path tries first, and both give the same answer."""
    at = body.find(_HINT_START)
    if at < 0 or not body.startswith(_DEEP_HINT, at):
        return False
    if body.find(b"\\", 0, at) < 0:
        return not body.count(b'"', 0, at) % 2
    head = body[:at].replace(b"\\\\", b"__").replace(b'\\"', b"__")
    return not head.count(b'"') % 2


def _scan(body: bytes, max_children: int) -> Scanned | NotJson:
    """`scan_json`, with its refusal returned rather than raised."""
    try:
        return scan_json(body, max_children)
    except NotJson as refused:
        return refused


_RAW_LIST = msgspec.json.Decoder(list[Raw])
_ENVELOPES = msgspec.json.Decoder(list[_Envelope])
_MAX_BATCH_STRUCT = 10_000  # past this max_batch, `_elements` decodes `list[Raw]`


def _fill(text: bytes) -> bytes:
    """A JSON string found nowhere in `text`: a random one (2**-128 a try to be there,
    so no real member can read as it)."""
    fill = b'"%s"' % secrets.token_hex(16).encode()
    while fill in text:
        fill = b'"%s"' % secrets.token_hex(16).encode()
    return fill


def _too_deep_answer(members: _Envelope, fill: bytes) -> bytes:
    """The -32600 of a too-deep Request object read with its too-deep values replaced
    by `fill` (`_deep_element`): its id when readable and valid, else null. `_DROP`
    when the object is a notification all the same: no id member, and the envelope
    the fast path would take (`jsonrpc` "2.0", `method` a string, `params` absent or
    an array or object; a too-deep one is a container). Its params are what the
    parser cannot read (or another member is): it cannot be forwarded, and must not
    be answered (spec section 4.1)."""
    if not len(members.id) and _notification(members, fill):
        return _DROP
    id_ = Raw() if bytes(members.id) == fill else members.id  # a deep id: invalid
    what = "params nest" if bytes(members.params) == fill else "the request nests"
    error = error_object(ErrorCode.INVALID_REQUEST, data=f"{what} deeper than {_parser_limit()}")
    return response_error(id_ if len(id_) and _valid_id(id_) else _NULL, error)


def _notification(members: _Envelope, fill: bytes) -> bool:
    """Whether a too-deep Request object without an id member would decode as a
    notification but for its depth: its `jsonrpc` and `method`, read by `Request`'s
    own rules (escapes, types); values over 64 levels deep were replaced by `[]` and
    too-deep ones by `fill`, which no real method can be (see `_fill`)."""
    jsonrpc, method, params = members.jsonrpc, members.method, members.params
    if not (len(jsonrpc) and len(method)) or bytes(method) == fill:
        return False
    if len(params) and memoryview(params)[0] not in _PARAMS_FIRST and bytes(params) != fill:
        return False
    try:
        _ENVELOPE_HEAD.decode(b'{"jsonrpc":%b,"method":%b}' % (jsonrpc, method))
    except (msgspec.ValidationError, msgspec.DecodeError):  # (a lone surrogate: answered, as before)
        return False
    return True


class _Head(msgspec.Struct, gc=False):
    """`Request`'s checked members: what `_notification` decodes."""

    jsonrpc: typing.Literal["2.0"]
    method: str


_ENVELOPE_HEAD = msgspec.json.Decoder(_Head)


def _single(item: Request | bytes) -> Body:
    """The `Body` of a non-batch body of one element (its answer's status, or no
    answer at all for a too-deep notification)."""
    if item is _DROP:
        return Body(False, [], 200, 1)
    return Body(False, [item], 200 if type(item) is Request else 400)


def _batch(items: list[Request | bytes]) -> Body:
    """The `Body` of a batch, its too-deep notifications (`_DROP`) left out and counted."""
    if _DROP not in items:
        return Body(True, items)
    kept = [item for item in items if item is not _DROP]
    return Body(True, kept, 200, len(items) - len(kept))


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


# Why a Request object is invalid, in the -32600's `data` (new user, round 100: a bare
# "Invalid Request" did not say which member was wrong). Fixed strings: nothing sent is echoed.
def _why(reason: str) -> bytes:
    return error_object(ErrorCode.INVALID_REQUEST, data=reason)


_NOT_AN_OBJECT = response_error(_NULL, _why("a Request object is a JSON object (a batch: an array of them)"))
_NO_JSONRPC = _why('member "jsonrpc" missing: it must be "2.0"')
_BAD_JSONRPC = _why('member "jsonrpc" must be "2.0"')
_NO_METHOD = _why('member "method" missing')
_BAD_METHOD = _why('member "method" must be a string')
_TWICE_JSONRPC = _why('member "jsonrpc" given more than once, a copy not "2.0"')
_TWICE_METHOD = _why('member "method" given more than once, a copy not a string')
_BAD_ID = _why('member "id" must be a string, a number or null')
_BAD_PARAMS = _why('member "params" must be an array or an object')
_JSONRPC = msgspec.json.Decoder(typing.Literal["2.0"])


def _invalid(id_: Raw, error: bytes) -> bytes:
    """The -32600 response `error` (an error object) with `id_` when it is valid, else null
    (spec section 5: "If there was an error in detecting the id ... it MUST be Null")."""
    return response_error(id_ if len(id_) and _valid_id(id_) else _NULL, error)


def _bad_member(req: Request) -> bytes:
    """The -32600 response of a Request whose id or params has the wrong type."""
    return _invalid(req.id, _BAD_PARAMS if _valid_id(req.id) else _BAD_ID)


def _envelope_error(lax: _Lax, exc: msgspec.ValidationError | None = None) -> bytes:
    """The error object of a Request object whose `jsonrpc` or `method` is wrong or missing;
    `exc`: `Request`'s refusal, if it was decoded (which names the member at its end)."""
    if not len(lax.jsonrpc):
        return _NO_JSONRPC
    try:
        _JSONRPC.decode(lax.jsonrpc)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _BAD_JSONRPC
    if not len(lax.method):
        return _NO_METHOD
    if memoryview(lax.method)[0] != 0x22:
        return _BAD_METHOD
    # A member given twice, its last copy right and an earlier one wrong: `_Lax` keeps the
    # last, `Request` checks each (hostile testing, round 108: no reason was given).
    where = str(exc).rpartition(" - at ")[2] if exc is not None else ""
    if where == "`$.jsonrpc`":
        return _TWICE_JSONRPC  # (new user, round 101: 'must be "2.0"' read oddly, the last copy "2.0")
    if where == "`$.method`":
        return _TWICE_METHOD
    return _INVALID_REQUEST_ERROR  # (not reached: `Request` checks no other member)
_PARSE_ERROR = response_error(_NULL, error_object(ErrorCode.PARSE_ERROR))
_EMPTY_BATCH = _INVALID_NULL  # spec example: `[]` gets one plain -32600
# The "answer" of a too-deep notification: none. Empty: no real answer is (and `in`,
# which `_batch` uses, finds it by identity or by equality, which agree here).
_DROP = b""

