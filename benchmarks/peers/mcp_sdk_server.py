"""Peer: the official MCP Python SDK's own server (`mcp` 2.x `MCPServer`, named FastMCP before
2.0), written the way its docs show, serving the demo's tools over Streamable HTTP.

Run: `python benchmarks/peers/mcp_sdk_server.py --port P [--workers N] [--mode stateless-json]`;
the endpoint is http://127.0.0.1:P/mcp. uvicorn with uvloop and httptools, as the other peers.
Tools: add(a, b), subtract(minuend, subtrahend), fib(n) (CPU-bound: it blocks the loop, as any
inline tool does; 0 <= n <= 35, else a tool error), async sleep(seconds) (0..3600) and
worker_info() ({"pid": ...}, which process answered). A tool error is the SDK's: a
CallToolResult with isError true. With --faults, also raise_error(code, message): answered as the
JSON-RPC error {code, message}, as `rpc-broker serve --app broker.demo:faults`'s tool of that name.

Modes (--mode), each speaking both protocol eras (2026-07-28 per request, 2025-11-25 after
initialize; the SDK picks by the MCP-Protocol-Version header):
  stateless-json  `stateless_http=True, json_response=True`: no session, every answer one
                  JSON body. The fastest configuration the SDK offers (add at 16 connections on
                  2 cores, 2026-07-28: 1,670 calls/s; stateless-sse 1,450; sessions 1,290).
  stateless-sse   stateless, answers as SSE where the SDK streams (2025-11-25 requests always;
                  2026-07-28 ones once a tool emits a notification, e.g. progress).
  sessions        `stateless_http=False, json_response=False`, the SDK's default: initialize
                  mints an Mcp-Session-Id, 2025-11-25 answers are SSE streams.
The stateless modes run in several processes (--workers): no state is kept between requests.
A session lives in the process that made it, so `sessions` runs in one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from starlette.applications import Starlette

MODES = {  # --mode -> (stateless_http, json_response)
    "stateless-json": (True, True),
    "stateless-sse": (True, False),
    "sessions": (False, False),
}
# How --workers' processes (uvicorn imports create_app in each) learn the options.
_MODE_ENV = "MCP_PEER_MODE"
_FAULTS_ENV = "MCP_PEER_FAULTS"

server = MCPServer("rpc-broker-demo-peer", log_level="WARNING")


def _fib(n: int) -> int:
    return n if n < 2 else _fib(n - 1) + _fib(n - 2)


@server.tool()
def add(a: int | float, b: int | float) -> int | float:
    """a + b."""
    return a + b


@server.tool()
def subtract(minuend: int | float, subtrahend: int | float) -> int | float:
    """minuend - subtrahend."""
    return minuend - subtrahend


@server.tool()
def fib(n: int) -> int:
    """The n-th Fibonacci number computed the slow way (CPU-bound); 0 <= n <= 35."""
    if not 0 <= n <= 35:
        raise ToolError("n must be within 0..35")
    return _fib(n)


@server.tool()
async def sleep(seconds: float) -> float:
    """Waits `seconds` (0..3600) without blocking the loop; returns them."""
    if not 0 <= seconds <= 3600:
        raise ToolError("seconds must be within 0..3600")
    await asyncio.sleep(seconds)
    return seconds


@server.tool()
def worker_info() -> dict[str, int]:
    """{"pid": the process id that answered}."""
    return {"pid": os.getpid()}


def raise_error(code: int, message: str) -> None:
    """Answers the JSON-RPC error {code, message} (--faults only)."""
    raise MCPError(code, message)


def create_app() -> Starlette:
    """The Streamable HTTP app at /mcp in the mode of $MCP_PEER_MODE (default
    stateless-json), with raise_error if $MCP_PEER_FAULTS is 1."""
    stateless, json_response = MODES[os.environ.get(_MODE_ENV, "stateless-json")]
    if os.environ.get(_FAULTS_ENV) == "1":
        server.add_tool(raise_error)
    return server.streamable_http_app(stateless_http=stateless, json_response=json_response)


def main() -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (stateless modes only)")
    parser.add_argument("--mode", choices=MODES, default="stateless-json")
    parser.add_argument("--faults", action="store_true", help="also serve raise_error(code, message)")
    args = parser.parse_args()
    if args.workers > 1 and not MODES[args.mode][0]:
        parser.error("--workers > 1 needs a stateless mode: a session lives in the process that made it")
    os.environ[_MODE_ENV] = args.mode
    os.environ[_FAULTS_ENV] = "1" if args.faults else "0"
    uvicorn.run("mcp_sdk_server:create_app", factory=True, app_dir=str(Path(__file__).parent), host=args.host,
                port=args.port, workers=args.workers, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", backlog=2048)
    return 0


if __name__ == "__main__":
    sys.exit(main())
