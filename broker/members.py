"""A peer front-end's workers: those the first front-end started and handed over (`Members`).

With `serve --frontends N`, only the first front-end process supervises the workers
(broker/pool.py): it starts, restarts, reloads and recycles them. Each other front-end (a
peer) is handed, for each worker, the peer's end of a socketpair whose other end the
worker got at its start (`peerwire.WorkerJoined`), and follows the first front-end's word on
it (broker/peerwire.py): a worker joins the peer's rotation once its HELLO came on the peer's
connection and the first front-end said `Serve`; it leaves at `Retire` (the peer says BYE on
its connection: no call written is lost) or when the worker asks to leave (its own BYE); it
is gone at `Lost` (the peer's calls on it are answered -32002 with the reason the first
front-end saw) or when its connection closes. A reload's method table comes as `Methods`
before its workers' `Serve`s. A worker that holds a peer's call past its deadline and
cancel_grace is killed by the peer, by pid (the same user's process), and the first
front-end restarts it. Recycling by calls counts the first front-end's calls only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import typing

from broker import wire
from broker.channel import Worker, WorkerChannel, WorkerState
from broker.peerwire import Lost, Message, Methods, Retire, Serve, Struck, WorkerJoined

if typing.TYPE_CHECKING:
    from broker.dispatch import Dispatcher

__all__ = ["Members"]

log = logging.getLogger("broker.pool")


class _ByPid:
    """A worker process the peer did not start, killed by pid (`Membership._check_hung`:
    `worker.process.kill()`, its `kill_reason` set); the first front-end is told why first
    (`Members.on_kill`), then reaps and restarts it."""

    __slots__ = ("members", "returncode", "worker")

    def __init__(self, worker: Worker, members: Members) -> None:
        self.worker = worker
        self.members = members
        self.returncode: int | None = None

    def kill(self) -> None:
        if self.members.on_kill is not None:
            self.members.on_kill(self.worker.pid, self.worker.kill_reason)
        try:
            os.kill(self.worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            self.returncode = -signal.SIGKILL


class Members:
    """The workers of a peer front-end (see the module docstring). `handle` takes each
    control message from the first front-end (with a `WorkerJoined`'s descriptor); the
    workers' channels call back `hello`, `worker_leaving`, `channel_lost`, `wire_mismatch`
    as they do `Pool`'s. `ready` is set once `size` workers serve (the peer's listeners
    start then)."""

    def __init__(self, dispatcher: Dispatcher, loop: asyncio.AbstractEventLoop, size: int,
                 max_frame_bytes: int = wire.MAX_FRAME_BYTES, boot_timeout: float = 60.0) -> None:
        self.dispatcher = dispatcher
        self.loop = loop
        self.size = size
        self.max_frame_bytes = max_frame_bytes
        self.boot_timeout = boot_timeout
        # (as `Pool`'s, for the server: reloads are the first front-end's)
        self.on_reload: typing.Callable[[bool | None, str], None] | None = None
        self.after_reload: typing.Callable[[], None] | None = None
        self.on_kill: typing.Callable[[int, str], None] | None = None  # (pid, why): told before a kill
        self.workers: dict[int, Worker] = {}  # by pid: joined and not gone
        self._handed: dict[WorkerChannel, Worker] = {}  # connections handed over, their HELLO not read yet
        self._said_serve: set[int] = set()  # pids the first front-end said serve, HELLO or not yet
        self.methods: list[str] | None = None
        self.ready = asyncio.Event()
        dispatcher.worker_back_in = self._back_in
        dispatcher.worker_restarting = self._restarting

    def _back_in(self) -> float:
        """Seconds until a worker is back: 0 while the first front-end restarts one (a peer
        does not know its backoff: its calls wait, up to their deadlines)."""
        return 0.0

    def _restarting(self) -> bool:
        """Is a worker on its way back: fewer than `size` serve here (the first front-end
        restarts it, or starts its replacement)? O(workers). (Always True, a peer's only worker
        was never "the last open to other calls" for a call run alone, `Routing._open_besides`:
        with one worker its calls of a method struck waited to their deadline, or until the
        method's time alone was over, and then went as any call beside another front-end's
        call run alone, and both died: hostile testing, round 132.)"""
        return sum(w.state is WorkerState.READY for w in self.workers.values()) < self.size

    async def handle(self, message: Message, fd: int = -1) -> None:
        """Act on one control message from the first front-end."""
        if isinstance(message, WorkerJoined):
            await self._joined(message, fd)
        elif isinstance(message, Methods):
            self.methods = list(message.names)
            self.dispatcher.set_methods(message.names, message.sync, message.infos)
        elif isinstance(message, Serve):
            self._said_serve.add(message.pid)
            worker = self.workers.get(message.pid)
            if worker is not None and worker.state is WorkerState.STARTING and worker.channel not in self._handed:
                self._serve(worker)  # (its HELLO came already)
        elif isinstance(message, Retire):
            worker = self.workers.get(message.pid)
            if worker is not None:
                self._retire(worker)
        elif isinstance(message, Struck):  # (another front-end saw a worker die under these methods)
            self.dispatcher.struck(message.methods, message.caught, message.pid)
        elif isinstance(message, Lost):
            worker = self.workers.pop(message.pid, None)
            self._said_serve.discard(message.pid)
            if worker is not None:
                self._gone(worker, message.reason)

    async def _joined(self, message: WorkerJoined, fd: int) -> None:
        worker = Worker(message.slot)
        worker.pid = message.pid
        worker.process = _ByPid(worker, self)  # type: ignore[assignment]
        worker.move(WorkerState.STARTING)
        self.workers[message.pid] = worker
        channel = WorkerChannel(self)  # type: ignore[arg-type]
        worker.channel = channel
        self._handed[channel] = worker
        await self.loop.create_unix_connection(lambda: channel, sock=socket.socket(fileno=fd))

    def hello(self, channel: WorkerChannel, hello: wire.Hello) -> Worker:
        """A HELLO on a worker's connection: of the pid it was handed over with, else
        `wire.FrameError`. It serves once the first front-end says so."""
        worker = self._handed.pop(channel, None)
        if worker is None or worker.pid != hello.pid or worker.channel is not channel:
            if worker is not None and self.workers.get(worker.pid) is worker:  # (its connection closes: gone)
                del self.workers[worker.pid]
                worker.move(WorkerState.DEAD)
            raise wire.FrameError(f"HELLO from pid {hello.pid} on a connection handed over for "
                                  f"{worker.pid if worker is not None else 'no worker'}")
        worker.concurrency = max(1, hello.concurrency)
        if self.methods is None:  # (the first workers' table, until a Methods says otherwise)
            self.methods = [m.name for m in hello.methods]
            self.dispatcher.set_methods(self.methods, hello.sync_methods, hello.methods)
        if worker.pid in self._said_serve:
            self._serve(worker)
        return worker

    def _serve(self, worker: Worker) -> None:
        worker.move(WorkerState.READY)
        self.dispatcher.worker_ready(worker)
        if sum(w.state is WorkerState.READY for w in self.workers.values()) >= self.size:
            self.ready.set()

    def _retire(self, worker: Worker) -> None:
        if worker.state is WorkerState.READY:
            worker.move(WorkerState.DRAINING)
            self.dispatcher.worker_unready(worker)
        if worker.channel is not None:
            worker.channel.send(wire.Kind.BYE, 0, 0, b"")

    def worker_leaving(self, worker: Worker) -> None:
        """The worker said BYE (it was sent SIGTERM): out of the rotation, BYE back."""
        worker.leaving = True
        self._retire(worker)

    def channel_lost(self, worker: Worker) -> None:
        """The worker's connection closed: its calls here are answered -32002 now (the first
        front-end's `Lost` may come later, or never if it was the first to see it go)."""
        if self.workers.get(worker.pid) is worker:
            del self.workers[worker.pid]
            self._said_serve.discard(worker.pid)
            self._gone(worker, "its connection closed (the worker exited)")

    def _gone(self, worker: Worker, reason: str) -> None:
        if worker.state is not WorkerState.DEAD:
            worker.move(WorkerState.DEAD)
        self.dispatcher.worker_lost(worker, reason, serving=not worker.leaving)
        channel, worker.channel = worker.channel, None
        if channel is not None:
            self._handed.pop(channel, None)
            channel.close()

    def wire_mismatch(self, exc: wire.WireMismatch) -> None:
        """A worker of another wire version: refused here as by the first front-end."""
        log.error("a worker handed over speaks another wire version: %s", exc)

    async def start(self) -> None:
        """Wait until `size` workers serve here; raises `TimeoutError` past boot_timeout
        (the first front-end's workers did not all come: it fails its start too)."""
        await asyncio.wait_for(self.ready.wait(), self.boot_timeout)

    def wind_down(self) -> None:
        """The stop began (nothing to do: the first front-end stops the workers)."""

    def request_reload(self) -> None:
        """Reloads are the first front-end's (a peer's SIGHUP is ignored: `server.run`)."""

    async def stop(self, timeout: float, hurry: asyncio.Event | None = None) -> None:
        """The drain is over: BYE to every worker (no call comes after it; the worker exits
        once every front-end said it), then close the connections once written (`timeout`
        seconds at most)."""
        for worker in list(self.workers.values()):
            if worker.channel is not None:
                worker.channel.send(wire.Kind.BYE, 0, 0, b"")
                worker.channel.flush()
        await asyncio.sleep(0)
        self.close()

    def close(self) -> None:
        """Close every worker's connection here (the peer is stopping: BYE was said)."""
        for worker in list(self.workers.values()):
            if worker.channel is not None:
                worker.channel.close()
