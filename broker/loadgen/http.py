"""The HTTP/1.1 load connection: keep-alive POSTs with a prebuilt request head, responses
parsed by httptools and matched to requests in order (a FIFO in-flight table), a 503
turning the connection away counted as a refusal, and the requests of an unannounced
close between answers sent again on the next connection.
"""

from __future__ import annotations

import collections
import time

import httptools

from broker.loadgen.connection import LoadConnection, _Record, _Shared
from broker.loadgen.stream import MAX_LINE_BYTES

__all__ = ["MAX_ANSWER_BYTES", "HttpLoadConnection"]

# An answer's body longer than this (a broker's is at most its max_response_bytes, 32 MiB by
# default): malformed, the connection dropped (hostile testing, round 131: an endless chunked
# body, a huge Content-Length or an endless SSE event grew the generator by ~170 MB/s to GBs)
MAX_ANSWER_BYTES = MAX_LINE_BYTES


class _TooLong(Exception):
    """An answer's body passed `MAX_ANSWER_BYTES` (raised from `on_body`, out of the parser)."""

_now = time.monotonic


class HttpLoadConnection(LoadConnection):
    """HTTP/1.1 keep-alive framing: POST requests, httptools response parser; answers
    come in request order, so the in-flight table is a FIFO."""

    __slots__ = ("_body", "_body_len", "_check", "_head", "_keep_alive", "_mid", "_parser", "_queue", "_t_answer")

    def __init__(self, shared: _Shared, phase: float = 0.0, interval: float = 0.0) -> None:
        super().__init__(shared, phase, interval)
        self._queue: collections.deque[_Record] = collections.deque()
        self._inflight = self._queue
        self._push = self._queue.append
        t = shared.target
        host = t.host if ":" not in t.host else f"[{t.host}]"
        # (--token-file: the token in every request, RFC 6750 2.1; checked as a b64token by
        # the command, so it cannot end the header early)
        auth = f"Authorization: Bearer {shared.token}\r\n" if shared.token else ""
        self._head = (f"POST {t.path} HTTP/1.1\r\nHost: {host}:{t.port}\r\n{auth}"
                      "Content-Type: application/json\r\nContent-Length: ").encode()
        self._body: list[bytes] = []
        self._body_len = 0  # bytes of `_body`
        self._parser = httptools.HttpResponseParser(self)
        self._keep_alive = True
        self._mid = False  # part of a response has come (on_message_begin), not all of it
        self._t_answer = 0.0  # arrival of the last complete answer
        self._check = shared.checker.check  # checks (status, body, expect); MCP's checks tool results

    def _frame(self, body: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (self._head, len(body), body)

    def _reset_reader(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._body.clear()
        self._body_len = 0
        self._keep_alive = True
        self._mid = False

    def _fill(self) -> None:
        if self._retry:
            self._resend()
        super()._fill()

    def _resend(self) -> None:
        """Send the requests kept by `_keep_for_retry` again, first, as new bodies (ids
        count up) that keep their start times: their latency includes the reconnect."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._s.stopped:
            return
        s = self._s
        now = _now()
        out: list[bytes] = []
        for t_start in self._retry:
            body, expect = s.workload.body(self._k)
            self._k += 1
            out.append(self._frame(body))
            self._push((t_start, now, expect))
        s.resent += len(self._retry)
        self._retry.clear()
        transport.write(b"".join(out))

    def _keep_for_retry(self) -> int:
        """An unannounced close between answers (HTTP/1.1 lets a server close a keep-alive
        connection at any time, without `Connection: close`): after a complete answer, no
        byte of the next, and every request in flight written after that answer (the
        generator answered the answer with a new request as the server closed). Those
        requests are sent again on the next connection, not counted as lost. Anything
        else (a failure, a cut answer, a request the server had before its last answer)
        is lost: transport errors."""
        queue = self._queue
        if self._failed or self._mid or not self._answered_here or queue[0][1] < self._t_answer:
            return 0
        self._retry.extend(rec[0] for rec in queue)
        return len(queue)

    def on_message_begin(self) -> None:
        self._mid = True

    def data_received(self, data: bytes) -> None:
        self._now = _now()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            tally = self._s.checker.tally
            tally.malformed += 1
            tally.transport_errors += len(self._inflight)
            if isinstance(exc.__context__, _TooLong):
                tally.problem(f"an answer's body longer than {MAX_ANSWER_BYTES} bytes")
            else:
                tally.problem(f"not an HTTP response ({exc or type(exc).__name__}): it began {data[:80]!r}")
            self._inflight.clear()
            self._failed = True  # not a server we can talk to: back off before trying again
            self.abort()
            return
        if self._keep_alive:
            self._fill()
        elif not self._queue and self._transport is not None:
            self._transport.close()  # the server closes after its answer: so do we, and reopen

    def on_body(self, chunk: bytes) -> None:
        self._body_len += len(chunk)
        if self._body_len > MAX_ANSWER_BYTES:
            raise _TooLong
        self._body.append(chunk)

    def on_message_complete(self) -> None:
        chunks = self._body
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._body_len = 0
        status = self._parser.get_status_code()
        if status < 200:  # (1xx: interim, not the answer; RFC 9110 15.2: a client parses and ignores
            return  # it; hostile testing, round 131: each 100 Continue was counted as an answer)
        self._mid = False
        self._t_answer = self._now
        self._answered_here = True
        if not self._parser.should_keep_alive():
            self._keep_alive = False  # the server will close: do not send more here
            self._aborted = True  # and its close is not an error
            if status == 503 and (b'"jsonrpc"' not in body or b'"id":null' in body):
                # Turned away (a broker past its max_connections answers so, before or
                # instead of reading a request: an error with no id, or no JSON-RPC at
                # all): a refused connection, not an answer.
                self._refuse(status, body)
                return
        self._answered(status, body)

    def _refuse(self, status: int, body: bytes) -> None:
        tally = self._s.checker.tally
        tally.transport_errors += 1
        tally.problem(f"the server refused the connection: HTTP {status}, body {body[:120]!r}")
        self._failed = True
        if self._queue:
            self._queue.popleft()  # the request it was sent instead of an answer to

    def _answered(self, status: int, body: bytes) -> None:
        s = self._s
        try:
            t_start, _sent, expect = self._queue.popleft()
        except IndexError:  # an answer nobody asked for
            s.checker.tally.malformed += 1
            s.checker.tally.problem(f"an HTTP response to no request: HTTP {status}, body {body[:120]!r}")
            return
        recording = self._recording(t_start)
        self._check(status, body, expect)
        if recording:
            self._record_latency(t_start)

    def sweep(self, now: float) -> None:
        """Abort the connection if its oldest request is older than the timeout (the
        answers behind it cannot overtake it)."""
        queue = self._queue
        if queue and now - queue[0][1] > self._s.timeout and self._transport is not None:
            self._s.checker.tally.transport_errors += len(queue)
            self._s.checker.tally.problem(f"no answer within --timeout {self._s.timeout:g} s")
            queue.clear()
            self._failed = True
            self.abort()
