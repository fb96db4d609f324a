"""A batch's chunks: their calls run in the loop's slices (`ChunkRuns._advance`), their answers sent.

A CHUNK (several calls of one batch, `_Chunk`) is answered with one CHUNK_RESULTS, or with
CHUNK_PART frames and one CHUNK_REPLY: `_advance` starts its calls while
`WorkerProtocol._run`'s slice lasts. While every answer is a result, in the chunk's order,
each is kept with its id, to be sent as its finished Response object (`chunk.results_payload`:
the broker puts it in its slot as it is); the first that is not (an error, a notification's, an async call's, one
past max_frame_bytes, a part to send first) turns those into entries (`_unclean`), and from
then on each answer joins the chunk's unsent ones (`_chunk_answer`, a CHUNK_PART going out
first when they would pass max_frame_bytes). `_emit` sends them. Past its deadline a call is not
started (`_drop_unstarted`). `WorkerProtocol` (broker/worker/runtime.py) inherits these
methods; the state they use is the protocol's, in its slots. The names the run loop shares
with them are here too: a call's deadline and flow (`_deadline_of`), the answers of a call
that never ran (`_UNRUN`, `_CANCELLED`), and when a sync call is slow (`SLOW_SYNC_US`).

`_forked_from` is broker/worker/runtime.py's global (its hot path reads it): it is read
here through that module, `runtime._forked_from`, never a copy of it.
"""

from __future__ import annotations

import asyncio
import functools
import struct
import time
import typing

from broker import wire
from broker.chunk import RESULT_HEAD, RESULT_MID, add_answer, read_call, results_payload
from broker.wire import (
    AWAITED,
    CALL_ENTRY,
    CHUNK_PART,
    CHUNK_REPLY,
    CHUNK_RESULTS,
    ERROR,
    NOT_RUN,
    REPLY_ENTRY,
    RESULT,
    RETURNABLE,
)
from broker.worker import runtime  # (`runtime._forked_from`, read at run time: runtime imports this first)

if typing.TYPE_CHECKING:
    from broker.worker.links import Link
    from broker.worker.params import Method

_deadline_of = wire.DEADLINE.unpack_from  # a call's (deadline, flow), at the start of its frame's payload
# (flow: its connection's number, FLOW_MASK, and RETURNABLE: `WorkerProtocol._give_back`)
_DEADLINE_SIZE = wire.DEADLINE.size
_perf = time.perf_counter
_monotonic = time.monotonic  # the clock of the deadlines the broker sends (wire.py)
_CANCELLED = wire.CANCEL_ACK  # the broker tells this acknowledgement from a late result
# `_execute`'s kind for an ERROR whose handler never ran (its params did not bind, or no
# such method): the reply's aux says NOT_RUN, and no method's speed is learnt from it.
_UNRUN = -1
SLOW_SYNC_US = 1000  # a sync call this long (µs) blocks the replies behind it (dispatch.BLOCKING_US)
_SLOW_SYNC_S = SLOW_SYNC_US / 1e6
_AWAITED_WITHIN_S = 0.01  # a sync handler that returns its awaitable within this blocks nothing (wire.AWAITED)
_RESULT_FRAME = len(RESULT_HEAD) + len(RESULT_MID) + 2  # a Response object's bytes besides its id and result, `}\n`
# `\n` as an int: `_LF in body` is a memchr, where `b"\n" in body` first tries the needle as an
# int and raises and clears a TypeError inside (CPython 3.11: 2,200 instructions against 200)
_LF = 0x0A


