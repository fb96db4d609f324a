"""Fuzz harness: the JSON-RPC codec (`broker.jsonrpc.Codec.decode`), bytes in, a `Body` out.

The input is one request body, as an HTTP POST body or an NDJSON line. It is decoded by two
codecs (max_batch 1000, the default, and 3, so that the batch limit is met by short inputs),
and each `Body` is checked:

- `decode` raises nothing (its contract: bad input is answered, never raised);
- each item is a `Request` (method a str, id empty or a valid id, params empty, an array or an
  object) or a JSON-RPC error response (`{"jsonrpc":"2.0","id":...,"error":{code, message}}`)
  with the codec's own codes only (-32700, -32600);
- every id (a request's or an error response's) is null or bytes the input carried;
- against a reference, Python's strict `json` module: input that is not JSON (or not UTF-8) is
  one -32700; an array is a batch of as many answers in order (one -32600 for `[]` or past
  max_batch); each element is a Request exactly when the JSON-RPC 2.0 specification
  (section 4) says it is one, and an invalid element's answer echoes its id when that id is
  a string, a number or null, else null (section 5). Elements with a Request member given
  twice, or nested past 400 levels (the parser's limit is about 1000: the codec then answers
  or drops them by its own documented rules), are checked only by the rules above;
- the error answers made are at most `AMPLIFICATION` times the input (memory linear in the
  size), and time is linear in the size (`harness.timed`).

Run: `python -m fuzz.jsonrpc_codec [libFuzzer flags] [CORPUS_DIR]` (`make fuzz` does).
"""

from __future__ import annotations

import json
import sys
import typing

import msgspec

from fuzz.harness import instrumented, json_suite, main, spec_bodies, timed

with instrumented(__name__ == "__main__"):
    from broker.jsonrpc import Body, Codec, ErrorCode, Request

__all__ = ["AMPLIFICATION", "check", "seeds"]

# Bytes of error answers an input byte may make, plus a constant (memory linear in the size):
# an invalid element of 2 bytes (`1,`) is answered with about 120 (a -32600 saying why).
AMPLIFICATION = 100
AMPLIFICATION_BASE = 4096

_CODECS = (Codec(), Codec(max_batch=3))
_DEEP = 400  # levels: past this the reference leaves an element's classification to the codec
_MEMBERS = ("jsonrpc", "method", "params", "id")


class _Error(msgspec.Struct, forbid_unknown_fields=True):
    code: int
    message: str
    data: msgspec.Raw = msgspec.Raw()


class _Response(msgspec.Struct, forbid_unknown_fields=True):
    jsonrpc: typing.Literal["2.0"]
    id: msgspec.Raw
    error: _Error


_RESPONSE = msgspec.json.Decoder(_Response)
_CODEC_CODES = (ErrorCode.PARSE_ERROR, ErrorCode.INVALID_REQUEST)


class _Object(dict[str, object]):
    """A JSON object of the reference, with whether a Request member was given twice."""

    twice = False


def _pairs(pairs: list[tuple[str, object]]) -> _Object:
    obj = _Object(pairs)
    names = [k for k, _ in pairs if k in _MEMBERS]
    obj.twice = len(names) != len(set(names))
    return obj


def _no_constant(name: str) -> typing.NoReturn:
    raise ValueError(f"{name} is not JSON")


class _Skip(Exception):
    """The reference cannot say (nested past Python's recursion limit, lone surrogates)."""


def _reference(data: bytes) -> tuple[bool, object]:
    """(is JSON, its value) by Python's json module, strict: UTF-8 only, no NaN/Infinity."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False, None
    if "\\u" in text.lower() and any(f"\\u{p}" in text.lower() for p in ("d8", "d9", "da", "db", "dc", "dd", "de", "df")):
        raise _Skip  # a surrogate escape: msgspec refuses a lone one, Python's json takes it
    try:
        return True, json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant)
    except RecursionError:
        raise _Skip from None
    except ValueError:
        return False, None


def _depth(value: object) -> int:
    """Nesting depth of a reference value (iterative: it may be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v)
    return deepest


def _valid_id(value: object) -> bool:
    return value is None or (isinstance(value, (str, int, float)) and not isinstance(value, bool))


def _is_request(element: object) -> bool:
    """Whether a reference value is a valid Request object (spec section 4)."""
    if not isinstance(element, dict):
        return False
    if element.get("jsonrpc") != "2.0" or not isinstance(element.get("method"), str):
        return False
    if "params" in element and not isinstance(element["params"], (list, dict)):
        return False
    return "id" not in element or _valid_id(element["id"])


def _same(raw: bytes, value: object) -> bool:
    """Whether raw JSON `raw` reads as `value` (numbers compared as Python does)."""
    return bool(json.loads(raw) == value)


