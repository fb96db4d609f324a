"""A test app whose handlers fork, use multiprocessing and start subprocesses as real
handlers do (hostile testing: a child forked by a handler inherited the worker's signal
handling, nested forks were killed at birth, and subprocesses ignored SIGINT)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
import typing

import msgspec

from broker.worker import Registry

registry = Registry()


@registry.method
def pid() -> int:
    return os.getpid()


@registry.method
def fork_sigterm() -> int:
    """Fork a child that SIGTERMs itself; return how the child ended (its exit code as
    subprocess reports it: -15 for killed by SIGTERM)."""
    child = os.fork()
    if child == 0:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)
        finally:
            os._exit(7)  # SIGTERM was ignored (or handled): the worker's disposition
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


def _in_child(code: int | None) -> int:
    """What a child does that does not os._exit: sys.exit(code), a common idiom (the worker
    catches SystemExit), or with `code` None it returns into the worker."""
    print(f"child {os.getpid()} leaves with {code}", file=sys.stderr)
    if code is None:
        return -1
    sys.exit(code)


@registry.method
def fork_exit(code: int | None = 0) -> int:
    """Fork a child that comes back into the worker (`_in_child`; hostile testing, round 8:
    its loop's teardown broke the worker's); return the child's pid, not waited for
    (`reap` does)."""
    child = os.fork()
    if child == 0:
        return _in_child(code)
    return child


@registry.method
async def afork_exit(code: int | None = 0) -> int:
    """`fork_exit` from an async handler."""
    child = os.fork()
    if child == 0:
        return _in_child(code)
    return child


@registry.method
def reap(child: int) -> int:
    """Wait for a child `fork_exit` started; its exit code as subprocess reports it."""
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


def _square(x: int) -> int:
    return x * x


@registry.method
def fork_pool(n: int) -> list[int]:
    """A fork-context multiprocessing Pool; leaving `with` calls pool.terminate()."""
    with multiprocessing.get_context("fork").Pool(2) as pool:
        return pool.map(_square, range(n))


@registry.method
def double_fork(path: str) -> int:
    """Daemonise (fork, setsid, fork); the grandchild writes its pid to `path`."""
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.rename(path + ".tmp", path)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


def _inner() -> None:
    pass


def _outer() -> None:
    inner = multiprocessing.get_context("fork").Process(target=_inner)
    inner.start()
    inner.join(10)
    os._exit(0 if inner.exitcode == 0 else 10 + (inner.exitcode or 0) % 100)


@registry.method
def nested_process() -> int | None:
    """A fork-context Process that starts another: the outer's exit code (0 when the
    inner one ran and exited 0)."""
    outer = multiprocessing.get_context("fork").Process(target=_outer)
    outer.start()
    outer.join(20)
    return outer.exitcode


@registry.method
def sigint_subprocess() -> int | None:
    """Start `sleep 30`, send it SIGINT, return its return code (-2: killed by SIGINT)."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(5)
        except subprocess.TimeoutExpired:
            return None  # it ignored SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _ForkingResult:
    """A result whose JSON form is made by a child process: its `tolist`, which the
    worker's encoder calls after the handler returned, forks, and the child returns its
    value into the encoder (hostile testing, round 9: the child went on into the loop and
    ran the other calls waiting there a second time)."""

    def tolist(self) -> list[str]:
        child = os.fork()
        if child == 0:
            return ["computed in child"]
        os.waitpid(child, 0)
        return ["computed in parent"]


@registry.method
def fork_in_encode() -> object:
    return _ForkingResult()


@registry.method
async def afork_in_encode() -> object:
    return _ForkingResult()


@registry.method
async def arecord(path: str, tag: int) -> int:
    """Append "tag pid" to `path` after one step of the loop: a call's side effect."""
    import asyncio

    await asyncio.sleep(0)
    with open(path, "a") as f:
        f.write(f"{tag} {os.getpid()}\n")
    return tag


