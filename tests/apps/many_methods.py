"""A test app with a generated method table: $MANY_METHODS methods m0, m1, ... (default
10), each with a docstring of $MANY_METHODS_DOC characters (default 0), to test the
limits on what one worker serves (the method count, the HELLO's size). With
$MANY_METHODS_RAW=1 they take raw params: registered three times as fast (65,536 in 6 s)."""

import os

from broker.worker import Registry

registry = Registry()
_DOC = "d" * int(os.environ.get("MANY_METHODS_DOC", "0"))
_RAW = os.environ.get("MANY_METHODS_RAW") == "1"


def _make(i: int) -> None:
    def method(x: int = 0) -> int:
        return x + i

    method.__name__ = f"m{i}"
    method.__doc__ = _DOC
    registry.method(name=method.__name__, raw_params=_RAW)(method)


for _i in range(int(os.environ.get("MANY_METHODS", "10"))):
    _make(_i)
