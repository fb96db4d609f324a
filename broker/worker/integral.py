"""Integral numbers written as floats (`5.0`, `1e2`) made integers where a parameter's type wants an `int`.

JSON Schema counts a number with a zero fractional part an integer (draft 2020-12,
Validation section 6.1.1: `"type": "integer"` matches 5.0), and so do the MCP clients that
send one (LLM-made arguments, a language whose numbers are all doubles); msgspec's strict
mode refuses it ("Expected `int`, got `float`"), and its lax mode would take "5" too, which
JSON Schema does not. `integral_params` rewrites such params once their binding has failed
(broker/worker/params.py, `Method.bind`: the error path only, calls whose params fit pay
nothing): each number written with a fraction or an exponent that sits where the types
want an int (inside lists, dicts, Structs, dataclasses, TypedDicts, tuples, Optional and
other unions, an int Literal or Enum) and is integral is written again as that integer,
read exactly from its text (`9007199254740993.0` is 9007199254740993, which no float
holds); everything else is written as sent. A bool stays a bool (JSON Schema's boolean is
not an integer). An integer of more digits than a double holds (309: past 1.8e308) is left
as sent, and refused as before ("Number out of range", as msgspec refuses it), as are those
past `room`: the digits written beyond the numbers' own text, at most the params' length
and 309 more (hostile use: "1e308" is 5 bytes, its integer 309, and a MiB of them would
have been 64 MB).

Nothing here does I/O or knows a `Method`: it reads msgspec.inspect types and JSON text.
"""

from __future__ import annotations

import decimal
import marshal
import sys
import typing

import msgspec
from msgspec import inspect as mi

__all__ = ["Rewrite", "holds_int", "integral_params", "wants_int"]

