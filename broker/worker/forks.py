"""The worker's children: dying with the broker, and the forks a handler makes.

`die_with_parent` makes the worker die (SIGKILL) when the broker does, whatever it is
doing (prctl's parent-death signal, or a thread polling getppid()). `isolate_forks`
installs fork hooks (`os.register_at_fork`) that keep a child a handler forks off the
broker's channel: in the child, the channel's descriptor becomes /dev/null, the signal
handling is a fresh process's again, and `runtime._forked_from` is set, so that the
worker's code ends the child (`runtime._child_exits`) wherever it gets control back;
`_trap_return` ends it too where the code that forked hands control back to a loop or a
pool (`_LOOP_CODES`, `_pool_runners`, `_task_frame`, `_interrupting`).

`_forked_from` is broker/worker/runtime.py's global (its hot path reads it): the hook
here rebinds it through that module, never a copy of it.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import inspect
import logging
import os
import signal
import sys
import threading
import time
import types
import typing

from broker.worker import runtime
from broker.worker.runtime import _child_exits

log = logging.getLogger("broker.worker")  # (one logger for the package: its records say `broker.worker`)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The signals the worker handles itself (SIGTERM: its loop's handler; SIGINT: see `main`)
# and what a fresh Python process does with them: a handler's forked child gets these back.
FRESH_DISPOSITIONS = ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler))
_FRESH_SIGNALS = frozenset(signum for signum, _ in FRESH_DISPOSITIONS)
PARENT_POLL_SECONDS = 0.5  # the fallback watcher's period


def die_with_parent(parent: int, *, prctl: bool = True) -> str:
    """Make this process die (SIGKILL) when process `parent` (the broker) does, whatever
    it is doing: a worker busy in a sync handler must not outlive a broker killed with
    SIGKILL. Returns how: "prctl" or "thread".

    On Linux, prctl(PR_SET_PDEATHSIG, SIGKILL) (prctl(2)): the kernel sends the signal
    when the thread that forked us exits; the broker spawns its workers from its main
    thread (the event loop's), which lives as long as the process. Elsewhere (or with
    `prctl=False`), a daemon thread polls getppid() every `PARENT_POLL_SECONDS`: once
    the parent is gone we are reparented and the parent pid changes. Either way, a
    parent that died before this call (the race between fork and prctl) is seen at
    once by comparing getppid() with `parent`.
    """
    how = "thread"
    if prctl and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):  # no libc symbol: fall back to the thread
            pass
    if os.getppid() != parent:
        log.error("the broker (pid %d) is gone: exiting", parent)
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "thread":
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_SECONDS)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return how


def _untraced(frame: types.FrameType, event: str, arg: object) -> None:
    """sys.settrace's function in a trapped child: no frame but the trapped one is traced."""
    return None


def _trap_return(
    codes: typing.Collection[types.CodeType], *, step: types.FrameType | None = None, outermost: bool = False
) -> bool:
    """In a child a handler forked: exit it (`_child_exits`) when the innermost frame of
    the stack that hands control back to code that is not the fork's own returns or
    yields. That is a frame called by one running one of `codes` (what runs the event
    loop's callbacks, a thread pool's work items and callbacks: `_LOOP_CODES`,
    `_pool_runners`), `step`, the frame of the coroutine of the asyncio task that forked
    (`_task_frame`, taken before the fork: a loop run from C, uvloop's in a thread of
    the handler's, calls it from no frame; the child has no running loop), or
    one that interrupted other code (`_interrupting`: a finalizer, a signal handler),
    whichever comes first; else (`outermost`) the thread's first frame, its end. False
    if there is none (nothing is traced then).

    The frame's own tracing (`f_trace`, with sys.settrace on in this thread only, as
    bdb's set_trace does for the frames it stops in) costs the child a call per frame it
    enters while it runs, nothing once it has exited, and the worker nothing."""
    interrupting = _interrupting()
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if frame is step or code in interrupting or code.co_name == "__del__" or (
            frame.f_back is not None and frame.f_back.f_code in codes
        ):
            break
        if outermost and frame.f_back is None:  # (the thread's first frame: its end)
            break
        frame = frame.f_back
    if frame is None:
        return False
    trapped = frame

    def on_event(f: types.FrameType, event: str, arg: object) -> typing.Any:
        if event == "return" and f is trapped:
            _child_exits(None)
        return on_event

    trapped.f_trace = on_event
    trapped.f_trace_lines = False
    sys.settrace(_untraced)
    return True


