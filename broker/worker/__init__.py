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
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import dataclasses
import datetime
import decimal
import enum
import functools
import importlib
import inspect
import logging
import math
import operator
import os
import re
import signal
import struct
import sys
import threading
import time
import traceback
import types
import typing
import uuid
from collections.abc import Callable

import msgspec
import orjson

from broker import collisions, wire
from broker.jsonrpc import OTHER, ErrorCode, error_object
from broker.jsonscan import nests_deeper

__all__ = ["BROKER_CODES", "WORKER_BOOT_ERROR", "InvalidJson", "Method", "Registry", "RpcError", "main"]

log = logging.getLogger("broker.worker")

WORKER_BOOT_ERROR = 3
"""Exit status of a worker that could not load or serve its app: the broker stops rather
than restart it in a loop (as gunicorn's WORKER_BOOT_ERROR)."""


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
        self.message = str(message)
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
    written as a result is (`encode_result`), its repr if it has no JSON form. Raises `_Refused`, or what encoding the message raises."""
    code = exc.code
    if type(code) is not int:
        # An IntEnum, numpy's int64 (`__index__`) are integers; a bool, a float, a str not.
        try:
            if isinstance(code, bool) or not (isinstance(code, int) or hasattr(type(code), "__index__")):
                raise TypeError
            code = operator.index(code)
        except Exception:
            raise _Refused({"type": "RpcError", "reason": f"RpcError code is a {type(code).__name__}, not an integer"}) from None
    if not -_SAFE_INTEGER <= code <= _SAFE_INTEGER:
        raise _Refused({"type": "RpcError", "reason": f"RpcError code {code} is past +-(2**53 - 1), the integers every "
                        "JSON reader keeps exact (RFC 7493 2.2)"})
    if code in BROKER_CODES:
        raise _Refused({"type": "RpcError", "code": code,
                        "reason": f"RpcError code {code} is reserved for the broker's own errors (-32099..-32000)"})
    if code in _ENVELOPE_CODES:  # (round 34: answered 400 and counted as a client's unreadable request)
        raise _Refused({"type": "RpcError", "code": code, "reason": f"RpcError code {code} is reserved for requests "
                        "the broker cannot read (-32700 parse error, -32600 invalid request)"})
    message = exc.message if type(exc.message) is str else str(exc.message)
    value = exc.data
    if value is None:
        return error_object(code, message)
    try:  # (written as a result is: `encode_result`)
        data = _encoded_data(value)
    except InvalidJson as invalid:
        raise _Refused({"type": "RpcError", "reason": f"RpcError data is {invalid}"}) from None
    except TypeError:  # data of a type with no JSON form: its repr (one that refers to itself: -32603)
        data = msgspec.json.encode(repr(value))
    return error_object(code, message, msgspec.Raw(data))


def _encoded_data(data: object) -> bytes:
    """`encode_result`, raising what `_plain` raises (`_TooDeep`, a `tolist()`'s own
    error) but for `TypeError`, the one a repr stands in for."""
    if _ORJSON_FIRST:
        try:
            return _framed(orjson.dumps(data, option=_FIRST_OPTIONS))
        except TypeError:
            pass
    return _encoded_plain(data)


class InvalidParams(Exception):
    """params did not fit the signature: which parameter (or None) and why."""

    def __init__(self, param: str | None, reason: str) -> None:
        super().__init__(param, reason)
        self.param = param
        self.reason = reason


_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_STEP_END = re.compile(r"[.\[]")
_FIELD_IN_MSG = re.compile(r"field `([^`]+)`")
_decode_json = msgspec.json.decode
_astuple = msgspec.structs.astuple


class Method:
    """One registered handler and how to bind JSON params to it.

    Built by `Registry.method`; `bind(params)` turns the raw JSON params of a call
    into `(args, kwargs)` or raises `InvalidParams`.
    """

    __slots__ = (
        "_fast",
        "_flags",
        "_guard_decode",
        "_guards",
        "_kwonly",
        "_named_type",
        "_pos_names",
        "_pos_only",
        "_pos_only_required",
        "_pos_type",
        "_required_kwonly",
        "_typed",
        "_var_kw",
        "_var_pos",
        "doc",
        "fn",
        "is_async",
        "name",
        "raw_params",
    )

    def __init__(self, name: str, fn: Callable[..., object], raw_params: bool = False) -> None:
        self.name = name
        self.fn = fn
        self.is_async = _is_async(fn)
        self.raw_params = raw_params
        self.doc = inspect.getdoc(fn) or ""
        sig = inspect.signature(fn)
        try:  # (round 35: without include_extras, Annotated[int, Meta(ge=0)] was stripped, unchecked)
            hints = typing.get_type_hints(fn, include_extras=True)
        except NameError as exc:  # (round 36: "NameError ... at <string>:1" named no method)
            raise NameError(f"method {name!r}: a type hint names what is not defined when the app is loaded"
                            f" ({exc}): define it before the method is registered") from None
        for p in sig.parameters.values():
            if p.name.startswith("__"):  # (round 36: "Failed to get offset", or every call -32602)
                raise TypeError(f"method {name!r}: parameter {p.name!r} starts with '__', which params cannot "
                                "bind (Python mangles such names; msgspec reserves some): rename it")
        pos: list[tuple[str, object, object]] = []
        kwonly: list[tuple[str, object, object]] = []
        self._var_pos: object | None = None
        self._var_kw: object | None = None
        for p in sig.parameters.values():
            hint = hints.get(p.name, typing.Any)
            if p.kind in _POSITIONAL:
                pos.append((p.name, hint, p.default))
            elif p.kind is inspect.Parameter.KEYWORD_ONLY:
                kwonly.append((p.name, hint, p.default))
            elif p.kind is inspect.Parameter.VAR_POSITIONAL:
                self._var_pos = list[hint]  # type: ignore[valid-type]
            else:
                self._var_kw = dict[str, hint]  # type: ignore[valid-type]
        self._pos_names = [n for n, _, _ in pos]
        # Positional-only parameters (before `/`) bind by name too (an MCP host names every
        # argument), but beside **kwargs a name of one is **kwargs's, as in Python (round 32:
        # `{"a": 5}` filled `a` of `def f(a=0, /, **kw)`): the parameter then takes its default.
        only = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
        self._pos_only = frozenset(p.name for p in only) if self._var_kw is not None else frozenset()
        self._pos_only_required = [p.name for p in only if p.default is _EMPTY and p.name in self._pos_only]
        self._kwonly = [n for n, _, _ in kwonly]
        self._required_kwonly = [n for n, _, d in kwonly if d is _EMPTY]

        def fields(params: list[tuple[str, object, object]]) -> list[tuple[str, object] | tuple[str, object, object]]:
            return [(n, h) if d is _EMPTY else (n, h, _struct_default(d)) for n, h, d in params]

        # Defaults may not precede required fields in a Struct; Python enforces the
        # same order on positional parameters. The named struct is kw_only: a required
        # keyword-only param may follow a positional one with a default (f(a, b=1, *, c)).
        self._pos_type = msgspec.defstruct(
            f"{name}_positional", fields(pos), array_like=True, forbid_unknown_fields=True
        )
        named = pos + kwonly
        self._named_type = msgspec.defstruct(
            f"{name}_named", fields(named), kw_only=True, forbid_unknown_fields=self._var_kw is None
        )
        # The common case, fixed parameters only: msgspec decodes the params straight
        # into the struct (0.19 us for `add`, against 1.6 us for decode + convert).
        # Any failure falls back to the general path, which says what is wrong.
        self._fast: tuple[msgspec.json.Decoder[msgspec.Struct], msgspec.json.Decoder[msgspec.Struct] | None] | None = None
        # Every type a call may convert to is built now: an unsupported hint (a union of two
        # untagged Structs) fails the registration, as on the fast path (round 36: beside
        # *args it registered, then every call answered -32603).
        kinds = [kind for kind in (self._pos_type, self._named_type, self._var_pos, self._var_kw) if kind is not None]
        for kind in kinds if not raw_params else ():
            msgspec.json.Decoder(kind)
        held = [] if raw_params else collisions.reachable(msgspec.inspect.multi_type_info(kinds))
        self._flags = tuple({node.cls: None for node in held if isinstance(node, msgspec.inspect.EnumType)
                             and issubclass(node.cls, enum.Flag)}) or None
        if any(isinstance(node, msgspec.inspect.UnionType) and any(isinstance(t, msgspec.inspect.RawType)
                                                                   for t in node.types) for node in held):
            raise TypeError(f"method {name!r}: a msgspec.Raw in a union (msgspec decodes only the union's other "
                            "types: round 37, `Raw | None` took null alone): hint it msgspec.Raw, and read null "
                            "from its text")
        if any(isinstance(node, (msgspec.inspect.DataclassType, msgspec.inspect.TypedDictType))
               and any(isinstance(inner, msgspec.inspect.RawType) for inner in collisions.reachable(node))
               for node in held):
            raise TypeError(f"method {name!r}: a msgspec.Raw in a dataclass or TypedDict, which msgspec cannot "
                            "always decode (round 38: every value was refused): hold it in a msgspec.Struct")
        for kind in kinds if not raw_params else ():
            why = collisions.unsupported(kind)
            if why is not None:
                raise TypeError(f"method {name!r}: {why}, which hash flooding could not be checked for in time"
                                " linear in the params (broker/collisions.py): hint them otherwise")
        # The general path decodes params to Python values, then converts them: a JSON
        # number became a float on the way, and a Decimal lost its digits (round 36), and
        # msgspec.convert cannot make a msgspec.Raw (round 36). Where a hint holds either,
        # each value params give is decoded from its own JSON text with its parameter's
        # type, as the fast path decodes it (round 38: numbers decoded as Decimals made a
        # float parameter inf for 1e400, and a Decimal of 4301 digits bound by position
        # only). The check for hash flooding reads its values first, with Decimals exact.
        decimals = any(isinstance(node, msgspec.inspect.DecimalType) for node in held)
        if decimals and any(collisions.untyped_hashed(kind) for kind in kinds):
            raise TypeError(f"method {name!r}: beside a Decimal, a set's elements or a dict's keys hold an untyped"
                            " value (Any, a bare set or tuple), whose numbers the check for hash flooding could not"
                            " read as they are built: hint their type")
        self._guard_decode = _DECIMAL_JSON if decimals else _decode_json
        self._typed: dict[str, tuple[msgspec.json.Decoder[typing.Any], collisions.Check | None]] | None = None
        if decimals or any(isinstance(node, msgspec.inspect.RawType) for node in held):
            hinted = [(n, h) for n, h, _ in pos + kwonly]
            if self._var_pos is not None:
                hinted.append(("*", typing.get_args(self._var_pos)[0]))
            if self._var_kw is not None:
                hinted.append(("**", typing.get_args(self._var_kw)[1]))
            self._typed = {n: (msgspec.json.Decoder(h), collisions.guard(h)) for n, h in hinted}
        # Sets and non-str dict keys are checked for hash flooding before they are built
        # (broker/collisions.py): their params take the general path.
        guards = (None,) * 4 if raw_params else (
            collisions.guard(self._pos_type), collisions.guard(self._named_type),
            None if self._var_pos is None else collisions.guard(self._var_pos),
            None if self._var_kw is None else collisions.guard(self._var_kw))
        self._guards = guards if any(guards) else None
        if not (raw_params or self._var_pos or self._var_kw or self._required_kwonly or self._guards):
            self._fast = (
                msgspec.json.Decoder(self._pos_type),
                None if kwonly else msgspec.json.Decoder(self._named_type),
            )

    def params_schema(self) -> dict[str, object]:
        """JSON Schema of the named params (used by HELLO, and later by MCP): `{}` for a
        hint msgspec cannot describe, or whose description has no JSON form (round 36:
        `Meta(examples=[numpy.int64(10)])` stopped the worker's boot with a bare traceback)."""
        if self.raw_params:
            return {}
        try:
            schema = msgspec.json.schema(self._named_type)
            msgspec.json.encode(schema)
        except (TypeError, ValueError):  # (UnicodeEncodeError included: a lone surrogate)
            return {}
        return schema

    def bind(self, params: bytes, max_depth: int) -> tuple[tuple[object, ...], dict[str, object]]:
        """Raw JSON params (b"" when absent) → `(args, kwargs)` for the handler.

        Raises `InvalidParams` when they do not fit the signature, and
        `NestingTooDeep` past `max_depth` levels of arrays and objects.
        """
        if not params:
            if self.raw_params:
                return (None,), {}
            params = b"[]"
        fast = self._fast
        # Whether they nest past max_depth (exact for JSON; params that are not go on to
        # the checks below, which say so first). Params shorter than max_depth cannot
        # hold more brackets, nor can those with fewer (counted inline: the usual case,
        # no call); `nests_deeper` looks further (brackets in strings do not count:
        # they took every such call off the fast path and through a whole `scan_json`,
        # hostile testing).
        deep = (
            len(params) > max_depth
            and params.count(b"[") + params.count(b"{") > max_depth
            and nests_deeper(params, max_depth)
        )
        if fast is not None and not deep:
            try:
                first = params[0]
                if first == 0x5B:  # "["
                    return _astuple(fast[0].decode(params)), {}
                if first == 0x7B and fast[1] is not None:  # "{"
                    return _astuple(fast[1].decode(params)), {}
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
                pass
        if self.raw_params:
            _check_raw(params, max_depth, deep)
            return (msgspec.Raw(params),), {}
        try:
            obj = _decode_json(params) if self._typed is None else self._decode_typed(params, self._typed)
        except RecursionError:  # deeper than the parser takes, whatever max_depth says
            raise NestingTooDeep(max_depth) from None
        except msgspec.ValidationError as exc:  # valid JSON, with a number msgspec cannot hold
            obj = _values_decoded(params, _decode_json)  # (unless a later duplicate key replaced it)
            if obj is None:
                raise self._out_of_range(params, str(exc)) from None
        except msgspec.DecodeError as exc:
            raise InvalidParams(None, f"params are not valid JSON: {exc}") from None
        if deep:
            raise NestingTooDeep(max_depth)
        if self._guards is not None and self._typed is None:  # (typed: each value was checked)
            self._check_floods(obj, self._guards)
        if type(obj) is list:
            return self._bind_positional(obj), {}
        if type(obj) is not dict:  # section 4.2: params is an array or an object
            raise InvalidParams(None, "params must be an array or an object")
        return self._bind_named(obj)

    def _decode_typed(self, params: bytes,
                      typed: dict[str, tuple[msgspec.json.Decoder[typing.Any], collisions.Check | None]]) -> object:
        """Decode params whose parameters' hints hold a `msgspec.Raw`: each value such a
        parameter takes is decoded from its own text with its own type, the others as
        `bind` decodes them. Raises `InvalidParams` for a value that does not fit."""
        try:
            top = _RAW_TOP(params)
        except msgspec.ValidationError:
            raise InvalidParams(None, "params must be an array or an object") from None
        n = len(self._pos_names)
        if type(top) is list:
            var_pos = self._var_pos_name() if "*" in typed else ""
            return [self._decode_value(raw, typed.get(self._pos_names[i] if i < n else "*"),
                                       self._pos_names[i] if i < n else var_pos, "" if i < n else f"params[{i}]")
                    for i, raw in enumerate(top)]
        known, kw_only = self._named_type.__struct_fields__, self._pos_only  # (as in _check_floods)
        return {key: self._decode_value(raw, typed.get(key if key in known and key not in kw_only else "**"), key, "")
                for key, raw in typing.cast(dict[str, msgspec.Raw], top).items()}

    def _decode_value(self, raw: msgspec.Raw,
                      typed: tuple[msgspec.json.Decoder[typing.Any], collisions.Check | None] | None,
                      name: str, where: str) -> object:
        try:
            if typed is None:
                return _decode_json(raw)
            decoder, check = typed
            if check is not None:  # (the sets it holds, before they are built)
                try:
                    read = self._guard_decode(raw)
                    check(read)
                except collisions.Flooded as exc:
                    raise _flooded(exc, name, exc.where, where or None) from None
                except ArithmeticError:  # (a Decimal's exponent past decimal's limits: round 38)
                    raise msgspec.ValidationError("Number out of range") from None
                # Decoded from what the check read, written again: an object's duplicate
                # keys are gone, as they were for the check (round 39: the decoder built the
                # set of every duplicate, the check saw the last; 1 MiB held a worker 12.8 s).
                try:
                    raw = msgspec.Raw(_REWRITE(_float_form(read) if self._guard_decode is _DECIMAL_JSON else read))
                finally:
                    _UNDERFLOWED.clear()
            return decoder.decode(raw)
        except msgspec.ValidationError as exc:
            message = str(exc)
            raise InvalidParams(name or None, _inside(message, where or name, f"{message} ({where})" if where
                                                      else message)) from None

    def _check_floods(self, obj: object, guards: tuple[collisions.Check | None, ...]) -> None:
        """Refuse params putting more than `collisions.SHARED_HASH_MAX` distinct values of
        one hash in a set or an object's keys (hash flooding: building them would take
        time quadratic in their count), naming the parameter and where in it."""
        pos, named, var_pos, var_kw = guards
        n = len(self._pos_names)
        if type(obj) is list:
            try:
                if pos is not None:
                    pos(obj)
            except collisions.Flooded as exc:
                raise _flooded(exc, self._pos_names[typing.cast(int, exc.where[0])], exc.where[1:]) from None
            try:
                if var_pos is not None and len(obj) > n:
                    var_pos(obj[n:])
            except collisions.Flooded as exc:
                index = n + typing.cast(int, exc.where[0])
                raise _flooded(exc, self._var_pos_name(), [index, *exc.where[1:]], "params") from None
        elif type(obj) is dict:
            # (as `_bind_named` takes them: beside **kwargs, a positional-only parameter's name
            # is **kwargs's; round 37, it was checked as the parameter's, built unchecked)
            known, kw_only = self._named_type.__struct_fields__, self._pos_only
            try:
                if named is not None:
                    named({k: v for k, v in obj.items() if k not in kw_only} if kw_only else obj)
                if var_kw is not None:
                    var_kw({k: v for k, v in obj.items() if k not in known or k in kw_only})
            except collisions.Flooded as exc:
                raise _flooded(exc, str(exc.where[0]), exc.where[1:]) from None

    def _bind_positional(self, values: list[object]) -> tuple[object, ...]:
        if self._required_kwonly:
            raise InvalidParams(
                self._required_kwonly[0], "keyword-only parameter: pass params by name"
            )
        n = len(self._pos_names)
        head = values[:n] if self._var_pos is not None else values
        try:
            bound = msgspec.structs.astuple(msgspec.convert(head, self._pos_type, str_keys=True))
        except msgspec.ValidationError as exc:
            raise self._invalid(str(exc), len(head)) from None
        if self._var_pos is None or len(values) <= n:
            return bound
        try:
            rest = msgspec.convert(values[n:], self._var_pos, str_keys=True)
        except msgspec.ValidationError:
            raise self._invalid_extra(values[n:]) from None
        return bound + tuple(rest)

    def _bind_named(self, values: dict[str, object]) -> tuple[tuple[object, ...], dict[str, object]]:
        extra: dict[str, object] = {}
        if self._pos_only:  # (beside **kwargs)
            if self._pos_only_required:
                raise InvalidParams(self._pos_only_required[0],
                                    "positional-only parameter beside **kwargs: pass params as an array")
            named = [k for k in values if k in self._pos_only]
            if named:  # (**kwargs's, as in Python; the parameter keeps its default)
                extra = {k: values[k] for k in named}
                values = {k: v for k, v in values.items() if k not in self._pos_only}
        if self._var_kw is not None:
            known = set(self._pos_names) | set(self._kwonly)
            extra |= {k: values[k] for k in values if k not in known}
            try:
                extra = msgspec.convert(extra, self._var_kw, str_keys=True)
            except msgspec.ValidationError:
                raise self._invalid_extra(extra) from None
        try:
            bound = msgspec.structs.astuple(msgspec.convert(values, self._named_type, str_keys=True))
        except msgspec.ValidationError as exc:
            raise self._invalid(str(exc), None, values) from None
        n = len(self._pos_names)
        kwargs = dict(zip(self._named_kwonly_order(), bound[n:]))
        kwargs.update(extra)
        return bound[:n], kwargs

    def _invalid_extra(self, values: list[object] | dict[str, object]) -> InvalidParams:
        """Name the value taken by `*args` (its name and place in params) or by
        `**kwargs` (the key) that does not fit the hint; cold path, so it re-checks."""
        if type(values) is list:
            hint = typing.get_args(self._var_pos)[0]
            name = self._var_pos_name()
            for i, value in enumerate(values, len(self._pos_names)):
                try:
                    msgspec.convert(value, hint, str_keys=True)
                except msgspec.ValidationError as exc:
                    return InvalidParams(name, _inside(str(exc), f"params[{i}]", f"{exc} (params[{i}])"))
        else:
            hint = typing.get_args(self._var_kw)[1]
            for key, value in typing.cast(dict[str, object], values).items():
                try:
                    msgspec.convert(value, hint, str_keys=True)
                except msgspec.ValidationError as exc:
                    return InvalidParams(key, _inside(str(exc), key, str(exc)))
        return InvalidParams(None, "params do not fit the signature")

    def _out_of_range(self, params: bytes, message: str) -> InvalidParams:
        """Name the parameter holding a value msgspec cannot hold (a number past a
        double's range, e.g. 1e400). msgspec's `message` locates it as `$[i]...` in an
        array (the i-th positional parameter, or `*args`), but only as `$[...]...` in an
        object: its key is then found by decoding each value alone. Cold path."""
        at = _located(message)
        if at is not None and at[1] is not None:  # $[i]
            index = at[1]
            if index < len(self._pos_names):
                return self._invalid(message, None)
            if self._var_pos is not None:
                reason, inner = at[0], at[3]
                where = f" - at `params[{index}]{inner}`" if inner else f" (params[{index}])"
                return InvalidParams(self._var_pos_name(), reason + where)
            return InvalidParams(None, message)  # past the positional parameters
        try:
            values = msgspec.json.decode(params, type=dict[str, msgspec.Raw])
        except (msgspec.ValidationError, msgspec.DecodeError):
            return InvalidParams(None, message)
        for key, value in values.items():
            try:
                _decode_json(value)
            except msgspec.ValidationError as exc:
                reason, _, inner = str(exc).partition(" - at `$")  # (inner ends with its `)
                return InvalidParams(key, f"{reason} - at `{key}{inner}" if inner else reason)
        return InvalidParams(None, message)

    def _var_pos_name(self) -> str:
        """The name of the `*args` parameter (cold path: read from the signature)."""
        return next(p.name for p in inspect.signature(self.fn).parameters.values()
                    if p.kind is inspect.Parameter.VAR_POSITIONAL)

    def _named_kwonly_order(self) -> list[str]:
        return list(self._named_type.__struct_fields__[len(self._pos_names):])

    def _invalid(self, message: str, given: int | None, values: dict[str, object] | None = None) -> InvalidParams:
        """Map a msgspec validation message to the parameter it is about. `values`: the
        params given by name, whose keys are checked here rather than read back from the
        message, which quotes them (hostile testing, round 34: a key holding " - at
        `$[7]" was taken for the place of the error, and answered -32603)."""
        if values is not None and self._var_kw is None:
            known = self._named_type.__struct_fields__
            unknown = next((key for key in values if key not in known), None)
            if unknown is not None:
                return InvalidParams(unknown, "unexpected parameter")
        at = _located(message)
        if at is not None:
            reason, index, field, inner = at
            if index is not None and index >= len(self._pos_names):
                return InvalidParams(None, message)
            name = self._pos_names[index] if index is not None else typing.cast(str, field)
            if inner:  # inside the parameter: say where, e.g. `items[0].qty`
                reason = f"{reason} - at `{name}{inner}`"
            return InvalidParams(name, reason)
        if given is not None and "array" in message:
            n = len(self._pos_names)
            if given < n:
                return InvalidParams(self._pos_names[given], "missing required parameter")
            return InvalidParams(None, f"too many positional params: takes at most {n}, got {given}")
        f = _FIELD_IN_MSG.search(message)
        if f and "missing" in message:
            return InvalidParams(f.group(1), "missing required parameter")
        if f and "unknown" in message:
            return InvalidParams(f.group(1), "unexpected parameter")
        return InvalidParams(None, message)


def _float_form(value: object) -> object:
    """`value` (decoded with the numbers written with a fraction or an exponent as
    Decimals, `_DECIMAL_JSON`) with each such Decimal as the JSON text of a number in
    that form again (`format(d, "e")`: exact), so that the value written again decodes as
    the text sent would: a Decimal written as `str(d)` made `1e0` an integer `1`, which an
    `int` takes and the check had not read as one (hostile testing, round 42: a set's first
    element of 21 digits written `...e0` turned the check off, 1 MiB held a worker 25.6 s)."""
    kind = type(value)
    if kind is list:
        return [_float_form(item) for item in typing.cast(list[object], value)]
    if kind is dict:
        return {key: _float_form(item) for key, item in typing.cast(dict[str, object], value).items()}
    if kind is decimal.Decimal:
        return msgspec.Raw(format(typing.cast(decimal.Decimal, value), "e").encode())
    if kind is float and _UNDERFLOWED:
        held = _UNDERFLOWED.get(id(value))
        if held is not None and held[0] is value:
            return msgspec.Raw(held[1].encode())
    return value


_UNDERFLOWED: dict[int, tuple[float, str]] = {}  # a zero `_decimal_or_zero` made: (it, the text it was read from)


def _decimal_or_zero(text: str) -> decimal.Decimal | float:
    """A JSON number written with a fraction or an exponent, as a Decimal, or as the float
    zero msgspec reads it as where its exponent is past decimal's limits (`1e-99999999999999999999`),
    kept in `_UNDERFLOWED` to be written again as sent (round 43: refused "Number out of
    range" beside a Decimal, bound as 0.0 elsewhere). One past them the other way, which
    msgspec refuses too, raises `decimal.InvalidOperation`."""
    try:
        return decimal.Decimal(text)
    except decimal.InvalidOperation:
        value = float(text)
        if value:  # (inf: "Number out of range", as msgspec says)
            raise
        _UNDERFLOWED[id(value)] = (value, text)
        return value


def _values_decoded(params: bytes, decode: Callable[[bytes], object]) -> dict[str, object] | None:
    """An object's values decoded each alone, the last of duplicate keys kept (as a whole
    decode keeps it), or None if one does not decode: params `{"a": 1e400, "a": 2}` bind
    `a` to 2, as `{"a": "x", "a": 2}` do (round 36: refused, no parameter named). Cold path."""
    try:
        values = msgspec.json.decode(params, type=dict[str, msgspec.Raw])
        return {key: decode(value) for key, value in values.items()}
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None


def _flooded(exc: collisions.Flooded, name: str, path: list[str | int], root: str | None = None) -> InvalidParams:
    """`Method._check_floods`'s refusal: the parameter, and where in it (`path`)."""
    inner = "".join(f"[{step}]" if type(step) is int else f".{step}" for step in path)
    return InvalidParams(name, exc.reason.format(at=f" - at `{root or name}{inner}`" if inner else ""))


_DECIMAL_JSON = msgspec.json.Decoder(float_hook=_decimal_or_zero).decode
_RAW_TOP = msgspec.json.Decoder(list[msgspec.Raw] | dict[str, msgspec.Raw]).decode
_REWRITE = msgspec.json.encode  # (of `_float_form`'s values: numbers in the form they were sent)


FLAG_PSEUDO_MEMBERS_MAX = 4096
"""How many members an `enum.Flag` class that params bind to may make and cache (one
per value that is not one of its own: `IntFlag` takes any integer) before those that
nothing else holds are dropped."""
_FLAG_KEPT: dict[type, int] = {}  # a Flag class: how many members its map held after the last drop


def _drop_flag_members(classes: tuple[type, ...], afresh: bool = False) -> None:
    """Drop from each class's `_value2member_map_` the members that `enum.Flag`'s
    `_missing_` made and cached there for good (CPython's enum module) and that nothing
    else holds, once it has grown by `FLAG_PSEUDO_MEMBERS_MAX` since the last drop:
    binding `IntFlag` params from a client's distinct integers grew a worker by 36 MiB
    per 780 KiB request, never given back (hostile testing, round 36). The worker calls
    it after each call that binds such params, for every such class (round 38: dropped
    only when the class's own method was called next, each class kept a call's members). A member still held (by a module, or a call under way) stays, the same object;
    one made again after its drop is a new object, indistinguishable (no one held the old)."""
    for cls in classes:
        members = vars(cls).get("_value2member_map_")
        if type(members) is not dict or len(members) <= (0 if afresh else _FLAG_KEPT.get(cls, 0)) + FLAG_PSEUDO_MEMBERS_MAX:
            continue
        for value in _held_only_by(members):
            members.pop(value, None)  # (a tool's thread may have dropped it meanwhile)
        _FLAG_KEPT[cls] = len(members)


def _held_only_by(mapping: dict[object, object]) -> list[object]:
    """The keys of `mapping` whose values nothing else references: CPython reference
    counts, read the same way as that of a value a dict alone holds."""
    probe = {None: object()}  # (held by a dict, and by a list of its items, alone)
    alone = _reference_counts(list(probe.items()))[0][2]
    items = list(mapping.items())  # (one step: a tool's thread may add to it meanwhile)
    times: dict[int, int] = {}  # a value's id: how many keys it is the value of
    for _, value in items:
        times[id(value)] = times.get(id(value), 0) + 1
    # A value under k keys is held by the map and by `items` k times each: 2 (k - 1) more
    # than one under one key (round 37: a member cached under two keys, a negative value
    # and its positive twin, was never dropped, and a worker grew by 10 MiB a call).
    return [key for key, ident, count in _reference_counts(items) if count <= alone + 2 * (times[ident] - 1)]


def _reference_counts(items: list[tuple[object, object]]) -> list[tuple[object, int, int]]:
    return [(key, id(value), sys.getrefcount(value)) for key, value in items]


def _located(message: str) -> tuple[str, int | None, str | None, str] | None:
    """Split a msgspec validation message, "<reason> - at `$<path>`", into `(reason, index,
    field, inner)`: the path's first step, an array index `[i]` or a field `.name`, and the
    rest of it (e.g. `[0].qty`); None if it has no path (an error at the top). The path is
    the message's end and quotes nothing of the client's (an object's key shows as
    `[...]`), while the reason can (a key, an Enum value): so it is split at the last
    " - at `$", in linear time (hostile testing, round 34: a regular expression took
    quadratic time on a client's 300 KB key, 3 s at 32 KB, and its worker was killed as
    hung, with the calls on it)."""
    split = _split_path(message)
    if split is None:
        return None
    reason, path = split
    if path.startswith("["):
        end = path.find("]")
        digits = path[1:end]
        if end < 0 or not (digits.isascii() and digits.isdigit()):
            return None
        return reason, int(digits), None, path[end + 1:]
    if not path.startswith("."):
        return None
    step = _STEP_END.search(path, 1)
    end = len(path) if step is None else step.start()
    if end == 1:
        return None
    return reason, None, path[1:end], path[end:]


def _inside(message: str, where: str, bare: str) -> str:
    """msgspec's `message` about one value (of `*args` or `**kwargs`), its location made
    relative to `where` (`params[1]`, or the key): "<reason> - at `$.sku`" becomes "<reason>
    - at `params[1].sku`", a key's "<reason> - at `key` in `$`" "<reason> (a key) - at
    `params[1]`" (rounds 35, 36: msgspec's `$` was shown); `bare` if it says no place."""
    split = _split_path(message)
    return bare if split is None else f"{split[0]} - at `{where}{split[1]}`"


def _split_path(message: str) -> tuple[str, str] | None:
    """msgspec's validation `message` split into its reason and the path it ends with
    (without `$` and the backquotes), or None if it ends with none. A key's error, "<reason>
    - at `key` in `$<path>`", gives "<reason> (a key)" (round 36: read as no path). The
    path holds nothing of the client's, the reason may (a key, a value), so the split is at
    the last marker whose path is well formed, in linear time (round 34)."""
    for marker, tail in ((" - at `key` in `$", " (a key)"), (" - at `$", "")):
        reason, found, path = message.rpartition(marker)
        if found and path.endswith("`") and "`" not in path[:-1]:
            return reason + tail, path[:-1]
    return None


def _is_async(fn: Callable[..., object]) -> bool:
    """Is `fn` an async handler: a coroutine function, one marked so
    (`inspect.markcoroutinefunction`, 3.12+), or a sync wrapper of one made with
    `functools.wraps` (which returns the coroutine: run as a task, not inline)? A sync
    handler that returns an awaitable anyway is still run as a task (`_execute`)."""
    if inspect.iscoroutinefunction(fn):
        return True
    try:
        inner = inspect.unwrap(fn)
    except ValueError:  # a __wrapped__ cycle
        return False
    return inner is not fn and inspect.iscoroutinefunction(inner)


def _struct_default(value: object) -> object:
    """A parameter's default as a Struct field default. msgspec refuses a non-empty
    list/dict/set/bytearray, and copies an empty one per instance, so give it through a
    factory that returns that same object: the handler sees its default exactly as a
    Python call would (one object, shared by the calls)."""
    if type(value) in (list, dict, set, bytearray):  # (empty too: msgspec copies those per call,
        return msgspec.field(default_factory=lambda: value)  # round 36: a `_cache: dict = {}` memo never filled)
    return value


class NestingTooDeep(Exception):
    """params nest arrays/objects deeper than the configured max_depth."""


def _check_raw(params: bytes, max_depth: int, deep: bool) -> None:
    """The checks raw params get before a `raw_params` handler sees them: JSON
    (RFC 8259), UTF-8 (section 8.1) and max_depth (`deep`: `nests_deeper` said they
    nest past it, which holds once they are JSON). Any valid JSON passes: `1e400` and
    a 5000-digit integer are JSON, though no float or int of msgspec holds them."""
    try:
        _decode_raw(params)
    except RecursionError:
        raise NestingTooDeep(max_depth) from None
    except msgspec.DecodeError as exc:
        raise InvalidParams(None, f"params are not valid JSON: {exc}") from None
    if not params.isascii():
        try:
            params.decode()
        except UnicodeDecodeError:
            raise InvalidParams(None, "params are not valid UTF-8") from None
    if deep:
        raise NestingTooDeep(max_depth)


_decode_raw = msgspec.json.Decoder(msgspec.Raw).decode


class Registry:
    """The set of methods a worker serves, by JSON-RPC method name.

    Names are case-sensitive; names starting with "rpc." are reserved by the spec
    (section 4) and refused with `ValueError`, as are duplicates and "other", the
    metrics' `method` label of calls to unknown methods (`metrics.OTHER`: a tool so
    named was counted with them, hidden from the shipped alerts; round 34).
    """

    def __init__(self) -> None:
        self._methods: dict[str, Method] = {}

    @typing.overload
    def method(self, fn: Callable[..., object], /) -> Callable[..., object]: ...

    @typing.overload
    def method(
        self, fn: None = None, /, *, name: str | None = None, raw_params: bool = False
    ) -> Callable[[Callable[..., object]], Callable[..., object]]: ...

    def method(
        self,
        fn: Callable[..., object] | None = None,
        /,
        *,
        name: str | None = None,
        raw_params: bool = False,
    ) -> Callable[..., object]:
        """Register `fn` under `name` (default: the function's name).

        Use bare (`@registry.method`) or with options
        (`@registry.method(name="ns.op", raw_params=True)`). With `raw_params` the
        handler gets the params' exact JSON as one `msgspec.Raw` argument (None if
        absent), unvalidated; returning a `msgspec.Raw` sends that JSON on, checked and
        made compact (`encode_result`). Returns `fn` unchanged.
        """

        def register(f: Callable[..., object]) -> Callable[..., object]:
            method_name = name or f.__name__
            if method_name.startswith("rpc."):
                raise ValueError(f"method names starting with 'rpc.' are reserved: {method_name!r}")
            if method_name == OTHER:
                raise ValueError(f"method name {OTHER!r} is the metrics' label of calls to unknown methods:"
                                 " register it under another name (name=...)")
            if method_name in self._methods:
                raise ValueError(f"method {method_name!r} is already registered")
            self._methods[method_name] = Method(method_name, f, raw_params)
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
    except AttributeError:
        raise AttributeError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, Registry):
        raise TypeError(f"{spec} is a {type(obj).__name__}, not a broker.worker.Registry")
    if not len(obj):
        raise ValueError(f"{spec} has no methods registered")
    return obj


