"""The broker's log lines and access lines on their way to stderr, never blocking the event loop (`LogPipe`).

Theory of operation
-------------------
An access line is captured on the event loop's thread as a plain tuple (`accesslog.Entry`)
appended to a list: `LogPipe.access` is that list's own `append`, so a line costs the
tuple and a C call, no Python frame, no lock. While the loop runs (`LogPipe.attach`), a
timer takes the list every `FLUSH_SECONDS` and renders it there, on the loop, in one pass
(`accesslog.Renderer.lines`: text or one JSON object a line), into one buffer of bytes put
on a deque. Rendering in batches on the loop costs less than on another thread: a thread
rendering Python holds the GIL that every one of uvloop's callbacks must take back, and
measured at S1-64 that handoff cost the loop more than the rendering itself
(benchmarks/RESULTS.md, "Access log cost").

One writer thread, started by `LogPipe.start`, takes the buffers off the deque and writes
them with `os.write` (which lets go of the GIL while it waits) through a `LineWriter`. The
broker's own `logging.LogRecord`s (the root logger's one handler, `RecordHandler`) go on the
same deque, after the access lines captured before them, and are formatted by the writer
(`LineFormatter`: text, or one JSON object a line). The workers' lines come the same way:
each worker's stderr is a pipe whose read end the loop reads (`LogPipe.follow`), its whole
lines queued as buffers, so a worker never blocks on the broker's stderr.

The deque is bounded in lines (`QUEUE_LINES`, a buffer counted by its lines; a buffer put
when the deque is empty is taken whole, whatever its lines) and in bytes (`QUEUE_BYTES`),
the writer's batch in hand counted until written: when stderr is slow (a pipe
nobody reads, a terminal scrolled back) the writer thread blocks in its write, the deque
fills, and the lines past the bound are dropped and counted (`dropped`:
the access lines', the broker's own and the workers' apart, exported as
`rpc_broker_log_lines_dropped_total{log}`), never waited for, so the loop goes on answering
calls. The count on the deque is the difference of counters each written by one thread
only (`queued` by the loop's, `records` under the handler's lock, `taken` by the writer's),
so no lock is needed. `LogPipe.stop` (at the process's exit) renders what is captured and
writes what is queued, waiting `STOP_SECONDS` at most for a writer blocked on stderr.
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import datetime
import io
import logging
import os
import re
import select
import signal
import sys
import threading
import time
import typing

import msgspec

from broker.accesslog import Entry, Renderer, escape_unshown, json_line

__all__ = ["BROKER_RESERVE", "FLUSH_SECONDS", "FORMATS", "PIPE_BUF", "QUEUE_BYTES", "QUEUE_LINES",
           "STOP_SECONDS",
           "LineFormatter", "LineWriter", "LogPipe",
           "RecordHandler", "access_to_logger"]  # fmt: skip

FORMATS = ("text", "json")  # the log_format setting's values
QUEUE_LINES = 50000  # lines waiting for the writer, at most (past it they are dropped): ~9 MB of `add` lines
# (10,000 dropped 2,500 of a 4-client batch flood to a file when CI's full run held the writer back)
BROKER_RESERVE = 1000  # lines past QUEUE_LINES kept for the broker's own (its WARNINGs not lost behind access lines)
QUEUE_BYTES = 16 * 1024 * 1024  # and their bytes, at most (lines with params, escaped, can be 12 kB)
STOP_SECONDS = 2.0  # how long the stop waits for the writer to write what is queued
FLUSH_SECONDS = 0.05  # the access lines captured are rendered and queued this often while the loop runs
TEXT_FORMAT = "%(asctime)s broker pid %(process)d %(levelname)s %(message)s"  # the broker's lines, as text
PIPE_BUF = select.PIPE_BUF  # the largest write a pipe keeps whole (4096 on Linux)
_BUFFER_BYTES = 64 * 1024  # what the writer gathers before a write; `LineWriter.emit`'s buffer (after the stop)
_encode = msgspec.json.Encoder().encode
_OWN_LINE = rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} worker\[\d+\] pid "  # (worker/process.py's format, its pid next)
_LEVEL = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} worker\[\d+\]( pid \d+ )([A-Z]+) ")  # (json: its level)
_CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]")  # (a quick look, before decoding: the rest is not ASCII)
_EMPTY_LINES = re.compile(rb"(?m)^\n")
_EVERY_LINE = re.compile(rb"^(?=[\s\S])", re.M)  # (a worker's output pipe: none of its lines is its logging's)


def _text_escape(char: str) -> str:
    """An `accesslog.UNSHOWN` character as a worker's text line writes it: \\xNN, \\uNNNN or \\UNNNNNNNN."""
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the writer thread never takes these


