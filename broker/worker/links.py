"""The worker's connections to the front-ends past the first (`serve --frontends N`).

With N front-end processes each worker serves all of them, over one Unix socket each
(README, "Architecture"). The first connection, to the front-end that started the worker,
is `WorkerProtocol`'s own, as with one front-end; each other is a `Link`. A link decodes
its frames with its own decoder and hands its calls to the protocol's run loop with their
call ids tagged by the link's number in the top byte (`LINK_SHIFT`): the front-ends number
their calls apart, so two may send the same id. Everything past the edges (the backlog,
turns, chunks, slow methods, the held answers' thread, cancels) is the protocol's, shared
by all links, as if one broker had sent every call (a call run alone holds the other
connections: broker/worker/alone.py); the replies are written to one buffer
with their tagged ids and split by link when written (`split`), each to its link with
the front-end's own id back. A chunk's answers are its frames' too: the client ids inside a
CHUNK and its CHUNK_RESULTS are the front-end's, echoed as sent, never tagged. With one
front-end no id is tagged and nothing here runs.

A link's BYE means its front-end sends no more calls on it; the worker exits once every
connection has said BYE (or is closed) and every call is answered (`WorkerProtocol._flush`).
A link that closes (its front-end exited) takes its calls with it: those running are
cancelled, those waiting dropped, and their answers go nowhere. The first connection's
close ends the worker, as with one front-end: the front-end that started it is gone.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import typing

from broker import wire
from broker.wire import BYE, CALL, CANCEL, CHUNK, DEADLINE, HEADER, HEADER_SIZE, HOLD, NOTIFY

if typing.TYPE_CHECKING:
    from broker.worker.chunks import _Chunk
    from broker.worker.runtime import WorkerProtocol

__all__ = ["ID_MASK", "LINK_SHIFT", "Link", "LinkRuns", "split"]

log = logging.getLogger("broker.worker")

LINK_SHIFT = 56  # a call id's top byte is its link's number (0: the first connection's, untagged)
ID_MASK = (1 << LINK_SHIFT) - 1  # the front-end's own call id
MAX_LINKS = 255  # links past the first a worker may have (the top byte's values)

_unpack = HEADER.unpack_from
_pack = HEADER.pack


class Link(asyncio.Protocol):
    """One more front-end's connection (number `number`, 1 and up) to `protocol`'s worker.

    Its state is its own: transport, socket descriptor (for the held answers' thread,
    `WorkerProtocol._write_held`), frame decoder, whether it said BYE or is gone, and
    `pending`: replies the held answers' thread could not write, written first next time.
    """

    __slots__ = ("bye", "decoder", "fd", "gone", "number", "pending", "protocol", "tag", "transport")

    def __init__(self, protocol: WorkerProtocol, number: int, max_frame_bytes: int) -> None:
        if not 0 < number <= MAX_LINKS:
            raise ValueError(f"link number {number} outside 1..{MAX_LINKS}")
        self.protocol = protocol
        self.number = number
        self.tag = number << LINK_SHIFT
        self.decoder = wire.FrameDecoder(max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self.bye = False
        self.gone = False
        self.pending = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fd = sock.fileno()
        self.transport.write(wire.encode_frame(wire.Kind.HELLO, 0, 0, self.protocol.hello()))
        if self.protocol.leaving:  # SIGTERM came while connecting
            self.transport.write(wire.encode_frame(BYE, 0))
        self.protocol.link_joined(self.number)  # (a call may run alone here already: worker/alone.py)

    def data_received(self, data: bytes) -> None:
        protocol = self.protocol
        protocol.check_forked()
        if self.take(data):
            protocol.schedule_run()

    def take(self, data: bytes) -> bool:
        """Decode `data` and hand its frames to the protocol (calls and CANCELs tagged);
        False on a bad frame (this link is closed)."""
        try:
            frames = self.decoder.feed(data)
        except wire.FrameError as exc:
            log.error("worker %d: bad frame from front-end %d: %s", self.protocol.slot, self.number, exc)
            self.close()
            return False
        protocol = self.protocol
        tag = self.tag
        for kind, call_id, aux, payload in frames:
            if call_id > ID_MASK:
                log.error("worker %d: bad frame from front-end %d: call id %d past %d", self.protocol.slot,
                          self.number, call_id, ID_MASK)
                self.close()
                return False
            if kind == CALL or kind == NOTIFY or kind == CHUNK:
                if not protocol.queue_call(kind, call_id | tag, aux, payload):
                    self.close()
                    return False
            elif kind == CANCEL:
                protocol.cancel_call(call_id | tag)
            elif kind == BYE:
                self.bye = True
                protocol.link_said_bye()
            elif kind == HOLD:
                protocol.held_answered(self.number)
        return True

    def read_now(self) -> bool:
        """Read what the front-end sent while the loop was held (`WorkerProtocol._read_now`);
        False if the link is bad."""
        if self.fd < 0 or self.gone:
            return True
        while True:
            try:
                data = os.read(self.fd, 1 << 18)
            except OSError:  # (BlockingIOError: nothing more; else the loop's own read finds it)
                return True
            if not data:
                return True
            if not self.take(data):
                return False

    def write(self, data: bytes | bytearray) -> None:
        """Write replies (ids untagged already), after any the held answers' thread left."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.gone:
            self.pending.clear()
            return
        if self.pending:
            data = bytes(self.pending) + data
            self.pending.clear()
        transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.check_forked()
        self.gone = True
        self.pending.clear()
        self.protocol.link_lost(self)


