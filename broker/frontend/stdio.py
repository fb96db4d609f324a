"""stdin and stdout as the broker's one client: `rpc-broker stdio`, and the stdio faces built on it (`Stdio`).

Theory of operation
-------------------
In stdio mode the broker serves one client, the process that launched it: requests come
on stdin and answers go to stdout, one JSON text a line, and every log line goes to
stderr. The framing and the limits are the NDJSON stream front-end's, unchanged:
stdin and stdout are relayed to one end of a Unix socketpair (`Relay`), whose other end
`server.run` serves as an accepted stream connection of a `StdioFrontend` (a
`StreamFrontend` of one connection). So a call, a notification, a batch, a blank line, a
line past max_body_bytes, a last line with no newline, answers out of order, the turns,
the flow control and the drain at a stop are a stream connection's, as
broker/frontend/stream.py says.

Why a relay rather than the loop's pipe transports (`connect_read_pipe`): stdin may be a
pipe, a tty, a socket or a regular file, stdout a pipe, a regular file or a socket. The
pipe transports refuse regular files (epoll cannot watch one), and set O_NONBLOCK on the
descriptor, a flag of the open file description, which a tty shares with the shell that
started the broker (left on, the shell's next read fails with EAGAIN). Two threads doing
blocking reads and writes take every kind and change no flag; and a socket is what the
stream connection knows (its half-close, SIOCINQ and SIOCOUTQ for the drain and
send_timeout). The cost, one more copy of each byte through a socket buffer, is small
beside decoding it.

The relay's threads:

    stdin -> socket   waits for stdin (poll, beside a wake-up pipe for the stop), reads up
                      to CHUNK bytes, sends them whole: while the broker pauses its reading
                      the socket fills, the thread waits, and the launcher's writes block
                      (back-pressure). At stdin's end (EOF; an error such as EIO, a tty
                      hung up) it shuts the socket's sending side: the connection sees its
                      client's half-close, answers every call owed, then closes.
    socket -> stdout  writes what the connection sends to stdout, whole (with poll when
                      stdout is non-blocking), until the connection closes (every answer
                      written) or stdout has no reader (EPIPE); then it shuts the socket
                      both ways (the connection's calls in flight are cancelled) and
                      resolves `Relay.ended` with why: `server.run` then stops the broker.

Nothing else may reach the launcher's stdout: `take_stdio` moves stdin and stdout off
descriptors 0 and 1 (the relay keeps duplicates, not inherited by children), and puts
/dev/null on 0 and stderr on 1, so a stray print of the broker's process, or of any process
started from it, goes to stderr (the workers' stdout and stderr are the pipe the broker
logs from: broker/pool.py, broker/logpipe.py).

What stdio mode changes in the settings (`stdio_config`): serve's JSON-RPC listeners (HTTP
on host:port, stream_port, stream_socket) are not opened; its one listener is the separate
metrics listener, when metrics_port is set (metrics are not collected otherwise: nothing
could read them). The one client may use every worker (connection_share 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import select
import socket
import threading
import typing

import msgspec

from broker.frontend.base import Limits
from broker.frontend.mcp import McpServer
from broker.frontend.stream import StreamFrontend

if typing.TYPE_CHECKING:
    from broker.config import Config
    from broker.dispatch import Dispatcher
    from broker.frontend.incoming import Incoming
    from broker.pool import Pool

__all__ = [
    "ENDED_BY_BROKER",
    "ENDED_BY_EOF",
    "ENDED_BY_READER",
    "JSONRPC",
    "MCP",
    "FrontendFactory",
    "Relay",
    "Stdio",
    "StdioFrontend",
    "jsonrpc_frontend",
    "log_listeners",
    "mcp_frontend",
    "stdio_config",
    "take_stdio",
]

log = logging.getLogger("broker")

CHUNK = 256 * 1024  # bytes a read of stdin or of the socket takes at most (uvloop's read size)
ENDED_BY_EOF = "stdin ended and every call owed was answered"
ENDED_BY_READER = "stdout has no reader (EPIPE), or is not open"
ENDED_BY_BROKER = "the broker ended the connection"


class StdioFrontend(StreamFrontend):
    """The stream front-end of the one stdio connection (`transport` "stdio", the metrics'
    and access lines' label): one connection, no bearer token asked for (its client is the
    process that started the broker, as a Unix socket's is its file mode's), and at the
    stop no wait for a first line on its way (`waits_for_first_line`: it was there from the
    start). `limits`: as `StreamFrontend`'s (max_body_bytes, max_batch, keepalive_timeout,
    send_timeout, incoming; max_connections is 1). `on_lost`: called once its connection is lost, however (closed
    after stdin's end, aborted when stdout failed, reset at send_timeout): `server.run` then
    stops the broker. A stdio face of another protocol subclasses it (its `protocol`)."""

    waits_for_first_line = False

    def __init__(self, dispatcher: Dispatcher, *, transport: str = "stdio", **limits: typing.Unpack[Limits]) -> None:
        limits["max_connections"] = 1
        super().__init__(dispatcher, transport=transport, **limits)
        self.on_lost: typing.Callable[[], None] = _nothing

    def lost(self, conn: typing.Any) -> None:
        super().lost(conn)
        self.on_lost()


class FrontendFactory(typing.Protocol):
    """Makes the front-end of the stdio connection, once the workers are ready: from the
    broker's `dispatcher`, its `pool` (its methods: `Pool.methods`), its `config` (as
    `stdio_config` made it) and the `incoming` bytes bound all its listeners share."""

    def __call__(self, dispatcher: Dispatcher, pool: Pool, config: Config, incoming: Incoming) -> StdioFrontend: ...


def jsonrpc_frontend(dispatcher: Dispatcher, pool: Pool, config: Config, incoming: Incoming) -> StdioFrontend:
    """`rpc-broker stdio`'s front-end: plain JSON-RPC 2.0, one message a line (a `FrontendFactory`)."""
    return StdioFrontend(dispatcher, incoming=incoming, max_body_bytes=config.max_body_bytes,
                         max_batch=config.max_batch, keepalive_timeout=config.keepalive_timeout,
                         send_timeout=config.send_timeout)


