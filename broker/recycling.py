"""Worker recycling: a worker replaced once it was sent max_calls_per_worker calls, or past max_worker_memory of resident memory (`Recycling`).

`pool.Pool` inherits these methods (a mixin with no state of its own, as broker/reloads.py's:
the attributes it reads are the pool's, declared in broker/pool_state.py).

Theory of operation
-------------------
Each worker process gets its own call limit at its launch (`_arm`): max_calls_per_worker
plus randint(0, max_calls_jitter), so that workers started together do not all recycle
together (gunicorn's max_requests and max_requests_jitter). The dispatcher counts the
calls it sends to each process (`Worker.calls`; a chunk of a batch counts its calls) and,
when the count reaches `Worker.recycle_at`, calls `worker_worn` once (the count to tell
at is then put out of reach): on the hot path that is an addition and one compare a call.
A timer every RECYCLE_CHECK_SECONDS (2 s), armed only when a limit is set, reads each
ready worker's resident memory (RSS, psutil: one read of /proc a worker) against
max_worker_memory, and retries the recycles that could not start when they came due.
A worker already over max_worker_memory when it is READY (its RSS read at its HELLO, before
any call) is not recycled for memory (its replacement would be as large: a loop) but
warned about, once.

A recycle never takes the slot out of service. The replacement is spawned outside
`workers` (`replacements`, as a reload's `incoming` are) while the old worker goes on
taking calls. When the replacement says HELLO with the pool's methods it takes the slot in
one step (no await, `_hello_replacement`): the old worker leaves the rotation, is told
BYE (after every call sent to it) and drains in `retiring`, killed if it outlasts its
calls' deadlines as a reload's old workers are; the new one joins the rotation. The
recycle is counted then (`recycles`, by reason: the metric
`rpc_broker_worker_recycles_total{reason}`) and logged, one INFO line. It is not a
restart: `rpc_broker_worker_restarts_total` does not count it.

A recycle starts only while the pool serves: not while it starts or stops, nor during a
reload (whose swap replaces every worker anyway: a replacement still booting when a
reload begins is killed, `_drop_recycles`), and not for a worker that is not READY or
asked to leave. If the old worker goes while its replacement boots (it exits, its
socket closes, it asks to leave), the recycle is dropped and the replacement killed: the
slot's usual restart (or a leave's new worker) takes over. If the replacement fails (it
exits or closes its socket before its HELLO, sends none within boot_timeout, its process
cannot be created, or it serves other methods: the code changed on disk, and a reload
is asked for as for a restarted worker), the old worker serves on; the failure is logged
(WARNING) and counted (`recycle_failures`), and the slot is not tried again for a
backoff (RECYCLE_BACKOFF_SECONDS doubling per failure in a row, at most
RECYCLE_BACKOFF_MAX_SECONDS): a deploy broken on disk does not make a spawn loop.

A slot recycles again only once its previous worker has finished its calls and exited:
until then its worker serves on past its limit (the periodic check retries), so a slot has
at most two processes. Memory is not bounded so meanwhile: a leaking worker grows past
max_worker_memory until its predecessor's longest call ends, within that call's deadline
(hostile testing, round 116, M2; docs/operations.md says so).

Several slots may recycle at once: each old worker serves until its own replacement is
ready, so no capacity is lost (their imports take CPU meanwhile; the jitter spreads
recycles by calls, and RSS grows at each worker's own pace).
"""

from __future__ import annotations

import logging
import random
import time
import typing

import psutil

from broker import wire
from broker.channel import NEVER, CodeChanged, Worker, WorkerChannel, WorkerState
from broker.pool_state import PoolState
from broker.reloads import _log_task_error, method_change

__all__ = [
    "RECYCLE_BACKOFF_MAX_SECONDS", "RECYCLE_BACKOFF_SECONDS", "RECYCLE_CHECK_SECONDS", "RECYCLE_DROPPED",
    "RECYCLE_REASONS", "Recycle", "Recycling",
]

log = logging.getLogger("broker.pool")  # (the pool's logger: these are its lines)

RECYCLE_REASONS = ("max_calls", "max_memory")  # the `reason` label of rpc_broker_worker_recycles_total
RECYCLE_CHECK_SECONDS = 2.0  # how often each ready worker's RSS is read (and recycles put off are retried)
RECYCLE_BACKOFF_SECONDS = 1.0  # a slot whose replacement failed is not recycled again before this ...
RECYCLE_BACKOFF_MAX_SECONDS = 300.0  # ... doubling per failure in a row, up to this
RECYCLE_DROPPED = "recycle dropped"  # kill_reason of a replacement no longer wanted (`_drop_recycle`)
MIB = 1024 * 1024


class Recycle(typing.NamedTuple):
    """A recycle under way: `new` boots to replace `old` (the slot's worker), for `reason`
    (one of RECYCLE_REASONS), `measure` being what reached the limit (calls sent, or RSS
    bytes)."""

    new: Worker
    old: Worker
    reason: str
    measure: int


