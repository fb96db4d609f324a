"""A test app whose results change while the worker encodes them (hostile testing, round
23): `table()` returns a list holding an object whose `tolist()` empties that list, and
`snapshot()` a list of sets that a background thread of the tool refreshes all the time.
Each crashed the worker (SIGSEGV in orjson, reading freed memory)."""

import dataclasses
import datetime
import os
import threading
import typing

from broker.worker import Registry

registry = Registry()
CACHE = [{i, i + 1} for i in range(200)]  # (sets: not JSON natively)


def _refresh() -> None:
    while True:  # a tool's background refresher (a daemon thread: it ends with the worker)
        CACHE.clear()
        CACHE.extend({i, i + 1} for i in range(200))


threading.Thread(target=_refresh, daemon=True).start()


class Column:
    """A column that drops its owner's rows once read."""

    def __init__(self, rows: list[object]) -> None:
        self.rows = rows

    def tolist(self) -> list[int]:
        self.rows.clear()
        return [1]


@registry.method
def table() -> list[object]:
    rows: list[object] = []
    rows.append(Column(rows))
    rows.extend([[i] * 3 for i in range(100)])
    return rows


class Clearing(datetime.tzinfo):
    """A time zone whose utcoffset() empties a list (the one its datetime sits in)."""

    def __init__(self, rows: list[object]) -> None:
        self.rows = rows

    def utcoffset(self, dt: datetime.datetime | None) -> datetime.timedelta:
        self.rows.clear()
        return datetime.timedelta(0)


@dataclasses.dataclass
class Touchy:
    """A dataclass whose field reads empty a list (the one it sits in)."""

    _rows: list[object]  # (a leading underscore: not written, as orjson leaves it out)
    a: int = 1

    def __getattribute__(self, name: str) -> object:
        if name == "a":
            object.__getattribute__(self, "_rows").clear()
        return object.__getattribute__(self, name)


@registry.method
def zoned() -> list[object]:
    """Round 24: orjson ran a tzinfo's utcoffset() while walking the list."""
    rows: list[object] = []
    rows.append(datetime.datetime(2020, 1, 1, tzinfo=Clearing(rows)))
    rows.extend([[i] * 3 for i in range(100)])
    return rows


@registry.method
def touchy() -> list[object]:
    """Round 24: orjson read a dataclass's fields through its __getattribute__."""
    rows: list[object] = []
    rows.append(Touchy(rows))
    rows.extend([[i] * 3 for i in range(100)])
    return rows


@registry.method
def keyed() -> dict[object, object]:
    """Round 25: a datetime key's tzinfo ran as orjson walked the dict (it emptied it)."""
    rows: dict[object, object] = {}
    rows[datetime.datetime(2020, 1, 1, tzinfo=Clearing([]))] = 1
    rows.update({f"k{i}": [i] * 3 for i in range(100)})
    key = next(iter(rows))
    key.tzinfo.rows = rows  # type: ignore[union-attr]
    return rows


def _zoned_rows(rows: list[object]) -> list[object]:
    rows.append(datetime.datetime(2020, 1, 1, tzinfo=Clearing(rows)))
    rows.extend([[i] * 3 for i in range(100)])
    return rows


@registry.method
def boxed() -> object:
    """Round 27: a 0-d numpy array of objects holding such a list was unwrapped and the
    list given to orjson, which ran the tzinfo as it walked it."""
    import numpy as np

    box = np.empty((), dtype=object)
    box[()] = _zoned_rows([])
    return [box, 2**70]


class HashableList(list):  # type: ignore[type-arg]
    def __hash__(self) -> int:  # type: ignore[override]
        return 1


@registry.method
def list_keyed() -> dict[object, object]:
    """Round 27: a dict key that is a hashable list subclass, walked by orjson as a key."""
    return {typing.cast(typing.Hashable, _zoned_rows(HashableList())): 1}


@registry.method
def snapshot() -> list[set[int]]:
    return CACHE


@registry.method
def pid() -> int:
    return os.getpid()
