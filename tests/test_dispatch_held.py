"""The dispatcher's side of a call run alone in its worker whatever the other front-ends send
(wire.ALONE, HOLD, RETURN_ASIDE; broker/worker/alone.py): calls sent ALONE, a worker held out of
the rotation until its release or death, and calls given back aside going again as they were
sent. In-process, time injected, the worker's frames recorded (test_dispatch.RecordingChannel)."""

from __future__ import annotations

import json
import typing

import pytest
from test_dispatch import _entries_from, add_worker, body, chunk_reply, req, restarted
from test_dispatch_core import Clock, one_worker

from broker import wire
from broker.wire import HOLD, RETURN, RETURN_ASIDE


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> typing.Iterator[Clock]:
    """Time injected (test_dispatch_core.Clock)."""
    c = Clock(monkeypatch)
    yield c
    c.loop.close()


def test_a_call_run_alone_is_sent_alone_and_no_other_call_is(clock):
    d, w, codec, done = one_worker(clock.loop, ["m", "boom"], 10)
    d.submit(body(codec, req("m", [], 1)), done.append)
    [plain] = w.channel.take()
    assert not w.channel.flows[plain[1]] & wire.ALONE
    d.on_reply(w, wire.Kind.RESULT, plain[1], 5, b"0")
    d.submit(body(codec, req("boom", [], "b")), done.append)
    w.channel.take()
    restarted(d, w)  # (it died under `boom` alone: caught, its calls run alone)
    d.submit(body(codec, req("boom", [], "again")), done.append)
    [alone] = w.channel.take()
    assert w.channel.flows[alone[1]] & wire.ALONE and not w.channel.flows[alone[1]] & wire.RETURNABLE


def test_a_held_worker_takes_nothing_new_until_released_and_its_hold_is_answered(clock):
    d, a, codec, done = one_worker(clock.loop, ["m"], 10)
    b = add_worker(d, 1, 10)
    d.on_reply(a, HOLD, 0, 1, b"")
    assert a.channel.take() == [(HOLD, 0, 1, b"")]  # answered: nothing more comes from here
    assert d.ready_workers == 2 and d.answering_workers == 2  # (held, not down)
    for i in range(6):
        d.submit(body(codec, req("m", [i], i)), done.append)
    assert not a.channel.take() and len(b.channel.take()) == 6
    d.on_reply(a, HOLD, 0, 0, b"")  # released (after the rest of the read: a loop turn)
    clock.advance(0)
    assert not a.channel.take()  # (a release is not answered)
    for i in range(6):
        d.submit(body(codec, req("m", [i], i)), done.append)
    assert len(a.channel.take()) == 6  # (b is full of the first six: a takes the next, idle)


def test_a_release_read_with_the_next_hold_routes_nothing_to_the_worker(clock):
    """Hostile testing, round 137 (F6): a front-end resumed after a stop read a release and the
    worker's next hold in one read, and the release routed its queued calls into the worker,
    held again in a sync call run alone, where they died with it. The release waits for the rest
    of the read (a loop turn): held again meanwhile, the worker stays out of the rotation."""
    d, a, codec, done = one_worker(clock.loop, ["m"], 10)
    d.on_reply(a, HOLD, 0, 1, b"")
    for i in range(4):
        d.submit(body(codec, req("m", [i], i)), done.append)  # (queued: its one worker is held)
    assert a.channel.take() == [(HOLD, 0, 1, b"")]
    d.on_reply(a, HOLD, 0, 0, b"")  # the release, and the next hold, in one read
    d.on_reply(a, HOLD, 0, 1, b"")
    clock.advance(0)
    assert a.channel.take() == [(HOLD, 0, 1, b"")]  # (the hold answered; no call sent)
    d.on_reply(a, HOLD, 0, 0, b"")  # released, and not held again: the queue goes
    clock.advance(0)
    assert len([f for f in a.channel.take() if f[0] == wire.Kind.CALL]) == 4


