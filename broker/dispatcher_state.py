"""The dispatcher's state as the modules of its methods see it (`DispatcherState`), for the type checker.

`dispatch.Dispatcher` holds the state (its `__init__` makes every attribute below) and
inherits the methods of broker/intake.py, broker/membership.py, broker/queueing.py,
broker/routing.py, broker/replies.py, broker/returns.py and broker/draining.py (mixins with no
state of their own). They subclass `DispatcherState`, which declares what they read of one
another's, once; at run time it is an empty class.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import typing
from collections import OrderedDict

if typing.TYPE_CHECKING:
    from msgspec import Raw

    from broker.accesslog import AccessLog
    from broker.answers import Exchange, ResponseBudget
    from broker.calls import Call, Route
    from broker.catalog import Catalog
    from broker.channel import Worker
    from broker.deadlines import DeadlineWheel
    from broker.fairqueue import FairQueue, Largest
    from broker.isolation import Isolation
    from broker.jsonrpc import Body, Request
    from broker.membership import MembershipTap
    from broker.metrics import CallMetrics
    from broker.policy import Policy
    from broker.ratelimit import Limiter

__all__ = ["DispatcherState"]


class DispatcherState:
    """What `dispatch.Dispatcher`'s mixins read of its state and of one another's methods."""

    if typing.TYPE_CHECKING:
        _alone: dict[Worker, bool]
        catalog: Catalog
        membership_tap: MembershipTap | None
        on_struck: typing.Callable[[list[str], bool, int], None] | None
        _struck_for: collections.OrderedDict[int, set[int]]
        shared_workers: bool
        _alone_held: bool
        _unstarted: dict[int, Raw | bytes]
        _blocked: int
        _blocking: list[int]
        _cancel_grace: float
        _chunk_max: int
        _connection_share: float
        _deadlines: DeadlineWheel
        _down_since: float
        _expired_queued: int
        _heavy_bytes: int
        _heavy_cap: int
        _heavy_share: int
        _held_workers: set[Worker]
        _ids: itertools.count[int]
        _isolation: Isolation
        _isolation_handle: asyncio.TimerHandle | None
        _largest: Largest[ResponseBudget]
        _loop: asyncio.AbstractEventLoop
        _max_queue: int
        _max_queue_bytes: int
        _method_timeouts: dict[str, float]
        _names: list[str]
        _one_timeout: bool
        _overdue: int
        _pending: dict[int, Call]
        _queue: FairQueue[Call]
        _queued_bytes: int
        _queued_calls: int
        _ready: list[Worker]
        _releasing: set[ResponseBudget]
        _reserved: Worker | None
        _reserved_for: ResponseBudget | None
        _left_kept: Worker | None
        _left_for: Call | None
        _returnable: int
        _room_heap: list[tuple[int, int, ResponseBudget]]
        _room_order: itertools.count[int]
        _room_waiters: OrderedDict[ResponseBudget, None]
        _roomless: int
        _joined: bool
        _rotation: int
        _routes: dict[str, Route]
        policy: Policy
        limiter: Limiter
        _share: int
        _share_waiters: dict[ResponseBudget, None]
        _start_failed: bool
        _sync_limit: int
        _sync_routing: bool
        _sync_share: int
        _sync_us: list[int]
        _timeout: float
        _too_large: bytes
        _too_much: bytes
        abandoned_total: dict[str, int]
        accepting: bool
        cut_off: int
        held_back: typing.Callable[[], int]
        _draining: bool
        _idle: asyncio.Event
        _serving: bool
        _shed_notes: int
        _shed_since: float
        _shed_timer: asyncio.TimerHandle | None
        _shed_unlogged: int
        late_cancelled_total: int
        late_results_total: int
        max_response_bytes: int
        metrics: CallMetrics | None
        access: AccessLog | None
        access_ok: AccessLog | None
        notifications_dropped: dict[int, int]
        oversize_total: int
        returned_total: int

        def _check_hung(self, call: Call) -> None: ...
        def _dequeue(self) -> Call: ...
        def _discover(self, request: Request, exchange: Exchange, size: int) -> bytes: ...
        def _log_shed(self, last: bool = False) -> None: ...
        def _not_overdue(self, worker: Worker, call_id: int) -> None: ...
        def submit(self, body: Body, on_done: typing.Callable[[Exchange], None],
                   budget: ResponseBudget | None = None) -> Exchange | None: ...
        def _check_idle(self) -> None: ...
        def _count_error(self, call: Call, index: int, code: int, latency: float, place: int = -1) -> None: ...
        def _finish(self, call: Call, error: bytes, code: int, remaining: bool = True) -> None: ...
        def _give_back(self, owner: ResponseBudget) -> None: ...
        def _isolation_ends(self) -> None: ...
        def _isolation_timer(self) -> None: ...
        def _pick(self, call: Call) -> Worker | None: ...
        def worker_held(self, worker: Worker, hold: int) -> None: ...
        def worker_blocked(self, worker: Worker, call_id: int, blocked: int, payload: bytes) -> None: ...
        def _pick_alone(self, call: Call) -> Worker | None: ...
        def _pump(self) -> None: ...
        def _push_waiter(self, owner: ResponseBudget) -> None: ...
        def _release_all(self) -> None: ...
        def _release_for_room(self) -> None: ...
        def _reserve(self, owner: ResponseBudget, promised: typing.Collection[Worker] = ()) -> Worker | None: ...
        def _requeue(self, calls: list[Call], aside: int = 0) -> None: ...
        def _reserved_idle(self, worker: Worker) -> None: ...
        def _returned(self, worker: Worker, call_id: int, place: int, payload: bytes) -> None: ...
        def _send(self, worker: Worker, call: Call) -> None: ...
        def _start(self, call: Call, now: float) -> None: ...
        def _unheavy(self, worker: Worker, call: Call) -> None: ...
        def _unreserve(self) -> bool: ...
        def worker_restarting(self) -> bool: ...
