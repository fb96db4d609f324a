"""A test app whose results change while the worker encodes them (hostile testing, round
23): `table()` returns a list holding an object whose `tolist()` empties that list, and
`snapshot()` a list of sets that a background thread of the tool refreshes all the time.
Each crashed the worker (SIGSEGV in orjson, reading freed memory)."""

import os
import threading

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


@registry.method
def snapshot() -> list[set[int]]:
    return CACHE


@registry.method
def pid() -> int:
    return os.getpid()