_ORJSON_OPTIONS = 0  # (the plain form: its leaves are JSON types and fragments)
# The first try: dataclasses and datetimes left to `_plain`, as orjson would run their
# Python code (a field's `__getattribute__`, a tzinfo's `utcoffset`) in the middle of
# walking the handler's containers (hostile testing, round 24: one that emptied the list
# being encoded crashed the worker, SIGSEGV).
# Non-string keys too (round 25: a datetime key's tzinfo ran as orjson walked the dict).
# numpy values too: a datetime64 whose unit has a multiplier (`datetime64[15m]`) makes
# orjson abort the process (round 28: SIGILL); `_native` screens them, leaf by leaf.
_FIRST_OPTIONS = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
_LEAF_OPTIONS = _FIRST_OPTIONS | orjson.OPT_SERIALIZE_NUMPY  # (one leaf, as `_native` gives it)


_PLAIN_DEPTH = 255  # how deep `_plain` goes: orjson's own limit (its recursion limit)
_NONE = type(None)
_ORJSON_INTS = range(-(2**63), 2**64)  # the integers orjson writes (msgspec those past them)


class _TooDeep(ValueError):
    """A result nests deeper than `_PLAIN_DEPTH` levels, or refers to itself."""


def _plain(value: object, depth: int = 0, seen: dict[int, tuple[object, object]] | None = None) -> object:
    """`value` made of plain JSON containers (new dicts and lists, of snapshots of the
    handler's: sets and tuples as lists, Structs and dataclasses as objects, what has a
    `tolist()` and orjson refuses as what it returns: numpy arrays orjson does not take
    natively, as its docs advise, array.array), for orjson to write with no Python code
    of the handler's running. Every other leaf becomes an `orjson.Fragment` of its JSON
    form: orjson's own where orjson takes it (numpy values, enums, UUIDs, subclasses of
    str and int), else msgspec's, checked (integers past 64 bits, bytes as base64,
    Decimal as a string, a `msgspec.Raw` made compact). So a value is written the same
    whatever its neighbours (hostile testing, rounds 24 and 25: numpy's float32, a str
    subclass, a float, written by msgspec next to an integer past 64 bits, differed).

    A container met again (a result that shares parts, a DAG) is made plain once:
    `seen` maps its id to it and its plain form.

    Python code of the handler's objects (a `tolist()`) runs only here, never while a C
    encoder walks the handler's containers: one that emptied the list it sat in, or
    another thread of the tool changing a set meanwhile, had orjson read freed memory,
    and the worker died of SIGSEGV with every call on it (hostile testing, round 23; the
    same script crashes orjson alone, and msgspec with a hook). Raises `_TooDeep`,
    `TypeError` (no JSON form), `InvalidJson` (a `msgspec.Raw` that is not JSON), or what
    a `tolist()` or msgspec (a 5000-digit integer) raises."""
    # (By identity, never `in` a set or a tuple, which compares by `__eq__`, a metaclass's
    # to fake: hostile testing, round 34, a list subclass "equal" to str reached orjson whole.)
    kind = type(value)
    if kind is str or kind is float or kind is bool or kind is _NONE:
        return value
    if kind is int:
        return value if value in _ORJSON_INTS else orjson.Fragment(msgspec.json.encode(value))
    if _SCALARS.get(kind) is kind:  # (a numpy number, bool or string scalar: orjson's own form, at once)
        return orjson.Fragment(orjson.dumps(value, option=_LEAF_OPTIONS))
    if depth >= _PLAIN_DEPTH:
        raise _TooDeep(f"nests deeper than {_PLAIN_DEPTH} levels (or refers to itself)")
    if seen is None:
        seen = {}
    elif (met := seen.get(id(value))) is not None and met[0] is value:
        return met[1]
    depth += 1
    if isinstance(kind, enum.EnumType) and not issubclass(kind, _NATIVE_MIXINS):
        return _plain_leaf(value, depth, seen)  # (a tuple or set Enum: its value, as orjson writes it)
    if issubclass(kind, dict):
        plain: object = {_key(key): _plain(item, depth, seen) for key, item in list(dict.items(typing.cast(dict[object, object], value)))}
    elif issubclass(kind, (list, tuple, set, frozenset)):
        plain = [_plain(item, depth, seen) for item in _items(typing.cast(list[object], value))]
    else:
        plain = _plain_leaf(value, depth, seen)
        if type(plain) is not dict and type(plain) is not list:
            return plain
        # (a Struct, a dataclass, what `tolist()` gave: made plain once too, round 39: one
        # Struct shared through a result was taken apart each time, 3.4 s for 12 MiB)
    seen[id(value)] = (value, plain)  # (`value` kept: its id is not reused meanwhile)
    return plain


