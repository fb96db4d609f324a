"""The broker's log lines and access lines on their way to stderr, through a bounded queue that never blocks the event loop (`LogPipe`).

Theory of operation
-------------------
`LogPipe.start` puts one `DroppingQueueHandler` (the stdlib's `QueueHandler`) on the root
logger, and a `QueueListener` thread takes the records off its queue and writes them with
one `LineWriter`. On the loop's thread a record costs only being put on the queue: it is
formatted (`LineFormatter`: text or one JSON object a line) and written by the listener's
thread, which writes into a buffer and flushes it when the queue is empty (one write for a
burst of lines, not one each).

The queue is bounded (`QUEUE_LINES`): when stderr is slow (a pipe nobody reads, a
terminal scrolled back) the writer thread blocks in its write, the queue fills, and the
lines past it are dropped and counted (`dropped`: the access lines' and the broker's own
apart, exported as `rpc_broker_log_dropped_total{log}`), never waited for, so the loop
goes on answering calls. `LogPipe.stop` (at the process's exit) flushes what is queued,
waiting `STOP_SECONDS` at most for a writer blocked on stderr.

Access lines (`accesslog.AccessLine`) take the same queue, put there by
`accesslog.AccessLog` with no `logging.Logger` in between (a `LogRecord` costs several
microseconds to make, as much as the rest of a call's dispatch).
"""

from __future__ import annotations

import datetime
import io
import logging
import logging.handlers
import os
import queue
import sys
import typing

import msgspec

from broker.accesslog import AccessLine

__all__ = ["FORMATS", "QUEUE_LINES", "STOP_SECONDS", "DroppingQueueHandler", "LineFormatter", "LineWriter", "LogPipe"]

FORMATS = ("text", "json")  # the log_format setting's values
QUEUE_LINES = 10000  # lines waiting for the writer, at most (past it they are dropped): a few MB
STOP_SECONDS = 2.0  # how long the stop waits for the writer to write what is queued
TEXT_FORMAT = "%(asctime)s broker pid %(process)d %(levelname)s %(message)s"  # the broker's lines, as text
_BUFFER_BYTES = 64 * 1024  # the writer's buffer: flushed when full, and whenever the queue is empty
_encode = msgspec.json.Encoder().encode


class LineFormatter(logging.Formatter):
    """Formats the broker's `logging.LogRecord`s (text: `fmt`; json: one object with time,
    level, logger, pid, message and the traceback, if any, in `exc`) and access lines
    (`AccessLine.render`) alike; `style` is "text" or "json"."""

    def __init__(self, style: str = "text", fmt: str = TEXT_FORMAT) -> None:
        if style not in FORMATS:
            raise ValueError(f"log_format = {style!r}: it must be one of {', '.join(FORMATS)}")
        super().__init__(fmt)
        self.style = style

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line (a traceback in text keeps its own lines, as the stdlib's)."""
        if isinstance(record, AccessLine):
            return typing.cast(AccessLine, record).render(self.style)
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


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """A `QueueHandler` that never blocks nor grows: a record that finds the queue full is
    dropped and counted in `dropped` ("access" for access lines, "broker" for the rest).
    Records are queued as they are (`prepare`): the writer's thread formats them."""

    def __init__(self, q: queue.Queue[typing.Any]) -> None:
        super().__init__(q)
        self.dropped = {"access": 0, "broker": 0}
        self._put = q.put_nowait

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """The record itself (one process: nothing is pickled, so nothing is formatted here).
        Its message's arguments are merged now, while they are what the caller meant."""
        if not isinstance(record, AccessLine) and record.args:
            record.msg = record.getMessage()
            record.args = None
        if record.exc_info and not isinstance(record, AccessLine):
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None  # (its traceback's frames are not kept alive in the queue)
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        """Put `record` on the queue, or drop and count it if the queue is full."""
        try:
            self._put(record)
        except queue.Full:
            self.dropped["access" if isinstance(record, AccessLine) else "broker"] += 1

    def access(self, line: AccessLine) -> None:
        """An access line (`accesslog.AccessLog.emit`): queued, or dropped and counted."""
        try:
            self._put(line)
        except queue.Full:
            self.dropped["access"] += 1


class LineWriter(logging.Handler):
    """Writes lines to a file descriptor (`fd`, stderr's by default) from one thread, the
    listener's: into a buffer, written (`os.write`) when it holds `_BUFFER_BYTES` and when
    the listener's queue is empty (`flush`). No lock is held while it writes (`handle`), and
    once `abandoned` (its thread left blocked by `LogPipe.stop`) `flush` does nothing: the
    process's exit (`logging.shutdown` flushes every handler) never waits for a stderr
    nobody reads. A failed write (no reader: EPIPE) drops what was buffered."""

    def __init__(self, fd: int = 2) -> None:
        super().__init__()
        self.fd = fd
        self.abandoned = False
        self._buf = bytearray()

    def handle(self, record: logging.LogRecord) -> bool:
        """Format and buffer `record` (no handler lock: only the listener's thread writes)."""
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


class _Listener(logging.handlers.QueueListener):
    """A `QueueListener` that flushes its handlers when its queue is empty (a burst of
    lines in one write), and calls each handler's `handle` (its level checked here)."""

    def handle(self, record: logging.LogRecord) -> None:
        for handler in self.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)
        if typing.cast("queue.Queue[typing.Any]", self.queue).empty():
            for handler in self.handlers:
                handler.flush()


class LogPipe:
    """The process's logging, from `start` to `stop`: the root logger's records and the
    access lines through one bounded queue to one writer thread (see the module docstring).

    level: the root logger's threshold (a logging level name or number). style: "text"
    or "json" (`FORMATS`). fd: the file descriptor lines are written to (default: a dup
    of stderr's). max_lines: the queue's bound.
    """

    def __init__(self, level: int | str = logging.INFO, style: str = "text",
                 fd: int | None = None, max_lines: int = QUEUE_LINES) -> None:
        self.queue: queue.Queue[typing.Any] = queue.Queue(max_lines)
        self.handler = DroppingQueueHandler(self.queue)
        self.writer = LineWriter(_stderr_fd() if fd is None else fd)
        self.writer.setFormatter(LineFormatter(style))
        self._listener = _Listener(self.queue, self.writer)
        self._level = level
        self._started = False

    @property
    def dropped(self) -> dict[str, int]:
        """Lines dropped for a full queue so far: {"access": n, "broker": n}."""
        return self.handler.dropped

    def start(self) -> None:
        """Replace the root logger's handlers with the queue's; start the writer thread."""
        root = logging.getLogger()
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        root.addHandler(self.handler)
        root.setLevel(self._level)
        self._listener.start()
        self._started = True

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the writer once it has written what is queued, `timeout` s at most. Then the
        root logger writes through the writer directly (the lines of the process's last
        moments); but a writer still blocked on a stderr nobody reads is abandoned (a daemon
        thread, it ends with the process) and the queue stays, dropping what comes."""
        if not self._started:
            return
        self._started = False
        thread = self._listener._thread
        try:
            self.queue.put(None, timeout=timeout)  # (QueueListener's sentinel)
        except queue.Full:
            self.writer.abandoned = True
            return
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                self.writer.abandoned = True
                return
            self._listener._thread = None
        self.writer.flush()
        root = logging.getLogger()
        root.removeHandler(self.handler)
        root.addHandler(self.writer)


def _stderr_fd() -> int:
    """A descriptor of stderr's of the writer's own (a dup: not closed with sys.stderr)."""
    try:
        return os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return os.dup(2)