@dataclasses.dataclass(frozen=True, slots=True)
class Stdio:
    """What `server.serve` and `server.run` serve on stdin and stdout instead of serve's
    listeners: `what` the start-up line names ("JSON-RPC", "MCP"), and the `frontend`
    factory of the connection. `ends`: the (stdin, stdout) descriptors to relay; None (the
    default) takes the process's own (`take_stdio`) when the broker starts."""

    what: str
    frontend: FrontendFactory
    ends: tuple[int, int] | None = None

    def relay(self) -> Relay:
        """The `Relay` of its `ends`: the process's own stdin and stdout, taken now (`take_stdio`), if none."""
        return Relay(*(take_stdio() if self.ends is None else self.ends))


JSONRPC = Stdio("JSON-RPC", jsonrpc_frontend)
"""`rpc-broker stdio`."""


def mcp_frontend(dispatcher: Dispatcher, pool: Pool, config: Config, incoming: Incoming) -> StdioFrontend:
    """`rpc-broker mcp-stdio`'s front-end: MCP, one message a line (broker/frontend/mcp.py, on the
    stream front-end's lines: `StreamFrontend.mcp`), the process its session (a `FrontendFactory`)."""
    face = jsonrpc_frontend(dispatcher, pool, config, incoming)
    face.mcp = McpServer(lambda: dispatcher.catalog, face.codec, limit=face.max_response_bytes)
    return face


MCP = Stdio("MCP", mcp_frontend)
"""`rpc-broker mcp-stdio`."""


