"""Who gives way at max_incoming_bytes (`frontend.incoming.Incoming.make_room`), in memory:
the order, what it frees, and how many connections it looks at. The connections are
plain objects with what `make_room` reads of a protocol (`holding_rank`, `_incoming`,
`evict_incoming`, `_fe`); the protocols' own `holding_rank` and `evict_incoming` are
exercised over real sockets in test_incoming_bytes.py. Here the count of ranks taken is
what matters, which a real broker shows only as time."""

from __future__ import annotations

import types

from broker.frontend.incoming import RESCAN_SECONDS, Incoming


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def time(self) -> float:
        return self.now


class Holder:
    """A connection holding `held` bytes of a request under way, come at `rate` bytes a
    second (its rank: `trickle_rank`'s shape, (begun within the grace, rate))."""

    ranks_taken = 0

    def __init__(self, incoming: Incoming, listener: types.SimpleNamespace, held: int, rate: float) -> None:
        self._fe = listener
        self._incoming = held
        self.rate = rate
        self.evicted = False
        self.incoming = incoming
        assert incoming.hold(0, held)
        listener.connections.add(self)

    def holding_rank(self, now: float, held: int = -1) -> tuple[int, float] | None:
        Holder.ranks_taken += 1
        if self.evicted or not (self._incoming if held < 0 else held):
            return None
        return 0, self.rate

    def evict_incoming(self, now: float) -> None:
        self.evicted = True
        self.incoming.hold(self._incoming, 0)
        self._incoming = 0

    def grow(self, by: int) -> bool:
        """Its request grows by `by` bytes: as the protocols' `_hold`/`_partial` count it."""
        after = self._incoming + by
        if self.incoming.hold(self._incoming, after) or self.incoming.make_room(self, self._incoming, after):
            self._incoming = after
            return True
        return False


def setup(limit: int) -> tuple[Incoming, types.SimpleNamespace, Clock]:
    incoming = Incoming(limit)
    clock = Clock()
    listener = types.SimpleNamespace(connections=set(), evicted_total={"incoming": 0},
                                     loop=types.SimpleNamespace(time=clock.time))
    incoming.listeners.append(listener)  # type: ignore[arg-type]
    return incoming, listener, clock


def test_the_slowest_give_way_first_only_if_they_free_enough_and_never_a_faster_one():
    incoming, listener, clock = setup(1000)
    slow = [Holder(incoming, listener, 100, rate) for rate in (1.0, 2.0, 3.0)]  # 300 bytes, slowest first
    fast = Holder(incoming, listener, 600, 1e6)
    newcomer = Holder(incoming, listener, 0, 50.0)
    newcomer.rate = 50.0
    assert incoming.held == 900
    assert newcomer.grow(250)  # needs 150: the two slowest go (200 bytes), not the third
    assert [h.evicted for h in slow] == [True, True, False] and not fast.evicted
    assert incoming.held == 950 and listener.evicted_total["incoming"] == 2
    clock.now += RESCAN_SECONDS
    assert not newcomer.grow(500)  # needs 450: the one slower holds 100, the faster 600: none goes
    assert not slow[2].evicted and not fast.evicted and incoming.held == 950
    clock.now += RESCAN_SECONDS
    assert not slow[2].grow(100)  # slower than everyone else: refused, nobody evicted for it
    assert listener.evicted_total["incoming"] == 2


def test_a_wave_of_refusals_takes_each_holder_s_rank_a_bounded_number_of_times():
    """Hostile testing, round 103 (HIGH): 4000 connections holding a byte each, slower than a
    wave of newcomers from the same connections but never enough to make room, were walked
    one by one at each refusal: 16 million ranks, the loop held 5 s. Between scans,
    which of them are slower and what they hold is found in O(log n) now."""
    n = 4000
    incoming, listener, clock = setup(10_000_000)
    tiny = [Holder(incoming, listener, 1, 1.0 / (i + 1)) for i in range(n)]  # (the later, the slower)
    Holder(incoming, listener, incoming.limit - incoming.held, 1e9)  # the bulk, fast, fills the bound
    Holder.ranks_taken = 0
    for i, holder in enumerate(tiny):
        holder.rate = 1e3 + i  # (its wave: faster than every tiny one, far slower than the bulk)
        assert not holder.grow(14_000)
        if i % 1000 == 999:
            clock.now += RESCAN_SECONDS  # (a scan every 1000 refusals: 4 in all)
    assert incoming.refused_total == 0  # (the caller counts its refusal: `refuse`)
    assert listener.evicted_total["incoming"] == 0 and not any(h.evicted for h in tiny)
    # Quadratic, it was n * n / 2 = 8,000,000 ranks: now the scans' (n + 1 each), and two a call.
    assert Holder.ranks_taken <= 5 * (n + 1) + 2 * n, Holder.ranks_taken


def test_a_newcomer_s_own_bytes_free_no_room_for_it_and_its_refusal_refuses_no_other():
    """Hostile testing, round 104 (MEDIUM): ranked at the last scan, a newcomer counted its
    own bytes among those slower than it, the walk that skipped it came up short, and every
    other newcomer was refused until the next scan: the attacker's slowest holder, grown
    by one byte more than the room left at each scan, had honest 300 KB calls refused (up
    to 34 of 71) while slower holders would have made room."""
    incoming, listener, _ = setup(1000)
    trigger = Holder(incoming, listener, 300, 1.0)  # (the slowest)
    bulk = [Holder(incoming, listener, 200, rate) for rate in (5.0, 6.0, 7.0)]
    assert incoming.held == 900
    slowpoke = Holder(incoming, listener, 0, 0.5)
    assert not slowpoke.grow(200)  # (none slower than it: refused; the trigger ranked at this scan)
    trigger.rate = 2.0  # (a little faster with its new bytes; still the slowest)
    assert not trigger.grow(150)  # (only itself was slower: refused, none closed)
    assert listener.evicted_total["incoming"] == 0
    honest = Holder(incoming, listener, 0, 100.0)
    assert honest.grow(300)  # within the same scan: the trigger gives way, not the bulk
    assert trigger.evicted and not any(h.evicted for h in bulk)
    assert incoming.held == 900 and listener.evicted_total["incoming"] == 1
