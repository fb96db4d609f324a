"""Hash flooding: a bound on the values of one hash that params may put in a set or dict.

Theory of operation. A hash table costs one comparison per entry of the same hash
that a lookup meets, so n entries of one hash cost n**2 / 2 comparisons to build
(Crosby and Wallach, "Denial of Service via Algorithmic Complexity Attacks", USENIX
Security 2003). Python randomizes the hash of `str` and `bytes` (PEP 456) but not of
numbers, tuples, frozensets, `uuid.UUID` (`hash(u.int)`) or `decimal.Decimal`: the
integers `5 + k * (2**61 - 1)` all hash alike, and so do UUIDs made from them. msgspec
builds a `set[UUID]` parameter, or the keys of a `dict[int, ...]` one, as a Python set
or dict, so 12,000 such UUIDs (480 KB of params) held a worker's loop for 7 s, every
other call on it waiting (hostile testing, round 36).

`guard(kind)` reads a parameter type (msgspec's own reading of it, `msgspec.inspect`)
once, at registration, and returns a check of the params' decoded JSON values (lists,
dicts with str keys, scalars) to run before msgspec converts them, or None where the
type holds no set and no dict with keys other than strings. The check converts each
array bound for a set, and each object's keys bound for non-str keys, to their values,
and puts them in a set of its own, refusing (`Flooded`) the first value that would make
more than `SHARED_HASH_MAX` distinct values of one hash. No lookup then meets more than
that many entries of its hash, so the check and the conversion after it cost time
linear in the params. Values of one hash by chance are rare (`hash(-1) == hash(-2)`,
`hash(1) == hash(2**61)`); more than 8 distinct ones are not chance.

Values are converted twice (here, then by the binding itself), so a `__post_init__` of
a frozen dataclass or Struct held in a set runs twice. Where a type is a union, each
branch that could take the value is checked (over-checking only costs time).
"""

from __future__ import annotations

import datetime
import decimal
import typing
import uuid
from collections.abc import Callable

import msgspec

__all__ = ["SHARED_HASH_MAX", "Flooded", "guard"]

SHARED_HASH_MAX = 8
"""How many distinct values of one hash one set (or one object's keys) may hold."""

Check = Callable[[object], None]

_info = msgspec.inspect
_convert = msgspec.convert