_STEP_FLAGS = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _task_frame() -> types.FrameType | None:
    """The frame of the coroutine of the asyncio task running in this thread, if any: its
    step ends as that frame yields or returns. A task whose coroutine has no frame of its
    own (an async generator's `aclose()`, closing a generator the loop finalizes): the
    outermost coroutine or async generator frame running (hostile testing, round 17: a
    child forked in such a generator's `finally`, on a thread's own uvloop loop, ran
    another task's step)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # (no loop running in this thread)
        return None
    if task is None:
        return None
    frame = getattr(task.get_coro(), "cr_frame", None)
    if frame is not None:
        return typing.cast(types.FrameType, frame)
    outer = None
    here: types.FrameType | None = sys._getframe(1)
    while here is not None:
        if here.f_code.co_flags & _STEP_FLAGS:
            outer = here
        here = here.f_back
    return outer


def _interrupting() -> set[types.CodeType]:
    """The code of what runs in the middle of other code, a call's perhaps: a finalizer
    (`weakref.finalize`, a `gc.callbacks` entry; `_trap_return` knows `__del__` by name)
    or a signal handler (a function, a method, a partial, an object's `__call__`). A
    child forked in one, going back, would run the rest of whatever it interrupted
    (hostile testing, round 16: the rest of another call, which ran twice). Not known: a
    `weakref.ref` callback, a finalizer not named `__del__`, a generator's `finally` run
    as it is collected (README)."""
    import gc
    import weakref

    handlers: list[object] = [weakref.finalize.__call__, *gc.callbacks]
    for signum in signal.valid_signals():
        try:
            handlers.append(signal.getsignal(signum))
        except (OSError, ValueError):
            pass
    codes = set()
    for handler in handlers:
        for _ in range(4):  # (a partial of a bound method of ...: unwrapped a few levels)
            code = getattr(handler, "__code__", None)
            if isinstance(code, types.CodeType):
                codes.add(code)
                break
            if isinstance(handler, functools.partial):
                handler = handler.func
            elif hasattr(handler, "__func__"):
                handler = handler.__func__
            elif callable(handler) and not isinstance(handler, type):
                handler = type(handler).__call__
            else:
                break
    return codes


def _pool_runners() -> list[types.CodeType]:
    """What the thread pools imported call a work item's function from: concurrent.futures'
    `_WorkItem.run` (run_in_executor, to_thread), multiprocessing.pool's `worker` (apply,
    and a chunk of one item) and its `mapstar`/`starmapstar` (a chunk's items, one after
    another); and their callbacks: a Future's done callbacks, a ThreadPool's result
    callbacks (its result-handling thread); and what a pool's thread runs besides: its
    `initializer` (concurrent.futures' `_worker`, multiprocessing's `worker`), the
    iterable given to `imap` (`Pool._handle_tasks`). A frame one of these calls is a
    work item's function, a callback, an initializer or the iterable's generator."""
    runners = []
    for module, names in (("concurrent.futures.thread", ("_WorkItem.run", "_worker")),
                          ("concurrent.futures._base", ("Future._invoke_callbacks",)),
                          ("multiprocessing.pool", ("worker", "mapstar", "starmapstar", "Pool._handle_tasks",
                                                    "ApplyResult._set", "MapResult._set"))):
        for name in names:
            function: typing.Any = sys.modules.get(module)
            for part in name.split("."):
                function = getattr(function, part, None)
            code = getattr(function, "__code__", None)
            if code is not None:
                runners.append(code)
    return runners


def _in_launch(module: str, owner: str, name: str) -> bool:
    """Whether this fork was made by `module`'s `owner.name` (a frame of it is on the stack)."""
    function = getattr(getattr(sys.modules.get(module), owner, None), name, None)
    code = getattr(function, "__code__", None)
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _in_multiprocessing_launch() -> bool:
    """Whether this fork is multiprocessing's (fork context): its child runs the process
    and calls os._exit, never coming back (`Popen._launch`)."""
    return _in_launch("multiprocessing.popen_fork", "Popen", "_launch")


def _in_subprocess_launch() -> bool:
    """Whether this fork is subprocess's, given a `preexec_fn` (it runs the fork hooks then;
    `Popen._execute_child`): its child runs that function and execs, or exits."""
    return _in_launch("subprocess", "Popen", "_execute_child")


# What calls the loop's callbacks: uvloop's loop (C) is run by asyncio.Runner.run (uvloop.run
# and asyncio.run both use a Runner), asyncio's by Handle._run. A frame called by one of these
# is a callback's (a task's step's): the child would be back in the loop once it returns.
_LOOP_CODES = frozenset({asyncio.runners.Runner.run.__code__, asyncio.events.Handle._run.__code__})


