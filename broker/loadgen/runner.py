"""The load itself: connections that send, read and check, in one or several processes.

Theory of operation
-------------------
One load process runs one uvloop loop and its share of the ``--connections``. Each
connection is one `asyncio.Protocol` object for the whole run (it is reused across
reconnects) and does everything in its callbacks; there is no task per request:

* **send** (`LoadConnection._fill`): while fewer than ``depth`` requests are in
  flight, build the next body (`Workload.body`), frame it (`_frame`: the HTTP
  request head is prebuilt, only Content-Length varies), and append
  ``(t_start, t_sent, Expect)`` to the in-flight deque; all requests made in one
  call are written with one ``write``. Closed loop: refill as answers come back
  (with ``--pipeline N``, only once N slots are free, so requests go out N at a
  time). Open loop: send the requests whose intended time (`schedule`) has come;
  ``t_start`` is the *intended* time; a timer wakes the connection at the next one.
* **receive** (`data_received`): one clock read per chunk; httptools calls
  `on_message_complete` per response; the oldest in-flight record is popped (HTTP/1.1
  answers in order), the answer checked (`Checker.check`) and ``now - t_start``
  appended in µs to a plain list (folded into the histogram every tick).
* **failures**: a reset, a close by the server, an unparsable response or a request
  older than ``--timeout`` (swept every 100 ms) counts every in-flight request of
  that connection as a transport error; the connection reconnects after 50 ms while
  there is still something to send.

Time line (monotonic clock, shared by all processes on Linux):

    t0 ---- warm-up ---- t_measure ---- duration ---- t_end ---- drain (<= timeout)

Requests whose ``t_start`` is before ``t_measure`` are checked but not recorded.
After ``t_end`` nothing new is scheduled; in-flight answers are awaited, and in
open loop the requests that were due before ``t_end`` but could not be sent (their
connection was full) are still sent and measured from their intended time.

Transport seam: `LoadConnection` holds scheduling, in-flight records and checking;
a subclass supplies the framing (`_frame`) and the reading (`data_received`).
`HttpLoadConnection` is HTTP/1.1; NDJSON over ``tcp://`` / ``unix://`` would be a
second subclass selected by `Target.scheme`.

Several processes (``--processes``): `run` spawns them (multiprocessing "spawn"),
each connects, reports ready, and starts at a common ``t0`` sent by the parent;
each sends `Progress` records while running and one `ProcessResult` at the end,
msgspec-encoded over a pipe. The parent adds the tallies and the histograms.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import multiprocessing
import multiprocessing.connection
import time
import typing
import urllib.parse
from collections.abc import Callable

import httptools
import msgspec

from broker.loadgen import schedule
from broker.loadgen.check import Checker, Tally
from broker.loadgen.stats import Latency
from broker.loadgen.workload import Call, Expect, IdMode, Workload

__all__ = ["ProcessResult", "Progress", "RunError", "Spec", "Target", "run", "run_process"]

TICK_S = 0.25  # histogram fold and progress period
SWEEP_S = 0.1  # timeout sweep period
RECONNECT_S = 0.05
_now = time.monotonic


class RunError(Exception):
    """The run could not be done at all (bad target, a load process died, ...)."""


class Target(typing.NamedTuple):
    """Where to send: parsed from ``http://host:port/path``.

    scheme: "http" (``tcp`` and ``unix`` NDJSON are reserved for later).
    """

    scheme: str
    host: str
    port: int
    path: str
    url: str

    @classmethod
    def parse(cls, url: str) -> Target:
        """Parse a target URL; raises `RunError` for an unsupported or malformed one."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme in ("tcp", "unix"):
            raise RunError(f"{parts.scheme}:// (NDJSON) targets are not supported yet: {url}")
        if parts.scheme != "http":
            raise RunError(f"target must be http://host:port/path, got {url!r}")
        try:
            port = parts.port or 80
        except ValueError as exc:
            raise RunError(f"bad port in {url!r}: {exc}") from None
        if not parts.hostname:
            raise RunError(f"no host in {url!r}")
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls("http", parts.hostname, port, path, url)


