"""Worker supervisor: spawn worker processes, handshake, restart with backoff, stop.

Theory of operation
-------------------
The pool listens on one Unix socket, `workers.sock`, inside a private 0700 directory. It
spawns N fresh interpreters (`python -m broker.worker`, never forked from the running
event loop: broker/spawning.py), each told its slot and the socket path. A worker
connects and sends HELLO (its pid, slot, methods and concurrency limit); the pool checks
the pid against the process it spawned and the method list against the first worker's,
and the worker becomes READY: the dispatcher starts routing calls to it.

Each slot's life follows `TRANSITIONS`:

    STARTING --HELLO--> READY --BYE--> DRAINING --exit--> DEAD
        |                 |                              |
        +------exit-------+---exit or socket closed------+--backoff--> STARTING

BYE goes from the broker to the worker (the stop, a reload's retiring workers): no call
comes after it, and the worker exits once it has answered every call sent before. A
worker sent SIGTERM asks for it with a BYE of its own (`worker_leaving`): the pool takes
it out of the rotation and answers BYE, so no call written to it is lost, and starts a
new worker in its slot at once, as a reload does (the new one first: the slot is out of
service only while the new one imports the app, not for as long as the old one's
longest call runs). The old one drains beside it in `retiring` and is not restarted
when it exits. Calls that find no other worker meanwhile wait in the queue for the new
one, never "no worker available". During a reload, whose new worker takes the slot at
the swap, the one leaving drains in its slot instead (see below for its exit). Either
way the restart reason is "left", not "exited": a leave is not a crash.

A worker sent SIGTERM before its HELLO (the interpreter's start, the app's import: its
loop's handler is not installed yet) is killed by it, status -SIGTERM. The broker never
sends SIGTERM (it kills with SIGKILL), so that is someone recycling it too: a leave,
restarted at once (no backoff) and counted "left", calls waiting for it meanwhile; also
while the pool starts (not a boot failure), and for a reload's new worker (another
takes its place in the reload).

A slot whose process exits (or whose socket closes) is DEAD: the dispatcher answers
its in-flight calls with "worker died" and its queued calls go to other workers. The
slot is respawned after an exponential backoff (0.1 s doubling up to
`restart_backoff_max`, reset once a worker has stayed up for 30 s), or at once, its
backoff reset, when its process was sent a call: a call may have crashed it, and a
client's crashing calls must not grow a backoff every other client's calls wait out
(`_failures_after`). From its socket's end to its exit being reaped, its restart is
taken to come after the backoff that exit would get (`channel_lost`). A worker that
exits before its HELLO while the pool is starting stops the whole start, whatever its
status (`WORKER_BOOT_ERROR` for an exception or sys.exit() at import, but os._exit()
says nothing): a bad `--app` is a bad deploy, not something to retry forever (gunicorn's
WORKER_BOOT_ERROR does the same). So is a worker with no HELLO within `boot_timeout` (an
import that hangs, a process stopped at import): it is killed, and the start fails.

A reload (SIGHUP, `reload`), which deploys the app anew, and what the pool does while one
is under way are in broker/reloads.py (`Reloads`, the mixin `Pool` inherits its methods from).
Recycling (max_calls_per_worker, max_worker_memory: a replacement boots beside the worker,
which serves until it is ready) is in broker/recycling.py (`Recycling`, another mixin).
How soon a slot restarts, and the reason each restart is counted under, is in
broker/restarts.py (`Restarts`, a third).

A worker restarted after a crash imports what is on disk now. If its HELLO lists other
methods than the running workers', the code changed on disk without a SIGHUP: it cannot
join them (its method indexes mean other methods), so it is refused and not restarted
(restart reason "code_changed"), and a reload deploys that code to every worker. If that
reload fails, the slot stays down until one succeeds: no restart loop. (With the same
method list nothing tells the pool the code changed: the worker joins on new code.)

The pool waits on process exits (one waiter task per process) and on socket events:
it never polls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
import time
import typing

from broker import wire
from broker.channel import (
    STOP_KILLED,
    TRANSITIONS,
    CodeChanged,
    LateHello,
    Worker,
    WorkerChannel,
    WorkerState,
)
from broker.config import ConfigError
from broker.dispatch import Dispatcher
from broker.errors import LocalError
from broker.recycling import RECYCLE_DROPPED, RECYCLE_REASONS, Recycle, Recycling
from broker.reloads import (  # (and what both modules use: the kill reasons, a few helpers)
    CODE_CHANGED,
    SUPERSEDED,
    WIRE_MISMATCH,
    Reloads,
    _log_task_error,
    _methods,
    method_change,
)
from broker.restarts import Restarts, restart_reason
from broker.spawning import describe_status, kill, kill_if_alive, spawn, worker_command
from broker.worker import WORKER_BOOT_ERROR

if typing.TYPE_CHECKING:
    from broker.peers import Peers

__all__ = ["TRANSITIONS", "CodeChanged", "Pool", "Worker", "WorkerBootError", "WorkerChannel", "WorkerState"]

log = logging.getLogger("broker.pool")


BOOT_TIMEOUT_SECONDS = 60.0  # default of boot_timeout: a worker with no HELLO by then is killed
KILL_AFTER_SECONDS = 2.0  # a worker whose socket closed but lives on is killed after


class WorkerBootError(LocalError):
    """A worker exited before its HELLO while the pool was starting: it could not load
    the app (exit status `WORKER_BOOT_ERROR`, or any other), or it sent no HELLO within
    the boot timeout (an import that hangs, or a process stopped at import)."""

    hint = "fix the app or its environment, then start the broker again: a bad deploy is not retried"


class Pool(Reloads, Recycling, Restarts):
    """Supervises `size` worker processes serving `app` for one `Dispatcher`."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        size: int,
        app: str,
        concurrency: int = 100,
        max_depth: int = 64,
        max_frame_bytes: int = wire.MAX_FRAME_BYTES,
        restart_backoff_max: float = 10.0,
        boot_timeout: float = BOOT_TIMEOUT_SECONDS,
        socket_dir: str = "",
        debug: bool = False,
        log_level: str = "info",
        max_calls_per_worker: int = 0,
        max_calls_jitter: int = 0,
        max_worker_memory: int = 0,
        worker_stderr: typing.Callable[[int, int, bool], None] | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        # Takes the read end of each worker's stderr pipe (`logpipe.LogPipe.follow`); None:
        # workers write to the broker's stderr themselves
        self.worker_stderr = worker_stderr
        self.loop = asyncio.get_running_loop()
        self.size = size
        self.app = app
        self.concurrency = concurrency
        self.max_depth = max_depth
        self.max_frame_bytes = max_frame_bytes
        self.restart_backoff_max = restart_backoff_max
        self.boot_timeout = boot_timeout
        self.debug = debug
        self.log_level = log_level
        self.workers = [Worker(i) for i in range(size)]
        self.methods: list[str] | None = None
        self.sync_methods: list[str] = []  # those of `methods` whose handlers are sync (HELLO)
        self._socket_dir_given = socket_dir
        self._dir = ""
        self._path = ""
        self._server: asyncio.AbstractServer | None = None
        self._stopping = False
        self._winding_down = False  # (`wind_down`)
        self._reloading = False
        self._starting = True
        self._boot_failure: asyncio.Future[str] = self.loop.create_future()
        self._changed = asyncio.Event()
        # Restarts by reason (the metric's label): exited, killed, hung, boot_timeout, reload
        self.restarts_by_reason: dict[str, int] = {}
        self.retiring: set[Worker] = set()  # replaced by a reload, not exited yet
        # A reload under way: its new workers (not in `workers`, taking no calls until
        # the swap), the method list they announce, and why it failed, if it did.
        self.incoming: list[Worker] = []
        self._incoming_methods: list[str] | None = None
        self._incoming_sync: list[str] = []
        self._incoming_infos: list[wire.MethodInfo] = []  # (the first new worker's HELLO's: the catalogue)
        self._incoming_error = ""
        self.after_reload: typing.Callable[[], None] | None = None  # called after each successful reload
        self.peers: Peers | None = None  # the other front-ends (--frontends N): each worker's connections to them
        self.reloads = {"success": 0, "failure": 0}  # reloads by outcome (a metric's label)
        # Told of each reload `request_reload` runs: (None, "") as it begins, then (True, "")
        # or (False, why it failed) as it ends (the status file: broker/statusfile.py).
        self.on_reload: typing.Callable[[bool | None, str], None] | None = None
        self.reload_failure = ""  # why the last reload failed ("" if it did not)
        # Reloads asked for (`request_reload`): the task running them, and whether
        # one more was asked for while it ran (or while the pool started).
        self._reload_task: asyncio.Task[None] | None = None
        self._reload_wanted = False
        # Slots whose worker exited during a reload (or whose restart came due then): not
        # restarted on the code being deployed, they wait for the reload's new worker, and
        # are restarted only if the reload fails. (Each exit was counted when reaped.)
        self._awaiting_reload: set[Worker] = set()
        # Recycling (broker/recycling.py): the limits (0: off); the replacements booting, by
        # slot (not in `workers` until their HELLO); recycles by reason and failures (metrics);
        # each slot's failures in a row and when it may be tried again; the periodic check.
        self.max_calls_per_worker = max_calls_per_worker
        self.max_calls_jitter = max_calls_jitter
        self.max_worker_memory = max_worker_memory
        self.replacements: dict[int, Recycle] = {}
        self.recycles = dict.fromkeys(RECYCLE_REASONS, 0)
        self.recycle_failures = 0
        self._recycle_failures_in_row: dict[int, int] = {}
        self._recycle_hold: dict[int, float] = {}
        self._recycle_timer: asyncio.TimerHandle | None = None
        # With several front-ends: the calls the others sent a worker (by pid; `Peers.calls_sent`)
        self.calls_elsewhere: typing.Callable[[int], int] = lambda pid: 0
        self._first_rss: dict[int, bool] = {}  # pid -> over max_worker_memory at its RSS's first read (warned)
        dispatcher.worker_back_in = self._worker_back_in
        dispatcher.worker_restarting = self._worker_restarting
        dispatcher.worker_worn = self.worker_worn

    @property
    def socket_path(self) -> str:
        """Path of the Unix socket workers connect to."""
        return self._path

    async def start(self) -> None:
        """Spawn every worker and wait until all are READY.

        Raises `WorkerBootError` if a worker cannot load the app, or if they are not
        all ready within `boot_timeout` seconds (an import that hangs: those still
        starting are killed). A reload asked for meanwhile (`request_reload`) runs once
        the start is over.
        """
        timeout = self.boot_timeout
        try:
            if self._socket_dir_given:
                # Its last component only, as `mkdir` does (/run/rpc-broker): a mistyped path
                # is an error, not a tree of directories made (hostile testing, round 9)
                try:
                    os.mkdir(self._socket_dir_given, mode=0o700)
                except FileExistsError:
                    pass
                except FileNotFoundError:  # (new user, round 100: the message named the directory)
                    parent = os.path.dirname(os.path.abspath(self._socket_dir_given))
                    raise OSError(f"its parent directory {parent!r} does not exist (only the last"
                                  " component is made, as mkdir does)") from None
                self._dir = tempfile.mkdtemp(prefix="rpc-broker-", dir=self._socket_dir_given)
            else:
                self._dir = tempfile.mkdtemp(prefix="rpc-broker-")  # mode 0700
            self._path = os.path.join(self._dir, "workers.sock")
            self._server = await self.loop.create_unix_server(lambda: WorkerChannel(self), self._path)
            os.chmod(self._path, 0o600)
            log.info("workers' socket %s (its directory removed at the stop; left behind after a SIGKILL)", self._path)
        except OSError as exc:  # (`stop` removes the directory made, if any)
            where = f"socket_dir {self._socket_dir_given!r}" if self._socket_dir_given else tempfile.gettempdir()
            raise ConfigError(f"cannot make the workers' Unix socket in {where}: {exc}") from None
        for worker in self.workers:
            await self._spawn(worker)
        deadline = self.loop.time() + timeout
        while not all(w.state is WorkerState.READY for w in self.workers):
            if self._stopping:  # `stop` was called meanwhile (SIGTERM): the start is given up
                return
            if self._boot_failure.done():
                raise WorkerBootError(self._boot_failure.result())
            self._changed.clear()
            left = deadline - self.loop.time()
            if left <= 0:
                late = [w for w in self.workers if w.state is not WorkerState.READY]
                for w in late:
                    if w.process is not None:
                        kill_if_alive(w.process)
                raise WorkerBootError(
                    f"worker {', '.join(str(w.slot) for w in late)} sent no HELLO within boot_timeout"
                    f" {timeout} s: app {self.app!r} hangs at import (or its process was stopped);"
                    " killed"
                )
            waiter: asyncio.Future[object] = asyncio.ensure_future(self._changed.wait())
            failed: asyncio.Future[object] = typing.cast("asyncio.Future[object]", self._boot_failure)
            await asyncio.wait([waiter, failed], timeout=left, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        self._starting = False
        self._start_recycling()
        if self._reload_wanted:  # a SIGHUP came while starting: deploy what is on disk now
            log.info("reload: one was asked for while the broker started: reloading now")
            self.request_reload()

    async def _spawn(self, worker: Worker) -> None:
        if self._prepare(worker):
            await self._launch(worker)

    def _prepare(self, worker: Worker) -> bool:
        """Make `worker` STARTING, its per-process state reset: from now on calls wait for
        it rather than be answered "no worker available". False once the pool stops."""
        if self._stopping:
            return False
        worker.move(WorkerState.STARTING)
        worker.channel = None
        worker.outstanding = 0
        worker.kill_reason = ""
        worker.leaving = False
        return True

    async def _launch(self, worker: Worker) -> None:
        """Start the process of a worker `_prepare` made STARTING."""
        if self._stopping:  # (`stop` came in between: a leave's replacement, `worker_leaving`)
            return
        argv = worker_command(
            self._path, worker.slot, app=self.app, concurrency=self.concurrency, max_depth=self.max_depth,
            max_frame_bytes=self.max_frame_bytes, log_level=self.log_level, debug=self.debug,
        )
        try:
            process, output, ends = await spawn(argv, self.peers, self.worker_stderr is not None)
        except OSError as exc:  # (EMFILE, EAGAIN, ENOMEM: the system is short of something now)
            self._launch_failed(worker, exc)
            return
        if output is not None and self.worker_stderr is not None:
            self.worker_stderr(output[0], process.pid, False)  # (its stdout and stderr)
            self.worker_stderr(output[1], process.pid, True)  # (its logging's)
        if self._stopping:  # `stop` came while this process was being created
            kill(process)
        elif (self.workers[worker.slot] is not worker and not any(w is worker for w in self.incoming)
              and self._replacement(worker) is None):
            # Started for a reload that failed while this process was being created (a leave's
            # replacement, round 39: it lived on, imported the code that was not deployed, and
            # its HELLO was refused as a stranger's), or for a recycle dropped meanwhile: not wanted any more.
            worker.kill_reason = worker.kill_reason or "started for a reload that failed meanwhile"
            kill(process)
        worker.process = process
        worker.pid = process.pid
        if self.peers is not None:
            self.peers.joined(worker, ends)
        worker.started_at = time.monotonic()
        worker.took_calls = False
        self._arm(worker)
        exited: asyncio.Future[int] = self.loop.create_future()
        worker.exited = exited
        boot_timer = self.loop.call_later(self.boot_timeout, self._boot_deadline, worker, process)
        task = self.loop.create_task(self._watch(worker, process, exited, boot_timer))
        task.add_done_callback(_log_task_error)

    def _launch_failed(self, worker: Worker, exc: OSError) -> None:
        """`worker`'s process could not be created. At the start that is a boot failure;
        for a reload's new worker, the reload fails; any other worker is tried again after
        its slot's backoff, STARTING meanwhile, so calls wait for it rather than be refused
        (hostile testing: with the descriptors used up, a crashed worker's restart raised
        EMFILE out of the supervising task and the slot stayed down for good)."""
        problem = f"worker {worker.slot}: its process cannot be created: {exc}"
        if self._starting:
            if not self._boot_failure.done():
                self._boot_failure.set_result(problem)
            self._changed.set()
            return
        if worker in self.incoming:
            self._incoming_error = self._incoming_error or problem
            self._changed.set()
            return
        rec = self._replacement(worker)
        if rec is not None:  # (the old worker serves on)
            self._recycle_failed(rec, f"process cannot be created: {exc}")
            return
        worker.failures += 1
        delay = self._backoff(worker.failures)
        log.error("%s; trying again in %.1f s", problem, delay)
        self.loop.call_later(delay, self._relaunch, worker)

    def _relaunch(self, worker: Worker) -> None:
        if not self._stopping and self.workers[worker.slot] is worker and worker.state is WorkerState.STARTING:
            if self._reloading:  # not on the code being deployed: the slot waits for the reload
                worker.move(WorkerState.DEAD)
                self._awaiting_reload.add(worker)
                return
            task = self.loop.create_task(self._launch(worker))
            task.add_done_callback(_log_task_error)

    async def _watch(
        self, worker: Worker, process: asyncio.subprocess.Process, exited: asyncio.Future[int],
        boot_timer: asyncio.TimerHandle,
    ) -> None:
        status = await process.wait()
        exited.set_result(status)
        boot_timer.cancel()  # (else it held the process and its worker for boot_timeout: round 75, a restart loop)
        if worker.process is not process:
            return
        worker.restart_at = 0.0  # (`channel_lost`'s guess, until this exit was reaped)
        was_starting = worker.state is WorkerState.STARTING
        # SIGTERM before its HELLO: the worker's own handler was not installed yet (the
        # interpreter's start, the app's import), so the signal killed it. The broker
        # never sends SIGTERM (its kills are SIGKILL): someone recycled it, as they would
        # a ready worker, which leaves losing no call. So it is a leave, not a failure
        # (hostile testing: two recycles in a row killed every replacement while it
        # imported, restart backoff, and calls were answered -32003 meanwhile).
        if was_starting and status == -signal.SIGTERM and not worker.kill_reason:
            worker.leaving = True
        reason = describe_status(status)
        if worker.kill_reason:
            reason = f"{reason} ({worker.kill_reason})"
        elif worker.leaving:
            reason = f"{reason} (it asked to leave)" if not was_starting else f"{reason} before it was ready: it left"
        left = worker.leaving and (status == 0 or status == -signal.SIGTERM)
        if worker.state is not WorkerState.DEAD:
            worker.move(WorkerState.DEAD)
        self.dispatcher.worker_lost(worker, reason, serving=self.workers[worker.slot] is worker and not worker.leaving)
        worker.channel = None
        self._changed.set()
        if self._stopping:
            return
        rec = self._replacement(worker)
        if rec is not None:  # a recycle's replacement, before its HELLO: the old worker serves on
            self._recycle_failed(rec, f"(pid {worker.pid}) {reason} before it was ready")
            return
        if self.workers[worker.slot] is worker:
            self._drop_recycle(worker.slot, f"its worker {reason}")
        if worker in self.incoming:
            if left and was_starting and self._reloading and not self._incoming_error:
                # A reload's new worker sent SIGTERM while it imports: another takes its place
                # in the reload (which still waits at most its timeout in all).
                log.info("reload: new worker %d (pid %d) %s; starting another", worker.slot, worker.pid, reason)
                self._replace_incoming(worker)
                return
            log.warning("reload: new worker %d (pid %d) %s", worker.slot, worker.pid, reason)  # (a failed reload: no restart)
            return
        if self.workers[worker.slot] is not worker:  # replaced (a reload, a leave; a failed reload's): no restart
            if worker in self.retiring:
                self.retiring.discard(worker)
                log.log(logging.INFO if status == 0 or not worker.leaving else logging.WARNING,
                        "worker %d (pid %d) %s: %s", worker.slot, worker.pid, "left" if worker.leaving else "retired", reason)
            elif worker.kill_reason.startswith((SUPERSEDED, RECYCLE_DROPPED)):
                log.info("worker %d (pid %d) %s", worker.slot, worker.pid, reason)
            else:  # (a new worker of a reload that failed, stopped with the others)
                log.info("reload: new worker %d (pid %d) stopped, the reload failed: %s", worker.slot, worker.pid, reason)
            return
        if worker.kill_reason.startswith(WIRE_MISMATCH):  # its HELLO was refused (`wire_mismatch`)
            self._count_restart(restart_reason(status, "", left))
            log.error("worker slot %d stays down, not restarted: %s", worker.slot, worker.kill_reason)
            if not self.dispatcher.ready_workers:
                self.dispatcher.no_worker_before(self._worker_back_in())
            return
        if worker.kill_reason.startswith(CODE_CHANGED):  # its HELLO was refused (`hello`)
            self._count_restart("code_changed")
            log.warning("worker %d (pid %d) %s; not restarted: the reload asked for replaces it",
                        worker.slot, worker.pid, reason)
            return
        why = restart_reason(status, worker.kill_reason, left)
        if self._reloading or worker.kill_reason.startswith(SUPERSEDED):
            # A restart now would import the code being deployed and join the old workers
            # (hostile testing: old and new code answered in turn, and a new method made a
            # false "changed on disk without a SIGHUP"). The reload's new worker takes the
            # slot at the swap; calls wait for it (`_worker_coming`), or go to the others.
            # The exit is counted now, under its own reason, whatever the reload's outcome
            # (hostile testing, round 8: the swap counted it "reload", and a SIGKILL by the
            # OOM killer during a deploy never reached the restarts alert).
            log.log(logging.INFO if left or worker.kill_reason.startswith(SUPERSEDED) else logging.WARNING,
                    "worker %d (pid %d) %s; a reload is under way: its slot waits for the reload's new worker",
                    worker.slot, worker.pid, reason)
            if worker.kill_reason.startswith(SUPERSEDED):  # replaced by the reload, counted as `_swap` counts those
                self._count_restart("reload")
            else:
                self._count_restart(why)
            self._awaiting_reload.add(worker)
            if not self._reloading:  # (the reload ended before this exit was reaped)
                self._restart_awaiting("the reload that superseded it failed")
            return
        log.log(logging.INFO if left else logging.WARNING, "worker %d (pid %d) %s", worker.slot, worker.pid, reason)
        if was_starting and self._starting and not left:
            # Exited before its HELLO while the pool starts: the app cannot boot, whatever
            # the status (an exception or sys.exit() at import is WORKER_BOOT_ERROR, but
            # os._exit() or a signal at import say nothing). Retrying would loop. (SIGTERM
            # is a leave: someone recycled it, the start goes on with a new one.)
            if not self._boot_failure.done():
                self._boot_failure.set_result(
                    f"worker {worker.slot} {reason} before it was ready: "
                    + (f"it could not boot app {self.app!r} (its log above says why)" if status == WORKER_BOOT_ERROR
                       else f"it could not load app {self.app!r}")
                )
            return
        if left or why == "hung":  # it left as it asked to (or was sent SIGTERM while starting): no failure, no backoff
            # (hung: the broker killed it, a call's deadline and cancel_grace after the call
            # began, which no crash loop repeats fast: round 74, hung kills under 30 s apart
            # raised the backoff, and other clients' calls were answered -32003 for seconds)
            delay = 0.0 if left else self._at_once(worker)
        else:
            worker.leaving = False  # it failed: no worker is coming during its backoff
            worker.failures = self._failures_after(worker)
            delay = self._restart_delay(worker, worker.failures)
        self._count_restart(why)
        worker.restart_at = time.monotonic() + delay  # (0 delay too: round 74, calls in the gap got -32003)
        if was_starting and not left and why != "hung":  # (a failed start: calls wait for one at most)
            self.dispatcher.start_failed()
        elif delay and not self.dispatcher.ready_workers:
            self.dispatcher.no_worker_before(self._worker_back_in())
        try:
            await asyncio.sleep(delay)
        finally:
            worker.restart_at = 0.0
        if self._stopping or worker.process is not process or self.workers[worker.slot] is not worker:
            return  # (a reload replaced it meanwhile)
        if self._reloading:  # a reload began during the backoff: its new worker takes the slot
            self._awaiting_reload.add(worker)
            return
        await self._spawn(worker)

    def _beside(self, worker: Worker) -> None:
        """`worker` leaves (it asked to): it drains in `retiring`, and a new worker takes its
        slot at once (counted `left`)."""
        self.retiring.add(worker)
        new = self.workers[worker.slot] = Worker(worker.slot)
        self._count_restart("left")
        if self._prepare(new):
            task = self.loop.create_task(self._launch(new))
            task.add_done_callback(_log_task_error)

    def _boot_deadline(self, worker: Worker, process: asyncio.subprocess.Process) -> None:
        if worker.process is process and worker.state is WorkerState.STARTING:
            log.error("worker %d (pid %d) sent no HELLO in %s s (boot_timeout): killing it",
                      worker.slot, worker.pid, self.boot_timeout)
            worker.kill_reason = f"boot timeout: no HELLO in {self.boot_timeout} s"
            kill(process)

    def hello(self, channel: WorkerChannel, hello: wire.Hello) -> Worker:
        """Bind a new connection to its worker slot; raises `wire.FrameError` if it
        does not match a worker we started (wrong slot or pid, other methods; `LateHello`:
        read after its exit was reaped)."""
        if not 0 <= hello.slot < self.size:
            raise wire.FrameError(f"HELLO from unknown slot {hello.slot}")
        names = [m.name for m in hello.methods]
        if self.incoming:
            new = self.incoming[hello.slot]
            if new.state is WorkerState.STARTING and new.pid == hello.pid:
                return self._hello_incoming(channel, new, names, hello)
        rec = self.replacements.get(hello.slot)
        if rec is not None and rec.new.state is WorkerState.STARTING and rec.new.pid == hello.pid:
            return self._hello_replacement(channel, rec, names, hello)
        worker = self.workers[hello.slot]
        if worker.pid == hello.pid and worker.state is WorkerState.DEAD:  # (read after its exit was reaped)
            raise LateHello(f"worker {hello.slot} (pid {hello.pid}) said HELLO before it exited")
        if worker.state is not WorkerState.STARTING or worker.pid != hello.pid:
            raise wire.FrameError(f"HELLO from pid {hello.pid} for slot {hello.slot}, expected pid {worker.pid}")
        if self.methods is None:
            self.methods = names
            self.sync_methods = list(hello.sync_methods)
            self.dispatcher.set_methods(names, self.sync_methods, hello.methods)
        elif names != self.methods and self._reloading:
            # Started before the reload (a crash's or a leave's restart) and importing the
            # code being deployed: the reload's new worker takes the slot at the swap.
            worker.kill_reason = f"{SUPERSEDED}: its code {method_change(names, self.methods)}"
            raise CodeChanged(f"worker {hello.slot} (pid {hello.pid}), {worker.kill_reason}")
        elif names != self.methods:
            # A restarted worker imported code that changed on disk without a SIGHUP.
            # It cannot join (its method indexes mean other methods): deploy that code
            # to every worker instead, as a SIGHUP would (see the module docstring).
            # (the change is said once, in the WARNING; the other lines name the worker)
            problem = f"worker {hello.slot} (pid {hello.pid})"
            worker.kill_reason = CODE_CHANGED
            change = method_change(names, self.methods)
            if self._starting:  # the first workers disagree: a deploy half-written at start
                if not self._boot_failure.done():
                    self._boot_failure.set_result(
                        f"{problem}'s code {change}: the app changed on disk while the broker started")
            else:
                log.warning("%s: its code %s: the app changed on disk without a SIGHUP; reloading every worker to it",
                            problem, change)
                self.request_reload()
            raise CodeChanged(f"{problem}: the app changed on disk")
        worker.channel = channel
        worker.concurrency = max(1, hello.concurrency)
        worker.move(WorkerState.READY)
        self._baseline(worker)  # (max_worker_memory: broker/recycling.py)
        log.info("worker %d ready (pid %d, %s)", worker.slot, worker.pid, _methods(names))
        self.dispatcher.worker_ready(worker)
        self._changed.set()
        return worker

    def killed_by_peer(self, pid: int, reason: str) -> None:
        """Another front-end killed worker `pid` for `reason` (a call of its hung: broker/members.py):
        its exit is said and counted as one this front-end made (`_watch`), not an outside kill."""
        for worker in [*self.workers, *self.retiring, *self.incoming, *(r.new for r in self.replacements.values())]:
            if worker.pid == pid and not worker.kill_reason:
                worker.kill_reason = reason
                return

    def wire_mismatch(self, exc: wire.WireMismatch) -> None:
        """A HELLO of another wire version (`wire.WireMismatch`) was refused: the start
        fails saying so, or the reload; a restarted worker's slot stays down, not
        restarted in a loop (each restart imports the same code: hostile testing, round
        21, 12 refusals in 12 s, the slot never back). Restarting the broker heals it."""
        problem = str(exc)
        if self._starting and not self._boot_failure.done():
            self._boot_failure.set_result(problem)
            return
        new = self.incoming[exc.slot] if self.incoming and 0 <= exc.slot < len(self.incoming) else None
        if new is not None and new.pid == exc.pid:
            self._incoming_error = self._incoming_error or problem
            return
        worker = self.workers[exc.slot] if 0 <= exc.slot < self.size else None
        if worker is not None and worker.pid == exc.pid:
            worker.kill_reason = f"{WIRE_MISMATCH}: {problem}"

    def worker_leaving(self, worker: Worker) -> None:
        """The worker said BYE: it asks to leave (it was sent SIGTERM). As at the
        broker's stop, it leaves the rotation (DRAINING) and is told BYE, which comes
        after every call sent to it; it answers all of those and exits. A new worker
        takes its slot at once, STARTING from now (`_prepare`: calls wait for it), and
        the old one drains beside it in `retiring`, as a reload's old workers do: the
        slot is not out of service while the old one's calls run.

        During a reload the old one drains in its slot instead: a new worker now would
        import the code being deployed before the swap (its HELLO refused if the methods
        changed), and the reload's new worker takes the slot at the swap anyway; if the
        old one exits first, its slot waits for the swap (`_watch`), and is restarted
        only if the reload fails. A reload's new worker that asks to leave before the
        swap is replaced in the reload, which still waits at most its timeout in all.
        (One told BYE already, by a reload or the stop, is leaving anyway.)"""
        if worker.state is not WorkerState.READY or worker.channel is None:
            return
        if self.workers[worker.slot] is worker:  # (a leave's new worker, or the reload's, replaces it)
            self._drop_recycle(worker.slot, "its worker asks to leave")
        worker.leaving = True
        worker.move(WorkerState.DRAINING)
        self.dispatcher.worker_unready(worker)
        worker.channel.send(wire.Kind.BYE, 0, 0, b"")
        self._retire_by(worker)  # (also during a reload: one that fails never swaps it out, round 18)
        if worker in self.incoming and self._reloading and not self._incoming_error and not self._stopping:
            # A reload's new worker recycled before the swap (its SIGTERM handler installed,
            # it said HELLO and BYE): another takes its place in the reload, as for one the
            # signal killed while it imported (round 37: the reload failed, the old code
            # served on, and the operator had to send SIGHUP again).
            log.info("reload: new worker %d (pid %d) asks to leave (SIGTERM) before the swap; starting another",
                     worker.slot, worker.pid)
            self.retiring.add(worker)  # (its exit is a leave's: `_watch`)
            self._replace_incoming(worker)
            return
        if self._reloading or self.workers[worker.slot] is not worker:
            log.info("worker %d (pid %d) asks to leave (SIGTERM) during a reload: it finishes its calls%s",
                     worker.slot, worker.pid, "" if self.workers[worker.slot] is worker else "; the reload fails")
            return
        log.info("worker %d (pid %d) asks to leave (SIGTERM): it finishes its calls beside a new worker",
                 worker.slot, worker.pid)
        self._beside(worker)

    def _retire_by(self, worker: Worker) -> None:
        """`worker` was told BYE and drains beside its replacement: it answers its calls
        and exits within their deadlines and cancel_grace (`answered_within`), else it is
        killed then, with a few seconds' margin (hostile testing, round 17: one stopped
        with SIGSTOP, never answering the BYE, lingered for good, and the broker's stop
        waited 10 s more for each)."""
        limit = self.dispatcher.answered_within() + KILL_AFTER_SECONDS
        self.loop.call_later(limit, self._retire_deadline, worker, worker.process, limit)

    def _retire_deadline(self, worker: Worker, process: asyncio.subprocess.Process | None, limit: float) -> None:
        if process is None or process.returncode is not None or worker.state is not WorkerState.DRAINING:
            return
        if not worker.kill_reason:
            worker.kill_reason = f"retired: not gone {limit:g} s after BYE"
        log.warning("worker %d (pid %d) was told to leave %g s ago and has not: killing it",
                    worker.slot, worker.pid, limit)
        kill(process)

    def channel_lost(self, worker: Worker) -> None:
        """A worker's socket closed: stop routing to it; kill it if it lingers. Until its
        exit is reaped (`_watch`), its restart is taken to come after the backoff that
        exit would get, so calls wait for it rather than be answered -32003 at once
        (hostile testing, round 75: bursts of up to 2500 calls in that gap)."""
        self.dispatcher.worker_unready(worker)
        if worker.state is not WorkerState.DEAD:
            worker.move(WorkerState.DEAD)
        process = worker.process
        if self.workers[worker.slot] is worker:  # (its restart takes the slot)
            self._drop_recycle(worker.slot, "its worker's socket closed")
        if process is not None and process.returncode is None:
            self.loop.call_later(KILL_AFTER_SECONDS, self._kill_lingering, worker, process)
            if not self._stopping and not worker.leaving and self.workers[worker.slot] is worker:
                worker.restart_at = time.monotonic() + self._restart_delay(worker, self._failures_after(worker))
                if not self.dispatcher.ready_workers:
                    self.dispatcher.no_worker_before(self._worker_back_in())

    def _kill_lingering(self, worker: Worker, process: asyncio.subprocess.Process) -> None:
        """Kill `process` if it still lives KILL_AFTER_SECONDS after its socket closed,
        saying why (round 76: its exit read as an outside SIGKILL)."""
        if process.returncode is None:
            if worker.process is process and not worker.kill_reason:
                worker.kill_reason = f"its socket closed {KILL_AFTER_SECONDS:g} s before"
            kill(process)

    async def stop(self, timeout: float = 10.0, hurry: asyncio.Event | None = None) -> None:
        """Ask every worker to finish and exit (BYE); SIGKILL those still alive after
        `timeout` s (or once `hurry` is set), and those not ready yet at once; remove the
        socket directory. A `start` under way returns (the broker was stopped while it started)."""
        self._stopping = True
        self._changed.set()  # (a `start` under way gives up)
        if self._recycle_timer is not None:
            self._recycle_timer.cancel()
        everyone = [*self.workers, *self.incoming, *self.retiring, *(r.new for r in self.replacements.values())]
        for worker in everyone:  # still importing (the start's, a reload's, a restart's): nothing to finish
            if worker.state is WorkerState.STARTING and worker.process is not None:
                kill_if_alive(worker.process)
        for worker in everyone:
            if worker.channel is not None and worker.state is WorkerState.READY:
                worker.move(WorkerState.DRAINING)
                self.dispatcher.worker_unready(worker)
                worker.channel.send(wire.Kind.BYE, 0, 0, b"")
        waits = [w.exited for w in everyone if w.exited is not None and not w.exited.done()]
        began = self.loop.time()
        if waits:
            if hurry is None:
                _, alive = await asyncio.wait(waits, timeout=timeout)
            else:  # (a second stop signal ends the wait: round 33, it waited the full timeout)
                exits = asyncio.ensure_future(asyncio.wait(waits, timeout=timeout))
                hurried = asyncio.ensure_future(hurry.wait())
                await asyncio.wait([exits, hurried], return_when=asyncio.FIRST_COMPLETED)
                exits.cancel()  # (not the exits it waits for: asyncio.wait leaves them be)
                hurried.cancel()
                alive = {w for w in waits if not w.done()}
            if alive:
                for worker in everyone:
                    if worker.process is not None and worker.process.returncode is None:
                        log.warning("worker %d (pid %d) did not exit in %.1f s: SIGKILL", worker.slot, worker.pid,
                                    self.loop.time() - began)
                        worker.kill_reason = worker.kill_reason or STOP_KILLED
                        kill(worker.process)
                await asyncio.wait(alive, timeout=5.0)
        if self._reload_task is not None:  # it sees _stopping and gives up
            await asyncio.wait([self._reload_task], timeout=5.0)
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)

