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

For that bound to hold, `unsupported(kind)` refuses at registration what the check
cannot read in linear time: a set's elements or a dict's keys holding a set or dict of
their own that could be flooded (each set's elements are converted whole: nested 30
deep, 800 KB of params took 0.23 s where msgspec alone takes 5 ms, round 37), or a
`msgspec.Raw` (which a conversion cannot make: the check saw no element, round 38).

The walk recurses into the values inside a value up to `_DEEP` containers down, and
leaves those deeper for later on a stack of its own (`_Run`), from which each is walked
afresh: params nest as deep as the front-end passes (about 1000 levels), and a recursive
walk takes about 3 Python frames a level (hostile testing, round 44: 500 levels of a
recursive Struct holding a set raised RecursionError; round 45: raising the recursion
limit meanwhile raised it for every thread, and a tool's thread with a small stack ran
off its end, SIGSEGV; round 46: a stack of every value still to walk was 5 to 7 times
slower than recursion, and held 56 MiB per MiB of wide params).

Values are converted twice (here, then by the binding itself), so a `__post_init__` of
a frozen dataclass or Struct held in a set runs twice. A union's value is checked as
msgspec reads it: by the branch of its JSON kind, a tagged Struct's by its tag; a
Struct's walk runs once per value (round 37: a recursive union of tagged Structs was
walked 2**depth times).

An `enum.Flag` param's values are checked wherever they are bound: the enum module makes
a member for each combination of bits it has not made yet and caches it in a dict keyed
by the value (an `IntFlag` takes any integer). Only combinations of the members' own
non-negative bits, or a member's own value, are taken (`UnknownBits` otherwise): below
`2**bits`, such values hash to themselves, distinct (rounds 39 to 41: values of one hash,
negative ones cached under a twin, and Flags in unions flooded that dict). One call's params
may make at most `MADE_MEMBERS_MAX` members of one class (`new_call` starts the count; round
44: 110,000 valid values, each making one, held a worker 0.8 to 1.9 s a call), and its values
that are none of its named members may cost `UNNAMED_COST_MAX`, but those it has a member for
already, looked up first (`_memoise_missing`), cost nothing of it.

Where the binding decodes each value from its own text (`Method` in broker/worker/params.py: a
Decimal or a Raw among the hints), the check reads numbers with a fraction or an exponent
as Decimals, and the binding decodes the value written again from what the check read,
numbers in the form they were sent (rounds 39, 42, 43: duplicate keys, `1e0` made `1`,
and floats read as Decimals in untyped set elements, which `untyped_hashed` refuses).
"""

from __future__ import annotations

import datetime
import decimal
import enum
import re
import typing
import uuid
from collections.abc import Callable

import msgspec

__all__ = [
    "MADE_MEMBERS_MAX",
    "SHARED_HASH_MAX",
    "UNNAMED_COST_MAX",
    "Flooded",
    "TooManyMembers",
    "TooManyUnnamed",
    "UnknownBits",
    "guard",
    "new_call",
    "reachable",
    "unsupported",
    "untyped_hashed",
]

SHARED_HASH_MAX = 8
"""How many distinct values of one hash one set (or one object's keys) may hold."""

Check = Callable[[object], None]
_At = tuple[typing.Any, str | int] | None  # where a value is: None (the top), or (where its container is, its step)
_Walk = Callable[[object, _At, "_Run"], None]  # (a value; where it is; the run it is part of)

_info = msgspec.inspect
_convert = msgspec.convert


class Flooded(ValueError):
    """More than `SHARED_HASH_MAX` distinct values of one hash in one set or one
    object's keys. `where`: the path to it from the checked value, innermost last
    (keys and indexes), filled in as the check unwinds; `reason`: what to tell."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count
        self.where: list[str | int] = []
        self.reason = (f"more than {SHARED_HASH_MAX} distinct values of one hash in one set or in one object's"
                       " keys{at}: refused (hash flooding)")


MADE_MEMBERS_MAX = 4096
"""How many members one call's params may make for one `enum.Flag` class (values made of
its bits that it has no member for yet)."""


class TooManyMembers(Flooded):
    """More than `MADE_MEMBERS_MAX` values in one call's params that an `enum.Flag` class
    has no member for: making each costs about 10 us and 0.5 KB (hostile testing, round 44:
    110,000 valid values of a 24-bit IntFlag, 0.95 MiB, held a worker 0.8 to 1.9 s a call)."""

    def __init__(self, cls: type) -> None:
        super().__init__(0)
        self.reason = (f"more than {MADE_MEMBERS_MAX} distinct values of {cls.__name__} that it has no member for"
                       " yet (each makes one){at}: refused")


UNNAMED_COST_MAX = 16384
"""How much the values in one call's params that are none of an `enum.Flag` class's named
members may cost, in calls of the class's `_missing_` on a value of under 8 bits (about
3 us): msgspec calls it for each such value, made before or not, and it goes through the
value's bits (a 60-bit value about 24 us), so a value costs 1 + its set bits // 8."""


