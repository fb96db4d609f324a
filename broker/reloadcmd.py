"""`rpc-broker reload`: send a running broker SIGHUP and wait for that reload's outcome, for systemd's ExecReload.

It reads the broker's status file (`status_file`, broker/statusfile.py, whose docstring
says how a reload is matched to the SIGHUP that asked for it), checks that the file is
the running broker's (its pid alive, and the same process: its start time), sends
SIGHUP, and polls the file until a reload that began after it took that SIGHUP ends.
It prints the outcome and exits with one of the codes below; failures say why on stderr.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from broker.statusfile import Status, process_start, read_status

__all__ = ["EXIT_FAILED", "EXIT_NO_BROKER", "EXIT_OK", "EXIT_TIMEOUT", "EXIT_USAGE", "POLL_SECONDS", "reload"]

EXIT_OK = 0  # the new workers took over
EXIT_FAILED = 1  # the reload failed: the old workers serve on (the reason on stderr)
EXIT_USAGE = 2  # bad usage or configuration (no status file set), as every command's
EXIT_TIMEOUT = 4  # no outcome within --timeout: the reload may still be running (or not have begun)
EXIT_NO_BROKER = 5  # no broker to reload: not running, another process, not allowed, or stopping
POLL_SECONDS = 0.05  # how often the status file is read while waiting

PROG = "rpc-broker reload"


class _NoBroker(Exception):
    """What makes the reload impossible (its message says why)."""


PID_MAX = 4194304  # the largest process id Linux gives (pid_max's bound, 2**22)


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's too: EPERM)."""
    try:
        os.kill(pid, 0)
    except PermissionError:
        pass
    except ProcessLookupError:
        return False
    return True


def _read(path: str, pid: int | None) -> Status:
    """The status at `path`, checked to be that of the live broker `pid` (None: the one the
    file names). Raises `_NoBroker` saying what is wrong."""
    try:
        status = read_status(path)
    except FileNotFoundError:
        where = f"pid {pid} runs, but " if pid is not None and _alive(pid) else "no broker running? "
        raise _NoBroker(f"{where}no status file {path} (is it a broker with status_file = {path!r}?"
                        " a broker writes it as it starts)") from None
    except PermissionError as exc:
        raise _NoBroker(f"cannot read the status file: {exc} (run as the broker's user, or root)") from None
    except (OSError, ValueError) as exc:
        raise _NoBroker(f"cannot read the status file: {exc}") from None
    if not 0 < status.pid <= PID_MAX:  # (round 116, L2: a huge one was an OverflowError's traceback)
        raise _NoBroker(f"the status file {path} names no process id ({status.pid}): not a broker's")
    if pid is not None and status.pid != pid:
        why = "which is not running (a stale file)" if not _alive(status.pid) else "another broker"
        raise _NoBroker(f"the status file {path} is pid {status.pid}'s, {why}, not pid {pid}'s: pid {pid}"
                        " is not a broker writing it (a broker that has not started yet, or another status_file)")
    if status.state == "stopped":  # (before its pid is looked at: another process may have it now)
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(status.time))
        raise _NoBroker(f"the broker is not running: pid {status.pid} stopped at {when} (its status file {path}"
                        " says so): nothing to reload (a start imports the code on disk)")
    if not _alive(status.pid):
        raise _NoBroker(f"the broker is not running: the status file {path} is from pid {status.pid},"
                        " which has exited (a stale file)")
    try:
        start = process_start(status.pid)
    except ProcessLookupError:
        raise _NoBroker(f"the broker is not running: pid {status.pid} has exited") from None
    if start and status.process_start and start != status.process_start:
        raise _NoBroker(f"the broker is not running: the status file {path} is from an earlier process"
                        f" {status.pid} (that pid is another process now: a stale file)")
    problem = _not_its_broker(path, status.pid)
    if problem:
        raise _NoBroker(f"pid {status.pid}, which the status file {path} names, {problem}: not signalled")
    return status


def _not_its_broker(path: str, pid: int) -> str:
    """Why process `pid` is not the broker that writes the status file at `path`, or "":
    it must run `rpc-broker serve` (its command line, /proc/PID/cmdline) as the user who
    owns the file. Hostile testing, round 116, H1: the file's pid and start time (anyone
    may read /proc/PID/stat) were all that was checked, and whoever could write the file's
    directory, the app's own code among them, had `reload` (run as root) send SIGHUP, whose
    default is to end a process, to any process of the machine."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(65536).split(b"\0")
        with open(f"/proc/{pid}/status", "rb") as f:
            uid = next(int(line.split()[1]) for line in f if line.startswith(b"Uid:"))
        owner = os.stat(path).st_uid
    except (OSError, StopIteration, ValueError, IndexError):
        return "cannot be checked (no /proc?)"
    serving = b"serve" in argv and any(a.endswith(b"rpc-broker") or a == b"broker" for a in argv)
    if not serving:
        return "is no rpc-broker serve process"
    if uid != owner:
        return f"runs as uid {uid}, not as the file's owner (uid {owner})"
    return ""


def reload(path: str, pid: int | None = None, timeout: float = 75.0) -> int:
    """Reload the broker whose status file is `path` (checked to be pid `pid`'s when given,
    as systemd's $MAINPID) and wait up to `timeout` seconds for the outcome. Returns an
    exit code: `EXIT_OK`, `EXIT_FAILED`, `EXIT_TIMEOUT` or `EXIT_NO_BROKER` (their
    comments say when); prints the outcome (stdout) or the reason (stderr)."""
    try:
        before = _read(path, pid)
    except _NoBroker as exc:
        _say(str(exc))
        return EXIT_NO_BROKER
    pid = before.pid
    if before.state == "stopping":
        _say(f"broker pid {pid} is stopping: no reload")
        return EXIT_NO_BROKER
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        _say(f"the broker is not running: pid {pid} has exited")
        return EXIT_NO_BROKER
    except PermissionError as exc:
        _say(f"not allowed to signal broker pid {pid}: {exc} (run as the broker's user, or root)")
        return EXIT_NO_BROKER
    deadline = time.monotonic() + timeout
    status = before
    while True:
        try:
            status = _read(path, pid)
        except _NoBroker as exc:
            _say(f"broker pid {pid} went away before the reload ended: {exc}")
            return EXIT_NO_BROKER
        if status.covers > before.sighups and status.outcome in ("ok", "failed"):
            break
        if status.state == "stopping":
            _say(f"broker pid {pid} is stopping: the reload asked for does not run (or was cut short)")
            return EXIT_NO_BROKER
        if time.monotonic() >= deadline:
            taken = status.sighups > before.sighups
            what = ("its reload is still running" if status.covers > before.sighups else
                    "its reload has not begun (one under way, or the start, comes first)" if taken else
                    "the broker has not taken the SIGHUP")
            _say(f"no outcome within {timeout:g} s from broker pid {pid}: {what}; its log says more"
                 " (raise --timeout, and systemd's TimeoutStartSec, past boot_timeout)")
            return EXIT_TIMEOUT
        time.sleep(POLL_SECONDS)
    if status.outcome == "ok":
        print(f"{PROG}: broker pid {pid}: reloaded (reload {status.reloads}): the new workers took over", flush=True)
        return EXIT_OK
    _say(f"broker pid {pid}: reload {status.reloads} failed: {status.message}; the old workers serve on")
    return EXIT_FAILED
