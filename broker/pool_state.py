"""The pool's state as the modules of its reload's, recycling's and restarts' methods see it (`PoolState`), for the type checker.

`pool.Pool` holds the state (its `__init__` makes every attribute below) and inherits the
methods of broker/reloads.py, broker/recycling.py and broker/restarts.py (mixins with no
state of their own). Those mixins subclass `PoolState`, which declares what they read of
the pool's attributes and methods; at run time it is an empty class.
"""

from __future__ import annotations

import asyncio
import typing

if typing.TYPE_CHECKING:
    from broker.channel import Worker
    from broker.dispatch import Dispatcher
    from broker.recycling import Recycle
    from broker.wire import MethodInfo

__all__ = ["PoolState"]


class PoolState:
    """What `pool.Pool`'s mixins (`reloads.Reloads`, `recycling.Recycling`, `restarts.Restarts`) read of its state and methods."""

    if typing.TYPE_CHECKING:
        _awaiting_reload: set[Worker]
        _changed: asyncio.Event
        _recycle_failures_in_row: dict[int, int]
        _recycle_hold: dict[int, float]
        _recycle_timer: asyncio.TimerHandle | None
        _incoming_error: str
        _incoming_methods: list[str] | None
        _incoming_sync: list[str]
        _incoming_infos: list[MethodInfo]
        _first_rss: dict[int, bool]
        _path: str
        _reload_task: asyncio.Task[None] | None
        _reload_wanted: bool
        _reloading: bool
        _starting: bool
        _stopping: bool
        _winding_down: bool
        after_reload: typing.Callable[[], None] | None
        boot_timeout: float
        calls_elsewhere: typing.Callable[[int], int]
        dispatcher: Dispatcher
        incoming: list[Worker]
        loop: asyncio.AbstractEventLoop
        max_calls_jitter: int
        max_calls_per_worker: int
        max_worker_memory: int
        methods: list[str] | None
        recycle_failures: int
        recycles: dict[str, int]
        on_reload: typing.Callable[[bool | None, str], None] | None
        reload_failure: str
        reloads: dict[str, int]
        restart_backoff_max: float
        restarts_by_reason: dict[str, int]
        replacements: dict[int, Recycle]
        retiring: set[Worker]
        size: int
        sync_methods: list[str]
        workers: list[Worker]

        def _baseline(self, worker: Worker) -> None: ...
        def _beside(self, worker: Worker) -> None: ...
        def _count_restart(self, why: str) -> None: ...
        def _drop_recycles(self, why: str) -> None: ...
        async def _launch(self, worker: Worker) -> None: ...
        def _prepare(self, worker: Worker) -> bool: ...
        def _retire_by(self, worker: Worker) -> None: ...
        async def _spawn(self, worker: Worker) -> None: ...
        def request_reload(self) -> None: ...
