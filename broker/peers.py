"""The other front-end processes (`serve --frontends N`): started, told and stopped by the first (`Peers`).

The first front-end (the process `rpc-broker serve` runs) binds every TCP listener; with N
front-ends it also binds N - 1 more sockets to each listener's address with SO_REUSEPORT
(`bind`), so the kernel spreads new connections over all of them, and starts N - 1 peers
(`python -m broker.peer`, fresh interpreters, never forked from this loop) that inherit them
(`start`). Each peer runs its own front-ends and dispatcher (broker/server.py) over the same
workers: at each worker's start the pool makes one socketpair per peer, the worker gets one
end (`--link-fd`, broker/worker/links.py) and the peer the other, beside a `WorkerJoined`
line on its control socket (`link_ends`, `joined`; broker/peerwire.py). The first
front-end's dispatcher tells this module of every change of its workers
(`Dispatcher.membership_tap`: `ready`, `unready`, `lost`, `methods`), which each peer is
told in turn, so all route to the same workers under the same method table
(broker/members.py). At the stop each peer is sent SIGTERM: it drains as the first
front-end does, and exits; the workers exit once every front-end has said BYE. A peer that
dies is started again, and the workers reloaded to connect to it (`on_restart`). /metrics
is made on demand from every front-end's series (`serve_metrics`, broker/scrapes.py).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import os
import signal
import socket
import sys
import typing

from broker import peerwire
from broker.metrics import ACCUMULATED, FRONTEND_RESTART_REASONS
from broker.peerwire import (
    SHARE_SECONDS,
    Collect,
    Counters,
    Exposition,
    Killed,
    Lost,
    Message,
    Methods,
    Ready,
    Retire,
    Serve,
    Setup,
    Struck,
    Want,
    WorkerJoined,
)
from broker.scrapes import Rounds

if typing.TYPE_CHECKING:
    from broker.auth import Token
    from broker.channel import Worker
    from broker.wire import MethodInfo

__all__ = ["RESTART_AFTER_SECONDS", "SILENT_SECONDS", "Control", "Peers", "frontend_restart_reason", "tap"]

log = logging.getLogger("broker")

SILENT_SECONDS = 10.0  # a peer that sends nothing this long (its `Counters` come every second) is killed as hung
START_SECONDS = 30.0  # ... and one that said nothing yet, this long after its start (an interpreter's imports)
BACKOFF_LIMIT = 5  # a peer failing in a row waits RESTART_AFTER_SECONDS * 2**n, n at most this (320 s)
RESTART_AFTER_SECONDS = 10.0  # a peer is started again at most once in this long (a crash loop)


class Control:
    """One end of a control socketpair (either side's), non-blocking: messages out in order
    (each `WorkerJoined` with its descriptor, closed here once sent), messages in to
    `on_message` (with a descriptor, or -1); `on_close` once it ends or breaks. `receiver`:
    the reading state to go on from (what was read before, a line's start with it), else a
    new one."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 on_message: typing.Callable[[Message, int], None],
                 on_close: typing.Callable[[], None] | None = None, receiver: peerwire.Receiver | None = None) -> None:
        self._on_close = on_close
        self._loop = loop
        self._sock = sock
        sock.setblocking(False)
        self._queue: collections.deque[tuple[bytes, int]] = collections.deque()
        self._writing = False
        self._receiver = receiver or peerwire.Receiver()
        self._on_message = on_message
        self.closed = False
        loop.add_reader(sock.fileno(), self._readable)

    def send(self, message: Message, fd: int = -1) -> None:
        if self.closed:
            if fd >= 0:
                os.close(fd)
            return
        self._queue.append((peerwire.encode(message), fd))
        if not self._writing:
            self._flush()

    def _flush(self) -> None:
        queue = self._queue
        while queue:
            data, fd = queue[0]
            try:
                sent = socket.send_fds(self._sock, [data], [fd]) if fd >= 0 else self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    self._writing = True
                    self._loop.add_writer(self._sock.fileno(), self._flush)
                return
            except OSError:
                self.close()
                return
            if fd >= 0:  # (sent with the line's first byte: SCM_RIGHTS)
                os.close(fd)
            if sent < len(data):
                queue[0] = (data[sent:], -1)
            else:
                queue.popleft()
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._sock.fileno())

    def _readable(self) -> None:
        try:
            got = peerwire.recv(self._sock, self._receiver)
        except (BlockingIOError, InterruptedError):
            return
        except ConnectionResetError:  # (the other process exited: its end, as end of file)
            got = None
        except (OSError, peerwire.PeerWireError) as exc:
            log.error("a front-end's control channel broke: %s", exc)
            self.close()
            return
        if got is None:
            self.close()
            return
        for message, fd in got:
            self._on_message(message, fd)

    async def flushed(self, timeout: float) -> None:
        """Wait until every message sent is written (`timeout` s at most)."""
        deadline = self._loop.time() + timeout
        while self._queue and not self.closed and self._loop.time() < deadline:
            await asyncio.sleep(0.01)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._sock.fileno())
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
        for _, fd in self._queue:
            if fd >= 0:
                os.close(fd)
        self._queue.clear()
        self._receiver.close()
        self._sock.close()
        if self._on_close is not None:
            self._on_close()


