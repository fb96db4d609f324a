"""Peer: fastapi-jsonrpc, written the way its docs show, with the demo's methods.

Run: `uvicorn fastapi_jsonrpc_app:app --app-dir benchmarks/peers --port P --workers N
--loop uvloop --http httptools --no-access-log --log-level warning`.
Methods: add(a, b), fib(n) (CPU-bound, blocks the loop as any inline handler does) and async
sleep(seconds), served at `/`.
"""

from __future__ import annotations

import asyncio

import fastapi_jsonrpc as jsonrpc


def _fib(n: int) -> int:
    return n if n < 2 else _fib(n - 1) + _fib(n - 2)


app = jsonrpc.API()
api = jsonrpc.Entrypoint("/")


@api.method()
async def add(a: int | float, b: int | float) -> int | float:
    return a + b


@api.method()
async def fib(n: int) -> int:
    return _fib(n)


@api.method()
async def sleep(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


app.bind_entrypoint(api)