def _plain_leaf(value: object, depth: int, seen: dict[int, tuple[object, object]]) -> object:
    """`_plain` of what is neither a container nor a plain leaf. Only single values go to a
    C encoder whole: what holds others is taken apart here first (round 29: an Enum's
    numpy value reached orjson whole and aborted it; a Struct's contents that `_plain`
    refused sent the Struct to msgspec's hook; an attrs instance was walked by msgspec).
    Sorted by their type, never by `isinstance`, which believes an instance's `__class__`
    (round 30: a dataclass claiming to be a Fragment or a datetime reached orjson whole,
    which walked it and ran a tzinfo that emptied its list: SIGSEGV)."""
    kind = type(value)
    if issubclass(kind, orjson.Fragment):
        return value  # (its newlines: `_framed`)
    if issubclass(kind, msgspec.Raw):
        return orjson.Fragment(_checked_json(bytes(typing.cast(msgspec.Raw, value))))
    if issubclass(kind, msgspec.Struct):
        return _struct_plain(typing.cast(msgspec.Struct, value), depth, seen)
    if issubclass(kind, str):  # subclasses, as orjson reads them: the string itself, whatever
        return str.__str__(typing.cast(str, value))  # else they are (a dataclass, an Enum: rounds 29, 31)
    if issubclass(kind, int):  # (past 64 bits too; bool is a leaf)
        return _plain(int.__int__(typing.cast(int, value)), depth, seen)
    if isinstance(kind, enum.EnumType):  # (as orjson writes it: its value; its metaclass makes it one
        return _plain(typing.cast(enum.Enum, value).value, depth, seen)  # to orjson, round 31; a float one too)
    if issubclass(kind, float):
        return float.__float__(typing.cast(float, value))
    if issubclass(kind, _DATETIMES):  # (as orjson writes it: RFC 3339, "+00:00")
        return orjson.Fragment(orjson.dumps(_exact_datetime(typing.cast(datetime.date, value))))
    met = _DATACLASS_FIELDS.get(kind)
    names = met[1] if met is not None and met[0] is kind else _fields(value)
    if names is not None:  # (as orjson: its fields in order, those named with a leading underscore left out)
        return {name: _plain(getattr(value, name), depth, seen) for name in names}
    try:
        written = orjson.dumps(_native(value), option=_LEAF_OPTIONS)
    except TypeError:
        pass
    else:
        numpy = sys.modules.get("numpy")
        if numpy is not None and issubclass(kind, (numpy.number, numpy.bool_)) and len(_SCALARS) < 64:
            _SCALARS[kind] = kind  # (written by orjson: `_plain` writes the next ones at once)
        return orjson.Fragment(written)
    if issubclass(kind, _BY_MSGSPEC):  # (before `tolist`: a memoryview's bytes as base64, as bytes are; round 32)
        return orjson.Fragment(msgspec.json.encode(_msgspec_exact(value, kind)))  # (one value, holding none)
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        listed = tolist()
        if type(listed) is type(value):  # (numpy's longdouble: its own tolist)
            raise TypeError(f"cannot encode an object of type {type(value).__name__}")
        return _plain(listed, depth, seen)
    raise TypeError(f"cannot encode an object of type {type(value).__name__}")


_BY_MSGSPEC = (decimal.Decimal, bytes, bytearray, memoryview, datetime.timedelta, uuid.UUID)  # (orjson refuses them)
_TIMEDELTA_FIELDS = tuple(getattr(datetime.timedelta, name) for name in ("days", "seconds", "microseconds"))


def _msgspec_exact(value: object, kind: type) -> object:
    """A `_BY_MSGSPEC` value as one of the exact types msgspec writes (it refuses their
    subclasses: numpy's `bytes_`, round 32), read by C: bytes-likes by their buffer."""
    if kind is memoryview:  # (its bytes in order, as a copy: msgspec refused a strided one, round 39)
        return memoryview.tobytes(typing.cast(memoryview, value))
    if any(kind is exact for exact in _BY_MSGSPEC) or issubclass(kind, uuid.UUID):  # (by identity: `_plain`)
        return value
    if issubclass(kind, decimal.Decimal):
        return decimal.Decimal(typing.cast(decimal.Decimal, value))
    if issubclass(kind, datetime.timedelta):
        return datetime.timedelta(*(field.__get__(value) for field in _TIMEDELTA_FIELDS))
    return bytes(memoryview(typing.cast(bytes, value)))


def _items(value: list[object] | tuple[object, ...] | set[object] | frozenset[object]) -> list[object]:
    """A snapshot of a list, tuple or set (or a subclass's) items as stored, as orjson reads
    a list: not through a subclass's `__iter__` (hostile testing, round 27: a list subclass
    read differently beside an integer past 64 bits)."""
    kind = type(value)
    if issubclass(kind, list):
        return list.copy(typing.cast(list[object], value))
    if issubclass(kind, tuple):
        return list(tuple.__iter__(typing.cast(tuple[object, ...], value)))
    if issubclass(kind, set):
        return list(set.__iter__(typing.cast(set[object], value)))
    return list(frozenset.__iter__(typing.cast(frozenset[object], value)))


_DATETIMES = (datetime.datetime, datetime.date, datetime.time)
# An Enum of these is written by orjson as one of these (its data: a float one, as its
# `value`, read mid-walk: round 32, SIGSEGV past `_check_enum`, and written apart as a float).
_NATIVE_MIXINS = (str, int, dict, list)


# Whether orjson's first pass (`encode_result`) can be trusted with every Enum class made
# in this process: False for good once one is not (`_check_enum`).
_ORJSON_FIRST = True
_UNTRUSTED_ENUMS: list[str] = []  # (the classes that turned it off: the log, the tests)


def _watch_enums() -> None:
    """Check the Enum classes made so far (Enum's subclasses), and wrap
    `enum.EnumType.__new__` to check every one made after (`_check_enum`). Run when this
    module is imported as `broker.worker` (not as `__main__` under `-m`: `main` runs the
    real module's code, which reads its own `_ORJSON_FIRST`)."""
    made = enum.EnumType.__dict__["__new__"].__func__

    def __new__(metacls: type, *args: object, **kwargs: object) -> type:
        cls = made(metacls, *args, **kwargs)
        _check_enum_closed(cls)
        return typing.cast(type, cls)

    __new__.__wrapped__ = made  # type: ignore[attr-defined]
    enum.EnumType.__new__ = staticmethod(__new__)  # type: ignore[method-assign,assignment]
    for name in ("__setattr__", "__delattr__"):  # (round 32: a `value` property set on the class later)
        setattr(enum.EnumType, name, _rechecking(getattr(enum.EnumType, name)))
    pending: list[type] = [enum.Enum]
    while pending:
        cls = pending.pop()
        _check_enum_closed(cls)
        pending.extend(type.__subclasses__(cls))


def _rechecking(change: Callable[..., None]) -> Callable[..., None]:
    """`enum.EnumType`'s `__setattr__` or `__delattr__`, `change`, followed by
    `_check_enum` of the class changed and of every class derived from it when the name
    is one `_enum_trusted` reads (only those: EnumType sets each member so as it makes a
    class, and a check each time took 2 s for an Enum of 3000 members, 0.06 s alone)."""

    def changed(cls: type, name: str, *args: object) -> None:
        change(cls, name, *args)
        if name not in _ENUM_LOOKUPS:
            return
        pending = [cls]
        while pending:
            klass = pending.pop()
            _check_enum_closed(klass)
            pending.extend(type.__subclasses__(klass))

    changed.__wrapped__ = change  # type: ignore[attr-defined]
    return changed


def _check_enum(cls: type) -> None:
    """Turn `_ORJSON_FIRST` off for good if orjson cannot be trusted with `cls`'s instances.

    orjson writes an instance of a class whose metaclass is `enum.EnumType` (but for the
    `_NATIVE_MIXINS`) as its `value`, read mid-walk: a `value` that raised, or a member
    whose value was itself or another such member, made orjson read a NULL or recurse past
    its stack, and the worker died of SIGSEGV with every call on it (hostile testing, round
    31). Trusted: a class derived from `enum.Enum` (an instance of one made with
    `metaclass=EnumType` alone can hold any `value`) whose `value` and attribute lookup are
    Enum's own and whose members' values are not Enum members orjson reads the value of.
    Once one is not, every result is made plain first (`_plain`, which reads a value as
    Python code and bounds its depth): slower (README, "Results"). A class's own
    `_missing_` is wrapped to check each member it makes (`_guard_missing`). A member's
    value changed after its class was made is not seen."""
    if not _ORJSON_FIRST or issubclass(cls, _NATIVE_MIXINS):
        return
    if not _enum_trusted(cls) or _guard_missing(cls) is False:
        _untrust(cls)


def _check_enum_closed(cls: type) -> None:
    """`_check_enum`, failing closed: a check that raises (the class's own code, run as
    it is read) leaves the class untrusted, and the class is made all the same (hostile
    testing, round 35: a check that raised failed the class statement, and a member its
    `__init__` had kept belonged to a class never checked; a recheck that raised after
    the attribute was set left trust on)."""
    try:
        _check_enum(cls)
    except Exception:
        _untrust(cls)


def _untrust(cls: type) -> None:
    """Turn `_ORJSON_FIRST` off for good, because of `cls`, logged."""
    global _ORJSON_FIRST
    _ORJSON_FIRST = False
    try:
        name = f"{type.__getattribute__(cls, '__module__')}.{type.__getattribute__(cls, '__qualname__')}"
    except Exception:  # (a class of odd names: its check failed on it)
        name = "(an Enum class whose name cannot be read)"
    _UNTRUSTED_ENUMS.append(name)
    log.warning("Enum class %s: orjson cannot be trusted to read its members' values (one raises, "
                "refers back to a member, or is looked up by code of the class's own): every result "
                "of this worker is written the slower way, taken apart first (README, \"Results\")", name)


