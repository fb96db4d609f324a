"""A test app whose Enum's `_missing_` makes members of unknown values and forgets their
`_value_` (hostile testing, round 33: msgspec calls `_missing_` as it decodes an Enum-typed
param, and orjson then read the missing value: SIGSEGV, from a client's input alone)."""

import enum

from broker.worker import Registry
from tests.apps.hostile import nap, pid

registry = Registry()
registry.method(pid)  # (the worker's pid, and an innocent call in flight on it)
registry.method(nap)


class Status(enum.Enum):
    OK = "ok"
    FAILED = "failed"

    @classmethod
    def _missing_(cls, value: object) -> "Status":
        member = object.__new__(cls)
        member._name_ = f"UNKNOWN_{value}".upper()
        return member  # (its _value_ never set)


@registry.method
def echo_status(status: Status) -> dict[str, Status]:
    return {"status": status}