def stdio_config(config: Config) -> Config:
    """`config` as stdio mode runs it: connection_share 1 (its one client may use every
    worker: the share keeps room for other clients, and there is none), and metrics off
    unless metrics_port gives them a listener (with serve's default, 0, they would be on
    the RPC listener, which stdio mode does not open)."""
    return msgspec.structs.replace(config, connection_share=1.0, metrics=config.metrics and config.metrics_port != 0)


def log_listeners(config: Config) -> None:
    """Log what stdio mode does with serve's listeners (`stdio_config`'s `config`): none
    opened, metrics_port's aside; a WARNING for a stream listener asked for (stream_port,
    stream_socket set: in a file shared with serve, say)."""
    asked = [f"{name} {value}" for name, value in (("stream_port", config.stream_port),
                                                    ("stream_socket", config.stream_socket)) if value]
    if asked:
        log.warning("stdio: %s set, but stdio mode opens no JSON-RPC listener", ", ".join(asked))
    if config.frontends != 1:  # (new user, round 112: ignored, and nothing said so)
        log.warning("stdio: frontends %d set, but stdio mode runs one front-end (its one connection)",
                    config.frontends)
    log.info("stdio: serve's JSON-RPC listeners are not opened (host:port, stream_port, stream_socket)%s",
             "" if config.metrics else "; no metrics: metrics_port opens a listener for them")


def _dup_high(fd: int) -> int:
    """A duplicate of `fd` numbered 3 or more, not inherited by child processes (-1 if `fd`
    is not open): never on 0, 1 or 2, one of which may be closed, and later taken for it."""
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    except OSError:
        return -1


def take_stdio() -> tuple[int, int]:
    """Move the process's stdin and stdout off descriptors 0 and 1; return duplicates of
    them (-1 for one that is not open: its end comes at once), not inherited by child
    processes. From then on descriptor 0 reads /dev/null and descriptor 1 writes to
    stderr (to /dev/null without one): nothing the process or its children print reaches
    the launcher's stdout, which carries answers alone, and no descriptor the process
    opens later lands on 0 or 1 (with stdout closed, `>&-`, the log's duplicate of stderr
    was made there, and taken for stdout). What `sys.stdout` holds in its buffer goes to
    stderr too. Call it first, before the process opens descriptors it keeps."""
    ends = _dup_high(0), _dup_high(1)
    first = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)  # (may be 0 or 1 itself, if closed)
    null = _dup_high(first)
    os.close(first)
    try:
        os.dup2(null, 0)
        try:
            os.dup2(2, 1)
        except OSError:  # (no stderr: 2>&-)
            os.dup2(null, 1)
    finally:
        os.close(null)
    return ends


def _nothing() -> None:
    pass


def _wait(fd: int, events: int, wake: int = -1) -> bool:
    """Block until `fd` is ready for `events` (poll(2)); False if `wake` became readable first."""
    poller = select.poll()
    poller.register(fd, events)
    if wake >= 0:
        poller.register(wake, select.POLLIN)
    while True:
        ready = poller.poll()
        if any(ready_fd == wake for ready_fd, _ in ready):
            return False
        if ready:
            return True