def _enum_trusted(cls: type) -> bool:
    """`_check_enum`'s test."""
    if not issubclass(cls, enum.Enum):
        return False
    for klass in cls.__mro__:  # (the class's own lookup, not its metaclass's; a C type's is C)
        own = vars(klass)
        if "__getattr__" in own or ("__getattribute__" in own and not any(klass is t for t in _GENERIC_LOOKUP)):
            return False  # (round 36: a C type's own lookup need not be the generic one: GenericAlias
            # forwards every name to its origin, threading.local reads a per-thread dict)
        if ("value" in own and klass is not enum.Enum) or "_value_" in own:  # (a property of its own, a
            return False  # member named so, or a descriptor read before the member's own: round 34)
        if type(own.get("__dict__")) not in _PLAIN_DICT:  # (round 35: a `__dict__` property showed
            return False  # `vars(member)` a dict the member's lookups do not use)
    if vars(enum.Enum).get("value") is not _ENUM_VALUE or getattr(_ENUM_VALUE, "fget", None) is not _ENUM_VALUE_GET:
        return False  # (round 35: Enum's own `value` replaced, a recheck skipped it)
    return all(_member_trusted(member) for member in vars(cls).get("_member_map_", {}).values())


def _member_trusted(member: object) -> bool:
    """Whether orjson can read `member`'s value: it has one, and not an Enum member whose
    value orjson would read in turn."""
    own = vars(member) if hasattr(member, "__dict__") else None
    if type(own) is not dict or not all(type(name) is str for name in own):
        return False  # (a dict subclass, or a key of a str subclass: its `__eq__` would run as `_value_` is looked up)
    value = own.get("_value_", _NO_VALUE)
    kind = type(value)
    return value is not _NO_VALUE and not (isinstance(kind, enum.EnumType) and not issubclass(kind, _NATIVE_MIXINS))


def _guard_missing(cls: type) -> bool | None:
    """Wrap the `_missing_` of `cls`'s own (not the enum module's: Flag's makes members of
    integer value) so that each member it makes that is not one of the class's own is
    checked (`_member_trusted`), and one orjson cannot be trusted with turns
    `_ORJSON_FIRST` off before it is returned: msgspec calls `_missing_` as it decodes
    params, and a member made there without `_value_` crashed the worker with a client's
    input alone, a chain of them valued by each other orjson's stack (hostile testing,
    round 33). False if its `_missing_` is not a classmethod (not checked: untrusted)."""
    for klass in cls.__mro__:
        found = vars(klass).get("_missing_")
        if found is not None:
            break
    else:
        return None
    if klass.__module__ == "enum":
        return None
    function = getattr(found, "__func__", None)
    if type(found) is not classmethod or function is None:
        return False
    if getattr(function, "_checked_by", None) is _check_made:  # (wrapped already)
        return None

    def _missing_(owner: type, value: object) -> object:
        member = function(owner, value)
        _check_made(owner, member)
        return member

    _missing_._checked_by = _check_made  # type: ignore[attr-defined]
    _missing_.__wrapped__ = function  # type: ignore[attr-defined]
    type.__setattr__(klass, "_missing_", classmethod(_missing_))
    return None


def _check_made(cls: type, member: object) -> None:
    """`_guard_missing`'s check of a member `cls._missing_` made."""
    kind = type(member)
    if not _ORJSON_FIRST or member is None or issubclass(kind, _NATIVE_MIXINS) or not isinstance(kind, enum.EnumType):
        return
    if vars(cls).get("_member_map_", {}).get(vars(member).get("_name_") if hasattr(member, "__dict__") else None) is member:
        return  # (one of its own: checked with the class)
    if not _member_trusted(member):
        _untrust(kind)


_ENUM_LOOKUPS = frozenset({"value", "_value_", "__getattribute__", "__getattr__", "_member_map_", "_missing_", "__bases__"})
_NO_VALUE = object()
# C types whose own `__getattribute__` is the generic lookup (PyObject_GenericGetAttr), as a
# member's class may mix them in; any other class with a lookup of its own is not trusted.
_GENERIC_LOOKUP = (object, int, str, float, complex, bytes, bytearray, tuple, list, dict, set, frozenset,
                   decimal.Decimal, datetime.date, datetime.datetime, datetime.time, datetime.timedelta)
_PLAIN_DICT = (type(None), types.GetSetDescriptorType)  # a class's own `__dict__` entry: none, or the one type makes
_ENUM_VALUE = vars(enum.Enum)["value"]  # Enum's own `value` (an `enum.property`), and what it calls
_ENUM_VALUE_GET = _ENUM_VALUE.fget
if __name__ != "__main__":  # (under `-m`, the real module's watch is the one `main` reads)
    _watch_enums()
_DATETIME_FIELDS = tuple(getattr(datetime.datetime, name) for name in (
    "year", "month", "day", "hour", "minute", "second", "microsecond"))  # (the C fields' own readers)
_TIME_FIELDS = tuple(getattr(datetime.time, name) for name in ("hour", "minute", "second", "microsecond"))
_DATETIME_FOLD = datetime.datetime.fold
_TIME_TZINFO = datetime.time.tzinfo
_UTC = datetime.UTC


def _whole_minutes(offset: datetime.timedelta) -> bool:
    """Whether a UTC offset is a whole number of minutes, as RFC 3339 section 5.6 writes one."""
    return not (offset.seconds % 60 or offset.microseconds)


def _exact_datetime(value: datetime.date | datetime.time) -> datetime.date | datetime.time:
    """A datetime, date or time (or a subclass's) as a value of the exact stdlib type with
    the same fields, for orjson to write with no Python code of the value's own: an aware
    datetime's offset is taken here (`datetime.utcoffset`, which Python checks: a
    timedelta within a day) and given as a `datetime.timezone`. orjson called a tzinfo's
    methods itself and trusted what they gave: one raising (a tzinfo subclass without
    `utcoffset`), or a pytz-like `normalize` raising, crashed the worker (SIGSEGV); a
    25-hour offset was written as +01:00, a str one as garbage (hostile testing, round
    30). Raises what the tzinfo raises, `TypeError`/`ValueError` for an offset Python
    refuses, and `TypeError` for a time with a tzinfo (as orjson: no JSON form)."""
    kind = type(value)
    if kind is datetime.datetime:
        zone = typing.cast(datetime.datetime, value).tzinfo
        if zone is None or zone is _UTC or (type(zone) is datetime.timezone and _whole_minutes(zone.utcoffset(None))):
            return value  # (the usual one: naive, or UTC or another fixed offset, read by orjson in C)
    if issubclass(kind, datetime.datetime):
        offset = datetime.datetime.utcoffset(typing.cast(datetime.datetime, value))
        zone = None if offset is None else datetime.timezone(offset)
        year, month, day, hour, minute, second, micro = (field.__get__(value) for field in _DATETIME_FIELDS)
        made = datetime.datetime(year, month, day, hour, minute, second, micro, zone, fold=_DATETIME_FOLD.__get__(value))
        # RFC 3339 offsets are whole minutes: one with seconds (a local mean time, Amsterdam's
        # +00:19:32 until 1937) was written rounded, the instant 28 s off, 23:59:59 as
        # "+23:60", -00:00:01 as "-00:00" ("offset unknown"): written in UTC (round 32)
        return made if offset is None or _whole_minutes(offset) else made.astimezone(_UTC)
    if issubclass(kind, datetime.date):
        day = typing.cast(datetime.date, value)
        return day if kind is datetime.date else datetime.date.fromordinal(datetime.date.toordinal(day))
    if _TIME_TZINFO.__get__(value) is not None:
        raise TypeError("datetime.time must not have tzinfo set (it has no UTC offset of its own)")
    return datetime.time(*(field.__get__(value) for field in _TIME_FIELDS), fold=datetime.time.fold.__get__(value))


# numpy's scalar types met so far that orjson writes as they are (numbers, bools, strings;
# not datetime64, nor objects): `_plain` gives them to orjson at once (a list of 1000
# float64s took 6x as long through `_plain_leaf` as orjson's first try had, round 28's fix).
_SCALARS: dict[type, type] = {}  # (each its own value: read back by identity, `_plain`)


class _StructForm(typing.NamedTuple):
    """How msgspec writes a Struct type: its fields' encode names (renamed), their
    defaults (or `NODEFAULT`), their factories if list, dict or set (whose
    empty values count as the default; else None), whether defaults are left out, the
    tag field's name and value (or None), and whether it is an array."""

    names: tuple[str, ...]
    defaults: tuple[object, ...]
    empties: tuple[type | None, ...]
    omit_defaults: bool
    tag: tuple[str, object] | None
    array_like: bool


_STRUCT_FORMS: dict[type, tuple[type, _StructForm]] = {}  # per Struct type met (at most 1024)
_EMPTY_DEFAULTS = (list, dict, set)  # the factories msgspec's omit_defaults knows (not bytearray: round 30)


def _struct_form(cls: type) -> _StructForm:
    """The `_StructForm` of a `msgspec.Struct` type, from the attributes msgspec gives it:
    `__struct_encode_fields__`, `__struct_defaults__` (the last fields', a factory as a
    `Factory` holding it) and `__struct_config__` (msgspec's docs, "Structs": rename,
    omit_defaults, tagged unions, array_like). Not `msgspec.structs.fields`, which
    evaluates the annotations (round 31's preparation: one naming an undefined type
    raised NameError for a Struct that msgspec writes)."""
    met = _STRUCT_FORMS.get(cls)
    if met is not None and met[0] is cls:  # (by identity: `_plain`)
        return met[1]
    struct = typing.cast(typing.Any, cls)
    config = struct.__struct_config__
    names: tuple[str, ...] = struct.__struct_encode_fields__
    given = struct.__struct_defaults__
    defaults = (msgspec.NODEFAULT,) * (len(names) - len(given)) + tuple(given)
    factories = [getattr(default, "factory", None) if type(default) is _FACTORY else None for default in defaults]
    form = _StructForm(names, defaults, tuple(f if f in _EMPTY_DEFAULTS else None for f in factories),
                       config.omit_defaults,
                       None if config.tag is None else (config.tag_field, config.tag), config.array_like)
    if len(_STRUCT_FORMS) < 1024:
        _STRUCT_FORMS[cls] = (cls, form)
    return form


_FACTORY = type(next(d for d in msgspec.defstruct("_Probe", [("x", list, msgspec.field(default_factory=list))])
                     .__struct_defaults__))  # (msgspec's Factory type, which it does not export)


def _empty(value: object, factory: type | None) -> bool:
    """Whether `value` is an empty value of `factory`'s exact type (list, dict or set), as
    msgspec's omit_defaults counts it the default."""
    return type(value) is factory and not len(typing.cast(typing.Sized, value))


def _struct_plain(value: msgspec.Struct, depth: int, seen: dict[int, tuple[object, object]]) -> object:
    """A `msgspec.Struct` made plain as msgspec writes it: an object of its fields by
    encode name, tag first, `UNSET` fields (and, with omit_defaults, fields holding their
    default: the default itself, or an empty list, dict or set where that type is the
    factory) left out; or an array, with array_like. Its field values are read at
    once (`msgspec.structs.astuple`) and made plain by `_plain`: msgspec walking the
    Struct itself ran Python code of what it held (a dataclass field read, a `tolist()`)
    in mid-walk, and one that emptied a list it sat in crashed the worker (SIGSEGV).
    Raises `TypeError` for an `UNSET` field of an array_like Struct (msgspec refuses it
    too), and as `_plain` does."""
    form = _struct_form(type(value))
    values = msgspec.structs.astuple(value)
    unset = msgspec.UNSET
    if form.array_like:
        if any(item is unset for item in values):
            raise TypeError(f"{type(value).__name__} is array_like and has an UNSET field")
        items = [_plain(item, depth, seen) for item in values]
        return items if form.tag is None else [form.tag[1], *items]
    plain: dict[str, object] = {} if form.tag is None else {form.tag[0]: form.tag[1]}
    omit = form.omit_defaults
    for name, default, empty, item in zip(form.names, form.defaults, form.empties, values):
        if item is unset or (omit and (item is default or _empty(item, empty))):
            continue
        plain[name] = _plain(item, depth, seen)
    return plain


def _native(value: object) -> object:
    """A numpy array as orjson takes it natively: C-contiguous, in native byte order, 0-d
    ones as their scalar (orjson refuses the others, and their `tolist()` wrote float32
    0.1 as 0.10000000149011612, datetime64[ns] as integers: a value's form depended on
    its array's layout; hostile testing, round 26). Only numpy's own array type, and not
    of Python objects (round 27: a 0-d one holding a list was given to orjson, whose walk
    ran a tzinfo that emptied it: SIGSEGV; a masked array lost its mask). Anything else
    as it is."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return value
    kind = type(value)
    if issubclass(kind, numpy.datetime64):
        return _datetimes(numpy, value)
    if kind is not numpy.ndarray:
        if issubclass(kind, numpy.ndarray) and typing.cast(typing.Any, value).dtype.kind == "M":
            return _masked_datetimes(numpy, value)
        return value
    array = typing.cast(typing.Any, value)
    if array.dtype.hasobject:
        return value
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if array.dtype.kind == "M":
        return _datetimes(numpy, array)
    if array.ndim == 0:
        return array[()]
    return numpy.ascontiguousarray(array)


def _masked_datetimes(numpy: typing.Any, value: typing.Any) -> object:
    """An ndarray subclass's (a masked array's) datetime64 values as `_datetimes` gives
    them, its masked ones as None (as its `tolist()` gives them): its `tolist()` gave
    numbers where numpy's own array gave text (hostile testing, round 30)."""
    array = numpy.asarray(value)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    masked = numpy.ma.getmaskarray(value)
    return numpy.where(masked | numpy.isnat(array), None, numpy.datetime_as_string(array)).tolist()


def _datetimes(numpy: typing.Any, value: typing.Any) -> object:
    """numpy datetime64 values (an array in native byte order, or a scalar) as ISO 8601
    text in their own unit, by numpy, NaT as None: orjson aborted the process on a unit
    with a multiplier (`datetime64[15m]`: SIGILL), wrote values past its range as
    1970-01-01, and refused ps, fs and as (hostile testing, round 28)."""
    return numpy.where(numpy.isnat(value), None, numpy.datetime_as_string(value)).tolist()


_DATACLASS_FIELDS: dict[type, tuple[type, tuple[str, ...]]] = {}  # per dataclass, it and the fields orjson writes


def _fields(value: object) -> tuple[str, ...] | None:
    """The names of the fields written of `value`, a dataclass or attrs instance (those
    named with a leading underscore left out, as orjson and msgspec do), or None if it is
    neither (cached per class, at most 1024 classes)."""
    cls = type(value)
    if dataclasses.is_dataclass(cls) and not issubclass(cls, type):
        names = tuple(f.name for f in dataclasses.fields(typing.cast(typing.Any, cls)) if not f.name.startswith("_"))
    else:
        attr = sys.modules.get("attr")
        if attr is None or not attr.has(cls):
            return None
        names = tuple(a.name for a in attr.fields(cls) if not a.name.startswith("_"))
    if len(_DATACLASS_FIELDS) < 1024:
        _DATACLASS_FIELDS[cls] = (cls, names)
    return names


_MSGSPEC_KEYS = _BY_MSGSPEC  # (round 30: as msgspec writes them in a Struct; round 33: UUID subclasses, memoryview)


