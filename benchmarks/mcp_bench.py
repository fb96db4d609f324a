"""`make bench`'s MCP scenarios (benchmarks/run.py): the correctness probe of an MCP server's
Streamable HTTP endpoint in both protocol eras, and the markdown of the MCP tables.

The probe speaks the protocol by hand (http.client, the bench's own SSE reading from
`broker.loadgen.mcp`), so that it judges the broker and the SDK's server by the same rules:
at 2026-07-28 `tools/call` of add, fib and sleep with the right results, an unknown tool
refused (a JSON-RPC -32602, or a CallToolResult with isError true, the SDK's way: noted);
at 2025-11-25 `initialize`, `notifications/initialized` (2xx) and a call in the session.
"""

from __future__ import annotations

import http.client
import json
import statistics
import typing

from broker.loadgen import mcp

PATH = "/mcp"  # where the broker and the SDK's server serve MCP by default
_MODERN_HEADERS = {"content-type": "application/json", "accept": "application/json, text/event-stream",
                   "mcp-protocol-version": mcp.MODERN_VERSION, "mcp-method": "tools/call"}
_META = {"io.modelcontextprotocol/protocolVersion": mcp.MODERN_VERSION,
         "io.modelcontextprotocol/clientCapabilities": {},
         "io.modelcontextprotocol/clientInfo": {"name": "rpc-broker-bench-probe", "version": "0"}}


class _Answer(typing.NamedTuple):
    status: int
    headers: dict[str, str]
    message: dict[str, typing.Any] | None  # the JSON-RPC response (out of its SSE stream), None if none
    body: bytes