class Relay:
    """stdin and stdout relayed to and from one end of a Unix socketpair, whose other end
    the broker serves as a stream connection (see the module docstring).

    stdin, stdout: descriptors (`take_stdio`'s), read and written by the relay's threads,
    never closed by it (-1: not open). The relay ends once the connection closed and every
    byte it sent was written to stdout (`finish` waits for that), or when stdout fails:
    then the connection, still open, is aborted. `why` says which."""

    def __init__(self, stdin: int, stdout: int) -> None:
        self._stdin = stdin
        self._stdout = stdout
        ours, theirs = socket.socketpair()
        self._ours = ours  # the relay's end, blocking
        self._theirs: socket.socket | None = theirs  # the connection's, until `connect` hands it over
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._eof = False  # stdin ended
        self._failed = ""  # how stdout failed (ENDED_BY_READER, or the error)
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: asyncio.Future[None] | None = None
        self._transport: asyncio.Transport | None = None  # the connection's

    @property
    def why(self) -> str:
        """Why the connection ends, as far as the relay knows: ENDED_BY_READER (or how else
        stdout failed), ENDED_BY_EOF (stdin ended), else ENDED_BY_BROKER."""
        return self._failed or (ENDED_BY_EOF if self._eof else ENDED_BY_BROKER)

    async def connect(self, factory: typing.Callable[[], asyncio.Protocol]) -> None:
        """Serve the socket's far end with a protocol of `factory` (a front-end's `protocol`),
        then start the threads: what the launcher wrote meanwhile waited in stdin."""
        loop = self._loop = asyncio.get_running_loop()
        self._ended = loop.create_future()
        theirs, self._theirs = self._theirs, None  # (the transport owns it now)
        if theirs is None:
            raise RuntimeError("the relay is connected already")
        theirs.setblocking(False)
        self._transport, _ = await loop.connect_accepted_socket(factory, theirs)
        for name, target in (("stdin", self._read_stdin), ("stdout", self._write_stdout)):
            thread = threading.Thread(target=target, name=f"rpc-broker {name} relay", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _read_stdin(self) -> None:
        """stdin -> socket, until stdin ends (then its half-close) or the socket is shut."""
        fd, ours = self._stdin, self._ours
        try:
            while fd < 0 or _wait(fd, select.POLLIN, self._wake_r):
                try:
                    data = os.read(fd, CHUNK)
                except BlockingIOError:  # (stdin non-blocking: its launcher's choice)
                    continue
                except OSError:  # (EIO: a tty hung up; EBADF: not open)
                    data = b""
                if not data:
                    self._eof = True
                    ours.shutdown(socket.SHUT_WR)
                    return
                ours.sendall(data)
        except OSError:  # (the socket shut by the other thread: the relay is over)
            return

    def _write_stdout(self) -> None:
        """socket -> stdout, until the connection closes or stdout fails; then the end."""
        ours = self._ours
        try:
            while data := ours.recv(CHUNK):
                failed = self._write_all(data)
                if failed is not None:
                    self._failed = failed
                    break
        except OSError:  # (ECONNRESET: the connection reset, send_timeout)
            pass
        with contextlib.suppress(OSError):
            ours.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")  # (the stdin thread's poll returns)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                self._loop.call_soon_threadsafe(self._end)

    def _end(self) -> None:
        """The relay ended (on the loop): a connection still open is aborted, its calls in
        flight cancelled: stdout failed, its answers have nowhere to go (half-closed by the
        shutdown, it would wait for them: only a write tells a socket its peer is gone)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.abort()
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    def _write_all(self, data: bytes) -> str | None:
        """Write `data` whole to stdout; else why not: ENDED_BY_READER (EPIPE, a socket
        reset, not open), or the error (ENOSPC: a file on a full disk)."""
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._stdout, view):]
            except BlockingIOError:  # (non-blocking: wait until it takes more)
                _wait(self._stdout, select.POLLOUT)
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF):
                    return ENDED_BY_READER
                return f"stdout failed: {exc}"
        return None

    async def finish(self, timeout: float) -> None:
        """Wait up to `timeout` s for what the connection sent to be written to stdout."""
        if self._ended is not None and not self._ended.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._ended), timeout)

    def close(self) -> None:
        """Stop the threads (the socket shut, the stdin thread woken) and close what the
        relay made; a thread still blocked writing to a stdout nobody reads is left (a
        daemon thread: the process's exit ends it), and so are the descriptors it uses."""
        with contextlib.suppress(OSError):
            self._ours.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")
        for thread in self._threads:
            thread.join(0.5)
        if any(thread.is_alive() for thread in self._threads):
            return
        if self._theirs is not None:  # (never connected)
            self._theirs.close()
        self._ours.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
