"""A handler's result as the JSON text of the reply: `encode_result`.

The fast path is one `orjson.dumps` of the result, with dataclasses and datetimes left
out (`_FIRST_OPTIONS`). What orjson refuses, or what it cannot be trusted with, is first
made plain (`_plain`): copied into new dicts and lists whose leaves are JSON types or
`orjson.Fragment`s, with no Python code of the handler's objects running while a C
encoder walks them (hostile testing found several ways to crash the worker that way).
msgspec writes what orjson does not (integers past 64 bits, Structs, Decimal, bytes),
and a `msgspec.Raw` is checked and made compact (`InvalidJson` if it is not JSON;
`NoJsonForm` for a value with no JSON form).

Whether orjson's fast path can be trusted is decided per process: an Enum class whose
members orjson cannot read safely turns `_ORJSON_FIRST` off for good (`_check_enum`). The
watch over Enum classes (`_watch_enums`) is installed once, as this module is imported,
and `_ORJSON_FIRST` is rebound here only: read it as `results._ORJSON_FIRST`, never
through a copy made with `from ... import`.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import logging
import sys
import types
import typing
import uuid
from collections.abc import Callable

import msgspec
import orjson

log = logging.getLogger("broker.worker")  # (one logger for the package: its records say `broker.worker`)


def _encoded_data(data: object) -> bytes:
    """`encode_result`, raising what `_plain` raises (`_TooDeep`, a `tolist()`'s own
    error) but for `TypeError`, the one a repr stands in for."""
    if _ORJSON_FIRST:
        try:
            return _framed(orjson.dumps(data, option=_FIRST_OPTIONS))
        except TypeError:
            pass
    return _encoded_plain(data)


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


_PLAIN_DEPTH = 254  # how deep `_plain` goes: orjson's own limit (255 levels are its "Recursion limit reached")
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
    `enum.EnumType.__new__` to check every one made after (`_check_enum`). Run once, as
    this module is imported (it is never run as `__main__`: `python -m broker.worker` runs
    `__main__.py`), so there is one watch and one `_ORJSON_FIRST` in a process."""
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
_watch_enums()  # (once per process: a module's body runs once, `-m` included: `__main__.py`)
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
        raise NoJsonForm(f"result of type {type(result).__name__} is not JSON-serializable: {exc}",
                         _why_no_json_form(exc)) from None


def _why_no_json_form(exc: Exception) -> str:
    """A client's reason for `exc` (`encode_result`'s failure): the limit a valid value passed
    (its nesting, an integer's digits: hostile testing, round 111, both were "no JSON form"),
    else that it has none."""
    if isinstance(exc, _TooDeep) or (isinstance(exc, _Unwritable) and "Recursion limit" in str(exc)):
        return f"the result nests deeper than {_PLAIN_DEPTH} levels, or refers to itself"
    if isinstance(exc, ValueError) and "integer string conversion" in str(exc):
        return (f"the result holds an integer of more than {sys.get_int_max_str_digits()} digits "
                "(sys.get_int_max_str_digits())")
    return "the result has no JSON form"


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


def checked_result(result: object, check: Callable[[bytes], object], returns: object) -> bytes:
    """`encode_result(result)`, checked by a tool's `check` (`tools.result_check`: its JSON
    decoded as its return type `returns`). Raises as `encode_result` does, and `ResultMismatch`
    saying where the result breaks its outputSchema."""
    encoded = encode_result(result)
    try:
        check(encoded)
    except msgspec.ValidationError as exc:
        raise ResultMismatch(f"result does not fit its return type {returns!r}: {exc}",
                             f"the result does not fit the tool's outputSchema: {exc}") from None
    return encoded


class NoJsonForm(TypeError):
    """A handler's result has no JSON form (`encode_result`): the message says why, for the log;
    `reason`, for the client, names a limit it passed (its nesting, an integer's digits)."""

    def __init__(self, message: str, reason: str = "the result has no JSON form") -> None:
        super().__init__(message)
        self.reason = reason


_format_json = msgspec.json.format


class ResultMismatch(NoJsonForm):
    """A tool's result has a JSON form that breaks its outputSchema (`checked_result`): MCP,
    server/tools "Output Schema": "Servers MUST provide structured results that conform to
    this schema". `reason` says where, for the client."""
