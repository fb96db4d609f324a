"""A test app defining Enum classes orjson cannot be trusted with (hostile testing, round
31: orjson read a member's `value` mid-walk, and one that raised or was the member itself
crashed the worker, SIGSEGV), and handlers returning their members."""

import enum
import os

from broker.worker import Registry

registry = Registry()


class Itself(enum.Enum):
    """A member whose value is the member itself (set by its own `__new__`)."""

    A = 1

    def __new__(cls, number: int) -> "Itself":
        member = object.__new__(cls)
        member._value_ = member
        return member


class Raising(enum.Enum):
    """A member whose `value` raises."""

    A = 1

    @property
    def value(self) -> object:
        raise RuntimeError("no value here")


class Plain(enum.Enum):
    """A member orjson writes as its value, 7."""

    A = 7


@registry.method
def pid() -> int:
    return os.getpid()


@registry.method
def itself() -> object:
    return [Itself.A]


@registry.method
def raising() -> object:
    return {"member": Raising.A}


@registry.method
def plain() -> object:
    return {"member": Plain.A, "list": [1, 2, 3]}
