"""A test app whose one tool leaves a mark outside the broker: `record(mark)` appends
`mark` as a line to the file named by $LEDGER_FILE and returns how many lines it has.
A test reads the file to learn whether a call really ran (tests/test_cross_site.py)."""

import os

from broker.worker import Registry

registry = Registry()


@registry.method
def record(mark: str) -> int:
    with open(os.environ["LEDGER_FILE"], "a+", encoding="utf-8") as f:
        f.write(mark + "\n")
        f.seek(0)
        return len(f.read().splitlines())


@registry.method
async def record_async(mark: str) -> int:
    """`record`, as an async handler."""
    return record(mark)


@registry.method
def hold(seconds: float) -> float:
    """Block the worker (a sync call) for `seconds`."""
    import time

    time.sleep(seconds)
    return seconds


@registry.method
async def hold_after_await(seconds: float) -> float:
    """An async handler that holds the worker's loop (a CPU-bound step) after one await."""
    import asyncio
    import time

    await asyncio.sleep(0)
    time.sleep(seconds)
    return seconds


@registry.method
async def tidy(seconds: float) -> str:
    """Waits `seconds`; cancelled, it cleans up for `seconds` (awaiting), then records `tidied`."""
    import asyncio

    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        await asyncio.sleep(seconds)
        record("tidied")
    return "done"


@registry.method
def pid() -> int:
    return os.getpid()


@registry.method
def big(size: int) -> str:
    """A string of `size` bytes: a large answer for a small call."""
    return "x" * size
