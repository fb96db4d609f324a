"""A call on its way through the broker, sans-IO: `Call`, `Route`, `CallState` and its `TRANSITIONS`.

`Call` is one request, notification or batch chunk; `Route`, where a method's calls go. Here
too is what the dispatcher does to a call besides routing it: what it holds while queued
(`held_bytes`, `hold`), what it costs in the queue (`queue_cost`), and the -32001 error
objects of one whose deadline passed (`timed_out`, `as_timed_out`). broker/dispatch.py
moves calls; this module says what one is.
"""

from __future__ import annotations

import enum
import typing

import msgspec
from msgspec import Raw

from broker.answers import Exchange, ResponseBudget
from broker.chunk import encode_requests
from broker.jsonrpc import ErrorCode, Request, error_object
from broker.wire import CALL, CANCEL_ACK, CANCEL_ACK_RAN, CHUNK, NOTIFY

if typing.TYPE_CHECKING:
    from broker.channel import Worker

__all__ = [
    "ACKS", "NO_ID", "TRANSITIONS", "Call", "CallState", "Route", "as_timed_out", "held_bytes", "hold", "live",
    "owed", "queue_cost", "timed_out",
]  # fmt: skip

NO_ID = Raw()  # the raw id of a chunk, or of a queued call's shell once expired


def held_bytes(call: Call) -> int:
    """Bytes `call` would hold while queued: its raw params and client id(s)."""
    if call.ids is None:
        return len(call.params) + len(call.id)
    return len(call.params) + sum(map(len, call.ids))


def hold(call: Call) -> None:
    """Copy what a call about to be queued keeps of its request body (raw id and
    params: `msgspec.Raw` views into the whole body, which they would keep alive) and
    record the bytes it holds in `call.held`. (A chunk's params are its own already.)"""
    if call.ids is None:
        call.id = call.id.copy()
        params = call.params
        if type(params) is Raw:
            call.params = params.copy()
    else:
        call.ids = [id_.copy() for id_ in call.ids]
    call.held = held_bytes(call)


class Route(typing.NamedTuple):
    """Where a method's calls go: its index in the workers' method list, deadline (s),
    and `sync`: 1 for a sync handler that blocks its worker (see BLOCKING_US), -1 for
    a sync handler measured fast (its calls' times are watched), 0 for an async one."""

    method_index: int
    timeout: float
    sync: int = 0


class Call(msgspec.Struct, eq=False):
    """One call (or notification, or chunk of a batch) on its way through the broker.

    Made with `Call.of` (one request) or `Call.chunk` (several calls of one batch).
    eq=False: calls compare and hash by identity (they are keys of the deadline wheel).
    """

    call_id: int  # the broker's own id on the wire
    exchange: Exchange | None  # None for a notification, or once answered
    slot: int  # its answer's place in the exchange (-1: none)
    id: Raw  # the client's raw id
    kind: int  # wire.Kind of its frame: CALL, NOTIFY or CHUNK
    index: int  # method index (a chunk: its number of entries)
    params: Raw | bytes  # raw params (a chunk: its CALL_ENTRY payload)
    timeout: float  # seconds
    arrival: float  # when the call arrived (time.perf_counter)
    sync: int  # > 0: blocking sync calls it holds (a chunk: their count); -1: see Route.sync
    owner: ResponseBudget  # its connection's: its flow in the queue, and whose places it holds in flight
    worker: Worker | None = None
    tick: int = 0  # its slot in the DeadlineWheel; 0 once expired or answered
    weight: int = 1  # calls it stands for (a chunk: several; once sent, those not answered yet)
    slots: list[int] | None = None  # a chunk's answer slots (-1: notification)
    ids: list[Raw] | None = None  # a chunk's raw client ids
    methods: list[int] | None = None  # a chunk's method indexes
    stride: int = 0  # a chunk's slots are slots[0] + stride * k, k = 0, 1...: its answers fill them at once (0: not so)
    held: int = 0  # bytes it holds while queued (counted in max_queue_bytes)
    heavy: int = 0  # its params' bytes counted in its worker's `heavy` (large params only, `_send`)
    stale: bool = False  # in flight when a reload replaced the method table: its reply teaches nothing
    kept: bytes | int | None = None  # its params kept for the access log once sent (log_params: `accesslog.keep_params`)
    again: bool = False  # given back unstarted and queued again: its wait was observed once (`_requeue`)

    @classmethod
    def of(
        cls, call_id: int, exchange: Exchange | None, slot: int, request: Request, route: Route, arrival: float,
        owner: ResponseBudget,
    ) -> Call:
        """One request (a call, or a notification when `exchange` is None) of the connection
        whose budget is `owner`."""
        return cls(
            call_id, exchange, slot, request.id, CALL if exchange is not None else NOTIFY,
            route.method_index, request.params, route.timeout, arrival, route.sync, owner,
        )  # fmt: skip

    @classmethod
    def chunk(
        cls,
        call_id: int,
        exchange: Exchange,
        entries: list[tuple[int, Request, Route]],
        timeout: float,
        arrival: float,
        sync: bool = False,
        stride: int = 0,
    ) -> Call:
        """Several calls of one batch as one unit (see wire.Kind.CHUNK): one frame,
        one deadline (they share `timeout`), one reply. `sync`: they are all blocking
        sync calls (`Route.sync`; a chunk never mixes them with others). `stride`: its
        entries' slots are evenly spaced by it (0: not so, or unknown). Its connection's
        budget is `exchange.budget`."""
        payload, slots, ids, methods = encode_requests(entries)
        return cls(
            call_id,
            exchange if slots.count(-1) < len(slots) else None,
            -1,
            NO_ID,
            CHUNK,
            len(entries),
            payload,
            timeout,
            arrival,
            len(entries) if sync else 0,
            exchange.budget,
            weight=len(entries),
            slots=slots,
            ids=ids,
            methods=methods,
            stride=stride,
        )


