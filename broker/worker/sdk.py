"""The tool author's API: `Registry` and its `@registry.method`, `RpcError`, `load_app`.

A `Registry` maps JSON-RPC method names to `Method`s (broker/worker/params.py: how a
call's params bind to the handler). A handler raises `RpcError` to answer with its own
error object, which `_rpc_error_object` builds from the error's attributes as they are
when the answer is made: a code the broker keeps for itself (`BROKER_CODES`, and -32700,
-32600) or that is not an integer is refused (`_Refused`) and the call answered -32603,
and `data` is written as a result is (broker/worker/results.py). `load_app` imports the
"module:attribute" the worker serves (`--app`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import operator
import re
import typing
from collections.abc import Callable

import msgspec

from broker.jsonrpc import OTHER, error_object
from broker.worker.params import Method
from broker.worker.results import InvalidJson, _encoded_data
from broker.worker.tools import TOOL_NAME, ToolAnnotations, describe, result_check, tool_annotations


class RpcError(Exception):
    """Raise from a handler to answer with your own JSON-RPC error object.

    code: an integer error code (section 5.1). -32768..-32000 are reserved by the
        spec; -32099..-32000 are the broker's (`BROKER_CODES`, the README's table), and
        so are -32700 and -32600 (requests it cannot read): one of those is answered
        -32603, so pick codes outside them.
        code, message and data are read when the error object is built.
    message: a short description.
    data: anything JSON-encodable, or None to omit it.
    """

    def __init__(self, code: int, message: str, data: object = None) -> None:
        super().__init__(code, message, data)
        # As given, an integer-like one (numpy's int64: `__index__`) made an int: a code
        # that is not an integer answers -32603 saying so (`int(code)` here made 1.5 into
        # 1 and "5" into 5, hostile testing round 9).
        if not isinstance(code, int) and hasattr(type(code), "__index__"):
            code = operator.index(code)
        self.code = code
        self.message = message  # (made a str when the error object is built: `_rpc_error_object`)
        self.data = data


BROKER_CODES = range(-32099, -32000 + 1)
"""Error codes only the broker answers with (README, Errors): -32000 overloaded, -32001
timed out, -32002 worker died, -32003 no worker, -32004 shutting down, and the rest of
the range the spec leaves to the server (JSON-RPC 2.0 section 5.1). An `RpcError` with
one of them is answered -32603: a client, an HTTP status (503/504/502) and the metrics
could not tell it from the broker's own error."""


_ENVELOPE_CODES = (-32700, -32600)
"""Error codes of a request the broker cannot read (the body, the Request object): no
handler sees one, and an `RpcError` with one is answered -32603 (as `BROKER_CODES`): an
HTTP 400 and the metrics' `parse_error`/`invalid_request` would blame the client."""


class _Refused(Exception):
    """An `RpcError` the worker will not send as it is; `data` of the -32603 answering it."""

    def __init__(self, data: dict[str, object]) -> None:
        super().__init__(data)
        self.data = data


_SAFE_INTEGER = 2**53 - 1  # I-JSON's interoperable integers (RFC 7493 2.2): a JavaScript number's exact ones