@registry.method
async def afork_genexit() -> int:
    """An async handler whose child raises GeneratorExit (round 10: it went through to the
    loop, which ran another call's handler in the child)."""
    child = os.fork()
    if child == 0:
        raise GeneratorExit
    return child


class ForkingParams(msgspec.Struct):
    """Params whose decoding forks (`__post_init__` runs while the worker binds them);
    the child marks what it decoded (round 10: the child then ran the handler too)."""

    path: str
    x: int

    def __post_init__(self) -> None:
        if os.fork() == 0:
            self.x = -1


@registry.method
def charge(p: ForkingParams) -> int:
    """Append "x pid" to `p.path`: a side effect that must happen once per call."""
    with open(p.path, "a") as f:
        f.write(f"{p.x} {os.getpid()}\n")
    return p.x


@registry.method
async def atick(path: str, tag: int, steps: int = 5) -> int:
    """Append "tag step pid" to `path` in each of `steps` steps: side effects made by steps
    of a call that another call's child could run a second time."""
    import asyncio

    for step in range(steps):
        with open(path, "a") as f:
            f.write(f"{tag} {step} {os.getpid()}\n")
        await asyncio.sleep(0.02 if step else 0)
    return tag


@registry.method
async def afork_await(path: str) -> int:
    """An async handler whose child awaits before it returns (rounds 9 and 10, documented
    then: the child ran the worker's loop, and other calls' steps in it), then notes
    that it got past the await."""
    import asyncio

    child = os.fork()
    await asyncio.sleep(0)
    with open(path, "a") as f:
        f.write(f"after-await {'child' if child == 0 else 'parent'} {os.getpid()}\n")
    return child


@registry.method
def fork_later(path: str) -> str:
    """A loop callback that forks, its child returning into the loop (round 9)."""
    import asyncio

    def callback() -> None:
        if os.fork() == 0:
            with open(path, "a") as f:
                f.write(f"callback-child {os.getpid()}\n")

    asyncio.get_running_loop().call_soon(callback)
    return "scheduled"


@registry.method
async def agather(path: str, tag: int) -> int:
    """Two subtasks of this call (asyncio.gather, a TaskGroup), each appending "tag part
    step pid" to `path` in each of 5 steps: steps a child back in the loop could run a
    second time (round 12: the tasks a handler makes were not checked)."""
    import asyncio

    async def part(name: str) -> None:
        for step in range(5):
            with open(path, "a") as f:
                f.write(f"{tag} {name} {step} {os.getpid()}\n")
            await asyncio.sleep(0.02 if step else 0)

    await asyncio.gather(part("g0"), part("g1"))
    async with asyncio.TaskGroup() as group:
        group.create_task(part("t0"))
        group.create_task(part("t1"))
    return tag


@registry.method
async def afork_in_subtask(path: str) -> int:
    """A subtask that forks; its child awaits before it ends itself (round 12)."""
    import asyncio

    async def sub() -> int:
        child = os.fork()
        await asyncio.sleep(0)
        with open(path, "a") as f:
            f.write(f"subtask-after-await {'child' if child == 0 else 'parent'} {os.getpid()}\n")
        return child

    return await asyncio.create_task(sub())


@registry.method
async def fork_in_executor() -> int:
    """A fork in a thread pool's thread whose child returns (round 12: the child went back
    into the pool's worker loop and waited there forever, outliving the worker)."""
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(None, os.fork)


@registry.method
def legacy_coroutine(x: int) -> object:
    """A sync handler returning a generator-based coroutine, awaited as an async one's
    (round 12: a step-by-step driver of the awaitable refused it, -32603)."""
    import types

    @types.coroutine
    def legacy() -> typing.Generator[None, None, int]:
        yield  # (a bare yield: a loop iteration, as asyncio.sleep(0))
        return x * 2

    return legacy()


class _IterAwaitable:
    def __await__(self) -> typing.Iterator[None]:  # (any iterator will do, says the language reference)
        return iter([None, None])


@registry.method
def iter_awaitable() -> object:
    return _IterAwaitable()


