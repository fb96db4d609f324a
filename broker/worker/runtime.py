"""The worker process's run loop: `WorkerProtocol`, the worker's end of its Unix socket.

Frames from the broker (broker/wire.py) are decoded in `data_received` and join a
backlog; `_run` runs the waiting calls for up to `SLICE_SECONDS` per loop turn, then
writes their replies in one write. A call is bound (`Method.bind`), run (`_execute`: a
sync handler inline, an async one as a task, `_guarded`, whose answer
broker/worker/tasks.py makes) and answered with one RESULT or ERROR frame; a CHUNK
(several calls of one batch, `_Chunk`) is answered with one CHUNK_RESULTS when all its
answers are results, else CHUNK_PART frames and one CHUNK_REPLY (broker/worker/chunks.py).
A CANCEL cancels a call and is acknowledged at once (tasks.py); past its deadline a call is
not started. A sync method that blocked the loop once is "slow": the answers ready before
its next call go out first. Answers ready behind a handler that runs long are sent from another thread (broker/worker/held.py); the
error object a failed call is answered with is built in broker/worker/errors.py; which
connection's calls run first, when one's calls take the loop's slices, is decided in
broker/worker/turns.py; a call run alone whatever the other front-ends send, in alone.py.

A child that a handler forks has a copy of all this. `_forked_from` (set in the child by
the fork hooks of broker/worker/forks.py) is read wherever the worker's code gets
control back, and `_child_exits` ends the child there. It is read on the hot path, so it
is this module's own global: other modules rebind and read it as `runtime._forked_from`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import logging
import math
import os
import sys
import threading
import time
import types
import typing
from collections.abc import Callable

import msgspec

from broker import wire
from broker.wire import (
    AWAITED,
    BYE,
    CALL,
    CANCEL,
    CHUNK,
    CHUNK_REPLY,
    ERROR,
    NOT_RUN,
    NOTIFY,
    RESULT,
    RETURNABLE,
)
from broker.worker.alone import ALONE, HOLD, AloneRuns  # (wire's ALONE and HOLD, as it reads them)
from broker.worker.chunks import (  # (what the run loop shares with the chunks' runs)
    _AWAITED_WITHIN_S,
    _CANCELLED,
    _DEADLINE_SIZE,
    _SLOW_SYNC_S,
    _UNRUN,
    SLOW_SYNC_US,
    ChunkRuns,
    _Chunk,
    _deadline_of,
)
from broker.worker.errors import ErrorAnswers
from broker.worker.held import HeldAnswers
from broker.worker.links import ID_MASK, Link, LinkRuns
from broker.worker.params import _drop_flag_members
from broker.worker.results import checked_result, encode_result
from broker.worker.sdk import Registry
from broker.worker.tasks import _PAST_DEADLINE_RAN, TaskAnswers
from broker.worker.tools import method_info
from broker.worker.turns import _CHARGED_S, FlowTurns, _flow_of

log = logging.getLogger("broker.worker")  # (one logger for the package: its records say `broker.worker`)


_BYE_FRAME = wire.encode_frame(wire.Kind.BYE, 0)  # (SIGTERM: see WorkerProtocol.stop)
_pack_header = wire.HEADER.pack
_perf = time.perf_counter
_monotonic = time.monotonic  # the clock of the deadlines the broker sends (wire.py)
SLICE_SECONDS = 0.002  # run waiting calls this long before letting the loop do I/O


_forked_from = 0
"""In a child forked by a handler (by the worker's process: `isolate_forks`), the worker's
pid; 0 in the worker itself. A child's own forks keep it."""


def _child_exits(exc: BaseException | None) -> typing.NoReturn:
    """End a child a handler forked, now that it came back into the worker's code: its
    handler returned (`exc` None) or raised `exc` (sys.exit() raises SystemExit), or the
    loop called the worker back in it.

    It exits with os._exit, as multiprocessing's children do, and as the child of any
    process serving an event loop must: going on, it would run the worker's loop, whose
    epoll instance it shares with the worker (fork copies the descriptor, not the set it
    names; libuv's remedy, uv_loop_fork, uvloop does not call). The loop's teardown at the
    child's exit took the worker's registrations out of it: hostile testing, round 8, a
    child that called sys.exit(0) left its worker deaf to SIGTERM for good (no leave, no
    replacement, nothing logged), and a subprocess's exit could go unseen.

    The status is what the child asked for: sys.exit(code)'s code (1 for a message,
    which is printed, as Python does), 0 for a return, 1 for another exception (logged,
    with its traceback). Only the child's own output is flushed: the worker flushed
    stdout and stderr before the fork (`isolate_forks`); no atexit handler or finalizer
    runs, they are the worker's."""
    code = 0
    if isinstance(exc, SystemExit):
        try:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                # (past a C int, os._exit raised OverflowError and the child went back into
                # the loop, hostile testing round 9: Python's own exit gives 255 then)
                code = int(exc.code) if -(2**31) <= exc.code < 2**31 else 255
            else:
                code = 1
                print(exc.code, file=sys.stderr)
        except BaseException:  # (an int subclass whose comparisons raise, a str that cannot print)
            code = code or 1
    elif exc is not None:
        code = 1
        try:
            log.error("a child forked by a handler (the worker is pid %d) raised %s: it exits with 1",
                      _forked_from, type(exc).__name__, exc_info=exc)
        except BaseException:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:
            pass
    try:
        os._exit(code)
    finally:  # (never returns: os._exit cannot fail with an int in range, but not even then)
        os._exit(1)


_COROUTINE = types.CoroutineType


def _close_if_cancelled(coroutine: types.CoroutineType[object, object, object], task: asyncio.Task[object]) -> None:
    """A task's done callback: close `coroutine` if the task was cancelled (before its
    first step it never awaited it; closing one that ran is a no-op)."""
    if task.cancelled():
        coroutine.close()


def _identity(value: object) -> object:
    return value


async def _guarded(
    fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object],
    finished: Callable[[bool, object], None] | None = None, deadline: float = math.inf,
) -> tuple[bool, object]:
    """Run an async handler to its end: (True, result) or (False, the exception raised),
    also given to `finished` in the handler's last step, so that the answer is made in it
    (a done callback comes a loop turn later, which a slow sync call can take first).
    (False, `_PAST_DEADLINE_RAN`) if its first step comes past the call's `deadline`
    (CLOCK_MONOTONIC s): the handler never runs, the call was answered -32001 (a sync
    call started after it in the same loop turn held the loop meanwhile, and the CANCEL,
    if it has come, is read only after this step). Its params were bound, which may have
    run the app's code (a __post_init__), so it is answered CANCEL_ACK_RAN, never as a call
    that did not start (hostile testing, round 64: 12 of 12 such calls told `"started":
    false` had run their param's __post_init__).

    Never raises, not even BaseException: a Task re-raises SystemExit and
    KeyboardInterrupt out of the event loop (asyncio's Task.__step), which would stop
    the worker with every other call in flight. A CancelledError is returned too; the
    caller tells the broker's CANCEL apart from one the handler raised itself.
    """
    if _forked_from:  # (a child the loop went on in: not past its trap, `_trap_loop_return`)
        _child_exits(None)
    if deadline <= _monotonic():
        if fn is _identity:  # what a sync handler returned: never awaited now, but the handler ran
            awaitable = args[0]
            if type(awaitable) is _COROUTINE:
                typing.cast("typing.Coroutine[object, object, object]", awaitable).close()
            elif isinstance(awaitable, asyncio.Future):  # (a Task it made runs from then on, on its
                awaitable.cancel()  # own: cancelled, as an async handler's, at its next await)
        return False, _PAST_DEADLINE_RAN
    try:
        value = fn(*args, **kwargs)
        # (An awaitable from a function that is not a coroutine function: a wraps-decorated one.)
        if type(value) is _COROUTINE or inspect.isawaitable(value):
            value = await typing.cast(typing.Awaitable[object], value)
    except GeneratorExit as exc:  # the coroutine is being closed: it must not go on
        if _forked_from:  # (a child raising it: it would reach the loop, which runs other calls)
            _child_exits(exc)
        raise
    except BaseException as exc:  # the point: one answer, the worker lives on
        if _forked_from:  # (a child the handler forked, back here: `_child_exits`)
            _child_exits(exc)
        if finished is not None:
            finished(False, exc)
        return False, exc
    if _forked_from:
        _child_exits(None)
    if finished is not None:
        finished(True, value)
    return True, value