class TooManyUnnamed(Flooded):
    """Values of an `enum.Flag` class in one call's params that are none of its named
    members, repeated or not, costing more than `UNNAMED_COST_MAX` (hostile testing, round
    46: one value repeated 116,000 times, 1 MiB, held a worker 1.8 to 2.5 s; round 52:
    16,384 values of 46 to 60 bits each, counted as one apiece, 0.3 to 0.4 s)."""

    def __init__(self, cls: type) -> None:
        super().__init__(0)
        self.reason = (f"values of {cls.__name__} that are none of its named members cost more than {UNNAMED_COST_MAX}"
                       " calls of its _missing_ (one a value, one more per 8 bits set){at}: refused")


class UnknownBits(Flooded):
    """A value for an `enum.Flag` that is not made of its members' bits (negative, or
    with others). The enum module makes and caches a member for each such value in a
    dict keyed by the value, whose hash is its own, and stores a negative one under a
    twin too (hostile testing, round 40: values of one hash flooded that dict, whatever
    was counted): a Flag param takes its members' combinations only, as `Flag`'s own
    default boundary (STRICT) does."""

    def __init__(self, cls: type, value: int) -> None:
        super().__init__(0)
        self.reason = f"{value} is not made of the bits of {cls.__name__}'s members{{at}}"


def guard(kind: object) -> Check | None:
    """The check of decoded JSON values bound for the type `kind` (any type msgspec
    converts to), or None if `kind` holds no set and no dict with non-str keys.
    The check raises `Flooded`; it never raises for values that do not fit `kind`
    (the conversion after it says what is wrong)."""
    node = _info.type_info(kind)
    if not any(_checked_node(n) for n in reachable(node)):  # (a type holding itself and nothing hashed: no
        return None  # check, its walk all placeholders; hostile testing, round 140, F7: the general path, 2.7x)
    walk = _Compiler().plan(node)
    if walk is None:
        return None

    def check(value: object) -> None:
        run = _Run()
        run.append((walk, value, None, 0))
        pop = run.pop
        while run:
            step, item, at, run.overlap = pop()
            run.depth = 0
            step(item, at, run)
    return check


_DEEP = 64
"""How many containers down a walk recurses (about 3 Python frames each) before it leaves
the values inside for later (`_Run`)."""


class _Run(list[tuple[_Walk, object, _At, int]]):
    """One check's state: the containers left for later, each with its walk, where it is
    and `overlap` then (a stack), how many containers down the walk now is (`depth`), how
    many unions walking more than one branch it is inside (`overlap`), and the (Struct walk,
    value) pairs walked inside such unions (`done`)."""

    __slots__ = ("depth", "done", "overlap")

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.overlap = 0
        self.done: set[tuple[int, int]] = set()


def _located(exc: Flooded, at: _At) -> Flooded:
    """`exc` with the steps to where it was raised (`at`) before those it has."""
    exc.where[:0] = _path(at)
    return exc


def _path(at: _At) -> list[str | int]:
    """The steps (keys and indexes) from the checked value to the one `at` names."""
    steps: list[str | int] = []
    while at is not None:
        at, step = at
        steps.append(step)
    steps.reverse()
    return steps