class CallState(enum.Enum):
    """Where a `Call` is on its way, as `Dispatcher.state_of` reads it from where the
    dispatcher holds it (the queue, the pending table) and its deadline (`Call.tick`,
    0 once the call is answered or expired): the hot path keeps no field for it.
    `TRANSITIONS` says which state may follow which (h11's `_state.py` has the same
    idea for HTTP/1.1); the dispatcher's state machine test holds every call to it."""

    QUEUED = "queued"  # waiting in the queue for a worker under its limit; its deadline runs
    IN_FLIGHT = "in flight"  # sent to a worker (in the pending table); its answer, if owed, not made yet;
    # queued again if the worker gives it back unstarted (wire.RETURN)
    ANSWERED_IN_QUEUE = "answered in queue"  # its deadline passed while queued: answered -32001,
    # its empty shell still in the deque (`_compact`)
    ANSWERED_AWAITING_WORKER = "answered awaiting worker"  # its deadline passed in flight: answered
    # -32001 and CANCEL sent; still pending, so its worker's count stays exact, until the
    # worker's late reply (or CANCEL_ACK) comes, or the worker is lost
    ENDED = "ended"  # in neither the queue nor the pending table: answered (or shed, or a
    # notification done) and forgotten


TRANSITIONS: dict[CallState, frozenset[CallState]] = {
    CallState.QUEUED: frozenset({CallState.IN_FLIGHT, CallState.ANSWERED_IN_QUEUE, CallState.ENDED}),
    CallState.IN_FLIGHT: frozenset({CallState.QUEUED, CallState.ANSWERED_AWAITING_WORKER, CallState.ENDED}),
    CallState.ANSWERED_IN_QUEUE: frozenset({CallState.ENDED}),
    CallState.ANSWERED_AWAITING_WORKER: frozenset({CallState.ENDED}),
    CallState.ENDED: frozenset(),
}
"""The states that may directly follow each (`CallState`): QUEUED goes IN_FLIGHT when a
worker takes it (`_pump`), ANSWERED_IN_QUEUE at its deadline, or ENDED (no worker coming,
the grace period over); IN_FLIGHT goes ENDED at its reply or its worker's loss, or
ANSWERED_AWAITING_WORKER at its deadline, or QUEUED again when its worker gives it back
unstarted (wire.RETURN: its method turned out slow there); the answered states end when the
queue drops the shell, or the worker replies or is lost. A call starts QUEUED, IN_FLIGHT, or
ENDED at once (shed "overloaded", no worker coming, shutting down; a notification's reply);
the calls a worker gives back from the middle of a chunk start QUEUED, a chunk of their own.
An answered call is never sent again, nor queued."""


def queue_cost(call: Call) -> int:
    """What taking `call` out of the queue costs its connection (`FairQueue`): the calls it
    stands for; nothing for an expired one's shell."""
    return call.weight if call.tick else 0


def owed(call: Call) -> bool:
    """Whether `call` is owed an answer still (a call or a chunk of calls, not answered;
    notifications and answered calls have no exchange)."""
    return call.exchange is not None


def live(call: Call) -> bool:
    return call.tick != 0


def timed_out(call: Call, started: bool = True) -> bytes:
    """The error object of a call whose deadline passed: -32001 with its timeout, and
    `"started": false` if it is known never to have reached its handler (it waited in the
    queue, for a worker or its connection's share, or its worker found the deadline passed
    before it started it): the client may retry it knowing that it did not run (the new
    user of round 60 could not tell a call that never started from a tool that ran too
    long). Else it may have run, or be running still: it was told to cancel."""
    if started:
        return error_object(ErrorCode.TIMED_OUT, data={"timeout_seconds": call.timeout})
    return error_object(ErrorCode.TIMED_OUT, data={"timeout_seconds": call.timeout, "started": False})


ACKS = (CANCEL_ACK, CANCEL_ACK_RAN)  # a worker's acknowledgements of a cancel (or of a deadline)


def as_timed_out(error: bytes | memoryview, call: Call) -> bytes | memoryview:
    """A worker's error object for a call not answered yet, `CANCEL_ACK` as -32001 with
    the call's timeout: the worker found its deadline passed before it started it (the
    deadline in its frame), and answered before the broker's timer fired (the same one,
    1 ms early at most); the client gets what that timer would have given it, and
    `"started": false`. `CANCEL_ACK_RAN` likewise, but its handler ran: not that."""
    if error == CANCEL_ACK:
        return timed_out(call, False)
    return timed_out(call) if error == CANCEL_ACK_RAN else error
