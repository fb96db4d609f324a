"""Params binding's slow paths: InvalidParams reasons out of msgspec's messages, and numbers no float holds.

When the one msgspec pass of `Method.bind` (broker/worker/params.py) fails, these say
which parameter is wrong and where in it (`InvalidParams`, from msgspec's messages:
`_located`, `_split_path`), and check numbers that no float holds exactly (`_float_form`,
`_decimal_or_zero`). They read messages and values, never a `Method`: which parameter a
place names, and the `InvalidParams` raised, are params.py's.
"""

from __future__ import annotations

import decimal
import re
import typing
from collections.abc import Callable

import msgspec

_STEP_END = re.compile(r"[.\[]")


def _float_form(value: object) -> object:
    """`value` (decoded with the numbers written with a fraction or an exponent as
    Decimals, `_DECIMAL_JSON`) with each such Decimal as the JSON text of a number in
    that form again (`format(d, "e")`: exact), so that the value written again decodes as
    the text sent would: a Decimal written as `str(d)` made `1e0` an integer `1`, which an
    `int` takes and the check had not read as one (hostile testing, round 42: a set's first
    element of 21 digits written `...e0` turned the check off, 1 MiB held a worker 25.6 s).
    Its lists and dicts (its own: just decoded) are changed in place, with a stack of its
    own, not Python's (round 44: 2 frames a level, RecursionError at 600 levels)."""
    kind = type(value)
    if kind is not list and kind is not dict:
        return _number_form(value)
    pending = [value]
    while pending:
        container = pending.pop()
        if type(container) is list:
            items: typing.Iterable[tuple[typing.Any, object]] = enumerate(typing.cast(list[object], container))
        else:
            items = list(typing.cast(dict[str, object], container).items())
        for place, item in items:
            kind = type(item)
            if kind is list or kind is dict:
                pending.append(item)
            elif kind is decimal.Decimal or kind is float:
                typing.cast(typing.Any, container)[place] = _number_form(item)
    return value


def _number_form(value: object) -> object:
    """A Decimal `_float_form` meets as its JSON text in its form, a zero `_decimal_or_zero`
    made as the text it was read from; any other value as it is."""
    kind = type(value)
    if kind is decimal.Decimal:
        return msgspec.Raw(format(typing.cast(decimal.Decimal, value), "e").encode())
    if kind is float and _UNDERFLOWED:
        held = _UNDERFLOWED.get(id(value))
        if held is not None and held[0] is value:
            return msgspec.Raw(held[1].encode())
    return value


_REFUSED_NUMBER = [""]  # the number `_decimal_or_zero` refused last (its text)
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
            _REFUSED_NUMBER[0] = text  # (which one: `_first_past_decimal`)
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


_DECIMAL_JSON = msgspec.json.Decoder(float_hook=_decimal_or_zero).decode


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


def _tail_message(message: str, first: int) -> str | None:
    """msgspec's refusal of the list of *args' values ("<reason> - at `$[k]<inner>`"), the
    k-th of which is params[first + k], said as a refusal of that value alone is:
    "<reason> (params[i])", or "<reason> - at `params[i]<inner>`" if inside it (or a key of
    it). None if `message` places no value."""
    at = _located(message)
    k = None if at is None else at[1]
    if at is None or k is None:
        return None
    reason, _, _, inner = at
    index = first + k
    if not inner and not reason.endswith(" (a key)"):
        return f"{reason} (params[{index}])"
    return f"{reason} - at `params[{index}]{inner}`"


_OUT_OF_RANGE = "Number out of range"
_NOT_DECIMAL = "Invalid decimal string"


def _number_out_of_range(message: str, raw: msgspec.Raw) -> str:
    """msgspec's "Invalid decimal string" `message` about a value of `raw` said as "Number
    out of range" where that value is a JSON number (its exponent past decimal's limits), not
    a string: the client sent no string (hostile testing, round 53, LOW). The value is found
    by the message's path, `[i]` steps only (a struct field's or a dict's value keeps the
    message); any other message is returned as it is."""
    split = _split_path(message)
    path = "" if split is None else split[1]
    value = bytes(raw)
    while path:
        if not path.startswith("["):
            return message
        end = path.find("]")
        digits = path[1:end]
        if end < 0 or not (digits.isascii() and digits.isdigit()):
            return message
        try:
            items = _RAW_LIST(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return message
        if int(digits) >= len(items):
            return message
        value = bytes(items[int(digits)])
        path = path[end + 1:]
    if value[:1] in b'"':
        return message
    return _OUT_OF_RANGE + message[len(_NOT_DECIMAL):]


_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw]).decode


def _array_of(values: list[msgspec.Raw]) -> msgspec.Raw:
    """The JSON array of raw `values`."""
    return msgspec.Raw(b"[" + b",".join(values) + b"]")


def _past_decimal(raw: msgspec.Raw) -> bool:
    """Whether `raw` holds a number past decimal's exponent limits (read as `bind` reads
    numbers beside a Decimal; plain values only: no set or Flag is built)."""
    try:
        _DECIMAL_JSON(raw)
    except ArithmeticError:
        return True
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    finally:
        _UNDERFLOWED.clear()
    return False



def _object_of(items: list[tuple[str, msgspec.Raw]]) -> msgspec.Raw:
    """The JSON object of `items` (keys and raw values)."""
    return msgspec.Raw(b"{" + b",".join(_encode_key(key) + b":" + raw for key, raw in items) + b"}")


_encode_key = msgspec.json.encode


def _refuses(decode: Callable[[typing.Any], object], value: object) -> str | None:
    """msgspec's refusal of `value` by `decode` (a decoder's or a conversion), or None."""
    try:
        decode(value)
    except msgspec.ValidationError as exc:
        return str(exc)
    except ArithmeticError:  # (a Decimal's exponent past decimal's limits)
        return _OUT_OF_RANGE
    return None



def _first_past_decimal(values: list[msgspec.Raw]) -> int:
    """The index of the first of `values` holding a number past decimal's exponent limits,
    which a decode refuses with no place: the number the refusal met (`_REFUSED_NUMBER`,
    what `_decimal_or_zero` saw last) is looked for in each value's text, each found
    checked alone (round 52: halving decoded the values before it again in each half,
    175,000 numbers 18 times: 0.6-0.8 s). The last if none is found."""
    text = _REFUSED_NUMBER[0].encode()
    for i, raw in enumerate(values):
        if text and text in bytes(raw) and _past_decimal(raw):
            return i
    return max(len(values) - 1, 0)
