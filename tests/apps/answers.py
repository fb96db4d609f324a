"""A test app whose handlers answer in ways that used to break the reply or be taken
for the broker's own errors (attack B: findings 1, 6, 9, 10): msgspec.Raw results,
RpcErrors changed after they were made or using the broker's codes, handlers that
stop the worker's loop, and async handlers behind a decorator."""

import asyncio
import functools
import os
import sys
from collections.abc import Awaitable, Callable

import msgspec

from broker.worker import Registry, RpcError
from tests.apps.hostile import nap, pid

registry = Registry()
registry.method(pid)  # (the innocent calls in flight)
registry.method(nap)


@registry.method
def raw(text: str, nested: bool = False) -> object:
    """Returns msgspec.Raw(text), at the top or inside an object."""
    value = msgspec.Raw(text.encode())
    return {"inner": [{"v": value}]} if nested else value


@registry.method
async def async_raw(text: str) -> object:
    await asyncio.sleep(0)
    return msgspec.Raw(text.encode())


@registry.method
def raw_error_data(text: str) -> None:
    raise RpcError(1001, "with raw data", msgspec.Raw(text.encode()))


@registry.method
def mutated_error(what: str) -> None:
    """An RpcError whose code or message is changed after it was made."""
    exc = RpcError(1001, "made fine")
    if what == "code_str":
        exc.code = "x"  # type: ignore[assignment]
    elif what == "code_none":
        exc.code = None  # type: ignore[assignment]
    elif what == "code_raw":
        exc.code = msgspec.Raw(b'1,"message":"m"},"result":42,"x":{"a":1')  # type: ignore[assignment]
    elif what == "code_bool":
        exc.code = True
    elif what == "message_int":
        exc.message = 123  # type: ignore[assignment]
    raise exc


@registry.method
def made_with_code(code: object) -> None:
    """An RpcError made with `code`, whatever its type (a float, a str, a bool)."""
    raise RpcError(code, "made so")  # type: ignore[arg-type]


@registry.method
def code_set_after(kind: str) -> None:
    """An RpcError whose code is set after it was made: numpy's int64 (an integer) or a
    code past what a JSON reader keeps exact."""
    import numpy as np

    exc = RpcError(1001, "set after")
    exc.code = np.int64(5) if kind == "numpy" else 10**30  # type: ignore[assignment]
    raise exc


@registry.method
def broker_code(code: int) -> None:
    """An RpcError with one of the broker's own codes."""
    raise RpcError(code, "the tool's own message", {"mine": True})


@registry.method
def big_error(size: int) -> None:
    raise RpcError(1001, "big", "x" * size)


@registry.method
async def stop_loop() -> int:
    asyncio.get_running_loop().stop()
    return os.getpid()


@registry.method
async def exit_later() -> int:
    asyncio.get_running_loop().call_soon(sys.exit, 0)
    return os.getpid()


def logged(fn: Callable[..., Awaitable[object]]) -> Callable[..., Awaitable[object]]:
    """A decorator as many are written: a sync wrapper that returns the coroutine."""
    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> Awaitable[object]:
        return fn(*args, **kwargs)
    return wrapper


@registry.method
@logged
async def wrapped_nap(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


async def _nap(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


@registry.method
def returns_coroutine(seconds: float) -> object:
    """A sync handler that returns an awaitable no decorator names."""
    return _nap(seconds)


RAN: list[float] = []  # the calls of `blocks_then_returns_coroutine` that ran (in-process tests)


@registry.method
def blocks_then_returns_coroutine(seconds: float) -> object:
    """A sync handler that does something (blocks `seconds`, and records that it ran), then
    returns an awaitable."""
    import time

    time.sleep(seconds)
    RAN.append(seconds)
    return _nap(0)


@registry.method
def raw_bytes(hex_: str) -> object:
    """msgspec.Raw of the bytes spelled in hex (e.g. invalid UTF-8)."""
    return msgspec.Raw(bytes.fromhex(hex_))
