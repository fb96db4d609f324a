"""Intake: a body's elements answered at once or routed, and a batch's calls dealt out in chunks (`Intake`).

`dispatch.Dispatcher` inherits these methods (a mixin with no state of its own: the
attributes it reads are the dispatcher's, declared in broker/dispatcher_state.py for the type
checker). `Dispatcher.submit` starts a lone call to a registered method itself (the common
case); any other body is walked here in order (`_entries`): an invalid element, a call past
its caller's rate limit, to a method that does not exist or its caller may not call, and
`rpc.discover` (broker/replies.py, `_discover`) are answered in their slots at once; each
routable request gets an empty slot (or none: a notification). A batch of more than two
routable requests, while a worker is ready and calls are taken, goes out in a few chunks,
about one per ready worker (`_start_chunks`), instead of one frame each.
"""

from __future__ import annotations

import typing

from broker.calls import Call
from broker.catalog import DISCOVER
from broker.dispatcher_state import DispatcherState
from broker.jsonrpc import ErrorCode, Request, error_object, response_error
from broker.replies import error_code

if typing.TYPE_CHECKING:
    from broker.answers import Exchange
    from broker.calls import Route
    from broker.jsonrpc import Body

__all__ = ["Intake"]

_METHOD_NOT_FOUND = error_object(ErrorCode.METHOD_NOT_FOUND)
_LIMITED = int(ErrorCode.RATE_LIMITED)  # notifications_dropped: past their caller's rate limit