class Flooded(ValueError):
    """More than `SHARED_HASH_MAX` distinct values of one hash in one set or one
    object's keys. `where`: the path to it from the checked value, innermost last
    (keys and indexes), filled in as the check unwinds."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count
        self.where: list[str | int] = []


def guard(kind: object) -> Check | None:
    """The check of decoded JSON values bound for the type `kind` (any type msgspec
    converts to), or None if `kind` holds no set and no dict with non-str keys.
    The check raises `Flooded`; it never raises for values that do not fit `kind`
    (the conversion after it says what is wrong)."""
    return _Compiler().plan(_info.type_info(kind))


class _Compiler:
    """Turns `msgspec.inspect` nodes into checks; recursive Struct, dataclass and
    TypedDict types (a tree of nodes) are compiled once each, through a cell."""

    def __init__(self) -> None:
        self._cells: dict[int, list[Check | None]] = {}
        self._open: set[int] = set()

    def plan(self, node: _info.Type) -> Check | None:
        if isinstance(node, _info.Metadata):
            return self.plan(node.type)
        if isinstance(node, (_info.SetType, _info.FrozenSetType)):
            item = self.plan(node.item_type)
            if item is None and _randomized(node.item_type):
                return None
            return _set_check(_python_type(node.item_type), item)
        if isinstance(node, (_info.DictType, _info.FrozenDictType)):
            return self._dict(node)
        if isinstance(node, (_info.ListType, _info.VarTupleType)):
            item = self.plan(node.item_type)
            return None if item is None else _each_item(item)
        if isinstance(node, _info.TupleType):
            items = [self.plan(t) for t in node.item_types]
            return _by_place(items) if any(items) else None
        if isinstance(node, (_info.StructType, _info.DataclassType, _info.TypedDictType, _info.NamedTupleType)):
            return self._fields(node)
        if isinstance(node, _info.UnionType):
            branches = [check for check in map(self.plan, node.types) if check is not None]
            return None if not branches else branches[0] if len(branches) == 1 else _every(branches)
        return None

    def _dict(self, node: _info.DictType | _info.FrozenDictType) -> Check | None:
        value = self.plan(node.value_type)
        if _randomized(node.key_type):
            return None if value is None else _each_value(value)
        return _keys_check(_python_type(node.key_type), value)

    def _fields(self, node: _info.StructType | _info.DataclassType | _info.TypedDictType
                | _info.NamedTupleType) -> Check | None:
        ident = id(node.cls)
        known = self._cells.get(ident)
        if known is not None:  # (a type holding itself: its check, once compiled)
            return None if ident not in self._open and known[0] is None else _through(known)
        cell: list[Check | None] = [None]
        self._cells[ident] = cell
        self._open.add(ident)
        fields = [(f.encode_name, check) for f in node.fields if (check := self.plan(f.type)) is not None]
        self._open.discard(ident)
        if not fields:
            return None
        if isinstance(node, _info.NamedTupleType) or getattr(node, "array_like", False):  # (from an array)
            checks = dict(fields)
            cell[0] = _by_place([checks.get(f.encode_name) for f in node.fields])
        else:
            cell[0] = _by_name(fields)
        return _through(cell)


def _randomized(node: _info.Type) -> bool:
    """Whether values of the type `node` cannot be made to share a hash at will: strings
    and bytes (PEP 456 randomizes their hash), enum members (hashed by name, and few),
    literals, booleans and None (few)."""
    while isinstance(node, _info.Metadata):
        node = node.type
    return isinstance(node, (_info.StrType, _info.BytesType, _info.EnumType, _info.LiteralType,
                             _info.BoolType, _info.NoneType))


def _through(cell: list[Check | None]) -> Check:
    def check(value: object) -> None:
        inner = cell[0]
        if inner is not None:
            inner(value)
    return check


def _each_item(item: Check) -> Check:
    def check(value: object) -> None:
        if type(value) is list:
            for i, element in enumerate(value):
                _at(item, element, i)
    return check


def _each_value(item: Check) -> Check:
    def check(value: object) -> None:
        if type(value) is dict:
            for key, element in value.items():
                _at(item, element, key)
    return check


def _by_place(items: list[Check | None]) -> Check:
    def check(value: object) -> None:
        if type(value) is list:
            for i, (item, element) in enumerate(zip(items, value)):
                if item is not None:
                    _at(item, element, i)
    return check


def _by_name(fields: list[tuple[str, Check]]) -> Check:
    def check(value: object) -> None:
        if type(value) is dict:
            for name, item in fields:
                if name in value:
                    _at(item, value[name], name)
    return check


def _every(branches: list[Check]) -> Check:
    def check(value: object) -> None:
        for branch in branches:
            branch(value)
    return check


def _at(check: Check, value: object, where: str | int) -> None:
    try:
        check(value)
    except Flooded as exc:
        exc.where.insert(0, where)
        raise


def _set_check(item_type: object, item: Check | None) -> Check:
    many = list[item_type]  # type: ignore[valid-type]

    def check(value: object) -> None:
        if type(value) is not list:
            return
        if item is not None:
            for i, element in enumerate(value):
                _at(item, element, i)
        _spread(_converted(value, many, item_type, True))
    return check


def _keys_check(key_type: object, value: Check | None) -> Check:
    many = list[key_type]  # type: ignore[valid-type]

    def check(given: object) -> None:
        if type(given) is not dict:
            return
        if value is not None:
            for key, element in given.items():
                _at(value, element, key)
        # (keys as a dict's: strict=False reads "7" as 7, a superset of str_keys's reading)
        _spread(_converted(list(given), many, key_type, False))
    return check


def _converted(values: list[object], many: object, item_type: object, strict: bool) -> list[object]:
    """`values` converted to `item_type`, those that do not convert left out (the binding
    after the check refuses them)."""
    try:
        return typing.cast(list[object], _convert(values, many, str_keys=True, strict=strict))
    except msgspec.ValidationError:
        pass
    out = []
    for value in values:
        try:
            out.append(_convert(value, item_type, str_keys=True, strict=strict))
        except msgspec.ValidationError:
            pass
    return out


def _spread(values: list[object]) -> None:
    """Raise `Flooded` if more than `SHARED_HASH_MAX` distinct `values` share a hash.
    Each lookup meets at most that many entries of its hash: linear time."""
    seen: set[object] = set()
    counts: dict[int, int] = {}  # (hash values are ints below 2**61: each its own, spread)
    for value in values:
        try:
            code = hash(value)
        except TypeError:  # (unhashable: the conversion refuses it)
            continue
        if value in seen:
            continue
        count = counts.get(code, 0) + 1
        if count > SHARED_HASH_MAX:
            raise Flooded(count)
        counts[code] = count
        seen.add(value)


_SCALARS: dict[type, object] = {
    _info.AnyType: typing.Any, _info.NoneType: None, _info.BoolType: bool, _info.IntType: int,
    _info.FloatType: float, _info.StrType: str, _info.BytesType: bytes, _info.ByteArrayType: bytearray,
    _info.MemoryViewType: memoryview, _info.DateTimeType: datetime.datetime, _info.DateType: datetime.date,
    _info.TimeType: datetime.time, _info.TimeDeltaType: datetime.timedelta, _info.UUIDType: uuid.UUID,
    _info.DecimalType: decimal.Decimal, _info.RawType: msgspec.Raw, _info.ExtType: msgspec.msgpack.Ext,
}


def _python_type(node: _info.Type) -> object:
    """A type msgspec converts to as it does to `node`, without `node`'s constraints
    (length, range, pattern): what the check converts values with."""
    kind = type(node)
    if kind in _SCALARS:
        return _SCALARS[kind]
    if isinstance(node, _info.Metadata):
        return _python_type(node.type)
    if isinstance(node, (_info.EnumType, _info.CustomType, _info.StructType, _info.DataclassType,
                         _info.TypedDictType, _info.NamedTupleType)):
        return node.cls
    if isinstance(node, _info.LiteralType):
        return typing.Literal[node.values]
    if isinstance(node, _info.UnionType):
        return typing.Union[tuple(_python_type(t) for t in node.types)]  # noqa: UP007
    if isinstance(node, _info.ListType):
        return list[_python_type(node.item_type)]  # type: ignore[misc]
    if isinstance(node, _info.SetType):
        return set[_python_type(node.item_type)]  # type: ignore[misc]
    if isinstance(node, _info.FrozenSetType):
        return frozenset[_python_type(node.item_type)]  # type: ignore[misc]
    if isinstance(node, _info.VarTupleType):
        return tuple[_python_type(node.item_type), ...]  # type: ignore[misc]
    if isinstance(node, _info.TupleType):
        return tuple[tuple(_python_type(t) for t in node.item_types)] if node.item_types else tuple[()]  # type: ignore[misc]
    if isinstance(node, (_info.DictType, _info.FrozenDictType)):
        return dict[_python_type(node.key_type), _python_type(node.value_type)]  # type: ignore[misc]
    return typing.Any
