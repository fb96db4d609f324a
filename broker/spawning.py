"""Worker processes as the pool makes and ends them: each one's command line and the descriptors it inherits, its creation, its kill, and the words for how it ended.

broker/pool.py decides when a slot's worker starts, and what its exit means (a restart, a
backoff, a failed start); this module does what that takes of the operating system:
`worker_command` (the arguments broker/worker/process.py parses), `spawn` (a fresh
interpreter, never a fork of the running loop, with its links to the other front-ends
and its output pipe), `kill` (SIGKILL: the broker never sends SIGTERM, which a worker
reads as "recycle me"), `describe_status` and `boot_error` (why it exited).
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import sys
import typing

from broker.worker.process import boot_error_path

if typing.TYPE_CHECKING:
    from broker.peers import Peers

__all__ = ["SPAWN_DESCRIPTORS", "boot_error", "describe_status", "kill", "kill_if_alive", "spawn", "worker_command"]

SPAWN_DESCRIPTORS = 16  # descriptors a process creation needs free (its pipes, /dev/null, the exec's error pipe)


def worker_command(
    socket_path: str, slot: int, *, app: str, concurrency: int, max_depth: int, max_frame_bytes: int,
    log_level: str, debug: bool,
) -> list[str]:
    """The command line of slot `slot`'s worker: `python -m broker.worker` with the
    arguments broker/worker/process.py parses (its `--parent-pid` this process's: the
    worker dies with it). `spawn` adds a `--link-fd` per other front-end."""
    argv = [
        sys.executable, "-m", "broker.worker",
        "--socket", socket_path,
        "--slot", str(slot),
        "--app", app,
        "--concurrency", str(concurrency),
        "--max-depth", str(max_depth),
        "--max-frame-bytes", str(max_frame_bytes),
        "--log-level", log_level,
        "--parent-pid", str(os.getpid()),
    ]  # fmt: skip
    if debug:
        argv.append("--debug")
    return argv


async def spawn(
    argv: list[str], peers: Peers | None, output: bool,
) -> tuple[asyncio.subprocess.Process, tuple[int, int] | None, list[int]]:
    """Start a worker process running `argv` (`worker_command`): stdin /dev/null, a
    session of its own. With `peers` (--frontends N), it is given its connection to each
    other front-end, a socketpair's end (`--link-fd`: broker/peers.py). With `output`, its
    stdout and stderr are one pipe, and its logging another (`--log-fd`), whose read ends
    are returned for the broker to read (`logpipe.LogPipe.follow`); without, they are the
    broker's.

    Returns (the process, the read ends of its output pipe and of its logging's pipe or None, the broker's ends of
    its links, for `Peers.joined`). Raises `OSError` when the system is short of
    something now (EMFILE, EAGAIN, ENOMEM), fewer than SPAWN_DESCRIPTORS descriptors left
    included."""
    links: list[int] = []
    ends: list[int] = []
    if _descriptors_left() < SPAWN_DESCRIPTORS + 2 * (peers.count if peers is not None else 0):
        # (uvloop's process creation, failing with EMFILE part-way, leaks 4 descriptors
        # each time: hostile testing saw them ratchet up; not tried then)
        raise OSError(errno.EMFILE, f"fewer than {SPAWN_DESCRIPTORS} file descriptors left")
    if peers is not None:
        links, ends = peers.link_ends()
        for fd in links:
            argv += ["--link-fd", str(fd)]
    # A worker's stderr, and its stdout (a handler's print), is a pipe the broker reads
    # (`Pool.worker_stderr`) and writes on with its own lines, never blocking: a stderr nobody
    # reads (a stuck journald socket, a full pipe) stalls no worker, and no call routed
    # to one (hostile testing, round 118: workers logging to a socket the access lines
    # filled stalled 10 s); nor does a stdout nobody reads.
    # Its logging writes to a pipe of its own (`--log-fd`), so that only its log lines read as
    # its log lines: a handler's print of a client's text in their form is marked a print
    # (hostile testing, round 131).
    stderr = logs = None
    try:
        stderr = os.pipe2(os.O_CLOEXEC) if output else None
        logs = os.pipe2(os.O_CLOEXEC) if output else None
    except OSError:  # (EMFILE: what was made so far closed, not leaked)
        for fd in (*(stderr or ()), *links, *ends):
            os.close(fd)
        raise
    out = stderr[1] if stderr else None
    if logs:
        argv += ["--log-fd", str(logs[1])]
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            pass_fds=[*links, *logs[1:]] if logs else links,
        )
    except BaseException:
        for pipe in (stderr, logs):
            if pipe:
                os.close(pipe[0])
        for fd in ends:
            os.close(fd)
        raise
    finally:
        for pipe in (stderr, logs):
            if pipe:
                os.close(pipe[1])
        for fd in links:
            os.close(fd)
    return process, (stderr[0], logs[0]) if stderr and logs else None, ends


def _descriptors_left() -> int:
    """File descriptors this process may still open: RLIMIT_NOFILE's soft limit less those
    open (/proc/self/fd; a large number where it cannot be read). O(open descriptors):
    once per process creation."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return 1 << 30
    return (1 << 30) if soft == resource.RLIM_INFINITY else soft - used


def kill(process: asyncio.subprocess.Process) -> None:
    """SIGKILL `process`; nothing if it is gone already."""
    try:
        process.kill()
    except ProcessLookupError:
        pass


def kill_if_alive(process: asyncio.subprocess.Process) -> None:
    """`kill` `process` unless its exit was reaped already."""
    if process.returncode is None:
        kill(process)


def describe_status(status: int) -> str:
    """Human words for a process exit status ("exited with 1", "killed by SIGKILL")."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with {status}"


def boot_error(socket_path: str, pid: int | None) -> str:
    """The line worker `pid` left to say why it could not load its app
    (`broker.worker.process.boot_error_path`), removed once read; "" if none."""
    if pid is None:
        return ""
    path = boot_error_path(socket_path, pid)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            said = f.read(4096).strip()
        os.unlink(path)
    except OSError:
        return ""
    return said
