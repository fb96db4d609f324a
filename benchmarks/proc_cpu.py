"""CPU time of a server's processes and of the load tool over one run, from /proc and getrusage.

On a 2-core machine shared with the load generator, CPU per call is steadier than throughput,
and the load tool's own share says how much of the cores the server had (issue 14).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from pathlib import Path
from types import TracebackType

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by `pids` (from /proc/PID/stat, fields 14 and 15).
    Raises OSError for a process that is gone."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


def children(pid: int) -> list[int]:
    """The PIDs of `pid`'s child processes (its first thread's, /proc/PID/task/PID/children:
    the broker's workers, a prototype's); [] when it has none or is gone."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _each(pids: list[int]) -> dict[int, float]:
    found = {}
    for pid in pids:
        try:
            found[pid] = cpu_seconds([pid])
        except OSError:  # (a worker replaced during the run: only those at both ends count)
            pass
    return found


def _is_peer(pid: int) -> bool:
    """Is `pid` a broker's front-end past the first (`python -m broker.peer`)?"""
    try:
        return b"broker.peer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@dataclasses.dataclass
class Cpu:
    """CPU seconds spent while one load tool ran against one server."""

    main: float  # the server's own process (the broker's front-end, and its other front-ends: --frontends N)
    children: float | None  # its child processes (the broker's workers) alive at both ends; None: it had none
    load: float  # the load tool and the children it waited for (getrusage RUSAGE_CHILDREN)
    wall: float  # the load tool's wall-clock seconds, start-up included
    calls: float = 0.0  # the calls answered over the whole run (warm-up too), set by the caller

    def per_call(self, seconds: float | None) -> float | None:
        """µs of `seconds` of CPU per call answered; None before `calls` is known (or for None)."""
        return seconds / self.calls * 1e6 if self.calls > 0 and seconds is not None else None


class CpuWatch:
    """`with CpuWatch(pid) as w: subprocess.run(load tool)`, then `w.cpu`. The runner must
    reap no other child meanwhile: the load tool's CPU is this process's RUSAGE_CHILDREN delta,
    read after subprocess.run has waited for it."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.cpu: Cpu | None = None

    def __enter__(self) -> CpuWatch:
        kids = children(self.pid) if self.pid else []
        peers = [k for k in kids if _is_peer(k)]  # (the broker's other front-ends count as its front-end)
        self._mains = ([self.pid] if self.pid else []) + peers
        self._kids = [k for k in kids if k not in peers]
        self._before = _each(self._mains), _each(self._kids)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._load = usage.ru_utime + usage.ru_stime
        self._t0 = time.monotonic()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        wall = time.monotonic() - self._t0
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        main, kids = _each(self._mains), _each(self._kids)
        self.cpu = Cpu(sum(v - self._before[0][p] for p, v in main.items() if p in self._before[0]),
                       sum(v - self._before[1][p] for p, v in kids.items() if p in self._before[1])
                       if self._kids else None,
                       usage.ru_utime + usage.ru_stime - self._load, wall)
