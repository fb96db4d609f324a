"""A test app whose handlers fail in the ways that used to kill their worker or leave a
call unanswered (issue 9, items 16 to 19)."""

import asyncio
import os
import sys

from broker.worker import Registry, RpcError

registry = Registry()


@registry.method
def pid() -> int:
    return os.getpid()


@registry.method
async def nap(seconds: float) -> float:
    """An innocent call in flight on the same worker."""
    await asyncio.sleep(seconds)
    return seconds


@registry.method
def surrogate_message() -> None:
    """A message made from a file name that is not UTF-8 (os.fsdecode's surrogateescape)."""
    raise RpcError(1001, "cannot read " + os.fsdecode(b"caf\xe9.txt"))


@registry.method
async def async_surrogate_data() -> None:
    await asyncio.sleep(0)
    raise RpcError(1002, "bad name", {"name": os.fsdecode(b"\xff")})


@registry.method
def self_referring_data() -> None:
    data: dict[str, object] = {}
    data["self"] = data
    raise RpcError(1003, "loop", data)


@registry.method
async def async_unencodable() -> object:
    await asyncio.sleep(0)
    return {"big": 2**70, "name": os.fsdecode(b"\xff")}  # msgspec's fallback meets a surrogate


@registry.method
async def async_self_referring() -> object:
    await asyncio.sleep(0)
    value: list[object] = []
    value.append(value)
    return value


@registry.method
async def async_exit() -> None:
    await asyncio.sleep(0)
    sys.exit("bye from a handler")


@registry.method
async def async_interrupt() -> None:
    await asyncio.sleep(0)
    raise KeyboardInterrupt


@registry.method
async def async_cancelled() -> None:
    """Raises CancelledError itself: nobody cancelled it."""
    await asyncio.sleep(0)
    raise asyncio.CancelledError


@registry.method
async def async_generator_exit() -> None:
    await asyncio.sleep(0)
    raise GeneratorExit


@registry.method
async def async_blob(size: int, delay: float = 0.0) -> str:
    await asyncio.sleep(delay)
    return "x" * size


@registry.method
def fork_and_return() -> str:
    """Forks, and returns in both processes: the child goes back into the worker's loop
    with a copy of everything in flight (hostile testing)."""
    child = os.fork()
    return "child" if child == 0 else f"parent {child}"