class _Compiler:
    """Turns `msgspec.inspect` nodes into checks; recursive Struct, dataclass and
    TypedDict types (a tree of nodes) are compiled once each, through a cell."""

    def __init__(self) -> None:
        self._cells: dict[int, list[_Walk | None]] = {}
        self._open: set[int] = set()

    def plan(self, node: _info.Type) -> _Walk | None:
        if isinstance(node, _info.Metadata):
            return self.plan(node.type)
        if isinstance(node, (_info.SetType, _info.FrozenSetType)):
            item = self.plan(node.item_type)
            if item is None and _randomized(node.item_type):
                return None
            return _hashed_check(list, _python_type(node.item_type), None if item is None else _each_item(item),
                                 strict=True)
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
        if isinstance(node, _info.EnumType) and issubclass(node.cls, enum.Flag):
            return _flag_walk(node.cls)
        if isinstance(node, _info.UnionType):
            objects: list[tuple[tuple[str, object] | None, _Walk | None]] = []
            arrays: list[tuple[tuple[str, object] | None, _Walk | None]] = []
            scalars: list[tuple[tuple[str, object] | None, _Walk | None]] = []
            walked = False
            for branch in _branches(node):
                walk = self.plan(branch)
                walked = walked or walk is not None
                inner = _unwrapped(branch)
                tag = ((inner.tag_field, inner.tag)
                       if isinstance(inner, _info.StructType) and inner.tag_field is not None else None)
                # (round 40: a Flag in a union, `Perm | None`, was never checked: a scalar; round 41:
                # every branch is kept, walked or not, so that a tag picks its own)
                (arrays if _from_array(inner) else objects if _from_object(inner) else scalars).append((tag, walk))
            return _union(objects, arrays, scalars) if walked else None
        return None

    def _dict(self, node: _info.DictType | _info.FrozenDictType) -> _Walk | None:
        value = self.plan(node.value_type)
        if _randomized(node.key_type):
            return None if value is None else _each_value(value)
        # (keys as a dict's: strict=False reads "7" as 7, a superset of str_keys's reading)
        return _hashed_check(dict, _python_type(node.key_type), None if value is None else _each_value(value),
                             strict=False, float_keys=_float_keyed(node.key_type))

    def _fields(self, node: _info.StructType | _info.DataclassType | _info.TypedDictType
                | _info.NamedTupleType) -> _Walk | None:
        ident = id(node.cls)
        known = self._cells.get(ident)
        if known is not None:  # (a type holding itself: its check, once compiled)
            return None if ident not in self._open and known[0] is None else _through(known)
        cell: list[_Walk | None] = [None]
        self._cells[ident] = cell
        self._open.add(ident)
        fields = [(f.encode_name, check) for f in node.fields if (check := self.plan(f.type)) is not None]
        self._open.discard(ident)
        if not fields:
            return None
        if isinstance(node, _info.NamedTupleType) or getattr(node, "array_like", False):  # (from an array)
            checks = dict(fields)
            # (a tagged array_like Struct's array opens with its tag: round 37, every field was
            # checked one place early, its sets never)
            tagged: list[_Walk | None] = [None] if getattr(node, "tag_field", None) is not None else []
            cell[0] = _by_place(tagged + [checks.get(f.encode_name) for f in node.fields])
        else:
            cell[0] = _by_name(fields)
        return _through(cell)


def _checked_node(node: _info.Type) -> bool:
    """Whether a type node may need a check of its own: one msgspec builds by hashing what
    the client sends (`_hashed`), or an `enum.Flag` (`_Compiler.plan` plans a walk for no other)."""
    return _hashed(node) or (isinstance(node, _info.EnumType) and issubclass(node.cls, enum.Flag))


def _randomized(node: _info.Type) -> bool:
    """Whether values of the type `node` cannot be made to share a hash at will: strings
    and bytes (PEP 456 randomizes their hash), members of an Enum that makes none (hashed
    by name, and few), literals, booleans and None (few). Not an `enum.Flag`'s, nor an
    Enum's with a `_missing_` of its own: the members they make can share a name, or have
    none (round 37: a KEEP Flag's members of unknown bits all hash as `hash(None)`)."""
    node = _unwrapped(node)
    if isinstance(node, _info.EnumType):
        missing = getattr(node.cls, "_missing_", None)
        return not issubclass(node.cls, enum.Flag) and getattr(missing, "__func__", None) is _ENUM_MISSING
    return isinstance(node, (_info.StrType, _info.BytesType, _info.LiteralType, _info.BoolType, _info.NoneType))


