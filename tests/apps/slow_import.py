"""An app whose import says it began (a file named by SLOW_IMPORT_MARK) and then takes
SLOW_IMPORT_SECONDS (tests/test_lifecycle.py: something to do while the broker waits for its
workers, with its ports bound but not yet listening)."""

import os
import pathlib
import time

from broker.worker import Registry

pathlib.Path(os.environ["SLOW_IMPORT_MARK"]).touch()
time.sleep(float(os.environ.get("SLOW_IMPORT_SECONDS", "2")))

registry = Registry()


@registry.method
def add(a: int, b: int) -> int:
    return a + b
