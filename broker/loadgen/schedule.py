"""Open-loop schedule: when each request is *meant* to be sent. Pure functions.

Coordinated omission (Gil Tene, "How NOT to Measure Latency"; wrk2's README): a
load generator that waits for an answer before sending the next request stops
asking while the server stalls, so the stall hides in a handful of slow samples.
In open-loop mode (``--rate R``) request ``i`` of connection ``g`` (of ``C``) has
an intended send time fixed in advance,

    intended(i) = t0 + g / R + i * C / R

so the ``C`` connections interleave into one evenly spaced stream of ``R``
requests/s. Its latency is measured from ``intended(i)``, not from when it went
out: a request that had to wait behind a stall (its connection's ``--depth`` was
full) still counts the wait. Requests are sent up to ``t_end`` of intended time. When
the measured window begins (``t_measure``), a connection skips to `first_at`
(``t_measure``): the warm-up's requests not sent by then are dropped, not sent late.
"""

from __future__ import annotations

import math

__all__ = ["connection_timing", "due", "first_at", "intended", "planned"]

_MAX_INDEX = 2.0**53  # past it, consecutive request indices are no longer distinct floats


def connection_timing(rate: float, connections: int, index: int) -> tuple[float, float]:
    """(phase, interval) in seconds of connection ``index`` (0-based) of ``connections``
    sharing ``rate`` requests/s. Raises ValueError unless rate > 0 and 0 <= index < connections."""
    if not (0 < rate < math.inf) or not 0 <= index < connections:
        raise ValueError(f"need 0 < rate < inf and 0 <= index < connections, got {rate}, {index}, {connections}")
    interval = connections / rate
    if not interval > 0:  # rate so high that the interval underflows to 0
        raise ValueError(f"rate {rate} too high for {connections} connections")
    return index / rate, interval


def intended(t0: float, phase: float, interval: float, i: int) -> float:
    """Intended send time (s, same clock as ``t0``) of request ``i`` (0-based) of a connection."""
    return t0 + phase + i * interval


def due(t0: float, phase: float, interval: float, sent: int, now: float, t_end: float) -> int:
    """How many requests, after the ``sent`` already sent, are due at ``now``: those with
    intended time <= ``now`` and < ``t_end``. Never negative.

    Raises ValueError for an interval that is not finite and > 0, or a span of
    intended times too long to count in floats (an infinite ``now`` and ``t_end``,
    or more than 2**53 requests): the CLI bounds ``--rate`` and the durations so
    that a run never gets near either, and the answer always comes in O(1)."""
    if not 0 < interval < math.inf:
        raise ValueError(f"need 0 < interval < inf, got {interval}")
    limit = min(now, math.nextafter(t_end, -math.inf))
    if limit < t0 + phase:
        return 0
    span = (limit - t0 - phase) / interval
    if not span < _MAX_INDEX:  # also catches inf and nan
        raise ValueError(f"schedule span too long: {span} intervals")
    last = math.floor(span)  # index of the last due request
    # Guard the float division at exact boundaries: one step either way is enough
    # (the division is off by at most an ulp), and a bounded step cannot spin.
    if intended(t0, phase, interval, last + 1) <= limit:
        last += 1
    elif last >= 0 and intended(t0, phase, interval, last) > limit:
        last -= 1
    return max(0, last + 1 - sent)


def first_at(t0: float, phase: float, interval: float, t: float) -> int:
    """Index of a connection's first request with intended time >= ``t`` (0 if ``t`` is
    before its first). The open loop skips to it when the measured window begins at
    ``t``, dropping the warm-up's backlog. Raises ValueError as `due` does."""
    return due(t0, phase, interval, 0, t, t)


def planned(rate: float, connections: int, duration: float) -> int:
    """Total requests the schedule holds in ``duration`` s (intended times in [0, duration))."""
    return sum(due(0.0, *connection_timing(rate, connections, g), 0, duration, duration)
               for g in range(connections))