def frontend_restart_reason(status: int, hung: bool, served: bool) -> str:
    """The bounded `reason` label of a front-end's restart (rpc_broker_frontend_restarts_total),
    from how it ended: "hung" when the first front-end killed it as silent (`Peers.check`),
    "never_served" when it exited before it served (a crash loop backs off), "stopped" when it
    exited 0 (a SIGTERM sent to it alone: drained first), "killed" by another signal (`status`
    < 0: asyncio's returncode), else "exited" (with an error). The workers' own reasons are
    restarts.restart_reason's."""
    if hung:
        return "hung"
    if not served:
        return "never_served"
    if status == 0:
        return "stopped"
    return "killed" if status < 0 else "exited"


class Peers:
    """The `count` peer front-ends of this process (see the module docstring), started with
    `config` (a `Config`'s fields as JSON values)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int, config: dict[str, typing.Any],
                 tokens: typing.Sequence[Token] = ()) -> None:
        self.loop = loop
        self.count = count
        self._config = config
        self._tokens = list(tokens)
        self._listeners: list[list[tuple[str, socket.socket]]] = [[] for _ in range(count)]
        self._controls: list[Control] = []
        self.processes: list[asyncio.subprocess.Process] = []
        self.ready: set[int] = set()  # peers whose listeners serve (`Ready`)
        self._samples: dict[int, list[tuple[str, str, dict[str, str], float]]] = {}  # each peer's last `Counters`
        self._sent: dict[int, dict[int, int]] = {}  # each peer's calls sent to each worker (pid), last said
        self.rounds: Rounds | None = None  # /metrics' (`serve_metrics`)
        self._stopping = False
        self._addresses: list[tuple[str, tuple[str, int] | tuple[str, int, int, int]]] = []
        self._restarted: dict[int, float] = {}  # each peer's last restart (loop time)
        # peers started again, by why the last one ended (rpc_broker_frontend_restarts_total{reason})
        self.restarts = dict.fromkeys(FRONTEND_RESTART_REASONS, 0)
        self._hung: set[int] = set()  # peers `check` killed as hung, until `_watch` sees them end
        self._heard_at: dict[int, float] = {}  # when each peer last said something, or started (loop time)
        self._spoke: set[int] = set()  # peers that said something since they started
        self._failures: dict[int, int] = {}  # each peer's exits in a row before it served
        self._checked = 0.0  # the last `check` (loop time)
        self.on_restart: typing.Callable[[], None] | None = None  # a peer was started again: reload the workers
        self._check: asyncio.TimerHandle | None = None
        # The counters and histograms of peers that exited, kept in the sum: a counter of the
        # broker's never goes back because one of its front-ends was replaced
        self._retired: list[tuple[str, str, dict[str, str], float]] = []
        # Told when a peer killed a worker (pid, why): the pool says why at its exit (`Pool.killed_by_peer`)
        self.on_killed: typing.Callable[[int, str], None] | None = None
        # a peer's Struck: struck here too (`Membership.struck`), after the other peers are told
        self.on_struck: typing.Callable[[list[str], bool, int], None] | None = None

    def bind(self, listeners: typing.Sequence[tuple[str, tuple[str, int] | tuple[str, int, int, int]]]) -> None:
        """For each of this process's TCP listeners, (its transport, "http" or "tcp", and its
        bound address), bind one socket per peer to the same address with SO_REUSEPORT
        (the first front-end's own must have it too). Raises `OSError`."""
        self._addresses = list(listeners)
        for number in range(1, self.count + 1):
            self._bind(number)

    def _bind(self, number: int) -> None:
        """Peer `number`'s listening sockets, one per listener of `bind`'s, bound (not listening)."""
        mine = self._listeners[number - 1]
        for transport, address in self._addresses:
            family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
            except OSError:
                sock.close()
                raise
            mine.append((transport, sock))

    async def start(self) -> None:
        """Start every peer (`python -m broker.peer`), each with its listening sockets and
        its end of a control socketpair, and send it its `Setup`."""
        for number in range(1, self.count + 1):
            await self._spawn(number)
        self._checked = self.loop.time()
        self._check = self.loop.call_later(SHARE_SECONDS, self.check)

    async def _spawn(self, number: int) -> None:
        ours, theirs = socket.socketpair()
        listeners, self._listeners[number - 1] = self._listeners[number - 1], []
        inherited = [(transport, sock.fileno()) for transport, sock in listeners]  # (the same numbers there)
        fds = [theirs.fileno(), *(fd for _, fd in inherited)]
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "broker.peer", "--control", str(theirs.fileno()),
                "--parent-pid", str(os.getpid()),
                stdin=asyncio.subprocess.DEVNULL, pass_fds=fds, start_new_session=True,  # (^C: the first one's)
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            for _, sock in listeners:
                sock.close()  # (the peer's now)
        control = Control(self.loop, ours, functools.partial(self._heard, number))
        if number <= len(self._controls):  # (a restart: in its place)
            self._controls[number - 1].close()
            self._controls[number - 1], self.processes[number - 1] = control, process
        else:
            self._controls.append(control)
            self.processes.append(process)
        self._heard_at[number] = self.loop.time()
        self._spoke.discard(number)
        self.loop.create_task(self._watch(number, process))
        control.send(Setup(number=number, config=self._config, listeners=inherited, tokens=self._tokens))

    async def _watch(self, number: int, process: asyncio.subprocess.Process) -> None:
        status = await process.wait()
        if self._stopping:
            return
        # Its listening socket closed with it: the kernel sends new connections to the others; its
        # connections, and the calls they were owed, are gone. A new one takes its place, and the
        # workers are reloaded, so that each has a connection to it (no call is lost by a reload):
        # not sooner than RESTART_AFTER_SECONDS after the last restart, and one that exits before it
        # serves (it cannot start: a crash loop) after twice as long each time in a row, up to
        # 2**BACKOFF_LIMIT times (hostile testing, round 127: one that failed once, its code broken
        # on disk, was never started again, even once fixed).
        served = number in self.ready
        reason = frontend_restart_reason(status, number in self._hung, served)
        self._hung.discard(number)
        self.ready.discard(number)
        self._retire_samples(number)
        self._sent.pop(number, None)  # (a front-end gone: its calls no longer count toward a worker's recycle)
        if self.rounds is not None:
            self.rounds.gone(number)
        failures = self._failures[number] = 0 if served else self._failures.get(number, 0) + 1
        wait = max(0.0, self._restarted.get(number, -math.inf) + RESTART_AFTER_SECONDS - self.loop.time(),
                   RESTART_AFTER_SECONDS * 2 ** min(failures - 1, BACKOFF_LIMIT) if failures else 0.0)
        again = (f"starting another{f' in {wait:.1f} s' if wait else ''}, and reloading the workers to connect them"
                 " to it")
        if not served:
            log.error("front-end %d (pid %d) exited with %d before it served (%d time%s in a row): %s; the other"
                      " front-ends serve on", number, process.pid, status, failures, "s" if failures > 1 else "", again)
        elif status == 0:  # (stopped by a SIGTERM sent to it alone: drained first; new user, round 112)
            log.warning("front-end %d (pid %d) stopped, its calls answered: %s", number, process.pid, again)
        else:
            log.error("front-end %d (pid %d) exited with %d: its connections were lost; %s", number, process.pid,
                      status, again)
        await asyncio.sleep(wait)
        if self._stopping:
            return
        self._restarted[number] = self.loop.time()
        self.restarts[reason] += 1
        try:
            self._bind(number)
            await self._spawn(number)
        except OSError as exc:
            log.error("front-end %d cannot be started again: %s; the other front-ends serve on", number, exc)
            return
        if self.on_restart is not None:
            self.on_restart()
            self.loop.call_later(RESTART_AFTER_SECONDS, self._connected, number, self.processes[number - 1], 0)

    def _connected(self, number: int, process: asyncio.subprocess.Process, tries: int) -> None:
        """Peer `number`, started again RESTART_AFTER_SECONDS (doubling with `tries`) ago and
        its workers reloaded to connect to it: still not serving, that reload failed (the app on
        disk does not import): reload again, until one connects them (new user, round 113: it
        served nothing, for good, until an operator's SIGHUP)."""
        if self._stopping or process.returncode is not None or number in self.ready or self.on_restart is None:
            return
        log.warning("front-end %d (pid %d) is not serving yet: its workers are not connected (the reload to"
                    " connect them failed?): reloading again", number, process.pid)
        self.on_restart()
        wait = RESTART_AFTER_SECONDS * 2 ** min(tries + 1, BACKOFF_LIMIT)
        self.loop.call_later(wait, self._connected, number, process, tries + 1)

    def _heard(self, number: int, message: Message, fd: int) -> None:
        if fd >= 0:
            os.close(fd)
        self._heard_at[number] = self.loop.time()
        self._spoke.add(number)
        if isinstance(message, Ready):
            self.ready.add(number)
        elif isinstance(message, Counters):
            if not message.round:
                self._sent[number] = message.sent
            if message.round and self.rounds is not None:
                self._samples[number] = message.samples  # (round -1: its last, kept once it exits)
                self.rounds.heard(number, message.round)
        elif isinstance(message, Want) and self.rounds is not None:
            control = self._controls[number - 1]
            self.rounds.gather(lambda: control.send(Exposition(body=typing.cast(Rounds, self.rounds).body.decode())))
        elif isinstance(message, Killed) and self.on_killed is not None:
            self.on_killed(message.pid, f"{message.reason} (front-end {number})")
        elif isinstance(message, Struck):
            self.struck(message.methods, message.caught, message.pid, number)
            if self.on_struck is not None:
                self.on_struck(message.methods, message.caught, message.pid)

    def check(self) -> None:
        """Every SHARE_SECONDS: kill (SIGKILL) a peer silent for SILENT_SECONDS (one not heard
        from since its start: START_SECONDS), its loop stopped or stuck (SIGSTOP, a hang): its
        listening socket still takes connections that it would never serve (SO_REUSEPORT knows
        nothing of it), and what it is sent waits here (hostile testing, round 127: one stopped
        before it served was never killed, and the sockets of every reload's workers piled up
        for it). `_watch` starts another. Not after this loop itself stalled (a check late by
        more than 2 SHARE_SECONDS): what the peers said meanwhile is still unread (round 127:
        the first front-end stopped 12 s killed a peer that had spoken all along)."""
        now = self.loop.time()
        if now - self._checked > 3 * SHARE_SECONDS:
            self._heard_at = dict.fromkeys(self._heard_at, now)
        self._checked = now
        for number, process in enumerate(self.processes, 1):
            silent = now - self._heard_at.get(number, now)
            if process.returncode is None and silent > (SILENT_SECONDS if number in self._spoke else START_SECONDS):
                log.error("front-end %d (pid %d) said nothing for %.0f s%s: killing it as hung", number, process.pid,
                          silent, "" if number in self._spoke else " since it started")
                process.kill()
                self._hung.add(number)
        if not self._stopping:
            self._check = self.loop.call_later(SHARE_SECONDS, self.check)

    def states(self) -> dict[str, int]:
        """The front-ends by state, this one (serving) counted: serving, starting (running and
        not serving yet), down (exited, waiting to be started again): rpc_broker_frontends."""
        running = sum(1 for p in self.processes if p.returncode is None)
        serving = len(self.ready)
        return {"serving": 1 + serving, "starting": running - serving, "down": self.count - running}

    def calls_sent(self, pid: int) -> int:
        """The calls the serving peers sent worker `pid` (at most SHARE_SECONDS old):
        `Pool.calls_elsewhere`, so that max_calls_per_worker counts every front-end's."""
        return sum(sent.get(pid, 0) for sent in self._sent.values())

    def samples(self) -> list[list[tuple[str, str, dict[str, str], float]]]:
        """Each peer's last series, and those kept of peers that exited
        (`metrics.BrokerCollector.peer_samples`)."""
        return [*self._samples.values(), self._retired]

    def _retire_samples(self, number: int) -> None:
        """Peer `number` exited: its counters' and histograms' last values stay in the sum
        (`_retired`, added up by series); its gauges (connections open, calls in flight) go."""
        last = self._samples.pop(number, None)
        if not last:
            return
        kept: dict[tuple[str, str, tuple[tuple[str, str], ...]], tuple[str, str, dict[str, str], float]] = {
            (f, n, tuple(sorted(labels.items()))): (f, n, labels, v) for f, n, labels, v in self._retired}
        for family, name, labels, value in last:
            if name.endswith(ACCUMULATED):
                key = (family, name, tuple(sorted(labels.items())))
                before = kept.get(key)
                kept[key] = (family, name, labels, value + (before[3] if before else 0.0))
        self._retired = list(kept.values())

    def serve_metrics(self, build: typing.Callable[[], bytes]) -> Rounds:
        """Make /metrics bodies on demand with `build` (this front-end's series and the
        peers' last, summed), for every front-end's scrapes (broker/scrapes.py)."""
        self.rounds = Rounds(self.loop, self._collect, build)
        return self.rounds

    def _collect(self, round_: int) -> set[int]:
        """Ask each serving peer for its series (`Rounds`' collect); their numbers."""
        for number in self.ready:
            self._controls[number - 1].send(Collect(round=round_))
        return set(self.ready)

    # -- the pool's hooks: each worker's connections to the peers ------------------------

    def link_ends(self) -> tuple[list[int], list[int]]:
        """One socketpair per peer for a worker about to start: (the worker's ends, to pass
        with --link-fd; the peers' ends, for `joined`). The caller closes the worker's ends
        once the process has them, and every end if it cannot start."""
        workers, peers = [], []
        for _ in range(self.count):
            a, b = socket.socketpair()
            workers.append(a.detach())
            peers.append(b.detach())
        return workers, peers

    def joined(self, worker: Worker, ends: list[int]) -> None:
        """`worker`'s process started: hand each peer its end of the worker's connection."""
        for control, fd in zip(self._controls, ends):
            control.send(WorkerJoined(slot=worker.slot, pid=worker.pid, generation=0), fd)
        for fd in ends[len(self._controls):]:  # (peers not started yet: none)
            os.close(fd)

    # -- MembershipTap: the first front-end's dispatcher's changes, told to every peer ---

    def _tell(self, message: Message) -> None:
        for control in self._controls:
            control.send(message)

    def methods(self, names: list[str], sync_methods: typing.Collection[str],
                infos: typing.Sequence[MethodInfo] | None) -> None:
        self._tell(Methods(generation=0, names=names, sync=list(sync_methods), infos=list(infos or [])))

    def ready_worker(self, worker: Worker) -> None:
        self._tell(Serve(pid=worker.pid))

    def unready(self, worker: Worker) -> None:
        self._tell(Retire(pid=worker.pid))

    def struck(self, methods: list[str], caught: bool, pid: int = 0, origin: int = 0) -> None:
        """Tell every serving peer but `origin` (the one that said it) that worker `pid` died
        holding calls of `methods` (peerwire.Struck): each strikes them too."""
        message = Struck(methods=methods, caught=caught, pid=pid)
        for number in self.ready:
            if number != origin:
                self._controls[number - 1].send(message)

    def lost(self, worker: Worker, reason: str) -> None:
        self._tell(Lost(pid=worker.pid, reason=reason))

    # -- the stop -------------------------------------------------------------------------

    async def stop(self, timeout: float) -> None:
        """SIGTERM every peer (each drains as this process does) and wait for their exits;
        SIGKILL those still running after `timeout` seconds."""
        self._stopping = True
        if self.rounds is not None:
            self.rounds.stop()
        if self._check is not None:
            self._check.cancel()
        for process in self.processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                process.send_signal(signal.SIGCONT)  # (one stopped acts on it now, not at the kill: round 127)
        waits = [asyncio.ensure_future(p.wait()) for p in self.processes]
        if waits:
            _, late = await asyncio.wait(waits, timeout=timeout)
            for process in self.processes:
                if process.returncode is None:
                    log.warning("front-end process %d did not stop in %g s: killing it", process.pid, timeout)
                    process.kill()
            if late:
                await asyncio.wait(late, timeout=5)
        for control in self._controls:
            control.close()


class _Tap:
    """`Peers` as the dispatcher's `MembershipTap` (its `ready` is `Peers.ready_worker`)."""

    def __init__(self, peers: Peers) -> None:
        self.methods = peers.methods
        self.ready = peers.ready_worker
        self.unready = peers.unready
        self.lost = peers.lost


def tap(peers: Peers) -> _Tap:
    """The `MembershipTap` that tells `peers` (`Dispatcher.membership_tap`)."""
    return _Tap(peers)
