"""The demo tools served when no `--app` is given.

The JSON-RPC 2.0 specification's own example methods, by their names in its
"Examples" section (`subtract`, `sum`, `update`, `notify_hello`, `get_data`), and a
few tools that show the broker at work: `echo`, `add`, `sleep`, a CPU-bound `fib`
and `worker_info` (which worker process answered).
"""

from __future__ import annotations

import asyncio
import os

import msgspec

from broker.worker import Registry, RpcError

registry = Registry()

Number = int | float  # ints stay ints: 42 - 23 answers 19, not 19.0


@registry.method
def subtract(minuend: Number, subtrahend: Number) -> Number:
    """minuend - subtrahend; params by position or by name (spec examples)."""
    return minuend - subtrahend


@registry.method(name="sum")
def sum_(*values: Number) -> Number:
    """The sum of all positional params (spec example: [1,2,4] → 7)."""
    return sum(values)


@registry.method
def update(*values: object) -> None:
    """Accepts anything and does nothing (the spec's notification example)."""


@registry.method
def notify_hello(*values: object) -> None:
    """Does nothing (the spec's batch notification example)."""


@registry.method
def get_data() -> list[object]:
    """Returns ["hello", 5] (spec example)."""
    return ["hello", 5]


@registry.method(raw_params=True)
def echo(params: msgspec.Raw | None) -> msgspec.Raw | None:
    """Returns its params, numbers and strings byte for byte, without whitespace
    outside strings (null when there are none)."""
    return params


@registry.method
def add(a: Number, b: Number) -> Number:
    """a + b."""
    return a + b


@registry.method
async def sleep(seconds: float) -> float:
    """Waits `seconds` (0..3600) without blocking the worker; returns them."""
    if not 0 <= seconds <= 3600:
        raise RpcError(-32602, "Invalid params", {"param": "seconds", "reason": "must be within 0..3600"})
    await asyncio.sleep(seconds)
    return seconds


@registry.method
def fib(n: int) -> int:
    """The n-th Fibonacci number computed the slow way (CPU-bound); 0 <= n <= 35."""
    if not 0 <= n <= 35:
        raise RpcError(-32602, "Invalid params", {"param": "n", "reason": "must be within 0..35"})
    return _fib(n)


def _fib(n: int) -> int:
    return n if n < 2 else _fib(n - 1) + _fib(n - 2)


@registry.method
def worker_info() -> dict[str, int]:
    """{"pid": the process id of the worker that answered}."""
    return {"pid": os.getpid()}
