"""Draining: the stop's grace period, the requests held back, and the answers cut off (`Draining`).

`dispatch.Dispatcher` inherits these methods (a mixin with no state of its own: the attributes
it reads are the dispatcher's, declared in broker/dispatcher_state.py for the type checker).
At a stop (SIGTERM) the broker takes no new call (`accepting` off) and waits up to the grace
period for the answers owed (`drain`): the calls queued and in flight, and the requests the
front-ends hold back (`held_back`: received but not dispatched yet, on a connection that fell
behind, or not even read yet), which are dispatched in their turn (`submit_held`) and served as
calls in flight are. Once nothing is owed, or the grace period ends, whatever is left is
answered -32004 "grace period ended" and cancelled in its worker, which the front-ends write
before they close; how many so is `cut_off`.
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Callable

from broker import wire
from broker.dispatcher_state import DispatcherState
from broker.jsonrpc import ErrorCode, error_object

if typing.TYPE_CHECKING:
    from broker.answers import Exchange, ResponseBudget
    from broker.calls import Call
    from broker.jsonrpc import Body

__all__ = ["Draining"]

_GRACE_ENDED = error_object(ErrorCode.SHUTTING_DOWN, data="grace period ended")


def _owed(call: Call) -> int:
    """The answers `call` still owes: 1, a chunk's calls not answered yet, or 0 (a
    notification, or its connection's answers given up)."""
    exchange = call.exchange
    if exchange is None:
        return 0
    if call.slots is None:
        return 1
    answers = exchange.answers
    return sum(1 for slot in call.slots if slot >= 0 and answers[slot] is None)


class Draining(DispatcherState):
    """`dispatch.Dispatcher`'s methods for the stop (see the module docstring)."""

    def _check_idle(self) -> None:
        if not self.accepting and not self._queued_calls and not self._pending and not self.held_back():
            self._idle.set()

    def check_idle(self) -> None:
        """A front-end's held-back requests changed while draining: is nothing owed now?"""
        self._check_idle()

    def submit_held(
        self, body: Body, on_done: Callable[[Exchange], None], budget: ResponseBudget | None = None
    ) -> Exchange | None:
        """`submit` for a request a front-end held back undispatched (`_waiting`: its
        client fell behind, or was owed max_response_bytes). It was received before it
        could be dispatched, so the drain serves it as it serves calls in flight: until
        the grace period ends, it is routed as before the drain (see `held_back`)."""
        if self.accepting or not self._draining:
            return self.submit(body, on_done, budget)
        self.accepting = True
        try:
            return self.submit(body, on_done, budget)
        finally:
            self.accepting = False

    async def drain(self, grace: float, hurry: asyncio.Event | None = None) -> None:
        """Stop taking calls; wait up to `grace` s (or until `hurry` is set) for the
        owed answers, requests the front-ends hold back (`held_back`, `submit_held`)
        included, then answer whatever is left with "shutting down"."""
        self.accepting = False
        self._draining = True
        self._check_idle()
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        self._draining = False
        # A request completed after this (a front-end's connection still open until
        # `Listener.wait_closed` ends it) is answered "shutting down", never run: its
        # answer could be cut off with its connection (hostile testing).
        self._serving = False
        error = _GRACE_ENDED
        self._release_all()
        while self._queue:
            call = self._dequeue()
            if call.tick:  # (else it timed out while queued: answered already)
                self.cut_off += _owed(call)
                self._finish(call, error, ErrorCode.SHUTTING_DOWN)
        for call in list(self._pending.values()):
            self.cut_off += _owed(call)
            self._finish(call, error, ErrorCode.SHUTTING_DOWN)
            # Cancel it on the worker too: a worker told BYE waits for its calls in
            # flight, so an uncancelled long call would hold up the stop.
            worker = call.worker
            if worker is not None and worker.channel is not None:
                worker.channel.send(wire.Kind.CANCEL, call.call_id, 0, b"")
        if self._shed_timer is not None:  # (what the last interval shed, said now: the broker is stopping;
            self._shed_timer.cancel()  # hostile testing, round 106: said at the drain's start, those shed
            self._log_shed(last=True)  # during the grace period were never logged)
        self._idle.set()
