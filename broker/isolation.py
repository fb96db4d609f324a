"""Isolation: which methods' calls run alone on a worker, after a worker died under them.

A worker that crashes (a handler calling `os._exit`, a segfault, the OOM killer) or is
killed as hung takes with it every call it held, and the broker cannot tell which of them
had started: they are all answered -32002 "worker died". Most were other clients' calls
that happened to share the worker with the one that killed it (hostile testing, round 78:
a third to a half of an innocent client's calls, never run, died beside a client whose
every call crashed its worker). So the dispatcher routes the calls of a method under
suspicion *alone*: each to a worker holding nothing else, which takes nothing else until
it answers, and no more such workers at once than one connection's share of them
(`Dispatcher._pick_alone`). A call running alone that kills its worker takes only itself.
A method caught (its call the only one in a worker that died) or struck twice `waits` for
such a worker; one with a single strike from a death shared with other methods' calls (a
bystander, mostly) runs alone only where a worker is free for it, and as any call otherwise:
waiting, a bystander's calls, long ones above all, held every worker and every other call
(round 84).

Every method with a call in a worker when it died (for a worker killed as hung: with a
call past its deadline there) takes a *strike*, and its calls run alone until 2**(strikes
- 1) of them have answered (run, their worker living on): 1 after a first strike, 2 after
a second, 4, 8..., or until ALONE_SECONDS times that has passed since its last strike (4 s,
8 s, 16 s at most: longer than a worker's restart), whichever comes first. A crash that comes after its call answered (a thread of the
handler's) is blamed on whatever the worker holds then, which cannot be helped (round 79):
the time bound is what keeps that from costing an innocent method long, a slow one above all
(round 80: a framed `sleep(9)` owed 8 answers, one a worker at a time, and its clients timed
out for 35 s). A bystander, whose calls answer, is free again after a few; a method that
crashes on every call never is; one that crashes for some params only, between good calls
(round 79's new user: each crash beside other calls, cleared by the next good call, 68
bystanders dead in 15 s), must send twice as many good calls for each crash that is not
alone, or wait out its time bound: it takes calls beside it once every 16 s at most, not at
every crash (round 81: one pacing its crashes so still kills the calls beside each). Nor
can a crash from a thread after its call answered be told apart: kept up every few seconds,
it keeps whatever method it catches running alone (round 81). Strikes are forgotten
STRIKE_DECAY_SECONDS after a method's last one; a reload (new code) forgets everything.

With several front-ends (`serve --frontends N`) each keeps its own strikes, from the deaths
its own calls saw, but "alone" is the worker's: a call the dispatcher runs alone is sent
`wire.ALONE`, and the worker holds every other front-end while it runs (wire.HOLD: they route
nothing new to it, and their calls waiting there come back unstarted for another worker,
broker/worker/alone.py). A front-end whose calls were given back so has none in the worker
when it dies, and blames nothing (hostile testing, round 130: a call run alone shared its
worker with another front-end's calls, which died with it, -32002). Calls two front-ends send
alone to one worker take turns there, and the worker says when each starts (wire.STARTS): one
it dies before never ran, and goes again rather than take a strike (round 132).

This is a circuit breaker in the sense of Nygard's *Release It!* (2007), ch. 5, with the
broker's only trustworthy signal of a failure, a worker's death, "half open" meaning "one
call at a time, alone", and the exponential backoff of the strikes in place of a timer.

With several front-ends (`serve --frontends N`) each keeps its own `Isolation`, but a
front-end that sees a worker die tells the others the methods it struck (peerwire.Struck), and
they strike them too (`Membership.struck`): a method suspect on one is suspect on all, and each
sends its calls alone (wire.ALONE; the worker holds the others while one runs: broker/worker/alone.py).

Sans-IO: times are passed in (`time.perf_counter` seconds, the dispatcher's clock).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["STRIKE_DECAY_SECONDS", "Isolation"]

STRIKE_DECAY_SECONDS = 60.0  # a method's strikes are forgotten this long after its last one
MAX_OWED_SHIFT = 20  # (2**20 answers owed: the time bound frees it first)
ALONE_SECONDS = 4.0  # ... or this long times its answers owed, after its last strike,
MAX_ALONE_SECONDS = 16.0  # this long at most


class Isolation:
    """The methods (by index in the workers' method table) whose calls run alone.

    `alone` maps a method index to how many of its calls must still answer, run alone,
    before it is free (>= 1). It is empty in the usual case, and the dispatcher tests it
    before anything else (one truth test a call). `next_end`: the earliest time bound of
    those (`expire`)."""

    __slots__ = ("_ends", "_strikes", "alone", "next_end", "waits")

    def __init__(self) -> None:
        self.alone: dict[int, int] = {}
        # Those of them whose calls wait for a worker of their own: caught alone (a death with
        # no other call there), or struck twice. The others (one strike, from a death
        # shared with other methods' calls: bystanders, mostly) run alone only where a worker is
        # free for it, else as any (hostile testing, round 84: one kill -9 beside long polls had
        # the restarted worker run one alone and the other reserved for the next, and every
        # other call waited 5 s).
        self.waits: set[int] = set()
        self._strikes: dict[int, tuple[int, float]] = {}  # index -> (strikes, when the last came)
        self._ends: dict[int, float] = {}  # index -> when its calls stop running alone, whatever is owed
        self.next_end = math.inf

    def blame(self, methods: Iterable[int], now: float, caught: bool = False) -> dict[int, int]:
        """A worker died holding calls of `methods`: a strike each; `caught`: it held one call
        only (nothing else there to blame). Returns, for each, the answers now owed before its
        calls stop running alone (for the log)."""
        owed: dict[int, int] = {}
        for index in methods:
            strikes, last = self._strikes.get(index, (0, now))
            if now - last >= STRIKE_DECAY_SECONDS:
                strikes = 0
            strikes += 1
            self._strikes[index] = (strikes, now)
            if strikes > 1 or caught:  # (twice in a minute, or alone there: nothing else to blame)
                self.waits.add(index)
            owed[index] = self.alone[index] = 1 << min(strikes - 1, MAX_OWED_SHIFT)
            end = self._ends[index] = now + min(ALONE_SECONDS * (1 << min(strikes - 1, 8)), MAX_ALONE_SECONDS)
            self.next_end = min(self.next_end, end)
        return owed

    def ends_in(self, index: int, now: float) -> float:
        """Seconds (rounded to 0.1) until method `index` stops running alone, whatever is owed."""
        return round(max(0.0, self._ends.get(index, now) - now), 1)

    def expire(self, now: float) -> list[int]:
        """Free the methods whose time bound has passed at `now`; returns them."""
        ended = [index for index, end in self._ends.items() if end <= now]
        for index in ended:
            del self._ends[index]
            self.alone.pop(index, None)
            self.waits.discard(index)
        self.next_end = min(self._ends.values(), default=math.inf)
        return ended

    def strikes(self, index: int) -> int:
        """Method `index`'s strikes (0 if none, or forgotten: see `blame`, which decays them)."""
        return self._strikes.get(index, (0, 0.0))[0]

    def answered(self, index: int) -> bool:
        """A call of method `index`, run alone, answered (its handler ran, its worker lives
        on): one fewer owed. True if that frees the method."""
        owed = self.alone.get(index)
        if owed is None:
            return False
        if owed > 1:
            self.alone[index] = owed - 1
            return False
        del self.alone[index]
        self._ends.pop(index, None)
        self.waits.discard(index)
        return True

    def clear(self) -> None:
        """Forget everything (a reload: new code, and a new method table)."""
        self.alone.clear()
        self.waits.clear()
        self._strikes.clear()
        self._ends.clear()
        self.next_end = math.inf
