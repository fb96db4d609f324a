"""The status file: what a running broker publishes of itself and of its reloads, for `rpc-broker reload`.

Theory of operation
-------------------
With `status_file` set, the daemon keeps one small JSON document there (`Status`),
replaced whole on each change (written beside it, then renamed over it: a reader sees
the old document or the new one, never half of one). No socket, no new way in: the file
is the broker's user's (mode 0644, in a directory the operator chooses, systemd's
RuntimeDirectory for the shipped unit).

Which reload answers which SIGHUP. Reloads coalesce (`Pool.request_reload`): a SIGHUP
during a reload makes one more after it, and many make one. So the daemon counts the
SIGHUPs it took (`sighups`), and each reload, as it begins, notes that count (`covers`):
every SIGHUP taken before a reload began is answered by that reload, which imports the
code on disk then. `rpc-broker reload` reads `sighups` (n), sends its SIGHUP, and waits
for a finished reload with `covers` > n: it began after the daemon took a SIGHUP it had
not taken when the command looked, so after the command decided to reload. An earlier
reload's outcome (`covers` <= n) is never taken for its own.

Whose file. A file left by a broker that is gone, or by another broker, names another
process: `pid` with `process_start` (the kernel's start time of that pid, /proc's
field 22) tell a live broker from a reused pid. A broker starting on the same path as
one that runs (a handover with reuse_port) takes the file over; the old one then writes
it no more (`StatusFile.write` checks it is still its own).
"""

from __future__ import annotations

import logging
import os
import stat
import time
import typing

import msgspec

__all__ = ["Status", "StatusFile", "process_start", "read_status"]

log = logging.getLogger("broker")

State = typing.Literal["starting", "serving", "stopping", "stopped"]
Outcome = typing.Literal["none", "running", "ok", "failed"]


class Status(msgspec.Struct, kw_only=True):
    """The status file's document.

    pid, process_start: the broker's process id and its start time in clock ticks since
    boot (`process_start`; 0 where /proc is not readable). state: "starting" (the workers
    import the app), "serving", "stopping" (a stop signal came: SIGHUP is ignored),
    "stopped" (the broker has exited, cleanly or after a failed start: written as it
    ends; one killed, by SIGKILL or a crash, leaves its last state, and its pid gone tells).
    sighups: SIGHUPs the broker took (not those ignored while stopping). reloads: reloads
    begun (the generation). covers: `sighups` when the last reload began. outcome: "none"
    before any reload, "running" while one runs, then "ok" or "failed"; message: why it
    failed ("" otherwise). time: wall-clock seconds (Unix time) of this version.
    """

    pid: int
    process_start: int = 0
    state: State = "starting"
    sighups: int = 0
    reloads: int = 0
    covers: int = 0
    outcome: Outcome = "none"
    message: str = ""
    time: float = 0.0


def process_start(pid: int) -> int:
    """The start time of process `pid`, in clock ticks since boot (proc(5), /proc/PID/stat
    field 22); 0 when it cannot be read (no /proc, or another system). Raises
    ProcessLookupError when /proc has no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise ProcessLookupError(pid) from None
        return 0
    except OSError:
        return 0
    try:  # (the command name, field 2, may hold spaces and parentheses: split after its last ')')
        return int(stat.rpartition(b")")[2].split()[19])
    except (IndexError, ValueError):
        return 0


_decoder = msgspec.json.Decoder(Status)


def read_status(path: str) -> Status:
    """Read the status file at `path`: a regular file, opened without blocking and without
    following a symbolic link (hostile testing, round 116, H2: a FIFO put there blocked the
    broker's event loop at its next update, and `rpc-broker reload` for good). Raises
    OSError (FileNotFoundError, PermissionError, ELOOP...) when it cannot be read, and
    ValueError when it is no status document, or no regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file: not a status file of rpc-broker")
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path} is not a status file of rpc-broker: {exc}") from None


class StatusFile:
    """The daemon's side: `Status` kept at `path` ("" for none: every method then does
    nothing), replaced atomically at each `update`.

    A write that fails (a full disk, the directory gone) is logged as a WARNING, once per
    kind of error, and the broker serves on: the file informs, it never stops a broker.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        pid = os.getpid()
        try:
            start = process_start(pid)
        except ProcessLookupError:
            start = 0
        self.status = Status(pid=pid, process_start=start)
        self._taken_over = False
        self._written = False  # (the first write takes the file, whoever's it was)
        self._failed: set[str] = set()

    def update(self, **changes: typing.Any) -> None:
        """Set `changes` (fields of `Status`) and write the document, if it is still this
        broker's (once another broker has written its own there, this one stops writing)."""
        for name, value in changes.items():
            setattr(self.status, name, value)
        self.status.time = time.time()
        if not self.path or self._taken_over:
            return
        if self._written:
            try:
                other = read_status(self.path).pid
            except (OSError, ValueError):
                other = self.status.pid
            if other != self.status.pid:
                self._taken_over = True
                log.info("status file %s: pid %d writes it now; this broker no longer does", self.path, other)
                return
        else:
            self._say_whose()
        self._written = True
        self._write(msgspec.json.encode(self.status) + b"\n")

    def _say_whose(self) -> None:
        """Before the first write: a WARNING if the file is a running broker's, which this one
        takes over (new user, round 109: a second broker given the same file by mistake took it
        without a word, and `rpc-broker reload` could not follow the first any more). Expected
        in a reuse_port handover, which the line says."""
        try:
            other = read_status(self.path)
        except (OSError, ValueError):
            return
        if other.pid == self.status.pid or other.state == "stopped":
            return
        try:
            start = process_start(other.pid)
        except ProcessLookupError:
            return  # (a stale file: its broker gone)
        if start and other.process_start and start != other.process_start:
            return  # (its pid reused by another process)
        log.warning("status file %s was pid %d's, a broker still running: this broker takes it over, and "
                    "`rpc-broker reload` follows this one from now on (as a reuse_port handover does; if not "
                    "meant, give each broker a status_file of its own)", self.path, other.pid)

    def stopped(self) -> None:
        """The broker ends: write state "stopped" (new user, round 108: the file said
        "stopping" after the broker had exited), if the file is this broker's: one that
        ends before it first wrote it (a start refused early) leaves it to whoever wrote
        it, perhaps the broker it was to take over from."""
        if self._written:
            self.update(state="stopped")

    def _write(self, data: bytes) -> None:
        tmp = f"{self.path}.{self.status.pid}.tmp"
        try:
            # (a new file of its own: O_EXCL, so a symbolic link put there is never followed to
            # overwrite its target; round 116, M4. One left by a crash is removed first.)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            kind = type(exc).__name__
            if kind not in self._failed:
                self._failed.add(kind)
                log.warning("status file %s cannot be written (%s): `rpc-broker reload` cannot follow this"
                            " broker's reloads", self.path, exc)