class Recycling(PoolState):
    """`pool.Pool`'s worker recycling (see the module docstring).

    (A mixin with no state of its own: what it reads of the pool's is declared in
    `pool_state.PoolState`.)
    """

    def _arm(self, worker: Worker) -> None:
        """A process is launched for `worker`: its call count starts at 0, and its limit is
        max_calls_per_worker + randint(0, max_calls_jitter) calls (`NEVER` when off)."""
        worker.calls = 0
        if self.max_calls_per_worker:
            worker.max_calls = worker.recycle_at = self.max_calls_per_worker + random.randint(0, self.max_calls_jitter)
        else:
            worker.max_calls = worker.recycle_at = NEVER

    def _start_recycling(self) -> None:
        """The pool serves (its start is over): arm the periodic check, if a limit is set."""
        if (self.max_calls_per_worker or self.max_worker_memory) and self._recycle_timer is None and not self._stopping:
            self._recycle_timer = self.loop.call_later(RECYCLE_CHECK_SECONDS, self._recycle_check)

    def _recycle_check(self) -> None:
        """Every RECYCLE_CHECK_SECONDS: recycle each ready worker past a limit (its calls,
        put off when they came due; its RSS, read now). O(workers) reads of /proc."""
        self._recycle_timer = None
        if self._stopping:
            return
        try:
            now = time.monotonic()
            for worker in list(self.workers):
                if not self._may_recycle(worker, now):
                    continue
                calls = worker.calls + self.calls_elsewhere(worker.pid)  # (the other front-ends' too)
                if calls >= worker.max_calls:
                    self._recycle(worker, "max_calls", calls)
                elif self.max_worker_memory and not self._first_rss.get(worker.pid, False):
                    rss = _rss(worker.pid)
                    if rss > self.max_worker_memory:
                        self._recycle(worker, "max_memory", rss)
            serving = {w.pid for w in self.workers}
            for pid in [pid for pid in self._first_rss if pid not in serving]:  # (bounded: the workers')
                del self._first_rss[pid]
        finally:
            self._start_recycling()

    def _baseline(self, worker: Worker) -> None:
        """`worker` is READY (its HELLO: the app imported, no call taken yet): with
        max_worker_memory, its RSS is read now; over the limit already, it is never recycled
        for memory (`_first_rss`), and warned about: its replacement would be as large, and a
        recycle at every check a loop (hostile testing, round 115, M3: "before any call", seen
        at the 2 s check, did not hold it: replacements took calls before their first check)."""
        if not self.max_worker_memory:
            return
        rss = _rss(worker.pid)
        over = self._first_rss[worker.pid] = rss > self.max_worker_memory
        if over:
            log.warning("worker %d (pid %d) takes %.1f MiB, over max_worker_memory (%.1f MiB), from its start:"
                        " it is not recycled for memory (its replacement would be as large); raise the limit",
                        worker.slot, worker.pid, rss / MIB, self.max_worker_memory / MIB)

    def worker_worn(self, worker: Worker) -> None:
        """The dispatcher sent `worker` its max_calls-th call (`Dispatcher.worker_worn`):
        recycle it now if it may be (else the periodic check retries). Told once a process."""
        worker.recycle_at = NEVER
        if self._may_recycle(worker, time.monotonic()):
            self._recycle(worker, "max_calls", worker.calls)
        elif (previous := self._draining_in(worker.slot)) is not None:
            log.info("worker %d (pid %d) was sent %d calls, its limit: recycled once pid %d, the slot's previous"
                     " worker, has finished its calls (%d still in flight) and exited", worker.slot, worker.pid,
                     worker.calls, previous.pid, previous.outstanding)

    def _draining_in(self, slot: int) -> Worker | None:
        """An earlier worker of `slot` still finishing its calls (`retiring`), if any."""
        return next((w for w in self.retiring if w.slot == slot), None)

    def _may_recycle(self, worker: Worker, now: float) -> bool:
        """May `worker` be recycled now: the pool serving (not starting, stopping nor
        reloading), it the slot's ready worker, not leaving, with no replacement booting,
        no backoff after a failed one, and no earlier worker of its slot still finishing its
        calls (hostile testing, round 115, H1: with calls that run long, each slot's old
        workers piled up, 19 processes for 2 slots, 829 MiB, growing: now a slot has two
        processes at most, the one serving and the one before it, or its replacement)?"""
        return not (
            self._stopping or self._winding_down or self._starting or self._reloading
            or self.workers[worker.slot] is not worker or worker.state is not WorkerState.READY
            or worker.leaving or worker.channel is None or worker.slot in self.replacements
            or now < self._recycle_hold.get(worker.slot, 0.0) or self._draining_in(worker.slot) is not None
        )

    def _recycle(self, old: Worker, reason: str, measure: int) -> None:
        """Start `old`'s replacement, outside `workers`: it takes the slot at its HELLO."""
        new = Worker(old.slot)
        self.replacements[old.slot] = Recycle(new, old, reason, measure)
        log.debug("worker %d (pid %d) reached %s (%d): starting its replacement", old.slot, old.pid, reason, measure)
        if self._prepare(new):
            task = self.loop.create_task(self._launch(new))
            task.add_done_callback(_log_task_error)

    def _replacement(self, worker: Worker) -> Recycle | None:
        """The recycle `worker` boots for, if it is a replacement not in its slot yet."""
        rec = self.replacements.get(worker.slot)
        return rec if rec is not None and rec.new is worker else None

    def _hello_replacement(self, channel: WorkerChannel, rec: Recycle, names: list[str], hello: wire.Hello) -> Worker:
        """HELLO from a replacement: it takes the slot in one step (no await), and the old
        worker drains in `retiring`. Raises `CodeChanged` (a reload is asked for) if it
        serves other methods, `wire.FrameError` if the recycle is no longer wanted."""
        new, old = rec.new, rec.old
        if names != self.methods:
            new.kill_reason = f"its code {method_change(names, self.methods or [])}"
            log.warning("worker %d: pid %d, started to replace pid %d, serves other methods (%s): the app changed"
                        " on disk without a SIGHUP; reloading every worker to it", old.slot, new.pid, old.pid,
                        new.kill_reason)
            self.request_reload()
            raise CodeChanged(f"worker {new.slot} (pid {new.pid}): the app changed on disk")
        if self.workers[old.slot] is not old or old.state is not WorkerState.READY or old.channel is None:
            self._drop_recycle(old.slot, "its worker is gone")  # (dropped when it went: not reached)
            raise wire.FrameError(f"HELLO from the replacement of worker {old.slot}, which is gone")
        del self.replacements[old.slot]
        new.channel = channel
        new.concurrency = max(1, hello.concurrency)
        new.move(WorkerState.READY)
        self._baseline(new)
        self.workers[old.slot] = new
        self.dispatcher.worker_unready(old)  # (first: nothing more goes to it)
        old.move(WorkerState.DRAINING)
        old.channel.send(wire.Kind.BYE, 0, 0, b"")
        self.retiring.add(old)
        self._retire_by(old)
        self.dispatcher.worker_ready(new)
        self.recycles[rec.reason] = self.recycles.get(rec.reason, 0) + 1
        self._recycle_failures_in_row.pop(old.slot, None)
        self._recycle_hold.pop(old.slot, None)
        # (Its count now, every call sent to it: new user, round 108, read the count at the recycle's
        # start, the limit, as what it had served, though it took calls while its replacement started.)
        if rec.reason == "max_calls":  # (every front-end's: new user, round 114 read one's 39 of 50 as the count)
            sent = old.calls + self.calls_elsewhere(old.pid)
            late = sent - rec.measure
            what = f"pid {old.pid} was sent {sent} calls, its limit {old.max_calls}" + (
                f", {late} of them while its replacement started" if late > 0 else "")
        else:
            what = f"pid {old.pid} takes RSS {rec.measure / MIB:.1f} MiB, over {self.max_worker_memory / MIB:.1f} MiB"
        n = old.outstanding  # ("its 1 calls": new user, round 109)
        log.info("worker %d recycled (%s: %s): it finishes its %d call%s still in flight, then exits; pid %d serves",
                 old.slot, rec.reason, what, n, "" if n == 1 else "s", new.pid)
        self._changed.set()
        return new

    def _recycle_failed(self, rec: Recycle, problem: str) -> None:
        """`rec`'s replacement failed before its HELLO: the old worker serves on; the slot
        is not recycled again before its backoff (doubling per failure in a row)."""
        if self.replacements.get(rec.new.slot) is rec:
            del self.replacements[rec.new.slot]
        slot = rec.new.slot
        failures = self._recycle_failures_in_row[slot] = self._recycle_failures_in_row.get(slot, 0) + 1
        delay = min(RECYCLE_BACKOFF_MAX_SECONDS, RECYCLE_BACKOFF_SECONDS * 2 ** (failures - 1))
        self._recycle_hold[slot] = time.monotonic() + delay
        self.recycle_failures += 1
        log.warning("worker %d: recycling pid %d (%s) failed: its replacement %s; it serves on, and is not"
                    " recycled again for %g s", slot, rec.old.pid, rec.reason, problem, delay)

    def _drop_recycle(self, slot: int, why: str) -> None:
        """The recycle under way in `slot`, if any, is no longer wanted (its old worker is
        gone or leaving, a reload begins): kill its replacement (`_launch` kills one whose
        process is still being created)."""
        rec = self.replacements.pop(slot, None)
        if rec is None:
            return
        rec.new.kill_reason = f"{RECYCLE_DROPPED}: {why}"
        log.info("worker %d: recycling pid %d dropped (%s)", slot, rec.old.pid, why)
        if rec.new.process is not None and rec.new.process.returncode is None:
            try:
                rec.new.process.kill()
            except ProcessLookupError:
                pass

    def _drop_recycles(self, why: str) -> None:
        """Drop every recycle under way (a reload begins: its swap replaces every worker)."""
        for slot in sorted(self.replacements):
            self._drop_recycle(slot, why)


def _rss(pid: int) -> int:
    """Resident memory of process `pid` in bytes; 0 if it cannot be read (it exited)."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0