class Spec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a load process needs (sent to spawned processes as msgpack).

    Units: seconds for durations, requests/s for ``rate`` (None = closed loop).
    """

    target: str
    calls: list[Call]
    connections: int = 16
    depth: int = 1
    pipeline: int = 1
    rate: float | None = None
    batch: int = 1
    ids: IdMode = "int"
    processes: int = 1
    duration: float = 10.0
    warmup: float = 1.0
    timeout: float = 30.0
    seed: int = 0


class Progress(msgspec.Struct, frozen=True, tag="progress"):
    """Counters of one load process so far (p99_ms: its own p99, 0 if not computed)."""

    calls: int
    errors: int
    failures: int
    transport_errors: int
    p99_ms: float


class ProcessResult(msgspec.Struct, frozen=True, tag="result"):
    """What one load process hands back at the end.

    histogram: `Latency.encode()` of its latencies (µs).
    unsent: open-loop requests that were due but never sent before the drain ended.
    drain_s: how long answers kept coming after the measured window (an overloaded
        server in open loop answers the backlog then).
    """

    requests: int
    calls: int
    errors_by_code: dict[int, int]
    wrong_id: int
    missing: int
    duplicate: int
    malformed: int
    transport_errors: int
    unsent: int
    histogram: bytes
    drain_s: float = 0.0  # seconds from the end of the measured window to the last answer
    first_problem: str = ""

    def tally(self) -> Tally:
        """The counters as a `Tally`."""
        t = Tally()
        t.requests, t.calls = self.requests, self.calls
        t.errors_by_code = dict(self.errors_by_code)
        t.wrong_id, t.missing, t.duplicate, t.malformed = (
            self.wrong_id, self.missing, self.duplicate, self.malformed)
        t.transport_errors = self.transport_errors
        t.first_problem = self.first_problem
        return t


class _Shared:
    """State of one load process that its connections share."""

    __slots__ = ("checker", "conns", "depth", "lat", "loop", "open", "pipeline", "sending", "started",
                 "stopped", "t0", "t_end", "t_measure", "target", "timeout", "workload")

    def __init__(self, spec: Spec, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.target = Target.parse(spec.target)
        self.workload = Workload(spec.calls, spec.batch, spec.ids, spec.seed)
        self.checker = Checker(Tally())
        self.lat: list[int] = []
        self.open = spec.rate is not None
        self.pipeline = max(1, spec.pipeline)
        self.depth = max(spec.depth, self.pipeline)
        self.timeout = spec.timeout
        self.started = False  # t0 has come
        self.sending = False  # closed loop: between t0 and t_end
        self.stopped = False  # the run is over: no more reconnects
        self.t0 = self.t_end = 0.0
        self.t_measure = float("inf")
        self.conns: list[LoadConnection] = []


_Record = tuple[float, float, Expect | msgspec.Raw]  # (t_start: intended or sent, t_sent, expect)


class LoadConnection(asyncio.Protocol):
    """One connection's scheduling, in-flight records and checking (transport-neutral).

    phase / interval: its open-loop timing (`schedule.connection_timing`), unused in
    closed loop. Subclasses implement `_frame` and `data_received`.
    """

    __slots__ = ("_aborted", "_inflight", "_interval", "_k", "_next_i", "_now", "_phase", "_s",
                 "_timer", "_transport", "connected")

    def __init__(self, shared: _Shared, phase: float = 0.0, interval: float = 0.0) -> None:
        self._s = shared
        self._phase = phase
        self._interval = interval
        self._inflight: collections.deque[_Record] = collections.deque()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._k = 0  # bodies built (ids stay unique across reconnects)
        self._next_i = 0  # open loop: next request index of the schedule
        self._now = 0.0
        self._aborted = False
        self.connected = False

    # -- framing, by subclasses -----------------------------------------------------------
    def _frame(self, body: bytes) -> bytes:
        raise NotImplementedError

    def _reset_reader(self) -> None:
        raise NotImplementedError

    # -- asyncio callbacks -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        self._aborted = False
        self.connected = True
        self._reset_reader()

    def connection_lost(self, exc: Exception | None) -> None:
        s = self._s
        self._transport = None
        self.connected = False
        lost = len(self._inflight)
        self._inflight.clear()
        if lost:
            s.checker.tally.transport_errors += lost
            s.checker.tally.problem(f"connection lost with {lost} request(s) in flight" + (f": {exc}" if exc else ""))
        elif not self._aborted and self.wanted():
            s.checker.tally.transport_errors += 1  # closed on us with nothing in flight
            s.checker.tally.problem("the server closed an idle connection")
        if self.wanted():
            s.loop.call_later(RECONNECT_S, self.reconnect)

    # -- sending ---------------------------------------------------------------------------
    def wanted(self) -> bool:
        """True while this connection still has requests to send."""
        s = self._s
        if s.stopped:
            return False
        if not s.started:
            return True
        if not s.open:
            return s.sending
        return schedule.intended(s.t0, self._phase, self._interval, self._next_i) < s.t_end

    def start(self) -> None:
        """Begin sending (called at t0)."""
        if self._transport is not None:
            self._fill()

    def _fill(self) -> None:
        s = self._s
        transport = self._transport
        if transport is None:
            return
        inflight = self._inflight
        free = s.depth - len(inflight)
        if free <= 0:
            return
        body_of = s.workload.body
        frame = self._frame
        out: list[bytes] = []
        now = _now()
        k = self._k
        if not s.open:
            if not s.sending or (free < s.pipeline and inflight):
                return
            for _ in range(free):
                body, expect = body_of(k)
                k += 1
                out.append(frame(body))
                inflight.append((now, now, expect))
        elif s.started:
            i = self._next_i
            t0, phase, interval, t_end = s.t0, self._phase, self._interval, s.t_end
            t = t0 + phase + i * interval
            while free and t <= now and t < t_end:
                body, expect = body_of(k)
                k += 1
                out.append(frame(body))
                inflight.append((t, now, expect))
                free -= 1
                i += 1
                t = t0 + phase + i * interval
            self._next_i = i
            if free and t < t_end and self._timer is None:
                self._timer = s.loop.call_later(t - now, self._on_timer)
        self._k = k
        if out:
            transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _on_timer(self) -> None:
        self._timer = None
        self._fill()

    # -- answers ---------------------------------------------------------------------------
    def _answered(self, status: int, body: bytes) -> None:
        s = self._s
        try:
            t_start, _sent, expect = self._inflight.popleft()
        except IndexError:  # an answer nobody asked for
            s.checker.tally.malformed += 1
            return
        recording = t_start >= s.t_measure
        checker = s.checker
        checker.tally.recording = recording
        checker.check(status, body, expect)
        if recording:
            s.lat.append(int((self._now - t_start) * 1e6))

    # -- failures --------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Abort the connection if its oldest request is older than the timeout."""
        inflight = self._inflight
        if inflight and now - inflight[0][1] > self._s.timeout and self._transport is not None:
            self._s.checker.tally.transport_errors += len(inflight)
            self._s.checker.tally.problem(f"no answer within --timeout {self._s.timeout:g} s")
            inflight.clear()
            self.abort()

    def abort(self) -> None:
        """Drop the connection without counting anything more."""
        self._aborted = True
        if self._transport is not None:
            self._transport.abort()

    def reconnect(self) -> None:
        """Open a new connection for this protocol object (if still wanted)."""
        if self._transport is None and self.wanted():
            self._s.loop.create_task(connect(self))

    def idle(self) -> bool:
        """Nothing in flight and nothing left to send."""
        return not self._inflight and not self.wanted()

    def outstanding(self) -> int:
        """In flight plus (open loop) due-but-unsent requests."""
        s = self._s
        unsent = 0
        if s.open and s.started:
            unsent = schedule.due(s.t0, self._phase, self._interval, self._next_i, s.t_end, s.t_end)
        return len(self._inflight) + unsent

    def close(self) -> None:
        """Stop: cancel the timer and close the transport."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._aborted = True
        if self._transport is not None:
            self._transport.close()


class HttpLoadConnection(LoadConnection):
    """HTTP/1.1 keep-alive framing: POST requests, httptools response parser."""

    __slots__ = ("_body", "_head", "_keep_alive", "_parser")

    def __init__(self, shared: _Shared, phase: float = 0.0, interval: float = 0.0) -> None:
        super().__init__(shared, phase, interval)
        t = shared.target
        host = t.host if ":" not in t.host else f"[{t.host}]"
        self._head = (f"POST {t.path} HTTP/1.1\r\nHost: {host}:{t.port}\r\n"
                      "Content-Type: application/json\r\nContent-Length: ").encode()
        self._body: list[bytes] = []
        self._parser = httptools.HttpResponseParser(self)
        self._keep_alive = True

    def _frame(self, body: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (self._head, len(body), body)

    def _reset_reader(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._body.clear()
        self._keep_alive = True

    def data_received(self, data: bytes) -> None:
        self._now = _now()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._s.checker.tally.malformed += 1
            self._s.checker.tally.transport_errors += len(self._inflight)
            self._inflight.clear()
            self.abort()
            return
        if self._keep_alive:
            self._fill()

    def on_body(self, chunk: bytes) -> None:
        self._body.append(chunk)

    def on_message_complete(self) -> None:
        chunks = self._body
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if not self._parser.should_keep_alive():
            self._keep_alive = False  # the server will close: do not send more here
            self._aborted = True  # and its close is not an error
        self._answered(self._parser.get_status_code(), body)


async def connect(conn: LoadConnection, start: bool = True) -> bool:
    """Connect ``conn`` to its target and (if ``start``) begin sending; on failure count
    a transport error and retry after `RECONNECT_S` while the connection is wanted."""
    s = conn._s
    t = s.target
    try:
        await asyncio.wait_for(s.loop.create_connection(lambda: conn, t.host, t.port), s.timeout)
    except (TimeoutError, OSError) as exc:
        s.checker.tally.transport_errors += 1
        s.checker.tally.problem(f"cannot connect to {t.host}:{t.port}: {exc.strerror or type(exc).__name__}"
                                if isinstance(exc, OSError) and exc.strerror else
                                f"cannot connect to {t.host}:{t.port}: {type(exc).__name__}")
        if conn.wanted():
            s.loop.call_later(RECONNECT_S, conn.reconnect)
        return False
    if start:
        conn.start()
    return True


async def run_process(spec: Spec, first: int, count: int, *,
                      ready: Callable[[], float] | None = None,
                      on_progress: Callable[[Progress], None] | None = None,
                      want_p99: bool = False) -> ProcessResult:
    """Run connections ``first .. first+count-1`` (of ``spec.connections``) in this loop.

    ready: called once all are connected; returns t0 (monotonic seconds) to start
        at (default: now).
    on_progress: called every `TICK_S` seconds with this process's counters
        (``p99_ms`` computed only when ``want_p99``: it costs ~1 ms).
    Returns when the run and its drain are over.
    """
    loop = asyncio.get_running_loop()
    s = _Shared(spec, loop)
    # The hot path makes no reference cycles; the cyclic GC would only add pauses
    # (a full collection of a big heap takes milliseconds) to the latencies measured.
    gc_was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        return await _run_process(s, spec, first, count, ready, on_progress, want_p99)
    finally:
        if gc_was_enabled:
            gc.enable()
        gc.unfreeze()


async def _run_process(s: _Shared, spec: Spec, first: int, count: int,
                       ready: Callable[[], float] | None,
                       on_progress: Callable[[Progress], None] | None,
                       want_p99: bool) -> ProcessResult:
    conns: list[LoadConnection] = []
    for g in range(first, first + count):
        phase = interval = 0.0
        if spec.rate is not None:
            phase, interval = schedule.connection_timing(spec.rate, spec.connections, g)
        conns.append(HttpLoadConnection(s, phase, interval))
    s.conns = conns
    await asyncio.gather(*(connect(c, start=False) for c in conns))
    t0 = ready() if ready is not None else _now()
    s.t0, s.t_measure = t0, t0 + spec.warmup
    s.t_end = s.t_measure + spec.duration
    if t0 > _now():
        await asyncio.sleep(t0 - _now())
    s.started = True
    s.sending = True
    for c in conns:
        c.start()
    hist = Latency()
    tally = s.checker.tally

    def tick() -> None:
        hist.record_many(s.lat)
        if on_progress is not None:
            on_progress(Progress(tally.calls, tally.errors, tally.failures, tally.transport_errors,
                                 hist.percentile_ms(99) if want_p99 else 0.0))

    next_tick = _now() + TICK_S
    while True:
        now = _now()
        if now >= s.t_end:
            break
        for c in conns:
            c.sweep(now)
        if now >= next_tick:
            tick()
            next_tick = now + TICK_S
        await asyncio.sleep(min(SWEEP_S, s.t_end - now))
    s.sending = False
    deadline = s.t_end + spec.timeout
    while _now() < deadline and not all(c.idle() for c in conns):
        now = _now()
        for c in conns:
            c.sweep(now)
        if now >= next_tick:
            tick()
            next_tick = now + TICK_S
        await asyncio.sleep(0.01)
    drain_s = max(0.0, _now() - s.t_end)
    unsent = 0
    s.stopped = True
    for c in conns:
        out = c.outstanding()
        inflight = len(c._inflight)
        tally.transport_errors += inflight  # still unanswered at the end of the drain
        c._inflight.clear()
        unsent += out - inflight
        c.close()
    await asyncio.sleep(0)
    hist.record_many(s.lat)
    return ProcessResult(tally.requests, tally.calls, dict(tally.errors_by_code), tally.wrong_id,
                         tally.missing, tally.duplicate, tally.malformed, tally.transport_errors,
                         unsent, hist.encode(), drain_s, tally.first_problem)


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
    """Entry point of a spawned load process."""
    import signal

    import uvloop

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; daemons die with it

    spec = msgspec.msgpack.decode(spec_bytes, type=Spec)

    def ready() -> float:
        pipe.send_bytes(b"ready")
        return float(pipe.recv_bytes().decode())

    def progress(p: Progress) -> None:
        pipe.send_bytes(_encode(p))

    result = uvloop.run(run_process(spec, first, count, ready=ready, on_progress=progress,
                                    want_p99=want_p99))
    pipe.send_bytes(_encode(result))
    pipe.close()


def run(spec: Spec, on_progress: Callable[[Progress], None] | None = None,
        want_p99: bool = False) -> list[ProcessResult]:
    """Run ``spec`` in ``spec.processes`` load processes (in this one when 1) and return
    each process's result. ``on_progress`` gets the *summed* counters (p99: the largest
    of the processes' p99s) about every `TICK_S` s. Raises `RunError` if the target is
    bad or a load process dies or does not become ready within ``timeout + 30`` s."""
    Target.parse(spec.target)
    if spec.processes <= 1:
        import uvloop

        return [uvloop.run(run_process(spec, 0, spec.connections, on_progress=on_progress,
                                       want_p99=want_p99))]
    parts = split(spec.connections, spec.processes)
    ctx = multiprocessing.get_context("spawn")
    spec_bytes = msgspec.msgpack.encode(spec)
    procs: list[multiprocessing.process.BaseProcess] = []
    pipes: list[multiprocessing.connection.Connection] = []
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
                if not proc.is_alive() or _now() > deadline:
                    raise RunError(f"load process {proc.name} did not start (exit code {proc.exitcode})")
            if pipe.recv_bytes() != b"ready":
                raise RunError("load process protocol error")
        t0 = _now() + 0.05
        for pipe in pipes:
            pipe.send_bytes(repr(t0).encode())
        latest: dict[int, Progress] = {}
        results: dict[int, ProcessResult] = {}
        by_fd = {pipe.fileno(): i for i, pipe in enumerate(pipes)}
        end = t0 + spec.warmup + spec.duration + spec.timeout + 30
        while len(results) < len(pipes):
            waiting = [pipes[i] for i in range(len(pipes)) if i not in results]
            sentinels = [procs[i].sentinel for i in range(len(procs)) if i not in results]
            if _now() > end:
                raise RunError("load processes did not finish in time")
            for obj in multiprocessing.connection.wait([*waiting, *sentinels], timeout=0.5):
                if isinstance(obj, int):
                    continue  # a process exited: its pipe says whether it finished
                pipe = typing.cast(multiprocessing.connection.Connection, obj)
                i = by_fd[pipe.fileno()]
                try:
                    msg = _decode_msg(pipe.recv_bytes())
                except EOFError:
                    raise RunError(f"load process {procs[i].name} died "
                                   f"(exit code {procs[i].exitcode})") from None
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
        return [results[i] for i in range(len(pipes))]
    finally:
        for pipe in pipes:
            pipe.close()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