def post(port: int, path: str, body: object, headers: dict[str, str], timeout: float = 10.0) -> _Answer:
    """POST ``body`` (JSON-encoded) on a fresh connection; the answer, JSON or SSE."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        got = {k.lower(): v for k, v in resp.getheaders()}
        raw = resp.read()
    finally:
        conn.close()
    text = mcp.answer_of(raw) if got.get("content-type", "").startswith("text/event-stream") else raw
    try:
        message = json.loads(text) if text else None
    except ValueError:
        message = None
    return _Answer(resp.status, got, message if isinstance(message, dict) else None, raw)


def _value(result: object) -> object:
    """A CallToolResult's value: structuredContent's "result" (a scalar, wrapped), else the
    JSON of its first text content."""
    if not isinstance(result, dict):
        return None
    structured = result.get("structuredContent")
    if isinstance(structured, dict) and "result" in structured:
        return structured["result"]
    for c in result.get("content") or ():
        if isinstance(c, dict) and c.get("type") == "text":
            try:
                return json.loads(c.get("text", ""))
            except ValueError:
                return c.get("text")
    return None


def _modern_call(port: int, path: str, tool: str, arguments: dict[str, object], id_: int) -> _Answer:
    body = {"jsonrpc": "2.0", "id": id_, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments, "_meta": _META}}
    return post(port, path, body, {**_MODERN_HEADERS, "mcp-name": tool})


def _wrong(a: _Answer, id_: object, expect: object) -> str | None:
    """None if ``a`` answers call ``id_`` with a CallToolResult of value ``expect``."""
    m = a.message
    if a.status != 200 or m is None or m.get("jsonrpc") != "2.0" or m.get("id") != id_ or "result" not in m:
        return f"HTTP {a.status}, {a.body[:200]!r}"
    result = m.get("result")
    if not isinstance(result, dict) or result.get("isError") or _value(result) != expect:
        return f"expected a result of {expect!r}, got {json.dumps(m)[:200]}"
    return None


def probe(port: int, fib_n: int, fib_result: int, path: str = PATH) -> tuple[list[str], list[str]]:
    """Check one server's MCP endpoint (fib(fib_n) must be fib_result); returns (problems,
    notes). No problems: it answered correctly in both eras."""
    problems: list[str] = []
    notes: list[str] = []
    try:
        calls = (("add", {"a": 1, "b": 2}, 3), ("fib", {"n": fib_n}, fib_result), ("sleep", {"seconds": 0.01}, 0.01))
        for i, (tool, arguments, expect) in enumerate(calls):
            wrong = _wrong(_modern_call(port, path, tool, arguments, i + 1), i + 1, expect)
            if wrong:  # (the first is enough: a server without /mcp fails them all alike)
                return [f"2026-07-28 tools/call {tool}: {wrong}"], notes
        a = _modern_call(port, path, "no_such_tool", {}, 9)
        m = a.message or {}
        if isinstance(m.get("error"), dict) and m["error"].get("code") == -32602:
            pass
        elif isinstance(m.get("result"), dict) and m["result"].get("isError") is True:
            notes.append("an unknown tool is a CallToolResult with isError true (not a JSON-RPC -32602)")
        else:
            problems.append(f"2026-07-28 unknown tool: expected -32602 or isError, got HTTP {a.status} {a.body[:200]!r}")
        problems += _legacy(port, path, notes)
    except (OSError, http.client.HTTPException) as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    return problems, notes


def _legacy(port: int, path: str, notes: list[str]) -> list[str]:
    """The 2025-11-25 handshake and one call in its session; the problems found."""
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    a = post(port, path, json.loads(mcp.initialize_body()), headers)
    try:
        version = mcp.negotiated(json.dumps(a.message).encode()) if a.status == 200 and a.message else ""
    except ValueError:
        version = ""
    if not version:
        return [f"2025-11-25 initialize: HTTP {a.status}, {a.body[:200]!r}"]
    headers["mcp-protocol-version"] = version
    if "mcp-session-id" in a.headers:
        headers["mcp-session-id"] = a.headers["mcp-session-id"]
    else:
        notes.append("2025-11-25: no Mcp-Session-Id (stateless)")
    done = post(port, path, json.loads(mcp.initialized_body()), headers)
    if done.status // 100 != 2:
        return [f"2025-11-25 notifications/initialized: HTTP {done.status}, {done.body[:200]!r}"]
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    wrong = _wrong(post(port, path, body, headers), 1, 3)
    return [f"2025-11-25 tools/call add: {wrong}"] if wrong else []


# -- the report ------------------------------------------------------------------------------

class Measured(typing.Protocol):
    """What the tables read of one run (run.py's Measure)."""

    cps: float
    p50: float
    p99: float
    ok: bool
    problem: str


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def table(rows: dict[str, list[Measured]], order: list[str], sdk: list[str]) -> list[str]:
    """One MCP scenario's markdown table: calls/s (median, min-max), p50 and p99 (medians),
    the ratio to each SDK server of ``sdk``, and whether every answer checked out."""
    cps = {name: _med([m.cps for m in ms]) for name, ms in rows.items()}
    head = "| server | calls/s median (min-max) | p50 ms | p99 ms | " + "".join(f"vs {s} | " for s in sdk)
    lines = [head + "checked |", "|---|---:|---:|---:|" + "---:|" * len(sdk) + "---|"]
    for name in order:
        ms = rows.get(name)
        if not ms:
            continue
        values = [m.cps for m in ms]
        spread = f"{_med(values):,.0f}" + (f" ({min(values):,.0f}-{max(values):,.0f})" if len(values) > 1 else "")
        p50, p99 = _med([m.p50 for m in ms]), _med([m.p99 for m in ms])
        mine = cps[name]
        ratios = "".join(f"{mine / cps[s]:.2f}x | " if mine and cps.get(s) else "- | " for s in sdk)
        ok = all(m.ok for m in ms)
        check = "all answers checked: ok" if ok else \
            "FAILED: " + "; ".join(sorted({m.problem for m in ms if not m.ok}))[:200]
        lines.append(f"| {name} | {spread} | {p50 or 0:.2f} | {p99 or 0:.2f} | {ratios}{check} |")
    return lines


def ratio_lines(results: dict[str, dict[str, list[Measured]]], titles: dict[str, str], broker: str,
                sdk: list[str]) -> list[str]:
    """The (not a target) summary: ``broker``'s calls/s over each SDK server's, per scenario."""
    out = []
    for key, rows in results.items():
        mine = _med([m.cps for m in rows.get(broker, []) if m.ok])
        parts = [f"{mine / theirs:.2f}x {s}" for s in sdk
                 if mine and (theirs := _med([m.cps for m in rows.get(s, []) if m.ok]))]
        out.append(f"- (not a target) {titles[key]}: {broker} "
                   + (", ".join(parts) if parts else "not measured side by side") + ".")
    return out
