"""A test app whose worker speaks another version of the worker wire format, as one started
from rpc-broker code upgraded in place under a running broker would (tests/test_lifecycle.py):
the version in the file named by $OTHER_WIRE_FILE, read at import, if it exists."""

import os

from broker import wire
from broker.worker import Registry

if os.path.exists(os.environ.get("OTHER_WIRE_FILE", "")):
    with open(os.environ["OTHER_WIRE_FILE"]) as f:
        wire.VERSION = int(f.read())

registry = Registry()


@registry.method
def add(a: int, b: int) -> int:
    return a + b
