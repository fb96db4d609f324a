"""HTTP/1.1 front-end: what a request is owed, in its place in the connection's answers (`Owed`).

Every request routed takes one place in its connection's `_responses` queue, in the
order the requests came, and keeps it until its answer is written
(broker/frontend/httpanswer.py, `_flush_ready`): so pipelined requests are answered in
order, however their calls finish. A place holds one of four types, told apart by
`type()` (one test per answer, no method call):

    Exchange   a JSON-RPC body dispatched: the dispatcher's own record
               (broker/answers.py), queued bare, as the hot path has it (no record a
               request besides it); written once its last answer is in
    Ready      a finished answer (404, 405, 415, /healthz...) owed after those before
               it: counted in the connection's `ResponseBudget` until written
    Scrape     a GET /metrics: answered from a build made once the answers before it
               are written (`HttpFrontend.scrape_answer`)
    Deferred   a JSON-RPC body not dispatched yet (`_waiting`): its client fell behind
               or was owed max_response_bytes; then its Exchange, or a 204 if it owed
               nothing
"""

from __future__ import annotations

import typing

from broker.answers import Exchange

if typing.TYPE_CHECKING:
    from broker.frontend.mcp import ToolCall
    from broker.ratelimit import Bucket

__all__ = ["Deferred", "Owed", "Ready", "Scrape"]


class Ready(typing.NamedTuple):
    """A finished answer written after those owed before it (`Answers._queue`).

    data: the whole response (status line, headers, body), counted in the connection's
        `ResponseBudget` (and max_outgoing_bytes) until written.
    keep_alive: whether the connection stays open after it.
    path: its label in the statuses counter (`httplistener.PATHS`).
    """

    data: bytes
    keep_alive: bool
    path: str


class Scrape:
    """A GET /metrics owed on a connection: it takes build number `build` or a later one
    (`HttpFrontend.scrape_answer`), once the answers before it are written."""

    __slots__ = ("build", "keep_alive")

    def __init__(self, keep_alive: bool, build: int) -> None:
        self.keep_alive = keep_alive
        self.build = build


class Deferred:
    """A JSON-RPC request whose body waits to be dispatched: its connection was owed
    max_response_bytes of answers, or its client was not reading (see `_gated`).
    `exchange` once dispatched; `response` if it then owed nothing (204). `denied` and
    `bucket`: its caller's policy and rate limit, `caller` its token's name (`ResponseBudget`'s
    when it is dispatched). `mcp`: for an MCP tools/call, its `mcp.ToolCall` (what is
    dispatched, instead of `body` decoded; `body` is kept for its count in max_incoming_bytes)."""

    __slots__ = ("body", "bucket", "caller", "cors", "denied", "exchange", "keep_alive", "mcp", "response")

    def __init__(self, body: bytes | bytearray, keep_alive: bool, cors: bytes,
                 denied: typing.AbstractSet[str] = frozenset(), bucket: Bucket | None = None,
                 caller: str = "") -> None:
        self.body = body
        self.caller = caller
        self.denied = denied
        self.bucket = bucket
        self.keep_alive = keep_alive
        self.cors = cors
        self.exchange: Exchange | None = None
        self.response = b""
        self.mcp: ToolCall | None = None


Owed = Exchange | Ready | Scrape | Deferred  # an entry of `HttpProtocol._responses`
