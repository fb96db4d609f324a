"""The MCP load connection (``rpc-broker bench --mcp``): the HTTP/1.1 connection of `http`
with the heads of MCP's Streamable HTTP, its answers taken out of SSE streams, each result
checked as a CallToolResult, and in the 2025-11-25 era a handshake on each connection
before its first call. The protocol's bytes are `mcp`'s (sans-IO).

Lifecycle of one connection (2025-11-25, basic/lifecycle), in `Lifecycle`'s words:

    connection made ──▶ INITIALIZING         initialize written (no call before its answer)
    its answer: a result with a protocolVersion (and maybe an Mcp-Session-Id header)
                    ──▶ INITIALIZED_SENT     notifications/initialized written, with the
                                             version and session id every call carries
    a 2xx to it     ──▶ OPERATION            the calls go out, as over plain HTTP

Anything else in the handshake (an error answer, another status, no answer within
--timeout) is one transport error ("MCP initialize failed: ..."): the connection is
dropped and opened again after the back-off, with a new handshake. A reconnect always
begins a new session. At 2026-07-28 a connection is in OPERATION from the start.
"""

from __future__ import annotations

import asyncio
import enum
import re
import time
import typing

import msgspec

from broker.loadgen import mcp
from broker.loadgen.connection import _Shared
from broker.loadgen.http import HttpLoadConnection
from broker.loadgen.workload import Expect

__all__ = ["Lifecycle", "McpLoadConnection"]

_now = time.monotonic
_SESSION_ID = re.compile(rb"[\x21-\x7e]+")  # visible ASCII (2025-11-25 transports, Session Management)


class Lifecycle(enum.Enum):
    """Where a connection's 2025-11-25 handshake is (see the module docstring)."""

    INITIALIZING = "initializing"
    INITIALIZED_SENT = "initialized sent"
    OPERATION = "operation"


class McpLoadConnection(HttpLoadConnection):
    """HTTP/1.1 keep-alive POSTs of ``tools/call`` to an MCP endpoint (`Spec.mcp` era).

    ``_heads``: each tool's request head, by its name as JSON text (`mcp.tool_name_at`),
    when the calls are of several tools at 2026-07-28 (their ``Mcp-Name`` differs); else
    empty, and `_head` serves every call.
    """

    __slots__ = ("_handshake_t", "_heads", "_host", "_in_session", "_lifecycle", "_session_id", "_sse")

    def __init__(self, shared: _Shared, phase: float = 0.0, interval: float = 0.0) -> None:
        super().__init__(shared, phase, interval)
        t = shared.target
        self._host = f"[{t.host}]:{t.port}" if ":" in t.host else f"{t.host}:{t.port}"
        self._heads: dict[bytes, bytes] = {}
        self._lifecycle = Lifecycle.OPERATION
        self._session_id = b""  # the Mcp-Session-Id header of the answer being read
        self._sse = False  # the answer being read is an SSE stream (Content-Type: text/event-stream)
        self._handshake_t = 0.0  # when the handshake's last message was written
        self._in_session = False  # the calls carry an Mcp-Session-Id
        self._check = self._check_tool_call
        if shared.mcp == "modern":
            heads = {msgspec.json.encode(tool): self._head_for(mcp.MODERN_VERSION, tool) for tool in shared.tools}
            self._head = next(iter(heads.values()))
            self._heads = heads if len(heads) > 1 else {}

    def _head_for(self, version: str, tool: str | None = None, session_id: str = "") -> bytes:
        return mcp.call_head(self._s.target.path, self._host, self._s.token, version=version, tool=tool,
                             session_id=session_id)

    def _frame(self, body: bytes) -> bytes:
        head = self._heads[mcp.tool_name_at(body)] if self._heads else self._head
        return b"%s%d\r\n\r\n%s" % (head, len(body), body)

    # -- the 2025-11-25 handshake ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._s.mcp != "legacy" or not self.connected:
            return
        self._lifecycle = Lifecycle.INITIALIZING
        self._write_handshake(self._head_for(""), mcp.initialize_body())

    def _write_handshake(self, head: bytes, body: bytes) -> None:
        self._handshake_t = _now()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"%s%d\r\n\r\n%s" % (head, len(body), body))

    def _fill(self) -> None:
        if self._lifecycle is Lifecycle.OPERATION:  # (no call before the handshake is over)
            super()._fill()

    def _handshake(self, status: int, body: bytes) -> None:
        """An answer to the handshake's message in flight (see the module docstring)."""
        tally = self._s.checker.tally
        if self._lifecycle is Lifecycle.INITIALIZING:
            answer = mcp.answer_of(body) if self._sse else body
            if status != 200 or answer is None:
                self._handshake_failed(f"HTTP {status}, body {body[:160]!r}")
                return
            try:
                version = mcp.negotiated(answer)
            except ValueError as exc:
                self._handshake_failed(str(exc))
                return
            session = self._session_id
            if session and not _SESSION_ID.fullmatch(session):
                self._handshake_failed(f"an Mcp-Session-Id that is not visible ASCII: {session[:80]!r}")
                return
            tally.protocol_version = tally.protocol_version or version
            self._in_session = bool(session)
            self._head = self._head_for(version, session_id=session.decode("ascii"))
            self._lifecycle = Lifecycle.INITIALIZED_SENT
            self._write_handshake(self._head, mcp.initialized_body())
            return
        if status // 100 != 2:
            self._handshake_failed(f"notifications/initialized answered HTTP {status}, body {body[:160]!r}")
            return
        tally.initialized += 1
        if self._in_session:
            tally.sessions += 1
        self._lifecycle = Lifecycle.OPERATION  # (data_received fills the connection next)

    def _handshake_failed(self, why: str) -> None:
        """One transport error; the connection is dropped and opened again after the back-off."""
        tally = self._s.checker.tally
        tally.transport_errors += 1
        tally.problem(f"MCP initialize failed: {why}")
        self._failed = True
        self.abort()

    def sweep(self, now: float) -> None:
        if (self._lifecycle is not Lifecycle.OPERATION and self._transport is not None
                and now - self._handshake_t > self._s.timeout):
            self._handshake_failed(f"no answer within --timeout {self._s.timeout:g} s")
            return
        super().sweep(now)

    # -- answers ---------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._sse = False
        self._session_id = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        """httptools: one whole header of the answer being read."""
        name = name.lower()
        if name == b"content-type":
            self._sse = value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
        elif name == b"mcp-session-id":
            self._session_id = value

    def _answered(self, status: int, body: bytes) -> None:
        if self._lifecycle is not Lifecycle.OPERATION:
            self._handshake(status, body)
            return
        super()._answered(status, body)

    def _check_tool_call(self, status: int, body: bytes, expect: Expect | msgspec.Raw) -> None:
        """Check one call's answer (`HttpLoadConnection._check`), out of its SSE stream first."""
        checker = typing.cast(mcp.ToolChecker, self._s.checker)
        if self._sse:
            answer = mcp.answer_of(body)
            if answer is None:
                checker.tally.problem(f"an SSE stream with no JSON-RPC response in it: {body[:120]!r}")
                answer = body  # (then counted malformed, as any answer that is not one)
            body = answer
        checker.check_tool_call(status, body, expect)
