"""Replies: a worker's answers back to their calls (`Replies`), and the broker's own to `rpc.discover`.

`dispatch.Dispatcher` inherits these methods (a mixin with no state of its own: the
attributes it reads are the dispatcher's, declared below for the type checker). A worker's
frames reach `on_reply`: a RESULT or ERROR for one call, a CHUNK_PART or CHUNK_REPLY for a
batch chunk's calls (`_fill_chunk`), a CHUNK_RESULTS of a chunk's finished Response objects
(`_fill_results`), a RETURN of calls it gave back unstarted (`_returned`, broker/returns.py).

A worker's reply (`on_reply`) finds its call by id in the pending table, splices the
raw result or error object after the client's raw id, and fills the call's slot; the
exchange calls back when its last slot is filled. Answers from different workers
arrive in any order; the slots keep request order.

A call that timed out stays in the pending table (without its exchange) until its
worker replies, so the worker's outstanding count stays exact; that reply is then
dropped and counted as late: as `cancelled` when it is the worker's acknowledgement
of the CANCEL (`wire.CANCEL_ACK`), else as `result` (the handler finished after the
deadline, e.g. a sync handler that could not be interrupted). Notifications travel
the same way with no exchange (their late replies are not counted: none was owed).

`rpc.discover` (OpenRPC's service discovery, broker/catalog.py) is answered by the broker
itself as a body is walked (`_discover`, from `Dispatcher._entries`: only a method no worker
registered is looked up there, so the calls to registered ones pay nothing for it), with the
catalogue's document less the methods its caller may not call (`policy`): it tells no more of
what exists than a call would. It is a call as any other otherwise: after the caller's
authentication and rate limit, served to the callers allow_methods/deny_methods allow it to
(else -32601), counted in the metrics and the access log as method `rpc.discover`, and held
to max_response_bytes.
"""

from __future__ import annotations

import logging
import time
import typing
from collections import Counter

from msgspec import Raw

from broker.accesslog import results_of
from broker.answers import GONE, Exchange, Outgoing
from broker.calls import ACKS, Call, as_timed_out, timed_out
from broker.catalog import DISCOVER
from broker.chunk import answers as chunk_answers
from broker.chunk import count_answers, entries_of, results
from broker.dispatcher_state import DispatcherState
from broker.jsonrpc import (
    _RESP_HEAD,  # with _RESP_RESULT: response_result's pieces, for splicing inline
    ErrorCode,
    Request,
    error_object,
    http_status,
    response_error,
    response_result,
)
from broker.jsonrpc import _RESULT as _RESP_RESULT
from broker.routing import BLOCKING_US
from broker.wire import (
    AWAITED,
    BLOCKED,
    CANCEL_ACK,
    CANCEL_ACK_RAN,
    CHUNK_PART,
    CHUNK_REPLY,
    CHUNK_RESULTS,
    ERROR,
    HOLD,
    NOT_RUN,
    NOTIFY,
    REPLY_ENTRY,
    RESULT,
    RETURN,
    STARTS,
)

if typing.TYPE_CHECKING:
    from broker.channel import Worker

__all__ = ["Replies", "error_code"]

log = logging.getLogger("broker.dispatch")  # (the dispatcher's logger: these are its lines)

_EXPIRED = int(ErrorCode.TIMED_OUT)  # notifications_dropped: those their worker never started, their deadline passed
_SPLICE_BYTES = len(response_result(b"", b""))  # a result's answer's bytes besides its id and result
_ERROR_SPLICE_BYTES = len(response_error(b"", b""))  # an error's, besides its id and error object (1 fewer)
_TOO_LARGE_MARK = memoryview(b"")  # (_fill_chunk: an entry answered past max_response_bytes)
_VIEW_FROM = 4096  # (_fill_chunk: results from this many bytes are viewed, not copied, to be spliced)
_clock = time.perf_counter
_DISCOVER_PARAMS = error_object(ErrorCode.INVALID_PARAMS, data={"param": None, "reason": f"{DISCOVER} takes no params"})
_NO_PARAMS = (b"", b"[]", b"{}")
_BLANKS = b" \t\r\n"  # (JSON's whitespace: RFC 8259 section 2)
_MALFORMED = error_object(ErrorCode.INTERNAL_ERROR, data="the worker's answer was malformed")


