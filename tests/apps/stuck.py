"""A test app whose `spin` handler never returns: a sync loop that ignores CANCEL."""

import os
import time

from broker.worker import Registry

registry = Registry()


@registry.method
def spin(seconds: float) -> None:
    """Busy-waits `seconds` without yielding to the worker's event loop."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@registry.method
def gil(n: int) -> int:
    """sum(range(n)): C code holding the GIL the whole time (the worker's other threads stay still)."""
    return sum(range(n))


@registry.method
def pid() -> int:
    return os.getpid()


@registry.method
async def linger(seconds: float) -> str:
    """Waits `seconds`; cancelled, it cleans up for `seconds` more (awaiting: the loop is
    free all along), then returns."""
    import asyncio

    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        await asyncio.sleep(seconds)
    return "done"


@registry.method
async def nap(seconds: float) -> float:
    import asyncio

    await asyncio.sleep(seconds)
    return seconds
