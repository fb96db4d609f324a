"""Worker SDK and the worker process's run loop.

Write tools as plain functions and register them::

    from broker.worker import Registry, RpcError

    registry = Registry()

    @registry.method
    def subtract(minuend: int, subtrahend: int) -> int:
        return minuend - subtrahend

    @registry.method(name="math.divide")
    async def divide(a: float, b: float) -> float:
        if b == 0:
            raise RpcError(1001, "division by zero", {"a": a})
        return a / b

then serve them with ``rpc-broker serve --app mymodule:registry``.

MCP tools: ``Registry(tools=True)`` offers every method to MCP hosts (or
``@registry.method(tool=True, title=..., annotations=ToolAnnotations(read_only_hint=True))``
one at a time); the docstring is the tool's description, the type hints its inputSchema and
outputSchema (broker/worker/tools.py).

Params binding (JSON-RPC 2.0 section 4.2): positional params (an array) bind to the
handler's parameters in order, named params (an object) by name; omitted params take
their defaults; `*args` and `**kwargs` take the rest. msgspec converts and validates
each value against the type hints; a mismatch answers -32602 with
`data = {"param": name, "reason": why}`. A handler raises `RpcError` for its own
errors; any other exception answers -32603 without a traceback unless debug is on.
Results are encoded with orjson (dataclasses, datetimes, UUIDs, enums, numpy arrays),
falling back to msgspec (msgspec Structs, integers past 64 bits, `msgspec.Raw`, whose
JSON is checked and made compact). An RpcError's code must be outside `BROKER_CODES`.

Sync handlers run inline on the worker's event loop, one at a time: a worker is a
process, so CPU-bound tools scale with `--workers`. Async handlers run concurrently,
up to the worker's concurrency limit. A worker process serves one connection to the
broker and exits when it closes, or once it has answered every call sent before the
broker's BYE. SIGTERM makes it ask for that BYE (`WorkerProtocol.stop`): it leaves
without losing a call, and the broker starts another in its place.

The package, one concern a module (each opens with how it works):

    sdk.py      the tool author's API: Registry, RpcError (and its error object), load_app
    tools.py    tool metadata: names, ToolAnnotations, the JSON Schemas of params and result
    params.py   params binding: Method, InvalidParams, NestingTooDeep, Flag member drops
    param_errors.py  params binding's slow paths: InvalidParams reasons, numbers no float holds
    results.py  encode_result: a result's JSON, orjson first, the Enum watch
    runtime.py  WorkerProtocol, the run loop: frames, calls, chunks, deadlines, replies
    chunks.py   a batch's chunks: their calls run in the loop's slices, their answers sent
    turns.py    the turns among connections' flows: the order the waiting calls run in
    held.py     the thread that sends answers held behind a blocking handler
    links.py    the connections to the other front-ends (serve --frontends N)
    errors.py   the error object a failed call is answered with
    forks.py    die_with_parent, and the children a handler forks (isolate_forks)
    process.py  the process: arguments, start-up, main (run by __main__.py)

Import from `broker.worker` what is re-exported here. A private name is its module's: a
global rebound at run time (`results._ORJSON_FIRST`, `runtime._forked_from`) must be read
through its module, never copied with `from ... import`.
"""

from broker.worker.forks import die_with_parent, isolate_forks
from broker.worker.params import FLAG_PSEUDO_MEMBERS_MAX, InvalidParams, Method, NestingTooDeep
from broker.worker.process import WORKER_BOOT_ERROR, main
from broker.worker.results import InvalidJson, NoJsonForm, encode_result
from broker.worker.runtime import WorkerProtocol
from broker.worker.sdk import BROKER_CODES, Registry, RpcError, load_app
from broker.worker.tools import ToolAnnotations

__all__ = [
    "BROKER_CODES",
    "FLAG_PSEUDO_MEMBERS_MAX",
    "WORKER_BOOT_ERROR",
    "InvalidJson",
    "InvalidParams",
    "Method",
    "NestingTooDeep",
    "NoJsonForm",
    "Registry",
    "RpcError",
    "ToolAnnotations",
    "WorkerProtocol",
    "die_with_parent",
    "encode_result",
    "isolate_forks",
    "load_app",
    "main",
]