_TERM_IN_CHILD = [False]


def _term_at_birth() -> None:  # (registered at import: it runs before the worker's own hook)
    if _TERM_IN_CHILD[0]:
        os.kill(os.getpid(), signal.SIGTERM)


os.register_at_fork(after_in_child=_term_at_birth)


@registry.method
def fork_term_at_birth() -> int:
    """A child that gets SIGTERM as it starts, before the worker's fork hook gave it a fresh
    process's signal handling (the new-user check, round 11: a Pool's terminate() reached a
    child still starting; the worker's inherited handler took the signal, which was lost,
    and the child lived on). Its exit status, as subprocess gives it: -15 when SIGTERM
    killed it."""
    _TERM_IN_CHILD[0] = True
    try:
        child = os.fork()
    finally:
        _TERM_IN_CHILD[0] = False
    if child == 0:
        time.sleep(0.5)  # (a signal pending would have come by now)
        os._exit(7)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


@registry.method
def fork_in_thread() -> int:
    """A plain thread forks, and its child returns from the thread's function (round 13:
    the child's parent-watch thread kept it alive; a handler waiting for it hung)."""
    import threading

    child: list[int] = []
    thread = threading.Thread(target=lambda: child.append(os.fork()))
    thread.start()
    thread.join()
    if not child or child[0] == 0:  # (in the child: its thread ends here)
        return 0
    return child[0]


_SLOW_HOOK = [False]


def _slow_hook() -> None:  # (a library's fork hook that takes a while, as grpc's may)
    if _SLOW_HOOK[0]:
        time.sleep(0.002)


os.register_at_fork(before=_slow_hook, after_in_parent=_slow_hook, after_in_child=_slow_hook)


@registry.method
async def fork_race(path: str, rounds: int) -> list[int]:
    """Fork from the loop's thread (a callback) and a pool thread at once, `rounds` times,
    every child returning where it was forked (round 13: the worker's hooks kept which
    thread forked in one place for all threads, so a loop-thread child could be taken for
    a pool thread's and run the loop, a pool thread's for the loop's and hang). A marker
    callback is ready in the loop at each fork: a child that ran the loop would write its
    pid to `path`. Returns the children's exit statuses."""
    import asyncio

    loop = asyncio.get_running_loop()
    children: list[int] = []

    def marker() -> None:
        if os.getpid() != worker:
            with open(path, "a") as f:
                f.write(f"{os.getpid()}\n")

    def fork_here() -> None:
        loop.call_soon(marker)
        child = os.fork()
        if child:
            children.append(child)

    worker = os.getpid()
    _SLOW_HOOK[0] = True
    try:
        for _ in range(rounds):
            loop.call_soon(fork_here)
            child = await loop.run_in_executor(None, os.fork)
            if child == 0:
                return []  # (the pool thread's child: it must exit as this returns there)
            children.append(child)
            await asyncio.sleep(0)
    finally:
        _SLOW_HOOK[0] = False
    statuses = []
    for child in children:
        for _ in range(300):  # (3 s at most each: a child that does not exit is a failure)
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                statuses.append(os.waitstatus_to_exitcode(status))
                break
            await asyncio.sleep(0.01)
        else:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            statuses.append(-999)
    return statuses


def _fork_returning(child: list[int]) -> None:
    child.append(os.fork())


@registry.method
def fork_in_raw_thread() -> int:
    """As `fork_in_thread`, from a `_thread` thread (round 14: not trapped, the child lived on)."""
    import _thread

    child: list[int] = []
    done = threading_event()
    _thread.start_new_thread(lambda: (_fork_returning(child), done.set()), ())
    done.wait(10)
    return child[0] if child and child[0] else 0


@registry.method
def fork_in_thread_pool() -> int:
    """As `fork_in_thread`, from a multiprocessing ThreadPool's thread (round 14: the child
    went back into the pool's loop and waited there)."""
    from multiprocessing.pool import ThreadPool

    with ThreadPool(1) as pool:
        child = pool.apply(os.fork)
    return child


