"""A test app whose handlers write to the worker's stdout and stderr themselves: a print,
a write with no newline (what the broker's reading of the workers' output must take whole)."""

import sys

from broker.worker import Registry

registry = Registry()


@registry.method
def say(text: str) -> bool:
    """print(text): to the worker's stdout."""
    print(text)
    return True


@registry.method
def mutter(text: str) -> bool:
    """`text` to the worker's stderr, no newline after it."""
    sys.stderr.write(text)
    sys.stderr.flush()
    return True


@registry.method
def fail(text: str) -> None:
    """Raise ValueError(text): the worker logs it, the client's text in its message."""
    raise ValueError(text)
