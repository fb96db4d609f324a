"""Signatures: a handler's parameters read once, at registration, into the msgspec types its params are bound to (`Signature`).

`params.Method` inherits it (a base with the slots it fills) and binds each call's params
with what it holds: a Struct of the parameters by position (array_like) and one by name,
the types of *args and **kwargs, the decoders of the fast path (fixed parameters, nothing
to check: msgspec decodes straight into the Struct) and of the typed path (a Decimal or a
msgspec.Raw in a hint: each value decoded from its own text), the checks for hash flooding
(broker/collisions.py), and the enum.Flag classes binding may make members of. A hint no
call could be bound to refuses the registration (`TypeError`, naming the method and the
parameter), rather than every call being answered -32602 or -32603. The JSON Schema of
the params by name (HELLO, MCP's inputSchema: broker/worker/tools.py) is read from it.

Nothing here runs per call, nor does I/O: broker/worker/params.py binds.
"""

from __future__ import annotations

import enum
import functools
import inspect
import re
import sys
import typing
from collections.abc import Callable

import msgspec

from broker import collisions
from broker.floats import read_float, read_json
from broker.worker.integral import wants_int
from broker.worker.param_errors import _DECIMAL_JSON

__all__ = ["BUILT_PER_BYTE", "OBJECT_BYTES", "Signature", "Typed", "built_per_object", "holds_decimal_or_raw",
           "too_many_objects"]

Typed = tuple[msgspec.json.Decoder[typing.Any], "collisions.Check | None", object]
"""A parameter's on the typed path: its decoder, its check for hash flooding (None: none), and
its type if it holds neither a Decimal nor a msgspec.Raw (then it may be read as the general path
reads params, and converted to it), else None."""

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_decode_json = read_json  # (floats read by float(): broker/floats.py)