def _key(key: object) -> str:
    """A dict key as orjson writes it with OPT_NON_STR_KEYS (None as "null", a datetime as
    RFC 3339); keys that are then equal are one (the last value wins: RFC 8259 section 4,
    names SHOULD be unique). Raises `TypeError` for a key orjson refuses."""
    if type(key) is str:
        return key
    kind = type(key)
    if kind is int:  # (the usual one, at a tenth of the cost: 1 us each by orjson)
        return str(key)
    if isinstance(kind, enum.EnumType) and not issubclass(kind, (str, int)):  # (as orjson: its value's
        return _key(typing.cast(enum.Enum, key).value)  # form; a datetime one made exact)
    if issubclass(kind, int) and kind is not bool:  # (subclasses as their integer, past 64 bits too:
        return str(int.__int__(typing.cast(int, key)))  # orjson refused those, and float ones, round 31)
    if issubclass(kind, float):
        key = float.__float__(typing.cast(float, key))
    elif issubclass(kind, _DATETIMES):  # (round 30: a tzinfo's methods run by orjson: SIGSEGV)
        key = _exact_datetime(typing.cast(datetime.date, key))
    elif issubclass(kind, _MSGSPEC_KEYS):  # (as msgspec writes them: orjson refuses them; subclasses too)
        return str(msgspec.json.decode(msgspec.json.encode(_msgspec_exact(key, kind))))
    try:
        encoded = orjson.dumps({key: None}, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # (numpy's scalars: written as orjson writes them as values)
        numpy = sys.modules.get("numpy")
        if numpy is None or not issubclass(kind, numpy.generic) or issubclass(kind, numpy.object_):
            raise  # (round 27: a hashable list subclass, walked here by orjson: SIGSEGV)
        written = _encoded_plain(key)  # (as the value is written: round 32, longlong, bytes_ and
        return str(orjson.loads(written)) if written[:1] == b'"' else written.decode()  # timedelta64 were refused)
    return str(next(iter(orjson.loads(encoded))))


def _framed(encoded: bytes) -> bytes:
    """`encoded` (orjson's), checked if it holds a raw newline, which only an
    `orjson.Fragment` in the result puts there (orjson copies it verbatim): it would split
    an NDJSON line, and a line after it could answer another call (hostile testing, round
    25: a forged answer to id 2). Raises `InvalidJson` (a TypeError) if it is not JSON."""
    if encoded.find(b"\n") + encoded.find(b"\r") == -2:  # (neither; round 31: a CR, at which
        return encoded  # Python's text lines split too)
    return _checked_json(encoded)


def encode_result(result: object) -> bytes:
    """Compact JSON bytes of a handler's result (never a raw newline: they are framed
    as NDJSON lines too). Raises `TypeError` if it has no JSON form, `InvalidJson` (a
    `TypeError`) if a `msgspec.Raw` in it is not valid JSON.

    orjson writes every result. First as it is, with no `default` hook and numpy,
    datetimes and dataclasses refused: it runs no Python code while it walks the result
    (but an Enum member's `value`: README, "Results"), unless an Enum class orjson cannot
    be trusted with exists (`_check_enum`). What it refuses is made plain (`_plain`) and
    written by orjson again.

    A result is written in full before its size is checked: one that repeats a part
    (a list of one 1 MiB string 300 times) costs the worker its full written size for
    a moment, whatever `max_frame_bytes` says (README, "Limits")."""
    if _ORJSON_FIRST:  # (`_encoded_data`'s first try, inline: one call less per result on the hot path)
        try:
            encoded = orjson.dumps(result, option=_FIRST_OPTIONS)
        except TypeError:
            pass
        else:
            # (no LF or CR: both finds -1; `in` with b"\r" cost 140 ns a result here, `find` 20)
            return encoded if encoded.find(b"\n") + encoded.find(b"\r") == -2 else _checked_json(encoded)
    try:
        return _encoded_plain(result)
    except InvalidJson:
        raise
    except Exception as exc:  # TypeError, _TooDeep, a tolist()'s own error, a dict changed meanwhile
        raise NoJsonForm(f"result of type {type(result).__name__} is not JSON-serializable: {exc}") from None


def _encoded_plain(value: object) -> bytes:
    """`value` made plain and written by orjson. Raises as `_plain` does, and
    `_Unwritable` if orjson still refuses it (a string with a lone surrogate, which has
    no UTF-8 form; parts shared past orjson's depth)."""
    plain = _plain(value)
    try:
        encoded = orjson.dumps(plain, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError as exc:
        raise _Unwritable(str(exc)) from None
    return _framed(encoded)


class _Unwritable(ValueError):
    """A value made plain that orjson refuses all the same (`_encoded_plain`)."""


def _checked_json(encoded: bytes) -> bytes:
    """`encoded` checked as one JSON value (RFC 8259) in UTF-8 (section 8.1) and made
    compact: msgspec copies a `msgspec.Raw` verbatim, so it could hold anything (`}{`,
    a second Response object, a pretty-printed document whose newlines would split an
    NDJSON line). Whitespace outside strings goes (JSON strings cannot hold a raw
    newline); numbers and strings are kept byte for byte. Raises `InvalidJson` (a
    `TypeError`) if it is not valid JSON."""
    try:
        compact = _format_json(encoded, indent=-1)
    except Exception as exc:  # DecodeError; RecursionError past the parser's depth
        raise InvalidJson(f"not valid JSON (a msgspec.Raw inside?): {exc}") from None
    if not compact.isascii():
        try:
            compact.decode()
        except UnicodeDecodeError as exc:
            raise InvalidJson(f"not valid UTF-8 (a msgspec.Raw inside?): {exc}") from None
    return compact


class InvalidJson(TypeError):
    """What msgspec encoded (a `msgspec.Raw` copied verbatim) is not one valid JSON value."""


class NoJsonForm(TypeError):
    """A handler's result has no JSON form (`encode_result`): the message says why."""


_format_json = msgspec.json.format


_RESULT = int(wire.Kind.RESULT)
_ERROR = int(wire.Kind.ERROR)
_CALL = int(wire.Kind.CALL)
_NOTIFY = int(wire.Kind.NOTIFY)
_CANCEL = int(wire.Kind.CANCEL)
_CHUNK = int(wire.Kind.CHUNK)
_CHUNK_PART = int(wire.Kind.CHUNK_PART)
_CHUNK_REPLY = int(wire.Kind.CHUNK_REPLY)
_CALL_ENTRY = wire.CALL_ENTRY
_REPLY_ENTRY = wire.REPLY_ENTRY
_BYE = int(wire.Kind.BYE)
_BYE_FRAME = wire.encode_frame(wire.Kind.BYE, 0)  # (SIGTERM: see WorkerProtocol.stop)
_pack_header = wire.HEADER.pack
_deadline_of = wire.DEADLINE.unpack_from  # a call's deadline, at the start of its frame's payload
_DEADLINE_SIZE = wire.DEADLINE.size
_perf = time.perf_counter
_monotonic = time.monotonic  # the clock of the deadlines the broker sends (wire.py)
_CANCELLED = wire.CANCEL_ACK  # the broker tells this acknowledgement from a late result
_NOT_RUN = wire.NOT_RUN  # a reply's aux when the handler never ran (wire.py)
_AWAITED = wire.AWAITED  # a flag in a reply's aux: a sync-declared method's call was awaited (wire.py)
# `_execute`'s kind for an ERROR whose handler never ran (its params did not bind, or no
# such method): the reply's aux says NOT_RUN, and no method's speed is learnt from it.
_UNRUN = -1
# The answer of last resort, when even a -32603 naming the failure cannot be encoded.
_INTERNAL = error_object(ErrorCode.INTERNAL_ERROR, data={"type": "unknown"})
SLICE_SECONDS = 0.002  # run waiting calls this long before letting the loop do I/O
STACK_MARGIN = 256  # frames the worker's recursion limit has past the front-end's (`main`)
HELD_SECONDS = 0.005  # answers ready behind a handler running this long go out from a thread (`_send_held`)
SLOW_SYNC_US = 1000  # a sync call this long (µs) blocks the replies behind it (dispatch.BLOCKING_US)
_SLOW_SYNC_S = SLOW_SYNC_US / 1e6
_AWAITED_WITHIN_S = 0.01  # a sync handler that returns its awaitable within this blocks nothing (wire.AWAITED)


def _text(value: str) -> str:
    """`value` with lone surrogates (a surrogateescape'd file name) written as \\udcxx
    escapes, so it can be encoded as UTF-8 (JSON text is UTF-8: RFC 8259 section 8.1)."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


_COROUTINE = types.CoroutineType


def _close_if_cancelled(coroutine: types.CoroutineType[object, object, object], task: asyncio.Task[object]) -> None:
    """A task's done callback: close `coroutine` if the task was cancelled (before its
    first step it never awaited it; closing one that ran is a no-op)."""
    if task.cancelled():
        coroutine.close()


def _identity(value: object) -> object:
    return value


async def _guarded(
    fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object],
    finished: Callable[[bool, object], None] | None = None, deadline: float = math.inf,
) -> tuple[bool, object]:
    """Run an async handler to its end: (True, result) or (False, the exception raised),
    also given to `finished` in the handler's last step, so that the answer is made in it
    (a done callback comes a loop turn later, which a slow sync call can take first).
    (False, `_PAST_DEADLINE`) if its first step comes past the call's `deadline`
    (CLOCK_MONOTONIC s): the handler never runs, the call was answered -32001 (a sync
    call started after it in the same loop turn held the loop meanwhile, and the CANCEL,
    if it has come, is read only after this step).

    Never raises, not even BaseException: a Task re-raises SystemExit and
    KeyboardInterrupt out of the event loop (asyncio's Task.__step), which would stop
    the worker with every other call in flight. A CancelledError is returned too; the
    caller tells the broker's CANCEL apart from one the handler raised itself.
    """
    if _forked_from:  # (a child the loop went on in: not past its trap, `_trap_loop_return`)
        _child_exits(None)
    if deadline <= _monotonic():
        if fn is _identity:  # what a sync handler returned: never awaited now
            awaitable = args[0]
            if type(awaitable) is _COROUTINE:
                typing.cast("typing.Coroutine[object, object, object]", awaitable).close()
            elif isinstance(awaitable, asyncio.Future):  # (a Task it made runs from then on, on its
                awaitable.cancel()  # own: cancelled, as an async handler's, at its next await)
        return False, _PAST_DEADLINE
    try:
        value = fn(*args, **kwargs)
        if type(value) is _COROUTINE or inspect.isawaitable(value):  # (a wraps-decorated async
            value = await typing.cast(typing.Awaitable[object], value)  # function may not be)
    except GeneratorExit as exc:  # the coroutine is being closed: it must not go on
        if _forked_from:  # (a child raising it: it would reach the loop, which runs other calls)
            _child_exits(exc)
        raise
    except BaseException as exc:  # the point: one answer, the worker lives on
        if _forked_from:  # (a child the handler forked, back here: `_child_exits`)
            _child_exits(exc)
        if finished is not None:
            finished(False, exc)
        return False, exc
    if _forked_from:
        _child_exits(None)
    if finished is not None:
        finished(True, value)
    return True, value


class _PastDeadline(Exception):
    """An async call whose first step came past its deadline: it is answered `CANCEL_ACK`."""


_PAST_DEADLINE = _PastDeadline()


class _Chunk:
    """A CHUNK being run: where its next call starts, and answers not yet sent."""

    __slots__ = (
        "awaited", "chunk_id", "count", "deadline", "next", "payload", "pos", "ran", "t0", "tasks", "unsent",
        "waiting"
    )  # fmt: skip

    def __init__(self, chunk_id: int, count: int, payload: bytes) -> None:
        self.chunk_id = chunk_id
        self.count = count
        self.payload = payload
        self.deadline: float = _deadline_of(payload)[0]  # its calls', CLOCK_MONOTONIC s (wire.py)
        self.pos = _DEADLINE_SIZE  # byte offset of the next call's entry
        self.next = 0  # index of the next call to start
        self.unsent = bytearray()  # REPLY_ENTRY-framed answers for the next part
        self.tasks: list[asyncio.Task[tuple[bool, object]]] = []
        self.waiting = 0  # async calls still running
        self.ran = False  # a handler of it ran (else its CHUNK_REPLY's aux is NOT_RUN)
        # A sync-declared method's call of it returned an awaitable: 1 at once, -1 after
        # blocking (then not AWAITED), 0 none (wire.AWAITED).
        self.awaited = 0
        self.t0 = _perf()


class WorkerProtocol(asyncio.Protocol):
    """The worker's end of its Unix socket to the broker.

    Runs each CALL/NOTIFY frame's handler and answers with exactly one RESULT or
    ERROR frame. Replies produced while handling one read go out in one write; replies
    of async handlers that finish later are coalesced per loop iteration.
    """

    # (Slots: past 30 attributes an instance's dict no longer shares its keys, and every
    # attribute read on the hot path got slower: 2.6 % more instructions per call.)
    __slots__ = (
        "_advancing",
        "_answered",
        "_awaited",
        "_backlog",
        "_cancelled",
        "_chunks",
        "_closing",
        "_concurrency",
        "_debug",
        "_decoder",
        "_dirty",
        "_down",
        "_fd",
        "_flag_classes",
        "_flush_scheduled",
        "_grab",
        "_grab_lock",
        "_hello",
        "_leaving",
        "_loop",
        "_max_depth",
        "_max_result",
        "_methods",
        "_out",
        "_read_first",
        "_run_scheduled",
        "_running",
        "_slot",
        "_slow",
        "_task_of",
        "_tasks",
        "_transport",
        "_winding",
        "_yielded",
        "done",
    )

    def __init__(
        self,
        registry: Registry,
        slot: int,
        concurrency: int,
        max_depth: int = 64,
        max_frame_bytes: int = 16 * 1024 * 1024,
        debug: bool = False,
    ) -> None:
        self._methods = registry.methods()
        # The enum.Flag classes params bind to: the members their calls make are dropped
        # after each such call, once nothing holds them (`_drop_flag_members`).
        self._flag_classes = tuple({cls: None for m in self._methods for cls in m._flags or ()})
        # Per method index: did its last sync call take SLOW_SYNC_US or more? A sync method
        # not run yet counts as slow, as the broker counts it (dispatch.BLOCKING_US): what is
        # ready goes out before its first call, which may block. (One past the table: an
        # index the broker sends for a method this code does not have.)
        self._slow = [not m.is_async for m in self._methods] + [False]
        self._slot = slot
        self._concurrency = concurrency
        self._max_depth = max_depth
        self._debug = debug
        self._decoder = wire.FrameDecoder(max_frame_bytes)
        self._max_result = max_frame_bytes  # largest result or error object sent
        self._out = bytearray()
        self._flush_scheduled = False
        self._tasks: dict[int, asyncio.Task[tuple[bool, object]]] = {}
        # Where each running async call's answer goes: (call id, method, start) or (chunk,
        # its entry, method), for its last step to answer it (`_finished`); and those
        # answered so, which their done callbacks then leave alone.
        self._task_of: dict[asyncio.Task[tuple[bool, object]], tuple[object, int, float | int]] = {}
        self._answered: set[asyncio.Task[tuple[bool, object]]] = set()
        # Tasks the broker cancelled (CANCEL): only their CancelledError is "cancelled
        # by the broker" (-32001); one a handler raises by itself is -32603.
        self._cancelled: set[asyncio.Task[tuple[bool, object]]] = set()
        # Tasks of sync-declared methods' awaitables: -1 returned at once (wire.AWAITED), else
        # the µs the handler blocked before it returned it (its reply's aux: the worker's time).
        self._awaited: dict[asyncio.Task[tuple[bool, object]], int] = {}
        self._backlog: collections.deque[tuple[int, int, int, bytes] | _Chunk] = collections.deque()
        self._chunks: dict[int, _Chunk] = {}  # chunks started and not yet fully answered
        self._dirty: set[_Chunk] = set()  # chunks with answers to send
        self._run_scheduled = False
        self._read_first = False  # `_run` was put off to a later loop turn: it reads first (`_read_now`)
        self._yielded = (0, 0)  # (call id, loop turns) given to async calls before a slow one (`_run`)
        self._closing = False  # the broker said BYE: no call comes after it; close once all are answered
        # Tasks whose cancel was acknowledged at once (`_cancel`), still running (cleaning up):
        # the worker closes after them, as after its calls (hostile testing, round 17: a
        # reload's BYE closed it at once, and its teardown cut their clean-up short).
        self._winding: set[asyncio.Task[tuple[bool, object]]] = set()
        self._leaving = False  # this worker said BYE (SIGTERM) and waits for the broker's
        self._down = False  # see going_down
        self._transport: asyncio.Transport | None = None
        self._fd = -1  # the channel's socket, for `_send_held`
        # While a handler runs (`_execute`): when it started (perf_counter s), else 0.0. The
        # answers made before it in the same slice are sent by `_send_held`'s thread once
        # it has run HELD_SECONDS; `_grab` is set while that thread sends (`_sent_held`).
        self._running = 0.0
        self._grab = False
        self._grab_lock = threading.Lock()
        self._advancing: _Chunk | None = None  # the chunk `_advance` runs calls of
        self._hello = b""  # see hello
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()

    def hello(self) -> bytes:
        """The HELLO payload: this process, its slot and its method table (built once)."""
        if self._hello:
            return self._hello
        hello = wire.Hello(
            pid=os.getpid(),
            slot=self._slot,
            methods=[
                wire.MethodInfo(m.name, m.params_schema(), _text(m.doc)) for m in self._methods
            ],
            concurrency=self._concurrency,
            sync_methods=[m.name for m in self._methods if not m.is_async],
            wire=wire.VERSION,
        )
        self._hello = msgspec.json.encode(hello)
        return self._hello

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._fd = sock.fileno()
            threading.Thread(target=self._send_held, name="held-answers", daemon=True).start()
        self._transport.write(wire.encode_frame(wire.Kind.HELLO, 0, 0, self.hello()))
        if self._leaving:  # SIGTERM came while connecting
            self._transport.write(_BYE_FRAME)

    def going_down(self) -> None:
        """The worker is exiting (its loop was stopped, or the connection is gone): the
        calls still running are cancelled and get no answer from here. The broker
        answers them -32002 with this process's pid and exit status once it is gone; a
        -32603 CancelledError would say the handler raised it itself."""
        self._down = True

    def connection_lost(self, exc: Exception | None) -> None:
        if _forked_from:  # (a forked child's loop read EOF on /dev/null: `isolate_forks`)
            _child_exits(None)
        self._down = True
        for task in self._tasks.values():
            task.cancel()
        for chunk in self._chunks.values():
            for task in chunk.tasks:
                task.cancel()
        if not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        if _forked_from:  # (the loop calls back into a forked child: `_child_exits`)
            _child_exits(None)
        if self._take(data) and not self._run_scheduled:
            self._run()

    def _take(self, data: bytes) -> bool:
        """Decode `data` from the broker and act on its frames (calls join the backlog,
        CANCELs cancel); False on a bad frame (the connection is closed)."""
        try:
            frames = self._decoder.feed(data)
        except wire.FrameError as exc:
            log.error("worker %d: bad frame from broker: %s", self._slot, exc)
            assert self._transport is not None
            self._transport.close()
            return False
        backlog = self._backlog
        for kind, call_id, aux, payload in frames:
            if kind == _CALL or kind == _NOTIFY or kind == _CHUNK:
                if len(payload) < _DEADLINE_SIZE:
                    log.error("worker %d: bad frame from broker: a call with no deadline", self._slot)
                    assert self._transport is not None
                    self._transport.close()
                    return False
                backlog.append((kind, call_id, aux, payload))
            elif kind == _CANCEL:
                self._cancel(call_id)
            elif kind == _BYE:
                self._closing = True
        return True

    def _read_now(self) -> bool:
        """Read and act on what the broker sent while the loop was held (a slow sync call),
        before the next waiting call runs. A callback scheduled with call_soon runs before
        the loop's next read of the channel, on uvloop as on asyncio (hostile testing,
        round 16: calls of a batch waiting behind a 1 s sync call were answered -32001 at
        their deadline and CANCELs sent for them, and ran all the same). The channel is
        non-blocking, and the loop hands each read to `data_received` as it comes, so
        reading it here keeps the frames in order. False if the connection is bad."""
        transport = self._transport
        sock = None if transport is None else transport.get_extra_info("socket")
        if sock is None:
            return True
        while True:
            try:
                data = os.read(sock.fileno(), 1 << 18)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:  # (the loop's own read finds it too)
                return True
            if not data:  # (end of file: the loop's own read finds it too)
                return True
            if not self._take(data):
                return False

    def _cancel(self, call_id: int) -> None:
        """CANCEL: an async call is cancelled and acknowledged (`CANCEL_ACK`) at once, a
        call not started yet dropped and acknowledged. At once, not when its task ends:
        a handler that catches the cancel and cleans up (awaiting, the loop free) got its
        worker killed as hung after cancel_grace, and the calls beside it answered -32002
        (hostile testing, round 16); the broker kills only a worker that does not answer
        (a sync handler stuck, a loop held). Its task runs on to its end; what it returns
        then is dropped."""
        task = self._tasks.get(call_id)
        if task is not None:
            if not task.done():
                task.cancel()
                where = self._task_of.pop(task, None)
                if where is None:  # (not started yet: its done callback answers it)
                    self._cancelled.add(task)
                    return
                self._tasks.pop(call_id, None)
                self._awaited.pop(task, None)
                self._answered.add(task)  # (its done callback: nothing to do)
                self._winding.add(task)
                self._reply(_ERROR, call_id, typing.cast("tuple[int, int, float]", where)[2], _CANCELLED)
                self._schedule_flush()
            return
        chunk = self._chunks.get(call_id)
        if chunk is not None:
            for task in chunk.tasks:
                if not task.done():
                    task.cancel()
                    where = self._task_of.pop(task, None)
                    if where is None:
                        self._cancelled.add(task)
                        continue
                    self._answered.add(task)
                    self._winding.add(task)
                    self._chunk_answer(chunk, typing.cast("tuple[_Chunk, int, int]", where)[1], _ERROR, _CANCELLED)
                    chunk.waiting -= 1
            self._drop_unstarted(chunk)
            try:
                self._backlog.remove(chunk)
            except ValueError:
                pass
            self._dirty.add(chunk)
            return
        for i, queued in enumerate(self._backlog):  # rare: a call still waiting here
            if type(queued) is tuple and queued[1] == call_id:
                del self._backlog[i]
                self._reply(_ERROR, call_id, _perf(), _CANCELLED)  # a whole chunk, too
                return

    def _drop_unstarted(self, chunk: _Chunk) -> None:
        """Answer the calls of `chunk` not started yet as cancelled (`CANCEL_ACK`; a
        notification is owed no answer): cancelled, or their deadline passed."""
        while chunk.next < chunk.count:
            _index, flags, length = _CALL_ENTRY.unpack_from(chunk.payload, chunk.pos)
            chunk.pos += _CALL_ENTRY.size + length
            if not flags & wire.NOTIFY_FLAG:
                self._chunk_answer(chunk, chunk.next, _ERROR, _CANCELLED)
            chunk.next += 1

    def _run(self) -> None:
        """Run waiting calls for up to `SLICE_SECONDS`, then write their replies. If
        calls remain, go on in the next loop iteration, after reading what arrived
        (CANCEL frames: `_read_now`) and writing the replies: a slow sync handler neither
        holds back the replies of the calls before it nor hides a CANCEL."""
        if _forked_from:  # (not the calls still waiting a second time, in a forked child)
            _child_exits(None)
        self._run_scheduled = False
        if self._read_first:
            self._read_first = False
            if not self._read_now():
                return
        backlog = self._backlog
        deadline = _perf() + SLICE_SECONDS
        while backlog:
            item = backlog[0]
            if type(item) is _Chunk:
                finished = self._advance(item, deadline)
                self._advancing = None
                if finished:
                    backlog.popleft()
            else:
                kind, call_id, aux, payload = typing.cast("tuple[int, int, int, bytes]", item)
                call_deadline = _deadline_of(payload)[0]
                if call_deadline <= _monotonic():  # answered -32001 by the broker (wire.py)
                    backlog.popleft()
                    self._reply(_ERROR, call_id, 0.0, _CANCELLED, _NOT_RUN)  # (a whole chunk, too)
                    continue
                if (
                    kind != _CHUNK and self._slow[min(aux, len(self._methods))]
                    and (self._tasks or any(chunk.waiting for chunk in self._chunks.values()))
                    and self._yield(call_id)
                ):  # fmt: skip
                    break
                backlog.popleft()
                if kind == _CHUNK:
                    chunk = self._chunks[call_id] = _Chunk(call_id, aux, payload)
                    backlog.appendleft(chunk)
                    continue
                self._call(call_id, aux, payload[_DEADLINE_SIZE:], call_deadline)
            if backlog and _perf() > deadline:
                self._run_scheduled = self._read_first = True
                self._loop.call_soon(self._run)
                break
        self._flush()

    def _yield(self, call_id: int) -> bool:
        """Before call `call_id`, of a method that blocks the loop, with async calls in
        flight: whether the loop runs a turn first (`_run` goes on in the next one), so
        that they go on before it. An async call whose wait ended, or that started and
        has not run a step yet, needs a turn for its step, and one that finished a turn
        more for its answer (a task's done callback comes a turn later); `_call` then
        writes the answers ready before the slow call runs. At most two turns a call: a
        steady flow of async calls cannot hold it back. (Hostile testing, round 13: an
        async call's answer waited behind a slow sync call sent after it, long enough to
        be answered -32001 "timed out" although its handler was done; the README says
        each answer leaves as soon as its own handler returns.)"""
        last, turns = self._yielded
        turns = turns + 1 if last == call_id else 1
        if turns > 2:
            return False
        self._yielded = (call_id, turns)
        # (and reads first: a task step may hold the loop meanwhile, round 17, and a CANCEL
        # for the slow call or those behind it come then)
        self._run_scheduled = self._read_first = True
        self._loop.call_soon(self._run)
        return True

    def stop(self) -> None:
        """Leave as the broker's stop makes a worker leave, losing no call (SIGTERM).

        Closing at the first idle moment dropped the calls the broker had written and
        this worker had not read yet (answered -32002 "worker died"), and the broker
        went on sending more. So the worker says BYE instead and serves on: the broker
        takes it out of its rotation and answers BYE, which comes after every call it
        sent; the worker answers all of those, then closes (`_closing`, as on a BYE the
        broker sends first); the broker has started another worker in its place meanwhile."""
        if _forked_from:
            _child_exits(None)
        if self._closing or self._leaving:  # told BYE already, or asked already
            return
        self._leaving = True
        if self._transport is not None and not self._transport.is_closing():
            self._write_out()  # (the answers ready so far go first)
            self._transport.write(_BYE_FRAME)

    def _execute(
        self, index: int, params: bytes, deadline: float
    ) -> tuple[int, bytes] | asyncio.Task[tuple[bool, object]]:
        """Run one call: (kind, body) for a sync handler or a failure, or the Task
        running an async handler (its outcome comes from `_outcome`). Never raises.

        No handler starts past `deadline` (CLOCK_MONOTONIC s, the call's: wire.py): a sync
        one is checked once its params are bound (binding megabytes of them takes a large
        part of a second: hostile testing, round 20), an async one at its task's first
        step (`_guarded`), a sync one's coroutine too; (_UNRUN, CANCEL_ACK) then."""
        if _forked_from:  # (a child forked anywhere, a finalizer included, runs no call)
            _child_exits(None)
        try:
            method = self._methods[index]
            if method._flags is not None:  # (once this call's members are no longer held)
                self._loop.call_soon(_drop_flag_members, self._flag_classes)
            args, kwargs = method.bind(params, self._max_depth)
        except BaseException as exc:  # the handler never ran: -32602, -32601, -32600
            return _UNRUN, self._error(exc, index)
        if _forked_from:  # (forked while the params were decoded: a __post_init__; round 10)
            _child_exits(None)
        if deadline <= _monotonic():  # (the broker answered it -32001 meanwhile)
            return _UNRUN, _CANCELLED
        try:
            if method.is_async:
                task = self._loop.create_task(_guarded(method.fn, args, kwargs, self._finished, deadline))
                if _forked_from:  # (3.12+, eager start: a child that awaited comes back here)
                    _child_exits(None)
                if method._flags is not None:
                    task.add_done_callback(self._flag_call_done)
                return task
            result = method.fn(*args, **kwargs)
            if _forked_from:  # a child the handler forked returned: `_child_exits`
                _child_exits(None)
            try:
                return _RESULT, encode_result(result)
            except TypeError:  # (no JSON form: checked only now, off the fast path)
                if not inspect.isawaitable(result):
                    raise
            # A sync handler that returned a coroutine (a decorator `_is_async` could
            # not see through): run it as an async one's.
            task = self._loop.create_task(_guarded(_identity, (result,), {}, self._finished, deadline))
            if method._flags is not None:  # (round 42: its Flag members stayed after it ended)
                task.add_done_callback(self._flag_call_done)
            if type(result) is _COROUTINE:  # (cancelled before its first step, it is never awaited:
                # closed then, without "coroutine ... was never awaited"; round 27)
                task.add_done_callback(functools.partial(_close_if_cancelled, result))
            return task
        except BaseException as exc:  # one ERROR reply, the worker lives on
            if _forked_from:  # (a child that raised, sys.exit() included)
                _child_exits(exc)
            return _ERROR, self._error(exc, index)

    def _flag_call_done(self, task: asyncio.Task[tuple[bool, object]]) -> None:
        """An async call binding enum.Flag members ended: drop them, once nothing holds them
        (past the bound counted from none kept: the drop made as the call began counted its
        members as kept, and the members of a call ended stayed for good, round 41)."""
        self._loop.call_soon(_drop_flag_members, self._flag_classes, True)

    def _outcome(
        self, task: asyncio.Task[tuple[bool, object]], index: int, outcome: tuple[bool, object] | None = None
    ) -> tuple[int, bytes]:
        """The answer of a finished async call, as `_execute` gives a sync one: `outcome`,
        or its task's result. Never raises: an exception here would be lost in a done
        callback, and the call would never be answered."""
        by_broker = task in self._cancelled
        if by_broker:
            self._cancelled.discard(task)
        try:
            value: object
            try:
                ok, value = task.result() if outcome is None else outcome
            except BaseException as exc:  # cancelled before it ever ran, or a GeneratorExit
                ok, value = False, exc  # raised by the handler (_guarded lets that through)
            if ok:
                return _RESULT, encode_result(value)
            if (by_broker and isinstance(value, asyncio.CancelledError)) or value is _PAST_DEADLINE:
                return _ERROR, _CANCELLED
            return _ERROR, self._error(typing.cast(BaseException, value), index)
        except BaseException as exc:  # the result has no JSON form (or a hook raised)
            return _ERROR, self._error(exc, index)

    def _call(self, call_id: int, index: int, params: bytes, deadline: float) -> None:
        index = min(index, len(self._methods))  # (past the table: answered -32601)
        if self._slow[index] and (self._out or self._dirty):
            # This method's last call blocked the loop: what is ready goes out now, not
            # after it (fast calls read with it would wait for the slow one otherwise).
            self._write_out()
        t0 = self._running = _perf()
        try:
            done = self._execute(index, params, deadline)
        finally:
            self._running = 0.0
        if _forked_from:  # (forked while the result or error was encoded: a hook, a repr)
            _child_exits(None)
        if self._grab:  # (`_send_held`'s thread is writing what was ready: it goes first)
            self._sent_held()
        if type(done) is tuple:
            kind = done[0]
            if kind == _UNRUN:  # it says nothing of how long the method takes
                self._reply(_ERROR, call_id, t0, done[1], _NOT_RUN)
                return
            self._slow[index] = self._reply(kind, call_id, t0, done[1]) >= SLOW_SYNC_US
            return
        task = typing.cast("asyncio.Task[tuple[bool, object]]", done)
        if self._methods[index].is_async:
            self._slow[index] = False  # an async handler blocks nothing
        else:  # a sync one's awaitable: its wait blocks nothing, what came before it did (round 24)
            blocked = _perf() - t0
            self._slow[index] = blocked >= _SLOW_SYNC_S
            # (within 10 ms, returned at once, allowing for a loaded machine's delays: wire.AWAITED)
            self._awaited[task] = -1 if blocked < _AWAITED_WITHIN_S else min(int(blocked * 1e6), _AWAITED - 1)
        self._tasks[call_id] = task
        if not task.done():  # (else finished at once, eagerly: answered by its done callback)
            self._task_of[task] = (call_id, index, t0)
        task.add_done_callback(lambda t: self._task_done(call_id, index, t0, t))

    def _finished(self, ok: bool, value: object) -> None:
        """The last step of an async call's task (`_guarded`): make its answer now. Not a
        cancellation's, which the done callback answers as before, once it knows whether
        the worker is going down (the loop's teardown cancels every task: their calls are
        the broker's to answer, -32002, not -32603 CancelledError)."""
        if not ok and isinstance(value, asyncio.CancelledError):
            return
        task = asyncio.current_task(self._loop)
        where = self._task_of.pop(task, None) if task is not None else None
        if where is None:  # (its done callback answers it: started eagerly, and not yet known)
            return
        self._answered.add(task)  # type: ignore[arg-type]  # (its done callback: nothing to do)
        if type(where[0]) is _Chunk:
            chunk, i, index = typing.cast("tuple[_Chunk, int, int]", where)
            self._chunk_task_answer(chunk, i, index, task, (ok, value))  # type: ignore[arg-type]
        else:
            call_id, index, t0 = typing.cast("tuple[int, int, float]", where)
            self._task_answer(call_id, index, t0, task, (ok, value))  # type: ignore[arg-type]

    def _task_done(self, call_id: int, index: int, t0: float, task: asyncio.Task[tuple[bool, object]]) -> None:
        if task in self._answered:  # (answered in its last step: `_finished`, or at its cancel)
            self._answered.discard(task)
            self._wound(task)
            return
        self._task_of.pop(task, None)  # (cancelled before it ran, a GeneratorExit: never finished)
        self._task_answer(call_id, index, t0, task, None)

    def _task_answer(
        self, call_id: int, index: int, t0: float, task: asyncio.Task[tuple[bool, object]],
        outcome: tuple[bool, object] | None,
    ) -> None:
        if _forked_from:
            _child_exits(None)
        self._tasks.pop(call_id, None)
        awaited = self._awaited.pop(task, 0)
        if self._down:
            return
        kind, body = self._outcome(task, index, outcome)
        if _forked_from:  # (forked while the result or error was encoded: a `tolist`, a repr)
            _child_exits(None)
        if awaited < 0:  # a sync handler's awaitable: its time is not the worker's (wire.AWAITED)
            self._reply(kind, call_id, t0, body, min(int((_perf() - t0) * 1e6), _AWAITED - 1) | _AWAITED)
        elif awaited:  # ... returned after blocking this long: the worker's time, as a sync call's
            self._reply(kind, call_id, t0, body, awaited)
        else:
            self._reply(kind, call_id, t0, body)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _advance(self, chunk: _Chunk, deadline: float) -> bool:
        """Start a chunk's calls until `deadline` (perf_counter s) or the chunk's own,
        past which the rest are answered as cancelled, unstarted (the broker answered
        them -32001); True once all have started or been so answered. Its answers so far
        go out as a CHUNK_PART, or as the CHUNK_REPLY when none is left running."""
        left = chunk.deadline - _monotonic()
        if left <= 0:
            self._drop_unstarted(chunk)
            self._dirty.add(chunk)
            return True
        unpack = _CALL_ENTRY.unpack_from
        size = _CALL_ENTRY.size
        pack = _REPLY_ENTRY.pack
        payload = chunk.payload
        unsent = chunk.unsent
        limit = self._max_result
        slow = self._slow
        unknown = len(self._methods)  # (answered "method not found")
        t0 = _perf()
        if t0 + left < deadline:  # (then `_run` calls again, and the rest are answered above)
            deadline = t0 + left
        while chunk.next < chunk.count:
            i = chunk.next
            try:
                index, _flags, length = unpack(payload, chunk.pos)
            except struct.error:
                index, length = unknown, 0
            if index > unknown:
                index = unknown
            if slow[index] and (unsent or self._out or self._dirty):
                # As in `_call`: the answers ready so far go out (a CHUNK_PART: call i is
                # not started yet) before a call that may block the loop, so they are not
                # held past their deadline behind it.
                self._dirty.add(chunk)
                self._write_out()
                t0 = _perf()
            start = chunk.pos + size
            chunk.pos = start + length
            chunk.next += 1
            self._advancing = chunk
            self._running = t0
            try:
                done = self._execute(index, payload[start : start + length], chunk.deadline)
            finally:
                self._running = 0.0
            if _forked_from:  # (as in `_call`)
                _child_exits(None)
            if self._grab:
                self._sent_held()
            now = _perf()
            if type(done) is tuple:
                kind, body = done
                if kind == _UNRUN:  # (no handler ran: nothing learnt)
                    kind = _ERROR
                else:
                    slow[index] = now - t0 >= _SLOW_SYNC_S
                    if slow[index]:  # (a call of it blocked: the chunk's time is the worker's, not AWAITED; round 25)
                        chunk.awaited = -1
                    chunk.ran = True
                if len(unsent) + len(body) <= limit:  # fits this part (the common case)
                    unsent += pack(i, kind, len(body))
                    unsent += body
                else:
                    self._chunk_answer(chunk, i, kind, body)
            else:
                task = typing.cast("asyncio.Task[tuple[bool, object]]", done)
                slow[index] = False
                chunk.ran = True
                if not self._methods[index].is_async:  # a sync handler's awaitable (wire.AWAITED):
                    if now - t0 >= _AWAITED_WITHIN_S:  # returned after blocking: the chunk's time is the worker's
                        chunk.awaited = -1
                    elif not chunk.awaited:
                        chunk.awaited = 1
                chunk.tasks.append(task)
                chunk.waiting += 1
                if not task.done():  # (else finished at once, eagerly: answered by its done callback)
                    self._task_of[task] = (chunk, i, index)
                task.add_done_callback(functools.partial(self._chunk_task_done, chunk, i, index))
            t0 = now
            if chunk.next < chunk.count and now > deadline:
                self._dirty.add(chunk)
                return False
        self._dirty.add(chunk)
        return True

    def _chunk_task_done(self, chunk: _Chunk, i: int, index: int, task: asyncio.Task[tuple[bool, object]]) -> None:
        if task in self._answered:  # (answered in its last step: `_finished`, or at its cancel)
            self._answered.discard(task)
            self._wound(task)
            return
        self._task_of.pop(task, None)
        self._chunk_task_answer(chunk, i, index, task, None)

    def _chunk_task_answer(
        self, chunk: _Chunk, i: int, index: int, task: asyncio.Task[tuple[bool, object]],
        outcome: tuple[bool, object] | None,
    ) -> None:
        if _forked_from:
            _child_exits(None)
        if self._down:
            return
        kind, body = self._outcome(task, index, outcome)
        if _forked_from:  # (forked while the result or error was encoded: a `tolist`, a repr)
            _child_exits(None)
        self._chunk_answer(chunk, i, kind, body)
        chunk.waiting -= 1
        self._dirty.add(chunk)
        self._schedule_flush()

    def _chunk_answer(self, chunk: _Chunk, i: int, kind: int, body: bytes) -> None:
        """Add the answer of a chunk's call `i` to its unsent answers. A chunk's answers
        may together pass max_frame_bytes: those before this one go out first as a
        CHUNK_PART, so each frame holds at most max_frame_bytes of answers (plus one
        entry header). Only an answer that alone is larger fails (-32603)."""
        if len(body) > self._max_result:
            kind, body = _ERROR, self._too_large(kind, len(body))
        unsent = chunk.unsent
        if unsent and len(unsent) + len(body) > self._max_result:
            self._reply(_CHUNK_PART, chunk.chunk_id, chunk.t0, bytes(unsent))
            unsent.clear()
        unsent += _REPLY_ENTRY.pack(i, kind, len(body))
        unsent += body

    def _too_large(self, kind: int, size: int) -> bytes:
        """-32603 for an answer of `size` bytes past max_frame_bytes: a result's, or
        (`kind` ERROR) an error object's, as an RpcError with a big `data`."""
        what = "error object" if kind == _ERROR else "result"
        return error_object(
            ErrorCode.INTERNAL_ERROR, data=f"{what} of {size} bytes exceeds max_frame_bytes {self._max_result}"
        )

    def _emit(self, chunk: _Chunk) -> None:
        """Send a chunk's unsent answers: the CHUNK_REPLY once nothing in it is left
        to run, else a CHUNK_PART."""
        if chunk.next == chunk.count and not chunk.waiting:
            self._chunks.pop(chunk.chunk_id, None)
            aux = -1 if chunk.ran else _NOT_RUN
            if chunk.awaited > 0:  # (wire.AWAITED)
                aux = min(int((_perf() - chunk.t0) * 1e6), _AWAITED - 1) | _AWAITED
            self._reply(_CHUNK_REPLY, chunk.chunk_id, chunk.t0, bytes(chunk.unsent), aux)
        elif chunk.unsent:
            self._reply(_CHUNK_PART, chunk.chunk_id, chunk.t0, bytes(chunk.unsent))
        else:
            return
        chunk.unsent.clear()

    def _reply(self, kind: int, call_id: int, t0: float, body: bytes, aux: int = -1) -> int:
        """Queue one reply frame; returns its service time (µs since `t0`), its aux
        unless `aux` gives one (NOT_RUN). Times are capped below NOT_RUN."""
        service_us = min(int((_perf() - t0) * 1e6), _AWAITED - 1) if aux < 0 else aux
        if len(body) > self._max_result and kind < _CHUNK_REPLY:  # the broker would drop the
            kind, body = _ERROR, self._too_large(kind, len(body))  # connection (chunks: _chunk_answer)
        out = self._out
        out += _pack_header(len(body), kind, call_id, service_us)
        out += body
        return service_us

    def _wound(self, task: asyncio.Task[tuple[bool, object]]) -> None:
        """A task whose cancel was acknowledged at once has ended: a worker told BYE may
        close now (`_flush`)."""
        if task in self._winding:
            self._winding.discard(task)
            if self._closing:
                self._schedule_flush()

    def _flush(self) -> None:
        if _forked_from:
            _child_exits(None)
        self._flush_scheduled = False
        self._write_out()
        transport = self._transport
        if self._closing and not (self._tasks or self._backlog or self._chunks or self._winding) and transport is not None:
            transport.close()

    def _send_held(self) -> None:
        """A thread's loop, every HELD_SECONDS: if a handler has run that long (a method
        that is usually fast and blocks once, which the worker did not write out before),
        send the answers made before it in its slice (`_write_held`). Else they waited
        in `_out`, and a batch's in its chunk, until it returned: past their deadline they
        were answered -32001 although they had run (hostile testing, round 26).

        Safe beside the loop's thread: while `_running` is set, that thread is in
        `_execute` (binding params, the handler, encoding its result), which touches
        neither `_out` nor a chunk's answers (an async call finished in its eager first
        step is answered by its done callback, later). This thread sets `_grab`, then
        checks that the same handler still runs; the loop's thread clears `_running`,
        then checks `_grab` and if set waits for the lock (`_sent_held`): under the GIL
        one of them sees the other (Dekker's two flags). A handler that holds the GIL
        in C code lets this thread run only once it returns; a forked child has no such
        thread."""
        lock = self._grab_lock
        while not self._down:
            time.sleep(HELD_SECONDS)
            started = self._running
            if not started or _perf() - started < HELD_SECONDS:
                continue
            if not (self._out or self._dirty or self._advancing is not None):
                continue
            with lock:
                self._grab = True
                try:
                    if self._running == started:
                        self._write_held()
                finally:
                    self._grab = False

    def _write_held(self) -> None:
        """(`_send_held`'s thread, the loop's thread in a handler) Send what `_out` holds,
        the answers of the batches run in this slice first (CHUNK_PARTs), straight to the
        socket, as far as it takes them: only if the transport has nothing buffered, so
        the frames keep their order; the rest is the loop's to write."""
        transport = self._transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size():
            return
        chunks = set(self._dirty)
        if self._advancing is not None:
            chunks.add(self._advancing)
        for chunk in chunks:
            if chunk.unsent:
                self._reply(_CHUNK_PART, chunk.chunk_id, chunk.t0, bytes(chunk.unsent))
                chunk.unsent.clear()
        out = self._out
        if out:
            try:
                sent = os.write(self._fd, out)
            except OSError:  # (BlockingIOError: the broker is not reading now; the loop writes it)
                return
            del out[:sent]

    def _sent_held(self) -> None:
        """(the loop's thread, out of `_execute`) Wait until `_send_held`'s thread is done."""
        with self._grab_lock:
            pass

    def _write_out(self) -> None:
        """Write every reply ready now (chunks' answers included) in one write."""
        if self._dirty:
            for chunk in self._dirty:
                self._emit(chunk)
            self._dirty.clear()
        transport = self._transport
        if self._out and transport is not None and not transport.is_closing():
            transport.write(bytes(self._out))
            self._out.clear()

    def _error(self, exc: BaseException, index: int) -> bytes:
        """The error object answering a call that raised `exc`. Never raises: an
        exception here would escape the read loop and kill the worker with every
        call in flight on it. What cannot be encoded (an RpcError whose message has
        a lone surrogate, or whose data refers to itself) answers -32603."""
        try:
            return self._error_object(exc, index)
        except BaseException as failure:  # (even a __repr__ that raises SystemExit)
            return self._unencodable(exc, index, failure)

    def _name(self, index: int) -> str:
        return self._methods[index].name if 0 <= index < len(self._methods) else "?"

    def _unencodable(self, exc: BaseException, index: int, failure: BaseException) -> bytes:
        try:
            log.error("worker %d: handler %s raised %s, whose error object has no JSON form (%r)",
                      self._slot, self._name(index), type(exc).__name__, failure)
            return error_object(ErrorCode.INTERNAL_ERROR, data={
                "type": _text(type(exc).__name__),
                "reason": f"the error object has no JSON form: {type(failure).__name__}",
            })
        except BaseException:
            return _INTERNAL

    def _error_object(self, exc: BaseException, index: int) -> bytes:
        if isinstance(exc, RpcError):
            try:
                return _rpc_error_object(exc)
            except _Refused as refused:
                log.error("worker %d: handler %s raised an RpcError the worker refuses: %s",
                          self._slot, self._name(index), refused.data["reason"])
                return error_object(ErrorCode.INTERNAL_ERROR, data=refused.data)
        if isinstance(exc, InvalidJson):
            log.error("worker %d: handler %s returned a result that is %s", self._slot, self._name(index), exc)
            return error_object(ErrorCode.INTERNAL_ERROR, data={"type": "TypeError", "reason": f"the result is {exc}"})
        if isinstance(exc, NoJsonForm):  # (round 32: logged as "handler ... raised", which it had not)
            log.error("worker %d: handler %s returned a result with no JSON form (%s)", self._slot, self._name(index), exc)
            detail = {"type": "TypeError", "reason": "the result has no JSON form"}
            if self._debug:
                detail["message"] = _text(str(exc))
            return error_object(ErrorCode.INTERNAL_ERROR, data=detail)
        if isinstance(exc, InvalidParams):
            return error_object(ErrorCode.INVALID_PARAMS, data={"param": exc.param, "reason": exc.reason})
        if isinstance(exc, NestingTooDeep):
            return error_object(
                ErrorCode.INVALID_REQUEST, data=f"params nest deeper than max_depth {exc.args[0]}"
            )
        if isinstance(exc, IndexError) and index >= len(self._methods):
            return error_object(ErrorCode.METHOD_NOT_FOUND)
        log.error("worker %d: handler %s raised", self._slot, self._name(index), exc_info=exc)
        data: dict[str, object] = {"type": type(exc).__name__}
        if self._debug:
            data["message"] = _text(str(exc))
            data["traceback"] = _text("".join(traceback.format_exception(exc)))
        return error_object(ErrorCode.INTERNAL_ERROR, data=data)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The signals the worker handles itself (SIGTERM: its loop's handler; SIGINT: see `main`)
# and what a fresh Python process does with them: a handler's forked child gets these back.
FRESH_DISPOSITIONS = ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler))
_FRESH_SIGNALS = frozenset(signum for signum, _ in FRESH_DISPOSITIONS)
PARENT_POLL_SECONDS = 0.5  # the fallback watcher's period


def die_with_parent(parent: int, *, prctl: bool = True) -> str:
    """Make this process die (SIGKILL) when process `parent` (the broker) does, whatever
    it is doing: a worker busy in a sync handler must not outlive a broker killed with
    SIGKILL. Returns how: "prctl" or "thread".

    On Linux, prctl(PR_SET_PDEATHSIG, SIGKILL) (prctl(2)): the kernel sends the signal
    when the thread that forked us exits; the broker spawns its workers from its main
    thread (the event loop's), which lives as long as the process. Elsewhere (or with
    `prctl=False`), a daemon thread polls getppid() every `PARENT_POLL_SECONDS`: once
    the parent is gone we are reparented and the parent pid changes. Either way, a
    parent that died before this call (the race between fork and prctl) is seen at
    once by comparing getppid() with `parent`.
    """
    how = "thread"
    if prctl and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):  # no libc symbol: fall back to the thread
            pass
    if os.getppid() != parent:
        log.error("the broker (pid %d) is gone: exiting", parent)
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "thread":
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_SECONDS)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return how


