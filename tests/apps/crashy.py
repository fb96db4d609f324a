"""A test app whose `crash` handler kills its own worker process."""

import os

from broker.worker import Registry

registry = Registry()


@registry.method
def crash() -> None:
    """Exits the worker at once with status 1 (no reply is ever sent)."""
    os._exit(1)


@registry.method
def pid() -> int:
    return os.getpid()
