"""The broker's end of one worker, besides supervising it: the slot's record (`Worker`, its
`WorkerState` and `TRANSITIONS`) and its Unix socket's protocol (`WorkerChannel`: frames out
as calls are sent, replies in to `Dispatcher.on_reply`). broker/pool.py starts, watches and
replaces the processes; its module docstring says how a slot lives.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import struct
import typing
from collections import OrderedDict

from broker import wire
from broker.wire import BYE, CHUNK_REPLY, ERROR, HELLO, RESULT

if typing.TYPE_CHECKING:
    from broker.pool import Pool

__all__ = ["TRANSITIONS", "CodeChanged", "LateHello", "Worker", "WorkerChannel", "WorkerState"]

log = logging.getLogger("broker.pool")  # (the pool's logger: these are its lines)
STOP_KILLED = "the stop: not gone after BYE"
"""`Worker.kill_reason` of a worker the stop killed (`Pool.stop`): its calls' methods are not struck."""


class WorkerState(enum.Enum):
    """The life of one worker slot (see `TRANSITIONS`)."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.READY, WorkerState.DEAD}),
    WorkerState.READY: frozenset({WorkerState.DRAINING, WorkerState.DEAD}),
    WorkerState.DRAINING: frozenset({WorkerState.DEAD}),
    WorkerState.DEAD: frozenset({WorkerState.STARTING}),
}


NEVER = 1 << 62  # a call count no process reaches: recycling by calls off (`Worker.recycle_at`)


class Worker:
    """One worker slot: its current process, channel, state and load."""

    __slots__ = (
        "benched",
        "blocked",
        "blocked_in",
        "blocked_until",
        "calls",
        "channel",
        "concurrency",
        "exited",
        "failures",
        "heavy",
        "heavy_calls",
        "holds",
        "kill_reason",
        "leaving",
        "limit",
        "max_calls",
        "outstanding",
        "overdue",
        "pid",
        "process",
        "recycle_at",
        "restart_at",
        "slot",
        "started_at",
        "state",
        "sync_calls",
        "sync_since",
        "sync_until",
        "took_calls",
    )

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.state = WorkerState.DEAD
        self.pid = 0
        self.process: asyncio.subprocess.Process | None = None
        self.channel: WorkerChannel | None = None
        self.outstanding = 0
        self.concurrency = 1
        self.limit = 1  # calls in flight it may have now (the dispatcher's: see dispatch.py)
        self.sync_calls = 0  # sync calls in flight (the dispatcher's)
        self.blocked = False  # busy in a blocking sync call, its limit taken down (the dispatcher's)
        # When its blocking sync calls in flight began, and are expected to end (time.perf_counter()
        # s, from their methods' estimates; the dispatcher's: `_pick_blocked` picks by it)
        self.sync_since = self.sync_until = 0.0
        # Several front-ends: what the worker said blocks it (wire.BLOCKED): the call's id if it
        # is this front-end's (0: another's), and its deadline (time.perf_counter() s; 0.0: not
        # blocked); and why it is out of the rotation (the dispatcher's `_bench`: HOLD, BLOCKED)
        self.blocked_in = 0
        self.blocked_until = 0.0
        self.benched = 0
        self.holds = 0  # HOLDs it sent this front-end (a release waits for the end of its read: `worker_held`)
        self.heavy = 0  # bytes of large params (routing.HEAVY_BYTES or more each) of its calls in flight (the dispatcher's)
        # Those calls, the oldest first, with when each was sent (time.perf_counter() s; the dispatcher's:
        # how soon it may be free of large params, `Routing._drains_in`)
        self.heavy_calls: OrderedDict[object, float] = OrderedDict()
        # Ids of its calls past their deadline, cancelled and not answered yet: while any, it
        # takes no new call while another worker is ready (the dispatcher's)
        self.overdue: set[int] = set()
        self.started_at = 0.0
        self.restart_at = 0.0  # time.monotonic() at which its restart backoff ends (0: not in one)
        self.failures = 0
        self.took_calls = False  # this process was sent a call (the dispatcher's `_send`)
        self.exited: asyncio.Future[int] | None = None
        self.kill_reason = ""  # why the broker killed this process, if it did (STOP_KILLED: the stop)
        self.leaving = False  # this process asked to leave (SIGTERM: `Pool.worker_leaving`)
        # Calls (a chunk: its calls) sent to this process (the dispatcher's `_send`); its
        # recycling limit (max_calls_per_worker plus its jitter, drawn at its launch: see
        # broker/recycling.py), and the count at which `_send` tells the pool (the limit,
        # then out of reach once told: one compare a call)
        self.calls = 0
        self.max_calls = self.recycle_at = NEVER

    def move(self, state: WorkerState) -> None:
        """Change state; raises `RuntimeError` on a transition not in `TRANSITIONS`."""
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"worker {self.slot}: {self.state.name} -> {state.name} is not a transition")
        self.state = state

    def __repr__(self) -> str:
        return f"<Worker slot={self.slot} pid={self.pid} {self.state.name} outstanding={self.outstanding}>"


_pack_header = wire.HEADER.pack
_pack_call = wire.CALL_HEADER.pack
_DEADLINE_SIZE = wire.DEADLINE.size
_CALLS = frozenset({wire.CALL, wire.NOTIFY, wire.CHUNK})  # the frames `unsent` gives back
_LENGTH = struct.Struct(">I").unpack_from  # a frame header's first field: its payload's length


def _frame_end(out: bytearray, at: int) -> int:
    """Where the frame holding byte `at` of `out` (frames back to back from 0) ends."""
    end = 0
    while end <= at:
        end += wire.HEADER_SIZE + _LENGTH(out, end)[0]
    return end
FLUSH_AT_BYTES = 256 * 1024  # write at once past this much queued, else once per loop turn


class CodeChanged(wire.FrameError):
    """A restarted worker's HELLO names other methods than the pool serves: the app
    changed on disk without a SIGHUP (`Pool.hello`); a reload to that code follows."""

    hint = "a reload to the code on disk follows by itself; send SIGHUP after changing the app"


class LateHello(wire.FrameError):
    """A worker's HELLO read after its exit was reaped (`Pool.hello`): the process is gone, its
    exit logged; its connection is closed (hostile testing, round 138: an ERROR that said "HELLO
    from pid N for slot 0, expected pid N")."""


class WorkerChannel(asyncio.Protocol):
    """The broker's end of one worker's Unix socket.

    `send` queues a frame; everything queued in one loop iteration goes out in one
    write. Replies go straight to `Dispatcher.on_reply`.
    """

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._dispatcher = pool.dispatcher
        # A chunk's reply frame holds up to max_frame_bytes of answers plus one entry
        # header (worker.WorkerProtocol._chunk_answer): a result of exactly the limit fits.
        self._decoder = wire.FrameDecoder(pool.max_frame_bytes + wire.REPLY_ENTRY.size)
        self._out = bytearray()
        self._flush_scheduled = False
        self._transport: asyncio.Transport | None = None
        self._ended = False  # its end is read, and the pool told (`_end`)
        self._paused = False  # the kernel took less than the last write: the rest waits in `_out` (`pause_writing`)
        self._fd = -1  # its socket's descriptor, written to directly (`flush`)
        self.worker: Worker | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)
        # Paused as soon as a write is not all taken: what is sent meanwhile waits in `_out`, never
        # written if the worker dies first (`unsent`), rather than in the transport's buffer, whose
        # calls died -32002 with it (hostile testing, round 138: calls behind a large call sent to a
        # worker whose loop a handler held, not a byte of them written, and their methods struck)
        self._transport.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        self._fd = -1 if sock is None else sock.fileno()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._out:
            self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._end()

    def eof_received(self) -> bool | None:
        # At once, not a loop turn later at `connection_lost`: the rest of this turn routes
        # around the worker (hostile testing, round 137: an answer read just before the end
        # freed a place, and a queued call was written into the dead worker, -32002, unrun).
        self._end()
        return None  # (the transport closes)

    def _end(self) -> None:
        """The worker's end is read (EOF, a read error, `drain`'s EOF): the pool is told, once."""
        if self._ended:
            return
        self._ended = True
        # Only while it is its worker's channel: a restart with no backoff (a hung kill, a
        # worker up 30 s) can reap the old process and start the slot's next before this
        # socket's end is read, which then made the new one DEAD, refused its HELLO ("from
        # pid N, expected pid N") and killed it (hostile testing, round 75).
        if self.worker is not None and self.worker.channel is self:
            self._pool.channel_lost(self.worker)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except wire.FrameError as exc:
            log.error("worker %s sent a bad frame: %s (%s)", self.worker, exc, exc.hint)
            if self.worker is not None and not self.worker.kill_reason:  # (its calls' `status` says why it went:
                self.worker.kill_reason = "it sent a bad frame"  # round 83, a bare "exited with 0")
            self.close()
            return
        worker = self.worker
        on_reply = self._dispatcher.on_reply
        for kind, call_id, aux, payload in frames:
            if worker is not None and (kind == RESULT or kind == ERROR or kind >= CHUNK_REPLY):
                # (a `try` costs nothing until it catches, CPython 3.11's zero-cost exceptions)
                try:
                    on_reply(worker, kind, call_id, aux, payload)
                except Exception:  # a bug in answering one reply (hostile testing: a front-end's
                    # write after its half-close) must not close this channel: the worker would
                    # be lost with every other client's calls on it (-32002)
                    log.exception("answering call %d of worker %s failed; the worker is kept", call_id, worker)
            elif kind == HELLO and worker is None:
                try:
                    worker = self.worker = self._pool.hello(self, wire.decode_hello(payload))
                except wire.WireMismatch as exc:
                    log.error("rejected a worker connection: %s", exc)
                    self._pool.wire_mismatch(exc)
                    self.close()
                    return
                except CodeChanged as exc:  # (expected, and healed by the reload: logged as WARNING)
                    log.info("closing the connection of a worker whose code changed on disk: %s", exc)
                    self.close()
                    return
                except LateHello as exc:  # (its exit was logged already: nothing is wrong here)
                    log.info("closing the connection of a worker gone: %s", exc)
                    self.close()
                    return
                except wire.FrameError as exc:
                    log.error("rejected a worker connection: %s", exc)
                    self.close()
                    return
            elif kind == BYE and worker is not None:  # it asks to leave (SIGTERM)
                self._pool.worker_leaving(worker)
            else:
                log.error("worker %s sent an unexpected frame kind %d", worker, kind)
                self.close()
                return

    def send(self, kind: int, call_id: int, aux: int, payload: bytes | bytearray | memoryview) -> None:
        """Queue one frame for the worker (written at the end of this loop iteration):
        CANCEL, BYE, HOLD (a hold's answer); a call's goes with its deadline (`send_call`)."""
        self._out += _pack_header(len(payload), kind, call_id, aux)
        self._out += payload
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._pool.loop.call_soon(self.flush)

    def send_call(
        self, kind: int, call_id: int, aux: int, deadline: float, flow: int, params: bytes | bytearray | memoryview
    ) -> None:
        """Queue a CALL, NOTIFY or CHUNK frame: `params` (a CHUNK's entries) after the
        call's `deadline` (CLOCK_MONOTONIC s: the worker starts no call past it) and `flow`
        (its connection's number, u32: the worker takes turns among flows); see `wire`."""
        out = self._out
        out += _pack_call(_DEADLINE_SIZE + len(params), kind, call_id, aux, deadline, flow)
        out += params
        if len(out) >= FLUSH_AT_BYTES:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._pool.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write everything queued now; unless the worker's end is read, or the socket
        closes (a read error), or the write fails (EPIPE: the worker's end came first, not
        read yet): then it is kept, never sent, for `unsent`. The kernel is given the bytes
        itself (os.write: how many it took is known): when it takes part only, the rest of
        the frame it cut goes to the transport, which pauses (`pause_writing`), and the
        frames after it wait here until the transport has written it (`resume_writing`)."""
        self._flush_scheduled = False
        transport = self._transport
        out = self._out
        while out and transport is not None and not self._ended and not self._paused and not transport.is_closing():
            if self._fd < 0:  # (no socket of its own: a transport that takes everything)
                transport.write(bytes(out))
                out.clear()
                return
            try:
                taken = os.write(self._fd, out)
            except BlockingIOError:
                taken = 0
            except OSError:  # (EPIPE: its end came first, read soon by the loop; hostile testing, round 137:
                return  # a queued call written into a worker dead for half a second was answered -32002)
            if taken == len(out):
                out.clear()
                return
            # (hostile testing, round 139: one write of many calls, the kernel taking part of it, left the
            # calls past that in the transport's buffer, never written when the worker died, -32002)
            cut = _frame_end(out, taken)
            transport.write(bytes(out[taken:cut]))
            del out[:cut]

    def unsent(self) -> dict[int, bytes]:
        """The calls queued for the worker and never written (`flush`): {call id: params}
        of each CALL, NOTIFY and CHUNK frame (a chunk's: its entries), forgotten here. Its
        death did not touch them: `Membership.worker_lost` sends them again."""
        if not self._out:
            return {}
        frames = wire.FrameDecoder(len(self._out)).feed(self._out)
        self._out.clear()
        return {call_id: payload[_DEADLINE_SIZE:] for kind, call_id, _aux, payload in frames if kind in _CALLS}

    def drain(self) -> None:
        """Read and act on what the worker wrote that this end has not read yet: called once
        its process is gone, whose exit can be reaped (or another front-end say it is gone)
        before its socket's end is read, so all it wrote is there (`Membership.worker_lost`:
        a call it said starts, wire.STARTS, is not sent again)."""
        transport = self._transport
        sock = None if transport is None else transport.get_extra_info("socket")
        if sock is None:
            return
        while self._transport is not None:
            try:
                data = os.read(sock.fileno(), 1 << 18)
            except OSError:  # (BlockingIOError: nothing more)
                return
            if not data:  # (its end: as if read by the loop, `eof_received`; not while it is
                if self.worker is None or self.worker.state is not WorkerState.DEAD:  # lost already)
                    self._end()
                return
            self.data_received(data)

    def close(self) -> None:
        """Close the socket (the worker exits when it sees that)."""
        if self._transport is not None:
            self._transport.close()