def test_a_held_worker_that_dies_is_forgotten_and_its_slot_served_again(clock):
    d, a, codec, done = one_worker(clock.loop, ["m"], 10)
    b = add_worker(d, 1, 10)
    d.on_reply(a, HOLD, 0, 1, b"")
    restarted(d, a)  # (killed as hung under the call run alone, say: back, not held)
    assert not d._held_workers and d.ready_workers == 2
    d.on_reply(a, HOLD, 0, 0, b"")  # (a release from before its death: nothing)
    for i in range(12):
        d.submit(body(codec, req("m", [i], i)), done.append)
    assert len(a.channel.take()) and len(b.channel.take())


def test_calls_given_back_aside_go_again_as_they_were_sent_to_another_worker(clock):
    d, a, codec, done = one_worker(clock.loop, ["q", "a"], 100, sync_prefetch=1)
    d.set_methods(["q", "a"], sync_methods=["q"])
    d.submit(body(codec, req("q", [], "learn")), lambda e: None)  # `q` learnt fast: sent RETURNABLE
    [frame] = a.channel.take()
    d.on_reply(a, wire.Kind.RESULT, frame[1], 100, b"0")
    b = add_worker(d, 1, 100)
    d.submit(body(codec, req("q", ["x"], 1)), done.append)
    [sent] = a.channel.take() or b.channel.take()
    first, other = (a, b) if sent[1] in a.channel.flows else (b, a)
    assert first.channel.flows[sent[1]] & wire.RETURNABLE
    d.on_reply(first, HOLD, 0, 1, b"")
    first.channel.take()
    d.on_reply(first, RETURN, sent[1], RETURN_ASIDE, sent[3])
    [again] = other.channel.take()
    assert json.loads(again[3]) == ["x"] and other.channel.flows[again[1]] & wire.RETURNABLE  # (not as blocking)
    assert (first.outstanding, first.blocked, d.returned_total) == (0, False, 0)
    d.on_reply(other, wire.Kind.RESULT, again[1], 100, b'"y"')
    assert json.loads(done[-1].body())["result"] == "y"


def test_a_chunk_given_back_aside_in_part_goes_again_call_by_call_as_each_method_is_known(clock):
    d, a, codec, done = one_worker(clock.loop, ["m"], 100)
    b = add_worker(d, 1, 100)
    d.on_reply(b, HOLD, 0, 1, b"")  # (b held for now: the chunk goes to a)
    d.submit(body(codec, [req("m", [i], i) for i in range(5)]), done.append)
    [chunk] = a.channel.take()
    assert chunk[0] == wire.Kind.CHUNK
    d.on_reply(b, HOLD, 0, 0, b"")
    clock.advance(0)
    b.channel.take()
    d.on_reply(a, HOLD, 0, 1, b"")
    a.channel.take()
    d.on_reply(a, RETURN, chunk[1], 2 | RETURN_ASIDE, _entries_from(chunk[3], 2))  # it ran the first two
    singles = b.channel.take()
    assert [json.loads(f[3]) for f in singles] == [[2], [3], [4]]
    assert all(b.channel.flows[f[1]] & wire.RETURNABLE for f in singles)  # (not as blocking)
    assert d.returned_total == 0
    d.on_reply(a, wire.Kind.CHUNK_REPLY, chunk[1], 5, b"".join(
        wire.REPLY_ENTRY.pack(i, wire.RESULT, 1) + b"%d" % i for i in range(2)))
    for f, value in zip(singles, (b"2", b"3", b"4")):
        d.on_reply(b, wire.Kind.RESULT, f[1], 5, value)
    answers = json.loads(done[-1].body())
    assert sorted((r["id"], r["result"]) for r in answers) == [(i, i) for i in range(5)]


def test_a_held_worker_that_leaves_is_not_back_at_its_release(clock):
    d, a, codec, done = one_worker(clock.loop, ["m"], 10)
    b = add_worker(d, 1, 10)
    d.on_reply(a, HOLD, 0, 1, b"")
    d.worker_unready(a)  # (it asks to leave, SIGTERM: draining)
    d.on_reply(a, HOLD, 0, 0, b"")
    assert d.ready_workers == 1
    for i in range(5):
        d.submit(body(codec, req("m", [i], i)), done.append)
    assert len(b.channel.take()) == 5 and not [f for f in a.channel.take() if f[0] != HOLD]