def _rpc_error_object(exc: RpcError) -> bytes:
    """The error object (section 5.1) of an `RpcError`, from its attributes as they are
    now (a handler may have changed them after `__init__`). `code` must be an integer
    outside `BROKER_CODES` and `message` becomes a string, else `_Refused`; `data` is
    written as a result is (`encode_result`): one with no JSON form is refused too, as a result
    is (its repr() was sent, which can carry heap addresses). Raises `_Refused`, or what encoding
    the message raises."""
    code = exc.code
    if type(code) is not int:
        # An IntEnum, numpy's int64 (`__index__`) are integers; a bool, a float, a str not.
        try:
            if isinstance(code, bool) or not (isinstance(code, int) or hasattr(type(code), "__index__")):
                raise TypeError
            code = operator.index(code)
        except Exception:
            raise _Refused({"type": "RpcError", "reason": f"RpcError code is {_a(type(code).__name__)}, not an integer"}) from None
    if not -_SAFE_INTEGER <= code <= _SAFE_INTEGER:
        raise _Refused({"type": "RpcError", "reason": f"RpcError code {code} is past +-(2**53 - 1), the integers every "
                        "JSON reader keeps exact (RFC 7493 2.2)"})
    if code in BROKER_CODES:
        raise _Refused({"type": "RpcError", "code": code,
                        "reason": f"RpcError code {code} is reserved for the broker's own errors (-32099..-32000)"})
    if code in _ENVELOPE_CODES:  # (round 34: answered 400 and counted as a client's unreadable request)
        raise _Refused({"type": "RpcError", "code": code, "reason": f"RpcError code {code} is reserved for requests "
                        "the broker cannot read (-32700 parse error, -32600 invalid request)"})
    message = exc.message
    if type(message) is not str:
        kind = type(message)
        if kind.__str__ is object.__str__ and kind.__repr__ is object.__repr__:  # (hostile testing, round 111)
            raise _Refused({"type": "RpcError", "reason": f"RpcError message is {_a(kind.__name__)}, which has no "
                            "text of its own (its str() is a repr with a memory address)"})
        message = str(message)
    value = exc.data
    if value is None:
        return error_object(code, message)
    try:  # (written as a result is: `encode_result`)
        data = _encoded_data(value)
    except InvalidJson as invalid:
        raise _Refused({"type": "RpcError", "reason": f"RpcError data is {invalid}"}) from None
    except TypeError:  # (no JSON form: refused as a result is; its repr was sent, heap addresses and all, round 82)
        raise _Refused({"type": "RpcError", "reason": f"RpcError data is {_a(type(value).__name__)}, which has no JSON form"}) from None
    return error_object(code, message, msgspec.Raw(data))


class Registry:
    """The set of methods a worker serves, by JSON-RPC method name.

    Names are case-sensitive; names starting with "rpc." are reserved by the spec
    (section 4) and refused with `ValueError`, as are duplicates and "other", the
    metrics' `method` label of calls to unknown methods (`metrics.OTHER`: a tool so
    named was counted with them, hidden from the shipped alerts; round 34).

    tools: whether a method is an MCP tool when `method` is not told (`tool=None`):
        `Registry(tools=True)` offers every method to MCP hosts, and each that cannot be
        one says so at registration (register it with tool=False).
    """

    def __init__(self, tools: bool = False) -> None:
        if type(tools) is not bool:
            raise TypeError(f"Registry(tools=...) is {_a(type(tools).__name__)}, not True or False")
        self.tools = tools
        self._methods: dict[str, Method] = {}

    @typing.overload
    def method(self, fn: Callable[..., object], /) -> Callable[..., object]: ...

    @typing.overload
    def method(
        self, fn: None = None, /, *, name: str | None = None, raw_params: bool = False, tool: bool | None = None,
        title: str | None = None, annotations: ToolAnnotations | dict[str, object] | None = None,
    ) -> Callable[[Callable[..., object]], Callable[..., object]]: ...

    def method(
        self,
        fn: Callable[..., object] | None = None,
        /,
        *,
        name: str | None = None,
        raw_params: bool = False,
        tool: bool | None = None,
        title: str | None = None,
        annotations: ToolAnnotations | dict[str, object] | None = None,
    ) -> Callable[..., object]:
        """Register `fn` under `name` (default: the function's name).

        Use bare (`@registry.method`) or with options
        (`@registry.method(name="ns.op", raw_params=True)`). With `raw_params` the
        handler gets the params' exact JSON as one `msgspec.Raw` argument (None if
        absent), unvalidated; returning a `msgspec.Raw` sends that JSON on, checked and
        made compact (`encode_result`). Returns `fn` unchanged.

        tool: offer it to MCP hosts as a tool (None: the registry's `tools`). A tool's name
            must match `TOOL_NAME` (`^[a-zA-Z0-9_-]{1,64}$`), its arguments come by name only
            (no *args; no positional-only parameter beside **kwargs), and its params and
            result must have a JSON Schema (broker/worker/tools.py): else ValueError or
            TypeError, saying what to do. Its description is the docstring
            (`inspect.getdoc`). A `raw_params` tool is allowed: its inputSchema is
            `{"type": "object"}` (any arguments object, passed on as it is).
        title: a human-readable name (MCP's Tool `title`; OpenRPC's method `summary`, for
            any method).
        annotations: MCP's ToolAnnotations, a `ToolAnnotations` or a dict with MCP's keys
            (`{"readOnlyHint": True}`); unknown keys and wrong types are a ValueError. A
            tool's only: given for a method that is not one, ValueError.
        """
        is_tool = self.tools if tool is None else tool
        if type(is_tool) is not bool:
            raise TypeError(f"tool= is {_a(type(is_tool).__name__)}, not True, False or None")
        if title is not None and type(title) is not str:
            raise TypeError(f"title= is {_a(type(title).__name__)}, not a str")

        def register(f: Callable[..., object]) -> Callable[..., object]:
            method_name = name or f.__name__
            if method_name.startswith("rpc."):
                raise ValueError(f"method names starting with 'rpc.' are reserved: {method_name!r}")
            if method_name == OTHER:
                raise ValueError(f"method name {OTHER!r} is the metrics' label of calls to unknown methods:"
                                 " register it under another name (name=...)")
            if method_name in self._methods:  # (new user, round 100: where the first one is)
                raise ValueError(f"method {method_name!r} is already registered{_where(self._methods[method_name].fn)}")
            if is_tool and not TOOL_NAME.fullmatch(method_name):
                raise ValueError(f"method {method_name!r} cannot be a tool: a tool's name is 1 to 64 letters, digits,"
                                 " '_' or '-' (MCP hosts pass it to model APIs that take no other): register it"
                                 f" under such a name (name={_tool_name(method_name)!r}), or with tool=False")
            if annotations is not None and not is_tool:
                raise ValueError(f"method {method_name!r}: annotations describe a tool, and it is not one:"
                                 " register it with tool=True (or in a Registry(tools=True))")
            method = Method(method_name, f, raw_params)
            method.tool = is_tool
            method.title = title
            method.annotations = tool_annotations(method_name, annotations)
            if is_tool:  # (what a host could not use is refused now, not at the first tools/list)
                method.described = describe(method, tool=True)
                method.check_result = result_check(method)
                method.flags_returned()
            self._methods[method_name] = method
            return f

        return register(fn) if fn is not None else register

    def methods(self) -> list[Method]:
        """The registered methods, in registration order."""
        return list(self._methods.values())

    def __contains__(self, name: object) -> bool:
        return name in self._methods

    def __len__(self) -> int:
        return len(self._methods)


