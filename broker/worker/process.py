"""The worker process: `python -m broker.worker --socket PATH --slot N --app MODULE:ATTR ...`.

`main` parses the arguments the broker gives (broker/pool.py), makes the process die
with the broker and deaf to SIGINT, loads the app (`load_app`), and runs `_serve` on
uvloop: one `WorkerProtocol` connected to the broker's socket, until the broker closes
it or says BYE. It exits 0 then, or `WORKER_BOOT_ERROR` when the app cannot be loaded
or served, which the broker reads as "stop, do not restart it in a loop".

This module is not `__main__`: broker/worker/__main__.py calls its `main`, so the
package's classes (`Registry`) are the same objects whether `-m` or an import got them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import io
import logging
import os
import signal
import socket
import sys
import time
import traceback
import types
import typing

import orjson

from broker import wire
from broker.worker import runtime
from broker.worker.forks import die_with_parent, isolate_forks
from broker.worker.links import Link
from broker.worker.results import _LEAF_OPTIONS
from broker.worker.runtime import WorkerProtocol, _child_exits
from broker.worker.sdk import Registry, load_app

# This package's directory (the files worker.py once was): a traceback's frames in its files are
# the broker's, not the app's (`_where`).
_PACKAGE = os.path.dirname(__file__)

log = logging.getLogger("broker.worker")  # (one logger for the package: its records say `broker.worker`)


WORKER_BOOT_ERROR = 3
"""Exit status of a worker that could not load or serve its app: the broker stops rather
than restart it in a loop (as gunicorn's WORKER_BOOT_ERROR)."""
STACK_MARGIN = 256  # frames the worker's recursion limit has past the front-end's (`main`)


async def _serve(args: argparse.Namespace, registry: Registry) -> int:
    loop = asyncio.get_running_loop()
    if hasattr(asyncio, "eager_task_factory"):  # 3.12+: async handlers that never
        loop.set_task_factory(asyncio.eager_task_factory)  # suspend finish inline
    try:  # orjson imports numpy at the first type it does not know (0.1 s): now, at boot, not
        orjson.dumps(object(), option=_LEAF_OPTIONS)  # in a call, whose time it would be
    except TypeError:  # (a first awaited call took 72 ms, and was learnt blocking: round 25)
        pass
    # (with several front-ends, each routes over its share of the concurrency: HELLO says it)
    share = max(1, args.concurrency // (len(args.socket) + len(args.link_fd)))
    proto = WorkerProtocol(registry, args.slot, share, args.max_depth, args.max_frame_bytes, args.debug)
    hello = proto.hello()
    if len(hello) > args.max_frame_bytes:  # the broker would refuse the frame
        log.error("app %r: its HELLO (its table of %d methods) is %d bytes, more than max_frame_bytes %d,"
                  " the largest frame the broker accepts: not serving it (raise max_frame_bytes, or"
                  " shorten the methods' docstrings)", args.app, len(registry), len(hello), args.max_frame_bytes)
        return WORKER_BOOT_ERROR
    loop.add_signal_handler(signal.SIGTERM, proto.stop)
    first, *others = args.socket
    # The other front-ends' connections (`--frontends N`: broker/worker/links.py), by path or
    # made by the broker (one end of a socketpair, inherited), numbered in that order. Known
    # before the first front-end's calls come: one sent ALONE runs alone whatever the others
    # send, and says when it starts (worker/alone.py; hostile testing, round 132: run as any
    # before the links were added, its crash read as a call that never started, and sent again)
    ends: list[str | socket.socket] = [*others, *(socket.socket(fileno=fd) for fd in args.link_fd)]
    links = [Link(proto, number, args.max_frame_bytes) for number in range(1, len(ends) + 1)]
    for link in links:
        proto.add_link(link)
    transport, _ = await loop.create_unix_connection(lambda: proto, first)
    fds = [transport.get_extra_info("socket").fileno()]
    for link, end in zip(links, ends):
        if isinstance(end, str):
            link_transport, _ = await loop.create_unix_connection(lambda link=link: link, end)  # type: ignore[misc]
        else:
            link_transport, _ = await loop.create_unix_connection(lambda link=link: link, sock=end)  # type: ignore[misc]
        fds.append(link_transport.get_extra_info("socket").fileno())
    isolate_forks(*fds)
    try:
        await proto.done
    finally:  # done, or the loop is going down (a handler stopped it: the runner cancels
        if runtime._forked_from:  # what is left) (a forked child must not tear the loop down: `_child_exits`)
            _child_exits(None)
        proto.going_down()
    return 0


def _described(exc: BaseException) -> str:
    """"Type: message", or the type alone when the message is empty, or says it cannot be
    printed (round 27: a `__str__` that raised turned the log line into a logging error)."""
    try:
        message = str(exc)
    except BaseException:
        message = "(its message cannot be printed)"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _where(exc: BaseException) -> str:
    """" at FILE:LINE" of the last frame of `exc`'s traceback outside Python's import
    machinery (the app's line that raised), or "" (a new user's check, round 26: an
    import that failed on a KeyError logged only "'MY_TOOL_TOKEN'")."""
    ours = {importlib.__file__}
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen") and f.filename not in ours and os.path.dirname(f.filename) != _PACKAGE]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def load_registry(app: str, debug: bool) -> Registry | None:
    """The Registry of `app` ("module:attribute"), imported as a worker does (from the
    current directory and PYTHONPATH); None after logging why it cannot be served: an
    exception or sys.exit() at its import (a method refused at registration among them),
    or more methods than a worker can name (`wire.MAX_METHODS`). `debug`: the traceback too.
    Used by the workers and by `rpc-broker check-app` (broker/worker/check.py)."""
    try:
        registry = load_app(app)
    except SystemExit as exc:  # the app called sys.exit() at import: a boot failure too
        log.error("cannot load app %r: it called sys.exit(%r) at import", app, exc.code)
        return None
    except BaseException as exc:
        hint = ""
        module = app.partition(":")[0]
        if isinstance(exc, ModuleNotFoundError) and module.endswith(".py"):  # (round 31, a new user)
            hint = f" (--app names a module, not a file: {module[:-3]}:{app.partition(':')[2]})"
        elif isinstance(exc, ModuleNotFoundError) and exc.name and module.startswith(exc.name.partition(".")[0]):
            path = os.environ.get("PYTHONPATH", "")
            hint = (f" (the module is looked up from the current directory, {os.getcwd()}, and PYTHONPATH, "
                    + (f"{path!r}" if path else "unset")
                    + ": run from the directory that holds it, or set PYTHONPATH=DIR)")
        log.error("cannot load app %r: %s%s%s%s", app, _described(exc), _where(exc), hint,
                  "" if debug else " (serve --debug or check-app --debug prints the traceback)", exc_info=debug)
        return None
    if len(registry) > wire.MAX_METHODS:  # a batch could not name the ones past it
        log.error("app %r has %d methods, more than the %d one worker can serve (a batch names"
                  " a method by a 16-bit index): not serving it", app, len(registry), wire.MAX_METHODS)
        return None
    return registry


def boot_error_path(socket_path: str, pid: int) -> str:
    """Where worker `pid`, whose broker listens at `socket_path`, leaves the line that says
    why it cannot load its app, before it exits `WORKER_BOOT_ERROR`: in the broker's private
    socket directory, for the broker to read and remove (`reloads.boot_error`: a failed
    reload's reason, in the status file that `rpc-broker reload` reads)."""
    return os.path.join(os.path.dirname(socket_path), f"boot-error-{pid}")


class _LastError(logging.Handler):
    """Keeps the last ERROR line logged while the app loads (`main`)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.message = record.getMessage()
        except Exception:  # (a message that cannot be formatted: nothing kept)
            pass

    def leave(self, path: str) -> None:
        """Write the line kept to `path` (at most 4 KiB; nothing if it cannot be written)."""
        try:
            with open(path, "w", encoding="utf-8", errors="replace") as f:
                f.write(self.message[:4096])
        except OSError:
            pass


def _deaf(signum: int, frame: types.FrameType | None) -> None:
    """The worker's SIGINT handler: nothing (see `main`)."""


class _RecordLines(logging.Formatter):
    """A record's further lines (a traceback's; a newline in its message, which may be a
    client's text in an exception's) indented: only a record's first line starts as this
    worker's lines do, with its time and `worker[N] pid PID`, so the broker, which reads
    them, shows the others as the worker's (`logpipe.LogPipe._worker_lines`) and none passes
    for a record of its own (hostile testing, round 119)."""

    converter = time.gmtime  # type: ignore[assignment]  # (UTC, as the broker's lines and the access lines)

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", "\n    ")


def _log_stream(fd: int) -> typing.TextIO:
    """The log lines' stream on inherited descriptor `fd`: line-buffered UTF-8 text (a line
    at once, as stderr writes them), not closed at exec (its handlers' children do not hold it)."""
    os.set_inheritable(fd, False)
    return open(fd, "w", encoding="utf-8", errors="backslashreplace", buffering=1)


def main(argv: list[str] | None = None) -> int:
    """Worker process entry point: `python -m broker.worker --socket PATH --slot N ...`.

    Started by the broker, not by hand. Exits 0 when the broker closes the
    connection or says BYE (SIGTERM asks it to: `WorkerProtocol.stop`), `WORKER_BOOT_ERROR` when the app cannot be loaded (an
    exception or sys.exit() at import) or cannot be served (more than `wire.MAX_METHODS`
    methods, or a HELLO larger than max_frame_bytes), and dies (SIGKILL) with the broker.
    """
    parser = argparse.ArgumentParser(prog="python -m broker.worker")
    parser.add_argument("--socket", required=True, action="append",
                        help="the front-end's workers socket; again for each other front-end's")
    parser.add_argument("--link-fd", type=int, action="append", default=[],
                        help="an inherited connected Unix socket to another front-end (again for each)")
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--app", required=True)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--max-depth", type=int, default=64)
    parser.add_argument("--max-frame-bytes", type=int, default=wire.MAX_FRAME_BYTES)
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--log-fd", type=int, default=-1, help="an inherited pipe for the log lines (default: stderr)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--parent-pid", type=int, default=0,
                        help="the broker's pid: this process dies with it (default: the parent now)")
    args = parser.parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):  # (a pipe's stdout is block-buffered: a handler's print
        sys.stdout.reconfigure(line_buffering=True)  # would come out at the worker's exit, not now)
    # (--log-fd: a pipe of its own, the broker's; a handler's print goes to stdout and stderr,
    # another pipe, so that no print of a client's text passes for a log line: round 131)
    handler = logging.StreamHandler(_log_stream(args.log_fd) if args.log_fd >= 0 else None)
    handler.setFormatter(_RecordLines(f"%(asctime)s worker[{args.slot}] pid %(process)d %(levelname)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    # The broker decides when we stop: SIGINT (a Ctrl-C to the terminal's process group)
    # is caught and does nothing. Not SIG_IGN, which exec keeps: the subprocesses that
    # handlers start would ignore SIGINT too; exec resets a caught signal to the default.
    signal.signal(signal.SIGINT, _deaf)
    die_with_parent(args.parent_pid or os.getppid())
    # The front-end passes params nested up to its parser's limit (the recursion limit, at
    # its shallow stack); here the loop's, dispatch's and encoding's frames sit below them,
    # and msgspec, which counts Python's recursion limit, failed on params a few levels
    # short of it (hostile testing, round 26: echo of params 983 deep, -32603 "not valid JSON").
    sys.setrecursionlimit(sys.getrecursionlimit() + STACK_MARGIN)
    said = _LastError()
    logging.getLogger().addHandler(said)
    registry = load_registry(args.app, args.debug)
    logging.getLogger().removeHandler(said)
    if registry is None:
        said.leave(boot_error_path(args.socket[0], os.getpid()))
        return WORKER_BOOT_ERROR
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_serve(args, registry))
    return uvloop.run(_serve(args, registry))
