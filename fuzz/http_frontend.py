"""Fuzz harness: the HTTP/1.1 front-end, bytes in, through a real `HttpProtocol` in memory.

Input: `harness.plan`'s (flags, pieces). The pieces are what the client sends, fed to the
protocol read by read as the loop would (none while its reading is paused) on a
`frontends.MemoryTransport`, its listener (`HttpFrontend`: Host checks for the loopback names,
one allowed origin, `https://app.example`, and a /metrics body) on an `EchoDispatcher`. Flags
as fuzz/ndjson_frontend.py's: bit 0 EOF after the last piece, bit 1 a client slow to read
(bit 7: slower), bit 2 calls answered in the next loop iteration, bit 3 max_body_bytes 64,
bit 4 max_batch 3, bit 5 max_response_bytes 256, bit 6 max_incoming_bytes 512.

Checked (`frontends`, and here): no exception escapes a call or a loop callback; the loop
idles, and reading is never paused for good; nothing is written after the close; the output is
a sequence of whole HTTP/1.1 responses (`parse_responses`), each of a status the front-end
documents (broker/frontend/httpmsg.py's `STATUS_LINES`, and 100 Continue), with a
content-length (but 1xx and 204), none after one that said `connection: close`; every JSON
body that is JSON-RPC (an object with `jsonrpc`, or an array) is a response or an array of
them (`check_answers`: ids null or from a body the codec decoded, no call answered twice);
every call the dispatcher answered is written, unless its connection was gone first; the
output is at most `AMPLIFICATION` times the input; time is linear in the size.

Run: `python -m fuzz.http_frontend [libFuzzer flags] [CORPUS_DIR]` (`make fuzz` does).
"""

from __future__ import annotations

import re
import typing

from fuzz.harness import instrumented, json_suite, main, spec_bodies, with_plans

with instrumented(__name__ == "__main__"):
    from broker.dispatch import Dispatcher
    from broker.frontend.base import Incoming
    from broker.frontend.http import HttpFrontend, HttpProtocol
    from broker.frontend.httpmsg import STATUS_LINES
    from fuzz.frontends import EchoDispatcher, Flags, RecordingCodec, connection_check

__all__ = ["AMPLIFICATION", "Response", "check", "parse_responses", "seeds"]

AMPLIFICATION = 100  # output bytes an input byte may cause, plus AMPLIFICATION_BASE
AMPLIFICATION_BASE = 8192  # (one /metrics body, a few error answers)
_STATUSES = frozenset(STATUS_LINES) | {100}
_STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*\r\n")


class Response(typing.NamedTuple):
    """One HTTP response of the output: its status, headers (names lower case) and body."""

    status: int
    headers: dict[bytes, bytes]
    body: bytes


def parse_responses(out: bytes) -> list[Response]:
    """The HTTP/1.1 responses `out` holds, in order; raises `AssertionError` if it is not a
    sequence of whole responses. A response with a content-length but followed at once by
    another status line, or by nothing, is an answer to HEAD (no content, RFC 9110 9.3.2)."""
    responses = []
    pos = 0
    while pos < len(out):
        line = _STATUS_LINE.match(out, pos)
        assert line, f"not a status line at byte {pos}: {out[pos:pos + 80]!r}"
        end = out.find(b"\r\n\r\n", line.start())
        assert end >= 0, f"a response head left unfinished: {out[pos:pos + 200]!r}"
        headers: dict[bytes, bytes] = {}
        for field in out[line.end():end].split(b"\r\n") if end > line.end() - 2 else []:
            if not field:
                continue
            name, colon, value = field.partition(b":")
            assert colon, f"a header line without a colon: {field!r}"
            name = name.lower()
            assert name not in headers or name == b"vary", f"header {name!r} given twice"
            headers[name] = value.strip()
        status = int(line.group(1))
        pos = end + 4
        body = b""
        if status >= 200 and status != 204:
            assert b"content-length" in headers, f"a {status} without content-length"
            length = int(headers[b"content-length"])
            if not (length and (pos == len(out) or out.startswith(b"HTTP/1.1 ", pos))):  # (else: a HEAD's answer)
                body = out[pos:pos + length]
                assert len(body) == length, f"a body cut short: {len(body)} of {length} bytes"
                pos += length
        responses.append(Response(status, headers, body))
    return responses


def _make(dispatcher: EchoDispatcher, options: Flags) -> tuple[HttpProtocol, RecordingCodec]:
    fe = HttpFrontend(
        typing.cast(Dispatcher, dispatcher),
        metrics=lambda: b"# HELP fuzz_up A metric.\n# TYPE fuzz_up gauge\nfuzz_up 1\n",
        allowed_origins=("https://app.example",),
        max_body_bytes=options.max_body_bytes,
        max_batch=options.max_batch,
        incoming=Incoming(options.max_incoming_bytes) if options.max_incoming_bytes else None,
    )
    codec = fe.codec = RecordingCodec(options.max_batch)
    return HttpProtocol(fe), codec


def _answers(out: bytes) -> list[bytes]:
    """The JSON-RPC bodies of the responses `out` holds, the responses checked."""
    responses = parse_responses(out)
    answers = []
    for i, response in enumerate(responses):
        assert response.status in _STATUSES, f"status {response.status} not documented"
        if response.headers.get(b"connection") == b"close":
            assert i == len(responses) - 1, "a response after one that said connection: close"
        if response.headers.get(b"content-type", b"").startswith(b"application/json") and (
            response.body.startswith(b"[") or b'"jsonrpc"' in response.body
        ):
            answers.append(response.body)
    return answers


check = connection_check(_make, _answers, (AMPLIFICATION, AMPLIFICATION_BASE), "an `HttpProtocol`")


def _post(body: bytes, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST / HTTP/%s\r\nHost: localhost\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (version, extra, len(body), body))


def _chunked(body: bytes) -> bytes:
    half = len(body) // 2
    parts = [body[:half], body[half:]]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p)
    return (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n")


def seeds() -> list[bytes]:
    """Requests a client sends: POSTs of the specification's example bodies and of some
    JSONTestSuite files (with Content-Length, chunked, pipelined, HTTP/1.0 keep-alive, with
    100-continue, cross-origin), probes and /metrics (GET, HEAD), a CORS preflight, an
    Upgrade, bad requests; each under each chunk plan, a few with other flags."""
    bodies = spec_bodies() + json_suite()[::16]
    requests = [_post(b) for b in bodies]
    requests += [_chunked(b) for b in bodies[:8]]
    requests += [
        _post(bodies[0], b"Connection: keep-alive\r\n", b"1.0"),
        _post(bodies[1], b"Expect: 100-continue\r\n"),
        _post(bodies[2], b"Origin: https://app.example\r\n"),
        _post(bodies[2], b"Origin: https://evil.example\r\n"),
        _post(bodies[3], b"Connection: close\r\n"),
        b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"HEAD /readyz HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"OPTIONS / HTTP/1.1\r\nHost: localhost\r\nOrigin: https://app.example\r\n"
        b"Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: evil.example\r\nContent-Length: 2\r\n\r\n{}",
        b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}",
        b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\r\n",
        b"POST / HTTP/3.0\r\nHost: localhost\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ]
    out: list[bytes] = []
    for request in requests:
        out += with_plans(request, 1)
    pipelined = b"".join(requests[:6]) + requests[-10] + requests[1]
    for flags in (0, 1, 3, 5, 7, 0x25, 0x49, 0x87, 0x11, 0x0D):
        out += with_plans(pipelined, flags)
    return out


if __name__ == "__main__":
    main("http_frontend", check, seeds)
