"""The broker's log lines and access lines on their way to stderr, through a bounded queue that never blocks the event loop (`LogPipe`).

Theory of operation
-------------------
One deque holds what waits to be written: the access log's entries (`accesslog.Entry`,
plain tuples, put by `LogPipe.access` with no `logging` machinery in between) and the
broker's own `logging.LogRecord`s (put by `RecordHandler`, the root logger's only
handler). One writer thread, started by `LogPipe.start`, takes everything off it, formats
it (`accesslog.Renderer` for access lines, `LineFormatter` for records: text or one JSON
object a line) and writes it with `os.write` through a `LineWriter`, a few hundred lines a
write.

On the loop's thread an access line costs a tuple and a `deque.append` (atomic: no lock),
a bound's test and a flag's: the writer is woken (`threading.Event.set`, a lock) only when
it sleeps with nothing queued; then it waits `WRITE_SECONDS` more for the lines to gather,
so under load it wakes at most every `WRITE_SECONDS` and writes them all at once. (The
stdlib's `QueueHandler` and `queue.Queue` cost a lock and a condition per line, the
`Logger` and `LogRecord` several microseconds: measured in benchmarks/RESULTS.md.)

The queue is bounded (`QUEUE_LINES`, a chunk's results counted a line each): when stderr
is slow (a pipe nobody reads, a terminal scrolled back) the writer thread blocks in its
write, the queue fills, and the lines past it are dropped and counted (`dropped`: the
access lines' and the broker's own apart, exported as `rpc_broker_log_lines_dropped_total
{log}`), never waited for, so the loop goes on answering calls. The count in the queue is
the difference of counters each written by one thread only (`queued` by the loop's,
`records` under the handler's lock, `taken` by the writer's), so no lock is needed.
`LogPipe.stop` (at the process's exit) writes what is queued, waiting `STOP_SECONDS` at
most for a writer blocked on stderr.
"""

from __future__ import annotations

import collections
import datetime
import io
import logging
import os
import signal
import sys
import threading
import typing

import msgspec

from broker.accesslog import Entry, Renderer

__all__ = ["FORMATS", "QUEUE_LINES", "STOP_SECONDS", "WRITE_SECONDS", "LineFormatter", "LineWriter", "LogPipe",
           "RecordHandler", "access_to_logger"]  # fmt: skip

FORMATS = ("text", "json")  # the log_format setting's values
QUEUE_LINES = 10000  # lines waiting for the writer, at most (past it they are dropped): a few MB
STOP_SECONDS = 2.0  # how long the stop waits for the writer to write what is queued
WRITE_SECONDS = 0.02  # the writer, woken, waits this long for more lines: a write per 20 ms at most under load
TEXT_FORMAT = "%(asctime)s broker pid %(process)d %(levelname)s %(message)s"  # the broker's lines, as text
_WRITE_LINES = 64  # lines formatted before they are written: the GIL given up (os.write) every ~100 us, not ms
_BUFFER_BYTES = 64 * 1024  # `LineWriter.emit`'s buffer (after the stop): written when full, and by `flush`
_encode = msgspec.json.Encoder().encode
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the writer thread never takes these


class LineFormatter(logging.Formatter):
    """Formats the broker's `logging.LogRecord`s: text (`fmt`), or json (one object with time,
    level, logger, pid, message and the traceback, if any, in `exc`); `style` is "text" or "json"."""

    def __init__(self, style: str = "text", fmt: str = TEXT_FORMAT) -> None:
        if style not in FORMATS:
            raise ValueError(f"log_format = {style!r}: it must be one of {', '.join(FORMATS)}")
        super().__init__(fmt)
        self.style = style

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line (a traceback in text keeps its own lines, as the stdlib's)."""
        if self.style == "text":
            return super().format(record)
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "logger": record.name, "pid": record.process, "message": record.getMessage(),
        }  # fmt: skip
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return _encode(line).decode()


class RecordHandler(logging.Handler):
    """The root logger's handler while a `LogPipe` runs: puts each record on the pipe's
    queue as it is (formatted by the writer's thread), or drops and counts it."""

    def __init__(self, pipe: LogPipe) -> None:
        super().__init__()
        self._pipe = pipe

    def emit(self, record: logging.LogRecord) -> None:
        """Queue `record`, its message's arguments merged now (while they are what the caller
        meant) and its traceback made text (its frames not kept alive in the queue)."""
        if record.args:
            record.msg = record.getMessage()
            record.args = None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        self._pipe.record(record)  # (under this handler's lock: `LogPipe.records`' one writer)


class LineWriter(logging.Handler):
    """Writes lines to a file descriptor (`fd`, stderr's by default) from one thread at a
    time: `write_lines` (the pipe's writer thread), or as a handler (`emit`: the root
    logger's after the pipe's stop) into a buffer written when full and by `flush`. No lock
    is held while it writes, and once `abandoned` (its thread left blocked by
    `LogPipe.stop`) `flush` does nothing: the process's exit (`logging.shutdown` flushes
    every handler) never waits for a stderr nobody reads. A failed write (no reader:
    EPIPE) drops what was buffered."""

    def __init__(self, fd: int = 2) -> None:
        super().__init__()
        self.fd = fd
        self.abandoned = False
        self._buf = bytearray()

    def handle(self, record: logging.LogRecord) -> bool:
        """Format and buffer `record` (no handler lock: one thread writes at a time)."""
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        """Buffer `record`'s line; write the buffer once it is full."""
        try:
            line = self.format(record)
        except RecursionError:  # pragma: no cover - as logging.StreamHandler
            raise
        except Exception:
            self.handleError(record)
            return
        self._buf += line.encode("utf-8", "backslashreplace") + b"\n"
        if len(self._buf) >= _BUFFER_BYTES:
            self._write()

    def write_lines(self, lines: list[str]) -> None:
        """Write `lines` (no newlines of their own), in one write when the fd takes it."""
        self._buf += ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")
        self._write()

    def flush(self) -> None:
        """Write what is buffered (unless abandoned)."""
        if not self.abandoned:
            self._write()

    def _write(self) -> None:
        buf = self._buf
        try:
            while buf:
                del buf[: os.write(self.fd, buf)]
        except OSError:
            buf.clear()