class Signature:
    """What a handler's signature needs for its params to be bound, read at registration.

    `Signature(name, fn, raw_params)` reads `fn`'s parameters and type hints; raises
    `NameError` for a hint naming what is not defined, `TypeError` for a parameter or a
    hint that no params could be bound to (with why and what to hint instead).
    """

    __slots__ = (
        "_fast",
        "_flags",
        "_guard_decode",
        "_guards",
        "_holds_any",
        "_integers",
        "_into",
        "_kwonly",
        "_named_type",
        "_objects",
        "_pos_names",
        "_pos_only",
        "_pos_only_required",
        "_pos_type",
        "_post_init",
        "_required_kwonly",
        "_typed",
        "_var_kw",
        "_var_pos",
        "raw_params",
        "returns",
    )

    def __init__(self, name: str, fn: Callable[..., object], raw_params: bool = False) -> None:
        self.raw_params = raw_params
        sig = inspect.signature(fn)
        # (a functools.partial, or an object with __call__: the hints of what it calls; typing's
        # own "is not a module, class, method, or function" named neither, hostile testing, round 92)
        hinted: object = fn
        if isinstance(fn, functools.partial):
            hinted = fn.func
        elif not (inspect.isroutine(fn) or isinstance(fn, type)):
            hinted = type(fn).__call__
        try:  # (round 35: without include_extras, Annotated[int, Meta(ge=0)] was stripped, unchecked)
            hints = typing.get_type_hints(hinted, include_extras=True)
        except NameError as exc:  # (round 36: "NameError ... at <string>:1" named no method)
            raise NameError(f"method {name!r}: a type hint names what is not defined when the app is loaded"
                            f" ({exc}): define it before the method is registered") from None
        self.returns: object = hints.get("return", _EMPTY)  # (the result's schema: broker/worker/tools.py)
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
        # What the params' objects may build each, where more than a small object's: checked
        # against their count before any is built (`Method.bind`; hostile testing, round 140, F9)
        self._objects = built_per_object([node for node in held if getattr(node, "cls", None)
                                          not in (self._pos_type, self._named_type)])
        # Whether a Struct or dataclass of theirs runs code of the app's when built and an `Any`
        # could take a float past a double's range, read as the internal `BEYOND`: it is then never
        # converted to place it (hostile testing, round 141, F8: `__post_init__` ran on `BEYOND`)
        self._holds_any = any(isinstance(node, msgspec.inspect.AnyType) for node in held)
        self._post_init = self._holds_any and any(
            isinstance(node, (msgspec.inspect.StructType, msgspec.inspect.DataclassType))
            and hasattr(node.cls, "__post_init__") for node in held)
        self._flags = tuple({node.cls: None for node in held if isinstance(node, msgspec.inspect.EnumType)
                             and issubclass(node.cls, enum.Flag)}) or None
        # A class no JSON value is an instance of (round 49: registered, then every call giving
        # it answered -32602, counted as the client's mistake) refuses the registration, naming
        # the parameter (issue 12, item 10: `check-app` and the start say so; round 50 had kept
        # `p: Plain | None = None` served for calls not giving it); not an abstract one
        # (`numbers.Real`, `Hashable`), which a conversion takes by isinstance.
        if not raw_params:
            for p in sig.parameters.values():
                hint = hints.get(p.name, typing.Any)
                custom = next((node.cls for node in collisions.reachable(msgspec.inspect.type_info(hint))
                               if isinstance(node, msgspec.inspect.CustomType) and _json_is_of(node.cls) is not True),
                              None)
                if custom is not None:
                    raise TypeError(
                        f"method {name!r}: parameter {p.name!r}: its type hint holds {custom.__module__}."
                        f"{custom.__qualname__}, which msgspec cannot decode from JSON (no dec_hook), so every call "
                        "giving it would be refused " + ("-32602" if _json_is_of(custom) is False else
                                                         "-32603 (isinstance takes no Protocol not @runtime_checkable)")
                        + ": hint it dict, list, a msgspec.Struct or a dataclass")
        if any(isinstance(node, msgspec.inspect.UnionType) and any(isinstance(t, msgspec.inspect.RawType)
                                                                   for t in node.types) for node in held):
            # (hostile testing, round 37: `Raw | None` took null alone)
            raise TypeError(f"method {name!r}: a msgspec.Raw in a union (msgspec decodes only the union's other "
                            "types: `Raw | None` would take null alone): hint it msgspec.Raw, and read null "
                            "from its text")
        if any(isinstance(node, (msgspec.inspect.DataclassType, msgspec.inspect.TypedDictType))
               and any(isinstance(inner, msgspec.inspect.RawType) for inner in collisions.reachable(node))
               for node in held):
            # (hostile testing, round 38: every value was refused)
            raise TypeError(f"method {name!r}: a msgspec.Raw in a dataclass or TypedDict, which msgspec cannot "
                            "always decode: hold it in a msgspec.Struct")
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
        # Where the hints want an int, the types by which a refused call's integral floats
        # (5.0) are made integers (broker/worker/integral.py): the positional parameters'
        # and *args' element's, the named ones' (a positional-only one beside **kwargs is
        # **kwargs's) and **kwargs' value's. None: no int to make.
        self._integers: tuple[tuple[list[msgspec.inspect.Type], msgspec.inspect.Type | None],
                              tuple[dict[str, msgspec.inspect.Type], msgspec.inspect.Type | None]] | None = None
        if any(wants_int(node) for node in held):
            info = msgspec.inspect.type_info
            self._integers = (
                ([info(h) for _, h, _ in pos], None if self._var_pos is None else info(typing.get_args(self._var_pos)[0])),
                ({n: info(h) for n, h, _ in pos + kwonly if n not in self._pos_only},
                 None if self._var_kw is None else info(typing.get_args(self._var_kw)[1])),
            )
        self._typed: dict[str, Typed] | None = None
        if decimals or any(isinstance(node, msgspec.inspect.RawType) for node in held):
            # (*args' values are decoded as one list, **kwargs' as one object: round 49, value
            # by value, each checked, rewritten and decoded alone, 1 MiB held a worker 0.7-1.9 s)
            hinted = [(n, h) for n, h, _ in pos + kwonly]
            if self._var_pos is not None:
                hinted.append(("*", self._var_pos))
            if self._var_kw is not None:
                hinted.append(("**", self._var_kw))
            # (a hint that holds neither is read as the general path reads params, floats by
            # float(), then converted: msgspec's typed decoders read floats by its own reader,
            # 1 MiB of `1e308` 1.6 s, hostile testing, round 139, F4; its floats in `Any` by
            # float() too, `float_hook`)
            self._typed = {n: (msgspec.json.Decoder(h, float_hook=read_float), collisions.guard(h),
                               None if holds_decimal_or_raw(h) else h) for n, h in hinted}
            for n, h in hinted:
                if self._typed[n][1] is not None and any(isinstance(node, msgspec.inspect.RawType)
                                                         for node in collisions.reachable(msgspec.inspect.type_info(h))):
                    # (round 44: its value is decoded from what the check read, written again:
                    # the Raw's text lost a float's digits, or was refused, 1e400)
                    raise TypeError(f"method {name!r}: parameter {n!r} holds a msgspec.Raw beside a set or a dict with"
                                    " keys other than strings, whose check for hash flooding would rewrite the Raw's"
                                    " text: give the Raw a parameter of its own")
        # What params are bound into once decoded: on the typed path each value is built and
        # checked by its own decoder already, so the binding only places them (round 48:
        # converted again, a plain Enum's or Flag's member was refused, "Expected `int`, got
        # `Shade`", on every call, and a Flag's _missing_ ran twice a value).
        self._into = (self._pos_type, self._named_type, self._var_pos, self._var_kw)
        if self._typed is not None:
            untyped: list[tuple[str, object, object]] = [(n, typing.Any, d) for n, _, d in pos]
            untyped_kw: list[tuple[str, object, object]] = [(n, typing.Any, d) for n, _, d in kwonly]
            self._into = (
                msgspec.defstruct(f"{name}_positional_built", fields(untyped), array_like=True,
                                  forbid_unknown_fields=True),
                msgspec.defstruct(f"{name}_named_built", fields(untyped + untyped_kw),
                                  kw_only=True, forbid_unknown_fields=self._var_kw is None),
                None if self._var_pos is None else list[typing.Any],
                None if self._var_kw is None else dict[str, typing.Any],
            )
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

    def named_params_types(self) -> tuple[type[msgspec.Struct], object | None]:
        """(the Struct of the params by name, `dict[str, hint]` of **kwargs or None): what the
        JSON Schema of a tool's arguments is made of (broker/worker/tools.py)."""
        return self._named_type, self._var_kw

    def flags_returned(self) -> None:
        """Count the `enum.Flag` classes a tool's result, checked by decoding it as its return type
        (broker/worker/tools.py, `result_check`), makes members of among the method's own: the
        worker drops those nothing holds after its calls, as for its params' (hostile testing,
        round 142, F4: a worker grew 49 to 300 MiB over 6 calls whose results made them)."""
        if self.returns is _EMPTY:
            return
        try:
            returned = _flag_classes(self.returns)
        except (TypeError, ValueError):
            return
        if returned:
            self._flags = tuple({**dict.fromkeys(self._flags or ()), **dict.fromkeys(returned)})

    def positional_only_unnamed(self) -> list[str]:
        """The positional-only parameters that params by name cannot give (beside **kwargs:
        a name goes to **kwargs), in order."""
        return [n for n in self._pos_names if n in self._pos_only]


