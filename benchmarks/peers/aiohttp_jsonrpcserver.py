"""Peer: aiohttp + jsonrpcserver, written the way their docs show, with the demo's methods.

One process: `python benchmarks/peers/aiohttp_jsonrpcserver.py --port P` (uvloop).
Several processes: `gunicorn aiohttp_jsonrpcserver:app --chdir benchmarks/peers --workers 2
--worker-class aiohttp.GunicornUVLoopWebWorker --bind 127.0.0.1:P`.
Methods: add(a, b), fib(n) (CPU-bound, blocks the loop as any inline handler does) and async
sleep(seconds); every body goes to jsonrpcserver's `async_dispatch`, 204 when it answers nothing.
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop
from aiohttp import web
from jsonrpcserver import Result, Success, async_dispatch, method


def _fib(n: int) -> int:
    return n if n < 2 else _fib(n - 1) + _fib(n - 2)


@method
async def add(a: float, b: float) -> Result:
    return Success(a + b)


@method
async def fib(n: int) -> Result:
    return Success(_fib(n))


@method
async def sleep(seconds: float) -> Result:
    await asyncio.sleep(seconds)
    return Success(seconds)


async def handle(request: web.Request) -> web.Response:
    answer = await async_dispatch(await request.text())
    if not answer:
        return web.Response(status=204)
    return web.Response(text=answer, content_type="application/json")


app = web.Application()
app.router.add_post("/", handle)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None, backlog=2048,
                loop=uvloop.new_event_loop())
