"""An NDJSON connection's state as the modules of its methods see it (`StreamState`), for the type checker.

`stream.StreamProtocol` holds the state (its `__slots__`, made by its `__init__`) and inherits
the methods of broker/frontend/streamclose.py (`Closing`: its refusals, the drain at the stop
and its close), a mixin with no state of its own. It subclasses `StreamState`, which declares
what it reads of the connection and of the connection's methods, once; at run time it is an
empty class, with empty `__slots__` (so that the connection keeps no `__dict__`), as
broker/frontend/httpstate.py is for HTTP.
"""

from __future__ import annotations

import typing

from broker.frontend.connection import Connection

if typing.TYPE_CHECKING:
    import asyncio
    from collections import deque

    from broker.frontend.stream import StreamFrontend

__all__ = ["StreamState"]


class StreamState(Connection):
    """What `stream.StreamProtocol`'s mixin reads of its state and of its methods."""

    if typing.TYPE_CHECKING:
        _backlog: bytes
        _buffer: bytearray
        _eof: bool
        _fe: StreamFrontend
        _incoming: int
        _refused: bool
        _skipping: bool
        _transport: asyncio.Transport | None
        _turn_bytes: int
        _unread: int
        _waiting: deque[bytes]
        accepted_at: float
        last_active: float
        line_started: float
        lines: int
        lingering_since: float
        owed: int
        read_paused: bool
        send_stalled: float

        # stream.StreamProtocol's
        def _lines(self, data: bytes) -> None: ...
        def _send(self, data: bytes) -> None: ...
    else:
        # (At run time only: to mypy, a class whose bases all declare `__slots__` may assign
        # no attribute but theirs, and the mixin's attributes are `StreamProtocol`'s slots.)
        __slots__ = ()
