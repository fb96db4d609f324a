"""A test and benchmark app mixing a slow sync handler with fast ones
(benchmarks/sync_mix.py; tests/test_dispatch_e2e.py)."""

import asyncio
import time

from broker.worker import Registry

registry = Registry()


@registry.method
def block(seconds: float) -> float:
    """Sleeps `seconds` in a plain function: blocks its worker's whole process."""
    time.sleep(seconds)
    return seconds


@registry.method
def brief(seconds: float) -> float:
    """Like `block`: a second blocking method, for the short side of a test that needs two."""
    time.sleep(seconds)
    return seconds


@registry.method
def add(a: int, b: int) -> int:
    """A fast sync call."""
    return a + b


@registry.method
async def wait(seconds: float) -> float:
    """A fast async call that waits on I/O for `seconds` without blocking its worker."""
    await asyncio.sleep(seconds)
    return seconds


@registry.method
async def hold(data: list[object], seconds: float) -> int:
    """Takes `data` (large params, at will) and holds them `seconds` without blocking its worker."""
    await asyncio.sleep(seconds)
    return len(data)