def _json_is_of(cls: type) -> bool | None:
    """Whether a value decoded from JSON can be an instance of `cls`, which a conversion to a
    class msgspec has no decoder for checks by isinstance: True for `numbers.Real`,
    `Hashable`, a runtime-checkable Protocol; False for `Fraction`, `Counter`, a plain
    class; None if isinstance refuses `cls` (round 51: a Protocol not checkable at runtime
    raised TypeError out of every call's binding)."""
    try:
        return any(isinstance(value, cls) for value in _JSON_VALUES)
    except TypeError:
        return None


_JSON_VALUES: tuple[object, ...] = (0, 0.5, "", True, None, [], {})  # (one of each type msgspec decodes JSON to, untyped)


def _struct_default(value: object) -> object:
    """A parameter's default as a Struct field default. msgspec refuses a non-empty
    list/dict/set/bytearray, and copies an empty one per instance, so give it through a
    factory that returns that same object: the handler sees its default exactly as a
    Python call would (one object, shared by the calls)."""
    if type(value) in (list, dict, set, bytearray):  # (empty too: msgspec copies those per call,
        return msgspec.field(default_factory=lambda: value)  # round 36: a `_cache: dict = {}` memo never filled)
    return value


def _flag_classes(hint: object) -> tuple[type, ...]:
    """The `enum.Flag` classes the type `hint` holds, at any depth."""
    return tuple({node.cls: None for node in collisions.reachable(msgspec.inspect.type_info(hint))
                  if isinstance(node, msgspec.inspect.EnumType) and issubclass(node.cls, enum.Flag)})