_forked_from = 0
"""In a child forked by a handler (by the worker's process: `isolate_forks`), the worker's
pid; 0 in the worker itself. A child's own forks keep it."""


def _child_exits(exc: BaseException | None) -> typing.NoReturn:
    """End a child a handler forked, now that it came back into the worker's code: its
    handler returned (`exc` None) or raised `exc` (sys.exit() raises SystemExit), or the
    loop called the worker back in it.

    It exits with os._exit, as multiprocessing's children do, and as the child of any
    process serving an event loop must: going on, it would run the worker's loop, whose
    epoll instance it shares with the worker (fork copies the descriptor, not the set it
    names; libuv's remedy, uv_loop_fork, uvloop does not call). The loop's teardown at the
    child's exit took the worker's registrations out of it: hostile testing, round 8, a
    child that called sys.exit(0) left its worker deaf to SIGTERM for good (no leave, no
    replacement, nothing logged), and a subprocess's exit could go unseen.

    The status is what the child asked for: sys.exit(code)'s code (1 for a message,
    which is printed, as Python does), 0 for a return, 1 for another exception (logged,
    with its traceback). Only the child's own output is flushed: the worker flushed
    stdout and stderr before the fork (`isolate_forks`); no atexit handler or finalizer
    runs, they are the worker's."""
    code = 0
    if isinstance(exc, SystemExit):
        try:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                # (past a C int, os._exit raised OverflowError and the child went back into
                # the loop, hostile testing round 9: Python's own exit gives 255 then)
                code = int(exc.code) if -(2**31) <= exc.code < 2**31 else 255
            else:
                code = 1
                print(exc.code, file=sys.stderr)
        except BaseException:  # (an int subclass whose comparisons raise, a str that cannot print)
            code = code or 1
    elif exc is not None:
        code = 1
        try:
            log.error("a child forked by a handler (the worker is pid %d) raised %s: it exits with 1",
                      _forked_from, type(exc).__name__, exc_info=exc)
        except BaseException:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:
            pass
    try:
        os._exit(code)
    finally:  # (never returns: os._exit cannot fail with an int in range, but not even then)
        os._exit(1)