class WorkerProtocol(ChunkRuns, TaskAnswers, FlowTurns, HeldAnswers, ErrorAnswers, LinkRuns, AloneRuns, asyncio.Protocol):
    """The worker's end of its Unix socket to the broker.

    Runs each CALL/NOTIFY frame's handler and answers with exactly one RESULT or
    ERROR frame. Replies produced while handling one read go out in one write; replies
    of async handlers that finish later are coalesced per loop iteration.
    """

    # (Slots: past 30 attributes an instance's dict no longer shares its keys, and every
    # attribute read on the hot path got slower: 2.6 % more instructions per call.)
    __slots__ = (
        "_active",
        "_advancing",
        "_answered",
        "_awaited",
        "_backlog",
        "_bye",
        "_cancelled",
        "_chunks",
        "_closing",
        "_concurrency",
        "_debug",
        "_decoder",
        "_dirty",
        "_down",
        "_fd",
        "_flag_classes",
        "_flush_scheduled",
        "_grab",
        "_grab_lock",
        "_hello",
        "_leaving",
        "_links",
        "_loop",
        "_max_depth",
        "_max_result",
        "_methods",
        "_out",
        "_out_first",
        "_read_first",
        "_run_scheduled",
        "_running",
        "_running_deadline",
        "_running_id",
        "_slot",
        "_slow",
        "_spent",
        "_surprise",
        "_task_of",
        "_tasks",
        "_told",
        "_transport",
        "_used",
        "_virtual",
        "_winding",
        "_yielded",
        "done",
    )

    def __init__(
        self,
        registry: Registry,
        slot: int,
        concurrency: int,
        max_depth: int = 64,
        max_frame_bytes: int = wire.MAX_FRAME_BYTES,
        debug: bool = False,
    ) -> None:
        self._methods = registry.methods()
        # The enum.Flag classes params bind to: the members their calls make are dropped
        # after each such call, once nothing holds them (`_drop_flag_members`).
        self._flag_classes = tuple({cls: None for m in self._methods for cls in m._flags or ()})
        # Per method index: did its last sync call take SLOW_SYNC_US or more? A sync method
        # not run yet counts as slow, as the broker counts it (dispatch.BLOCKING_US): what is
        # ready goes out before its first call, which may block. (One past the table: an
        # index the broker sends for a method this code does not have.)
        self._slow = [not m.is_async for m in self._methods] + [False]
        self._slot = slot
        self._concurrency = concurrency
        self._max_depth = max_depth
        self._debug = debug
        self._decoder = wire.FrameDecoder(max_frame_bytes)
        self._max_result = max_frame_bytes  # largest result or error object sent
        self._out = bytearray()
        # (several front-ends: the first connection's replies split off `_out` that the held
        # answers' thread could not write, in part a frame: written first next time, `links`)
        self._out_first = bytearray()
        self._flush_scheduled = False
        self._tasks: dict[int, asyncio.Task[tuple[bool, object]]] = {}
        # Where each running async call's answer goes: (call id, method, start) or (chunk,
        # its entry, method), for its last step to answer it (`_finished`); and those
        # answered so, which their done callbacks then leave alone.
        self._task_of: dict[asyncio.Task[tuple[bool, object]], tuple[object, int, float | int]] = {}
        self._answered: set[asyncio.Task[tuple[bool, object]]] = set()
        # Tasks the broker cancelled (CANCEL): only their CancelledError is "cancelled
        # by the broker" (-32001); one a handler raises by itself is -32603.
        self._cancelled: set[asyncio.Task[tuple[bool, object]]] = set()
        # Tasks of sync-declared methods' awaitables: -1 returned at once (wire.AWAITED), else
        # the µs the handler blocked before it returned it (its reply's aux: the worker's time).
        self._awaited: dict[asyncio.Task[tuple[bool, object]], int] = {}
        self._backlog: collections.deque[tuple[int, int, int, bytes] | _Chunk] = collections.deque()
        self._chunks: dict[int, _Chunk] = {}  # chunks started and not yet fully answered
        self._dirty: set[_Chunk] = set()  # chunks with answers to send
        self._run_scheduled = False
        self._read_first = False  # `_run` was put off to a later loop turn: it reads first (`_read_now`)
        self._yielded = (0, 0)  # (call id, loop turns) given to async calls before a slow one (`_run`)
        self._spent = False  # a call (or chunk) took the whole last slice: `_next_turn` due
        self._surprise = -1  # a call sent RETURNABLE turned out slow: `_give_back` due, of this method
        self._used: dict[int, float] = {}  # each flow's start (s): `_next_turn`, `_charge`
        self._virtual = 0.0  # the start of the last call (or chunk) charged (s): `_arrival`
        self._active: set[int] = set()  # the flows waiting at the last turn, or charged since
        self._closing = False  # the broker said BYE: no call comes after it; close once all are answered
        # (With several front-ends: each other one's connection, a `Link`; `_closing` once
        # the first connection's BYE (`_bye`) and every link's came.)
        self._links: list[Link] = []  # (broker/worker/links.py)
        self._alone_init()  # (broker/worker/alone.py)
        self._bye = False
        # Tasks whose cancel was acknowledged at once (`_cancel`), still running (cleaning up):
        # the worker closes after them, as after its calls (hostile testing, round 17: a
        # reload's BYE closed it at once, and its teardown cut their clean-up short).
        self._winding: set[asyncio.Task[tuple[bool, object]]] = set()
        self._leaving = False  # this worker said BYE (SIGTERM) and waits for the broker's
        self._down = False  # see going_down
        self._transport: asyncio.Transport | None = None
        self._fd = -1  # the channel's socket, for `_send_held`
        # While a handler runs (`_execute`): when it started (perf_counter s), else 0.0. The
        # answers made before it in the same slice are sent by `_send_held`'s thread once
        # it has run HELD_SECONDS; `_grab` is set while that thread sends (`_sent_held`).
        self._running = 0.0
        # ... and the call's (or chunk's) id (tagged by its link) and deadline, set before
        # `_running`; `_told`: the front-ends were told a handler blocks the worker (wire.BLOCKED;
        # several front-ends only), not yet that it returned (`_sent_held`).
        self._running_id = 0
        self._running_deadline = math.inf
        self._told = False
        self._grab = False
        self._grab_lock = threading.Lock()
        self._advancing: _Chunk | None = None  # the chunk `_advance` runs calls of
        self._hello = b""  # see hello
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()

    def hello(self) -> bytes:
        """The HELLO payload: this process, its slot and its method table (built once)."""
        if self._hello:
            return self._hello
        hello = wire.Hello(
            pid=os.getpid(),
            slot=self._slot,
            methods=[method_info(m) for m in self._methods],
            concurrency=self._concurrency,
            sync_methods=[m.name for m in self._methods if not m.is_async],
            wire=wire.VERSION,
        )
        self._hello = msgspec.json.encode(hello)
        return self._hello

    @property
    def slot(self) -> int:
        """The worker's slot (the broker's number for it)."""
        return self._slot

    @property
    def leaving(self) -> bool:
        """This worker said BYE (SIGTERM) and waits for the front-ends' (`stop`)."""
        return self._leaving

    def check_forked(self) -> None:
        """End a forked child the loop called back into (`_child_exits`)."""
        if _forked_from:
            _child_exits(None)

    def schedule_run(self) -> None:
        """Run the waiting calls now, unless a run is due already (`_run`)."""
        if not self._run_scheduled:
            self._run()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._fd = sock.fileno()
            threading.Thread(target=self._send_held, name="held-answers", daemon=True).start()
        self._transport.write(wire.encode_frame(wire.Kind.HELLO, 0, 0, self.hello()))
        if self._leaving:  # SIGTERM came while connecting
            self._transport.write(_BYE_FRAME)

    def going_down(self) -> None:
        """The worker is exiting (its loop was stopped, or the connection is gone): the
        calls still running are cancelled and get no answer from here. The broker
        answers them -32002 with this process's pid and exit status once it is gone; a
        -32603 CancelledError would say the handler raised it itself."""
        self._down = True

    def connection_lost(self, exc: Exception | None) -> None:
        if _forked_from:  # (a forked child's loop read EOF on /dev/null: `isolate_forks`)
            _child_exits(None)
        self._down = True
        for task in self._tasks.values():
            task.cancel()
        for chunk in self._chunks.values():
            for task in chunk.tasks:
                task.cancel()
        if not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        if _forked_from:  # (the loop calls back into a forked child: `_child_exits`)
            _child_exits(None)
        if self._take(data) and not self._run_scheduled:
            self._run()

    def _take(self, data: bytes) -> bool:
        """Decode `data` from the broker and act on its frames (calls join the backlog,
        CANCELs cancel); False on a bad frame (the connection is closed)."""
        try:
            frames = self._decoder.feed(data)
        except wire.FrameError as exc:
            log.error("worker %d: bad frame from broker: %s", self._slot, exc)
            assert self._transport is not None
            self._transport.close()
            return False
        backlog = self._backlog
        for kind, call_id, aux, payload in frames:
            if kind == CALL or kind == NOTIFY or kind == CHUNK:
                if len(payload) < _DEADLINE_SIZE or (call_id > ID_MASK and self._links):
                    log.error("worker %d: bad frame from broker: %s", self._slot,
                              "a call with no deadline" if len(payload) < _DEADLINE_SIZE else f"call id {call_id} past {ID_MASK}")
                    assert self._transport is not None
                    self._transport.close()
                    return False
                backlog.append((kind, call_id, aux, payload))
            elif kind == CANCEL:
                self._cancel(call_id)
            elif kind == BYE:
                self._bye = True
                self._closing = not self._links or self._all_bye()
            elif kind == HOLD:
                self.held_answered(0)
        return True

    def _run(self) -> None:
        """Run waiting calls for up to `SLICE_SECONDS`, then write their replies. If
        calls remain, go on in the next loop iteration, after reading what arrived
        (CANCEL frames: `_read_now`) and writing the replies: a slow sync handler neither
        holds back the replies of the calls before it nor hides a CANCEL."""
        if _forked_from:  # (not the calls still waiting a second time, in a forked child)
            _child_exits(None)
        self._run_scheduled = False
        if self._read_first:
            self._read_first = False
            if not self._read_now():
                return
        backlog = self._backlog
        if self._spent:
            self._next_turn()
        now = _perf()
        deadline = now + SLICE_SECONDS
        while backlog:
            started = now
            item = backlog[0]
            if type(item) is _Chunk:
                finished = self._advance(item, deadline)
                self._advancing = None
                if finished:
                    backlog.popleft()
                if self._surprise >= 0:
                    self._give_back(self._surprise)
                    self._surprise = -1
            else:
                kind, call_id, aux, payload = typing.cast("tuple[int, int, int, bytes]", item)
                call_deadline, flow = _deadline_of(payload)
                if call_deadline <= _monotonic():  # answered -32001 by the broker (wire.py)
                    backlog.popleft()
                    self._reply(ERROR, call_id, 0.0, _CANCELLED, NOT_RUN)  # (a whole chunk, too)
                    continue
                if self._links and flow & ALONE:  # (alone whatever the other front-ends send: worker/alone.py)
                    if self._alone_turn(typing.cast("tuple[int, int, int, bytes]", item)):
                        continue
                    break
                if (
                    kind != CHUNK and self._slow[min(aux, len(self._methods))]
                    and (self._tasks or any(chunk.waiting for chunk in self._chunks.values()))
                    and self._yield(call_id)
                ):  # fmt: skip
                    break
                backlog.popleft()
                if kind == CHUNK:
                    chunk = self._chunks[call_id] = _Chunk(call_id, aux, payload)
                    backlog.appendleft(chunk)
                    continue
                if self._call(call_id, aux, payload[_DEADLINE_SIZE:], call_deadline) and flow & RETURNABLE and backlog:
                    self._give_back(aux)
            if backlog and ((now := _perf()) > deadline or now - started >= _CHARGED_S):
                if now - started >= _CHARGED_S:  # (a call, or a chunk's calls, that took a while: charged)
                    self._charge(_flow_of(item), now - started)
                    if now - started >= SLICE_SECONDS:  # ... the whole slice: its flow's turn is over
                        self._spent = True
                if now <= deadline:
                    continue
                self._run_scheduled = self._read_first = True
                self._loop.call_soon(self._run)
                break
        if not backlog and self._active:  # (idle: every flow that comes next arrives afresh)
            self._active = set()
        self._flush()

    def stop(self) -> None:
        """Leave as the broker's stop makes a worker leave, losing no call (SIGTERM).

        Closing at the first idle moment dropped the calls the broker had written and
        this worker had not read yet (answered -32002 "worker died"), and the broker
        went on sending more. So the worker says BYE instead and serves on: the broker
        takes it out of its rotation and answers BYE, which comes after every call it
        sent; the worker answers all of those, then closes (`_closing`, as on a BYE the
        broker sends first); the broker has started another worker in its place meanwhile."""
        if _forked_from:
            _child_exits(None)
        if self._closing or self._leaving:  # told BYE already, or asked already
            return
        self._leaving = True
        if self._transport is not None and not self._transport.is_closing():
            self._write_out()  # (the answers ready so far go first)
            self._transport.write(_BYE_FRAME)
            for link in self._links:
                link.write(_BYE_FRAME)

    def _execute(
        self, index: int, params: bytes, deadline: float
    ) -> tuple[int, bytes] | asyncio.Task[tuple[bool, object]]:
        """Run one call: (kind, body) for a sync handler or a failure, or the Task
        running an async handler (its outcome comes from `_outcome`). Never raises.

        No handler starts past `deadline` (CLOCK_MONOTONIC s, the call's: wire.py): a sync
        one is checked once its params are bound (binding megabytes of them takes a large
        part of a second: hostile testing, round 20), an async one at its task's first
        step (`_guarded`); (_UNRUN, CANCEL_ACK_RAN) then for the bind (it may have run the
        app's code: a __post_init__), and CANCEL_ACK_RAN for the async one's first step, for
        the same reason. The awaitable a sync one returns is held to it too, but that handler
        has run: its call is answered CANCEL_ACK_RAN (wire.py), which the broker never gives
        as "started": false."""
        if _forked_from:  # (a child forked anywhere, a finalizer included, runs no call)
            _child_exits(None)
        try:
            method = self._methods[index]
            if method._flags is not None:  # (once this call's members are no longer held)
                self._loop.call_soon(_drop_flag_members, self._flag_classes)
            args, kwargs = method.bind(params, self._max_depth)
        except BaseException as exc:  # the handler never ran: -32602, -32601, -32600
            return _UNRUN, self._error(exc, index)
        if _forked_from:  # (forked while the params were decoded: a __post_init__; round 10)
            _child_exits(None)
        if deadline <= _monotonic():  # (the broker answered it -32001 meanwhile, while it was bound:
            # binding may have run code of the app's, a __post_init__, so not CANCEL_ACK, which
            # says nothing of it ran; hostile testing, round 62)
            return _UNRUN, wire.CANCEL_ACK_RAN
        try:
            if method.is_async:
                task = self._loop.create_task(_guarded(method.fn, args, kwargs, self._finished, deadline))
                if _forked_from:  # (3.12+, eager start: a child that awaited comes back here)
                    _child_exits(None)
                if method._flags is not None:
                    task.add_done_callback(self._flag_call_done)
                return task
            result = method.fn(*args, **kwargs)
            if _forked_from:  # a child the handler forked returned: `_child_exits`
                _child_exits(None)
            try:
                check = method.check_result  # (a tool's with an outputSchema: broker/worker/tools.py)
                return RESULT, encode_result(result) if check is None else checked_result(result, check, method.returns)
            except TypeError:  # (no JSON form: checked only now, off the fast path)
                if not inspect.isawaitable(result):
                    raise
            # A sync handler that returned a coroutine (a decorator `_is_async` could
            # not see through): run it as an async one's (not past the deadline: round 20).
            task = self._loop.create_task(_guarded(_identity, (result,), {}, self._finished, deadline))
            if method._flags is not None:  # (round 42: its Flag members stayed after it ended)
                task.add_done_callback(self._flag_call_done)
            if type(result) is _COROUTINE:  # (cancelled before its first step, it is never awaited:
                # closed then, without "coroutine ... was never awaited"; round 27)
                task.add_done_callback(functools.partial(_close_if_cancelled, result))
            return task
        except BaseException as exc:  # one ERROR reply, the worker lives on
            if _forked_from:  # (a child that raised, sys.exit() included)
                _child_exits(exc)
            return ERROR, self._error(exc, index)

    def _call(self, call_id: int, index: int, params: bytes, deadline: float) -> bool:
        """Run (or start) call `call_id` of method `index`; True if it was a sync handler's
        that blocked the loop SLOW_SYNC_US or more (`_give_back`)."""
        index = min(index, len(self._methods))  # (past the table: answered -32601)
        if self._slow[index]:
            if self._links and not self._told:  # (several front-ends: they are told first, wire.BLOCKED)
                self._tell_ahead(call_id, deadline)
            if self._out or self._out_first or self._dirty:
                # This method's last call blocked the loop: what is ready goes out now, not
                # after it (fast calls read with it would wait for the slow one otherwise).
                self._write_out()
        self._running_id = call_id  # (for `_send_held`'s thread: wire.BLOCKED)
        self._running_deadline = deadline
        t0 = self._running = _perf()
        try:
            done = self._execute(index, params, deadline)
        finally:
            self._running = 0.0
        if _forked_from:  # (forked while the result or error was encoded: a hook, a repr)
            _child_exits(None)
        if self._grab:  # (`_send_held`'s thread is writing what was ready, it goes first; or it said BLOCKED)
            self._sent_held()
        if type(done) is tuple:
            kind = done[0]
            if kind == _UNRUN:  # it says nothing of how long the method takes
                self._reply(ERROR, call_id, t0, done[1], NOT_RUN)
                return False
            slow = self._slow[index] = self._reply(kind, call_id, t0, done[1]) >= SLOW_SYNC_US
            return slow
        task = typing.cast("asyncio.Task[tuple[bool, object]]", done)
        if self._methods[index].is_async:
            self._slow[index] = False  # an async handler blocks nothing
        else:  # a sync one's awaitable: its wait blocks nothing, what came before it did (round 24)
            blocked = _perf() - t0
            self._slow[index] = blocked >= _SLOW_SYNC_S
            # (within 10 ms, returned at once, allowing for a loaded machine's delays: wire.AWAITED)
            self._awaited[task] = -1 if blocked < _AWAITED_WITHIN_S else min(int(blocked * 1e6), AWAITED - 1)
        self._tasks[call_id] = task
        if not task.done():  # (else finished at once, eagerly: answered by its done callback)
            self._task_of[task] = (call_id, index, t0)
        task.add_done_callback(lambda t: self._task_done(call_id, index, t0, t))
        return self._slow[index]

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _reply(self, kind: int, call_id: int, t0: float, body: bytes, aux: int = -1) -> int:
        """Queue one reply frame; returns its service time (µs since `t0`), its aux
        unless `aux` gives one (NOT_RUN). Times are capped below NOT_RUN."""
        service_us = min(int((_perf() - t0) * 1e6), AWAITED - 1) if aux < 0 else aux
        if len(body) > self._max_result and kind < CHUNK_REPLY:  # the broker would drop the
            kind, body = ERROR, self._too_large(kind, len(body))  # connection (chunks: _chunk_answer)
        out = self._out
        out += _pack_header(len(body), kind, call_id, service_us)
        out += body
        return service_us

    def _flush(self) -> None:
        if _forked_from:
            _child_exits(None)
        self._flush_scheduled = False
        self._write_out()
        transport = self._transport
        if self._closing and not (
            self._tasks or self._backlog or self._chunks or self._winding or self._alone_next
        ) and transport is not None:
            transport.close()
            for link in self._links:
                link.close()

    def _write_out(self) -> None:
        """Write every reply ready now (chunks' answers included) in one write."""
        if self._dirty:
            for chunk in self._dirty:
                self._emit(chunk)
            self._dirty.clear()
        transport = self._transport
        if self._links:  # (several front-ends: each link's replies to it, `links.LinkRuns`)
            self._write_links(transport)
        elif self._out and transport is not None and not transport.is_closing():
            transport.write(bytes(self._out))
            self._out.clear()
