"""Restarts: how soon a worker's slot is started again after its process exits, the reason that restart is counted under, and how soon the dispatcher may expect a worker back (`Restarts`).

`pool.Pool` inherits these methods (a mixin with no state of its own: the attributes it
reads are the pool's, declared in broker/pool_state.py for the type checker); `Pool._watch`
reaps each exit and acts on what they say. A slot is restarted after an exponential
backoff (`_backoff`: 0.1 s doubling up to `restart_backoff_max`) only while its processes
die having served nothing (`_failures_after`: an import that fails); a worker that took
calls, or stayed up STABLE_SECONDS, is restarted at once, but no sooner than
RESTART_EVERY_SECONDS after its last start (`_at_once`). Each restart is counted under a
bounded reason (`restart_reason`, `_count_restart`: the label of
rpc_broker_worker_restarts_total). The dispatcher asks `_worker_back_in` and
`_worker_restarting` whether calls should wait for a worker rather than be answered
-32003.
"""

from __future__ import annotations

import math
import time
import typing

from broker.channel import WorkerState
from broker.membership import RESTART_WAIT_SECONDS
from broker.pool_state import PoolState

if typing.TYPE_CHECKING:
    from broker.channel import Worker

__all__ = ["RESTART_EVERY_SECONDS", "STABLE_SECONDS", "Restarts", "restart_reason"]

STABLE_SECONDS = 30.0  # a worker up this long resets its slot's backoff
# A slot restarted with no backoff (its process took calls, or was killed as hung) is restarted
# no sooner than this after its last start: one client whose every call crashes its worker
# otherwise had every slot restarting back to back, each start a process and an import, over
# a core of CPU for a call at a time (hostile testing, round 77: 63 restarts in 10 s).
RESTART_EVERY_SECONDS = 1.0


class Restarts(PoolState):
    """`pool.Pool`'s restart policy (see the module docstring).

    (A mixin with no state of its own: what it reads of the pool's is declared in
    `pool_state.PoolState`.)
    """

    def _worker_coming(self) -> bool:
        """Is a worker on its way to READY? One starting (a leave's replacement is from
        the leave on, `worker_leaving`), or one that asked to leave during a reload and
        drains in its slot: it is restarted at once when it exits 0, so calls wait for
        it in the queue. That counts from its BYE to its restart, also once its socket
        has closed (DEAD, `channel_lost`) and while its exit is being reaped; or a slot
        that waits for the reload under way (`_awaiting_reload`: its new worker takes
        the slot at the swap, and if the reload fails the slot is restarted then).
        (Retiring workers, a reload's or those a leave replaced, are not in `workers`.)"""
        return bool(self._awaiting_reload) or any(w.state is WorkerState.STARTING or w.leaving for w in self.workers)

    def _worker_back_in(self) -> float:
        """Seconds until a worker is on its way to READY: 0 if one is (`_worker_coming`),
        else until the first restart backoff ends (it starts then, and takes the calls that
        waited for it: hostile testing, round 73, a worker killed within 30 s of its start
        had every other client's queued call answered -32003 for a 0.1 s backoff);
        `math.inf` if no restart is coming (a slot that stays down)."""
        if self._worker_coming():
            return 0.0
        backs = [w.restart_at for w in self.workers if w.restart_at]
        return max(0.0, min(backs) - time.monotonic()) if backs else math.inf

    def _worker_restarting(self) -> bool:
        """Is a worker on its way back to READY: starting, or to start within
        RESTART_WAIT_SECONDS (`_worker_back_in`)? O(slots)."""
        return self._worker_back_in() <= RESTART_WAIT_SECONDS

    def _failures_after(self, worker: Worker) -> int:
        """The failures in a row `worker`'s slot counts once its process exited unasked:
        none if it was up STABLE_SECONDS or took a call (the app boots and serves: a call
        may have crashed it, at once or later, and each such exit costs its own restart,
        at once; hostile testing, rounds 75 and 76: one client whose calls made the worker
        exit, during the call or just after its answer, doubled the backoff as an import
        crash loop does, and every other client's calls were answered -32003 nearly all
        the time); else one more (a process that dies having served nothing: an import
        that fails, an app's own thread that exits at once)."""
        if worker.took_calls or time.monotonic() - worker.started_at >= STABLE_SECONDS:
            return 0
        return worker.failures + 1

    def _restart_delay(self, worker: Worker, failures: int) -> float:
        """Seconds before `worker`'s slot restarts after an exit that leaves it `failures`
        failures in a row: the backoff, or with none, `_at_once`."""
        return self._backoff(failures) if failures else self._at_once(worker)

    def _at_once(self, worker: Worker) -> float:
        """Seconds before a restart with no backoff: none once `worker`'s process has been
        up RESTART_EVERY_SECONDS, else the rest of that time."""
        return max(0.0, RESTART_EVERY_SECONDS - (time.monotonic() - worker.started_at))

    def _backoff(self, failures: int) -> float:
        """Seconds before a slot with `failures` failures in a row is restarted: 0 for
        none, else 0.1 s doubling per failure, at most `restart_backoff_max`."""
        return min(self.restart_backoff_max, 0.1 * 2 ** (failures - 1)) if failures > 0 else 0.0

    def _count_restart(self, why: str) -> None:
        """Count one restart of a worker's slot, under the bounded reason `why` (the
        metric's label): once per process that exits or is replaced."""
        self.restarts_by_reason[why] = self.restarts_by_reason.get(why, 0) + 1


def restart_reason(status: int, kill_reason: str, left: bool = False) -> str:
    """The bounded `reason` label of a restart: "hung" or "boot_timeout" when the broker
    killed the worker for that, "left" when it left as asked (`left`: SIGTERM, after its
    BYE, or before its HELLO, `Pool._watch`), "killed" by another signal, else "exited".
    (A worker refused because the code changed on disk is counted "code_changed" by the
    pool, and a leave whose new worker starts at once "left" by `Pool.worker_leaving`.)"""
    if kill_reason.startswith("hung"):
        return "hung"
    if kill_reason.startswith("boot timeout"):
        return "boot_timeout"
    if left:
        return "left"
    return "killed" if status < 0 else "exited"