def _untraced(frame: types.FrameType, event: str, arg: object) -> None:
    """sys.settrace's function in a trapped child: no frame but the trapped one is traced."""
    return None


def _trap_return(
    codes: typing.Collection[types.CodeType], *, step: types.FrameType | None = None, outermost: bool = False
) -> bool:
    """In a child a handler forked: exit it (`_child_exits`) when the innermost frame of
    the stack that hands control back to code that is not the fork's own returns or
    yields. That is a frame called by one running one of `codes` (what runs the event
    loop's callbacks, a thread pool's work items and callbacks: `_LOOP_CODES`,
    `_pool_runners`), `step`, the frame of the coroutine of the asyncio task that forked
    (`_task_frame`, taken before the fork: a loop run from C, uvloop's in a thread of
    the handler's, calls it from no frame; the child has no running loop), or
    one that interrupted other code (`_interrupting`: a finalizer, a signal handler),
    whichever comes first; else (`outermost`) the thread's first frame, its end. False
    if there is none (nothing is traced then).

    The frame's own tracing (`f_trace`, with sys.settrace on in this thread only, as
    bdb's set_trace does for the frames it stops in) costs the child a call per frame it
    enters while it runs, nothing once it has exited, and the worker nothing."""
    interrupting = _interrupting()
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if frame is step or code in interrupting or code.co_name == "__del__" or (
            frame.f_back is not None and frame.f_back.f_code in codes
        ):
            break
        if outermost and frame.f_back is None:  # (the thread's first frame: its end)
            break
        frame = frame.f_back
    if frame is None:
        return False
    trapped = frame

    def on_event(f: types.FrameType, event: str, arg: object) -> typing.Any:
        if event == "return" and f is trapped:
            _child_exits(None)
        return on_event

    trapped.f_trace = on_event
    trapped.f_trace_lines = False
    sys.settrace(_untraced)
    return True


