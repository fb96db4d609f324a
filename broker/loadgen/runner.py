"""The load itself: connections that send, read and check, in one or several processes.

Theory of operation
-------------------
One load process runs one uvloop loop and its share of the ``--connections``. Each
connection is one `asyncio.Protocol` object for the whole run (it is reused across
reconnects) and does everything in its callbacks; there is no task per request:

* **send** (`LoadConnection._fill`): while fewer than ``depth`` requests are in
  flight, build the next body (`Workload.body`), frame it (`_frame`: the HTTP
  request head is prebuilt, only Content-Length varies; NDJSON adds a newline), and
  enter ``(t_start, t_sent, Expect)`` in the in-flight table; all requests made in one
  call are written with one ``write``. Closed loop: refill as answers come back
  (with ``--pipeline N``, only once N slots are free, so requests go out N at a
  time). Open loop: send the requests whose intended time (`schedule`) has come;
  ``t_start`` is the *intended* time; a timer wakes the connection at the next one.
* **receive** (`data_received`): one clock read per chunk. HTTP: httptools calls
  `on_message_complete` per response; the oldest in-flight record is popped (HTTP/1.1
  answers in order). NDJSON: each line is looked up by id (below). The answer is
  checked (`Checker`) and ``now - t_start`` appended in µs to a plain list (folded
  into the histogram every tick).
* **failures**: a reset, a close by the server, an unparsable response or a request
  older than ``--timeout`` (swept every 100 ms) counts every in-flight request of
  that connection as a transport error (NDJSON: only the requests that are late, see
  below). Except over HTTP, an unannounced close between answers (a complete answer,
  no byte of the next, every request in flight written after that answer): those
  requests are sent again on the next connection (`_keep_for_retry`, `resent`). A close
  with nothing in flight after a complete answer is orderly, announced or not. While
  there is still something to send the connection is reopened: at once if it got an
  answer, after a back-off (`RECONNECT_S` doubling to `RECONNECT_MAX_S`) otherwise or
  after a failure: a refused or failed connect, a close or reset before any answer, a
  503 turning the connection away, a timeout.
  A transport that is closed or closing is never written to.

Time line (monotonic clock, shared by all processes on Linux):

    t0 ---- warm-up ---- t_measure ---- duration ---- t_end ---- drain (<= timeout)

Requests whose ``t_start`` is before ``t_measure`` are checked but not recorded. In open
loop, at ``t_measure`` the warm-up's requests not yet sent are dropped (`_skip_warmup`):
the window's schedule starts afresh, so a warm-up backlog is neither sent in the window
(where its answers would not count) nor counted as never sent.
After ``t_end`` nothing is sent (``sending`` is False): in open loop the requests that
were due before ``t_end`` but could not be sent (their connection was full) are
"never sent" (``unsent``). The drain only awaits answers to requests already sent; at
its end (``t_end + timeout``) what is still unanswered has waited past ``--timeout`` and
counts as timed out (transport errors, one problem line for all connections).

Interrupts: `_Shared.interrupt` (SIGINT/SIGTERM handler, or the parent's ``stop``
message) only notes the signal and wakes the main loop, which ends the window there
(``t_end`` = now), drains for at most `INTERRUPT_DRAIN_S` (or ``--timeout``) and
returns the result with ``interrupted`` and the real ``window_s``; requests still in
flight then are ``abandoned``, not errors. A second interrupt ends the drain at once.

Transport seam: `LoadConnection` holds the scheduling and the depth; a subclass
supplies the framing (`_frame`), the in-flight table (`_inflight`, filled through
`_push`), the reading (`data_received`), the timeout `sweep` and `give_up`.
`HttpLoadConnection` is HTTP/1.1; `StreamLoadConnection` is NDJSON over ``tcp://``
and ``unix://`` (selected by `Target.scheme`).

NDJSON: matching out-of-order answers
-------------------------------------
The stream front-end writes each answer line as soon as it is ready, so lines come
in any order. Every id names exactly one body of its connection (`workload`: ids
count up across reconnects; in ``repeated`` mode the calls of one batch share their
body's id), so the in-flight table is a dict keyed by raw id bytes: a single call
by its id, a batch by its first id, with a second dict from each of a batch's ids
to that key. A line is decoded once (msgspec, envelope only) and its (first
known) id pops the record; the line is then checked against that body's `Expect`
with the HTTP rules (an array must answer a batch, by its set of ids as a
multiset, and so on). Lines that match no record:

* an id sent on this connection whose body was answered already: ``duplicate``;
* an id never sent on this connection: ``wrong_id``; a line that is not JSON, or
  has no id: ``malformed``. Such a *stray* line stands in for one body left without
  an answer (as a wrong-id answer does over HTTP): that body is given up when its
  ``--timeout`` passes, when the connection closes or the run ends, or at once
  when there are as many strays as bodies in flight (with ``--depth 1``: at once);
  it then counts no transport error but one answered request, as a wrong answer
  does over HTTP (a batch: its calls beyond the stray's count are ``missing``). An answer arriving after its body was given up is ignored;
* an error answer with ``"id": null`` (the server could not read the request):
  taken as the answer to the oldest body in flight.

A body of only notifications gets no line: it is done once written (counted in
``requests``, no latency) and holds no slot, so the connection goes on at the next
loop iteration, paced by the transport's write buffer. Per-call timeouts do not
close a stream connection: later answers keep coming on it.

Cost per single call on the hot path: one ``split`` per chunk, one msgspec decode
of the envelope, ``bytes(id)`` (~0.2 µs) and one dict pop; no NamedTuple, no
second decode (`Checker.check_line` gets the decoded line on the slow path).

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
import os
import time
import typing
import urllib.parse
from collections.abc import Callable

import httptools
import msgspec

from broker.loadgen import schedule
from broker.loadgen.check import Answer, Checker, Tally
from broker.loadgen.stats import Latency
from broker.loadgen.workload import Call, Expect, IdMode, Workload

__all__ = ["ProcessResult", "Progress", "RunError", "Spec", "Target", "run", "run_process"]

TICK_S = 0.25  # histogram fold and progress period
SWEEP_S = 0.1  # timeout sweep period
RECONNECT_S = 0.05  # first back-off after a failed connection; doubles per failure in a row
RECONNECT_MAX_S = 1.0  # the back-off's cap
INTERRUPT_DRAIN_S = 1.0  # interrupted: answers to requests in flight are awaited this long at most
_now = time.monotonic


class RunError(Exception):
    """The run could not be done at all (bad target, a load process died, ...)."""


UNIX_PATH_MAX = 107  # bytes of a Unix socket path (sun_path is 108 with its NUL)
TARGET_FORMS = "http://host:port/path, tcp://host:port or unix:///path/to.sock"


class Target(typing.NamedTuple):
    """Where to send: parsed from ``http://host:port/path`` (HTTP/1.1),
    ``tcp://host:port`` or ``unix:///path/to.sock`` (newline-delimited JSON).

    scheme: "http", "tcp" or "unix".
    host / port: of http and tcp ("" and 0 for unix).
    path: the HTTP request path, or the Unix socket path ("" for tcp).
    """

    scheme: str
    host: str
    port: int
    path: str
    url: str

    @property
    def stream(self) -> bool:
        """True for the NDJSON targets (tcp, unix)."""
        return self.scheme != "http"

    @property
    def where(self) -> str:
        """The address, for messages: ``host:port`` or ``unix://path``."""
        return f"unix://{self.path}" if self.scheme == "unix" else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, url: str) -> Target:
        """Parse a target URL; raises `RunError` for an unsupported or malformed one."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "unix":
            path = url[len("unix://"):] if url.startswith("unix://") else ""
            if not path:
                raise RunError(f"no socket path in {url!r}: write unix:///path/to.sock")
            if len(os.fsencode(path)) > UNIX_PATH_MAX:
                raise RunError(f"Unix socket path too long in {url!r}: "
                               f"{len(os.fsencode(path))} bytes, at most {UNIX_PATH_MAX}")
            return cls("unix", "", 0, path, url)
        if parts.scheme not in ("http", "tcp"):
            raise RunError(f"target must be {TARGET_FORMS}; got {url!r}")
        try:
            port = parts.port
        except ValueError as exc:
            raise RunError(f"bad port in {url!r}: {exc}") from None
        if not parts.hostname:
            raise RunError(f"no host in {url!r}")
        if parts.scheme == "tcp":
            if port is None:
                raise RunError(f"no port in {url!r}: write tcp://host:port")
            if parts.path not in ("", "/") or parts.query or parts.fragment:
                raise RunError(f"a tcp:// target has no path or query: {url!r}")
            return cls("tcp", parts.hostname, port, "", url)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls("http", parts.hostname, 80 if port is None else port, path, url)


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
    refused_batches: batches the server answered with one error for the whole body.
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
    refused_batches: int = 0
    interrupted: int = 0  # the signal that stopped the run early (0: it ran its course)
    window_s: float = 0.0  # the measured window's real length (shorter when interrupted)
    abandoned: int = 0  # interrupted: requests still in flight when it stopped (not errors)
    reconnects: int = 0  # connections reopened after a close, a reset or a failed connect
    backoffs: int = 0  # of those, the ones that waited first (after a failure)
    resent: int = 0  # HTTP: requests sent again after an unannounced close between answers

    def tally(self) -> Tally:
        """The counters as a `Tally`."""
        t = Tally()
        t.requests, t.calls = self.requests, self.calls
        t.errors_by_code = dict(self.errors_by_code)
        t.refused_batches = self.refused_batches
        t.wrong_id, t.missing, t.duplicate, t.malformed = (
            self.wrong_id, self.missing, self.duplicate, self.malformed)
        t.transport_errors = self.transport_errors
        t.first_problem = self.first_problem
        return t


class _Shared:
    """State of one load process that its connections share."""

    __slots__ = ("backoffs", "checker", "connecting", "conns", "depth", "hurry", "interrupted", "lat", "loop",
                 "open", "pipeline", "reconnects", "resent", "sending", "started", "stopped", "t0", "t_end", "t_measure",
                 "target", "timeout", "wake", "workload")

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
        self.connecting: set[asyncio.Task[bool]] = set()  # reconnects under way
        self.interrupted = 0  # the signal (or stop message) that ended the run early
        self.hurry = False  # interrupted twice: end the drain now
        self.wake = asyncio.Event()  # set by `interrupt` to wake the main loop at once
        self.reconnects = 0
        self.backoffs = 0
        self.resent = 0

    def interrupt(self, signum: int) -> None:
        """Stop early (a signal handler's whole job: the main loop acts on it). A second
        call cuts the drain short."""
        if self.interrupted:
            self.hurry = True
        else:
            self.interrupted = signum
        self.wake.set()


_Record = tuple[float, float, Expect | msgspec.Raw]  # (t_start: intended or sent, t_sent, expect)


class _InFlight(typing.Protocol):
    """The in-flight table of a connection, as the base class sees it: one entry per
    request body awaiting its answer."""

    def __len__(self) -> int: ...

    def clear(self) -> None: ...


class LoadConnection(asyncio.Protocol):
    """One connection's scheduling and depth (transport-neutral).

    phase / interval: its open-loop timing (`schedule.connection_timing`), unused in
    closed loop. Subclasses set `_inflight` and `_push` (records a request just
    framed), and implement `_frame`, `_reset_reader`, `data_received`, `sweep` and
    `give_up`.
    """

    __slots__ = ("_aborted", "_answered_here", "_connecting", "_failed", "_fails", "_inflight", "_interval", "_k",
                 "_k_conn", "_next_i", "_now", "_orderly", "_phase", "_push", "_retry", "_s", "_timer", "_transport",
                 "connected")

    _inflight: _InFlight
    _push: Callable[[_Record], None]

    def __init__(self, shared: _Shared, phase: float = 0.0, interval: float = 0.0) -> None:
        self._s = shared
        self._phase = phase
        self._interval = interval
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._k = 0  # bodies built (ids stay unique across reconnects)
        self._next_i = 0  # open loop: next request index of the schedule
        self._now = 0.0
        self._aborted = False
        self._orderly = False  # the server announced its close after a complete answer
        self._failed = False  # refused, timed out or not HTTP: back off before reconnecting
        self._connecting = False  # a `connect` for it is under way
        self._fails = 0  # failed connections in a row (sets the reconnect back-off)
        self._k_conn = 0  # `_k` when the current connection was made
        self._answered_here = False  # a complete answer came on the current connection
        self._retry: list[float] = []  # HTTP: t_start of requests to send again (see _keep_for_retry)
        self.connected = False

    # -- framing, by subclasses -----------------------------------------------------------
    def _frame(self, body: bytes) -> bytes:
        raise NotImplementedError

    def _reset_reader(self) -> None:
        raise NotImplementedError

    # -- asyncio callbacks -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        if self._s.stopped:  # a reconnect that finished after the run: uvloop's loop.close()
            self._aborted = True  # would wait for this open transport forever
            self._transport.abort()
            return
        self._aborted = False
        self._orderly = self._failed = self._answered_here = False
        self._k_conn = self._k
        self.connected = True
        self._reset_reader()

    def connection_lost(self, exc: Exception | None) -> None:
        s = self._s
        if self._transport is not None and not self._transport.is_closing():
            return  # the loss of an older transport of this object (a connect given up on)
        self._transport = None
        self.connected = False
        lost = len(self._inflight)
        if lost:
            lost -= self._keep_for_retry()
        self._inflight.clear()
        if lost:
            s.checker.tally.transport_errors += lost
            s.checker.tally.problem(f"connection lost with {lost} request(s) in flight" + (f": {exc}" if exc else ""))
        elif not self._aborted and not self._answered_here and not self._retry and self.wanted():
            s.checker.tally.transport_errors += 1  # closed on us before answering anything
            s.checker.tally.problem("the server closed a connection before answering on it")
        # (A close with nothing in flight after complete answers is orderly, announced or
        # not: HTTP/1.1 lets a server close an idle keep-alive connection at any time.)
        # A connection that got answers is reopened at once. Anything else (refused, a
        # failed connect, closed or reset before answering, a 503 turning it away, a
        # timeout): back off, doubling up to a cap, so that a server out of descriptors
        # is not hammered.
        if self._failed or not self._answered_here:
            self._fails += 1
        else:
            self._fails = 0
        if self.wanted() and not self._connecting:  # else `connect` retries
            self.retry()

    def _keep_for_retry(self) -> int:
        """The connection was lost with requests in flight: keep those that the server
        never began to answer, to send again on the next connection (their start times
        in `_retry`), and return how many. None here (HTTP overrides it)."""
        return 0

    def retry(self) -> None:
        """Reconnect: at once after an orderly close, else after the back-off."""
        s = self._s
        s.reconnects += 1
        if self._fails:
            s.backoffs += 1
            s.loop.call_later(min(RECONNECT_MAX_S, RECONNECT_S * 2 ** (self._fails - 1)), self.reconnect)
        else:
            self.reconnect()

    # -- sending ---------------------------------------------------------------------------
    def wanted(self) -> bool:
        """True while this connection still has requests to send."""
        s = self._s
        if s.stopped:
            return False
        if not s.started or self._retry:
            return True
        if not s.sending:  # the window is over: nothing more is sent, not even a backlog
            return False
        if not s.open:
            return True
        return schedule.intended(s.t0, self._phase, self._interval, self._next_i) < s.t_end

    def start(self) -> None:
        """Begin sending (called at t0)."""
        self._fill()

    def _fill(self) -> None:
        s = self._s
        transport = self._transport
        if transport is None or transport.is_closing():
            return  # closed (or closing) by the server or a failure: connection_lost will count it
        inflight = self._inflight
        free = s.depth - len(inflight)
        if free <= 0:
            return
        body_of = s.workload.body
        frame = self._frame
        push = self._push
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
                push((now, now, expect))
        elif s.sending:
            i = self._next_i
            t0, phase, interval, t_end = s.t0, self._phase, self._interval, s.t_end
            t = t0 + phase + i * interval
            if t < s.t_measure <= now:  # the window began with a warm-up backlog: drop it
                i = self._skip_warmup()
                t = t0 + phase + i * interval
            while free and t <= now and t < t_end:
                body, expect = body_of(k)
                k += 1
                out.append(frame(body))
                push((t, now, expect))
                free -= 1
                i += 1
                t = t0 + phase + i * interval
            self._next_i = i
            if free and t < t_end and self._timer is None:
                self._timer = s.loop.call_later(t - now, self._on_timer)
        self._k = k
        if out:
            transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _skip_warmup(self) -> int:
        """Open loop, once the measured window has begun: drop the warm-up's requests that
        are not sent yet (counted nowhere), so that the window's schedule starts afresh at
        ``t_measure`` and a backlog built up in the warm-up is neither sent in the window
        nor counted as never sent. Returns the new `_next_i`."""
        s = self._s
        first = schedule.first_at(s.t0, self._phase, self._interval, s.t_measure)
        if first > self._next_i:
            self._next_i = first
        return self._next_i

    def _on_timer(self) -> None:
        self._timer = None
        self._fill()

    # -- failures --------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Give up on requests older than the timeout (called every `SWEEP_S`)."""
        raise NotImplementedError

    def give_up(self, count: bool = True) -> int:
        """End of the drain: drop what is still in flight and return how many; ``count``:
        as transport errors (the caller words the problem once, for all connections)."""
        n = len(self._inflight) + len(self._retry)
        if n:
            if count:
                self._s.checker.tally.transport_errors += n
            self._inflight.clear()
            self._retry.clear()
        return n

    def abort(self) -> None:
        """Drop the connection without counting anything more."""
        self._aborted = True
        if self._transport is not None:
            self._transport.abort()

    def reconnect(self) -> None:
        """Open a new connection for this protocol object (if still wanted)."""
        if self._transport is None and not self._connecting and self.wanted():
            task = self._s.loop.create_task(connect(self))
            self._s.connecting.add(task)
            task.add_done_callback(self._s.connecting.discard)

    def idle(self) -> bool:
        """Nothing in flight and nothing left to send."""
        return not self._inflight and not self.wanted()

    def outstanding(self) -> int:
        """In flight plus (open loop) due-but-unsent requests."""
        s = self._s
        unsent = 0
        if s.open and s.started:
            unsent = schedule.due(s.t0, self._phase, self._interval, self._skip_warmup(), s.t_end, s.t_end)
        return len(self._inflight) + len(self._retry) + unsent

    def close(self) -> None:
        """Stop: cancel the timer and drop the transport. Aborted, not closed: a close
        waits to flush what is buffered, and a server that stopped reading would keep
        the handle open past the run (uvloop's loop.close() then fails with EBUSY)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._aborted = True
        if self._transport is not None:
            self._transport.abort()


class HttpLoadConnection(LoadConnection):
    """HTTP/1.1 keep-alive framing: POST requests, httptools response parser; answers
    come in request order, so the in-flight table is a FIFO."""

    __slots__ = ("_body", "_head", "_keep_alive", "_mid", "_parser", "_queue", "_t_answer")

    def __init__(self, shared: _Shared, phase: float = 0.0, interval: float = 0.0) -> None:
        super().__init__(shared, phase, interval)
        self._queue: collections.deque[_Record] = collections.deque()
        self._inflight = self._queue
        self._push = self._queue.append
        t = shared.target
        host = t.host if ":" not in t.host else f"[{t.host}]"
        self._head = (f"POST {t.path} HTTP/1.1\r\nHost: {host}:{t.port}\r\n"
                      "Content-Type: application/json\r\nContent-Length: ").encode()
        self._body: list[bytes] = []
        self._parser = httptools.HttpResponseParser(self)
        self._keep_alive = True
        self._mid = False  # part of a response has come (on_message_begin), not all of it
        self._t_answer = 0.0  # arrival of the last complete answer

    def _frame(self, body: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (self._head, len(body), body)

    def _reset_reader(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._body.clear()
        self._keep_alive = True
        self._mid = False

    def _fill(self) -> None:
        if self._retry:
            self._resend()
        super()._fill()

    def _resend(self) -> None:
        """Send the requests kept by `_keep_for_retry` again, first, as new bodies (ids
        count up) that keep their start times: their latency includes the reconnect."""
        transport = self._transport
        if transport is None or transport.is_closing() or self._s.stopped:
            return
        s = self._s
        now = _now()
        out: list[bytes] = []
        for t_start in self._retry:
            body, expect = s.workload.body(self._k)
            self._k += 1
            out.append(self._frame(body))
            self._push((t_start, now, expect))
        s.resent += len(self._retry)
        self._retry.clear()
        transport.write(b"".join(out))

    def _keep_for_retry(self) -> int:
        """An unannounced close between answers (HTTP/1.1 lets a server close a keep-alive
        connection at any time, without `Connection: close`): after a complete answer, no
        byte of the next, and every request in flight written after that answer (the
        generator answered the answer with a new request as the server closed). Those
        requests are sent again on the next connection, not counted as lost. Anything
        else (a failure, a cut answer, a request the server had before its last answer)
        is lost: transport errors."""
        queue = self._queue
        if self._failed or self._mid or not self._answered_here or queue[0][1] < self._t_answer:
            return 0
        self._retry.extend(rec[0] for rec in queue)
        return len(queue)

    def on_message_begin(self) -> None:
        self._mid = True

    def data_received(self, data: bytes) -> None:
        self._now = _now()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            tally = self._s.checker.tally
            tally.malformed += 1
            tally.transport_errors += len(self._inflight)
            tally.problem(f"not an HTTP response ({exc or type(exc).__name__}): it began {data[:80]!r}")
            self._inflight.clear()
            self._failed = True  # not a server we can talk to: back off before trying again
            self.abort()
            return
        if self._keep_alive:
            self._fill()
        elif not self._queue and self._transport is not None:
            self._transport.close()  # the server closes after its answer: so do we, and reopen

    def on_body(self, chunk: bytes) -> None:
        self._body.append(chunk)

    def on_message_complete(self) -> None:
        chunks = self._body
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        status = self._parser.get_status_code()
        self._mid = False
        self._t_answer = self._now
        self._answered_here = True
        if not self._parser.should_keep_alive():
            self._keep_alive = False  # the server will close: do not send more here
            self._aborted = True  # and its close is not an error
            self._orderly = True
            if status == 503 and b'"jsonrpc"' not in body:
                # Turned away (a broker past its max_connections answers so, before or
                # instead of reading a request): a refused connection, not an answer.
                self._refuse(status, body)
                return
        self._answered(status, body)

    def _refuse(self, status: int, body: bytes) -> None:
        tally = self._s.checker.tally
        tally.transport_errors += 1
        tally.problem(f"the server refused the connection: HTTP {status}, body {body[:120]!r}")
        self._failed = True
        self._orderly = False
        if self._queue:
            self._queue.popleft()  # the request it was sent instead of an answer to

    def _answered(self, status: int, body: bytes) -> None:
        s = self._s
        try:
            t_start, _sent, expect = self._queue.popleft()
        except IndexError:  # an answer nobody asked for
            s.checker.tally.malformed += 1
            s.checker.tally.problem(f"an HTTP response to no request: HTTP {status}, body {body[:120]!r}")
            return
        recording = t_start >= s.t_measure
        checker = s.checker
        checker.tally.recording = recording
        checker.check(status, body, expect)
        if recording:
            s.lat.append(int((self._now - t_start) * 1e6))

    def sweep(self, now: float) -> None:
        """Abort the connection if its oldest request is older than the timeout (the
        answers behind it cannot overtake it)."""
        queue = self._queue
        if queue and now - queue[0][1] > self._s.timeout and self._transport is not None:
            self._s.checker.tally.transport_errors += len(queue)
            self._s.checker.tally.problem(f"no answer within --timeout {self._s.timeout:g} s")
            queue.clear()
            self._failed = True
            self.abort()


_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
_NL = b"\n"
_NULL = b"null"
MAX_LINE_BYTES = 64 * 1024 * 1024  # an answer line longer than this: malformed, connection dropped


class _IdOnly(msgspec.Struct, gc=False):
    """Just the id of an answer that is not a well-formed Response (to find its body)."""

    id: msgspec.Raw = msgspec.Raw()


class StreamLoadConnection(LoadConnection):
    """NDJSON over TCP or a Unix socket: one request body per line out, one answer line
    per answered body back, in any order (matched by id: see the module docstring).

    `_pending` is the in-flight table: raw id bytes of a single call, or first id of a
    batch, to its record; insertion order is send order, so its first entry is the
    oldest. `_owner` maps each id of a batch in flight to its key.
    """

    __slots__ = ("_decode", "_decode_id", "_decode_raws", "_expired", "_k_first", "_owner", "_parts",
                 "_parts_len", "_pending", "_quiet", "_refill_armed", "_strays", "_write_paused")

    def __init__(self, shared: _Shared, phase: float = 0.0, interval: float = 0.0) -> None:
        super().__init__(shared, phase, interval)
        self._pending: dict[bytes, _Record] = {}
        self._inflight = self._pending
        self._push = self._register
        self._owner: dict[bytes, bytes] = {}
        # (failures it counted, arrival time) of each stray line not yet tied to a body
        self._strays: collections.deque[tuple[int, float]] = collections.deque()
        self._expired: set[bytes] = set()  # ids of bodies given up on: their late answers are ignored
        self._parts: list[bytes] = []  # the incomplete last line, in chunks (never rescanned)
        self._parts_len = 0
        self._k_first = 0  # first body number sent on the current connection
        self._quiet = 0  # bodies of only notifications written by the current `_fill`
        self._refill_armed = False
        self._write_paused = False
        self._decode = msgspec.json.Decoder(Answer | list[Answer]).decode
        self._decode_id = msgspec.json.Decoder(_IdOnly).decode
        self._decode_raws = msgspec.json.Decoder(list[msgspec.Raw]).decode

    def _frame(self, body: bytes) -> bytes:
        return body + _NL

    def _reset_reader(self) -> None:
        self._parts.clear()
        self._parts_len = 0
        self._owner.clear()
        self._strays.clear()
        self._expired.clear()
        self._k_first = self._k
        self._write_paused = False

    # -- sending ---------------------------------------------------------------------------
    def _register(self, rec: _Record) -> None:
        """Enter a request just framed in the in-flight table (its `_push`)."""
        expect = rec[2]
        if type(expect) is msgspec.Raw:
            self._pending[bytes(expect)] = rec
            return
        ids = expect.ids
        if not ids:  # only notifications: no line will answer it; done once written
            self._quiet += 1
            if rec[0] >= self._s.t_measure:
                tally = self._s.checker.tally
                tally.requests += 1
                tally.calls += expect.calls
            return
        key = ids[0]
        self._pending[key] = rec
        if expect.batch:
            owner = self._owner
            for id_ in ids:
                owner[id_] = key

    def _fill(self) -> None:
        self._quiet = 0
        super()._fill()
        # Notification-only bodies hold no slot and get no answer to refill on: go on
        # at the next loop iteration (paced by the transport's write buffer).
        if self._quiet and not self._refill_armed and not self._write_paused:
            self._refill_armed = True
            self._s.loop.call_soon(self._refill)

    def _refill(self) -> None:
        self._refill_armed = False
        if not self._write_paused:
            self._fill()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._fill()

    # -- answers ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._now = now = _now()
        if self._parts or data.find(_NL) < 0:
            data = self._join_partial(data)
            if not data:
                return
        self._answered_here = True  # a complete line came: the connection works
        lines = data.split(_NL)
        tail = lines.pop()
        if tail:
            self._parts.append(tail)
            self._parts_len = len(tail)
        s = self._s
        pending = self._pending
        decode = self._decode
        t_measure = s.t_measure
        tally = s.checker.tally
        lat = s.lat
        for line in lines:
            try:
                d = decode(line)
            except _DECODE_ERRORS:
                self._odd_line(line, None)
                continue
            if type(d) is Answer:
                rec = pending.pop(bytes(d.id), None)
                if (rec is not None and type(rec[2]) is msgspec.Raw and len(d.error) == 0
                        and len(d.result) and d.jsonrpc == "2.0"):
                    # Fast path: one call, answered by a result (its id matched by the pop).
                    t_start = rec[0]
                    if t_start >= t_measure:
                        tally.requests += 1
                        tally.calls += 1
                        lat.append(int((now - t_start) * 1e6))
                    continue
                if rec is not None:
                    self._answered(rec, line, d)
                    continue
            self._odd_line(line, d)
        if self._transport is not None:
            self._fill()

    def _join_partial(self, data: bytes) -> bytes:
        """Add ``data`` to the incomplete line; return the bytes to split into lines
        (b"" while no line is complete). Drops the connection past `MAX_LINE_BYTES`."""
        nl = data.find(_NL)
        if nl < 0:
            self._parts.append(data)
            self._parts_len += len(data)
            if self._parts_len > MAX_LINE_BYTES:
                tally = self._s.checker.tally
                tally.malformed += 1
                tally.problem(f"an answer line longer than {MAX_LINE_BYTES} bytes")
                self._parts.clear()
                self._parts_len = 0
                self.abort()  # connection_lost counts what is in flight
            return b""
        self._parts.append(data)
        joined = b"".join(self._parts)
        self._parts.clear()
        self._parts_len = 0
        return joined

    def _find(self, key: bytes) -> _Record | None:
        """Pop the record of the body that the id ``key`` belongs to, if in flight."""
        rec = self._pending.pop(key, None)
        if rec is None and self._owner:
            owner_key = self._owner.get(key)
            if owner_key is not None:
                rec = self._pending.pop(owner_key, None)
        return rec

    def _answered(self, rec: _Record, line: bytes, decoded: Answer | list[Answer] | None) -> None:
        """Check ``line`` as the answer to the body of ``rec`` (popped from `_pending`)."""
        s = self._s
        t_start, _sent, expect = rec
        if type(expect) is not msgspec.Raw and expect.batch:
            owner = self._owner
            for id_ in expect.ids:
                owner.pop(id_, None)
        recording = t_start >= s.t_measure
        checker = s.checker
        checker.tally.recording = recording
        checker.check_line(line, expect, decoded)
        if recording:
            s.lat.append(int((self._now - t_start) * 1e6))

    def _ids_of(self, line: bytes) -> list[bytes] | None:
        """The ids in a line that is not a well-formed answer (None: not JSON at all)."""
        try:
            one = self._decode_id(line)
        except _DECODE_ERRORS:
            pass
        else:
            return [bytes(one.id)] if len(one.id) else []
        try:
            raws = self._decode_raws(line)
        except _DECODE_ERRORS:
            return None
        ids: list[bytes] = []
        for raw in raws:
            try:
                one = self._decode_id(raw)
            except _DECODE_ERRORS:
                continue
            if len(one.id):
                ids.append(bytes(one.id))
        return ids

    def _odd_line(self, line: bytes, decoded: Answer | list[Answer] | None) -> None:
        """The slow path: a line that did not decode as answers, an array, or an answer
        whose id is not in flight."""
        if decoded is None:
            if not line.strip():
                return  # a blank line (or the \r of a \r\n one)
            ids = self._ids_of(line)
        elif type(decoded) is Answer:
            ids = [bytes(decoded.id)]
        else:
            ids = [bytes(a.id) for a in typing.cast(list[Answer], decoded)]
        for key in ids or ():
            rec = self._find(key)
            if rec is not None:
                self._answered(rec, line, decoded)
                return
        tally = self._s.checker.tally
        if not ids:  # not JSON, or no id anywhere
            tally.malformed += 1
            tally.problem(f"malformed answer line: {line[:120]!r}")
            self._stray(1)
            return
        if (type(decoded) is Answer and ids[0] == _NULL and len(decoded.error)
                and len(decoded.result) == 0 and self._pending):
            # The server could not read a request's id (spec 5): take it as the answer
            # to the oldest body in flight.
            self._answered(self._pending.pop(next(iter(self._pending))), line, decoded)
            return
        wrong = duplicate = 0
        body_of_id = self._s.workload.body_of_id
        for key in ids:
            if key in self._expired:
                continue  # late: its body was given up (and counted) already
            k = body_of_id(key)
            if k is not None and self._k_first <= k < self._k:
                duplicate += 1
            else:
                wrong += 1
        tally.duplicate += duplicate
        tally.wrong_id += wrong
        if wrong:
            tally.problem(f"an answer with an id nobody is waiting for: {line[:120]!r}")
            self._stray(wrong)
        elif duplicate:
            tally.problem(f"a duplicate answer (its call was answered already): {line[:120]!r}")

    def _stray(self, failures: int) -> None:
        """A line tied to no body, which counted ``failures``: it stands in for one body
        that will get no answer; if the strays now cover every body in flight, give
        those up at once (nothing else could answer them). With nothing in flight it
        stands in for nothing."""
        if not self._pending:
            return  # nothing in flight: an unsolicited line, it stands in for nothing
        strays = self._strays
        strays.append((failures, self._now))
        if len(self._pending) <= len(strays):
            self._expire(list(self._pending))

    def _expire(self, keys: list[bytes], why: str = "no answer to id {id}") -> None:
        """Give up on the bodies ``keys``: each taken by a stray line if one is left
        (no more counted), else one transport error (first problem: ``why``, with
        ``{id}`` filled in)."""
        pending = self._pending
        strays = self._strays
        tally = self._s.checker.tally
        for key in keys:
            rec = pending.pop(key, None)
            if rec is None:
                continue
            expect = rec[2]
            if type(expect) is msgspec.Raw:
                ids: tuple[bytes, ...] = (key,)
            else:
                ids = expect.ids
                if expect.batch:
                    for id_ in ids:
                        self._owner.pop(id_, None)
            self._expired.update(ids)
            if strays:
                # Answered, wrongly: a request like a wrong answer over HTTP (the checker
                # counts those as requests too), its calls beyond the stray's count missing.
                failures, t_answer = strays.popleft()
                tally.missing += max(0, len(ids) - failures)
                t_start = rec[0]
                if t_start >= self._s.t_measure:
                    tally.requests += 1
                    tally.calls += 1 if type(expect) is msgspec.Raw else expect.calls
                    self._s.lat.append(int((t_answer - t_start) * 1e6))
            else:
                tally.transport_errors += 1
                tally.problem(why.format(id=key.decode(errors="replace")))

    def _lose_all(self) -> None:
        """Before the base class counts what is in flight as lost: the strays take
        the oldest bodies they can stand in for."""
        if self._strays and self._pending:
            self._expire(list(self._pending)[: len(self._strays)])

    # -- failures --------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Give up on each request older than the timeout, alone: the connection stays
        (the answers of later requests can overtake a stuck one)."""
        pending = self._pending
        if not pending:
            return
        limit = now - self._s.timeout
        late: list[bytes] = []
        for key, rec in pending.items():
            if rec[1] >= limit:
                break
            late.append(key)
        if late:
            self._expire(late, f"no answer to id {{id}} within --timeout {self._s.timeout:g} s")
        if self._strays and len(pending) <= len(self._strays) and not self.wanted():
            self._expire(list(pending))  # draining: only the bodies the strays stood for are left
        if late:
            self._fill()  # their slots are free again, and no answer may come to refill them

    def give_up(self, count: bool = True) -> int:
        n = len(self._pending)
        self._lose_all()
        super().give_up(count)
        self._owner.clear()
        return n

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose_all()
        self._owner.clear()
        self._strays.clear()
        super().connection_lost(exc)


async def connect(conn: LoadConnection, start: bool = True) -> bool:
    """Connect ``conn`` to its target and (if ``start``) begin sending; on failure count
    a transport error and retry after the back-off (`LoadConnection.retry`) while the
    connection is wanted."""
    s = conn._s
    t = s.target
    conn._connecting = True
    try:
        if t.scheme == "unix":
            await asyncio.wait_for(s.loop.create_unix_connection(lambda: conn, t.path), s.timeout)
        else:
            await asyncio.wait_for(s.loop.create_connection(lambda: conn, t.host, t.port), s.timeout)
    except (TimeoutError, OSError) as exc:
        conn._connecting = False
        if conn._transport is not None:  # made, then given up on (timed out): never write to it
            conn._transport.abort()
            conn._transport = None
        s.checker.tally.transport_errors += 1
        s.checker.tally.problem(f"cannot connect to {t.where}: {exc.strerror}"
                                if isinstance(exc, OSError) and exc.strerror else
                                f"cannot connect to {t.where}: {type(exc).__name__}")
        conn._fails += 1
        if conn.wanted():
            conn.retry()
        return False
    finally:
        conn._connecting = False
    if conn._transport is None:  # made and already lost (its connection_lost left the retry to us)
        if conn.wanted():
            conn.retry()
        return False
    if start:
        conn.start()
    return True


async def run_process(spec: Spec, first: int, count: int, *,
                      ready: Callable[[], float] | None = None,
                      on_progress: Callable[[Progress], None] | None = None,
                      want_p99: bool = False,
                      signals: tuple[int, ...] = (),
                      on_shared: Callable[[_Shared], None] | None = None) -> ProcessResult:
    """Run connections ``first .. first+count-1`` (of ``spec.connections``) in this loop.

    ready: called once all are connected; returns t0 (monotonic seconds) to start
        at (default: now).
    on_progress: called every `TICK_S` seconds with this process's counters
        (``p99_ms`` computed only when ``want_p99``: it costs ~1 ms).
    signals: these signals interrupt the run (`_Shared.interrupt`): it stops sending,
        drains for at most `INTERRUPT_DRAIN_S` (or ``--timeout``), and returns what it
        measured, with ``interrupted`` set to the signal number.
    on_shared: called with the process's shared state once made (a load process
        uses it to interrupt the run when its parent says so).
    Returns when the run and its drain are over.
    """
    loop = asyncio.get_running_loop()
    s = _Shared(spec, loop)
    for sig in signals:
        loop.add_signal_handler(sig, s.interrupt, sig)
    if on_shared is not None:
        on_shared(s)
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
        for sig in signals:
            loop.remove_signal_handler(sig)


async def _run_process(s: _Shared, spec: Spec, first: int, count: int,
                       ready: Callable[[], float] | None,
                       on_progress: Callable[[Progress], None] | None,
                       want_p99: bool) -> ProcessResult:
    conns: list[LoadConnection] = []
    kind: type[LoadConnection] = StreamLoadConnection if s.target.stream else HttpLoadConnection
    for g in range(first, first + count):
        phase = interval = 0.0
        if spec.rate is not None:
            phase, interval = schedule.connection_timing(spec.rate, spec.connections, g)
        conns.append(kind(s, phase, interval))
    s.conns = conns
    await asyncio.gather(*(connect(c, start=False) for c in conns))
    t0 = ready() if ready is not None else _now()
    s.t0, s.t_measure = t0, t0 + spec.warmup
    s.t_end = s.t_measure + spec.duration
    if t0 > _now() and not s.interrupted:
        try:
            await asyncio.wait_for(s.wake.wait(), t0 - _now())
        except TimeoutError:
            pass
    s.started = True
    s.sending = not s.interrupted
    if s.interrupted:
        s.t_end = s.t_measure = s.t0  # nothing was measured
    for c in conns:
        c.start()  # a connection closed or failed since it was made is skipped (not written to)
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
        if now >= s.t_end or s.interrupted:
            break
        for c in conns:
            c.sweep(now)
        if now >= next_tick:
            tick()
            next_tick = now + TICK_S
        try:
            await asyncio.wait_for(s.wake.wait(), min(SWEEP_S, s.t_end - now))
        except TimeoutError:
            pass
    # The window is over (or cut short): from now on nothing is sent, not even an open
    # loop's backlog (requests due but not sent are "never sent"); the drain only waits
    # for answers to requests already sent.
    s.sending = False
    if s.interrupted:
        s.t_end = min(s.t_end, max(_now(), s.t_measure))
        deadline = _now() + min(spec.timeout, INTERRUPT_DRAIN_S)
    else:
        deadline = s.t_end + spec.timeout
    while _now() < deadline and not s.hurry and not all(c.idle() for c in conns):
        now = _now()
        for c in conns:
            c.sweep(now)
        if now >= next_tick:
            tick()
            next_tick = now + TICK_S
        await asyncio.sleep(0.01)
    drain_s = max(0.0, _now() - s.t_end)
    unsent = lost = 0
    s.stopped = True
    interrupted = bool(s.interrupted)
    for c in conns:
        out = c.outstanding()
        n = c.give_up(count=not interrupted)
        lost += n
        unsent += out - n
        c.close()
    if lost and not interrupted:
        # Sent by the end of the window and still unanswered --timeout later: timed out,
        # a transport error by the same rule as a request timing out within the window.
        tally.problem(f"{lost} request(s) with no answer within --timeout {spec.timeout:g} s "
                      "(given up at the end of the drain)")
    if s.connecting:  # reconnects still under way: stop them (connection_made closes late ones)
        for task in s.connecting:
            task.cancel()
        await asyncio.gather(*s.connecting, return_exceptions=True)
    await asyncio.sleep(0)
    hist.record_many(s.lat)
    return ProcessResult(tally.requests, tally.calls, dict(tally.errors_by_code), tally.wrong_id,
                         tally.missing, tally.duplicate, tally.malformed, tally.transport_errors,
                         unsent, hist.encode(), drain_s, tally.first_problem, tally.refused_batches,
                         interrupted=s.interrupted,
                         window_s=max(0.0, s.t_end - s.t_measure),
                         abandoned=lost if interrupted else 0,
                         reconnects=s.reconnects, backoffs=s.backoffs, resent=s.resent)


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


class RunInterrupted(RunError):
    """Interrupted (signal ``signum``) before the load started: nothing was measured."""

    def __init__(self, signum: int) -> None:
        super().__init__("interrupted before the load started")
        self.signum = signum


class ProcessDied(RunError):
    """A load process died; ``results``: what the others measured (they were stopped)."""

    def __init__(self, message: str, results: list[ProcessResult]) -> None:
        super().__init__(message)
        self.results = results


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
