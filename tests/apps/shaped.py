"""Tools whose results break (or keep) their return types below the top: the outputSchema the
host is given says what they must be (tests/test_mcp_results.py; hostile testing, round 131)."""

import enum
import typing
from decimal import Decimal

import msgspec

from broker.worker import Registry

registry = Registry(tools=True)


class Point(msgspec.Struct):
    x: int
    y: int


class Named(typing.TypedDict):
    a: int


@registry.method
def point(kind: str) -> Point:
    """A Point, or a dict that should be one: `kind` says how it is wrong ("ok" for not)."""
    values: dict[str, object] = {"ok": {"x": 1, "y": 2}, "missing": {"x": 1}, "typed": {"x": "a", "y": 2},
                                 "nan": {"x": 1, "y": float("nan")}, "struct": Point(3, 4)}
    return typing.cast(Point, values[kind])


@registry.method
def named(a: object) -> Named:
    """{"a": a}: an int, or not."""
    return typing.cast(Named, {"a": a})


@registry.method
def letter(value: str) -> typing.Literal["a", "b"]:
    """`value` as it is: "a" or "b", or not."""
    return typing.cast(typing.Literal["a", "b"], value)


@registry.method
def numbers(values: list[object]) -> list[int]:
    """`values` as they are: integers, or not."""
    return typing.cast(list[int], values)


@registry.method
def scaled(values: list[object]) -> list[float]:
    """`values` as they are: floats, or not (hostile testing, round 140, F5: a result of floats
    written with an exponent was checked by msgspec's slow reader, 1.7 s a MiB of `1e308`)."""
    return typing.cast(list[float], values)


class Price(msgspec.Struct):
    amount: Decimal


class Tagged(msgspec.Struct, tag=True):
    v: int


# What msgspec's decoding of a return type takes but the schema it writes of that type does not
# say (new user, round 118, F9: the official SDK's client refused each): the outputSchema says it.


@registry.method
def price() -> Price:
    """A float where a Decimal is declared, in a Struct."""
    return typing.cast(Price, {"amount": 3.3})


@registry.method
def prices() -> list[Decimal]:
    """A float where a Decimal is declared, in a list."""
    return [Decimal("1.5"), typing.cast(Decimal, 2.5)]


@registry.method
def tagged(many: bool = False) -> Tagged | list[Tagged]:
    """A tagged Struct as a dict without its tag (and, `many`, in a list beside one with it)."""
    return typing.cast(Tagged, [{"v": 1}, {"type": "Tagged", "v": 2}] if many else {"v": 1})


@registry.method
def unique() -> set[int]:
    """A list with repeats where a set is declared."""
    return typing.cast(set[int], [1, 1, 2])


@registry.method
def whole(value: float) -> int:
    """`value` as it is: a float where an int is declared (new user, round 118, F2)."""
    return typing.cast(int, value)


class Kept(enum.IntFlag):
    """An IntFlag: its boundary, KEEP, takes bits it has no member for."""

    A = 1
    B = 2


@registry.method
def kept(value: int) -> list[Kept]:
    """`value` as a Kept (hostile testing, round 142, F3: 4 passed the check, and the SDK refused
    it, "4 is not one of [0, 1, 2, 3]"; the check refuses bits of no member, as for params)."""
    return [Kept(value)]


@registry.method
def keyed(key: str) -> list[dict[int, str]]:
    """A dict whose key is `key`: an integer's text, or not."""
    return [{typing.cast(int, key): "a"}]


Wide = enum.IntFlag("Wide", {f"W{i}": 1 << i for i in range(24)})  # (a member for each of 24 bits)


@registry.method
def wide_values(values: list[int]) -> list[Wide]:  # type: ignore[valid-type]
    """`values` as they are: the check of the result makes a Wide of each (hostile testing, round
    142, F4: made for good, 49 to 300 MiB over 6 calls)."""
    return typing.cast(list[Wide], values)  # type: ignore[valid-type]


@registry.method
def wide_made() -> int:
    """How many Wide members this worker holds, made or its own."""
    return len(Wide._value2member_map_)


@registry.method
def as_set(values: list[int]) -> set[int]:
    """`values` as they are, declared a set (hostile testing, round 142, F9: integers of one hash
    held the check's decoding 15 s)."""
    return typing.cast(set[int], values)
