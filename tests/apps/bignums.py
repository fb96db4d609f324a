"""Methods given numbers that msgspec's JSON parser reads slowly (`1e308`: broker/worker/slow_numbers.py;
hostile testing, round 136, F2) and a Struct that counts how often binding builds it."""

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
def counted(first: Counted, tag: str, n: int = 0) -> str:
    return tag


@registry.method
def made() -> int:
    """How many `Counted` binding has built in this worker so far."""
    return len(MADE)