def error_code(error: bytes, default: int = ErrorCode.INTERNAL_ERROR) -> int:
    """The code of an error object (a worker's, which encodes `code` first) or of the
    error in a whole Response object (the codec's answer to an invalid element);
    `default` if there is none to read. `jsonrpc.http_status` of it is the HTTP status of
    a single response (e.g. 400 for -32600 past max_depth; 200 for codes not in
    `jsonrpc.ERRORS`). (`"code":` cannot occur inside a JSON string: its quotes would be
    escaped; and an error's `data` comes after its `code`.)"""
    at = error.find(b'"code":')
    if at < 0:
        return default
    end = error.find(b",", at)
    try:
        return int(error[at + 7 : end])
    except ValueError:
        return default


def _mix(methods: list[int]) -> dict[int, int]:
    """{method index: calls} of a chunk; most chunks hold one method (counted in C)."""
    first = methods[0]
    if methods.count(first) == len(methods):
        return {first: len(methods)}
    return Counter(methods)


class Replies(DispatcherState):
    """`dispatch.Dispatcher`'s side of the answers: `on_reply` and what it needs (see the
    module docstring).

    (A mixin with no state of its own: what it reads of the dispatcher's is declared in
    `dispatcher_state.DispatcherState`.)
    """

    def on_reply(self, worker: Worker, kind: int, call_id: int, aux: int, payload: bytes) -> None:
        """A worker answered `call_id` with a RESULT or ERROR payload (raw JSON), or
        with (part of) a chunk's answers; `aux` is its service time in microseconds."""
        if kind >= CHUNK_PART:
            if kind == RETURN:
                self._returned(worker, call_id, aux, payload)
                return
            if kind == HOLD:
                if aux == STARTS:  # (a call sent ALONE starts: a death from now on may be its)
                    self._unstarted.pop(call_id, None)
                else:
                    self.worker_held(worker, aux)
                return
            if kind == BLOCKED:
                self.worker_blocked(worker, call_id, aux, payload)
                return
            # CHUNK_PART: some of a chunk's answers; the chunk stays pending
            part = self._pending.get(call_id)
            if part is not None and part.worker is worker:
                if part.exchange is not None:
                    self._fill_chunk(part, part.exchange, payload)
                elif not part.tick:  # its deadline passed: these answers come late
                    self._count_late(kind, payload, part)
                else:  # (notifications only, or its calls answered: its notifications may be unrun)
                    self._unrun(part, kind, payload)
                # The calls answered run no more: their capacity is the worker's again
                # (a chunk of 2 slow calls and 200 instant ones held 202 slots until the
                # slow ones ended), and queued calls start in it.
                done = min(count_answers(payload), part.weight)
                part.weight -= done
                slots = part.slots
                if slots is not None and -1 in slots:  # its notifications answered are marked done (-2):
                    for i, _kind, _start, _end in chunk_answers(payload):  # were its worker to die, they are
                        if i < len(slots) and slots[i] == -1:  # not counted lost (`worker_lost`)
                            slots[i] = -2
                worker.outstanding -= done
                part.owner.in_flight -= done
                if not part.weight:  # every call of it answered: it owes nothing more, whatever its final
                    part.exchange = None  # reply says (`abandon` passes over a connection with none in flight)
                if self._queued_calls:
                    self._give_back(part.owner)
                    self._pump()
            return
        call = self._pending.pop(call_id, None)
        if call is None or call.worker is not worker:  # not a call of this worker's
            if call is not None:
                self._pending[call_id] = call
            self._count_late(kind, payload, None)
            return
        worker.outstanding -= call.weight
        call.owner.in_flight -= call.weight
        if call.heavy:
            self._unheavy(worker, call)
        awaited = aux != NOT_RUN and aux >= AWAITED  # (wire.AWAITED: it blocked the worker for ~0 µs)
        if awaited:
            aux -= AWAITED
        sync = call.sync
        if sync:
            if sync > 0:
                worker.sync_calls -= sync
                call.owner.blocking -= sync
                if self._unstarted:  # (sent ALONE, answered: `worker_lost` has nothing to send again)
                    self._unstarted.pop(call_id, None)
                if not worker.sync_calls and worker.blocked:
                    worker.blocked = False
                    worker.limit = worker.concurrency
                    self._blocked -= 1
                    if self._alone and worker in self._alone:  # it ran a call alone
                        self._ran_alone(worker, call, kind, payload, aux)
                    if self._alone_held:  # (it may be reserved for one now)
                        self._release_all()
            # How long do its calls take? (BLOCKING_US; not from a reply whose handler never ran)
            if call.methods is None and not call.stale and aux != NOT_RUN:
                index = call.index
                est = self._sync_us[index]  # (-1: an async method's, a call run alone: `_pick_alone`)
                if (kind != ERROR or payload != CANCEL_ACK) and est >= 0:  # (a cancel took no time)
                    est += ((0 if awaited else aux) - est) >> 3
                    self._sync_us[index] = est
                    if (est >= BLOCKING_US) != self._blocking[index]:
                        self._reclassify(index, est)
        exchange = call.exchange
        metrics = self.metrics
        if metrics is not None:
            if aux == NOT_RUN:  # no handler ran: no service time
                pass
            elif call.methods is not None:  # a chunk: each call at the chunk's time over its size
                per_call = aux // len(call.methods)
                for index, n in _mix(call.methods).items():
                    metrics.service[index].observe_us(per_call, n)
            elif kind != RESULT or exchange is None:  # (results: in metrics.result below)
                metrics.service[call.index].observe_us(aux)
        if exchange is not None:
            self._deadlines.remove(call)
            if call.slots is not None:
                call.exchange = None
                if kind == CHUNK_RESULTS:
                    self._fill_results(call, exchange, payload)
                    if not call.stale and aux != NOT_RUN:
                        self._learn_chunk(call, 0 if awaited else aux)
                elif kind == CHUNK_REPLY:
                    self._fill_chunk(call, exchange, payload)
                    if not call.stale and aux != NOT_RUN:
                        self._learn_chunk(call, 0 if awaited else aux)
                else:  # one ERROR for the whole chunk
                    self._fail_chunk(call, exchange, typing.cast(bytes, as_timed_out(payload, call)), True)
            else:
                # The answer's size, counted before it is made: the answers owed on its
                # connection may not go past max_response_bytes (see ResponseBudget).
                size = len(payload) + len(call.id) + _SPLICE_BYTES
                budget = exchange.budget
                outgoing = budget.outgoing
                if budget.held + size <= self.max_response_bytes and kind == RESULT and (
                    outgoing.held + size <= outgoing.limit
                ):
                    budget.held += size
                    outgoing.held += size
                    exchange.size += size
                    if metrics is not None:
                        metrics.result(call.index, _clock() - call.arrival, aux)
                    if self.access_ok is not None:  # (access_log "all"; else, the one test a result pays)
                        self.access_ok.call(call, 0, _clock() - call.arrival)
                    # exchange.fill(call.slot, response_result(...)), inline: two calls less (0.1 µs)
                    exchange.answers[call.slot] = b"".join((_RESP_HEAD, call.id, _RESP_RESULT, payload, b"}"))
                    exchange.remaining -= 1
                    if not exchange.remaining:
                        exchange.on_done(exchange)
                elif outgoing is GONE:
                    self._gone(call, exchange, kind, payload, aux)
                elif kind == RESULT:  # (too large, unless its exchange is owed first: `_large_result`)
                    self._large_result(call, exchange, payload, size, aux)
                else:  # (an error's answer is a byte shorter, `"error":`: one filling the budget exactly was refused)
                    self._answer_error(call, exchange, payload, size - _SPLICE_BYTES + _ERROR_SPLICE_BYTES)
        elif call.tick:  # a notification (or a chunk of them, or one whose calls all answered in parts)
            self._deadlines.remove(call)
            if kind != RESULT:
                self._unrun(call, kind, payload)
        else:  # its deadline passed: the client has its answer already
            self._count_late(kind, payload, call)
            if worker.overdue:
                self._not_overdue(worker, call_id)
        if (self._alone or self._alone_held) and not worker.outstanding:  # (isolation: `_reserved_idle`)
            self._reserved_idle(worker)
        elif self._queued_calls:  # capacity was freed: fill all of it from the queue, in order
            self._give_back(call.owner)
            self._pump()
        elif not self.accepting:
            self._check_idle()

    def _ran_alone(self, worker: Worker, call: Call, kind: int, payload: bytes, aux: int) -> None:
        """`worker` answered the call it ran alone (`_pick_alone`): it is no longer spent on
        them, and if the handler ran, its method owes one answer fewer (`Isolation.answered`):
        the last one frees it."""
        del self._alone[worker]
        if aux != NOT_RUN and (kind != ERROR or payload != CANCEL_ACK) and self._isolation.answered(call.index):
            log.info("%s: its calls run as any again (as many of them as asked answered, run alone)",
                     self._names[call.index])

    def _reserved_idle(self, worker: Worker) -> None:
        """`worker` holds nothing now, while calls run alone (`_pick_alone`): the calls
        waiting for a worker of their own go on (one may take it); if it was reserved for
        one and none takes it, it takes any call again."""
        self._release_all()
        self._pump()
        if self._alone.get(worker) is False and not worker.blocked and not worker.outstanding:
            del self._alone[worker]
            if worker in self._ready:
                worker.limit = worker.concurrency
                self._pump()
        else:
            self._check_idle()

    def _gone(self, call: Call, exchange: Exchange, kind: int, payload: bytes, aux: int) -> None:
        """Fill a single call's slot with nothing: its connection is gone (`forget`). Counted
        in the metrics as what the worker answered."""
        if kind != RESULT:
            self._count_error(call, call.index, error_code(payload), _clock() - call.arrival)
        else:
            if self.metrics is not None:
                self.metrics.result(call.index, _clock() - call.arrival, aux)
            if self.access_ok is not None:
                self.access_ok.call(call, 0, _clock() - call.arrival)
        exchange.fill(call.slot, b"")

    def _large_result(self, call: Call, exchange: Exchange, result: bytes, size: int, aux: int) -> None:
        """Fill a single call's slot with its `result` (`size`: the answer's bytes), which
        would take its connection's `held` past max_response_bytes, or all connections'
        past max_outgoing_bytes: kept if its exchange is the first its connection owes
        and it fits beside that exchange's own answers (`ResponseBudget.counted`), else
        -32603 (`_answer_error`). `aux`: the worker's time for the call, µs."""
        budget = exchange.budget
        outgoing = budget.outgoing
        if budget.counted(exchange) + size <= self.max_response_bytes and outgoing.held + size <= outgoing.limit:
            budget.keep(exchange, size)
            if self.metrics is not None:
                self.metrics.result(call.index, _clock() - call.arrival, aux)
            if self.access_ok is not None:
                self.access_ok.call(call, 0, _clock() - call.arrival)
            exchange.fill(call.slot, b"".join((_RESP_HEAD, call.id, _RESP_RESULT, result, b"}")))
        else:
            self._answer_error(call, exchange, result, size)

    def _answer_error(self, call: Call, exchange: Exchange, error: bytes, size: int) -> None:
        """Fill a single call's slot with the worker's error object `error` (`size`: the
        answer's bytes), or with -32603 if the answer would take its connection's answers
        owed past max_response_bytes, or all connections' past max_outgoing_bytes (a
        result too: then `error` is that result)."""
        if error == CANCEL_ACK or error == CANCEL_ACK_RAN:  # (see `as_timed_out`)
            size -= len(error)
            error = timed_out(call, error == CANCEL_ACK_RAN)
            size += len(error)
        budget = exchange.budget
        outgoing = budget.outgoing
        held = budget.held
        if held + size > self.max_response_bytes:  # (unless its exchange is owed first)
            held = budget.counted(exchange)
        if held + size <= self.max_response_bytes and outgoing.held + size <= outgoing.limit:
            code = error_code(error)
            answer = response_error(call.id, error)
        else:
            code = ErrorCode.INTERNAL_ERROR
            answer = self._oversize(call.id, held + size > self.max_response_bytes, outgoing)
        budget.keep(exchange, len(answer))
        self._count_error(call, call.index, code, _clock() - call.arrival)
        exchange.fill(call.slot, answer, http_status(code))

    def _count_error(self, call: Call, index: int, code: int, latency: float, place: int = -1) -> None:
        """Count an answer with an error object of `code` to `call` (of method `index`;
        `latency` seconds after it arrived) in the metrics, and tell the access log of it:
        the call itself, or (`place` >= 0) a chunk's call at that place."""
        if self.metrics is not None:
            self.metrics.answered(index, code, latency)
        if self.access is not None:
            if place < 0:
                self.access.call(call, code, latency)
            else:
                self.access.element(call, place, code, latency)

    def _discover(self, request: Request, exchange: Exchange, size: int) -> bytes:
        """The answer to `request`, a call of `rpc.discover` in a body being walked
        (`Dispatcher._entries`; `size`: the bytes of the answers made before it there, not
        counted in its budget yet, as this one is not): the caller's OpenRPC document
        (`catalog.Catalog.openrpc`, without the methods `exchange.budget.denied`), -32602 for
        params other than none, [] or {}, or -32603 if the document would take the
        connection's answers owed past max_response_bytes (or all connections' past
        max_outgoing_bytes), as a worker's result would. Counted (method `rpc.discover`)
        and told to the access log here."""
        budget = exchange.budget
        code = 0
        if bytes(request.params).translate(None, _BLANKS) not in _NO_PARAMS:
            code = ErrorCode.INVALID_PARAMS
            answer = response_error(request.id, _DISCOVER_PARAMS)
        else:
            answer = response_result(request.id, self.catalog.openrpc(budget.denied))
            outgoing = budget.outgoing
            held = budget.held + size
            if held + len(answer) > self.max_response_bytes:  # (unless its exchange is owed first)
                held = budget.counted(exchange) + size
            if held + len(answer) > self.max_response_bytes or outgoing.held + size + len(answer) > outgoing.limit:
                code = ErrorCode.INTERNAL_ERROR
                answer = self._oversize(request.id, held + len(answer) > self.max_response_bytes, outgoing)
        metrics = self.metrics
        if metrics is not None:
            if code:
                metrics.answered(metrics.discover, code, 0.0)
            else:
                metrics.ok(metrics.discover, 0.0)
        access = self.access if code else self.access_ok
        if access is not None:
            access.early(budget, request, code)
        return answer

    def _oversize(self, id_: Raw, connection: bool, outgoing: Outgoing) -> bytes:
        """The -32603 answer (small: the caller counts it in the budget all the same) for
        call `id_`, whose own answer would take its connection's answers owed past
        max_response_bytes (`connection`), else all connections' past max_outgoing_bytes
        (`outgoing`'s limit). Nothing for a connection gone (`forget`)."""
        if outgoing is GONE:
            return b""
        if not connection:
            outgoing.refused_total += 1
            outgoing.over()
            if outgoing.refused_total == 1 or outgoing.refused_total % 1000 == 0:
                log.warning("answers refused: responses owed on all connections exceed max_outgoing_bytes %d "
                            "(%d so far)", outgoing.limit, outgoing.refused_total)
            return response_error(id_, self._too_much)
        self.oversize_total += 1
        if self.oversize_total == 1 or self.oversize_total % 1000 == 0:
            log.warning("answers refused: responses owed on a connection exceed max_response_bytes %d (%d so far)",
                        self.max_response_bytes, self.oversize_total)
        return response_error(id_, self._too_large)

    def _reclassify(self, index: int, est: int) -> None:
        """A sync method's estimate crossed BLOCKING_US: route its calls accordingly,
        those still queued too. A queued call goes out as what its method is known to
        be when it is sent, not when it was queued: the calls of a fresh `add` queued
        one by one behind its first call (unmeasured: blocking) went on one at a time
        per worker after its first answer showed it fast, and a burst of batches was
        shed -32000 with the workers far from worker_concurrency (hostile testing).
        (A walk of the queue, only when a method crosses the threshold: rare.)"""
        if index >= len(self._names):  # `other`: a method a reload removed
            return
        blocking = int(est >= BLOCKING_US)
        self._blocking[index] = blocking
        name = self._names[index]
        self._routes[name] = self._routes[name]._replace(sync=1 if blocking else -1)
        flags = self._blocking
        for call in self._queue:
            if not call.tick:  # an expired shell
                continue
            if call.methods is None:
                if call.index == index:
                    call.sync = 1 if blocking else -1
            elif index in call.methods:
                call.sync = sum(flags[m] for m in call.methods)
        log.debug("sync method %s: its estimated time crossed %d us (now %d us): %s", name, BLOCKING_US, est,
                  "blocking" if blocking else "not blocking")

    def _learn_chunk(self, call: Call, aux: int) -> None:
        """Learn a sync method's service time from a chunk of its calls alone (a
        chunk's `aux` is its total: of several methods, it says nothing of each)."""
        methods: list[int] = call.methods  # type: ignore[assignment]  # (no cast: 130 ns per chunk)
        index = methods[0]
        est = self._sync_us[index]
        if est >= 0 and methods.count(index) == len(methods):
            per_call = aux // len(methods)
            est += (per_call - est) >> 3
            self._sync_us[index] = est
            if (est >= BLOCKING_US) != self._blocking[index]:
                self._reclassify(index, est)

    def _not_overdue(self, worker: Worker, call_id: int) -> None:
        """`worker` answered (or gave back) call `call_id`, past its deadline: with none left
        overdue, it is chosen as any again."""
        overdue = worker.overdue
        if call_id in overdue:
            overdue.discard(call_id)
            if not overdue:
                self._overdue -= 1

    def _count_late(self, kind: int, payload: bytes, call: Call | None) -> None:
        """Count a reply to a call answered already: per call (notifications, which
        were owed no answer, are not counted), as the worker's acknowledgement of a
        CANCEL (`wire.CANCEL_ACK`) or as a late result. `call`: whose reply it is, or
        None for an id not pending on this worker (then each answer counts)."""
        slots = call.slots if call is not None else None
        if call is not None:
            self._unrun(call, kind, payload)
        if kind == CHUNK_RESULTS:  # (all results, of calls: notifications' never come so)
            self.late_results_total += payload.count(b"\n") + 1
        elif kind == CHUNK_REPLY or kind == CHUNK_PART:
            for i, entry_kind, start, end in chunk_answers(payload):
                if slots is not None and i < len(slots) and slots[i] < 0:
                    pass  # a notification's
                elif entry_kind == ERROR and payload[start:end] in ACKS:
                    self.late_cancelled_total += 1
                else:
                    self.late_results_total += 1
        else:
            if call is None:
                calls = 1
            elif slots is not None:  # one ERROR frame for a whole chunk
                calls = sum(1 for slot in slots if slot >= 0)
            else:
                calls = int(call.kind != NOTIFY)
            if kind == ERROR and payload in ACKS:
                self.late_cancelled_total += calls
            else:
                self.late_results_total += calls

    def _unrun(self, call: Call, kind: int, payload: bytes) -> None:
        """Count the notifications of `call` that its reply (`kind`, `payload`) says never
        started, their deadline passed first (`wire.CANCEL_ACK`): they get no answer, so
        `notifications_dropped` is their only trace (hostile testing, round 83: counted
        nowhere). A chunk's (of notifications only: a chunk never mixes them with calls,
        `_start_chunks`) are those of its entries answered so, or all of them, when one
        ERROR answers it whole; not those answered already (-2: `on_reply`)."""
        slots = call.slots
        if kind == CHUNK_RESULTS:  # (all results)
            return
        if slots is None:
            unrun = int(call.kind == NOTIFY and kind == ERROR and payload == CANCEL_ACK)
        elif kind == ERROR:
            unrun = slots.count(-1) if payload == CANCEL_ACK else 0
        elif CANCEL_ACK not in payload:  # (the usual case, found at C speed)
            return
        else:
            unrun = sum(1 for i, entry_kind, start, end in chunk_answers(payload)
                        if entry_kind == ERROR and i < len(slots) and slots[i] == -1 and payload[start:end] == CANCEL_ACK)
        if unrun:
            self.notifications_dropped[_EXPIRED] = self.notifications_dropped.get(_EXPIRED, 0) + unrun

    def _fill_chunk(self, call: Call, exchange: Exchange, payload: bytes) -> None:
        """Splice the answers of a CHUNK_PART or CHUNK_REPLY payload into their slots.

        Each answer is tested against what its connection may still be owed. (One test
        per payload instead, when all of it fits, was measured: the bound needs the
        chunk's ids' bytes, and summing them costs what the tests per answer save.)"""
        # (Annotations, not typing.cast: a cast of list[int] costs 130 ns, per chunk.)
        slots: list[int] = call.slots  # type: ignore[assignment]
        ids: list[Raw] = call.ids  # type: ignore[assignment]
        metrics = self.metrics
        results = 0  # results filled (for metrics)
        answers = exchange.answers
        gone = exchange.budget.outgoing is GONE  # (its connection is: `forget`)
        view = memoryview(payload)
        unpack = REPLY_ENTRY.unpack_from
        size = REPLY_ENTRY.size
        join = b"".join
        end = len(payload)
        pos = filled = 0
        budget = exchange.budget
        outgoing = budget.outgoing
        # What the connection may still be owed, and all of them
        room = start = min(self.max_response_bytes - budget.held, outgoing.limit - outgoing.held)
        refused: set[int] | None = None  # entries answered -32603 past max_response_bytes
        again: list[int] | None = None  # results of calls answered before (a worker's second answer)
        while pos < end:
            i, entry_kind, length = unpack(payload, pos)
            pos += size
            slot = slots[i]
            if slot >= 0 and answers[slot] is None:
                # A small result is sliced out (a copy), a large one viewed: a memoryview
                # costs 40 ns more than a slice of a few bytes, per answer.
                result = payload[pos : pos + length] if length < _VIEW_FROM else view[pos : pos + length]
                if gone:
                    answer = b""
                elif entry_kind == RESULT:
                    answer = join((_RESP_HEAD, ids[i], _RESP_RESULT, result, b"}"))  # response_result, inline
                else:
                    answer = response_error(ids[i], as_timed_out(result, call))
                room -= len(answer)
                if room < 0 and not gone:
                    # Owed first, it is counted with its own answers only (`ResponseBudget.counted`:
                    # no count it reads changes in this loop), and the smaller room says which bound
                    own = self.max_response_bytes - budget.counted(exchange)
                    wider = min(own, outgoing.limit - outgoing.held)
                    room += wider - start
                    start = wider
                    if room < 0:
                        room += len(answer)
                        answer = self._oversize(ids[i], wider == own, outgoing)
                        room -= len(answer)  # (admitted past the limit: it is small)
                        entry_kind = ERROR
                        if refused is None:
                            refused = set()
                        refused.add(i)
                        result = _TOO_LARGE_MARK
                answers[slot] = answer
                if entry_kind == RESULT:
                    results += 1
                else:
                    self._count_error(
                        call, typing.cast(list[int], call.methods)[i],
                        ErrorCode.INTERNAL_ERROR if result is _TOO_LARGE_MARK else error_code(bytes(result)),
                        _clock() - call.arrival, i,
                    )  # fmt: skip
                filled += 1
            elif slot >= 0 and entry_kind == RESULT:  # (not counted: its first answer was)
                if again is None:
                    again = []
                again.append(i)
            pos += length
        budget.keep(exchange, start - room)  # (before on_done: see filled below)
        if results and metrics is not None:
            latency = _clock() - call.arrival
            methods: list[int] = call.methods  # type: ignore[assignment]
            if results == len(methods):  # the common case: every call of the chunk, all results
                mix = _mix(methods)
            else:  # some answered before (CHUNK_PART), errors, notifications: walk it again
                mix = Counter()
                pos = 0
                while pos < end:
                    i, entry_kind, length = unpack(payload, pos)
                    if entry_kind == RESULT and slots[i] >= 0 and (refused is None or i not in refused):
                        mix[methods[i]] += 1
                    pos += size + length
                for i in again or ():
                    if refused is None or i not in refused:
                        mix[methods[i]] -= 1
            for index, n in mix.items():
                metrics.ok(index, latency, n)
        if results and self.access_ok is not None:  # (access_log "all": a line per result, one entry)
            # Every call of the chunk a result (the common case): its places not read again
            places = None if results == len(slots) else results_of(payload, slots, {*(refused or ()), *(again or ())})
            self.access_ok.chunk_results(call, places, _clock() - call.arrival)
        exchange.filled(filled)

    def _fill_results(self, call: Call, exchange: Exchange, payload: bytes) -> None:
        """Put the finished Response objects of a CHUNK_RESULTS payload (`wire.py`: one per
        call of the chunk, in order, all results) in their slots, as they are: one split and,
        when the chunk's slots are evenly spaced (`Call.stride`), one slice assignment, with
        no step per call (that step was `_fill_chunk`'s, about 27 % of a batched call's
        front-end time, benchmarks/hotpath.py --profile). The chunk's answers are tested
        against what its connection may still be owed as one piece, the bytes its answers
        would each count (the separators are the array's commas). Read one by one as a
        CHUNK_REPLY's instead (`_fill_chunk`, through `chunk.entries_of`, which checks each
        object's id against the chunk's own) when that test fails (each answer is then
        tested, and refused -32603 alone if it does not fit), when some of its calls were
        answered in parts before, when its connection is gone, or when the access log
        writes a line per result. A payload without one object per call, or whose objects
        are not what `entries_of` expects, is a broken worker's: its calls are answered
        -32603."""
        slots: list[int] = call.slots  # type: ignore[assignment]  # (no cast: 130 ns per chunk)
        count = len(slots)
        parts = results(payload, count)
        if parts is not None:
            budget = exchange.budget
            outgoing = budget.outgoing
            size = len(payload) + 1 - count  # (each answer's bytes, without the separators)
            if call.weight == count and self.access_ok is None and (
                budget.held + size <= self.max_response_bytes and outgoing.held + size <= outgoing.limit
            ):
                budget.held += size
                outgoing.held += size
                exchange.size += size
                answers = exchange.answers
                stride = call.stride
                if stride:
                    answers[slots[0] : slots[-1] + 1 : stride] = parts
                else:
                    for slot, part in zip(slots, parts):
                        answers[slot] = part
                metrics = self.metrics
                if metrics is not None:
                    latency = _clock() - call.arrival
                    for index, n in _mix(call.methods).items():  # type: ignore[arg-type]
                        metrics.ok(index, latency, n)
                exchange.filled(count)
                return
            entries = entries_of(parts, call.ids)  # type: ignore[arg-type]
            if entries is not None:
                self._fill_chunk(call, exchange, entries)
                return
        log.error("worker %s answered chunk %d with %d bytes that are not %d Response objects; its calls are "
                  "answered -32603", call.worker, call.call_id, len(payload), count)
        self._fail_chunk(call, exchange, _MALFORMED, True)

    def _fail_chunk(self, call: Call, exchange: Exchange, error: bytes, remaining: bool) -> None:
        """Answer every still-unanswered call of a chunk with `error` (an error object)."""
        answers = exchange.answers
        count = 0
        code = error_code(error)
        latency = _clock() - call.arrival
        methods = typing.cast(list[int], call.methods)
        budget = exchange.budget
        outgoing = budget.outgoing
        limit = self.max_response_bytes
        for i, (slot, id_) in enumerate(zip(typing.cast(list[int], call.slots), typing.cast(list[Raw], call.ids))):
            if slot >= 0 and answers[slot] is None:
                answer = response_error(id_, error) if outgoing is not GONE else b""
                # (a worker's error object can be large)
                if outgoing is not GONE and (
                    (over := budget.counted(exchange) + len(answer) > limit) or outgoing.held + len(answer) > outgoing.limit
                ):
                    answer = self._oversize(id_, over, outgoing)
                    self._count_error(call, methods[i], ErrorCode.INTERNAL_ERROR, latency, i)
                else:
                    self._count_error(call, methods[i], code, latency, i)
                budget.keep(exchange, len(answer))
                answers[slot] = answer
                count += 1
        if remaining:
            exchange.filled(count)
        else:
            exchange.remaining -= count
