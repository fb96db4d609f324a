"""The load in one or several processes: `run` runs a `Spec` in this process or spawns
``--processes`` load processes, gathers their progress and results, and handles
SIGINT/SIGTERM for the whole run. It also re-exports the names callers use (`Spec`,
`Target`, `run`, the results and errors), so ``broker.loadgen.runner`` stays the entry.

Several processes (``--processes``): `run` spawns them (multiprocessing "spawn"),
each connects, reports ready, and starts at a common ``t0`` sent by the parent;
each sends `Progress` records while running and one `ProcessResult` at the end,
msgspec-encoded over a pipe. The parent adds the tallies and the histograms.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
import typing
from collections.abc import Callable

import msgspec

from broker.loadgen.connection import _Shared
from broker.loadgen.process import run_process
from broker.loadgen.target import ProcessDied, ProcessResult, Progress, RunError, RunInterrupted, Spec, Target

__all__ = ["ProcessDied", "ProcessResult", "Progress", "RunError", "RunInterrupted", "Spec", "Target", "run",
           "run_process"]

_now = time.monotonic


# -- several processes ----------------------------------------------------------------------

_Msg = Progress | ProcessResult
_encode = msgspec.msgpack.encode
_decode_msg = msgspec.msgpack.Decoder(_Msg).decode


def split(connections: int, processes: int) -> list[tuple[int, int]]:
    """(first, count) of each process's connections; raises ValueError if some process
    would get none."""
    if processes < 1 or connections < processes:
        raise ValueError(f"need 1 <= processes <= connections, got {processes}, {connections}")
    base, extra = divmod(connections, processes)
    out: list[tuple[int, int]] = []
    first = 0
    for p in range(processes):
        n = base + (1 if p < extra else 0)
        out.append((first, n))
        first += n
    return out


def _child(spec_bytes: bytes, first: int, count: int, pipe: multiprocessing.connection.Connection,
           want_p99: bool) -> None:
    """Entry point of a spawned load process.

    Ctrl-C is the parent's (it sends ``stop SIGNUM``, then ``hurry`` on a second one);
    SIGTERM stops this process's run the same way. If the parent is gone (its end of
    the pipe closed), the run stops at once and the process exits quietly, sending
    nothing."""
    import signal

    import uvloop

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    spec = msgspec.msgpack.decode(spec_bytes, type=Spec)
    shared: list[_Shared] = []
    gone = False

    def parent_gone() -> None:
        nonlocal gone
        gone = True
        s = shared[0]
        try:
            s.loop.remove_reader(pipe.fileno())
        except (OSError, ValueError):
            pass
        if not s.interrupted:
            s.interrupt(signal.SIGTERM)
        s.hurry = True

    def on_message() -> None:
        try:
            msg = pipe.recv_bytes()
        except (EOFError, OSError):
            parent_gone()
            return
        s = shared[0]
        if msg == b"hurry":
            s.hurry = True
            s.wake.set()
        elif msg.startswith(b"stop ") and not s.interrupted:
            s.interrupt(int(msg[5:]))

    def ready() -> float:
        try:
            pipe.send_bytes(b"ready")
            t0 = float(pipe.recv_bytes().decode())
        except (EOFError, OSError):
            parent_gone()
            return _now()
        shared[0].loop.add_reader(pipe.fileno(), on_message)
        return t0

    def progress(p: Progress) -> None:
        if gone:
            return
        try:
            pipe.send_bytes(_encode(p))
        except OSError:  # BrokenPipeError: the parent is gone
            parent_gone()

    result = uvloop.run(run_process(spec, first, count, ready=ready, on_progress=progress,
                                    want_p99=want_p99, signals=(signal.SIGTERM,),
                                    on_shared=shared.append))
    if not gone:
        try:
            pipe.send_bytes(_encode(result))
        except OSError:
            pass
    pipe.close()



def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run(spec: Spec, on_progress: Callable[[Progress], None] | None = None,
        want_p99: bool = False) -> list[ProcessResult]:
    """Run ``spec`` in ``spec.processes`` load processes (in this one when 1) and return
    each process's result. ``on_progress`` gets the *summed* counters (p99: the largest
    of the processes' p99s) about every `TICK_S` s. Raises `RunError` if the target is
    bad or a load process does not become ready within ``timeout + 30`` s, and
    `ProcessDied` (with the others' results) if one dies.

    SIGINT and SIGTERM (when called in the main thread) stop the run early: sending
    stops, answers in flight are awaited briefly, and the results measured so far come
    back with ``interrupted`` set to the signal; a second signal cuts the drain short.
    Before the load has started they raise `RunInterrupted`."""
    import signal

    Target.parse(spec.target)
    signals = (signal.SIGINT, signal.SIGTERM) if _main_thread() else ()
    if spec.processes <= 1:
        import uvloop

        return [uvloop.run(run_process(spec, 0, spec.connections, on_progress=on_progress,
                                       want_p99=want_p99, signals=signals))]
    return _run_processes(spec, on_progress, want_p99, signals)


def _run_processes(spec: Spec, on_progress: Callable[[Progress], None] | None, want_p99: bool,
                   signals: tuple[int, ...]) -> list[ProcessResult]:
    import signal
    import socket
    import types

    parts = split(spec.connections, spec.processes)
    ctx = multiprocessing.get_context("spawn")
    spec_bytes = msgspec.msgpack.encode(spec)
    procs: list[multiprocessing.process.BaseProcess] = []
    pipes: list[multiprocessing.connection.Connection] = []
    # Signal handlers only note the signal; the wake-up fd makes `wait` return at once.
    got: list[int] = []
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    old_handlers: dict[int, Callable[[int, types.FrameType | None], object] | int | None] = {}
    old_wakeup = -1
    if signals:
        old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        for sig in signals:
            old_handlers[sig] = signal.signal(sig, lambda signum, _frame: got.append(signum))

    def tell(i: int, msg: bytes) -> None:
        try:
            pipes[i].send_bytes(msg)
        except OSError:
            pass  # that process is gone: its sentinel says so

    try:
        for first, count in parts:
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_child, args=(spec_bytes, first, count, child_end, want_p99),
                            daemon=True, name=f"rpc-broker-bench-{first}")
            p.start()
            child_end.close()
            procs.append(p)
            pipes.append(parent_end)
        deadline = _now() + spec.timeout + 30
        for pipe, proc in zip(pipes, procs):
            while not pipe.poll(0.1):
                if got:
                    raise RunInterrupted(got[0])
                if not proc.is_alive() or _now() > deadline:
                    raise RunError(f"load process {proc.name} did not start (exit code {proc.exitcode})")
            if pipe.recv_bytes() != b"ready":
                raise RunError("load process protocol error")
        if got:
            raise RunInterrupted(got[0])
        t0 = _now() + 0.05
        for pipe in pipes:
            pipe.send_bytes(repr(t0).encode())
        latest: dict[int, Progress] = {}
        results: dict[int, ProcessResult] = {}
        dead: dict[int, str] = {}
        stopped = hurried = False
        by_fd = {pipe.fileno(): i for i, pipe in enumerate(pipes)}
        end = t0 + spec.warmup + spec.duration + spec.timeout + 30
        while len(results) + len(dead) < len(pipes):
            live = [i for i in range(len(pipes)) if i not in results and i not in dead]
            if (got or dead) and not stopped:
                stopped = True  # interrupted, or one died: the others stop and report
                for i in live:
                    tell(i, b"stop %d" % (got[0] if got else signal.SIGTERM))
            if len(got) > 1 and not hurried:
                hurried = True
                for i in live:
                    tell(i, b"hurry")
            if _now() > end:
                raise RunError("load processes did not finish in time")
            ready = multiprocessing.connection.wait(
                [*(pipes[i] for i in live), *(procs[i].sentinel for i in live), wake_r], timeout=0.5)
            for obj in ready:
                if obj is wake_r:
                    try:
                        wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                    continue
                if isinstance(obj, int):
                    continue  # a process exited: its pipe says whether it finished
                pipe = typing.cast(multiprocessing.connection.Connection, obj)
                i = by_fd[pipe.fileno()]
                try:
                    msg = _decode_msg(pipe.recv_bytes())
                except (EOFError, OSError):
                    procs[i].join(1)
                    dead[i] = f"load process {procs[i].name} died (exit code {procs[i].exitcode})"
                    continue
                if isinstance(msg, ProcessResult):
                    results[i] = msg
                else:
                    latest[i] = msg
                    if on_progress is not None:
                        on_progress(Progress(
                            sum(m.calls for m in latest.values()), sum(m.errors for m in latest.values()),
                            sum(m.failures for m in latest.values()),
                            sum(m.transport_errors for m in latest.values()),
                            max(m.p99_ms for m in latest.values())))
        done = [results[i] for i in sorted(results)]
        if got:
            done = [msgspec.structs.replace(r, interrupted=got[0]) for r in done]
        if dead:
            raise ProcessDied(next(iter(dead.values())), done)
        return done
    finally:
        if signals:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(old_wakeup)
        wake_r.close()
        wake_w.close()
        for pipe in pipes:
            pipe.close()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
