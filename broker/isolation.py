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

The methods of every call a dead worker held come under suspicion (none can be told
apart from the others). A method is

    suspect     its calls run alone until one of them answers (it ran and its worker
                lived): the innocent bystanders of a crash, free again after one call;
    convicted   a call of it was the only call its worker held when the worker died:
                its calls run alone for ISOLATE_SECONDS after its last such death,
                whatever answers meanwhile (a handler that crashes for some params only
                is caught the same way).

This is a circuit breaker in the sense of Nygard's *Release It!* (2007), ch. 5, with the
broker's only trustworthy signal of a failure, a worker's death, and "half open" meaning
"one call at a time, alone". A reload (new code) forgets it all.

Sans-IO: times are passed in (`time.perf_counter` seconds, the dispatcher's clock).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["ISOLATE_SECONDS", "Isolation"]

ISOLATE_SECONDS = 30.0  # a convicted method's calls run alone this long after its last death


class Isolation:
    """The methods (by index in the workers' method table) whose calls run alone.

    `alone` maps a method index to when its isolation ends (`math.inf`: a suspect, until
    a call of it answers). It is empty in the usual case, and the dispatcher tests it
    before anything else (one truth test a call)."""

    __slots__ = ("_next_expiry", "alone")

    def __init__(self) -> None:
        self.alone: dict[int, float] = {}
        self._next_expiry = math.inf  # the earliest end of a conviction (perf_counter s)

    def blame(self, methods: Iterable[int], sole: bool, now: float) -> list[tuple[int, str]]:
        """A worker died holding calls of `methods`; `sole`: it held one call only.
        Returns what changed, [(method index, "convicted" | "suspect")], for the log."""
        changed: list[tuple[int, str]] = []
        for index in methods:
            if sole:
                until = now + ISOLATE_SECONDS
                self.alone[index] = until
                self._next_expiry = min(self._next_expiry, until)
                changed.append((index, "convicted"))
            elif index not in self.alone:
                self.alone[index] = math.inf
                changed.append((index, "suspect"))
        return changed

    def isolated(self, index: int, now: float) -> bool:
        """Do calls of method `index` run alone now? (A conviction past its end is dropped.)"""
        if now >= self._next_expiry:
            self._expire(now)
        return index in self.alone

    def _expire(self, now: float) -> None:
        self.alone = {index: until for index, until in self.alone.items() if until > now}
        self._next_expiry = min((u for u in self.alone.values() if u != math.inf), default=math.inf)

    def answered(self, index: int) -> bool:
        """A call of method `index`, run alone, answered (its handler ran, its worker lives):
        a suspect is free again (True); a convicted method stays isolated."""
        if self.alone.get(index) == math.inf:
            del self.alone[index]
            return True
        return False

    def clear(self) -> None:
        """Forget everything (a reload: new code, and a new method table)."""
        self.alone.clear()
        self._next_expiry = math.inf
