"""A test app whose `spin` handler never returns: a sync loop that ignores CANCEL."""

import os
import time

from broker.worker import Registry

registry = Registry()


@registry.method
def spin(seconds: float) -> None:
    """Busy-waits `seconds` without yielding to the worker's event loop."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@registry.method
def pid() -> int:
    return os.getpid()
