"""Reloads: the app deployed anew to every worker, in one swap (`Reloads`).

`pool.Pool` inherits these methods (a mixin with no state of its own: the attributes it
reads are the pool's, declared in broker/pool_state.py for the type checker). Besides
them, the kill reasons and the few helpers both modules use are here (broker/pool.py
imports them; the processes' own, spawning and killing, are broker/spawning.py's).

A reload (SIGHUP, `reload`) deploys the app anew, whatever methods it now has: a new
Worker for every slot is spawned outside `workers` (`incoming`); each says HELLO and
is READY but takes no call. Once all are, `_swap` acts in one step (no await): the old
workers leave the rotation, the new method table is installed (`Dispatcher.set_methods`
translates the calls already routed), the new workers join, and the old ones get BYE
and drain. Old and new code never take calls at the same time, so a call's method
index always means the same method to the worker it reaches. If a new worker fails,
the new ones are killed and nothing else changes: only `workers` are ever restarted.
Reloads are asked for with `request_reload`, which coalesces: one asked for during a
reload, or while the pool starts, runs once that ends (nginx's and gunicorn's SIGHUP),
so the code on disk last is the code deployed.

During a reload no slot is restarted: a restart would import the code being deployed
and take calls beside the old code (hostile testing: old and new answered in turn, and
a method the new code added made a false "changed on disk without a SIGHUP"). A slot
whose worker exits then (it left, it crashed, or its restart's backoff ends then) waits
for the reload (`_awaiting_reload`, calls wait for it or go to the other workers): its
new worker takes the slot at the swap. If the reload fails, those slots are restarted
then, on the code on disk, and the log says so (a WARNING: that code may not be the old
workers'). A worker started before the reload whose HELLO comes during it with other
methods is refused the same way (`SUPERSEDED`), not as code changed without a SIGHUP.
Each exit is counted when it is reaped, under its own restart reason (killed, exited,
left...; "reload" for one SUPERSEDED), whatever the reload's outcome: otherwise "reload"
counts only the workers the swap replaced while they ran (one that asked to leave during
the reload and drains in its slot is counted "left" there).
"""

from __future__ import annotations

import asyncio
import logging
import typing

from broker import wire
from broker.channel import Worker, WorkerChannel, WorkerState
from broker.pool_state import PoolState
from broker.spawning import boot_error, describe_status, kill, kill_if_alive
from broker.worker import WORKER_BOOT_ERROR

__all__ = ["CODE_CHANGED", "SUPERSEDED", "WIRE_MISMATCH", "Reloads", "method_change"]

log = logging.getLogger("broker.pool")  # (the pool's logger: these are its lines)


CODE_CHANGED = "code changed on disk"  # kill_reason of a restarted worker whose HELLO was refused
WIRE_MISMATCH = "another wire version"  # kill_reason of a restarted worker whose HELLO was (`Pool.wire_mismatch`)
SUPERSEDED = "superseded by the reload"  # kill_reason of one refused so during a reload (`Pool.hello`)