class LogPipe:
    """The process's logging, from `start` to `stop`: the root logger's records and the
    access lines through one bounded queue to one writer thread (see the module docstring).

    level: the root logger's threshold (a logging level name or number). style: "text"
    or "json" (`FORMATS`). fd: the file descriptor lines are written to (default: a dup
    of stderr's). max_lines: the queue's bound. `dropped`: lines dropped for a full queue
    so far, {"access": n, "broker": n} (one dict, updated in place).
    """

    def __init__(self, level: int | str = logging.INFO, style: str = "text",
                 fd: int | None = None, max_lines: int = QUEUE_LINES) -> None:
        self._pending: collections.deque[Entry | logging.LogRecord] = collections.deque()
        self._append = self._pending.append
        self._max = max_lines
        self.queued = 0  # access lines put on the queue (the loop's thread only)
        self.records = 0  # records put on it (under the handler's lock only)
        self.taken = 0  # lines taken off it (the writer's thread only)
        self.dropped = {"access": 0, "broker": 0}
        self.handler = RecordHandler(self)
        self.writer = LineWriter(_stderr_fd() if fd is None else fd)
        self.writer.setFormatter(LineFormatter(style))
        self._renderer = Renderer(style)
        self._idle = False  # the writer sleeps with nothing queued: the next line wakes it
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._level = level

    def access(self, entry: Entry) -> None:
        """An access entry (`accesslog.AccessLog.emit`): queued, or dropped and counted. The
        event loop's thread only; never blocks."""
        lines = 1 if type(entry[5]) is bytes else len(entry[5])
        if self.queued + self.records - self.taken + lines > self._max:
            self.dropped["access"] += lines
            return
        self.queued += lines
        self._append(entry)
        if self._idle:
            self._idle = False
            self._wake.set()

    def record(self, record: logging.LogRecord) -> None:
        """A broker's record (`RecordHandler.emit`, under its lock): queued, or dropped and counted."""
        if self.queued + self.records - self.taken >= self._max:
            self.dropped["broker"] += 1
            return
        self.records += 1
        self._append(record)
        if self._idle:
            self._idle = False
            self._wake.set()

    def start(self) -> None:
        """Replace the root logger's handlers with the queue's; start the writer thread."""
        root = logging.getLogger()
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        root.addHandler(self.handler)
        root.setLevel(self._level)
        self._thread = threading.Thread(target=self._run, name="rpc-broker log writer", daemon=True)
        # Started with the stop and reload signals blocked (it inherits the mask): only the main
        # thread takes them, so the exit can hold them off (as `server._start_threads_masked`)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            self._thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _run(self) -> None:
        pending = self._pending
        stopping = self._stopping
        while True:
            self._wake.clear()
            self._idle = True
            if not pending and not stopping.is_set():
                self._wake.wait()  # (until `access` or `record` queues a line, or the stop)
            self._idle = False
            stopping.wait(WRITE_SECONDS)  # (the lines of the next 20 ms in the same write)
            self._drain()
            if stopping.is_set() and not pending:
                return

    def _drain(self) -> None:
        """Format and write everything queued, `_WRITE_LINES` lines a write."""
        pending = self._pending
        popleft = pending.popleft
        entry = self._renderer.entry
        fmt = self.writer.format
        out: list[str] = []
        while pending:
            item = popleft()
            try:
                if type(item) is tuple:
                    self.taken += 1 if type(item[5]) is bytes else len(item[5])  # (as `access` counted it)
                    out += entry(item)
                else:
                    self.taken += 1
                    out.append(fmt(typing.cast(logging.LogRecord, item)))
            except Exception as exc:  # (a line that cannot be made: said, the writer goes on)
                out.append(f"log line not written: {exc!r}")
            if len(out) >= _WRITE_LINES:
                self.writer.write_lines(out)
                out = []
        if out:
            self.writer.write_lines(out)

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the writer once it has written what is queued, `timeout` s at most. Then the
        root logger writes through the writer directly (the lines of the process's last
        moments); but a writer still blocked on a stderr nobody reads is abandoned (a daemon
        thread, it ends with the process) and the queue stays, dropping what comes."""
        thread = self._thread
        if thread is None:
            return
        self._thread = None
        self._stopping.set()
        self._wake.set()
        thread.join(timeout)
        if thread.is_alive():
            self.writer.abandoned = True
            return
        self._drain()  # (what came after the thread's last look)
        root = logging.getLogger()
        root.removeHandler(self.handler)
        root.addHandler(self.writer)


def access_to_logger(logger: logging.Logger) -> typing.Callable[[Entry], None]:
    """An `accesslog.AccessLog` emit for a process with no `LogPipe` (`server.run` called by
    an embedder): each line an INFO record of `logger`, as text (slower: a record a line)."""
    renderer = Renderer("text")

    def emit(entry: Entry) -> None:
        if logger.isEnabledFor(logging.INFO):
            for line in renderer.entry(entry):
                logger.info("%s", line)

    return emit


def _stderr_fd() -> int:
    """A descriptor of stderr's of the writer's own (a dup: not closed with sys.stderr)."""
    try:
        return os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return os.dup(2)
