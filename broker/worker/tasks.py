"""Async calls' tasks to their answers, and CANCELs acknowledged at once (`TaskAnswers`).

`WorkerProtocol._execute` (broker/worker/runtime.py) starts an async handler, or the
awaitable a sync one returned, as a task; the task's last step makes the call's answer
(`_finished`: a done callback comes a loop turn later, which a slow sync call can take
first), else its done callback does (`_task_done`: cancelled before it ran). A CANCEL
(`TaskAnswers._cancel`) cancels a call's task and acknowledges it at once; the task runs on
to its end (`_winding`), its outcome dropped. `WorkerProtocol` inherits these methods; the
state they use is the protocol's, in its slots.

`_forked_from` is broker/worker/runtime.py's global (its hot path reads it): it is read
here through that module, `runtime._forked_from`, never a copy of it.
"""

from __future__ import annotations

import asyncio
import collections
import time
import typing

from broker import wire
from broker.wire import AWAITED, ERROR, RESULT
from broker.worker import runtime  # (`runtime._forked_from`, read at run time: runtime imports this first)
from broker.worker.chunks import _CANCELLED, _Chunk
from broker.worker.params import _drop_flag_members
from broker.worker.results import checked_result, encode_result

if typing.TYPE_CHECKING:
    from broker.worker.params import Method

_perf = time.perf_counter


class _PastDeadline(Exception):
    """An async call (or the awaitable a sync handler returned) whose first step came past
    its deadline: it is answered `CANCEL_ACK_RAN`. Its params were bound, or the sync handler
    ran (its side effects made) before it returned the awaitable (hostile testing, round 61:
    answered CANCEL_ACK, the client was told "started": false, and a retry would have done it
    twice; round 64, the same after an async method's param __post_init__)."""


_PAST_DEADLINE_RAN = _PastDeadline()


