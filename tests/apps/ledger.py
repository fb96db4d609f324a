"""A test app whose one tool leaves a mark outside the broker: `record(mark)` appends
`mark` as a line to the file named by $LEDGER_FILE and returns how many lines it has.
A test reads the file to learn whether a call really ran (tests/test_cross_site.py)."""

import os

from broker.worker import Registry

registry = Registry()


@registry.method
def record(mark: str) -> int:
    with open(os.environ["LEDGER_FILE"], "a+", encoding="utf-8") as f:
        f.write(mark + "\n")
        f.seek(0)
        return len(f.read().splitlines())


@registry.method
def hold(seconds: float) -> float:
    """Block the worker (a sync call) for `seconds`."""
    import time

    time.sleep(seconds)
    return seconds
