"""One load process: `run_process` makes its share of the connections in the running
loop, starts them at t0, sweeps timeouts and folds latencies every tick, ends the
window (or is interrupted), drains, and returns the process's `ProcessResult`.

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
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

from broker.loadgen import schedule
from broker.loadgen.connection import LoadConnection, _Shared, connect
from broker.loadgen.http import HttpLoadConnection
from broker.loadgen.mcp_http import McpLoadConnection
from broker.loadgen.stats import Latency
from broker.loadgen.stream import StreamLoadConnection
from broker.loadgen.target import ProcessResult, Progress, Spec

__all__ = ["INTERRUPT_DRAIN_S", "SWEEP_S", "TICK_S", "run_process"]

TICK_S = 0.25  # histogram fold and progress period
SWEEP_S = 0.1  # timeout sweep period
INTERRUPT_DRAIN_S = 1.0  # interrupted: answers to requests in flight are awaited this long at most
_now = time.monotonic


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
    kind: type[LoadConnection] = (StreamLoadConnection if s.target.stream else
                                  McpLoadConnection if spec.mcp else HttpLoadConnection)
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
            on_progress(Progress(tally.calls, tally.errors + sum(tally.tool_errors.values()), tally.failures,
                                 tally.transport_errors,
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
        if not c.full:  # (due with room on its connection: this process could not make them in time)
            s.behind += out - n
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
                         reconnects=s.reconnects, backoffs=s.backoffs, resent=s.resent,
                         unauthorized=tally.unauthorized, tool_errors=dict(tally.tool_errors),
                         initialized=tally.initialized, sessions=tally.sessions,
                         protocol_version=tally.protocol_version, sent=s.sent, behind=s.behind)
