"""/metrics with several front-ends (`serve --frontends N`): each body made on demand from every front-end's series.

A GET /metrics on any front-end asks for the next body (`HttpFrontend.gather`); a peer asks
the first front-end (`peerwire.Want`). The first front-end makes bodies in rounds
(`Rounds`): it asks every serving peer for its series (`peerwire.Collect`), waits for their
answers (`peerwire.Counters`; COLLECT_SECONDS at most: a stopped or dying peer's last series
count), sums them with its own (`metrics.BrokerCollector.peer_samples`) and hands the body to
every scrape that asked before the round began, a peer's in a `peerwire.Exposition`. A
scrape that asks while a round is under way waits for the next, so its body holds every
call answered before it came, on whichever front-end. Rounds are paced as one front-end's
builds are (the next no sooner than as long after the last as it took), so scrapes in a
loop cannot keep the first front-end's loop busy; and with no scrape nothing is made (a
body every second whatever was scraped took a third of a core with 400 methods and 4
front-ends: hostile testing, round 126).
"""

from __future__ import annotations

import asyncio
import logging
import typing

__all__ = ["COLLECT_SECONDS", "Rounds"]

COLLECT_SECONDS = 1.0  # a round waits this long at most for the peers' series

log = logging.getLogger("broker")


class Rounds:
    """The first front-end's rounds (see the module docstring).

    `collect(round)` asks the serving peers for their series and returns their numbers
    (those the round waits for: `heard`); `build()` makes the body from the series in hand
    (bytes). `body` is the last body made (b"" before the first)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, collect: typing.Callable[[int], set[int]],
                 build: typing.Callable[[], bytes]) -> None:
        self._loop = loop
        self._collect = collect
        self._build = build
        self.body = b""
        self._round = 0
        self._pending: set[int] = set()  # the peers the round under way waits for
        self._current: list[typing.Callable[[], None]] = []  # the scrapes it serves
        self._queued: list[typing.Callable[[], None]] = []  # those for the next round
        self._start_handle: asyncio.TimerHandle | None = None  # the next round's start
        self._deadline: asyncio.TimerHandle | None = None  # the round under way's end at the latest
        self._next = 0.0  # loop time: no round starts before it (the pace)
        self._stopped = False

    def gather(self, done: typing.Callable[[], None]) -> None:
        """Call `done` (never before this returns) once a body made from every front-end's
        series, each asked for after this call, is in `body`."""
        if self._stopped:  # (the last body; none made yet: one of the series in hand, new user,
            # round 114: a scrape on the metrics port in the drain waited on an empty body until the exit)
            if not self.body:
                self._finish()
            self._loop.call_soon(done)
            return
        self._queued.append(done)
        if self._start_handle is None and self._deadline is None:
            self._start_handle = self._loop.call_at(max(self._loop.time(), self._next), self._start)

    def _start(self) -> None:
        self._start_handle = None
        self._round += 1
        self._current, self._queued = self._queued, []
        self._pending = self._collect(self._round)
        self._deadline = self._loop.call_later(COLLECT_SECONDS, self._finish)
        if not self._pending:
            self._finish()

    def heard(self, number: int, round_: int) -> None:
        """Peer `number` sent its series for round `round_` (kept by the caller)."""
        if round_ == self._round:
            self.gone(number)

    def gone(self, number: int) -> None:
        """Peer `number` will not answer (it exited): the round waits for it no more."""
        self._pending.discard(number)
        if not self._pending and self._deadline is not None:
            self._finish()

    def _finish(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._pending = set()
        started = self._loop.time()
        try:
            self.body = self._build()
        except Exception:  # (the scrapes waiting are answered all the same, with the last body)
            log.exception("the /metrics body could not be made; the last one is served")
        now = self._loop.time()
        self._next = now + (now - started)
        done, self._current = self._current, []
        for call in done:
            call()
        if self._queued and self._start_handle is None:
            self._start_handle = self._loop.call_at(self._next, self._start)

    def stop(self) -> None:
        """Make no more rounds (the broker stops): the scrapes waiting are answered now, with
        a body of the series in hand (hostile testing, round 130: they were closed unanswered);
        those that ask later, with the last body."""
        for handle in (self._start_handle, self._deadline):
            if handle is not None:
                handle.cancel()
        self._start_handle = self._deadline = None
        self._stopped = True
        self._current += self._queued
        self._queued = []
        if self._current:
            self._finish()
