"""The demo tools served when no `--app` is given.

The JSON-RPC 2.0 specification's own example methods, by their names in its
"Examples" section (`subtract`, `sum`, `update`, `notify_hello`, `get_data`), and a
few tools that show the broker at work: `echo`, `add`, `sleep`, a CPU-bound `fib`
and `worker_info` (which worker process answered).

Every one an MCP host can call is a tool too (`Registry.method(tool=True)`): all but `sum`,
`update` and `notify_hello`, whose params come by position only (*values), which MCP's
arguments, by name, cannot give. Titles and annotations say what each does to its
environment (`readOnlyHint` for the pure functions; `openWorldHint` false: none reaches
outside the worker).

`faults` (`--app broker.demo:faults`) serves the same tools and six more that fail on
purpose, for trying the broker's answers to failures: `crash`, `hang`,
`slow`, `huge_reply`, `leak` and `raise_error`, tools too. They are not in `registry`, the
default app: anyone who can call a worker's tools could kill its workers or fill its memory.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec

from broker.worker import Registry, RpcError, ToolAnnotations

registry = Registry(tools=True)

PURE = ToolAnnotations(read_only_hint=True, open_world_hint=False)
"""A tool that only computes: no effect on its environment, nothing outside the worker."""

Number = int | float  # ints stay ints: 42 - 23 answers 19, not 19.0


@registry.method(title="Subtract", annotations=PURE)
def subtract(minuend: Number, subtrahend: Number) -> Number:
    """minuend - subtrahend; params by position or by name (spec examples)."""
    return minuend - subtrahend


@registry.method(name="sum", tool=False)
def sum_(*values: Number) -> Number:
    """The sum of all positional params (spec example: [1,2,4] → 7)."""
    return sum(values)


@registry.method(tool=False)
def update(*values: object) -> None:
    """Accepts anything and does nothing (the spec's notification example)."""


@registry.method(tool=False)
def notify_hello(*values: object) -> None:
    """Does nothing (the spec's batch notification example)."""


@registry.method(title="Get data", annotations=PURE)
def get_data() -> list[object]:
    """Returns ["hello", 5] (spec example)."""
    return ["hello", 5]


@registry.method(raw_params=True, title="Echo", annotations=PURE)
def echo(params: msgspec.Raw | None) -> msgspec.Raw | None:
    """Returns its params, numbers and strings byte for byte, without whitespace
    outside strings (null when there are none)."""
    return params


@registry.method(title="Add", annotations=PURE)
def add(a: Number, b: Number) -> Number:
    """a + b."""
    return a + b


@registry.method(title="Sleep", annotations=PURE)
async def sleep(seconds: float) -> float:
    """Waits `seconds` (0..3600) without blocking the worker; returns them."""
    if not 0 <= seconds <= 3600:
        raise RpcError(-32602, "Invalid params", {"param": "seconds", "reason": "must be within 0..3600"})
    await asyncio.sleep(seconds)
    return seconds


@registry.method(title="Fibonacci", annotations=PURE)
def fib(n: int) -> int:
    """The n-th Fibonacci number computed the slow way (CPU-bound); 0 <= n <= 35."""
    if not 0 <= n <= 35:
        raise RpcError(-32602, "Invalid params", {"param": "n", "reason": "must be within 0..35"})
    return _fib(n)


def _fib(n: int) -> int:
    return n if n < 2 else _fib(n - 1) + _fib(n - 2)


@registry.method(title="Worker info", annotations=PURE)
def worker_info() -> dict[str, int]:
    """{"pid": the process id of the worker that answered}."""
    return {"pid": os.getpid()}


# ---- faults: the demo's tools, and tools that fail on purpose ----

faults = Registry(tools=True)
for _method in registry.methods():
    faults.method(name=_method.name, raw_params=_method.raw_params, tool=_method.tool, title=_method.title,
                  annotations=_method.annotations)(_method.fn)

faults.method(name="slow", title="Slow", annotations=PURE)(sleep)  # async: `sleep` by the name the fault tools use

HUGE_REPLY_MAX = 256 * 1024 * 1024
"""`huge_reply`'s largest string, bytes: larger than the largest max_response_bytes a worker's
answer may be held to by default, within what a demo worker should allocate."""

LEAK_MAX = 2 * 1024 * 1024 * 1024
"""The most `leak` keeps in one worker process, bytes: each worker its own (`--workers` times
this in all)."""

_leaked: list[bytes] = []
_leaked_bytes = 0  # (a running total: summing the blocks made each call slower, hostile testing, round 112)


@faults.method(title="Crash the worker", annotations=ToolAnnotations(destructive_hint=True, open_world_hint=False))
def crash(how: str = "exit") -> None:
    """The worker process dies at once, its calls in flight with it: `how` "exit"
    (os._exit(1), no clean-up) or "kill" (SIGKILL to itself). The broker answers the
    calls it held -32002 (worker died) and starts another worker."""
    if how == "exit":
        os._exit(1)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RpcError(-32602, "Invalid params", {"param": "how", "reason": 'must be "exit" or "kill"'})


@faults.method(title="Hang the worker", annotations=ToolAnnotations(destructive_hint=True, open_world_hint=False))
def hang() -> None:
    """A sync call that never returns: the worker is stuck until the broker kills it as
    hung, `cancel_grace` seconds after the call's deadline (answered -32001, timed out)."""
    while True:
        time.sleep(3600)


@faults.method(title="Huge reply", annotations=PURE)
def huge_reply(bytes: int) -> str:
    """A string of `bytes` (0..268435456) "x" characters: the answer's result is bytes + 2
    bytes of JSON. One past max_frame_bytes (16 MiB by default) or max_response_bytes is
    answered -32603."""
    if not 0 <= bytes <= HUGE_REPLY_MAX:
        raise RpcError(-32602, "Invalid params", {"param": "bytes", "reason": f"must be within 0..{HUGE_REPLY_MAX}"})
    return "x" * bytes


@faults.method(title="Leak memory", annotations=ToolAnnotations(destructive_hint=False, open_world_hint=False))
def leak(bytes: int) -> dict[str, int]:
    """Keeps `bytes` (0..268435456) more of memory, written (resident), until the worker
    process exits; at most 2 GiB in one worker (each worker its own). Returns {"pid": the
    worker's pid, "held_bytes": all it keeps now}."""
    global _leaked_bytes
    held = _leaked_bytes
    if not 0 <= bytes <= HUGE_REPLY_MAX or held + bytes > LEAK_MAX:
        raise RpcError(-32602, "Invalid params",
                       {"param": "bytes", "reason": f"must be within 0..{HUGE_REPLY_MAX}, and at most"
                        f" {LEAK_MAX} kept in all (this worker keeps {held})"})
    if bytes:  # (leak(0) keeps nothing)
        _leaked.append(b"\xa5" * bytes)  # (written, unlike bytes(n)'s zero pages, which need not be resident)
        _leaked_bytes = held + bytes
    return {"pid": os.getpid(), "held_bytes": held + bytes}


@faults.method(title="Raise an error", annotations=PURE)
def raise_error(code: int, message: str, data: object = None) -> None:
    """Answers the JSON-RPC error object {code, message, data} (data left out when null).
    Codes the broker keeps for itself (-32099..-32000, -32700, -32600) are answered -32603
    instead, as for any tool (the README's Errors)."""
    raise RpcError(code, message, data)