class Reloads(PoolState):
    """`pool.Pool`'s reloads: `request_reload`, `reload` and its swap (see the module docstring).

    (A mixin with no state of its own: what it reads of the pool's is declared in
    `pool_state.PoolState`.)
    """

    def request_reload(self) -> None:
        """Ask for a reload (SIGHUP; a restarted worker found new code on disk).

        Requests coalesce, as in nginx and gunicorn, so the latest code on disk gets
        deployed: with none under way a reload starts now; one asked for while a
        reload runs, or while the pool starts, runs once that ends (any number of
        requests meanwhile make one more reload, which imports what is on disk then).
        Ignored once the pool is stopping.
        """
        if self._stopping or self._winding_down:
            return
        if self._starting or self._reload_task is not None:
            if not self._reload_wanted:
                log.info("reload: asked for while %s; it runs once that ends",
                         "the broker starts" if self._starting else "a reload is under way")
            self._reload_wanted = True
            return
        self._reload_task = self.loop.create_task(self._reloads())
        self._reload_task.add_done_callback(_log_task_error)

    def wind_down(self) -> None:
        """The broker's stop has begun (its drain, before `stop`): a reload asked for and
        not started yet (queued behind one under way, or the start) is dropped, and none is
        asked for after: its new workers would import the app only to be stopped (hostile
        testing, round 33: SIGHUP, SIGHUP, SIGTERM started a second set of workers 2 s into
        the stop). A reload under way goes on."""
        self._winding_down = True
        if self._reload_wanted:
            self._reload_wanted = False
            log.info("reload: the one asked for will not run: the broker is stopping")

    async def _reloads(self) -> None:
        try:
            while True:
                self._reload_wanted = False
                if self.on_reload is not None:  # (begins: it deploys what is on disk now)
                    self.on_reload(None, "")
                ok = await self.reload()
                if self.on_reload is not None:
                    self.on_reload(ok, self.reload_failure)
                if not self._reload_wanted or self._stopping:
                    return
                log.info("reload: another was asked for while this one ran: reloading again")
        finally:
            self._reload_task = None

    async def reload(self, timeout: float | None = None) -> bool:
        """Deploy the app anew (SIGHUP): start a fresh worker for every slot (each imports
        the app anew), wait until all are READY, then swap in one step: the new workers'
        method table replaces the old one, the new workers take calls, and the old ones
        get BYE, finish their calls in flight and exit. No call is lost; capacity is
        briefly doubled (both sets of processes run), never reduced.

        The new code may serve other methods: old and new workers never take calls at
        the same time, so a call only ever goes to a worker serving its table (calls
        routed before the swap are translated by `Dispatcher.set_methods`; calls to a
        method the new code lost answer -32601).

        Returns False, leaving the old workers serving and spawning nothing more, if a
        new worker fails to start (exits, closes its socket, is not ready within
        `timeout` s, or serves another method list than its new peers): a broken deploy
        does not take the pool down. The outcome is logged and counted in `reloads`.
        `timeout` defaults to `boot_timeout`. Returns False at once if a reload is under
        way already (`request_reload` queues one instead).
        """
        if self._stopping:
            self.reload_failure = "the broker is stopping"
            return False
        if self._reloading:
            log.warning("reload: one is already under way; this one is ignored")
            return False
        self.reload_failure = ""
        if timeout is None:
            timeout = self.boot_timeout
        self._reloading = True
        self._drop_recycles("a reload replaces every worker")
        self.incoming = [Worker(slot) for slot in range(self.size)]
        self._incoming_methods = None
        self._incoming_sync = []
        self._incoming_infos = []
        self._incoming_error = ""
        try:
            for worker in self.incoming:
                await self._spawn(worker)
            failure = await self._wait_incoming(timeout)
            if failure:
                self.reload_failure = failure
            if failure and self._stopping:
                self._awaiting_reload.clear()
                return False
            if failure:
                for worker in self.incoming:
                    if worker.channel is not None:
                        worker.channel.close()
                    if worker.process is not None:
                        kill_if_alive(worker.process)
                self.reloads["failure"] += 1
                log.error("reload failed: %s; keeping the old workers (the old code serves on)", failure)
                self._restart_awaiting("its worker left or exited during the reload, which failed")
                self._replace_leaving()
                down = [w.slot for w in self.workers if w.kill_reason.startswith(CODE_CHANGED)]
                if down:
                    log.error("worker slot %s stays down until a reload succeeds: the code on disk"
                              " serves other methods than the running workers", ", ".join(map(str, down)))
                return False
            self._awaiting_reload.clear()  # (their slots are the new workers')
            self._swap(self.incoming, typing.cast(list[str], self._incoming_methods), self._incoming_sync,
                       self._incoming_infos)
            self.reloads["success"] += 1
            if self.after_reload is not None:
                self.after_reload()
            log.info("reload: %s replaced", "the worker" if self.size == 1 else f"all {self.size} workers")
            return True
        finally:
            self.incoming = []
            self._reloading = False

    async def _wait_incoming(self, timeout: float) -> str:
        """Wait until every new worker of a reload is READY; "" then, else what failed."""
        deadline = self.loop.time() + timeout
        while True:
            if self._incoming_error:
                return self._incoming_error
            if self._stopping:
                return "the broker is stopping"
            for w in self.incoming:
                if w.exited is not None and w.exited.done():
                    status = w.exited.result()
                    why = boot_error(self._path, w.pid) if status == WORKER_BOOT_ERROR else ""
                    return (f"new worker {w.slot} (pid {w.pid}) {describe_status(status)} before it was ready"
                            + (f": it could not boot the app: {why}" if why else
                               ": it could not boot the app (its log above says why)" if status == WORKER_BOOT_ERROR
                               else ""))
                if w.state is WorkerState.DEAD:
                    return f"new worker {w.slot} (pid {w.pid}) closed its connection before it was ready"
            if all(w.state is WorkerState.READY for w in self.incoming):
                return ""
            left = deadline - self.loop.time()
            if left <= 0:
                starting = [w.slot for w in self.incoming if w.state is not WorkerState.READY]
                return f"new workers {starting} not ready after {timeout} s"
            self._changed.clear()
            waits: list[asyncio.Future[object]] = [asyncio.ensure_future(self._changed.wait())]
            waits += [typing.cast("asyncio.Future[object]", w.exited) for w in self.incoming if w.exited is not None]
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            waits[0].cancel()

    def _swap(self, incoming: list[Worker], names: list[str], sync_methods: list[str],
              methods: list[wire.MethodInfo]) -> None:
        """Put the ready new workers of a reload in place of the old ones, in one step
        (no await: no call is routed half-way). `methods`: their HELLO's `MethodInfo`s, the
        catalogue's (broker/catalog.py), installed whatever changed (a title, a docstring)."""
        old_workers = self.workers
        for old in old_workers:  # first out of the rotation: nothing more goes to them
            self.dispatcher.worker_unready(old)
        if names != self.methods or sync_methods != self.sync_methods:
            log.info("reload: the new code %s", method_change(names, self.methods or []))
            self.methods = names
            self.sync_methods = sync_methods
        # Always, even for the same table: calls routed before are translated, the routing
        # state is the new code's (a method still sync keeps what was learnt of its service
        # time; any other starts afresh: `Dispatcher.set_methods`), and so is the catalogue.
        self.dispatcher.set_methods(names, sync_methods, methods)
        self.workers = list(incoming)
        for new in incoming:
            self.dispatcher.worker_ready(new)
        for old in old_workers:
            if old.exited is None or old.exited.done():
                # Its process exited and `_watch` counted that under its own reason (killed,
                # exited, left...), or it has none (a slot that waited for the reload since
                # its restart came due): the reload replaces no running worker there.
                # (Counting every old worker "reload" hid those exits: hostile testing, round 8.)
                continue
            # Running (or exited and not reaped yet: `_watch` then finds it in `retiring` and
            # counts nothing). One that asked to leave during the reload was not replaced
            # when it asked (`worker_leaving`): its leave is counted now, as "left".
            if old.leaving:
                self._count_restart("left")
            else:
                self._count_restart("reload")
            alive = old.process is not None and old.process.returncode is None
            self.retiring.add(old)
            if old.state is WorkerState.READY and old.channel is not None:
                old.move(WorkerState.DRAINING)
                old.channel.send(wire.Kind.BYE, 0, 0, b"")
                self._retire_by(old)
            elif alive and old.state is not WorkerState.DRAINING:  # (one that asked to leave drains on)
                kill(typing.cast(asyncio.subprocess.Process, old.process))  # never got ready: nothing to drain

    def _hello_incoming(self, channel: WorkerChannel, worker: Worker, names: list[str], hello: wire.Hello) -> Worker:
        """HELLO from a new worker of a reload: READY, but it takes calls only at the
        swap. Every new worker must serve the same method list as the first one."""
        if self._incoming_methods is None:
            self._incoming_methods = names
            self._incoming_sync = list(hello.sync_methods)
            self._incoming_infos = list(hello.methods)
        elif names != self._incoming_methods:
            self._incoming_error = (
                f"new worker {worker.slot} serves {names}, not {self._incoming_methods} as new worker"
                " did before it (the app changed on disk during the reload?)"
            )
            self._changed.set()
            raise wire.FrameError(self._incoming_error)
        worker.channel = channel
        worker.concurrency = max(1, hello.concurrency)
        worker.move(WorkerState.READY)
        self._baseline(worker)  # (max_worker_memory: broker/recycling.py)
        log.info("reload: new worker %d ready (pid %d, %s)", worker.slot, worker.pid, _methods(names))
        self._changed.set()
        return worker

    def _replace_incoming(self, worker: Worker) -> None:
        """A reload's new worker left before the swap: another takes its place in the
        reload (which still waits at most its timeout in all), counted `left`."""
        self._count_restart("left")
        new = self.incoming[worker.slot] = Worker(worker.slot)
        if self._prepare(new):
            task = self.loop.create_task(self._launch(new))
            task.add_done_callback(_log_task_error)
        self._changed.set()

    def _restart_awaiting(self, why: str) -> None:
        """The reload failed (or the pool's last reload ended with it failed): restart the
        slots that waited for it (`_awaiting_reload`). They import the code on disk now,
        which the failed reload could not deploy: said in the log, as a WARNING. (Their
        exits were counted when reaped, `_watch`.)"""
        awaiting, self._awaiting_reload = self._awaiting_reload, set()
        for worker in sorted(awaiting, key=lambda w: w.slot):
            if self._stopping or self.workers[worker.slot] is not worker or worker.state is not WorkerState.DEAD:
                continue
            log.warning("worker slot %d restarts now (%s): it imports the code on disk now, which the old"
                        " workers may not run (a reload to it failed)", worker.slot, why)
            if self._prepare(worker):
                task = self.loop.create_task(self._launch(worker))
                task.add_done_callback(_log_task_error)

    def _replace_leaving(self) -> None:
        """The reload failed: a worker that asked to leave during it, draining in its slot
        for the swap, drains beside a new worker now, as a leave outside a reload does
        (hostile testing, round 19: its slot served nothing until its calls ended, a long
        poll's 20 s)."""
        for worker in list(self.workers):
            if self._stopping or not worker.leaving or worker.state is not WorkerState.DRAINING:
                continue
            log.warning("worker slot %d restarts now (its worker asked to leave during the reload, which failed):"
                        " it imports the code on disk now, which the old workers may not run", worker.slot)
            self._beside(worker)


def method_change(new: list[str], old: list[str], most: int = 20) -> str:
    """What `new` method list changes from `old`: "adds ['b'] and removes no method", each
    list sorted and cut at `most` names ("... and 380 more"): a line of the log per
    change, not both lists (new user, round 99, L3: three lines printed both whole lists,
    kilobytes each for an app of hundreds of methods)."""
    before, after = set(old), set(new)

    def listed(names: set[str]) -> str:
        if not names:
            return "no method"
        shown = sorted(names)[:most]
        return f"{shown}" + (f" and {len(names) - most} more" if len(names) > most else "")

    change = f"adds {listed(after - before)} and removes {listed(before - after)}"
    return f"{change} (the same methods in another order)" if before == after and new != old else change


def _methods(names: list[str]) -> str:
    """"1 method", "3 methods": a worker's method count in its ready line (hostile
    testing, round 32: "1 methods")."""
    return f"{len(names)} method{'' if len(names) == 1 else 's'}"


def _log_task_error(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("worker supervision failed", exc_info=task.exception())