def threading_event():  # type: ignore[no-untyped-def]
    import threading

    return threading.Event()


def _item_forking_at_zero(path: str, x: int) -> int:
    """A work item that notes its run in `path` (`item X PID`); item 0 forks, and its
    child returns from the item as the worker's does."""
    with open(path, "a") as f:
        f.write(f"item {x} {os.getpid()}\n")
    if x == 0 and os.fork() == 0:
        return -1
    return x


@registry.method
def fork_in_pool_chunk(path: str) -> list[int]:
    """A multiprocessing ThreadPool maps 4 items in one chunk; the first forks and its child
    returns (round 15: the child, trapped only where the chunk returned, ran the chunk's
    other 3 items a second time)."""
    import functools
    from multiprocessing.pool import ThreadPool

    with ThreadPool(1) as pool:
        return pool.map(functools.partial(_item_forking_at_zero, path), range(4), chunksize=4)


@registry.method
def fork_in_future(path: str) -> int:
    """A concurrent.futures work item that forks, its Future with a done callback that notes
    its run in `path` (`callback PID`) (round 15: the child set the Future's result, which ran
    the callbacks in it)."""
    import concurrent.futures

    def noted(future: concurrent.futures.Future[int]) -> None:
        with open(path, "a") as f:
            f.write(f"callback {os.getpid()}\n")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(_item_forking_at_zero, path, 0)
        future.add_done_callback(noted)
        return future.result()


@registry.method
def fork_in_thread_loop() -> int:
    """A thread runs its own asyncio loop for 30 s; a task of it forks, and the child
    returns from the task (round 15: it went back into that thread's loop, and lived for
    as long as the loop ran). The child's pid, once forked; the thread runs on."""
    import asyncio
    import threading

    child: list[int] = []
    forked = threading.Event()

    async def forking() -> None:
        _fork_returning(child)
        forked.set()

    async def main() -> None:
        asyncio.get_running_loop().create_task(forking())
        await asyncio.sleep(30)

    threading.Thread(target=lambda: asyncio.run(main()), daemon=True).start()
    forked.wait(10)
    return child[0] if child and child[0] else 0


@registry.method
def fork_in_pool_callback() -> int:
    """A multiprocessing ThreadPool's result callback forks, and its child returns (round
    15: it went back into the pool's result-handling loop, and waited there for good)."""
    from multiprocessing.pool import ThreadPool

    child: list[int] = []
    with ThreadPool(1) as pool:
        pool.apply_async(int, (1,), callback=lambda _: _fork_returning(child)).wait(10)
        time.sleep(0.1)  # (the callback runs after the result is set)
    return child[0] if child and child[0] else 0


@registry.method
def spawn_with_preexec(seconds: int) -> int:
    """A daemon started by subprocess with a `preexec_fn` (which runs the fork hooks): its
    pid. It is the handler's (round 16: the worker's hook tied it to the worker's life,
    and a reload killed it; without preexec_fn it lived on)."""
    import subprocess

    return subprocess.Popen(["sleep", str(seconds)], preexec_fn=os.setsid).pid


def _note(path: str, what: str) -> None:
    with open(path, "a") as f:
        f.write(f"{what} {os.getpid()}\n")


@registry.method
def fork_in_thread_uvloop(path: str) -> int:
    """A thread runs a uvloop loop (run_forever, from C: no Python frame runs its
    callbacks); a task on it forks while three others wait, each to note `other` (round
    16: the child ran the other tasks, and the loop it shares with the worker stalled)."""
    import asyncio
    import threading

    import uvloop

    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def other() -> None:
        await asyncio.sleep(0.3)
        _note(path, "other")

    async def forking() -> None:
        _fork_returning([])

    try:
        others = [asyncio.run_coroutine_threadsafe(other(), loop) for _ in range(3)]
        asyncio.run_coroutine_threadsafe(forking(), loop).result(10)
        for future in others:
            future.result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    return 3