class LineFormatter(logging.Formatter):
    """Formats the broker's `logging.LogRecord`s: text (`fmt`), or json (one object with time,
    level, logger, pid, message and the traceback, if any, in `exc`); `style` is "text" or "json".
    Times in UTC, as the access lines' (new user, round 110: the broker's were local time, the
    access lines' UTC, neither saying which)."""

    converter = time.gmtime  # type: ignore[assignment]  # (typeshed: gmtime's overloads; the stdlib's docs set it so)

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
            "level": record.levelname, "log": "broker", "logger": record.name, "pid": record.process,
            "message": record.getMessage(),
        }  # fmt: skip
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json_line(_encode(line))


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
    time: `write` (the pipe's writer thread), or as a handler (`emit`: the root
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

    def write(self, data: bytes) -> int:
        """Write `data` (whole lines), as the pipe's writer thread (waiting for a reader as
        long as it takes). Returns how many lines a failed write dropped (0: all written)."""
        self._buf += data
        return self._write()

    def flush(self) -> None:
        """Write what is buffered (unless abandoned)."""
        if not self.abandoned:
            self._write()

    def _write(self) -> int:
        """Write the buffer: whole lines, at most `PIPE_BUF` bytes a write (a longer line
        alone), so that on a pipe each write is atomic: another process's line written to
        the same stderr (the broker's workers wrote to it once: hostile testing, round 117
        had their lines spliced into access lines) never lands inside one of these."""
        buf = self._buf
        try:
            while buf:
                end = len(buf)
                if end > PIPE_BUF:
                    cut = buf.rfind(b"\n", 0, PIPE_BUF)
                    end = cut + 1 if cut >= 0 else buf.find(b"\n", PIPE_BUF) + 1 or len(buf)
                written = os.write(self.fd, bytes(buf[:end]))
                del buf[:written]
        except OSError:
            lost = buf.count(b"\n")
            buf.clear()
            return lost
        return 0


class LogPipe:
    """The process's logging, from `start` to `stop`: the access lines captured on the loop
    and the root logger's records through one bounded deque to one writer thread (see the
    module docstring).

    level: the root logger's threshold (a logging level name or number). style: "text"
    or "json" (`FORMATS`). fd: the file descriptor lines are written to (default: a dup
    of stderr's). max_lines: the deque's bound, and max_bytes its access lines' (a buffer put
    when the deque is empty is taken whole, whatever its size). `dropped`: lines dropped for a full deque
    so far, {"access": n, "broker": n} (one dict, updated in place); `lost`: those a write
    failed to write (no reader, a full disk); `dropped_total`: the two summed, read-only
    (`rpc_broker_log_lines_dropped_total`). `access`: takes an
    access entry (`accesslog.AccessLog`'s emit), on the loop's thread only; rendered at the
    next `flush` (every `FLUSH_SECONDS` once `attach`ed to the loop, and at the `stop`).
    """

    def __init__(self, level: int | str = logging.INFO, style: str = "text",
                 fd: int | None = None, max_lines: int = QUEUE_LINES, max_bytes: int = QUEUE_BYTES,
                 broker_reserve: int = BROKER_RESERVE) -> None:
        self._entries: list[Entry] = []  # captured since the last flush
        self.access: typing.Callable[[Entry], None] = self._entries.append
        # (buffer of lines, their count, "access" or "worker"), or a broker's record
        self._pending: collections.deque[tuple[bytes, int, str] | logging.LogRecord] = collections.deque()
        self._append = self._pending.append
        self._max = max_lines
        self._max_bytes = max_bytes
        self._reserve = broker_reserve
        self.queued_bytes = 0  # of the buffers put on the deque (the loop's thread only)
        self.taken_bytes = 0  # of those written, or failed (the writer's thread only)
        self.queued = 0  # buffers' lines put on the deque (the loop's thread only)
        self.records = 0  # records put on it (under the handler's lock only)
        self.taken = 0  # lines written, or failed (the writer's thread only): the deque's and the writer's in hand
        self.dropped = {"access": 0, "broker": 0, "worker": 0}
        self.lost = {"access": 0, "broker": 0, "worker": 0}  # lines a write failed to write (the writer's thread only)
        self.dropped_total = _Sum(self.dropped, self.lost)
        self.handler = RecordHandler(self)
        self.writer = LineWriter(_stderr_fd() if fd is None else fd)
        self.writer.setFormatter(LineFormatter(style))
        self._renderer = Renderer(style)
        self._json = style == "json"
        self._loop_thread: int | None = None  # the thread `access` is called on, once attached
        self._loop: asyncio.AbstractEventLoop | None = None
        # workers' stderr pipes read (`follow`): a line begun, the pid, [the last line was cut]
        self._followed: dict[int, tuple[bytearray, int, list[bool]]] = {}
        # by descriptor: the starts of its lines not the worker's logging's own (its output pipe's:
        # every line's), and whether it is the logging's pipe
        self._own: dict[int, tuple[re.Pattern[bytes], bool]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._idle = False  # the writer sleeps with nothing queued: the next buffer wakes it
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._level = level

    def attach(self, loop: asyncio.AbstractEventLoop, ticks: bool = True) -> None:
        """Flush every `FLUSH_SECONDS` on `loop` (called on its thread; `ticks` False: no
        access lines come, no timer), and read the pipes `follow`ed on it, until `detach`."""
        self._loop_thread = threading.get_ident()
        self._loop = loop
        if ticks:
            self._tick(loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.flush()
        self._timer = loop.call_later(FLUSH_SECONDS, self._tick, loop)

    def detach(self) -> None:
        """Stop the timer `attach` started, and flush what is captured; queue what the
        pipes `follow`ed hold (their workers have exited by now) and close them."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.flush()
        for fd in list(self._followed):
            while fd in self._followed and self._read(fd):
                pass
            if fd in self._followed:
                self._unfollow(fd)
        self._loop_thread = None
        self._loop = None

    def follow(self, fd: int, pid: int, logging_pipe: bool = False) -> None:
        """Forward the lines a worker (process `pid`) writes to a pipe whose read end is `fd`
        (this owns it from now on, and closes it at its end of file or `detach`): its stdout
        and stderr, or (`logging_pipe`) its logging's own pipe. Read on the loop `attach`ed, as
        they come, whole lines queued for the writer as the access lines are, or dropped and
        counted (`dropped["worker"]`) when the deque is full. So a worker never waits for the
        broker's stderr: only for this loop, which reads it. A line is made safe to show
        (`_worker_lines`): in json, an object of its own. Only the logging pipe's lines may
        show as the worker's log lines: every line of the other is marked a print (hostile
        testing, round 131: a tool that printed a client's text in the worker's own form, its
        pid guessed, wrote a CRITICAL line of the worker's)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("LogPipe.follow: not attached to a loop")
        os.set_blocking(fd, False)
        self._followed[fd] = (bytearray(), pid, [False])
        self._own[fd] = ((re.compile(rb"^(?!" + _OWN_LINE + str(pid).encode() + rb" )(?=[\s\S])", re.M), True)
                         if logging_pipe else (_EVERY_LINE, False))
        loop.add_reader(fd, self._read, fd)

    def _unfollow(self, fd: int) -> None:
        part, pid, _ = self._followed.pop(fd)
        if self._loop is not None:
            self._loop.remove_reader(fd)
        os.close(fd)
        if part:
            self._forward(bytes(part) + b"\n", pid, fd)
        del self._own[fd]

    def _read(self, fd: int) -> bool:
        """Read what `fd` holds, `_BUFFER_BYTES` at most, and queue its whole lines (a line
        cut once longer than that); at its end, stop following it. False: nothing to read."""
        try:
            data = os.read(fd, _BUFFER_BYTES)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._unfollow(fd)
            return False
        part, pid, cut = self._followed[fd]
        if cut[0]:  # (a cut line's rest: marked so, never read as a line of the worker's own; hostile
            cut[0] = False  # testing, round 120: a client's text past 64 KiB forged one so)
            part += b"..."
        end = data.rfind(b"\n") + 1
        if not end:
            part += data
            if len(part) >= _BUFFER_BYTES:  # (a worker writing no newline: cut, bounded)
                self._forward(bytes(part) + b"\n", pid, fd)
                part.clear()
                cut[0] = True
            return True
        if part:
            self._forward(bytes(part) + data[:end], pid, fd)
            part.clear()
        else:
            self._forward(data[:end], pid, fd)
        part += data[end:]
        return True

    def _forward(self, data: bytes, pid: int, fd: int) -> None:
        """Queue a worker's whole lines `data`, its empty lines left out, or drop and count
        them when they do not fit half the deque's bounds (a worker's flood leaves room for
        the access lines; hostile testing, rounds 119 and 120: a worker's flood, even one read
        of 32,768 short lines put on an empty deque, had them dropped, the calls that logged
        it unseen), their bytes as rendered (json and the text's marks make more of them)."""
        if b"\n\n" in data or data[:1] == b"\n":  # (nothing to show, and 18 to 72 bytes a line shown)
            data = _EMPTY_LINES.sub(b"", data)
            if not data:
                return
        lines = data.count(b"\n")
        backlog = self.queued + self.records - self.taken
        if backlog + lines > self._max // 2:
            self.dropped["worker"] += lines  # (before any work on them: a flood costs its reads only)
            return
        data = self._worker_lines(data, pid, *self._own[fd])
        if self.queued_bytes - self.taken_bytes + len(data) > self._max_bytes // 2:
            self.dropped["worker"] += lines
            return
        self.queued += lines
        self.queued_bytes += len(data)
        self._append((data, lines, "worker"))
        if self._idle:
            self._idle = False
            self._wake.set()

    def _worker_lines(self, data: bytes, pid: int, not_own: re.Pattern[bytes], logging_pipe: bool) -> bytes:
        """A worker's lines `data` (whole, each ending in a newline) as written: in text, as
        they are but for control characters (C0 but tab, DEL, C1: a terminal's escape
        sequences, a carriage return rewriting the line shown) and bytes not UTF-8, written
        `\\xNN`, and a line that does not start as the worker's logging starts its own (its
        time, `worker[N] pid PID `: a traceback's lines, a newline in a message a client chose),
        and every line of its output pipe (`not_own` matches them all: a print), shown as the
        worker's, `worker pid PID | ...` (hostile testing, round 119: an exception's message with
        newlines wrote lines read as the broker's and access lines);
        in json, each an object `{"time", "level", "log": "worker", "pid", "message"}` (the line as its
        message: every line of the log JSON, and none a forgery of an access line or the broker's)."""
        if self._json:
            now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
            text = data.decode("utf-8", "backslashreplace")
            own = f" pid {pid} "
            out = []
            for line in text.split("\n")[:-1]:  # (`level`: a log line's of the worker's own, else null)
                level = (match.group(2) if logging_pipe and (match := _LEVEL.match(line)) and match.group(1) == own
                         else None)
                out.append(json_line(_encode({"time": now, "level": level, "log": "worker", "pid": pid,
                                              "message": line})))
            return ("\n".join(out) + "\n").encode()
        data = not_own.sub(b"worker pid %d | " % pid, data)
        if data.isascii() and not _CONTROL_BYTES.search(data):
            return data
        text = escape_unshown(data.decode("utf-8", "backslashreplace"), _text_escape)
        return text.encode("utf-8", "backslashreplace")

    def flush(self) -> None:
        """Render the access entries captured so far and queue them as one buffer. When the
        writer has taken everything before, the buffer is queued whole, however many lines
        (at most the loop's calls of one `FLUSH_SECONDS`: a stderr that keeps up loses none,
        a batch flood's included); otherwise the lines past the deque's bound are dropped and
        counted, and only those that fit rendered. On the thread of `access`."""
        entries = self._entries
        if not entries:
            return
        batch = entries[:]
        entries.clear()
        backlog = self.queued + self.records - self.taken
        if backlog:
            room = self._max - backlog
            if room < len(batch):  # (a line an entry at least: those past the room not rendered)
                self.dropped["access"] += _lines_of(batch[max(room, 0):])
                del batch[max(room, 0):]
                if not batch:
                    return
        lines = self._renderer.lines(batch)
        if backlog and len(lines) > self._max - backlog:  # (a chunk's entry: its lines past the room)
            room = self._max - backlog
            self.dropped["access"] += len(lines) - room
            del lines[room:]
        data = ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")
        room = self._max_bytes - (self.queued_bytes - self.taken_bytes)
        if len(data) > room:  # (past the bytes' bound, the writer's buffer in hand counted: hostile
            # testing, round 118, saw 2-3 times the bound held; the lines that fit kept)
            size = kept = 0
            for line in lines:
                size += len(line.encode("utf-8", "backslashreplace")) + 1
                if size > room:
                    break
                kept += 1
            self.dropped["access"] += len(lines) - kept
            if not kept:
                return
            del lines[kept:]
            data = ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")
        self.queued += len(lines)
        self.queued_bytes += len(data)
        self._append((data, len(lines), "access"))
        if self._idle:
            self._idle = False
            self._wake.set()

    def line(self, text: str) -> None:
        """Queue `text` as a line of its own, after what is captured before it (never
        dropped: the start's banners). On the thread of `access`."""
        self.flush()
        data = (text + "\n").encode("utf-8", "backslashreplace")
        self.queued += 1
        self.queued_bytes += len(data)
        self._append((data, 1, "access"))
        if self._idle:
            self._idle = False
            self._wake.set()

    def record(self, record: logging.LogRecord) -> None:
        """A broker's record (`RecordHandler.emit`, under its lock): queued after the access
        lines captured before it on the same thread, or dropped and counted (only past the
        bound and `BROKER_RESERVE` more: access lines filling the queue leave room for these;
        new users, round 108, lost the WARNINGs of workers killed as hung)."""
        if self._entries and self._loop_thread in (None, threading.get_ident()):
            self.flush()
        if self.queued + self.records - self.taken >= self._max + self._reserve:
            self.dropped["broker"] += 1
            return
        self.records += 1
        self._append(record)
        if self._idle:
            self._idle = False
            self._wake.set()

    def start(self) -> None:
        """Replace the root logger's handlers with the deque's; start the writer thread."""
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
                self._wake.wait()  # (until `flush` or `record` queues something, or the stop)
            self._idle = False
            self._drain()
            if stopping.is_set() and not pending:
                return

    def _drain(self) -> None:
        """Write everything queued (records formatted here), `_BUFFER_BYTES` or so a write,
        the access lines and the broker's apart; lines a write failed to write (no reader:
        EPIPE; a full disk: ENOSPC) counted in `lost`."""
        pending = self._pending
        popleft = pending.popleft
        fmt = self.writer.format
        out: list[bytes] = []
        size = lines = counted = 0  # bytes, lines, and of those the buffers' bytes (`queued_bytes`')
        kind = "access"
        while pending:
            item = pending[0]
            item_kind = item[2] if type(item) is tuple else "broker"
            if item_kind != kind or size >= _BUFFER_BYTES:
                self._write(out, kind, lines, counted)
                out = []
                size = lines = counted = 0
                kind = item_kind
            popleft()
            if type(item) is tuple:
                data, n, _ = item
                lines += n
                counted += len(data)
            else:
                lines += 1
                try:
                    line = fmt(typing.cast(logging.LogRecord, item))
                except Exception as exc:  # (a line that cannot be made: said, the writer goes on)
                    line = f"log line not written: {exc!r}"
                data = (line + "\n").encode("utf-8", "backslashreplace")
            out.append(data)
            size += len(data)
        self._write(out, kind, lines, counted)

    def _write(self, out: list[bytes], kind: str, lines: int, counted: int) -> None:
        """Write `out`, then count its `lines` and buffers' bytes (`counted`) taken: until
        written they count against the deque's bounds."""
        if out:
            lost = self.writer.write(b"".join(out))
            if lost:
                self.lost[kind] += lost
        self.taken += lines
        self.taken_bytes += counted

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the writer once it has written what is captured and queued, `timeout` s at
        most. Then the root logger writes through the writer directly (the lines of the
        process's last moments); but a writer still blocked on a stderr nobody reads is
        abandoned (a daemon thread, it ends with the process) and the deque stays,
        dropping what comes."""
        self._timer = None  # (its loop is closed by now)
        self.flush()
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


class _Sum(collections.abc.Mapping[str, int]):
    """Two counts by the same keys, read as their sums (`LogPipe.dropped_total`)."""

    def __init__(self, a: dict[str, int], b: dict[str, int]) -> None:
        self._a, self._b = a, b

    def __getitem__(self, key: str) -> int:
        return self._a[key] + self._b[key]

    def __iter__(self) -> typing.Iterator[str]:
        return iter(self._a)

    def __len__(self) -> int:
        return len(self._a)


def _lines_of(entries: list[Entry]) -> int:
    """How many lines `entries` make: one each, a chunk's results one a result."""
    return sum(1 if type(e[5]) is bytes else len(e[5]) for e in entries)


def access_to_logger(logger: logging.Logger) -> typing.Callable[[Entry], None]:
    """An `accesslog.AccessLog` emit for a process with no `LogPipe` (`server.run` called by
    an embedder): each line an INFO record of `logger`, as text (slower: a record a line)."""
    renderer = Renderer("text")

    def emit(entry: Entry) -> None:
        if logger.isEnabledFor(logging.INFO):
            for line in renderer.lines([entry]):
                logger.info("%s", line)

    return emit


def _stderr_fd() -> int:
    """A descriptor of stderr's of the writer's own (a dup: not closed with sys.stderr), or
    of /dev/null when there is no stderr (`2>&-`: the broker serves all the same, as it
    did before its lines had a writer; hostile testing, round 117)."""
    try:
        return os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        try:
            return os.dup(2)
        except OSError:
            return os.open(os.devnull, os.O_WRONLY)
