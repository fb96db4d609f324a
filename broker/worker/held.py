"""Answers held behind a blocking handler, sent from a thread (`HeldAnswers._send_held`).

The loop's thread writes replies once per slice of calls. A handler that runs long (a
method that is usually fast and blocks once) holds the answers made before it in that
slice: a thread started with the connection wakes every `HELD_SECONDS` and, while the
same handler still runs, writes them straight to the socket. `WorkerProtocol`
(broker/worker/runtime.py) inherits these methods; the state they share with the
loop's thread (`_running`, `_grab`, `_grab_lock`) is the protocol's, in its slots.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import typing

from broker.wire import CHUNK_PART
from broker.worker.links import split

if typing.TYPE_CHECKING:
    from broker.worker.chunks import _Chunk
    from broker.worker.links import Link

_perf = time.perf_counter


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
        _transport: asyncio.Transport | None

        def _reply(self, kind: int, call_id: int, t0: float, body: bytes, aux: int = -1) -> int: ...
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
        thread."""
        lock = self._grab_lock
        while not self._down:
            time.sleep(HELD_SECONDS)
            started = self._running
            if not started or _perf() - started < HELD_SECONDS:
                continue
            if not (self._out or self._out_first or self._dirty or self._advancing is not None or any(link.pending for link in self._links)):
                continue
            with lock:
                self._grab = True  # type: ignore[misc]  # (a slot of WorkerProtocol's: mypy sees this class's empty ones)
                try:
                    if self._running == started:
                        self._write_held()
                finally:
                    self._grab = False  # type: ignore[misc]

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
        """(the loop's thread, out of `_execute`) Wait until `_send_held`'s thread is done."""
        with self._grab_lock:
            pass


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
