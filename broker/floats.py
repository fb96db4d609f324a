"""JSON floats read by Python's float() where msgspec's own reader may be slow: params are never refused for their numbers.

msgspec 0.23 reads a float with the Eisel-Lemire algorithm and, where it gives up, with a slow
decimal fallback: 2-20 µs a number for exponents near 290-308 (`1e308`), halfway points between
two doubles at any exponent (`1.2345000000000000576e249`, `1e23`) and long mantissas, against
0.03 µs for `1.5` (1 MiB of `1e308` took 1.6 s to decode; hostile testing, rounds 136 and 137).
Python's float() (David Gay's correctly rounded strtod) reads each of those in 0.1-0.3 µs, the
same double bit for bit. So `Method.bind` (broker/worker/params.py) decodes params with
msgspec's own reader only where `plain_numbers` says none of their numbers can take the slow
path, and otherwise with `read_json` (msgspec's parser, its floats handed to float(): 20-100 ms
a MiB whatever the numbers, against 2-15 ms for `plain` ones, benchmarks/slow_numbers.py).

`plain_numbers(params)`: no number is written with an exponent (no 'e' or 'E' right after a
digit). msgspec reads those by its fast path, or, past 19 digits, by a fallback whose cost grows
with the number's decimal exponent, here at most its length: 1 MiB of the slowest such forms
measured (halfway points written out in 310 digits, `111...1.0`) took 40-50 ms, against 7-14 ms
for `1.5`. Text in JSON strings that looks so counts too (a UUID's "0e8"): those params only take
the slower path. `read_json` answers as msgspec's decoder does, its messages included: a float
past a double's range is refused "Number out of range - at `$...`". `read_json_beyond` reads
such a float as `BEYOND` instead, counted in `beyond_read()`, so that a refusal can be placed
from the one decoded value (`first_beyond`). The front-end's loop reads with `plain_numbers` and
`decode_json` (either, as `plain_numbers` says): the access log's params (broker/accesslog.py) and
an MCP tool error's data (broker/frontend/mcp.py; hostile testing, round 139). Nothing here does I/O.
"""

from __future__ import annotations

import re
import typing

import msgspec

__all__ = ["BEYOND", "NumberOutOfRange", "beyond_read", "decode_json", "first_beyond", "plain_numbers", "read_float",
           "read_json", "read_json_beyond"]

_OUT_OF_RANGE = "Number out of range"  # (msgspec's own words)
# Digits read as '1', 'e' and 'E' as '0' (neither is a digit): an exponent is then "10".
_FORM = bytes.maketrans(b"0123456789eE", b"111111111100")


def plain_numbers(params: bytes) -> bool:
    """Whether no number in the JSON text `params` is written with an exponent, so that
    msgspec reads them all fast enough (see the module's docstring). False may be said of
    params whose strings only look so. ~2,000 CPU instructions for small params, 2 ms a MiB
    (`Method.bind` tests first, inline, whether params hold an 'e' or an 'E' at all: ~450)."""
    return not params.translate(_FORM).partition(b"10")[1]  # (partition: `in` and find take 1.3-2.5x its instructions)


def read_float(text: str) -> float:
    """A JSON float's text read by float(), as msgspec reads it (the same double); raises
    ValueError "Number out of range" past a double's range, which a decoder's `float_hook`
    turns into msgspec's own ValidationError, placed."""
    value = float(text)
    if value - value != 0.0:  # (inf: msgspec's own message, placed by msgspec)
        raise ValueError(_OUT_OF_RANGE)
    return value


class NumberOutOfRange:
    """What `read_json_beyond` reads a float past a double's range as (`1e400`): `BEYOND`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "BEYOND"


BEYOND = NumberOutOfRange()
_BEYOND_READ = [0]  # how many `read_json_beyond` has read so far (bind reads it before and after)


def _float_or_beyond(text: str) -> float | NumberOutOfRange:
    value = float(text)
    if value - value != 0.0:
        _BEYOND_READ[0] += 1
        return BEYOND
    return value


read_json: typing.Callable[[bytes], typing.Any] = msgspec.json.Decoder(float_hook=read_float).decode
"""msgspec.json.decode with each float read by float(): the same values and errors."""
read_json_beyond: typing.Callable[[bytes], typing.Any] = msgspec.json.Decoder(float_hook=_float_or_beyond).decode
"""`read_json`, but a float past a double's range is `BEYOND` (and counted) rather than refused."""


_decode = msgspec.json.Decoder().decode


def decode_json(text: bytes | msgspec.Raw) -> typing.Any:
    """JSON `text` decoded as msgspec.json.decode decodes it (the same values and errors), by
    msgspec's own reader where `plain_numbers` says it reads them fast, else by `read_json`."""
    return _decode(text) if plain_numbers(text if type(text) is bytes else bytes(text)) else read_json(text)


def beyond_read() -> int:
    """How many floats past a double's range `read_json_beyond` has read since the worker began."""
    return _BEYOND_READ[0]


def first_beyond(value: object) -> list[int | str] | None:
    """The place of the first `BEYOND` in `value` (decoded by `read_json_beyond`), in the text's
    order: the indexes from the top, each object's key as "...", but the first step's, the
    top object's own key (msgspec's messages show no other); None if it holds none (a later
    duplicate key's value replaced the number). Found in C: `value` encoded with each `BEYOND`
    as a number no float holds, decoded again with its floats read by a hook that refuses that
    one, where msgspec says "at `$[3][...][0]`" (a MiB of nested arrays ~0.1 s; walked in
    Python, 0.5 s: hostile testing, round 139, F6). Raises RecursionError past msgspec's depth."""
    if value is BEYOND:
        return []
    keys = list(typing.cast(dict[str, object], value)) if type(value) is dict else None
    try:
        _find_mark(_marked(list(typing.cast(dict[str, object], value).values()) if keys is not None else value))
    except msgspec.ValidationError as exc:
        steps: list[int | str] = [int(step) if step != "..." else step for step in _STEP.findall(str(exc))]
        if keys is not None and steps:
            steps[0] = keys[typing.cast(int, steps[0])]
        return steps
    return None


_MARK = b"9e999"  # (what `BEYOND` is written as by `_marked`, and refused as by `_find_mark`)
_STEP = re.compile(r"\[(\d+|\.\.\.)\]")


def _mark_beyond(value: object) -> msgspec.Raw:
    if value is BEYOND:
        return msgspec.Raw(_MARK)
    raise TypeError(f"not JSON: {type(value).__name__}")


def _refuse_mark(text: str) -> float:
    if text == "9e999":
        raise ValueError(_OUT_OF_RANGE)
    return 0.0


_marked = msgspec.json.Encoder(enc_hook=_mark_beyond).encode
_find_mark = msgspec.json.Decoder(float_hook=_refuse_mark).decode
