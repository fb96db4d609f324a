"""HTTP/1.1 messages, sans-IO: status lines, JSON responses, the Date header, and the checks of
a request's Content-Type and Content-Encoding (broker/frontend/http*.py write and read them)."""

from __future__ import annotations

import math
import re
from email.utils import formatdate
from http import HTTPStatus

from broker.jsonrpc import ErrorCode, error_object, response_error
from broker.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

__all__ = [
    "CLOSE", "CONTINUE", "JSON_HEADERS", "JSON_TYPE", "KEEP_ALIVE", "METRICS_HEADERS", "METRICS_TYPE", "PREFLIGHT",
    "RETRY_AFTER_SECONDS", "STATUS_LINES", "TOO_MANY_BODY", "date_header", "error_body", "is_identity", "is_json", "json_response", "retry_after", "status_line",
]

RETRY_AFTER_SECONDS = 1  # on every 503: the queue moves in ms, a worker restarts in seconds
JSON_TYPE = b"application/json"
PREFLIGHT = (
    b"access-control-allow-methods: POST\r\naccess-control-allow-headers: content-type, authorization\r\n"
    b"access-control-max-age: 600\r\n"
)  # (a CORS preflight's answer to an allowed origin: broker/frontend/httprequest.py)


def status_line(code: int) -> bytes:
    """The status line; a 503's carries `retry-after` with it (RFC 9110 10.2.3). (A 429's
    is its caller's own: `retry_after`.)"""
    line = f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\n".encode()
    return (line + b"retry-after: %d\r\n" % RETRY_AFTER_SECONDS) if code == 503 else line


def retry_after(seconds: float) -> bytes:
    """A 429's `retry-after` header line: `seconds` (a rate-limited call's
    `retry_after_seconds`, its bucket's wait for one call) rounded up to whole seconds, 1 at
    least (delta-seconds, RFC 9110 10.2.3; RFC 6585 4). Hostile testing, round 114, M2: it
    was always 1, and at a rate under one call a second a client retrying then was refused
    again."""
    return b"retry-after: %d\r\n" % max(1, math.ceil(seconds))


STATUS_LINES = {
    code: status_line(code)
    for code in (200, 202, 204, 400, 401, 403, 404, 405, 408, 429, 411, 413, 415, 421, 431, 500, 502, 503, 504, 505)
}
JSON_HEADERS = b"content-type: application/json\r\ncontent-length: "
CLOSE = b"connection: close\r\n"
KEEP_ALIVE = b"connection: keep-alive\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
METRICS_TYPE = b"content-type: " + METRICS_CONTENT_TYPE.encode() + b"\r\n"
METRICS_HEADERS = METRICS_TYPE + b"content-length: "


def date_header() -> bytes:
    """The `date` header line for now: ``b"date: Tue, 01 Dec 2026 05:52:03 GMT\\r\\n"``
    (IMF-fixdate, RFC 9110 section 5.6.7)."""
    return b"date: " + formatdate(usegmt=True).encode() + b"\r\n"


def json_response(status: int, body: bytes, keep_alive: bool, extra: bytes, json_head: bytes) -> bytes:
    """A JSON answer; `json_head` is `HttpFrontend.json_head` (date and content-type)."""
    return b"".join(
        (
            STATUS_LINES.get(status) or status_line(status),
            json_head,
            str(len(body)).encode(),
            b"\r\n",
            extra,
            b"" if keep_alive else CLOSE,
            b"\r\n",
            body,
        )
    )


def error_body(code: int, data: object = None) -> bytes:
    return response_error(b"null", error_object(code, data=data))


# (a JSON-RPC error object, as NDJSON's line: a client may read it as the answer to its call)
TOO_MANY_BODY = error_body(ErrorCode.OVERLOADED, "too many connections")


def is_identity(codings: bytes) -> bool:
    """Whether a Content-Encoding value names no content coding: its list elements each
    `identity` or empty (RFC 9110 5.6.1.2: empty elements are ignored; round 35: an empty
    value and ",identity," got 415)."""
    return all(coding.strip().lower() in (b"", b"identity") for coding in codings.split(b","))


def is_json(content_type: bytes | None) -> bool:
    """True if a Content-Type value names application/json: the media type compared
    case-insensitively, parameters (`; charset=utf-8`) allowed (RFC 9110 8.3.1), but a
    charset other than UTF-8, the only one JSON has (RFC 8259 8.1; round 44: `charset=latin1`
    was taken, and its body read as UTF-8), nor parameters that are not tokens or quoted
    strings (RFC 9110 5.6.6: round 83, `charset="utf-8` was taken; round 86, a quoted `;` or
    a quoted pair was read wrong)."""
    if content_type == JSON_TYPE:
        return True
    if content_type is None:
        return False
    media = content_type.partition(b";")[0]
    if media.strip(b" \t").lower() != JSON_TYPE:
        return False
    pos, end = len(media), len(content_type)
    while pos < end:
        found = _PARAMETER.match(content_type, pos)
        if found is None:
            return False
        pos = found.end()
        name, value = found.group(1, 2)
        if name is not None and name.lower() == b"charset":
            if value[:1] == b'"':
                value = _QUOTED_PAIR.sub(rb"\1", value[1:-1])
            if value.lower() not in _UTF8:
                return False
    return True


# One parameter of a media type, its ";" first, or an empty one (RFC 9110 8.3.1, 5.6.2, 5.6.4)
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_PARAMETER = re.compile(rb'[ \t]*;[ \t]*(?:(' + _TOKEN + rb')=(' + _TOKEN + rb'|"(?:[^"\\]|\\.)*"))?[ \t]*')
_QUOTED_PAIR = re.compile(rb"\\(.)", re.DOTALL)
_UTF8 = (b"utf-8", b"utf8")
