"""Tools whose results break (or keep) their return types below the top: the outputSchema the
host is given says what they must be (tests/test_mcp_results.py; hostile testing, round 131)."""

import typing

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
