"""HTTP/1.1 front-end: a connection's answers, written in order, and its close (`Answers`).

`http.HttpProtocol` inherits these methods (a mixin with no state of its own: the
attributes it reads are the connection's, declared in broker/frontend/httpstate.py for the
type checker). Every request routed (broker/frontend/httprequest.py) takes its place in
the connection's `_responses` queue (its entries' types: broker/frontend/httpowed.py): an
`Exchange` (a JSON-RPC body dispatched, whose dispatcher calls back, `_exchange_done`,
when its last answer is in), a `Ready` (finished bytes: `_queue`), a `Scrape` (a GET /metrics, answered from a build once the answers before it
are written: `scrape_built`), or a `Deferred` (a body not dispatched yet). `_flush_ready`
writes from the queue's head every answer finished, so pipelined requests are answered in
the order they came, however their calls finish; an answer with nothing owed before it is
written at once. `_write` writes one (status line, headers and body in one `write`),
counts it by path and status, and closes the connection after one that does not keep it
alive; at the broker's stop, the last answer says `connection: close` (`_closing_form`),
and `stop_close` half-closes.

A request that cannot be read, or is refused before its body is, is answered early and
the connection closes: `_answer_and_close` (400, 408, 431, 505), `_refuse_body` (413 past
max_body_bytes, 503 past max_incoming_bytes); what the request held goes at once
(`_drop_unfinished`), and what the client still sends is discarded (`_discarding`). A
connection of the probes' reserve given up for another (`HttpFrontend.give_up`) is
answered here too: its scrape from the last /metrics build if it waits for one
(`answer_displaced`), else the 503 of a connection refused at accept (`_refuse`).

A client that half-closes after sending (`shutdown(SHUT_WR)`, `nc -N`) gets what it is
owed, then the connection closes. After an error answer the broker half-closes and
discards (lingers, reading on) for at most LINGER_TIMEOUT silent, LINGER_TIME in all, once
its answers are taken; a lingering
connection is idle for `make_room`.
"""

from __future__ import annotations

import typing

from broker.answers import Exchange
from broker.frontend.base import PIPELINE_HIGH, PIPELINE_LOW, unread_bytes
from broker.frontend.httpmsg import CLOSE, TOO_MANY_BODY, error_body, json_response, retry_after
from broker.frontend.httpowed import Deferred, Ready, Scrape
from broker.frontend.httpstate import Close, HttpState
from broker.jsonrpc import ErrorCode

__all__ = ["Answers"]


