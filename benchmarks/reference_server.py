"""The benchmark's reference: one Python process answering JSON-RPC 2.0 inline.

Usage: python benchmarks/reference_server.py [--host 127.0.0.1] [--port 0]

uvloop + httptools + msgspec, no workers and no framework: the practical ceiling of one
Python process, which `benchmarks/run.py` compares the broker with. It serves the demo's
`add(a, b)`, `fib(n)` (0..35) and async `sleep(seconds)` (0..3600) with correct JSON-RPC 2.0:
single calls, notifications (a body of only notifications gets 204), batches answered in
request order, params by position or by name, and ids echoed byte for byte. HTTP/1.1
keep-alive and pipelining are safe: answers leave a connection in request order even when
a `sleep` finishes after a later request, and everything produced by one read goes out in
one write. Once listening it prints `serving JSON-RPC on http://HOST:PORT/` to stderr
(the broker's own line, so one launcher reads both); SIGTERM or SIGINT stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections import deque
from collections.abc import Awaitable, Callable

import httptools
import msgspec
import uvloop

NO_ID = msgspec.Raw(b"")  # `id` absent: a notification


class Request(msgspec.Struct):
    jsonrpc: str
    method: str
    params: msgspec.Raw = NO_ID
    id: msgspec.Raw = NO_ID


_decode = msgspec.json.Decoder(Request | list[Request]).decode
_decode_any = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_as_request = msgspec.json.Decoder(Request).decode


class CallError(Exception):
    def __init__(self, code: int, message: str) -> None:
        self.error = _encode({"code": code, "message": message})


def _args(params: msgspec.Raw, names: tuple[str, ...]) -> list[object]:
    """Positional arguments from raw params given by position or by name."""
    value = _decode_any(params) if params else []
    if isinstance(value, dict):
        if set(value) != set(names):
            raise CallError(-32602, "Invalid params")
        return [value[n] for n in names]
    if not isinstance(value, list) or len(value) != len(names):
        raise CallError(-32602, "Invalid params")
    return value


def _number(x: object) -> float | int:
    if type(x) is int or type(x) is float:
        return x
    raise CallError(-32602, "Invalid params")


def add(params: msgspec.Raw) -> object:
    a, b = _args(params, ("a", "b"))
    return _number(a) + _number(b)


def _fib(n: int) -> int:
    return n if n < 2 else _fib(n - 1) + _fib(n - 2)


def fib(params: msgspec.Raw) -> object:
    (n,) = _args(params, ("n",))
    if type(n) is not int or not 0 <= n <= 35:
        raise CallError(-32602, "Invalid params")
    return _fib(n)


def sleep(params: msgspec.Raw) -> Awaitable[object]:
    (seconds,) = _args(params, ("seconds",))
    if not 0 <= _number(seconds) <= 3600:
        raise CallError(-32602, "Invalid params")
    return _sleep(_number(seconds))


async def _sleep(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


METHODS: dict[str, Callable[[msgspec.Raw], object]] = {"add": add, "fib": fib, "sleep": sleep}
ASYNC = {"sleep"}


def _reply(id_: bytes, result: object) -> bytes:
    return b'{"jsonrpc":"2.0","id":' + id_ + b',"result":' + _encode(result) + b"}"


def _error(id_: bytes, error: bytes) -> bytes:
    return b'{"jsonrpc":"2.0","id":' + id_ + b',"error":' + error + b"}"


def _invalid() -> bytes:
    return _error(b"null", CallError(-32600, "Invalid Request").error)


async def _finish(id_: bytes, awaitable: Awaitable[object]) -> bytes | None:
    try:
        result = await awaitable
    except CallError as e:
        return _error(id_, e.error) if id_ else None
    return _reply(id_, result) if id_ else None


def call(req: Request) -> bytes | Awaitable[bytes | None] | None:
    """The answer to one request: bytes, None (notification) or an awaitable of either."""
    id_ = bytes(req.id)
    if req.jsonrpc != "2.0" or id_[:1] in (b"{", b"[", b"t", b"f") or (
            req.params and bytes(req.params)[:1] not in (b"[", b"{")):
        return _invalid()
    fn = METHODS.get(req.method)
    try:
        if fn is None:
            raise CallError(-32601, "Method not found")
        result = fn(req.params)
    except CallError as e:
        return _error(id_, e.error) if id_ else None
    except Exception:  # a bug here must not take the connection down
        return _error(id_ or b"null", CallError(-32603, "Internal error").error)
    if req.method in ASYNC:
        return _finish(id_, result)  # type: ignore[arg-type]
    return _reply(id_, result) if id_ else None


async def _gather(parts: list[bytes | asyncio.Future[bytes | None] | None]) -> bytes | None:
    return _join([await p if isinstance(p, asyncio.Future) else p for p in parts])


def _join(parts: list[bytes | None]) -> bytes | None:
    answers = [p for p in parts if p is not None]
    return b"[" + b",".join(answers) + b"]" if answers else None


def handle(body: bytes) -> bytes | Awaitable[bytes | None] | None:
    """The JSON-RPC answer to one HTTP body (None: nothing to answer)."""
    try:
        decoded = _decode(body)
    except msgspec.DecodeError:
        try:
            value = _decode_any(body)
        except msgspec.DecodeError:
            return _error(b"null", CallError(-32700, "Parse error").error)
        if not isinstance(value, list) or not value:
            return _invalid()
        decoded = []  # a batch with invalid elements: take them one at a time
        for item in value:
            try:
                decoded.append(_as_request(_encode(item)))
            except msgspec.DecodeError:
                decoded.append(None)  # type: ignore[arg-type]
    if isinstance(decoded, Request):
        return call(decoded)
    if not decoded:
        return _invalid()
    parts = [call(r) if r is not None else _invalid() for r in decoded]
    if any(not isinstance(p, bytes | None) for p in parts):  # start every async call now, together
        return _gather([p if isinstance(p, bytes | None) else asyncio.ensure_future(p) for p in parts])
    return _join(parts)  # type: ignore[arg-type]


def _http(status: bytes, body: bytes, keep_alive: bool) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + (b"\r\n\r\n" if keep_alive else b"\r\nConnection: close\r\n\r\n") + body)


class HttpConnection(asyncio.Protocol):
    """One client connection: httptools parses, answers leave in request order."""

    __slots__ = ("body", "closing", "keep_alive", "out", "parser", "queue", "transport")

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.out: list[bytes] = []  # answers produced during this read, written once
        self.queue: deque[bytes | asyncio.Future[bytes | None]] = deque()  # in order, when one is pending
        self.closing = False
        self.keep_alive = True
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._push(_http(b"400 Bad Request", b"", False))
            self.closing = True
        if self.out:
            self.transport.writelines(self.out)  # type: ignore[union-attr]
            self.out = []
        if self.closing and not self.queue:
            self.transport.close()  # type: ignore[union-attr]

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, chunk: bytes) -> None:
        self.body.append(chunk)

    def on_message_complete(self) -> None:
        keep = self.parser.should_keep_alive()
        if not keep:
            self.closing = True
        if self.parser.get_method() != b"POST":
            self._push(_http(b"405 Method Not Allowed", b"", keep))
            return
        answer = handle(b"".join(self.body))
        if isinstance(answer, bytes):
            self._push(_http(b"200 OK", answer, keep))
        elif answer is None:
            self._push(b"HTTP/1.1 204 No Content\r\n" + (b"\r\n" if keep else b"Connection: close\r\n\r\n"))
        else:
            fut = asyncio.ensure_future(answer)
            fut.add_done_callback(lambda f: self._done(f, keep))
            self.queue.append(fut)

    def _push(self, response: bytes) -> None:
        if self.queue:
            self.queue.append(response)
        else:
            self.out.append(response)

    def _done(self, fut: asyncio.Future[bytes | None], keep: bool) -> None:
        if fut.cancelled():  # the connection was lost
            return
        body = fut.result()
        index = self.queue.index(fut)
        self.queue[index] = (_http(b"200 OK", body, keep) if body is not None else
                             b"HTTP/1.1 204 No Content\r\n" + (b"\r\n" if keep else b"Connection: close\r\n\r\n"))
        ready: list[bytes] = []
        while self.queue and isinstance(self.queue[0], bytes):
            ready.append(self.queue.popleft())  # type: ignore[arg-type]
        if ready and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(ready)
            if self.closing and not self.queue:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        for item in self.queue:
            if isinstance(item, asyncio.Future):
                item.cancel()
        self.queue.clear()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(HttpConnection, host, port, backlog=4096)
    bound = server.sockets[0].getsockname()
    print(f"reference: serving JSON-RPC on http://{bound[0]}:{bound[1]}/", file=sys.stderr, flush=True)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: None if stop.done() else stop.set_result(None))
    await stop
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
