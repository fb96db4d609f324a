"""TLS handshakes counted against max_connections (`Handshake`), then handed to the listener's protocol.

With `ssl=` given to `loop.create_server`, a connection is not its protocol's until its TLS
handshake ends: for up to `HANDSHAKE_SECONDS` it holds a file descriptor that no limit sees
(hostile testing, round 114: 20,000 connections that never sent a ClientHello, opened in a
few seconds, took every descriptor; the broker could accept nothing and restart no worker
until they timed out). So the listeners are plain TCP and each accepted connection starts
as a `Handshake`: counted in its listener's `handshakes` (part of `Listener.pool_size`, so
of max_connections) while `loop.start_tls` runs, then handed to the listener's own
protocol (HTTP's or the NDJSON stream's), which takes the connection as if it had just been
accepted.

At max_connections a new connection first makes room as any does (`Listener.make_room`):
idle connections go, then, if none can, the oldest handshake begun `TRICKLE_GRACE_SECONDS`
ago or more is aborted (a client that has not finished a handshake in that time is slow, or
an attacker's, as one trickling its request is; counted `evicted_total["handshake"]`). If
nothing could go, the newcomer is refused (`Listener.refused`), reset before any byte of
TLS; on HTTP only past the probes' reserve too (`handshake_overflow`: a probe past the limit
then reaches the HTTP protocol, which admits it; hostile testing, round 115, M1).
"""

from __future__ import annotations

import asyncio
import ssl
import types
import typing

from broker.tls import HANDSHAKE_SECONDS

if typing.TYPE_CHECKING:
    from broker.frontend.httplistener import HttpFrontend
    from broker.frontend.stream import StreamFrontend

__all__ = ["Handshake"]


class Handshake(asyncio.Protocol):
    """One accepted TCP connection whose TLS handshake (server side, `context`) is under
    way, counted in `listener.handshakes`; once it ends, `listener.protocol()` takes the
    TLS transport (its `connection_made`), with any application data that came with the
    handshake's last flight. A handshake that fails, times out (`HANDSHAKE_SECONDS`) or is
    aborted to make room leaves nothing behind: no protocol of the listener's was made."""

    __slots__ = ("_context", "_early", "_eof", "_listener", "_task", "_transport", "started")

    def __init__(self, listener: HttpFrontend | StreamFrontend, context: ssl.SSLContext) -> None:
        self._listener = listener
        self._context = context
        self._transport: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self._early: list[bytes] = []  # application data read before the swap (`data_received`)
        self._eof = False  # the client's EOF (close_notify) came before the swap
        self.started = 0.0  # loop time the handshake began

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw = typing.cast(asyncio.Transport, transport)
        listener = self._listener
        loop = listener.loop
        if listener.pool_size() >= listener.max_connections and not listener.draining:
            listener.make_room()  # (idle connections, then the oldest handshake, if any may go)
            if listener.pool_size() >= listener.max_connections + listener.handshake_overflow:
                listener.refused()  # (HTTP: past its probes' reserve too)
                raw.abort()
                return
        # start_tls's first step runs now, not in a task's first step: uvloop starts reading
        # once connection_made returns (pause_reading here is lost), and a ClientHello read
        # before start_tls made its SSL protocol the transport's came here, not to it, and the
        # handshake waited for good (found testing this module). Its SSL protocol now gets
        # every byte read, keeping those before its own connection_made for it.
        starting = loop.start_tls(raw, self, self._context, server_side=True, ssl_handshake_timeout=HANDSHAKE_SECONDS)
        try:
            waiting = starting.send(None)
        except BaseException:  # (StopIteration included: it cannot end before the handshake)
            starting.close()
            raw.abort()
            raise
        self.started = loop.time()
        self._transport = raw
        listener.handshakes[self] = None
        self._task = loop.create_task(self._upgrade(raw, starting, waiting))

    async def _upgrade(self, raw: asyncio.Transport, starting: typing.Coroutine[typing.Any, typing.Any, typing.Any],
                       waiting: object) -> None:
        listener = self._listener
        try:
            secure = await _resumed(starting, waiting)
        except ssl.SSLError as exc:  # (a certificate refused, not TLS at all: counted and said)
            listener.handshake_failed(raw.get_extra_info("peername"), exc.reason or str(exc))
            raw.abort()
            return
        except (OSError, TimeoutError, ConnectionError, asyncio.CancelledError):
            raw.abort()
            return
        finally:
            listener.handshakes.pop(self, None)
        if secure is None or secure.is_closing():
            return
        protocol = listener.protocol()
        secure.set_protocol(protocol)
        protocol.connection_made(secure)
        for data in self._early:
            protocol.data_received(data)
        self._early.clear()
        if self._eof and not protocol.eof_received():
            secure.close()

    def abort(self) -> None:
        """End the handshake now (to make room, or at the broker's stop): the connection is reset."""
        self._listener.handshakes.pop(self, None)
        if self._task is not None:
            self._task.cancel()
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        """Application data decrypted as the handshake ended (with the client's Finished),
        before `_upgrade` resumed to hand the connection over (the same loop iteration, or
        the next): kept for the listener's protocol, which gets it first."""
        self._early.append(data)

    def eof_received(self) -> bool:
        """The client's close_notify before the swap: the listener's protocol gets it after
        the data (its answer decides whether the connection closes)."""
        self._eof = True
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.handshakes.pop(self, None)


@types.coroutine
def _resumed(coroutine: typing.Coroutine[typing.Any, typing.Any, typing.Any],
             yielded: object) -> typing.Generator[typing.Any, typing.Any, typing.Any]:
    """Await the rest of `coroutine`, whose first step ran already and yielded `yielded`
    (the future it waits on): what a task does with a coroutine it starts, from the second
    step on. Returns its result; raises what it raises (a cancellation is thrown into it)."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coroutine.close()
            raise
        except BaseException as exc:
            try:
                yielded = coroutine.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                yielded = coroutine.send(sent)
            except StopIteration as stop:
                return stop.value