class Answers(HttpState):
    """The answer side of `http.HttpProtocol`: its answers, written in the order of their
    requests, and its close (see the module docstring)."""

    __slots__ = ()

    def answer_displaced(self) -> bool:
        """Given up by the probes' reserve while owed its one scrape, waiting for its build:
        answer it from the last build, if one is kept, with `connection: close`, and close.
        That build was made before the scrape came, at most one build's pace earlier (ms),
        so its figures are that much older; a 503 would have Prometheus record the target
        down (`up` 0), which clients scraping in a loop could force (hostile testing, round
        8: 8 of them churning the places had 20 of 30 scrapes answered 503). (A scrape
        waits only while builds are paced, and a pace starts with a build, which is kept
        till it ends.) Return False if it is owed something else: refuse it then."""
        responses = self._responses
        if len(responses) != 1 or type(responses[0]) is not Scrape:
            return False
        answer = self._fe.scrape_answer(self._fe.scrape_builds, CLOSE)
        if answer is None:
            return False
        responses.clear()
        self._write(answer, False, "metrics")
        return True

    def _refuse(self, path: str = "other") -> None:
        """Turned away at max_connections: 503 "too many connections", then close;
        `path` labels it in the statuses counter (a request it answers, else "other")."""
        self._fe.refused()
        self._close = self._close or Close.CLOSE
        self._write(json_response(503, TOO_MANY_BODY, False, b"", self._fe.json_head), False, path)

    def _exchange_done(self, exchange: Exchange) -> None:
        if self._transport is None:
            return
        responses = self._responses
        if responses and responses[0] is exchange:
            if len(responses) == 1 and not self.read_paused:  # the common case: nothing else owed
                responses.popleft()
                keep_alive = exchange.context
                if type(keep_alive) is bool:  # no CORS headers: _answer inlined, for speed
                    extra = self._keep_header if keep_alive else b""
                    if exchange.status == 429:
                        extra += retry_after(exchange.retry_after)
                    self._write(
                        json_response(exchange.status, exchange.body(), keep_alive, extra, self._fe.json_head),
                        keep_alive, "rpc",
                    )  # fmt: skip
                    if self._write_paused:  # (ResponseBudget.written, inlined)
                        self._budget.parked += exchange.size
                    else:
                        self._budget.held -= exchange.size
                        self._budget.outgoing.held -= exchange.size
                else:
                    data, keep_alive = self._answer(exchange)
                    self._write(data, keep_alive, path_of(exchange))
            else:
                self._flush_ready()

    def _answer(self, exchange: Exchange) -> tuple[bytes, bool]:
        """The HTTP response to a finished exchange, and whether the connection stays
        open. The caller writes it, then calls `ResponseBudget.written`."""
        context = exchange.context
        if type(context) is tuple:  # an allowed cross-origin call: (keep_alive, CORS headers)
            if len(context) == 3:  # an MCP tools/call: (keep_alive, extra headers, its `mcp.ToolCall`)
                keep_alive, extra, call = context
                if keep_alive:
                    extra += self._keep_header
                body = call.finish(exchange.answers[0] or b"")
                return json_response(200, body, keep_alive, extra, self._fe.json_head), keep_alive
            keep_alive, extra = context
        else:
            keep_alive, extra = bool(context), b""
        if keep_alive:
            extra += self._keep_header
        if exchange.status == 429:
            extra += retry_after(exchange.retry_after)
        return json_response(exchange.status, exchange.body(), keep_alive, extra, self._fe.json_head), keep_alive

    def _deferred_done(self, exchange: Exchange) -> None:
        if self._transport is not None:
            self._flush_ready()

    def scrape_built(self) -> None:
        """The build this connection's next answer waits for is made (`HttpFrontend._scrape_due`)."""
        transport = self._transport
        if transport is not None and self._responses and not transport.is_closing():
            self._flush_ready()

    def _flush_ready(self) -> None:
        if self._parsing and self._fe.draining:
            return  # (at the end of the read's parse: `_write` holds back a last answer till then)
        responses = self._responses
        taken = False  # an RPC answer written with the buffer not full after it: the client keeps up
        while responses:
            head = responses[0]
            if type(head) is Ready:
                data, keep_alive, path = head
            elif type(head) is Scrape:
                if self._write_paused:
                    break  # resume_writing comes back here
                keep_alive = head.keep_alive
                fe = self._fe
                answer = fe.scrape_answer(max(head.build, self._scraped + 1), self._keep_header if keep_alive else CLOSE)
                if answer is None:
                    fe.wait_scrape(self)  # the next build comes back here
                    break
                self._scraped = fe.scrape_builds
                data = answer
                path = "metrics"
            else:
                if type(head) is Deferred:
                    if head.response:  # dispatched: only notifications
                        responses.popleft()
                        self._write(head.response, head.keep_alive, "rpc")
                        if self._transport is None:
                            return
                        continue
                    if head.exchange is None:  # not dispatched yet
                        break
                    exchange = head.exchange
                else:
                    exchange = typing.cast(Exchange, head)
                if exchange.remaining:
                    break
                data, keep_alive = self._answer(exchange)
                responses.popleft()
                self._write(data, keep_alive, path_of(exchange))
                self._budget.written(exchange, self._write_paused)
                taken = not self._write_paused
                if self._transport is None:
                    return
                continue
            responses.popleft()
            self._write(data, keep_alive, path)
            if type(head) is Ready:  # (not a scrape's answer: shared by the connections, not held)
                self._budget.release(len(data), self._write_paused)
            if self._transport is None:
                return
        busy = self._busy
        if busy is not None and not busy.remaining:
            # Done: not kept (hostile testing, round 15: kept with its answer after it
            # was written, 50 idle connections held 3 MB counted nowhere).
            self._busy = busy = None
        if self._waiting and not self._gated() and busy is None:
            # (not from inside the dispatcher's callback; and not while the one dispatched
            # last runs: its answer comes back here. Hostile testing, round 14: scheduled
            # each loop turn meanwhile, a core spun for as long as that call ran)
            self._fe.loop.call_soon(self._dispatch_waiting)
        elif not responses or taken:  # (owed nothing, or took an answer at once: round 27, not merely
            self._one_by_one = False  # "not paused now", which it always is after resume_writing)
        if len(responses) < PIPELINE_LOW:
            if self._backlog and not self._write_paused:
                self._schedule_turn()  # (held by what was owed: `_feed_turn`)
            elif self.read_paused:
                self._maybe_resume()

    def _write(self, data: bytes, keep_alive: bool, path: str) -> None:
        """Write one response; `path` is its label in the statuses counter (`PATHS`)."""
        transport = self._transport
        if transport is None:
            return
        fe = self._fe
        if (
            keep_alive and fe.draining and not self._responses and not self.request_started and not self._backlog
            and not self._unread  # (bytes received before the stop still to be read: not the last answer)
        ):  # fmt: skip
            if self._parsing:  # more requests may follow in this read: decided once it is parsed
                self._responses.append(Ready(data, keep_alive, path))
                self._budget.hold(len(data))
                return
            # The last answer before the stop closes the connection: say so (RFC 9112 9.6),
            # or a client pool would send its next request on it, to be discarded (hostile
            # testing: http.client's next POST got RemoteDisconnected, ran or not)
            data, keep_alive = self._closing_form(data), False
        transport.write(data)
        fe.sent_bytes += len(data)
        self.sent += len(data)
        counts = fe.statuses[path]  # by path, then status: no tuple per answer
        status = data[9:12]
        counts[status] = counts.get(status, 0) + 1
        self.last_active = fe.loop.time()  # idle time counts from the last answer
        if not keep_alive:
            self._close = self._close or Close.CLOSE  # (LINGER stays)
            self._responses.clear()
            self._drop_unfinished()
            fe.recount()  # (a request under way it was answered early is not waited for: `held`)
            if (self._close is Close.LINGER or fe.draining or unread_bytes(transport)) and (
                not self._eof and not self._probe_only and transport.can_write_eof()
            ):
                # An answer before the request was read, or with bytes the client sent after
                # it still unread (hostile testing, round 137: a front-end resumed after a
                # stop read its worker's answer before them): closing now would reset the
                # connection under a client still sending, and it might never see the
                # answer. Half-close and keep discarding its bytes (nginx's lingering
                # close); the client closes, or the sweep does after LINGER_TIMEOUT
                # silent or LINGER_TIME in all; make_room may close it sooner. (The
                # probes' reserve is not held that long: closed at once.)
                transport.write_eof()
                self.lingering_since = self.last_active
                # Read on, discarding, even while the answers before it still leave (reading
                # was paused for them): a client still sending was left unread, looked
                # silent, and was closed with its bytes unread, a reset that cut the answer
                # it was taking at 400 KB/s (hostile testing, round 23).
                self._discarding()
            else:
                transport.close()
        elif self._eof and not self._responses and not self.request_started and not self._backlog:
            transport.close()

    def _closing_form(self, response: bytes) -> bytes:
        """`response` (a keep-alive answer: status line, headers, body) saying
        `connection: close` instead."""
        head, _, body = response.partition(b"\r\n\r\n")
        if self._keep_header:  # (HTTP/1.0: "connection: keep-alive")
            head = head.replace(b"\r\n" + self._keep_header[:-2], b"")
        return head + b"\r\n" + CLOSE + b"\r\n" + body

    def stop_close(self) -> None:
        """Close for the broker's stop. Requests may still be on their way unread
        (pipelined, or in the kernel while reading was paused), and a close with bytes
        unread resets the connection (RST), which drops the answers its client has not
        taken yet. So half-close after what is written, and read on, discarding, as a
        lingering close does: the client reads to the end, then closes."""
        transport = self._transport
        if transport is None:
            return
        if self._eof or not transport.can_write_eof():
            transport.close()
            return
        self._close = self._close or Close.CLOSE
        transport.write_eof()
        self.lingering_since = self.last_active
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()

    def _drop_unfinished(self) -> None:
        """The connection closes after an answer: what an unfinished request holds (its
        body, counted in max_incoming_bytes) goes now, not when the answer is written nor
        when the lingering close ends (hostile testing, round 9: 900 kB of a body answered
        400 or 408 stayed held for the 30 s of its linger; round 10: for as long as a slow
        call it waited behind)."""
        self._request.body = b""
        if self._incoming:
            self._fe.incoming.hold(self._incoming, 0)
            self._incoming = 0

    def _queue(self, response: bytes, keep_alive: bool, path: str) -> None:
        """Write a finished response now, or after those owed before it: then it counts in
        the connection's `ResponseBudget` (and max_outgoing_bytes) until written, and
        reading pauses past PIPELINE_HIGH owed, as for calls (hostile testing, round 9:
        1000 connections each owing a slow call, then pipelining requests answered 421
        behind it and never reading, held 500 MB counted nowhere)."""
        if not self._responses:
            self._write(response, keep_alive, path)
        else:
            self._responses.append(Ready(response, keep_alive, path))
            self._budget.hold(len(response))
            if not keep_alive:  # (an early answer: 400, 413, 431...)
                self._drop_unfinished()
            if len(self._responses) > PIPELINE_HIGH:
                self._pause()

    def _queue_plain(
        self, status: int, message: bytes, keep_alive: bool, path: str, extra: bytes = b"", head: bool = False
    ) -> None:
        body = b'{"error":"' + message + b'"}'
        if keep_alive:
            extra += self._keep_header
        response = json_response(status, body, keep_alive, extra, self._fe.json_head)
        if head:  # a HEAD answer has the headers of the GET answer and no body (RFC 9110 9.3.2)
            response = response[: len(response) - len(body)]
        self._queue(response, keep_alive, path)

    def _queue_invalid(self, status: int, data: str, keep_alive: bool, path: str, cors: bytes = b"") -> None:
        """Queue an Invalid Request error object (id null) whose `data` says why, as `status`;
        `path` is its label in the statuses counter (`PATHS`); `cors`: the CORS headers of an
        allowed Origin (round 34: a 415 to one had none, and the page could not read why)."""
        body = error_body(ErrorCode.INVALID_REQUEST, data)
        extra = (self._keep_header if keep_alive else b"") + cors
        self._queue(json_response(status, body, keep_alive, extra, self._fe.json_head), keep_alive, path)

    def _answer_and_close(self, status: int, message: bytes) -> None:
        """Answer an unreadable request and close (lingering: it may still be sending)."""
        self._close = Close.LINGER
        self.request_started = 0.0
        self._queue_plain(status, message.replace(b'"', b"'"), False, "other", head=self._head_request())
        self._discarding()

    def _head_request(self) -> bool:
        """Whether the request under way is a HEAD, its request line read: its answer has
        no content, even an error's (RFC 9110 9.3.2; hostile testing, round 30: a 413, 505
        or 400 that closed the connection had one)."""
        return bool(self._request.url) and self._parser.get_method() == b"HEAD"

    def _discarding(self) -> None:
        """Its input is discarded from now on (`_close` not KEEP): read on, never paused again, so
        that a client blocked mid-send (a refused body it goes on uploading) can take the
        answers owed before it; paused, it took none, and send_timeout reset it, cutting
        them (hostile testing, round 24: an answer of 8 MB cut at 128 kB)."""
        if self.read_paused and self._transport is not None:
            self.read_paused = False
            self._transport.resume_reading()

    def _refuse_body(self, status: int = 413, body: bytes | None = None, code: int = ErrorCode.INVALID_REQUEST) -> None:
        """`status` with the error response `body` (413: past max_body_bytes; 503: past
        max_incoming_bytes) before the rest of the body is read, then close (lingering);
        counted as an answer `code`. To a path other than rpc_path, a plain error."""
        req = self._request
        fe = self._fe
        self._close = Close.LINGER  # (before the answer is written: `_write` half-closes)
        self.request_started = 0.0
        path = self._path_of(req.url.partition(b"?")[0])
        if self._head_done and path == "rpc" and self._may_call():  # (round 27: one a web page sent past
            # max_body_bytes moved the JSON-RPC counters; round 28: so did a head under way, whose path
            # is not known yet, to /healthz as well)
            cors = b"" if req.origin is None else fe.cors_headers(req.origin) or b""  # (round 34: a page
            self._queue(json_response(status, body or fe.too_large_body, False, cors, fe.json_head), False, path)
            fe.dispatcher.count_refused_body(code)  # allowed to call could not read why, as for 415)
        else:  # Not JSON-RPC: a plain error, counted by its path and status only (hostile
            # testing, round 26: a body sent to /healthz got a -32600 error object, and
            # anyone could move rpc_broker_calls_total and errors_total without JSON-RPC).
            self._queue_plain(status, fe.refused_plain[status], False, path, head=self._head_request())
        self._discarding()

    def request_timed_out(self) -> None:
        """Called by the sweep: the request under way took longer than request_timeout
        to arrive; answer 408 and close (RFC 9110 15.5.9)."""
        if self._close:  # a request pipelined after `Connection: close`: never answered
            self.request_started = 0.0
            return
        self._answer_and_close(408, b"request not received within request_timeout %g s" % self._fe.request_timeout)


def path_of(exchange: Exchange) -> str:
    """The `path` label of an exchange's answer: "mcp" for an MCP tools/call's (its context a 3-tuple), else "rpc"."""
    context = exchange.context
    return "mcp" if type(context) is tuple and len(context) == 3 else "rpc"
