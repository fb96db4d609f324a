"""Tools for the MCP tests (tests/test_mcp_http.py, tests/test_mcp_stdio.py): typed tools an MCP
host lists and calls, one that shows which worker ran it, one to cancel, one that prints."""

import asyncio
import logging
import os

import msgspec

from broker.worker import Registry

registry = Registry(tools=True)
log = logging.getLogger("mcp_tools")


class Point(msgspec.Struct):
    """A point in the plane."""

    x: float
    y: float


class Sum(msgspec.Struct):
    total: int
    pid: int


@registry.method(title="Add two integers", annotations={"readOnlyHint": True, "idempotentHint": True})
async def add(a: int, b: int) -> int:
    """a + b."""
    return a + b


@registry.method
async def slow_sum(a: int, b: int, seconds: float = 0.05) -> Sum:
    """a + b after `seconds`, and the pid of the worker that added them."""
    await asyncio.sleep(seconds)
    return Sum(a + b, os.getpid())


@registry.method
def norm(p: Point, scale: float = 1.0) -> float:
    """The length of `p` times `scale`."""
    return (p.x * p.x + p.y * p.y) ** 0.5 * scale


@registry.method
async def wait(token: str, seconds: float = 60.0) -> str:
    """Waits `seconds`; logs "cancelled TOKEN" if it is cancelled meanwhile."""
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        log.warning("cancelled %s", token)
        raise
    return token


@registry.method
def shout(text: str) -> str:
    """print()s `text` to the worker's stdout, and returns it upper-cased."""
    print(text)
    return text.upper()


@registry.method
def boom(text: str) -> str:
    """Raises ValueError(text)."""
    raise ValueError(text)


@registry.method
def die() -> None:
    """The worker process exits at once, its calls in flight with it."""
    os._exit(1)


@registry.method(tool=False)
def hidden() -> str:
    """A plain JSON-RPC method: not an MCP tool."""
    return "hidden"
