"""An app whose `hold` holds the worker's loop until a file exists (tests/test_worker_links.py:
answers made before it must leave while it runs)."""

from __future__ import annotations

import os
import time

from broker.worker import Registry

registry = Registry()


@registry.method
def add(a: int, b: int) -> int:
    return a + b


@registry.method
def hold(path: str) -> str:
    """Hold the loop (a sync handler, sleeping in steps of 1 ms) until `path` exists; 30 s at most."""
    end = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.001)
    return "released"