def isolate_forks(*channel_fds: int) -> None:
    """Keep the children a handler forks (os.fork(), multiprocessing's fork context) off
    the broker's channel, and make them die with this worker.

    Such a child has a copy of the worker: its loop, its tasks in flight and the channel's
    descriptor. Should it go back into the loop (a handler that returns in both
    processes), it would read the broker's frames and answer calls a second time (the
    broker counted them as late replies), and it would outlive the broker. In the child
    (`os.register_at_fork`), each of `channel_fds` (a socket per front-end) is replaced by /dev/null, so what it reads is
    end-of-file and what it writes goes nowhere, and the child is marked (`_forked_from`):
    where the worker's code gets control back in it (its handler returns or raises, the
    loop calls the protocol back) it exits at once (`_child_exits`), before the loop it
    shares the epoll instance of with the worker runs again or is torn down. The worker
    flushes stdout and stderr before it forks, so the child's flush at its exit writes
    only its own output. A child forked by the loop's thread also gets `die_with_parent`
    (prctl's signal is tied to the thread that forked: a child forked by a thread that
    ends early would die with it).

    The child also gets the signal handling of a fresh Python process back
    (`FRESH_DISPOSITIONS`), without the loop's wakeup fd: that is a socketpair shared
    with the worker, so a SIGTERM sent to the child (multiprocessing's terminate()) was
    caught there by the loop's handler and its number written to the WORKER's loop,
    which stopped.

    Only a fork by the worker itself is touched. A child's own forks (double-fork
    daemonisation, nested multiprocessing) run the hook too, with a copy of it: their
    parent is not the worker, so die_with_parent(worker) killed them at birth; the
    child already has /dev/null and fresh signal handling, which its forks inherit, and
    what it set up since (a file on the channel's number, its own handlers) is its own.
    The kernel clears PDEATHSIG in a fork's child: the grandchild is not tied to anyone.
    """
    worker = os.getpid()
    loop_thread = threading.get_ident()
    # Whether the fork under way is the worker's own (not a child's), per thread: two
    # threads may fork at once, and the hooks of one run between the other's (hostile
    # testing, round 13: with a list shared by all threads, a loop-thread child was taken
    # for a pool thread's, and ran the loop; a pool thread's for the loop's, and hung).
    # The child is the forking thread, with its own `local` and its ident.
    local = threading.local()

    def before() -> None:
        by_worker = local.by_worker = os.getpid() == worker
        local.step = _task_frame() if by_worker else None
        # (a loop running in this thread, in the parent: the child has none)
        local.in_loop = by_worker and asyncio.events._get_running_loop() is not None
        if by_worker:
            # Held until the child has its fresh signal handling (`after_in_child`): one
            # that came before was caught there by the worker's handler, and lost (the
            # new test, round 11: a Pool's terminate() SIGTERMs a child still starting,
            # which lived on and its join() hung the worker).
            signal.pthread_sigmask(signal.SIG_BLOCK, _FRESH_SIGNALS)
        if by_worker:  # (multiprocessing's fork does the same: the child's buffers start empty)
            for stream in (sys.stdout, sys.stderr):
                try:
                    if stream is not None:
                        stream.flush()
                except (OSError, ValueError):
                    pass

    def after_in_child() -> None:
        if not getattr(local, "by_worker", False):
            return
        local.by_worker = False
        step, local.step = local.step, None
        in_loop, local.in_loop = local.in_loop, False
        runtime._forked_from = worker  # (runtime's own global: its hot path reads it as one)
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for channel_fd in channel_fds:
                os.dup2(null, channel_fd)
            os.close(null)
        except OSError:
            pass
        try:  # (the forking thread is the child's main thread: signal calls may be made)
            signal.set_wakeup_fd(-1)
            for signum, disposition in FRESH_DISPOSITIONS:
                signal.signal(signum, disposition)
        except (OSError, ValueError):
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FRESH_SIGNALS)  # (one held now comes, as fresh)
        if _in_subprocess_launch():
            # The handler's to end, as without preexec_fn (README): prctl's signal would
            # survive the exec, and the worker's end (a reload) killed it (round 16).
            return
        if threading.get_ident() == loop_thread:
            die_with_parent(worker)
            if not _in_multiprocessing_launch():
                _trap_return([*_LOOP_CODES, *_pool_runners()], step=step)
        else:  # (the thread that forked may end before the worker: PDEATHSIG would follow it)
            die_with_parent(worker, prctl=False)
            # It exits as the work item it was forked in returns to its pool (forked in
            # `run_in_executor`, `to_thread`, a multiprocessing ThreadPool: it went on into
            # the pool's loop and waited there for good, rounds 12 and 14; where the pool's
            # own code returned, it ran the rest of a map's chunk again, or set the item's
            # Future and ran its callbacks, round 15), or as the callback or task step of
            # the thread's own asyncio loop returns to it (it went on in that loop: round
            # 15), else at the end of its thread, whatever started it (the parent-watch
            # thread would keep it alive: round 13). (A thread's own loop of another kind,
            # a queue's consumer, it goes on running: its thread's end is all it is known by.)
            if not _in_multiprocessing_launch():
                if in_loop and step is None:
                    # A plain callback of the thread's own loop, which uvloop runs from C
                    # (run_forever, run_until_complete: no frame of Python's calls it): it
                    # exits as the function that forked returns, before it goes back into
                    # that loop (hostile testing, round 18: it ran the loop's timers again).
                    _trap_return((), step=sys._getframe(1), outermost=True)
                else:
                    _trap_return([*_pool_runners(), *_LOOP_CODES], step=step, outermost=True)

    def after_in_parent() -> None:
        local.step, local.in_loop = None, False
        if getattr(local, "by_worker", False):
            local.by_worker = False
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FRESH_SIGNALS)

    os.register_at_fork(before=before, after_in_parent=after_in_parent, after_in_child=after_in_child)
