"""Answers held behind a blocking handler, sent from a thread (`HeldAnswers._send_held`),
and the front-ends told the worker is blocked (wire.BLOCKED).

The loop's thread writes replies once per slice of calls. A handler that runs long (a
method that is usually fast and blocks once) holds the answers made before it in that
slice: a thread started with the connection wakes every `HELD_SECONDS` and, while the
same handler still runs, writes them straight to the socket. `WorkerProtocol`
(broker/worker/runtime.py) inherits these methods; the state they share with the
loop's thread (`_running`, `_grab`, `_grab_lock`) is the protocol's, in its slots.

With several front-ends (`serve --frontends N`) each routes by its own calls alone: a worker
blocked in one front-end's sync call took the others' calls, which waited behind it while
another worker was idle, and a front-end could not tell a worker hung in its own call from
one busy in another's, so it killed it only once the longest deadline a call may have was
past (new user, round 114). So the same thread, once a handler has run HELD_SECONDS, tells
every connection the worker is blocked (BLOCKED, aux 1: the call's deadline, and to the
connection whose call it is, that call's id), and the loop's thread, once it returns, that
it is free (aux 0): the others route nothing new to it meanwhile, and each knows whose call
holds it and until when (broker/membership.py, `worker_blocked`, `_check_hung`).
"""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import time
import typing

from broker.wire import BLOCKED, CHUNK_PART, HEADER
from broker.worker.links import ID_MASK, LINK_SHIFT, split

if typing.TYPE_CHECKING:
    from broker.worker.chunks import _Chunk
    from broker.worker.links import Link

_perf = time.perf_counter
_pack_header = HEADER.pack
_pack_deadline = struct.Struct(">d").pack


HELD_SECONDS = 0.005  # answers ready behind a handler running this long go out from a thread (`_send_held`)


