"""A test app whose Enum's `_missing_` makes members of unknown values and forgets their
`_value_` (hostile testing, round 33: msgspec calls `_missing_` as it decodes an Enum-typed
param, and orjson then read the missing value: SIGSEGV, from a client's input alone)."""

import asyncio
import enum
import os

from broker.worker import Registry

registry = Registry()


class Status(enum.Enum):
    OK = "ok"
    FAILED = "failed"

    @classmethod
    def _missing_(cls, value: object) -> "Status":
        member = object.__new__(cls)
        member._name_ = f"UNKNOWN_{value}".upper()
        return member  # (its _value_ never set)


@registry.method
def pid() -> int:
    return os.getpid()


@registry.method
async def nap(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


@registry.method
def echo_status(status: Status) -> dict[str, Status]:
    return {"status": status}