class LinkRuns:
    """`WorkerProtocol`'s methods for its links (the other front-ends' connections).

    (A mixin with no state of its own: the attributes below are the protocol's slots.)
    """

    __slots__ = ()

    if typing.TYPE_CHECKING:
        _alone: int
        _alone_next: collections.deque[tuple[int, int, int, bytes]]
        _backlog: collections.deque[tuple[int, int, int, bytes] | _Chunk]
        _bye: bool
        _chunks: dict[int, _Chunk]
        _closing: bool
        _links: list[Link]
        _out: bytearray
        _out_first: bytearray
        _slot: int
        _tasks: dict[int, asyncio.Task[tuple[bool, object]]]
        _transport: asyncio.Transport | None

        def _cancel(self, call_id: int) -> None: ...
        def link_joined(self, number: int) -> None: ...
        def _take(self, data: bytes) -> bool: ...
        def _schedule_flush(self) -> None: ...
        def schedule_run(self) -> None: ...

    def add_link(self, link: Link) -> None:
        """Serve one more front-end's connection (`Link`, numbered in order from 1)."""
        if link.number != len(self._links) + 1:
            raise ValueError(f"link {link.number} added after {len(self._links)} links")
        self._links.append(link)

    def queue_call(self, kind: int, call_id: int, aux: int, payload: bytes) -> bool:
        """A CALL, NOTIFY or CHUNK frame joins the backlog; False (logged) if it has no deadline."""
        if len(payload) < DEADLINE.size:
            log.error("worker %d: bad frame from broker: a call with no deadline", self._slot)
            return False
        self._backlog.append((kind, call_id, aux, payload))
        return True

    def cancel_call(self, call_id: int) -> None:
        """CANCEL of `call_id` (see `_cancel`)."""
        self._cancel(call_id)

    def link_said_bye(self) -> None:
        """A link said BYE: the worker closes once every connection has (`_flush`)."""
        self._closing = self._all_bye()  # type: ignore[misc]  # (a slot of WorkerProtocol's: mypy sees this class's empty ones)
        if self._closing:
            self._schedule_flush()

    def _all_bye(self) -> bool:
        return self._bye and all(link.bye or link.gone for link in self._links)

    def link_lost(self, link: Link) -> None:
        """`link`'s front-end is gone: its calls are cancelled as by a CANCEL (`_cancel`: running
        ones cancelled, waiting ones dropped, a chunk's too), their answers going nowhere
        (`split` drops them). (Cancelled tasks of their own, they were logged as handlers that
        raised CancelledError, with tracebacks: hostile testing, round 126.)"""
        number = link.number
        ids = [call_id for call_id in self._tasks if call_id >> LINK_SHIFT == number]
        ids += [chunk_id for chunk_id in self._chunks if chunk_id >> LINK_SHIFT == number and chunk_id not in ids]
        ids += [_id_of(item) for item in self._backlog if _id_of(item) >> LINK_SHIFT == number]
        ids += [item[1] for item in self._alone_next if item[1] >> LINK_SHIFT == number]  # (worker/alone.py)
        for call_id in dict.fromkeys(ids):
            self._cancel(call_id)
        self.link_said_bye()
        if self._alone != -1:  # (a call runs alone here: it may go on, or release, without it: worker/alone.py)
            self.schedule_run()

    def _read_now(self) -> bool:
        """Read and act on what the broker sent while the loop was held (a slow sync call),
        before the next waiting call runs. A callback scheduled with call_soon runs before
        the loop's next read of the channel, on uvloop as on asyncio (hostile testing,
        round 16: calls of a batch waiting behind a 1 s sync call were answered -32001 at
        their deadline and CANCELs sent for them, and ran all the same). The channel is
        non-blocking, and the loop hands each read to `data_received` as it comes, so
        reading it here keeps the frames in order. False if the connection is bad."""
        transport = self._transport
        sock = None if transport is None else transport.get_extra_info("socket")
        if sock is None:
            return True
        for link in self._links:
            if not link.read_now():
                return False
        while True:
            try:
                data = os.read(sock.fileno(), 1 << 18)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:  # (the loop's own read finds it too)
                return True
            if not data:  # (end of file: the loop's own read finds it too)
                return True
            if not self._take(data):
                return False

    def _write_links(self, transport: asyncio.Transport | None) -> None:
        """Write the replies queued (`_out`): the first connection's to `transport`, each
        link's to it (`split`), after what the held answers' thread left it (`_out_first`,
        `Link.pending`)."""
        if (self._out or self._out_first) and transport is not None and not transport.is_closing():
            first, by_link = split(self._out, self._links)
            if self._out_first:
                first[:0] = self._out_first
                self._out_first.clear()
            if first:
                transport.write(bytes(first))
            for link, data in zip(self._links, by_link):
                if data is not None:
                    link.write(data)
                elif link.pending:
                    link.write(b"")
            self._out.clear()
        else:
            for link in self._links:
                if link.pending:
                    link.write(b"")