class _Chunk:
    """A CHUNK being run: where its next call starts, and answers not yet sent."""

    __slots__ = (
        "awaited", "chunk_id", "clean", "count", "deadline", "flow", "next", "payload", "pos", "ran", "results", "size",
        "t0", "tasks", "unsent", "waiting"
    )  # fmt: skip

    def __init__(self, chunk_id: int, count: int, payload: bytes) -> None:
        self.chunk_id = chunk_id
        self.count = count
        self.payload = payload
        self.deadline: float  # its calls', CLOCK_MONOTONIC s (wire.py)
        self.flow: int  # its connection's number (wire.py)
        self.deadline, self.flow = _deadline_of(payload)
        self.pos = _DEADLINE_SIZE  # byte offset of the next call's entry
        self.next = 0  # index of the next call to start
        self.unsent = bytearray()  # REPLY_ENTRY-framed answers for the next part
        # While `clean`: every answer so far a result, of the calls started but the one
        # running, in order, kept for a CHUNK_RESULTS (`results`: each call's raw id, then
        # its raw result; `size`: the bytes of their Response objects, separators included;
        # `unsent` empty). (No async call of it started: see `_advance`.)
        self.clean = True
        self.results: list[bytes] = []
        self.size = 0
        self.tasks: list[asyncio.Task[tuple[bool, object]]] = []
        self.waiting = 0  # async calls still running
        self.ran = False  # a handler of it ran (else its CHUNK_REPLY's aux is NOT_RUN)
        # A sync-declared method's call of it returned an awaitable: 1 at once, -1 after
        # blocking (then not AWAITED), 0 none (wire.AWAITED).
        self.awaited = 0
        self.t0 = _perf()


def _calls_of(payload: bytes, pos: int, method: int) -> bool:
    """Whether a CHUNK payload's calls from byte `pos` on include one of method index `method`."""
    unpack = CALL_ENTRY.unpack_from
    size = CALL_ENTRY.size
    end = len(payload)
    while pos + size <= end:
        index, _flags, id_length, length = unpack(payload, pos)
        if index == method:
            return True
        pos += size + id_length + length
    return False