_STEP_FLAGS = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _task_frame() -> types.FrameType | None:
    """The frame of the coroutine of the asyncio task running in this thread, if any: its
    step ends as that frame yields or returns. A task whose coroutine has no frame of its
    own (an async generator's `aclose()`, closing a generator the loop finalizes): the
    outermost coroutine or async generator frame running (hostile testing, round 17: a
    child forked in such a generator's `finally`, on a thread's own uvloop loop, ran
    another task's step)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # (no loop running in this thread)
        return None
    if task is None:
        return None
    frame = getattr(task.get_coro(), "cr_frame", None)
    if frame is not None:
        return typing.cast(types.FrameType, frame)
    outer = None
    here: types.FrameType | None = sys._getframe(1)
    while here is not None:
        if here.f_code.co_flags & _STEP_FLAGS:
            outer = here
        here = here.f_back
    return outer


def _interrupting() -> set[types.CodeType]:
    """The code of what runs in the middle of other code, a call's perhaps: a finalizer
    (`weakref.finalize`, a `gc.callbacks` entry; `_trap_return` knows `__del__` by name)
    or a signal handler (a function, a method, a partial, an object's `__call__`). A
    child forked in one, going back, would run the rest of whatever it interrupted
    (hostile testing, round 16: the rest of another call, which ran twice). Not known: a
    `weakref.ref` callback, a finalizer not named `__del__`, a generator's `finally` run
    as it is collected (README)."""
    import gc
    import weakref

    handlers: list[object] = [weakref.finalize.__call__, *gc.callbacks]
    for signum in signal.valid_signals():
        try:
            handlers.append(signal.getsignal(signum))
        except (OSError, ValueError):
            pass
    codes = set()
    for handler in handlers:
        for _ in range(4):  # (a partial of a bound method of ...: unwrapped a few levels)
            code = getattr(handler, "__code__", None)
            if isinstance(code, types.CodeType):
                codes.add(code)
                break
            if isinstance(handler, functools.partial):
                handler = handler.func
            elif hasattr(handler, "__func__"):
                handler = handler.__func__
            elif callable(handler) and not isinstance(handler, type):
                handler = type(handler).__call__
            else:
                break
    return codes


def _pool_runners() -> list[types.CodeType]:
    """What the thread pools imported call a work item's function from: concurrent.futures'
    `_WorkItem.run` (run_in_executor, to_thread), multiprocessing.pool's `worker` (apply,
    and a chunk of one item) and its `mapstar`/`starmapstar` (a chunk's items, one after
    another); and their callbacks: a Future's done callbacks, a ThreadPool's result
    callbacks (its result-handling thread); and what a pool's thread runs besides: its
    `initializer` (concurrent.futures' `_worker`, multiprocessing's `worker`), the
    iterable given to `imap` (`Pool._handle_tasks`). A frame one of these calls is a
    work item's function, a callback, an initializer or the iterable's generator."""
    runners = []
    for module, names in (("concurrent.futures.thread", ("_WorkItem.run", "_worker")),
                          ("concurrent.futures._base", ("Future._invoke_callbacks",)),
                          ("multiprocessing.pool", ("worker", "mapstar", "starmapstar", "Pool._handle_tasks",
                                                    "ApplyResult._set", "MapResult._set"))):
        for name in names:
            function: typing.Any = sys.modules.get(module)
            for part in name.split("."):
                function = getattr(function, part, None)
            code = getattr(function, "__code__", None)
            if code is not None:
                runners.append(code)
    return runners


def _in_launch(module: str, owner: str, name: str) -> bool:
    """Whether this fork was made by `module`'s `owner.name` (a frame of it is on the stack)."""
    function = getattr(getattr(sys.modules.get(module), owner, None), name, None)
    code = getattr(function, "__code__", None)
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _in_multiprocessing_launch() -> bool:
    """Whether this fork is multiprocessing's (fork context): its child runs the process
    and calls os._exit, never coming back (`Popen._launch`)."""
    return _in_launch("multiprocessing.popen_fork", "Popen", "_launch")


def _in_subprocess_launch() -> bool:
    """Whether this fork is subprocess's, given a `preexec_fn` (it runs the fork hooks then;
    `Popen._execute_child`): its child runs that function and execs, or exits."""
    return _in_launch("subprocess", "Popen", "_execute_child")


# What calls the loop's callbacks: uvloop's loop (C) is run by asyncio.Runner.run (uvloop.run
# and asyncio.run both use a Runner), asyncio's by Handle._run. A frame called by one of these
# is a callback's (a task's step's): the child would be back in the loop once it returns.
_LOOP_CODES = frozenset({asyncio.runners.Runner.run.__code__, asyncio.events.Handle._run.__code__})


def isolate_forks(channel_fd: int) -> None:
    """Keep the children a handler forks (os.fork(), multiprocessing's fork context) off
    the broker's channel, and make them die with this worker.

    Such a child has a copy of the worker: its loop, its tasks in flight and the channel's
    descriptor. Should it go back into the loop (a handler that returns in both
    processes), it would read the broker's frames and answer calls a second time (the
    broker counted them as late replies), and it would outlive the broker. In the child
    (`os.register_at_fork`), `channel_fd` is replaced by /dev/null, so what it reads is
    end-of-file and what it writes goes nowhere, and the child is marked (`_forked_from`):
    where the worker's code gets control back in it (its handler returns or raises, the
    loop calls the protocol back) it exits at once (`_child_exits`), before the loop it
    shares the epoll instance of with the worker runs again or is torn down. The worker
    flushes stdout and stderr before it forks, so the child's flush at its exit writes
    only its own output. A child forked by the loop's thread also gets `die_with_parent`
    (prctl's signal is tied to the thread that forked: a child forked by a thread that
    ends early would die with it).

    The child also gets the signal handling of a fresh Python process back
    (`FRESH_DISPOSITIONS`), without the loop's wakeup fd: that is a socketpair shared
    with the worker, so a SIGTERM sent to the child (multiprocessing's terminate()) was
    caught there by the loop's handler and its number written to the WORKER's loop,
    which stopped.

    Only a fork by the worker itself is touched. A child's own forks (double-fork
    daemonisation, nested multiprocessing) run the hook too, with a copy of it: their
    parent is not the worker, so die_with_parent(worker) killed them at birth; the
    child already has /dev/null and fresh signal handling, which its forks inherit, and
    what it set up since (a file on the channel's number, its own handlers) is its own.
    The kernel clears PDEATHSIG in a fork's child: the grandchild is not tied to anyone.
    """
    worker = os.getpid()
    loop_thread = threading.get_ident()
    # Whether the fork under way is the worker's own (not a child's), per thread: two
    # threads may fork at once, and the hooks of one run between the other's (hostile
    # testing, round 13: with a list shared by all threads, a loop-thread child was taken
    # for a pool thread's, and ran the loop; a pool thread's for the loop's, and hung).
    # The child is the forking thread, with its own `local` and its ident.
    local = threading.local()

    def before() -> None:
        by_worker = local.by_worker = os.getpid() == worker
        local.step = _task_frame() if by_worker else None
        # (a loop running in this thread, in the parent: the child has none)
        local.in_loop = by_worker and asyncio.events._get_running_loop() is not None
        if by_worker:
            # Held until the child has its fresh signal handling (`after_in_child`): one
            # that came before was caught there by the worker's handler, and lost (the
            # new test, round 11: a Pool's terminate() SIGTERMs a child still starting,
            # which lived on and its join() hung the worker).
            signal.pthread_sigmask(signal.SIG_BLOCK, _FRESH_SIGNALS)
        if by_worker:  # (multiprocessing's fork does the same: the child's buffers start empty)
            for stream in (sys.stdout, sys.stderr):
                try:
                    if stream is not None:
                        stream.flush()
                except (OSError, ValueError):
                    pass

    def after_in_child() -> None:
        global _forked_from
        if not getattr(local, "by_worker", False):
            return
        local.by_worker = False
        step, local.step = local.step, None
        in_loop, local.in_loop = local.in_loop, False
        _forked_from = worker
        try:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, channel_fd)
            os.close(null)
        except OSError:
            pass
        try:  # (the forking thread is the child's main thread: signal calls may be made)
            signal.set_wakeup_fd(-1)
            for signum, disposition in FRESH_DISPOSITIONS:
                signal.signal(signum, disposition)
        except (OSError, ValueError):
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FRESH_SIGNALS)  # (one held now comes, as fresh)
        if _in_subprocess_launch():
            # The handler's to end, as without preexec_fn (README): prctl's signal would
            # survive the exec, and the worker's end (a reload) killed it (round 16).
            return
        if threading.get_ident() == loop_thread:
            die_with_parent(worker)
            if not _in_multiprocessing_launch():
                _trap_return([*_LOOP_CODES, *_pool_runners()], step=step)
        else:  # (the thread that forked may end before the worker: PDEATHSIG would follow it)
            die_with_parent(worker, prctl=False)
            # It exits as the work item it was forked in returns to its pool (forked in
            # `run_in_executor`, `to_thread`, a multiprocessing ThreadPool: it went on into
            # the pool's loop and waited there for good, rounds 12 and 14; where the pool's
            # own code returned, it ran the rest of a map's chunk again, or set the item's
            # Future and ran its callbacks, round 15), or as the callback or task step of
            # the thread's own asyncio loop returns to it (it went on in that loop: round
            # 15), else at the end of its thread, whatever started it (the parent-watch
            # thread would keep it alive: round 13). (A thread's own loop of another kind,
            # a queue's consumer, it goes on running: its thread's end is all it is known by.)
            if not _in_multiprocessing_launch():
                if in_loop and step is None:
                    # A plain callback of the thread's own loop, which uvloop runs from C
                    # (run_forever, run_until_complete: no frame of Python's calls it): it
                    # exits as the function that forked returns, before it goes back into
                    # that loop (hostile testing, round 18: it ran the loop's timers again).
                    _trap_return((), step=sys._getframe(1), outermost=True)
                else:
                    _trap_return([*_pool_runners(), *_LOOP_CODES], step=step, outermost=True)

    def after_in_parent() -> None:
        local.step, local.in_loop = None, False
        if getattr(local, "by_worker", False):
            local.by_worker = False
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FRESH_SIGNALS)

    os.register_at_fork(before=before, after_in_parent=after_in_parent, after_in_child=after_in_child)


async def _serve(args: argparse.Namespace, registry: Registry) -> int:
    loop = asyncio.get_running_loop()
    if hasattr(asyncio, "eager_task_factory"):  # 3.12+: async handlers that never
        loop.set_task_factory(asyncio.eager_task_factory)  # suspend finish inline
    try:  # orjson imports numpy at the first type it does not know (0.1 s): now, at boot, not
        orjson.dumps(object(), option=_LEAF_OPTIONS)  # in a call, whose time it would be
    except TypeError:  # (a first awaited call took 72 ms, and was learnt blocking: round 25)
        pass
    proto = WorkerProtocol(
        registry, args.slot, args.concurrency, args.max_depth, args.max_frame_bytes, args.debug
    )
    hello = proto.hello()
    if len(hello) > args.max_frame_bytes:  # the broker would refuse the frame
        log.error("app %r: its HELLO (its table of %d methods) is %d bytes, more than max_frame_bytes %d,"
                  " the largest frame the broker accepts: not serving it (raise max_frame_bytes, or"
                  " shorten the methods' docstrings)", args.app, len(registry), len(hello), args.max_frame_bytes)
        return WORKER_BOOT_ERROR
    loop.add_signal_handler(signal.SIGTERM, proto.stop)
    transport, _ = await loop.create_unix_connection(lambda: proto, args.socket)
    isolate_forks(transport.get_extra_info("socket").fileno())
    try:
        await proto.done
    finally:  # done, or the loop is going down (a handler stopped it: the runner cancels
        if _forked_from:  # what is left) (a forked child must not tear the loop down: `_child_exits`)
            _child_exits(None)
        proto.going_down()
    return 0


def _described(exc: BaseException) -> str:
    """"Type: message", or the type alone when the message is empty, or says it cannot be
    printed (round 27: a `__str__` that raised turned the log line into a logging error)."""
    try:
        message = str(exc)
    except BaseException:
        message = "(its message cannot be printed)"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _where(exc: BaseException) -> str:
    """" at FILE:LINE" of the last frame of `exc`'s traceback outside Python's import
    machinery (the app's line that raised), or "" (a new user's check, round 26: an
    import that failed on a KeyError logged only "'MY_TOOL_TOKEN'")."""
    ours = {__file__, importlib.__file__}
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen") and f.filename not in ours]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _deaf(signum: int, frame: types.FrameType | None) -> None:
    """The worker's SIGINT handler: nothing (see `main`)."""


def main(argv: list[str] | None = None) -> int:
    """Worker process entry point: `python -m broker.worker --socket PATH --slot N ...`.

    Started by the broker, not by hand. Exits 0 when the broker closes the
    connection or says BYE (SIGTERM asks it to: `WorkerProtocol.stop`), `WORKER_BOOT_ERROR` when the app cannot be loaded (an
    exception or sys.exit() at import) or cannot be served (more than `wire.MAX_METHODS`
    methods, or a HELLO larger than max_frame_bytes), and dies (SIGKILL) with the broker.
    """
    parser = argparse.ArgumentParser(prog="python -m broker.worker")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--app", required=True)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--max-depth", type=int, default=64)
    parser.add_argument("--max-frame-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="the broker's pid: this process dies with it (default: the parent now)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s worker[{args.slot}] pid %(process)d %(levelname)s %(message)s",
    )
    # The broker decides when we stop: SIGINT (a Ctrl-C to the terminal's process group)
    # is caught and does nothing. Not SIG_IGN, which exec keeps: the subprocesses that
    # handlers start would ignore SIGINT too; exec resets a caught signal to the default.
    signal.signal(signal.SIGINT, _deaf)
    die_with_parent(args.parent_pid or os.getppid())
    # The front-end passes params nested up to its parser's limit (the recursion limit, at
    # its shallow stack); here the loop's, dispatch's and encoding's frames sit below them,
    # and msgspec, which counts Python's recursion limit, failed on params a few levels
    # short of it (hostile testing, round 26: echo of params 983 deep, -32603 "not valid JSON").
    sys.setrecursionlimit(sys.getrecursionlimit() + STACK_MARGIN)
    try:
        registry = load_app(args.app)
    except SystemExit as exc:  # the app called sys.exit() at import: a boot failure too
        log.error("cannot load app %r: it called sys.exit(%r) at import", args.app, exc.code)
        return WORKER_BOOT_ERROR
    except BaseException as exc:
        hint = ""
        module = args.app.partition(":")[0]
        if isinstance(exc, ModuleNotFoundError) and module.endswith(".py"):  # (round 31, a new user)
            hint = f" (--app names a module, not a file: {module[:-3]}:{args.app.partition(':')[2]})"
        elif isinstance(exc, ModuleNotFoundError) and exc.name and module.startswith(exc.name.partition(".")[0]):
            hint = (f" (the module is looked up from the current directory, {os.getcwd()}, and"
                    " PYTHONPATH: run from the directory that holds it, or set PYTHONPATH=DIR)")
        log.error("cannot load app %r: %s%s%s%s", args.app, _described(exc), _where(exc), hint,
                  "" if args.debug else " (--debug prints the traceback)", exc_info=args.debug)
        return WORKER_BOOT_ERROR
    if len(registry) > wire.MAX_METHODS:  # a batch could not name the ones past it
        log.error("app %r has %d methods, more than the %d one worker can serve (a batch names"
                  " a method by a 16-bit index): not serving it", args.app, len(registry), wire.MAX_METHODS)
        return WORKER_BOOT_ERROR
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_serve(args, registry))
    return uvloop.run(_serve(args, registry))


if __name__ == "__main__":
    # Run the real module's main: under `-m` this file is `__main__`, and its own
    # Registry class would not be the one the app's module imported.
    from broker.worker import main as _main

    sys.exit(_main())