@registry.method
def fork_in_initializer(path: str) -> int:
    """A ThreadPoolExecutor whose initializer forks, and the child returns (round 16: it
    went on to run the pool's work item a second time)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1, initializer=_fork_returning, initargs=([],)) as pool:
        pool.submit(_note, path, "item").result(10)
    return 1


@registry.method
def fork_in_imap_generator(path: str) -> list[int]:
    """A ThreadPool's imap over a generator that forks as it is iterated (in the pool's
    task-handling thread), noting each item (round 16: the child went on iterating)."""
    from multiprocessing.pool import ThreadPool

    def items() -> typing.Iterator[int]:
        for i in range(4):
            _note(path, f"item{i}")
            if i == 1:
                _fork_returning([])
            yield i

    with ThreadPool(2) as pool:
        return list(pool.imap(abs, items()))


@registry.method
def fork_in_done_callback(path: str) -> int:
    """A Future's first done callback forks, on the loop's thread; two more note `callback`
    (round 16: the child ran them, other calls' callbacks perhaps, a second time)."""
    import concurrent.futures

    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    future.add_done_callback(lambda _: _fork_returning([]))
    for _ in range(2):
        future.add_done_callback(lambda _: _note(path, "callback"))
    future.set_result(1)
    return 2


class _ForksWhenCollected:
    def __init__(self) -> None:
        self.me = self  # (a cycle: freed by the collector, in whatever code runs then)

    def __del__(self) -> None:
        _fork_returning([])


@registry.method
def fork_in_finalizer(path: str) -> int:
    """A finalizer forks in the middle of other code (the collector runs it there), and
    the child returns from it (round 16: it ran the rest of that code, another call's)."""
    import gc

    _ForksWhenCollected()
    gc.collect()
    _note(path, "after")
    return 1


@registry.method
def fork_in_signal_handler(path: str) -> int:
    """A signal handler forks in the middle of other code, and the child returns from it
    (round 16: it ran the rest of the code the signal interrupted, another call's)."""
    import functools

    class Handler:  # (an object's __call__, through a partial)
        def __call__(self, child: list[int], signum: int, frame: object) -> None:
            _fork_returning(child)

    before = signal.signal(signal.SIGUSR1, functools.partial(Handler(), []))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # (the handler runs in there)
        _note(path, "after")
    finally:
        signal.signal(signal.SIGUSR1, before)
    return 1


@registry.method
def fork_in_agen_cleanup_in_thread_loop(path: str) -> int:
    """A thread runs a uvloop loop (run_until_complete); an async generator dropped while
    suspended is closed by the loop (its `aclose()` task, whose coroutine has no frame of
    its own), and its `finally` forks; another task notes `other` at each step (round 17:
    the child ran one of them)."""
    import asyncio
    import threading

    import uvloop

    async def agen() -> typing.AsyncIterator[int]:
        try:
            yield 1
            await asyncio.sleep(10)
        finally:
            _fork_returning([])

    async def other() -> None:
        for _ in range(6):
            await asyncio.sleep(0.05)
            _note(path, "other")

    async def main() -> None:
        task = asyncio.ensure_future(other())
        g = agen()
        await g.__anext__()
        del g
        await task

    def run() -> None:
        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    return 6


@registry.method
def fork_in_thread_uvloop_callback(path: str) -> int:
    """A thread runs a uvloop loop (run_forever) with a timer that notes `tick` five times,
    0.1 s apart; a plain callback of that loop forks, and the child returns from it
    (round 18: no task, no Python frame running the loop: the child ran the loop, and its
    timers, again)."""
    import threading

    import uvloop

    loop = uvloop.new_event_loop()
    ticks = threading.Event()

    def tick(n: int) -> None:
        _note(path, "tick")
        if n < 5:
            loop.call_later(0.1, tick, n + 1)
        else:
            ticks.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    loop.call_soon_threadsafe(tick, 1)
    loop.call_soon_threadsafe(_fork_returning, [])
    try:
        ticks.wait(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    return 5
