"""Numbers that msgspec's JSON parser is slow to read, counted before params are decoded.

msgspec 0.23 reads a float with the Eisel-Lemire algorithm when its decimal exponent (that of
its first 19 significant digits read as an integer) is at most 288, and with a slow decimal
fallback above it: `1e289` to `1.7976931348623157e308` cost 10-20 µs each where `1e288`,
`1e-300` or `1.5` cost 0.02-0.05 µs, in typed and untyped decoding alike (measured on this
machine: 1 MiB of `1e308` decoded in 2.7-3.4 s, of `1.5` in 0.02 s; hostile testing, round
136, F2: such params held a worker 5 s, and `max_body_bytes` takes 4 MiB of them).

`slow_numbers(params)` counts, up to `SLOW_NUMBERS_MAX + 1`, the numbers written in a form
that can take that path (a superset of it: the others cost nothing):

- an exponent of 250 to 999 (`1e300`, `1.5E+0290`, `0.000...1e400`: the short forms, every
  one of which above 288 is slow, and fraction-led ones of fewer than 700 zeros);
- 41 digits or more before a fraction or an exponent (`111...1e249`, `111...1.0`: a number
  past 1e288 written with a smaller exponent has 41 integer digits at least).

What is left out costs at most ~15 ms a MiB (`0.<700 zeros>1e1000`: 1,478 of them a MiB,
14 ms), and params of at most `SLOW_NUMBERS_BYTES` are not counted (1,365 numbers at most,
~27 ms). `Method.bind` (broker/worker/params.py) refuses params holding more than
`SLOW_NUMBERS_MAX` (-32602), so no params of the forms counted keep a worker more than ~10 ms a
decoding for them. Not counted (hostile testing, round 137): numbers halfway between two floats
(`1.2345000000000000576e249`, 6-8 µs each, ~0.25 s a MiB), and a batch's calls are counted one by
one (docs/reference.md, "Slow-to-read numbers").

The count costs params over `SLOW_NUMBERS_BYTES` ~3-5 ms a MiB, in C (two translations, three
counts of a literal, two literal searches: see `benchmarks/slow_numbers.py`), and only params
with more than `SLOW_NUMBERS_MAX` exponents of 3 digits or more (or led by zeros), or with 41
digits before a point or an 'e', are searched further (~3-7 ms a MiB; up to 85 ms a MiB on a long
run of digits beside one number of 42 digits, round 137). Measured on 1 MiB:
`1.5` 3 ms (decoded in 7-15), `1.5e10` 4 (4), prose 3.5 (0.3), hex strings 5.5 (0.5), `1e200` 8
(8). Small params pay one comparison of their length. Nothing here does I/O.
"""

from __future__ import annotations

import itertools
import re
import typing

__all__ = ["SLOW_NUMBERS_BYTES", "SLOW_NUMBERS_MAX", "TOO_MANY_SLOW_NUMBERS", "slow_numbers"]

SLOW_NUMBERS_BYTES = 8 * 1024
"""Params of at most this many bytes are not counted: they hold too few numbers to matter."""
SLOW_NUMBERS_MAX = 512
"""The most slow-to-parse numbers that params over `SLOW_NUMBERS_BYTES` may hold (~10 ms)."""

# Digits read as 0, 'E' as 'e', '+' dropped, what ends a number in an array or an object as ',':
# an exponent of 3 or 4 digits is then "0e000," or "0e0000," and a long number 41 0s and a point
# or an 'e' (literals, searched in C: `\d{41}` took 20-30 ms a MiB). An exponent led by two
# zeros or more is "e00" where only 'E' is read as 'e' (a hex string holds one in 4096 bytes).
_DIGITS_FORM = bytes.maketrans(b"0123456789E \t\n\r]}", b"0000000000e,,,,,,")
_EXPONENT_FORM = bytes.maketrans(b"E", b"e")
_LONG_POINT, _LONG_EXPONENT = b"0" * 41 + b".", b"0" * 41 + b"e"
_LONG_NUMBER = re.compile(rb"\d{41}[.eE]")
# (after a digit, its last digit followed by what ends a number: neither a hex string's "3e312f"
# nor prose's "e300 " is counted; the lookbehind after the 'e' keeps the search from the literal)
_SLOW_EXPONENT = re.compile(rb"e(?<=\de)0*(?:2[5-9]|[3-9]\d)\d(?=[\s,\]}])")

TOO_MANY_SLOW_NUMBERS = (
    f"params hold more than {SLOW_NUMBERS_MAX} numbers written with an exponent of 250 to 999 or with 41"
    " digits or more before a fraction or an exponent, which the JSON parser reads slowly (~15 µs each):"
    f" at most {SLOW_NUMBERS_MAX} in params over {SLOW_NUMBERS_BYTES} bytes")
"""The -32602 reason (`InvalidParams`, no parameter named) for params past that bound."""


def slow_numbers(params: bytes) -> int:
    """How many numbers in the JSON text `params` are written in a form msgspec may read
    slowly (see the module's docstring), counted up to `SLOW_NUMBERS_MAX + 1`; 0 for params
    of at most `SLOW_NUMBERS_BYTES`. Text inside JSON strings that looks so counts too."""
    if len(params) <= SLOW_NUMBERS_BYTES:
        return 0
    most = SLOW_NUMBERS_MAX + 1
    digits, exponents = params.translate(_DIGITS_FORM, b"+"), params.translate(_EXPONENT_FORM, b"+")
    count = 0
    if digits.count(b"0e000,") + digits.count(b"0e0000,") + exponents.count(b"e00") > SLOW_NUMBERS_MAX:
        count = _up_to(_SLOW_EXPONENT.finditer(exponents), most)  # (else too few such exponents)
    if count < most and (_LONG_POINT in digits or _LONG_EXPONENT in digits):
        count += _up_to(_LONG_NUMBER.finditer(params), most - count)
    return count


def _up_to(found: typing.Iterator[re.Match[bytes]], most: int) -> int:
    return sum(1 for _ in itertools.islice(found, most))
