"""Methods given numbers that msgspec's JSON parser reads slowly (`1e308`, `1.2345000000000000576e249`:
broker/floats.py; hostile testing, rounds 136 and 137), one per shape of parameter, and a
Struct that counts how often binding builds it."""

import decimal
import typing

import msgspec

from broker.worker import Registry

registry = Registry()
MADE: list[int] = []  # one per `Counted` built in this worker


class Counted(msgspec.Struct):
    x: int

    def __post_init__(self) -> None:
        MADE.append(self.x)


@registry.method
def mark(tag: str, crash: int = 0, sleep: float = 0.0) -> str:
    """The repro's shape: one `str`, then an int and a float with defaults."""
    return tag


@registry.method
def total(values: list[float]) -> float:
    return sum(values)


@registry.method
def spread(values: list[float]) -> list[float]:
    """How many, the least and the most (a sum of `1e308`s is inf)."""
    return [len(values), min(values), max(values)]


@registry.method
def counted(first: Counted, tag: str, n: int = 0) -> str:
    return tag


@registry.method
def made() -> int:
    """How many `Counted` binding has built in this worker so far."""
    return len(MADE)


@registry.method
def ints(values: list[int]) -> int:
    return sum(values)


@registry.method
def untyped(values):  # type: ignore[no-untyped-def]  # (no hints: decoded as they come)
    return values


@registry.method
def star(*values: float) -> float:
    return sum(values)


@registry.method
def fdict(m: dict[str, float]) -> float:
    return sum(m.values())


class Point(msgspec.Struct):
    x: float
    n: int = 0


@registry.method
def points(ps: list[Point]) -> float:
    return sum(p.x for p in ps)


@registry.method
def anything(v: typing.Any) -> str:
    return type(v).__name__


@registry.method
def priced(price: decimal.Decimal, values: list[float], extra: typing.Any = None) -> str:
    """A Decimal beside floats (hostile testing, round 139, F4: the floats were read by
    msgspec's typed decoder, 1 MiB of `1e308` 1.6 s)."""
    return f"{price} {len(values)} {type(extra).__name__}"


@registry.method
def wrapped(body: msgspec.Raw, values: list[float]) -> int:
    """A msgspec.Raw beside floats (round 139, F4, as `priced`)."""
    return len(bytes(body)) + len(values)


@registry.method
def kwpriced(price: decimal.Decimal, point: Point | None = None, **values: list[float]) -> int:
    """**kwargs beside a Decimal (hostile testing, round 140, F1: still read by msgspec's typed
    decoder, 1 MiB of `1e308` 1.6 s); a Struct that ignores unknown fields (F3)."""
    return len(values)


@registry.method
def weights(v: dict[float, int]) -> int:
    """Float keys (round 140, F2: read by msgspec's own reader, twice, 1 MiB of `1.5e300` 1.15 s)."""
    return len(v)


class DF(msgspec.Struct):
    d: decimal.Decimal
    f: float


@registry.method
def dfs(xs: list[DF]) -> int:
    """Floats inside a type that holds a Decimal too, decoded with it by msgspec's reader (hostile
    testing, round 140, F8: 1 MiB of `1e308` there held a worker 0.8-2.6 s)."""
    return len(xs)


@registry.method
def decimals(xs: list[decimal.Decimal]) -> int:
    """Decimals alone: msgspec reads `1e308` as one fast."""
    return len(xs)
