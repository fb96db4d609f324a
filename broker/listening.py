"""The listeners: a TCP listener's protocol factory, and at a stop, the listeners closed and the connections queued in them served.

`accepting` makes a TCP listener's protocol (over TLS, a handshake first). At a stop
(broker/server.py, `run`), `stop_listening` closes every listener but a separate metrics
one, serves the connections the kernel had queued on them (`_accept_queued`) as the
connections open then are, and waits a little for the first requests of those that have
sent nothing yet (`_first_requests`); once the calls are drained, `close_last` closes the
metrics listener and gives the clients still taking answers the rest of the grace period.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import ssl
import typing

from broker.frontend.handshake import Handshake
from broker.frontend.http import HttpFrontend
from broker.frontend.stream import StreamFrontend

if typing.TYPE_CHECKING:
    from broker.frontend.stdio import StdioFrontend

__all__ = ["FIRST_REQUEST_SECONDS", "accepting", "close_last", "stop_listening"]

log = logging.getLogger("broker")


async def stop_listening(
    loop: asyncio.AbstractEventLoop, servers: list[asyncio.Server], frontends: list[HttpFrontend | StreamFrontend],
    face: StdioFrontend | None, tls: ssl.SSLContext | None, grace_period: float,
) -> list[int]:
    """Close the listeners `servers` (of `frontends`, in the same order; `tls`: the TCP
    listeners' context), each front-end draining, and serve the connections queued on them
    (`_accept_queued`); `face`, stdio's front-end, drains too. Returns once those queued are
    accepted and the silent connections have sent their first request, or
    FIRST_REQUEST_SECONDS (at most `grace_period` s) pass. A separate metrics listener stays
    open while the calls drain, so the drain can be watched; it closes last: the indexes of
    such listeners are returned (`close_last`)."""
    last = [i for i, fe in enumerate(frontends) if fe.transport == "metrics"]
    queued: list[asyncio.Task[object]] = []
    for i, (server, fe) in enumerate(zip(servers, frontends)):
        if i not in last:
            listening = [socket.socket(fileno=os.dup(sock.fileno())) for sock in server.sockets]
            server.close()
            fe.drain()
            queued += _accept_queued(loop, listening, fe, tls if fe.transport != "unix" else None)
    if face is not None:
        face.drain()  # (what stdin brought before the stop is served, then the connection half-closes)
    await asyncio.gather(*queued, return_exceptions=True)
    await _first_requests([fe for i, fe in enumerate(frontends[:len(servers)]) if i not in last],
                          min(FIRST_REQUEST_SECONDS, grace_period))
    return last


async def close_last(
    servers: list[asyncio.Server], frontends: typing.Sequence[HttpFrontend | StreamFrontend | StdioFrontend],
    last: list[int], taking: float, hurry: asyncio.Event,
) -> None:
    """Once the calls are drained: close the listeners `last` (`stop_listening`'s), and end
    every connection of `frontends` once its answers are written. Clients still taking
    answers already made (a slow reader of large ones) get `taking` s more, what is left of
    the grace period, and 2 s at least, before their connections are ended; all listeners
    at once (one after another, each would add its 2 s), and a second stop signal (`hurry`,
    set now or later) ends the wait."""
    for i in last:
        servers[i].close()
        frontends[i].drain()
    if hurry.is_set():
        await asyncio.gather(*(fe.wait_closed(timeout=0.2) for fe in frontends))
    else:
        await asyncio.gather(*(fe.wait_closed(timeout=2.0, taking=taking, hurry=hurry) for fe in frontends))


def _accept_queued(
    loop: asyncio.AbstractEventLoop, listening: list[socket.socket], fe: HttpFrontend | StreamFrontend,
    tls: ssl.SSLContext | None = None,
) -> list[asyncio.Task[object]]:
    """Accept the connections the kernel holds in the listen queues of `listening` (copies
    of a listener's sockets, taken before it closed: they keep its queue) and serve them as
    the connections open at the stop are (`fe` is draining), then close the copies: closing
    a listening socket resets the connections still queued on it, which had connected and
    may have sent their requests before the stop (hostile testing, round 34: 26 to 141 of
    200 clients that connected and wrote before SIGTERM were reset). Those that connect
    after it are refused by the kernel. Only as many as `fe` has room for within
    max_connections are accepted (round 35: past it, each took a file descriptor, until
    none was left, only to be closed unread); the rest are reset as before. Returns the
    tasks that make their transports (`loop.connect_accepted_socket`; over TLS with `tls`,
    its handshake counted as the listeners' are: `accepting`)."""
    tasks: list[asyncio.Task[object]] = []
    room = fe.max_connections - (fe.pool_size() if isinstance(fe, HttpFrontend) else len(fe.connections))
    for sock in listening:
        with sock:
            sock.setblocking(False)
            while len(tasks) < room:
                try:
                    conn, _ = sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:  # (EMFILE: those left are reset, as before)
                    log.warning("stopping: cannot accept a connection queued before the stop: %s", exc)
                    break
                tasks.append(loop.create_task(loop.connect_accepted_socket(accepting(fe, tls), conn)))
    return tasks


def accepting(fe: HttpFrontend | StreamFrontend, tls: ssl.SSLContext | None) -> typing.Callable[[], asyncio.Protocol]:
    """The protocol factory for `fe`'s TCP listener: its own (`fe.protocol`), or with `tls`
    a `Handshake` that hands the connection to it once TLS is set up (the handshake counted
    against max_connections: see broker/frontend/handshake.py)."""
    if tls is None:
        return fe.protocol
    return functools.partial(Handshake, fe, tls)


FIRST_REQUEST_SECONDS = 1.0
"""At a stop, how long the drain waits at most for the connections that have sent nothing yet
(accepted from the listen queue at the stop, or opened just before it) to send their first
request or line: it is on its way (a client connects, then writes). Answered "shutting down"
after the drain (hostile testing of a handover, issue 12 item 14: one call in thousands)."""


async def _first_requests(frontends: typing.Sequence[HttpFrontend | StreamFrontend], seconds: float) -> None:
    """Wait until no connection of `frontends` is silent (open, nothing received yet), or
    `seconds` pass: their first requests then come while the dispatcher still takes calls,
    and the drain waits for their answers. Checked every 5 ms (no event says "a first byte
    came" on every listener; bounded by `seconds`)."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + seconds

    def silent(fe: HttpFrontend | StreamFrontend) -> bool:
        if isinstance(fe, HttpFrontend):
            return any(c.transport is not None and not c.requests and not c.request_started for c in fe.connections)
        return any(c.transport is not None and not c.lines and not c.line_started for c in fe.connections)

    # (TLS handshakes under way too: a connection accepted before the stop whose handshake
    # ended after the drain was answered "grace period ended"; hostile testing, round 116, H3)
    while loop.time() < ends and any(fe.handshakes or silent(fe) for fe in frontends):
        await asyncio.sleep(0.005)