class Intake(DispatcherState):
    """`dispatch.Dispatcher`'s side of a body taken in: `_entries`, `_start_chunks` (see the
    module docstring).

    (A mixin with no state of its own: what it reads of the dispatcher's is declared in
    `dispatcher_state.DispatcherState`.)
    """

    def _entries(self, body: Body, exchange: Exchange) -> list[tuple[int, Request, Route]]:
        """Walk a body in order: answers known at once (invalid elements, unknown
        methods, `rpc.discover`) go into their slots; each routable request gets an empty slot, or -1
        for a notification. Returns (slot, request, route) per routable request."""
        answers = exchange.answers
        answer = answers.append
        routes = self._routes
        denied = exchange.budget.denied  # (its caller's: answered as if absent, `policy`)
        metrics = self.metrics
        entries: list[tuple[int, Request, Route]] = []
        entry = entries.append
        size = 0  # bytes of the answers made here
        # Counted once per body, not per element (hostile testing, round 11: 1000 `{}` a
        # 3 KB body cost 1.6 µs each here, 0.6 µs in the metrics): the invalid elements'
        # answers by answer (most are the codec's few constants), the unknown methods.
        invalid_answers: dict[bytes, int] | None = None
        unknown_methods = unknown_notifications = 0
        bucket = exchange.budget.bucket  # (its caller's rate limit: a call past it is not run)
        for request in body.items:
            if type(request) is not Request:  # (a test mypy narrows by: no typing.cast, 50 ns, per element)
                invalid = typing.cast(bytes, request)  # an invalid element's answer
                answer(invalid)
                size += len(invalid)
                if invalid_answers is None:
                    invalid_answers = {}
                invalid_answers[invalid] = invalid_answers.get(invalid, 0) + 1
                if self.access is not None:
                    self.access.invalid(exchange.budget, invalid, error_code(invalid, ErrorCode.INVALID_REQUEST))
                continue
            if bucket is not None and not bucket.take():
                if request.id:
                    wait = bucket.retry_after()
                    limited = response_error(request.id, error_object(
                        ErrorCode.RATE_LIMITED, data={"retry_after_seconds": wait}))
                    answer(limited)
                    size += len(limited)
                    if not exchange.batch:
                        exchange.status = 429
                        exchange.retry_after = wait  # (its Retry-After: the same, rounded up)
                    if metrics is not None:  # (under its method, if its caller may call it: round 107)
                        route = routes.get(request.method)
                        metrics.answered(metrics.discover if request.method == DISCOVER else metrics.other
                                         if route is None or (denied and request.method in denied)
                                         else route.method_index, ErrorCode.RATE_LIMITED, 0.0)
                    if self.access is not None:
                        self.access.early(exchange.budget, request, ErrorCode.RATE_LIMITED)
                else:  # (counted as dropped: their only trace; new user, round 107)
                    self.notifications_dropped[_LIMITED] = self.notifications_dropped.get(_LIMITED, 0) + 1
                continue
            route = routes.get(request.method)
            if route is None or (denied and request.method in denied):
                if request.method == DISCOVER and not (denied and DISCOVER in denied):  # (`Replies._discover`)
                    if request.id:
                        discovered = self._discover(request, exchange, size)
                        answer(discovered)
                        size += len(discovered)
                    elif metrics is not None:
                        metrics.notifications[metrics.discover] += 1
                    continue
                if request.id:
                    unknown = response_error(request.id, _METHOD_NOT_FOUND)
                    answer(unknown)
                    size += len(unknown)
                    unknown_methods += 1
                    if self.access is not None:
                        self.access.early(exchange.budget, request, ErrorCode.METHOD_NOT_FOUND)
                else:
                    unknown_notifications += 1
            elif request.id:
                entry((len(answers), request, route))
                answer(None)
            else:
                entry((-1, request, route))
                if metrics is not None:
                    metrics.notifications[route.method_index] += 1
        if metrics is not None and (invalid_answers or unknown_methods or unknown_notifications):
            other = metrics.other
            if invalid_answers:
                for invalid, n in invalid_answers.items():
                    metrics.answered(other, error_code(invalid, ErrorCode.INVALID_REQUEST), 0.0, n)
            if unknown_methods:
                metrics.answered(other, ErrorCode.METHOD_NOT_FOUND, 0.0, unknown_methods)
            metrics.notifications[other] += unknown_notifications
        if size:  # (hostile testing, round 10: "Method not found" echoes its id, and 30
            # connections each owing a slow call, then pipelining calls of an unknown
            # method with 900 kB ids, held 400 MB counted nowhere)
            exchange.budget.keep(exchange, size)
        return entries

    def _start_chunks(
        self, entries: list[tuple[int, Request, Route]], exchange: Exchange, now: float, arrival: float
    ) -> None:
        """A batch's calls go out in a few chunks (about one per ready worker) instead
        of one frame each. Calls with different deadlines never share a chunk, nor
        do blocking sync calls and others, nor calls and notifications (a chunk of calls
        is cancelled whole when its connection is gone, `abandon`, and notifications run
        whatever); blocking sync calls go one by one (see `routing`'s module docstring), and so
        do the calls of an isolated method, each to run alone (`_pick_alone`)."""
        groups: dict[tuple[float, int, bool], list[tuple[int, Request, Route]]] = {}
        calls = exchange.answers.count(None)  # (the calls' empty slots: the others are notifications)
        isolation = self._isolation
        if not isolation.alone and self._one_timeout and 1 not in self._blocking and (calls == len(entries) or not calls):
            # (calls only, or notifications only: a chunk never mixes them, see `abandon`)
            groups[entries[0][2].timeout, 0, not calls] = entries
        else:
            for entry in entries:
                route = entry[2]
                alone = route.method_index in isolation.alone
                key = route.timeout, 2 if alone else int(route.sync > 0), entry[0] < 0
                group = groups.get(key)
                if group is None:
                    group = groups[key] = []
                group.append(entry)
        workers = len(self._ready)
        room = self._share - exchange.budget.in_flight  # (its connection's share left)
        for (timeout, sync, _notes), group in groups.items():
            n = len(group)
            # Its slots one after another (calls, and no other element between them): each
            # chunk's are evenly spaced, and its answers fill them at once (`_fill_results`)
            even = group[0][0] >= 0 and group[-1][0] - group[0][0] == n - 1
            chunks = min(workers, n)
            size = 0  # > 0: chunks of `size` calls in order, not dealt out
            if sync == 2 or (sync and self._sync_routing):  # slow sync calls, isolated methods: one by one
                chunks = n
            elif n > room:  # past its share: chunks of the size the share takes in turn, in
                # request order (dealt out, the calls that waited, and timed out, were spread
                # over the whole batch: round 57's new user)
                size = self._chunk_max
                chunks = -(-n // size)
            room -= n
            for first in range(chunks):
                # Dealt out like cards: neighbours in a batch are often alike (the
                # same slow method), so interleaving spreads them over the workers.
                part = group[first * size : first * size + size] if size else group[first::chunks]
                if len(part) == 1:
                    slot, request, route = part[0]
                    call = Call.of(next(self._ids), exchange if slot >= 0 else None, slot, request, route, arrival,
                                   exchange.budget)
                    exchange.remaining += slot >= 0
                else:
                    # A chunk goes to a worker below its limit like a call does, so it
                    # may overshoot the limit by its size; it queues and is shed as one
                    # unit.
                    call = Call.chunk(next(self._ids), exchange, part, timeout, arrival, bool(sync),
                                      (1 if size else chunks) if even else 0)
                    exchange.remaining += call.weight - call.slots.count(-1)  # type: ignore[union-attr]  # (no cast: 130 ns)
                self._start(call, now)