def test_a_worker_said_blocked_before_it_serves_here_is_held_from_its_start(clock):
    """Hostile testing, round 134 (from reading): a peer front-end may read a worker's BLOCKED (in
    another front-end's call) before the first front-end's Serve; the worker then went into the
    rotation as if free, and what it said was forgotten. It is held from its start until its FREE."""
    from test_dispatch import RecordingChannel

    from broker.channel import Worker, WorkerState

    d, a, codec, done = one_worker(clock.loop, ["m"], 10)
    late = Worker(1)
    late.channel = RecordingChannel()  # type: ignore[assignment]
    late.concurrency = 10
    d.on_reply(late, wire.Kind.BLOCKED, 0, 1, b"\x7f\xf0" + bytes(6))  # (blocked till inf, not here)
    late.state = WorkerState.READY
    d.worker_ready(late)
    assert d.ready_workers == 2
    for i in range(4):
        d.submit(body(codec, req("m", [i], i)), done.append)
    assert not late.channel.take() and len(a.channel.take()) == 4
    d.on_reply(late, wire.Kind.BLOCKED, 0, 0, b"")  # free
    for i in range(4):
        d.submit(body(codec, req("m", [i], i)), done.append)
    assert len(late.channel.take()) == 4  # (a has the first four: the idle one takes these)


@pytest.mark.parametrize("told_first", [True, False])
def test_a_death_several_front_ends_saw_strikes_each_method_once(clock, told_first):
    """New user, round 115: a worker that died holding calls of one method from two front-ends
    struck it twice on each (its own strike, and the other's peerwire.Struck): its calls ran alone
    for 4 answers or 16 s, as after a second crash. Struck once per death (the worker's pid)."""
    d, w, codec, done = one_worker(clock.loop, ["m", "boom"], 10)
    w.pid = 4242
    d.submit(body(codec, req("boom", [], 1)), done.append)
    d.submit(body(codec, req("boom", [], 2)), done.append)
    if told_first:
        d.struck(["boom"], False, 4242)
    d.worker_lost(w, "exited with 1")
    if not told_first:
        d.struck(["boom"], False, 4242)
    assert d.isolated == {"boom": 1}  # (one strike: 1 answer owed)
    d.struck(["boom"], False, 4343)  # (another death: a second strike)
    assert d.isolated == {"boom": 2}


def test_calls_never_written_to_a_worker_that_died_go_to_the_next_unblamed(clock):
    """Hostile testing, round 137 (F7, F8): calls queued for a worker whose end came before their
    write (`WorkerChannel.unsent`: the write failed, EPIPE) never reached it: a single and a chunk
    wait again, in their order, and go whole to the next worker; the call it held takes the blame."""
    d, a, codec, done = one_worker(clock.loop, ["m", "n"], 10)
    d.submit(body(codec, req("n", [0], "held")), done.append)
    d.submit(body(codec, req("m", [1], 1)), done.append)
    d.submit(body(codec, [req("m", [i], i) for i in (2, 3)] + [req("n", [4], 4)]), done.append)
    _held, single, chunk = a.channel.take()
    assert (single[0], chunk[0]) == (wire.Kind.CALL, wire.Kind.CHUNK)
    a.channel.refuse(single)
    a.channel.refuse(chunk)
    b = add_worker(d, 1, 3)
    d.worker_lost(a, "exited with 1")
    again_single, again_chunk = b.channel.take()
    assert (d.queued_calls, d.in_flight_calls) == (0, 4)  # (hostile testing, round 138: the chunk counted as one call, -2)
    assert again_single[:1] == single[:1] and json.loads(again_single[3]) == [1]
    assert again_chunk[0] == wire.Kind.CHUNK and again_chunk[3] == chunk[3]  # (the same calls, methods)
    assert json.loads(done[0].body())["error"]["code"] == -32002  # (the call it held)
    assert ([d._isolation.strikes(i) for i in (0, 1)]) == [0, 1]  # (`n` struck, `m` not)
    d.on_reply(b, wire.Kind.RESULT, again_single[1], 0, b'"one"')
    d.on_reply(b, wire.Kind.CHUNK_REPLY, again_chunk[1], 3, chunk_reply(again_chunk))
    assert json.loads(done[1].body())["result"] == "one"
    assert sorted(r["id"] for r in json.loads(done[2].body())) == [2, 3, 4]
    assert (d.queued_calls, d.in_flight_calls) == (0, 0)