def _check_item(data: bytes, item: Request | bytes) -> None:
    """The rules every item obeys, whatever the reference says."""
    if type(item) is Request:
        assert isinstance(item.method, str)
        raw_id, params = bytes(item.id), bytes(item.params)
        assert not raw_id or raw_id[0] in b'"-0123456789n', raw_id
        assert not params or params[0] in b"[{", params
        assert not raw_id or raw_id in data, f"request id {raw_id!r} not in the input"
        assert not params or params in data, "params not in the input"
        return
    assert type(item) is bytes, type(item)
    response = _RESPONSE.decode(item)  # raises if not an error response
    assert response.error.code in _CODEC_CODES, response.error.code
    raw_id = bytes(response.id)
    assert raw_id == b"null" or raw_id in data, f"error response id {raw_id!r} not in the input"
    assert raw_id[0] in b'"-0123456789n', raw_id


def _code(item: Request | bytes) -> int:
    assert type(item) is bytes, f"expected an error response, got {item!r}"
    return _RESPONSE.decode(item).error.code


def _check_element(element: object, item: Request | bytes, shallow: bool) -> None:
    """One element against the reference's verdict (`shallow`: its whole body nests _DEEP levels at most)."""
    if (isinstance(element, _Object) and element.twice) or (not shallow and _depth(element) > _DEEP):
        return  # the codec's own rules (msgspec checks each copy of a member; the depth limit)
    if _is_request(element):
        assert type(item) is Request, f"a valid Request answered {item!r}"
        assert isinstance(element, dict)
        assert item.method == element["method"]
        if "id" in element:
            assert _same(bytes(item.id), element["id"]), (bytes(item.id), element["id"])
        else:
            assert not item.id, bytes(item.id)
        return
    assert _code(item) == ErrorCode.INVALID_REQUEST
    raw_id = bytes(_RESPONSE.decode(typing.cast(bytes, item)).id)
    if isinstance(element, dict) and "id" in element and _valid_id(element["id"]):
        assert _same(raw_id, element["id"]), (raw_id, element["id"])
    else:
        assert raw_id == b"null", raw_id


def _check_body(data: bytes, body: Body, max_batch: int, reference: tuple[bool, object] | None) -> None:
    """`body`, decoded from `data`, against the rules and `reference` (None: it cannot say)."""
    assert body.status in (200, 400), body.status
    made = 0
    for item in body.items:
        _check_item(data, item)
        made += len(item) if type(item) is bytes else 0
    assert made <= AMPLIFICATION * len(data) + AMPLIFICATION_BASE, (made, len(data))
    if not body.batch:
        assert len(body.items) + body.dropped == 1, body
        if body.items:
            assert body.status == (200 if type(body.items[0]) is Request else 400), body
    if reference is None:
        return
    is_json, value = reference
    if not is_json:
        assert not body.batch and len(body.items) == 1, body
        assert _code(body.items[0]) == ErrorCode.PARSE_ERROR, body.items[0]
        return
    depth = _depth(value)
    if isinstance(value, list):
        if not value or len(value) > max_batch:
            if depth <= _DEEP:
                assert not body.batch and len(body.items) == 1, body
                assert _code(body.items[0]) == ErrorCode.INVALID_REQUEST, body.items[0]
            return
        if depth > sys.getrecursionlimit() // 2 and not body.batch:
            return  # (too deep to read at all: the codec's documented -32700 or -32600)
        assert body.batch, body
        assert len(body.items) + body.dropped == len(value), (len(body.items), body.dropped, len(value))
        if not body.dropped:
            for element, item in zip(value, body.items, strict=True):
                _check_element(element, item, depth <= _DEEP)
        return
    assert not body.batch
    if body.items:
        _check_element(value, body.items[0], depth <= _DEEP)


def _check(data: bytes) -> int:
    try:
        reference: tuple[bool, object] | None = _reference(data)
    except _Skip:
        reference = None
    for codec in _CODECS:
        _check_body(data, codec.decode(data), codec.max_batch, reference)
    return 1


check = timed(_check)
check.__doc__ = """Decode `data` (one request body) with each codec and check the invariants of
this module's docstring; raises `AssertionError` (`harness.SlowInput` if too slow)."""


def seeds() -> list[bytes]:
    """The JSONTestSuite parsing files, the JSON-RPC specification's example bodies, and bodies
    nested past the parser's limit (about 1000 levels: the codec's slow paths, jsonscan.py):
    deep params, a deep id, a deep notification, each alone and in a batch beside a valid call."""
    deep = b"[" * 1100 + b"]" * 1100
    call = b'{"jsonrpc":"2.0","method":"a","params":[1],"id":7}'
    shapes = [
        b'{"jsonrpc":"2.0","method":"a","params":%s,"id":1}' % deep,
        b'{"jsonrpc":"2.0","method":"a","id":%s}' % deep,
        b'{"jsonrpc":"2.0","method":"a","params":%s}' % deep,
        b'{"jsonrpc":"2.0","method":"a","params":{"x":%s},"id":"s"}' % deep,
    ]
    nested = [*shapes, b"[" + b",".join([call, *shapes]) + b"]", b"[" + call + b"," + deep + b"]", b"[" * 1100]
    return json_suite() + spec_bodies() + nested


if __name__ == "__main__":
    main("jsonrpc_codec", check, seeds)