class TaskAnswers:
    """`WorkerProtocol`'s methods that answer its async calls' tasks, and CANCELs.

    (A mixin with no state of its own: the attributes below are the protocol's slots.)
    """

    __slots__ = ()

    if typing.TYPE_CHECKING:
        _alone_next: collections.deque[tuple[int, int, int, bytes]]
        _answered: set[asyncio.Task[tuple[bool, object]]]
        _awaited: dict[asyncio.Task[tuple[bool, object]], int]
        _backlog: collections.deque[tuple[int, int, int, bytes] | _Chunk]
        _cancelled: set[asyncio.Task[tuple[bool, object]]]
        _chunks: dict[int, _Chunk]
        _closing: bool
        _dirty: set[_Chunk]
        _down: bool
        _flag_classes: tuple[type, ...]
        _loop: asyncio.AbstractEventLoop
        _methods: list[Method]
        _task_of: dict[asyncio.Task[tuple[bool, object]], tuple[object, int, float | int]]
        _tasks: dict[int, asyncio.Task[tuple[bool, object]]]
        _winding: set[asyncio.Task[tuple[bool, object]]]

        def _cancel_next(self, call_id: int) -> bool: ...
        def _chunk_answer(self, chunk: _Chunk, i: int, kind: int, body: bytes) -> None: ...
        def _chunk_task_answer(
            self, chunk: _Chunk, i: int, index: int, task: asyncio.Task[tuple[bool, object]],
            outcome: tuple[bool, object] | None,
        ) -> None: ...
        def _drop_unstarted(self, chunk: _Chunk) -> None: ...
        def _error(self, exc: BaseException, index: int) -> bytes: ...
        def _reply(self, kind: int, call_id: int, t0: float, body: bytes, aux: int = -1) -> int: ...
        def _schedule_flush(self) -> None: ...

    def _cancel(self, call_id: int) -> None:
        """CANCEL: an async call is cancelled and acknowledged (`CANCEL_ACK`) at once, a
        call not started yet dropped and acknowledged. At once, not when its task ends:
        a handler that catches the cancel and cleans up (awaiting, the loop free) got its
        worker killed as hung after cancel_grace, and the calls beside it answered -32002
        (hostile testing, round 16); the broker kills only a worker that does not answer
        (a sync handler stuck, a loop held). Its task runs on to its end; what it returns
        then is dropped."""
        task = self._tasks.get(call_id)
        if task is not None:
            if not task.done():
                task.cancel()
                where = self._task_of.pop(task, None)
                if where is None:  # (not started yet: its done callback answers it)
                    self._cancelled.add(task)
                    return
                self._tasks.pop(call_id, None)
                self._awaited.pop(task, None)
                self._answered.add(task)  # (its done callback: nothing to do)
                self._winding.add(task)
                self._reply(ERROR, call_id, typing.cast("tuple[int, int, float]", where)[2], _CANCELLED)
                self._schedule_flush()
            return
        chunk = self._chunks.get(call_id)
        if chunk is not None:
            for task in chunk.tasks:
                if not task.done():
                    task.cancel()
                    where = self._task_of.pop(task, None)
                    if where is None:
                        self._cancelled.add(task)
                        continue
                    self._answered.add(task)
                    self._winding.add(task)
                    self._chunk_answer(chunk, typing.cast("tuple[_Chunk, int, int]", where)[1], ERROR, _CANCELLED)
                    chunk.waiting -= 1
            self._drop_unstarted(chunk)
            try:
                self._backlog.remove(chunk)
            except ValueError:
                pass
            self._dirty.add(chunk)
            return
        for i, queued in enumerate(self._backlog):  # rare: a call still waiting here
            if type(queued) is tuple and queued[1] == call_id:
                del self._backlog[i]
                self._reply(ERROR, call_id, _perf(), _CANCELLED)  # a whole chunk, too
                return
        if self._alone_next:  # (or waiting its turn to run alone: worker/alone.py)
            self._cancel_next(call_id)

    def _flag_call_done(self, task: asyncio.Task[tuple[bool, object]]) -> None:
        """An async call binding enum.Flag members ended: drop them, once nothing holds them
        (past the bound counted from none kept: the drop made as the call began counted its
        members as kept, and the members of a call ended stayed for good, round 41)."""
        self._loop.call_soon(_drop_flag_members, self._flag_classes, True)

    def _outcome(
        self, task: asyncio.Task[tuple[bool, object]], index: int, outcome: tuple[bool, object] | None = None
    ) -> tuple[int, bytes]:
        """The answer of a finished async call, as `_execute` gives a sync one: `outcome`,
        or its task's result. Never raises: an exception here would be lost in a done
        callback, and the call would never be answered."""
        by_broker = task in self._cancelled
        if by_broker:
            self._cancelled.discard(task)
        try:
            value: object
            try:
                ok, value = task.result() if outcome is None else outcome
            except BaseException as exc:  # cancelled before it ever ran, or a GeneratorExit
                ok, value = False, exc  # raised by the handler (_guarded lets that through)
            if ok:
                method = self._methods[index]
                check = method.check_result
                return RESULT, encode_result(value) if check is None else checked_result(value, check, method.returns)
            if by_broker and isinstance(value, asyncio.CancelledError):
                return ERROR, _CANCELLED
            if value is _PAST_DEADLINE_RAN:
                return ERROR, wire.CANCEL_ACK_RAN
            return ERROR, self._error(typing.cast(BaseException, value), index)
        except BaseException as exc:  # the result has no JSON form (or a hook raised)
            return ERROR, self._error(exc, index)

    def _finished(self, ok: bool, value: object) -> None:
        """The last step of an async call's task (`_guarded`): make its answer now. Not a
        cancellation's, which the done callback answers as before, once it knows whether
        the worker is going down (the loop's teardown cancels every task: their calls are
        the broker's to answer, -32002, not -32603 CancelledError)."""
        if not ok and isinstance(value, asyncio.CancelledError):
            return
        task = asyncio.current_task(self._loop)
        where = self._task_of.pop(task, None) if task is not None else None
        if where is None:  # (its done callback answers it: started eagerly, and not yet known)
            return
        self._answered.add(task)  # type: ignore[arg-type]  # (its done callback: nothing to do)
        if type(where[0]) is _Chunk:
            chunk, i, index = typing.cast("tuple[_Chunk, int, int]", where)
            self._chunk_task_answer(chunk, i, index, task, (ok, value))  # type: ignore[arg-type]
        else:
            call_id, index, t0 = typing.cast("tuple[int, int, float]", where)
            self._task_answer(call_id, index, t0, task, (ok, value))  # type: ignore[arg-type]

    def _task_done(self, call_id: int, index: int, t0: float, task: asyncio.Task[tuple[bool, object]]) -> None:
        if task in self._answered:  # (answered in its last step: `_finished`, or at its cancel)
            self._answered.discard(task)
            self._wound(task)
            return
        self._task_of.pop(task, None)  # (cancelled before it ran, a GeneratorExit: never finished)
        self._task_answer(call_id, index, t0, task, None)

    def _task_answer(
        self, call_id: int, index: int, t0: float, task: asyncio.Task[tuple[bool, object]],
        outcome: tuple[bool, object] | None,
    ) -> None:
        if runtime._forked_from:
            runtime._child_exits(None)
        self._tasks.pop(call_id, None)
        awaited = self._awaited.pop(task, 0)
        if self._down:
            return
        kind, body = self._outcome(task, index, outcome)
        if runtime._forked_from:  # (forked while the result or error was encoded: a `tolist`, a repr)
            runtime._child_exits(None)
        if awaited < 0:  # a sync handler's awaitable: its time is not the worker's (wire.AWAITED)
            self._reply(kind, call_id, t0, body, min(int((_perf() - t0) * 1e6), AWAITED - 1) | AWAITED)
        elif awaited:  # ... returned after blocking this long: the worker's time, as a sync call's
            self._reply(kind, call_id, t0, body, awaited)
        else:
            self._reply(kind, call_id, t0, body)
        self._schedule_flush()

    def _wound(self, task: asyncio.Task[tuple[bool, object]]) -> None:
        """A task whose cancel was acknowledged at once has ended: a worker told BYE may
        close now (`_flush`)."""
        if task in self._winding:
            self._winding.discard(task)
            if self._closing:
                self._schedule_flush()