class HeldAnswers:
    """`WorkerProtocol`'s methods that run in (or wait for) the held-answers thread.

    (A mixin with no state of its own: the attributes below are the protocol's slots.)
    """

    __slots__ = ()

    if typing.TYPE_CHECKING:
        _advancing: _Chunk | None
        _dirty: set[_Chunk]
        _down: bool
        _fd: int
        _grab: bool
        _grab_lock: threading.Lock
        _links: list[Link]
        _out: bytearray
        _out_first: bytearray
        _running: float
        _running_deadline: float
        _running_id: int
        _told: bool
        _transport: asyncio.Transport | None

        def _reply(self, kind: int, call_id: int, t0: float, body: bytes, aux: int = -1) -> int: ...
        def _schedule_flush(self) -> None: ...
        def _unclean(self, chunk: _Chunk) -> None: ...

    def _send_held(self) -> None:
        """A thread's loop, every HELD_SECONDS: if a handler has run that long (a method
        that is usually fast and blocks once, which the worker did not write out before),
        send the answers made before it in its slice (`_write_held`). Else they waited
        in `_out`, and a batch's in its chunk, until it returned: past their deadline they
        were answered -32001 although they had run (hostile testing, round 26).

        Safe beside the loop's thread: while `_running` is set, that thread is in
        `_execute` (binding params, the handler, encoding its result), which touches
        neither `_out` nor a chunk's answers (an async call finished in its eager first
        step is answered by its done callback, later). This thread sets `_grab`, then
        checks that the same handler still runs; the loop's thread clears `_running`,
        then checks `_grab` and if set waits for the lock (`_sent_held`): under the GIL
        one of them sees the other (Dekker's two flags). A handler that holds the GIL
        in C code lets this thread run only once it returns; a forked child has no such
        thread.

        With other connections (several front-ends) it tells each the worker is blocked
        (`_tell_blocked`), once a handler (if the loop's thread did not, `_tell_ahead`): `_grab`
        stays set while `_told` is, so the loop's thread, the handler done, comes to
        `_sent_held`, which tells them it is free."""
        lock = self._grab_lock
        while not self._down:
            time.sleep(HELD_SECONDS)
            started = self._running
            if not started or _perf() - started < HELD_SECONDS:
                continue
            tell = bool(self._links) and not self._told
            if not (tell or self._out or self._out_first or self._dirty or self._advancing is not None
                    or any(link.pending for link in self._links)):
                continue
            with lock:
                self._grab = True  # type: ignore[misc]  # (a slot of WorkerProtocol's: mypy sees this class's empty ones)
                try:
                    if self._running == started:
                        if tell:
                            self._tell_blocked()
                        self._write_held()
                finally:
                    self._grab = self._told  # type: ignore[misc]

    def _tell_blocked(self) -> None:
        """Queue BLOCKED, aux 1, for every connection: payload the running call's deadline (f64,
        CLOCK_MONOTONIC s; a chunk's), id that call's for the connection that sent it, 0 for the
        others. (`_send_held`'s thread, its handler still running; or the loop's thread, from
        `_tell_ahead`.)"""
        owner, own_id = self._running_id >> LINK_SHIFT, self._running_id & ID_MASK
        deadline = _pack_deadline(self._running_deadline)
        out = self._out
        for number in range(len(self._links) + 1):
            if number and self._links[number - 1].gone:
                continue
            out += _pack_header(len(deadline), BLOCKED, number << LINK_SHIFT | (own_id if number == owner else 0), 1)
            out += deadline
        self._told = True  # type: ignore[misc]

    def _tell_ahead(self, call_id: int, deadline: float) -> None:
        """(the loop's thread, several front-ends, not told yet) A call of a method whose last
        call blocked the loop (`_slow`) is about to start: tell every connection now, not
        HELD_SECONDS into it (in those milliseconds another front-end sent its own slow call to
        the same worker while another was idle: new user, round 113). The caller writes `_out`
        out before the call starts; `_grab` set brings the loop to `_sent_held` after it."""
        self._running_id = call_id  # type: ignore[misc]
        self._running_deadline = deadline  # type: ignore[misc]
        with self._grab_lock:  # (that thread's `_grab = _told`, read before this and written after, lost it)
            self._tell_blocked()
            self._grab = True  # type: ignore[misc]

    def _tell_free(self) -> None:
        """(the loop's thread, in `_sent_held`: the handler `_tell_blocked` told of returned)
        Queue BLOCKED, aux 0, id 0, for every connection."""
        out = self._out
        for number in range(len(self._links) + 1):
            if not number or not self._links[number - 1].gone:
                out += _pack_header(0, BLOCKED, number << LINK_SHIFT, 0)
        self._told = False  # type: ignore[misc]
        self._schedule_flush()

    def _write_held(self) -> None:
        """(`_send_held`'s thread, the loop's thread in a handler) Send what `_out` holds,
        the answers of the batches run in this slice first (CHUNK_PARTs), straight to the
        socket, as far as it takes them: only if the transport has nothing buffered, so
        the frames keep their order; the rest is the loop's to write."""
        transport = self._transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size():
            return
        chunks = set(self._dirty)
        if self._advancing is not None:
            chunks.add(self._advancing)
        for chunk in chunks:
            if chunk.clean and chunk.results:  # (a part: of entries)
                self._unclean(chunk)
            if chunk.unsent:
                self._reply(CHUNK_PART, chunk.chunk_id, chunk.t0, bytes(chunk.unsent))
                chunk.unsent.clear()
        out = self._out
        if self._links:  # (several front-ends: each link's replies to its own socket)
            if out:  # (`_out` keeps whole frames alone: `split` reads it from a frame's start; the
                # first connection's rest, a frame in part, waits in `_out_first`: hostile testing,
                # round 129, a partial write left in `_out` was read as a frame of link 120)
                first, by_link = split(out, self._links)
                out.clear()
                self._out_first += first
                for link, data in zip(self._links, by_link):
                    if data is not None:
                        link.pending += data
                    _write_some(link.pending, link.fd, link.transport)
            _write_some(self._out_first, self._fd, transport)
            return
        if out:
            try:
                sent = os.write(self._fd, out)
            except OSError:  # (BlockingIOError: the broker is not reading now; the loop writes it)
                return
            del out[:sent]

    def _sent_held(self) -> None:
        """(the loop's thread, out of `_execute`) Wait until `_send_held`'s thread is done;
        if it told the front-ends the worker is blocked, tell them it is free."""
        with self._grab_lock:
            if self._told:
                self._grab = False  # type: ignore[misc]
                self._tell_free()


def _write_some(pending: bytearray, fd: int, transport: asyncio.Transport | None) -> None:
    """(`_send_held`'s thread) Write what of `pending` the socket `fd` takes now, if its
    transport has nothing buffered (the frames keep their order); the rest stays."""
    if not pending or fd < 0 or transport is None or transport.is_closing() or transport.get_write_buffer_size():
        return
    try:
        sent = os.write(fd, pending)
    except OSError:
        return
    del pending[:sent]