class ChunkRuns:
    """`WorkerProtocol`'s methods that run a chunk's calls and send their answers.

    (A mixin with no state of its own: the attributes below are the protocol's slots.)
    """

    __slots__ = ()

    if typing.TYPE_CHECKING:
        _advancing: _Chunk | None
        _answered: set[asyncio.Task[tuple[bool, object]]]
        _chunks: dict[int, _Chunk]
        _dirty: set[_Chunk]
        _down: bool
        _grab: bool
        _links: list[Link]
        _max_result: int
        _methods: list[Method]
        _out: bytearray
        _out_first: bytearray
        _running: float
        _running_deadline: float
        _running_id: int
        _told: bool
        _slow: list[bool]
        _surprise: int
        _task_of: dict[asyncio.Task[tuple[bool, object]], tuple[object, int, float | int]]

        def _execute(
            self, index: int, params: bytes, deadline: float
        ) -> tuple[int, bytes] | asyncio.Task[tuple[bool, object]]: ...
        def _outcome(
            self, task: asyncio.Task[tuple[bool, object]], index: int, outcome: tuple[bool, object] | None = None
        ) -> tuple[int, bytes]: ...
        def _reply(self, kind: int, call_id: int, t0: float, body: bytes, aux: int = -1) -> int: ...
        def _schedule_flush(self) -> None: ...
        def _sent_held(self) -> None: ...
        def _tell_ahead(self, call_id: int, deadline: float) -> None: ...
        def _too_large(self, kind: int, size: int) -> bytes: ...
        def _wound(self, task: asyncio.Task[tuple[bool, object]]) -> None: ...
        def _write_out(self) -> None: ...

    def _advance(self, chunk: _Chunk, deadline: float) -> bool:
        """Start a chunk's calls until `deadline` (perf_counter s) or the chunk's own,
        past which the rest are answered as cancelled, unstarted (the broker answered
        them -32001); True once all have started or been so answered. Its answers so far
        go out as a CHUNK_PART, or as the CHUNK_REPLY when none is left running."""
        left = chunk.deadline - _monotonic()
        if left <= 0:
            self._drop_unstarted(chunk)
            self._dirty.add(chunk)
            return True
        unpack = CALL_ENTRY.unpack_from
        size = CALL_ENTRY.size
        pack = REPLY_ENTRY.pack
        payload = chunk.payload
        unsent = chunk.unsent
        results = chunk.results
        keep = results.append
        objects = chunk.size  # (the bytes of its objects: a local, put back in the chunk when this returns)
        end = len(payload)
        limit = self._max_result
        room = limit - _RESULT_FRAME  # (an object's bytes besides these, in a frame of `limit`)
        slow = self._slow
        unknown = len(self._methods)  # (answered "method not found")
        t0 = _perf()
        if t0 + left < deadline:  # (then `_run` calls again, and the rest are answered above)
            deadline = t0 + left
        while chunk.next < chunk.count:
            i = chunk.next
            try:
                index, flags, id_length, length = unpack(payload, chunk.pos)
            except struct.error:
                index, flags, id_length, length = unknown, 0, 0, 0
            if index > unknown:
                index = unknown
            if slow[index] and self._links and not self._told:  # (as in `_call`)
                self._tell_ahead(chunk.chunk_id, chunk.deadline)
            if slow[index] and (unsent or results or self._out or self._out_first or self._dirty):
                # As in `_call`: the answers ready so far go out (a CHUNK_PART: call i is
                # not started yet), and the front-ends told it blocks (wire.BLOCKED), before a
                # call that may block the loop, so they are not held past their deadline behind it.
                self._dirty.add(chunk)
                self._write_out()
                t0 = _perf()
            at = chunk.pos + size  # (its id)
            start = at + id_length
            chunk.pos = pos = start + length
            chunk.next += 1
            self._advancing = chunk  # type: ignore[misc]  # (a slot of WorkerProtocol's: mypy sees this class's empty ones)
            self._running_id = chunk.chunk_id  # type: ignore[misc]  # (`_send_held`'s thread: wire.BLOCKED)
            self._running_deadline = chunk.deadline  # type: ignore[misc]
            self._running = t0  # type: ignore[misc]
            try:
                done = self._execute(index, payload[start : start + length], chunk.deadline)
            finally:
                self._running = 0.0  # type: ignore[misc]
            if runtime._forked_from:  # (as in `_call`)
                runtime._child_exits(None)
            if self._grab:
                self._sent_held()
            now = _perf()
            if type(done) is tuple:
                kind, body = done
                if kind == _UNRUN:  # (no handler ran: nothing learnt)
                    kind = ERROR
                else:
                    slow[index] = now - t0 >= _SLOW_SYNC_S
                    if slow[index]:  # (a call of it blocked: the chunk's time is the worker's, not AWAITED; round 25)
                        chunk.awaited = -1
                        if chunk.flow & RETURNABLE:  # (and it was sent as not blocking: `_give_back`)
                            self._surprise = index  # type: ignore[misc]
                    chunk.ran = True
                if chunk.clean and kind == RESULT and not flags and id_length and pos <= end and (
                    objects + id_length + len(body) <= room
                ) and _LF not in body:  # kept for the CHUNK_RESULTS (the common case; the objects
                    # are made at once, in C, by `_emit`)
                    objects += _RESULT_FRAME + id_length + len(body)
                    keep(payload[at:start])
                    keep(body)
                else:
                    if chunk.clean:
                        self._unclean(chunk)
                    if len(unsent) + len(body) <= limit:  # fits this part
                        unsent += pack(i, kind, len(body))
                        unsent += body
                    else:
                        self._chunk_answer(chunk, i, kind, body)
            else:
                task = typing.cast("asyncio.Task[tuple[bool, object]]", done)
                slow[index] = False
                chunk.ran = True
                if chunk.clean:  # (its answer comes in its own time, out of the chunk's order)
                    self._unclean(chunk)
                if not self._methods[index].is_async:  # a sync handler's awaitable (wire.AWAITED):
                    if now - t0 >= _AWAITED_WITHIN_S:  # returned after blocking: the chunk's time is the worker's
                        chunk.awaited = -1
                    elif not chunk.awaited:
                        chunk.awaited = 1
                chunk.tasks.append(task)
                chunk.waiting += 1
                if not task.done():  # (else finished at once, eagerly: answered by its done callback)
                    self._task_of[task] = (chunk, i, index)
                task.add_done_callback(functools.partial(self._chunk_task_done, chunk, i, index))
            t0 = now
            if chunk.next < chunk.count and (now > deadline or self._surprise >= 0):
                chunk.size = objects
                self._dirty.add(chunk)
                return False
        chunk.size = objects
        self._dirty.add(chunk)
        return True

    def _chunk_task_done(self, chunk: _Chunk, i: int, index: int, task: asyncio.Task[tuple[bool, object]]) -> None:
        if task in self._answered:  # (answered in its last step: `_finished`, or at its cancel)
            self._answered.discard(task)
            self._wound(task)
            return
        self._task_of.pop(task, None)
        self._chunk_task_answer(chunk, i, index, task, None)

    def _chunk_task_answer(
        self, chunk: _Chunk, i: int, index: int, task: asyncio.Task[tuple[bool, object]],
        outcome: tuple[bool, object] | None,
    ) -> None:
        if runtime._forked_from:
            runtime._child_exits(None)
        if self._down:
            return
        kind, body = self._outcome(task, index, outcome)
        if runtime._forked_from:  # (forked while the result or error was encoded: a `tolist`, a repr)
            runtime._child_exits(None)
        self._chunk_answer(chunk, i, kind, body)
        chunk.waiting -= 1
        self._dirty.add(chunk)
        self._schedule_flush()

    def _chunk_answer(self, chunk: _Chunk, i: int, kind: int, body: bytes) -> None:
        """Add the answer of a chunk's call `i` to its unsent answers. A chunk's answers
        may together pass max_frame_bytes: those before this one go out first as a
        CHUNK_PART, so each frame holds at most max_frame_bytes of answers (plus one
        entry header). Only an answer that alone is larger fails (-32603)."""
        if chunk.clean:
            self._unclean(chunk)
        if len(body) > self._max_result:
            kind, body = ERROR, self._too_large(kind, len(body))
        unsent = chunk.unsent
        if unsent and len(unsent) + len(body) > self._max_result:
            self._reply(CHUNK_PART, chunk.chunk_id, chunk.t0, bytes(unsent))
            unsent.clear()
        add_answer(unsent, i, kind, body)

    def _emit(self, chunk: _Chunk) -> None:
        """Send a chunk's unsent answers: once nothing in it is left to run, the
        CHUNK_RESULTS if every call's answer is a result in `results`, else the
        CHUNK_REPLY; before, a CHUNK_PART."""
        if chunk.next == chunk.count and not chunk.waiting:
            self._chunks.pop(chunk.chunk_id, None)
            aux = -1 if chunk.ran else NOT_RUN
            if chunk.awaited > 0:  # (wire.AWAITED)
                aux = min(int((_perf() - chunk.t0) * 1e6), AWAITED - 1) | AWAITED
            results = chunk.results
            if chunk.clean and results:  # (every call's answer: all were started, none is running)
                self._reply(CHUNK_RESULTS, chunk.chunk_id, chunk.t0, results_payload(results), aux)
                results.clear()
                return
            if chunk.clean:
                self._unclean(chunk)
            self._reply(CHUNK_REPLY, chunk.chunk_id, chunk.t0, bytes(chunk.unsent), aux)
        elif chunk.unsent or chunk.results:
            if chunk.clean:  # (a part: of entries)
                self._unclean(chunk)
            self._reply(CHUNK_PART, chunk.chunk_id, chunk.t0, bytes(chunk.unsent))
        else:
            return
        chunk.unsent.clear()

    def _unclean(self, chunk: _Chunk) -> None:
        """`chunk` will not be answered with a CHUNK_RESULTS: turn the results it kept (of
        its first calls, in order) into entries of its `unsent` answers. Rare: only when a
        chunk's answers are not all results, in order, in one frame."""
        chunk.clean = False
        results = chunk.results
        if not results:
            return
        unsent = chunk.unsent
        for place, at in enumerate(range(1, len(results), 2)):
            add_answer(unsent, place, RESULT, results[at])
        results.clear()
        chunk.size = 0

    def _drop_unstarted(self, chunk: _Chunk) -> None:
        """Answer the calls of `chunk` not started yet as cancelled (`CANCEL_ACK`; a
        notification is owed no answer): cancelled, or their deadline passed."""
        while chunk.next < chunk.count:
            _index, notification, _start, chunk.pos = read_call(chunk.payload, chunk.pos)
            if not notification:
                self._chunk_answer(chunk, chunk.next, ERROR, _CANCELLED)
            chunk.next += 1