_ENUM_MISSING = vars(enum.Enum)["_missing_"].__func__
_FLAG_MISSING: typing.Callable[[type, object], object] = vars(enum.Flag)["_missing_"].__func__


def _through(cell: list[_Walk | None]) -> _Walk:
    """A Struct's (dataclass's, ...) walk, run once per value it is given: in a union,
    each branch that holds the same type meets the same values (round 37: a recursive
    union of two tagged Structs was checked 2**depth times, 688 bytes held a worker)."""
    def check(value: object, at: _At, run: _Run) -> None:
        inner = cell[0]
        if inner is None:
            return
        if run.overlap:  # (a value more than one branch of a union walks: once per Struct type)
            key = (id(cell), id(value))
            if key in run.done:
                return
            run.done.add(key)
        inner(value, at, run)
    return check


def _flag_walk(cls: type) -> _Walk:
    mask = 0
    own: set[int] = set()  # (the members' own values: a negative one too, `ALL = ~0`)
    for member in vars(cls).get("_member_map_", {}).values():
        if type(member._value_) is int:
            own.add(member._value_)
            if member._value_ >= 0:  # (round 41: `~0` made the mask -1, and let every value in)
                mask |= member._value_

    made = vars(cls).get("_value2member_map_", {})  # (the enum module's, for good: members made are added to it)
    memo = _memoise_missing(cls, made)

    def check(value: object, at: _At, run: _Run) -> None:
        if type(value) is int and value not in own:  # (any other the binding refuses)
            if value < 0 or value & ~mask:
                raise _located(UnknownBits(cls, value), at)
            new = _MADE.get(cls)
            if new is None:  # (the call's first: is the memo still the class's `_missing_`?)
                new = _MADE[cls] = set()
                _MEMOISED[cls] = memo is not None and vars(cls).get("_missing_") is memo
            if (value in made or value in new) and _MEMOISED[cls]:
                return  # (a member made already: the memo's lookup, about 0.2 us)
            unnamed = _UNNAMED[cls] = _UNNAMED.get(cls, 0) + 1 + value.bit_count() // 8
            if unnamed > UNNAMED_COST_MAX:
                raise _located(TooManyUnnamed(cls), at)
            if value not in made:  # a member the binding makes
                new.add(value)
                if len(new) > MADE_MEMBERS_MAX:
                    raise _located(TooManyMembers(cls), at)
    return check


def _memoise_missing(cls: type, made: dict[object, object]) -> object | None:
    """Give an `enum.Flag` class whose `_missing_` is the enum module's a `_missing_` that
    looks the value up in `made` (its `_value2member_map_`) first, as calling the class
    does, and returns that classmethod (None if the class has a `_missing_` of its own,
    which need not cache what it makes). msgspec calls `_missing_` for every value that
    is none of the named members, made before or not, and Flag's goes through the value's
    bits each time: a record list whose Flag field held `R|W` throughout cost 3.1 us a
    value and was refused past 16,384 of them; looked up, 0.18 us (new user, round 118,
    F10). Values the class made already then cost nothing of `UNNAMED_COST_MAX`."""
    found = getattr(cls, "_missing_", None)
    function = getattr(found, "__func__", None)
    if getattr(function, "_memo_of", None) is made:  # (memoised already: another method's params)
        return vars(cls).get("_missing_")
    if function is not _FLAG_MISSING:
        return None
    get = made.get

    def _missing_(owner: type, value: object) -> object:
        if type(value) is int:
            member = get(value)
            if member is not None:
                return member
        return _FLAG_MISSING(owner, value)

    _missing_._memo_of = made  # type: ignore[attr-defined]
    _missing_.__wrapped__ = _FLAG_MISSING  # type: ignore[attr-defined]
    memo: classmethod[typing.Any, typing.Any, object] = classmethod(_missing_)
    type.__setattr__(cls, "_missing_", memo)
    return memo


_MADE: dict[type, set[int]] = {}  # a Flag class: the values the call's params make members for (`new_call`)
_UNNAMED: dict[type, int] = {}  # a Flag class: the cost of the call's values that are none of its named members
_MEMOISED: dict[type, bool] = {}  # a Flag class: whether its `_missing_` looks made members up (`_memoise_missing`)


def new_call() -> None:
    """Start counting the members a call's params make (`MADE_MEMBERS_MAX`), and their
    values that are no named member (`UNNAMED_COST_MAX`), afresh: the worker calls it
    before it checks the params of a method whose hints hold a Flag."""
    _MADE.clear()
    _UNNAMED.clear()
    _MEMOISED.clear()


def _container(kind: type, inside: typing.Callable[[typing.Any, _At, _Run], None]) -> _Walk:
    """The walk of a value of type `kind` (list or dict): `inside(value, at, run)` walks the
    values it holds, up to `_DEEP` containers down; a container deeper is left on `run` and
    walked afresh later (the module's docstring)."""
    def check(value: object, at: _At, run: _Run) -> None:
        if type(value) is kind:
            if run.depth >= _DEEP:
                run.append((check, value, at, run.overlap))  # (walked afresh, later)
                return
            run.depth += 1
            inside(value, at, run)
            run.depth -= 1
    return check


def _each_item(item: _Walk) -> _Walk:
    def inside(value: list[object], at: _At, run: _Run) -> None:
        for i, element in enumerate(value):
            item(element, (at, i), run)
    return _container(list, inside)


def _each_value(item: _Walk) -> _Walk:
    def inside(value: dict[str, object], at: _At, run: _Run) -> None:
        for key, element in value.items():
            item(element, (at, key), run)
    return _container(dict, inside)


def _by_place(items: list[_Walk | None]) -> _Walk:
    def inside(value: list[object], at: _At, run: _Run) -> None:
        for i, (item, element) in enumerate(zip(items, value)):
            if item is not None:
                item(element, (at, i), run)
    return _container(list, inside)


def _by_name(fields: list[tuple[str, _Walk]]) -> _Walk:
    def inside(value: dict[str, object], at: _At, run: _Run) -> None:
        for name, item in fields:
            if name in value:
                item(value[name], (at, name), run)
    return _container(dict, inside)


def _union(objects: list[tuple[tuple[str, object] | None, _Walk | None]],
           arrays: list[tuple[tuple[str, object] | None, _Walk | None]],
           scalars: list[tuple[tuple[str, object] | None, _Walk | None]]) -> _Walk:
    """A union's walk: the branches msgspec could read the value with (those of its JSON
    kind; of tagged Structs, the one its tag names), each walked."""
    def check(value: object, at: _At, run: _Run) -> None:
        kind = type(value)
        branches = objects if kind is dict else arrays if kind is list else scalars
        if not branches:
            return
        if len(branches) > 1 and all(tag is not None for tag, _ in branches):
            for tag, walk in branches:
                field, name = typing.cast(tuple[str, object], tag)
                given = typing.cast(dict[str, object], value).get(field) if kind is dict else (
                    typing.cast(list[object], value)[0] if value else None)
                if walk is not None and type(given) is type(name) and given == name:
                    walk(value, at, run)  # (the same value: each pushes those inside it)
            return
        walks = overlap_walks[id(branches)]
        if walks is None:  # (one walk at most: `S | None`, each value walked once, no memo)
            for _, walk in branches:
                if walk is not None:
                    walk(value, at, run)
            return
        run.overlap += 1  # (each branch meets the same values: `_through`)
        for walk in walks:
            walk(value, at, run)
        run.overlap -= 1

    # The branches of one JSON kind that walk its values, where more than one does (round 47:
    # the memo in every untagged union, `S | None` included, cost 2.3 times the walk and 60 MiB
    # per MiB of params).
    overlap_walks: dict[int, list[_Walk] | None] = {}
    for kind in (objects, arrays, scalars):
        walks = [walk for _, walk in kind if walk is not None]
        overlap_walks[id(kind)] = walks if len(walks) > 1 else None
    return check


def _branches(node: _info.UnionType) -> list[_info.Type]:
    """A union's branches, those of a union inside it (behind `Annotated`, which msgspec does
    not flatten) in its place: round 47, `Annotated[set[int] | None, Meta(...)] | str` filed
    its inner union among the scalars, and a set sent for it was never checked (1 MiB held a
    worker 10.5 s; Flag values in a list there went unchecked too)."""
    branches: list[_info.Type] = []
    for branch in node.types:
        inner = _unwrapped(branch)
        branches.extend(_branches(inner) if isinstance(inner, _info.UnionType) else [branch])
    return branches


def _unwrapped(node: _info.Type) -> _info.Type:
    while isinstance(node, _info.Metadata):
        node = node.type
    return node


def _from_array(node: _info.Type) -> bool:
    """Whether msgspec reads the type `node` from a JSON array (else from an object)."""
    return isinstance(node, (_info.ListType, _info.VarTupleType, _info.TupleType, _info.SetType,
                             _info.FrozenSetType, _info.NamedTupleType)) or (
        isinstance(node, _info.StructType) and node.array_like)


def _from_object(node: _info.Type) -> bool:
    """Whether msgspec reads the type `node` from a JSON object."""
    return isinstance(node, (_info.DictType, _info.FrozenDictType, _info.DataclassType, _info.TypedDictType)) or (
        isinstance(node, _info.StructType) and not node.array_like)


def unsupported(kind: object) -> str | None:
    """Why the params type `kind` cannot be checked in linear time (see the module's
    docstring), or None: a set's elements or a dict's non-str keys that hold a set or
    dict `guard` would check, or a `msgspec.Raw`."""
    for node in reachable(_info.type_info(kind)):
        if isinstance(node, (_info.SetType, _info.FrozenSetType)):
            inner, what = node.item_type, "a set's elements"
        elif isinstance(node, (_info.DictType, _info.FrozenDictType)) and not _randomized(node.key_type):
            inner, what = node.key_type, "a dict's keys"
            if any(isinstance(held, _info.EnumType) and issubclass(held.cls, enum.Flag) for held in reachable(inner)):
                return "a dict's keys are enum.Flag members"
        else:
            continue
        for held in reachable(inner):
            if isinstance(held, _info.RawType):
                return f"{what} hold a msgspec.Raw"
            if isinstance(held, (_info.SetType, _info.FrozenSetType)) and not (
                    _randomized(held.item_type) and not any(map(_hashed, reachable(held.item_type)))):
                return f"{what} hold a set of their own"
            if _hashed(held) and not isinstance(held, (_info.SetType, _info.FrozenSetType)):
                return f"{what} hold a dict with keys other than strings"
    return None


def untyped_hashed(kind: object) -> bool:
    """Whether a set's elements or a dict's non-str keys in the params type `kind` hold an
    untyped value (`Any`, a bare `set` or `tuple`): decoded from its own text, a number
    there is a float, which the check, reading numbers with a fraction as Decimals (to
    keep a Decimal's digits), would not see (hostile testing, round 43: 21,299 float
    pairs of one hash in a `set[tuple]` beside a Decimal parameter held a worker 12 s)."""
    for node in reachable(_info.type_info(kind)):
        if isinstance(node, (_info.SetType, _info.FrozenSetType)):
            inner = node.item_type
        elif isinstance(node, (_info.DictType, _info.FrozenDictType)) and not _randomized(node.key_type):
            inner = node.key_type
        else:
            continue
        if any(isinstance(held, _info.AnyType) for held in reachable(inner)):
            return True
    return False


def _hashed(node: _info.Type) -> bool:
    """Whether msgspec builds `node` by hashing what the client sends."""
    if isinstance(node, (_info.SetType, _info.FrozenSetType)):
        return not _randomized(node.item_type)
    return isinstance(node, (_info.DictType, _info.FrozenDictType)) and not _randomized(node.key_type)


def reachable(node: object) -> list[_info.Type]:
    """Every type node `node` (a `msgspec.inspect.Type`, or a tuple of them as
    `multi_type_info` gives) holds, itself included, however deep (once each)."""
    pending: list[object] = [node]
    seen: dict[int, _info.Type] = {}
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        if isinstance(item, (list, tuple)):
            pending.extend(item)
            continue
        if isinstance(item, _info.Type):
            seen[id(item)] = item
        if isinstance(item, (_info.Type, _info.Field)):
            pending.extend(getattr(item, name) for name in item.__struct_fields__)
    return list(seen.values())


def _hashed_check(container: type[list[object] | dict[object, object]], element_type: object, inside: _Walk | None,
                  strict: bool, float_keys: bool = False) -> _Walk:
    """The check of the values msgspec hashes: a set's elements (`container` list, the JSON
    array it is built from) or a dict's keys (`container` dict), of `element_type`. First
    `inside` walks the values they hold (a set's elements; a dict's values), then, past
    `SHARED_HASH_MAX` of them, they are converted as the binding will (`strict`: see
    `msgspec.convert`) and refused (`Flooded`) if too many share a hash. `float_keys`: a dict's
    keys that a float takes are read by float() first, however many (`_float_keys`)."""
    many = list[element_type]  # type: ignore[valid-type]

    def check(value: object, at: _At, run: _Run) -> None:
        if type(value) is not container:
            return
        if inside is not None:  # (the sets inside its elements, and Flag values, first)
            inside(value, at, run)
        if float_keys and value:  # (small dicts too: round 141, F6, a MiB of dicts of 8 keys 0.85 s)
            _float_keys(typing.cast(dict[object, object], value))
        if len(value) > SHARED_HASH_MAX:  # (fewer cannot pass the bound)
            try:
                _spread(_converted(list(value) if isinstance(value, dict) else value, many, strict))
            except Flooded as exc:
                raise _located(exc, at) from None
    return check


def _float_keyed(node: _info.Type) -> bool:
    """Whether a dict's key type `node` is a float, or a union whose member for a number is one
    and that takes no string as it is (`float | int`, `Optional[float]`; not `float | str`, whose
    keys msgspec keeps as strings): its keys written with a fraction or an exponent become floats
    (round 141, F7: the union's keys were read by msgspec, 1.3 s a MiB)."""
    node = _unwrapped(node)
    if isinstance(node, _info.FloatType):
        return True
    if not isinstance(node, _info.UnionType):
        return False
    members = [_unwrapped(member) for member in node.types]
    return any(isinstance(m, _info.FloatType) for m in members) and all(
        isinstance(m, (_info.FloatType, _info.IntType, _info.NoneType)) for m in members)


_JSON_FLOAT = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+(?:[eE][+-]?[0-9]+)?|[eE][+-]?[0-9]+)")  # (a fraction or an exponent)


def _float_keys(value: dict[object, object]) -> None:
    """`value`'s keys, JSON texts of numbers with a fraction or an exponent, made the floats
    they read as by float() (the double msgspec's own reader makes of them, bit for bit), in
    place, in their order; the others (integers, which msgspec reads fast and `-0` as 0.0;
    `nan`, `1.`, past a double's range) left as they are, for the conversion to read or refuse
    as it would. msgspec's reader took 2-20 µs a key such as `1.5e300`, and each
    was read twice, by the check and by the binding: 1 MiB of them held a worker 1.15 s
    (hostile testing, round 140, F2). Duplicates of one value (`1.0`, `1.00`) are one key,
    its last value, as the conversion makes them."""
    keyed: list[tuple[object, object]] = []
    changed = False
    for key, item in value.items():
        if type(key) is str and _JSON_FLOAT.fullmatch(key) and (number := float(key)) - number == 0.0:
            keyed.append((number, item))
            changed = True
        else:
            keyed.append((key, item))
    if changed:
        value.clear()
        value.update(keyed)


def _converted(values: list[object], many: object, strict: bool) -> list[object]:
    """`values` converted to the item type of `many` (a `list[...]`), up to the first that
    does not convert: the binding after the check stops there too (msgspec converts a
    set's elements in order, and raises at the first it cannot), so those past it are
    never put in a set. (Round 38: converting each of the rest alone cost 0.5 s per MiB
    of params that were refused all the same.)"""
    try:
        return typing.cast(list[object], _convert(values, many, str_keys=True, strict=strict))
    except msgspec.ValidationError as exc:
        end = _first_failing(str(exc))
    if end is None or end > len(values):
        return []
    try:
        return typing.cast(list[object], _convert(values[:end], many, str_keys=True, strict=strict))
    except msgspec.ValidationError:
        return []


def _first_failing(message: str) -> int | None:
    """The index `i` a list conversion's message ends with ("... - at `$[i]...`"), read
    from its last marker (the reason before it may quote the client's text)."""
    at = message.rfind(" - at `$[")
    if at < 0:
        return None
    digits = message[at + 9:message.find("]", at + 9)]
    return int(digits) if digits.isascii() and digits.isdigit() else None


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