class _Number:
    """A number written with a fraction or an exponent, as `integral_params` reads it: its text."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text.encode()


def _as_written(value: object) -> msgspec.Raw:
    if type(value) is _Number:
        return msgspec.Raw(value.text)
    raise TypeError(f"not JSON: {type(value).__name__}")


_WRAPPED_NUMBER = msgspec.json.Decoder(float_hook=_Number).decode
_encode = msgspec.json.Encoder(enc_hook=_as_written).encode
_OBJECTS = (mi.StructType, mi.DataclassType, mi.TypedDictType, mi.DictType, mi.FrozenDictType)
_ARRAYS = (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType, mi.TupleType, mi.NamedTupleType)
# The most digits an integer written here has: a double's (1.8e308, 309 digits). A float past
# that is no number a client's doubles sent, and writing it out was the cost (hostile testing,
# round 139, F1: a batch of 1000 calls of `1e4299`, each written out as 4300 digits, held a
# worker 0.86 s). Below Python's int max str digits (4300; at least 640), so each is read back.
_MOST_DIGITS = len(str(int(sys.float_info.max)))
_MOST_KNOWN = 256  # distinct exponents' texts remembered a walk (`_Walk.known`)
_A_NUMBER = _Number("0")  # (what a union's member for a number is chosen by)
_TAKE_FLOATS = (mi.FloatType, mi.DecimalType, mi.AnyType, mi.CustomType, mi.RawType)


class Rewrite(typing.NamedTuple):
    """What `integral_params` made of params: `text`, the params written again (None if no
    number changed), and `fractional`: a number with a fractional part sat where only an
    int would do, and no integral one was left as sent (so a refusal "got `float`" is of a
    number that is not an integer)."""

    text: bytes | None
    fractional: bool


def wants_int(node: mi.Type) -> bool:
    """Whether a type node takes an integer that a float written integral may stand for:
    an `int` (Annotated too), a Literal holding an int, an Enum whose members are ints."""
    while isinstance(node, mi.Metadata):
        node = node.type
    if isinstance(node, mi.IntType):
        return True
    if isinstance(node, mi.LiteralType):
        return any(type(value) is int for value in node.values)
    return isinstance(node, mi.EnumType) and any(type(member.value) is int for member in node.cls)


def holds_int(node: mi.Type) -> bool:
    """Whether a type, or any type inside it (items, values, fields, union members), takes an
    integer that a float written integral may stand for (`wants_int`). Recursive types (a
    Struct holding itself) are walked once each."""
    pending, seen = [node], set()
    while pending:
        node = _bare(pending.pop())
        if id(node) in seen:
            continue
        seen.add(id(node))
        if wants_int(node):
            return True
        if isinstance(node, mi.UnionType):
            pending.extend(node.types)
        elif isinstance(node, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
            pending.append(node.item_type)
        elif isinstance(node, mi.TupleType):
            pending.extend(node.item_types)
        elif isinstance(node, (mi.DictType, mi.FrozenDictType)):
            pending.append(node.value_type)
        elif isinstance(node, (mi.StructType, mi.DataclassType, mi.TypedDictType, mi.NamedTupleType)):
            pending.extend(field.type for field in node.fields)
    return False


def integral_params(params: bytes, positional: tuple[list[mi.Type], mi.Type | None],
                    named: tuple[dict[str, mi.Type], mi.Type | None]) -> Rewrite:
    """`params` (a JSON array or object) with the integral numbers written as floats where
    the types want an int written as integers. `positional`: the positional parameters'
    types in order and *args' element type (or None); `named`: the types of the parameters
    that params by name fill (by name) and **kwargs' value type (or None). Linear in the
    params: one decode, one walk (its own stack, not Python's), one encode. Params that are
    not JSON, or whose top is neither, come back unchanged (`text` None)."""
    try:
        value = _WRAPPED_NUMBER(params)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return Rewrite(None, False)
    walk = _Walk(len(params) + _MOST_DIGITS)
    if type(value) is list:
        types, rest = positional
        walk.items(value, [*types, *[rest] * (len(value) - len(types))] if rest is not None else types)
    elif type(value) is dict:
        by_name, rest = named
        walk.fields(value, by_name, rest)
    else:
        return Rewrite(None, False)
    walk.run()
    if not walk.changed:
        return Rewrite(None, walk.fractional and not walk.kept)
    return Rewrite(_encode(value), walk.fractional and not walk.kept)


class _Walk:
    """The walk of a decoded value beside its type: `pending` holds (container, key, type)
    of the values still to see; `room` the digits integers may still add to the text; `known`
    the integers (and their digits) of the numbers written with an exponent seen first."""

    __slots__ = ("changed", "fractional", "kept", "known", "pending", "room")

    def __init__(self, room: int) -> None:
        self.pending: list[tuple[typing.Any, typing.Any, mi.Type]] = []
        self.room = room
        self.changed = self.fractional = self.kept = False
        self.known: dict[bytes, tuple[int, int]] = {}

    def items(self, values: list[object], types: typing.Sequence[mi.Type | None]) -> None:
        # (reversed: popped in order, the first numbers take the room)
        self.pending.extend((values, i, kind) for i, kind in reversed(list(zip(range(len(values)), types)))
                            if kind is not None and _worth(values[i]))

    def each(self, values: list[object], kind: mi.Type) -> None:
        """`values`, all of type `kind`: the numbers seen here, not one by one on the stack, where
        `kind` is an int, or a union whose member a number takes is the same for each (Optional[int]:
        its union chosen once, not a number at a time: round 139, F5, 1.5 s a MiB)."""
        bare = _bare(kind)
        union = isinstance(bare, mi.UnionType)
        if union:
            chosen = _member(typing.cast(mi.UnionType, bare), _A_NUMBER)
            wanted = chosen is not None and wants_int(chosen)
        elif not wants_int(bare):  # (else a number's place, not a container's)
            self.items(values, [kind] * len(values))
            return
        else:
            wanted = True
        number = self._number
        for i, value in enumerate(values):
            if type(value) is _Number:
                if wanted:
                    number(values, i, value)
                    if self.fractional or self.kept:
                        return
            elif union and (type(value) is list or type(value) is dict):  # (another member's: walked in order from here)
                self.pending.extend((values, j, kind) for j in range(len(values) - 1, i - 1, -1))
                return

    def fields(self, values: dict[str, object], by_name: dict[str, mi.Type], rest: mi.Type | None) -> None:
        # (reversed, as `items`: popped in the text's order; hostile testing, round 141, F10: the last
        # key's value was seen first, and `{"a": 1.0, "b": 1.5}` blamed `a`)
        self.pending.extend(reversed([(values, key, kind) for key, value in values.items()
                                      if (kind := by_name.get(key, rest)) is not None and _worth(value)]))

    def run(self) -> None:
        """Walk what is pending, in the params' order, up to the first number with a fractional
        part, or kept as sent, where an int is wanted: no binding takes it, and the params bound
        again are refused there (or before: the refusal of a client's params costs no more than
        its values before it; 1.6 MB of 5.5 in a list[int] took 0.37 s walked whole, and 1 MiB of
        integral floats of 250 digits, past `room` after 4,678 of them, 0.4 s: hostile testing,
        round 137, F5)."""
        pending = self.pending
        while pending and not self.fractional and not self.kept:
            container, key, kind = pending.pop()
            value = container[key]
            while isinstance(kind, mi.Metadata):
                kind = kind.type
            if isinstance(kind, mi.UnionType):
                chosen = _member(kind, value)
                if chosen is None:
                    continue
                kind = chosen
                while isinstance(kind, mi.Metadata):
                    kind = kind.type
            if type(value) is _Number:
                if wants_int(kind):
                    self._number(container, key, value)
            elif type(value) is list:
                self._array(value, kind)
            elif type(value) is dict:
                self._object(value, kind)

    def _number(self, container: typing.Any, key: object, raw: _Number) -> None:
        text = raw.text
        if b"e" not in text and b"E" not in text:  # (the usual 5.0: its digits before the point)
            whole, _, fraction = text.partition(b".")
            if fraction.strip(b"0"):
                self.fractional = True
                return
            if len(whole.lstrip(b"-0")) > _MOST_DIGITS:  # (no longer than its text: no room taken)
                self.kept = True
                return
            container[key] = int(whole)
            self.changed = True
            return
        known = self.known.get(text)  # (the same text again, as a MiB of `1e1` has it: read once)
        if known is not None:
            integer, width = known
        else:
            try:  # (Decimal, exact: `as_tuple` and back took twice as long, round 139, F5)
                number = decimal.Decimal(text.decode("ascii"))
            except (ArithmeticError, ValueError):  # (an exponent decimal cannot read)
                self.fractional = True
                return
            width = number.adjusted() + 1 if number else 1  # (its integer's digits, if it is one; a zero's is "0")
            if width > _MOST_DIGITS:
                self.kept = True  # (refused as before: out of range)
                return
            integer = int(number)
            if integer != number:  # (exact: a fractional part, or less than 1)
                self.fractional = True
                return
            if len(self.known) < _MOST_KNOWN:  # (a MiB of distinct texts gains nothing, and would hold ~40 MB)
                self.known[text] = integer, width
        if width - len(text) > self.room:
            self.kept = True  # (refused as before: "got `float`")
            return
        self.room -= max(width - len(text), 0)
        container[key] = integer
        self.changed = True

    def _array(self, values: list[object], kind: mi.Type) -> None:
        if isinstance(kind, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
            self.each(values, kind.item_type)
        elif isinstance(kind, mi.TupleType):
            self.items(values, kind.item_types)
        elif isinstance(kind, mi.NamedTupleType):
            self.items(values, [field.type for field in kind.fields])
        elif isinstance(kind, mi.StructType) and kind.array_like:
            skip = 0 if kind.tag_field is None else 1  # (a tagged one's tag is the first element)
            self.items(values, [None] * skip + [field.type for field in kind.fields])

    def _object(self, values: dict[str, object], kind: mi.Type) -> None:
        if isinstance(kind, (mi.DictType, mi.FrozenDictType)):
            self.fields(values, {}, kind.value_type)
        elif isinstance(kind, (mi.StructType, mi.DataclassType, mi.TypedDictType)) and not getattr(kind, "array_like", False):
            self.fields(values, {field.encode_name: field.type for field in kind.fields}, None)


def _worth(value: object) -> bool:
    """Whether the walk has anything to do in `value`: a number written with a fraction or an
    exponent (a `_Number`), or an array or object holding one, found in C: `marshal.dumps`, which
    writes lists, dicts, strings and integers (in binary: linear in their digits) and stops at
    the first object it cannot write, a `_Number` (nothing is read back). Hostile testing, round
    140, F7: a `1e0` after a MiB of nested empty Structs had the walk visit each of their 520,000
    arrays in Python, 1.8-2.3 s; round 141, F5: looked for by a JSON encoder, whose integers of
    4,299 digits cost it quadratic time, a MiB of them 60 levels down took 3.4 s."""
    kind = type(value)
    if kind is _Number:
        return True
    if (kind is not list and kind is not dict) or not value:
        return False
    try:
        marshal.dumps(typing.cast(typing.Any, value), 2)  # (version 2: no table of the objects written, as 3 and 4 keep)
    except ValueError:  # ("unmarshallable object": a _Number; or nested too deep for it, then walked all the same)
        return True
    return False


def _member(union: mi.UnionType, value: object) -> mi.Type | None:
    """The member of `union` that msgspec would decode `value` with: for a number, an int
    member unless one takes floats (then None: the number stays as sent); for an object or
    an array, the member of that shape (a tagged Struct's by its tag); else None."""
    members = [_bare(member) for member in union.types]
    shaped: list[mi.Type]
    if type(value) is _Number:
        if any(isinstance(member, _TAKE_FLOATS) for member in members):
            return None
        return next((member for member in members if wants_int(member)), None)
    if type(value) is dict:
        shaped = [m for m in members if isinstance(m, _OBJECTS) and not getattr(m, "array_like", False)]
        tag: object = None
    elif type(value) is list:
        shaped = [m for m in members if isinstance(m, _ARRAYS) or (isinstance(m, mi.StructType) and m.array_like)]
        tag = typing.cast(list[object], value)[0] if value else None
    else:
        return None
    for member in shaped:
        if isinstance(member, mi.StructType) and member.tag_field is not None:
            if tag is None and type(value) is dict:
                tag = typing.cast(dict[str, object], value).get(member.tag_field)
            if tag == member.tag:
                return member
    return next((m for m in shaped if not (isinstance(m, mi.StructType) and m.tag_field is not None)), None)


def _bare(node: mi.Type) -> mi.Type:
    while isinstance(node, mi.Metadata):
        node = node.type
    return node