def holds_decimal_or_raw(hint: object) -> bool:
    """Whether the type `hint` holds a Decimal or a msgspec.Raw, at any depth: its values must
    be decoded from their own text (a Decimal's digits, a Raw's bytes)."""
    return any(isinstance(node, (msgspec.inspect.DecimalType, msgspec.inspect.RawType))
               for node in collisions.reachable(msgspec.inspect.type_info(hint)))


OBJECT_BYTES = 128
"""What building one object of the params may take without `built_per_object` counting it: a
Struct of a few fields (72 bytes for five, its GC header included), a dict of one or two keys."""
_CONTAINERS = {list: 56, set: 216, frozenset: 216, dict: 64, bytearray: 57}  # (sys.getsizeof of each empty)


def _made_size(factory: Callable[[], object]) -> int:
    """About the bytes a field's `default_factory` makes each time: the object, and the containers
    it holds (one level; `lambda: [0] * 100` is 856 bytes, not 64: new user, round 118), by one call
    of it now, as msgspec calls it for each instance; 64 if it raises."""
    try:
        made = factory()
    except Exception:  # (the app's code: whatever it raises, the instance's own cost is what counts)
        return 64
    size = sys.getsizeof(made)
    items = list(made.values()) if isinstance(made, dict) else list(made) if isinstance(made, (list, tuple, set)) else []
    return size + sum(sys.getsizeof(item) for item in items[:10_000] if isinstance(item, (list, dict, set)))  # (numbers
    # and strings it holds may be shared, as small ints are: not counted)


def built_per_object(nodes: list[msgspec.inspect.Type]) -> tuple[int, bool, bool] | None:
    """The most bytes one instance of the Structs, dataclasses and NamedTuples among `nodes`
    may build from the least JSON (`{}`, or `[]` for an array-like one): the instance and a new
    container for each field whose default is one (msgspec makes an empty list, set or dict
    default anew for each instance; hostile testing, round 140, F9: 1 MiB of `{}` of a Struct of
    20 `set` fields built 1.6 GB). With whether such types decode from JSON objects and from
    arrays; None if none builds more than `OBJECT_BYTES`."""
    most, objects, arrays = 0, False, False
    for node in nodes:
        if not isinstance(node, (msgspec.inspect.StructType, msgspec.inspect.DataclassType,
                                 msgspec.inspect.NamedTupleType)):
            continue
        built = 56 + 8 * len(node.fields) + (104 if isinstance(node, msgspec.inspect.DataclassType) else 0)
        for field in node.fields:
            factory = field.default_factory
            if factory is not msgspec.NODEFAULT:
                built += _CONTAINERS[factory] if factory in _CONTAINERS else _made_size(factory)
        if built <= OBJECT_BYTES:
            continue
        most = max(most, built)
        if isinstance(node, msgspec.inspect.NamedTupleType) or getattr(node, "array_like", False):
            arrays = True
        else:
            objects = True
    return (most, objects, arrays) if most else None


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')  # (a JSON string, escapes included)
BUILT_PER_BYTE = 64
"""The most bytes the objects of a call's params may build a byte of params, counted before any is
built where one object may build more than `OBJECT_BYTES` (`too_many_objects`)."""


def too_many_objects(params: bytes, objects: tuple[int, bool, bool]) -> str | None:
    """Why `params` are refused, if their objects, counted by their brackets (`{`, and `[` for
    array-like Structs and NamedTuples; outside strings, where the first count is too many), could each build
    `objects[0]` bytes (`built_per_object`) past `BUILT_PER_BYTE` a byte of params: 1 MiB of `{}`
    of a Struct whose 20 fields default to an empty set built 1.6 GB in 1.3-2.4 s, and the
    worker's bound on params in flight (max_worker_params_bytes) counts bytes (hostile testing,
    round 140, F9); else None. ~1 ms a MiB."""
    most, braces, brackets = objects
    count = (params.count(b"{") if braces else 0) + (params.count(b"[") if brackets else 0)
    if count * most <= BUILT_PER_BYTE * len(params):
        return None
    outside = _STRING.sub(b'""', params)  # (counted again without the strings' brackets: new user, round 118)
    count = (outside.count(b"{") if braces else 0) + (outside.count(b"[") if brackets else 0)
    if count * most <= BUILT_PER_BYTE * len(params):
        return None
    return (f"{count} objects in {len(params)} bytes of params, each building up to {most} bytes (a Struct's or a"
            f" dataclass's fields and their empty containers): more than {BUILT_PER_BYTE} bytes built a byte of"
            " params, refused (memory)")