def load_app(spec: str) -> Registry:
    """Import "module:attribute" and return the `Registry` it names.

    Raises `ImportError`, `AttributeError` or `TypeError` with a clear message.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--app must look like 'module:attribute', got {spec!r}")
    module = importlib.import_module(module_name)
    try:
        obj = getattr(module, attr)
    except AttributeError:  # (what it has: new user, round 103, `mytools:registr`)
        registries = sorted(name for name, value in vars(module).items() if isinstance(value, Registry))
        close = difflib.get_close_matches(attr, registries, n=1)
        hint = (f" (did you mean {close[0]!r}?)" if close
                else f" (its Registries: {', '.join(map(repr, registries))})" if registries else "")
        raise AttributeError(f"module {module_name!r} has no attribute {attr!r}{hint}") from None
    if not isinstance(obj, Registry):
        raise TypeError(f"{spec} is {_a(type(obj).__name__)}, not a broker.worker.Registry")
    if not len(obj):
        raise ValueError(f"{spec} has no methods registered")
    return obj


def _where(fn: Callable[..., object]) -> str:
    """" (first by module.qualname, file:line)" of a registered handler, as far as it is known:
    a partial's function, a callable object's class; "" when nothing is."""
    fn = getattr(fn, "func", fn)  # (functools.partial)
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    said = f"{module}.{name}" if module else name
    return f" (first by {said}, {code.co_filename}:{code.co_firstlineno})" if code is not None else f" (first by {said})"


def _tool_name(name: str) -> str:
    """`name` made a tool's name (`TOOL_NAME`): every other character "_", cut at 64."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", name)[:64] or "tool"


def _a(noun: str) -> str:
    """`noun` with its indefinite article: "an int", "a str"."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun
