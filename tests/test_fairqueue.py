"""The dispatcher's fair queue (broker/fairqueue.py), sans-IO: each connection's calls in
order, connections served in turn by cost (self-clocked fair queueing), arrival order among
calls queued while nothing was taken out, connections held out of turn while they hold
their share of the workers' places."""

from __future__ import annotations

import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.fairqueue import FairQueue, Largest


def test_calls_queued_together_come_out_in_arrival_order_then_in_turn() -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(lambda call: 1)
    for i in range(3):
        q.append(("a", i), "a")
    q.append(("b", 0), "b")
    q.append(("c", 0), "c")
    out = [q.popleft() for _ in range(len(q))]
    # a's first (it came first), then b and c (served nothing yet), then a's others
    assert out == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("a", 2)]


def test_a_connection_that_comes_later_goes_after_one_call_of_the_backlog_of_another() -> None:
    """Round 53: one connection's queued flood no longer holds another's call behind all
    of it: the newcomer starts at the queue's virtual time, beside the flood's next call."""
    q: FairQueue[tuple[str, int]] = FairQueue(lambda call: 1)
    for i in range(100):
        q.append(("flood", i), "flood")
    assert [q.popleft() for _ in range(10)] == [("flood", i) for i in range(10)]
    q.append(("victim", 0), "victim")
    q.append(("victim", 1), "victim")
    assert [q.popleft() for _ in range(4)] == [("flood", 10), ("victim", 0), ("flood", 11), ("victim", 1)]


@pytest.mark.parametrize("churn", [False, True], ids=["returning", "new-connections"])
def test_a_backlog_gets_its_turn_beside_connections_sending_one_call_at_a_time(churn: bool) -> None:
    """Round 54 (HIGH): start-time fair queueing forgot a connection whose calls had all
    gone out, and it came back at the virtual time V, the start tag of the call served,
    which it did not move: 3 connections sending a call each time their last one was
    answered went before a backlogged one every time (it got 1 call of 3000). V is the
    finish tag served now (self-clocked): the backlog gets its turn, 1 call in 4; the
    same when each call comes on a new connection."""
    q: FairQueue[tuple[str, int]] = FairQueue(lambda call: 1)
    for i in range(2000):
        q.append(("backlog", i), "backlog")
    for k in range(3):
        q.append(("loop", k), ("loop", k))
    out = []
    for step in range(3000):
        call = q.popleft()
        out.append(call[0])
        if call[0] == "loop":  # its answer came: the next call, on the same connection or a new one
            q.append(call, ("loop", step) if churn else ("loop", call[1]))
    assert 740 <= out.count("backlog") <= 760, out.count("backlog")
    assert max(len(run) for run in "".join("b" if x == "backlog" else "." for x in out).split("b")) <= 3


def test_costly_calls_take_their_connections_turns() -> None:
    """A chunk of 10 calls costs its connection 10 turns of a connection of single calls."""
    q: FairQueue[tuple[str, int]] = FairQueue(lambda call: 10 if call[0] == "batch" else 1)
    for i in range(3):
        q.append(("batch", i), "batch")
    for i in range(30):
        q.append(("single", i), "single")
    out = "".join("B" if q.popleft()[0] == "batch" else "s" for _ in range(len(q)))
    assert out == "s" * 9 + "B" + "s" * 10 + "B" + "s" * 10 + "B" + "s"  # (ties: the older flow first)
    assert len(q) == 0


def test_a_connection_coming_back_waits_one_call_of_each_not_a_chunks_worth() -> None:
    """Round 55 (HIGH): ordered by start tags with V the largest finish tag served, a chunk
    of 500 calls went at its start and moved V 500 ahead; a connection sending one call at
    a time came back at V and waited behind about 500 calls of each of 8 backlogged
    connections (4500 calls). By finish tags it waits behind about one of each."""
    q: FairQueue[tuple[str, int]] = FairQueue(lambda call: call[1])
    for _ in range(3):
        q.append(("chunks", 500), "chunks")
    for k in range(8):
        for _ in range(5):
            q.append((f"single{k}", 1), f"single{k}")
    q.append(("loop", 1), "loop")
    waits: list[int] = []
    since = 0
    for _ in range(50_000):
        call = q.popleft()
        if call[0] == "loop":
            waits.append(since)
            since = 0
        else:
            since += call[1]
        q.append(call, call[0])  # every backlog kept as deep; the loop's next call as its last is out
    waits = waits[5:]
    assert sum(waits) / len(waits) <= 10, sum(waits) / len(waits)  # (8 singles and at times a chunk)
    assert max(waits) <= 8 + 500, max(waits)


def test_drop_keeps_the_order_and_the_turns() -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(lambda call: 1)
    for i in range(4):
        q.append(("a", i), "a")
        q.append(("b", i), "b")
    q.drop(lambda call: call[1] % 2 == 1)
    assert len(q) == 4 and sorted(q) == [("a", 1), ("a", 3), ("b", 1), ("b", 3)]
    assert [q.popleft() for _ in range(4)] == [("a", 1), ("b", 1), ("a", 3), ("b", 3)]
    q.drop(lambda call: True)
    assert len(q) == 0 and list(q) == []


_step = st.one_of(
    st.tuples(st.sampled_from("abcd"), st.integers(0, 5)),  # append (connection, cost)
    st.none(),  # popleft
    st.tuples(st.sampled_from(["hold", "release", "expire"]), st.sampled_from("abcd")),
    st.just("release_all"),
    st.just("drop"),
    st.just("give_back"),  # popleft, then appendleft: a worker gave the call back unstarted
)


@given(st.lists(_step, max_size=80))
def test_each_connections_calls_come_out_in_order_and_none_is_lost(steps: list[object]) -> None:
    """Any interleaving of appends (connection, cost), takes, holds and releases of a
    connection's calls, expiries of a connection's head, drops, and calls taken and put
    back at their connection's head (`appendleft`): a connection's calls
    come out in the order they went in, each once, never while it is held; iteration
    holds exactly what is queued, the flows in turn first, the head first of all."""
    q: FairQueue[tuple[str, int, int]] = FairQueue(lambda call: call[1])
    queued: dict[str, list[tuple[str, int, int]]] = {}
    held: set[str] = set()
    n = 0
    for step in steps:
        if step is None:
            if q.head() is None:
                assert all(not queued.get(key) for key in "abcd" if key not in held)
                with pytest.raises(IndexError):
                    q.popleft()
            else:
                head = q.head()
                call = q.popleft()
                assert call == head and call[0] not in held
                assert queued[call[0]].pop(0) == call  # its connection's oldest
        elif step == "release_all":
            q.release_all()
            held.clear()
        elif step == "give_back":
            call = q.head()
            if call is not None:
                assert q.popleft() is call
                q.appendleft(call, call[0])
                assert q.first(call[0]) is call  # (back at its connection's head)
        elif step == "drop":
            q.drop(lambda call: call[2] % 3 != 0)
            for key, calls in queued.items():
                queued[key] = [c for c in calls if c[2] % 3 != 0]
        elif isinstance(step[0], str) and step[0] in ("hold", "release", "expire"):
            what, key = typing.cast(tuple[str, str], step)
            if what == "hold":
                if queued.get(key):
                    q.hold(key)
                    held.add(key)
            elif what == "release":
                q.release(key)
                held.discard(key)
            elif queued.get(key):
                assert q.first(key) == queued[key][0]
                assert q.expire_head(queued[key].pop(0), key)
        else:
            key, cost = typing.cast(tuple[str, int], step)
            call = (key, cost, n)
            n += 1
            q.append(call, key)
            queued.setdefault(key, []).append(call)
        held = {key for key in held if queued.get(key)}  # (a flow emptied is forgotten, held or not)
        assert all(q.is_held(key) == (key in held) for key in "abcd")
        assert q.in_turn() == sum(1 for key, calls in queued.items() if calls and key not in held)
        assert sorted(typing.cast(list[str], q.held_keys())) == sorted(held)
        everything = [c for calls in queued.values() for c in calls]
        assert len(q) == len(everything) and sorted(q) == sorted(everything)
        in_turn = [c for c in q if c[0] not in held]
        assert list(q) == in_turn + [c for c in q if c[0] in held]
        assert q.head() == (in_turn[0] if in_turn else None)
    q.release_all()
    while len(q):
        call = q.popleft()
        assert queued[call[0]].pop(0) == call
    assert all(not calls for calls in queued.values())


def test_a_held_connection_sits_out_and_comes_back_with_no_credit() -> None:
    """A connection holding its share of the workers' places (`dispatch`'s
    connection_share) is held out of turn: the others' calls go, its own wait in order;
    released, it starts at V, one call a round beside the others, not a burst for the
    turns it sat out."""
    q: FairQueue[tuple[str, int]] = FairQueue(lambda call: 1)
    for i in range(50):
        q.append(("A", i), "A")
    for k in range(3):
        for i in range(20):
            q.append((f"B{k}", i), f"B{k}")
    q.hold("A")
    out = [q.popleft()[0] for _ in range(30)]
    assert "A" not in out and len(q) == 80
    q.release("A")
    out = [q.popleft() for _ in range(40)]
    a_calls = [call for call in out if call[0] == "A"]
    assert a_calls == [("A", i) for i in range(len(a_calls))]  # in order
    assert 9 <= len(a_calls) <= 11  # one a round of 4 connections: no credit for sitting out
    assert out.index(a_calls[0]) <= 3


def test_a_head_that_expires_leaves_at_once_and_gives_its_connection_no_credit() -> None:
    """Round 56 (HIGH): a chunk of 1000 calls expiring at its connection's head kept its
    place by its full cost: the connection's next call waited behind about 1000 calls of
    every other connection (5-10 s on a broker); and once the shell was out, at no cost,
    the connection was that far ahead, and its calls went first, up to 200 in a row.
    `expire_head` takes it out at once, and the connection's next call starts at V."""
    q: FairQueue[list[object]] = FairQueue(lambda call: typing.cast(int, call[1]) if call[2] else 0)
    chunk: list[object] = ["A", 500, True]
    q.append(chunk, "A")
    for _ in range(200):
        q.append(["A", 1, True], "A")
    for k in range(8):
        for _ in range(3):
            q.append([f"B{k}", 1, True], f"B{k}")
    out: list[str] = []
    for _ in range(40):  # the B connections go; A's chunk waits its turn
        call = q.popleft()
        out.append(typing.cast(str, call[0]))
        q.append(call, call[0])  # (every B backlog kept as deep)
    assert "A" not in out
    chunk[2] = False  # its deadline passed while it waited
    assert q.expire_head(chunk, "A") and chunk not in list(q)
    assert not q.expire_head(["A", 1, True], "A")  # (not its head: stays, a shell)
    out = []
    for _ in range(90):
        call = q.popleft()
        out.append(typing.cast(str, call[0]))
        if call[0] != "A":
            q.append(call, call[0])
    assert out.index("A") <= 9  # no stall: about one call of each B first
    runs = "".join("A" if who == "A" else "." for who in out).split(".")
    assert max(len(run) for run in runs) <= 2  # no credit: one A a round, not a burst
    assert 8 <= out.count("A") <= 12


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(-3, 3)), max_size=120))
def test_largest_is_the_key_of_the_largest_size_however_sizes_went(steps: list[tuple[str, int]]) -> None:
    """`Largest`: sizes grow (said) and shrink (unsaid) in any order; `top` is a key of the
    largest size, None when every size is 0, and its heap stays bounded by `trim`."""
    sizes = dict.fromkeys("abcdef", 0)
    largest: Largest[str] = Largest(sizes.__getitem__)
    for key, change in steps:
        if change > 0:
            sizes[key] += change
            largest.grew(key)
        else:
            sizes[key] = max(0, sizes[key] + change)
        largest.trim(sum(1 for n in sizes.values() if n))
        top = largest.top()
        if max(sizes.values()) == 0:
            assert top is None
        else:
            assert top is not None and sizes[top] == max(sizes.values())
        assert len(largest._heap) <= 2 * 6 + 64 + 1