def _id_of(item: object) -> int:
    """The call id of a backlog entry: a frame's tuple or a `_Chunk`."""
    return typing.cast("_Chunk", item).chunk_id if not isinstance(item, tuple) else typing.cast(
        "tuple[int, int, int, bytes]", item)[1]


def split(out: bytes | bytearray, links: list[Link]) -> tuple[bytearray, list[bytearray | None]]:
    """The reply frames in `out` (whole frames, ids tagged by link) by link: the first
    connection's, and each link's (index `number - 1`, None if it has none), each frame
    with its front-end's own id. Frames of a link not in `links` are dropped. O(frames)."""
    first = bytearray()
    by_link: list[bytearray | None] = [None] * len(links)
    pos, end = 0, len(out)
    run = 0  # start of the current run of untagged frames, copied whole
    while pos < end:
        length, kind, call_id, aux = _unpack(out, pos)
        stop = pos + HEADER_SIZE + length
        if call_id > ID_MASK:
            if run < pos:
                first += out[run:pos]
            number = call_id >> LINK_SHIFT
            if number <= len(links):
                buf = by_link[number - 1]
                if buf is None:
                    buf = by_link[number - 1] = bytearray()
                buf += _pack(length, kind, call_id & ID_MASK, aux)
                buf += out[pos + HEADER_SIZE : stop]
            run = stop
        pos = stop
    if run < end:
        first += out[run:end] if run else out
    return first, by_link
