"""The pool's state as the module of its reload's methods sees it (`PoolState`), for the type checker.

`pool.Pool` holds the state (its `__init__` makes every attribute below) and inherits the
methods of broker/reloads.py (a mixin with no state of its own). That mixin subclasses
`PoolState`, which declares what it reads of the pool's attributes and methods; at run
time it is an empty class.
"""

from __future__ import annotations

import asyncio
import typing

if typing.TYPE_CHECKING:
    from broker.channel import Worker
    from broker.dispatch import Dispatcher

__all__ = ["PoolState"]


class PoolState:
    """What `pool.Pool`'s mixin (`reloads.Reloads`) reads of its state and methods."""

    if typing.TYPE_CHECKING:
        _awaiting_reload: set[Worker]
        _changed: asyncio.Event
        _incoming_error: str
        _incoming_methods: list[str] | None
        _incoming_sync: list[str]
        _reload_task: asyncio.Task[None] | None
        _reload_wanted: bool
        _reloading: bool
        _starting: bool
        _stopping: bool
        _winding_down: bool
        after_reload: typing.Callable[[], None] | None
        boot_timeout: float
        dispatcher: Dispatcher
        incoming: list[Worker]
        loop: asyncio.AbstractEventLoop
        methods: list[str] | None
        reloads: dict[str, int]
        retiring: set[Worker]
        size: int
        sync_methods: list[str]
        workers: list[Worker]

        def _beside(self, worker: Worker) -> None: ...
        def _count_restart(self, why: str) -> None: ...
        async def _launch(self, worker: Worker) -> None: ...
        def _prepare(self, worker: Worker) -> bool: ...
        def _retire_by(self, worker: Worker) -> None: ...
        async def _spawn(self, worker: Worker) -> None: ...
