"""The transport-neutral half of a load connection: the state a load process's
connections share (`_Shared`), the scheduling, depth, failure counting and reconnects
of one connection (`LoadConnection`), and `connect`. The framing and the reading are
the subclasses': `HttpLoadConnection` (`http`) and `StreamLoadConnection` (`stream`).

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
  answers in order). NDJSON: each line is looked up by id (see `stream`). The answer is
  checked (`Checker`) and ``now - t_start`` appended in µs to a plain list (folded
  into the histogram every tick).
* **failures**: a reset, a close by the server, an unparsable response or a request
  older than ``--timeout`` (swept every 100 ms) counts every in-flight request of
  that connection as a transport error (NDJSON: only the requests that are late, see
  `stream`). Except over HTTP, an unannounced close between answers (a complete answer,
  no byte of the next, every request in flight written after that answer): those
  requests are sent again on the next connection (`_keep_for_retry`, `resent`). A close
  with nothing in flight after a complete answer is orderly, announced or not. While
  there is still something to send the connection is reopened: at once if it got an
  answer, after a back-off (`RECONNECT_S` doubling to `RECONNECT_MAX_S`) otherwise or
  after a failure: a refused or failed connect, a close or reset before any answer, a
  503 turning the connection away, a timeout.
  A transport that is closed or closing is never written to.

Transport seam: `LoadConnection` holds the scheduling and the depth; a subclass
supplies the framing (`_frame`), the in-flight table (`_inflight`, filled through
`_push`), the reading (`data_received`), the timeout `sweep` and `give_up`.
`HttpLoadConnection` is HTTP/1.1; `StreamLoadConnection` is NDJSON over ``tcp://``
and ``unix://`` (selected by `Target.scheme`).
"""

from __future__ import annotations

import asyncio
import time
import typing
from collections.abc import Callable

import msgspec

from broker.loadgen import mcp, schedule
from broker.loadgen.check import Checker, Tally
from broker.loadgen.target import Spec, Target
from broker.loadgen.workload import Expect, Workload

__all__ = ["LATE_S", "RECONNECT_MAX_S", "RECONNECT_S", "LoadConnection", "connect"]

LATE_S = 0.010  # open loop: a request sent this long after its intended time, with room, is late by the load process
RECONNECT_S = 0.05  # first back-off after a failed connection; doubles per failure in a row
RECONNECT_MAX_S = 1.0  # the back-off's cap
_now = time.monotonic


class _Shared:
    """State of one load process that its connections share."""

    __slots__ = ("backoffs", "behind", "checker", "connecting", "conns", "depth", "hurry", "interrupted", "lat",
                 "loop", "mcp", "open", "pipeline", "reconnects", "resent", "sending", "sent", "started", "stopped",
                 "t0", "t_end", "t_measure", "target", "timeout", "token", "tools", "wake", "workload")

    def __init__(self, spec: Spec, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.target = Target.parse(spec.target)
        self.mcp = spec.mcp  # the MCP era driven, or None (JSON-RPC)
        self.tools = tuple(dict.fromkeys(c.method for c in spec.calls)) if spec.mcp else ()  # MCP: tool names
        if spec.mcp:
            self.workload = Workload(mcp.tool_calls(spec.calls, spec.mcp), spec.batch, spec.ids, spec.seed)
            self.checker: Checker = mcp.ToolChecker(Tally(), modern=spec.mcp == "modern")
            if spec.mcp == "modern":
                self.checker.tally.protocol_version = mcp.MODERN_VERSION
        else:
            self.workload = Workload(spec.calls, spec.batch, spec.ids, spec.seed)
            self.checker = Checker(Tally())
        self.lat: list[int] = []
        self.open = spec.rate is not None
        self.pipeline = max(1, spec.pipeline)
        self.depth = max(spec.depth, self.pipeline)
        self.timeout = spec.timeout
        self.token = spec.token  # the bearer token to send ("" for none): see the connections' framing
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
        # Open loop, of the measured window's schedule: requests sent, and those this process sent
        # `LATE_S` or more after their intended time with room on their connection (`_fill`)
        self.sent = 0
        self.behind = 0

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
                 "_measured", "_next_i", "_now", "_phase", "_push", "_retry", "_s", "_timer", "_transport", "connected",
                 "full")

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
        self._measured = 0  # open loop: the index of its first request of the measured window (`start`)
        self._now = 0.0
        self._aborted = False
        self._failed = False  # refused, timed out or not HTTP: back off before reconnecting
        self._connecting = False  # a `connect` for it is under way
        self._fails = 0  # failed connections in a row (sets the reconnect back-off)
        self._answered_here = False  # a complete answer came on the current connection
        self._retry: list[float] = []  # HTTP: t_start of requests to send again (see _keep_for_retry)
        self.connected = False
        # Open loop: the last `_fill` left requests due for want of room (depth full, or no transport):
        # those sent late next waited on the server, not on this process
        self.full = False

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
        self._failed = self._answered_here = False
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
        s = self._s
        if s.open:  # (the index of its first request of the measured window: `sent` counts from it)
            self._measured = schedule.first_at(s.t0, self._phase, self._interval, s.t_measure)
        self._fill()

    def _fill(self) -> None:
        s = self._s
        transport = self._transport
        if transport is None or transport.is_closing():
            self.full = True
            return  # closed (or closing) by the server or a failure: connection_lost will count it
        inflight = self._inflight
        free = s.depth - len(inflight)
        if free <= 0:
            self.full = True
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
            first = i
            late = now - LATE_S  # (sent after it, with room: late by this process, not the server)
            behind = 0
            while free and t <= now and t < t_end:
                body, expect = body_of(k)
                k += 1
                out.append(frame(body))
                push((t, now, expect))
                free -= 1
                if t < late and t >= s.t_measure:
                    behind += 1
                i += 1
                t = t0 + phase + i * interval
            if i > first:
                s.sent += max(0, i - max(first, self._measured))
                if not self.full:
                    s.behind += behind
            self.full = free == 0 and t <= now and t < t_end
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

    # -- answers ---------------------------------------------------------------------------
    def _recording(self, t_start: float) -> bool:
        """Whether the answer to a body first sent at `t_start` (s, `_now`'s clock) is
        recorded: sent in the measured window, not in the warm-up. Sets the tally's
        `recording` to match, for the check of that answer which follows."""
        s = self._s
        recording = s.checker.tally.recording = t_start >= s.t_measure
        return recording

    def _record_latency(self, t_start: float) -> None:
        """Record the latency of an answer that came at `_now` to a body sent at `t_start`,
        in µs."""
        self._s.lat.append(int((self._now - t_start) * 1e6))

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
