"""A worker serving several front-ends tells each when a handler blocks it (wire.BLOCKED;
broker/worker/held.py).

New user, round 114: with two front-ends, a fast call one front-end sent to a worker blocked in
the other's sync call waited behind it, while another worker was idle; and a front-end could
not tell a worker hung in its own call from one busy in another's. In-process: a real
`WorkerProtocol` and its `Link`s on socketpairs, driven by the raw wire; then one connection."""

from __future__ import annotations

import asyncio
import math
import struct
import time

import pytest
from test_worker_alone import call
from test_worker_links import run_links  # noqa: F401  # (a fixture, by name)
from test_worker_sdk import INDEX, Broker, chunk_frame, result, run  # noqa: F401  # (`run`: a fixture)

from broker.wire import Kind, encode_call
from broker.worker import WorkerProtocol

FREE = (Kind.BLOCKED, 0, 0, b"")


def blocked(call_id: int, deadline: float) -> tuple[int, int, int, bytes]:
    return (Kind.BLOCKED, call_id, 1, struct.pack(">d", deadline))


async def _blocked_frames(b: Broker, n: int) -> list[tuple[int, int, int, bytes]]:
    b.keep_blocked = True
    frames = await b.read(n, timeout=10)
    return [(f[0], f[1], f[2], bytes(f[3])) for f in frames]


async def _warm(bs: list[Broker]) -> None:
    """A sync method's first call counts as slow (the front-ends told before it starts): one of
    `add_ints` makes it known fast."""
    bs[0].send(call(99, "add_ints", b"[0, 0]"))
    assert [f[:2] for f in await _blocked_frames(bs[0], 3)] == [(Kind.BLOCKED, 99), FREE[:2], (Kind.RESULT, 99)]
    for b in bs[1:]:
        assert await _blocked_frames(b, 2) == [blocked(0, math.inf), FREE]


@pytest.mark.serial  # (a 3 ms spin, preempted past the held answers' tick beside 3 other tests on 2 cores, was told)
def test_every_front_end_is_told_a_handler_blocks_the_worker_and_when_it_returned(run_links):  # noqa: F811  # (the fixture imported)
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second, third = bs
        await _warm(bs)
        deadline = time.monotonic() + 30
        second.send(encode_call(Kind.CALL, 7, INDEX["spin"], b"[0.3]", deadline, 1))
        # The call's own front-end is told with its id; the others with id 0; each then told it is free
        assert await _blocked_frames(first, 1) == [blocked(0, deadline)]
        assert await _blocked_frames(third, 1) == [blocked(0, deadline)]
        [told, free, answer] = await _blocked_frames(second, 3)
        assert told == blocked(7, deadline) and free == FREE
        assert answer[:2] == (Kind.RESULT, 7) and result(answer) == 0.3
        assert await _blocked_frames(first, 1) == [FREE] and await _blocked_frames(third, 1) == [FREE]
        # A chunk's call: the chunk's id and deadline, to the front-end that sent it
        first.send(chunk_frame(4, [("add_ints", b"[1, 2]", False), ("spin", b"[0.2]", False)], flow=2))
        frames = await _blocked_frames(first, 4)  # (its first answer as a part, before the spin ends)
        assert [f[:3] for f in frames if f[0] == Kind.BLOCKED] == [(Kind.BLOCKED, 4, 1), FREE[:3]]
        assert math.isinf(struct.unpack(">d", next(f for f in frames if f[0] == Kind.BLOCKED)[3])[0])
        assert await _blocked_frames(second, 2) == [blocked(0, math.inf), FREE]
        # A method whose last call blocked: told before its call starts, however short it is
        second.send(call(8, "spin", b"[0.003]"))
        assert [f[:2] for f in await _blocked_frames(second, 3)] == [(Kind.BLOCKED, 8), FREE[:2], (Kind.RESULT, 8)]
        assert [f[:3] for f in await _blocked_frames(first, 2)] == [(Kind.BLOCKED, 0, 1), FREE[:3]]
        second.send(call(9, "spin", b"[0]"))  # (told too: then learnt fast)
        assert [f[:2] for f in await _blocked_frames(second, 3)] == [(Kind.BLOCKED, 9), FREE[:2], (Kind.RESULT, 9)]
        # A call of a method known fast that blocks less than the held answers' tick says nothing
        second.send(call(10, "add_ints", b"[2, 2]"), call(11, "spin", b"[0.003]"))
        assert [f[:2] for f in await _blocked_frames(second, 2)] == [(Kind.RESULT, 10), (Kind.RESULT, 11)]
        assert [f[:3] for f in await _blocked_frames(first, 2)] == [(Kind.BLOCKED, 0, 1), FREE[:3]]  # (call 9's)
        await first.nothing_more(0.2)

    run_links(test, 3)


def test_a_worker_with_one_front_end_says_nothing_of_blocking(run):  # noqa: F811  # (the fixture imported)
    async def test(proto: WorkerProtocol, b: Broker) -> None:
        b.keep_blocked = True
        b.send(encode_call(Kind.CALL, 1, INDEX["spin"], b"[0.2]", math.inf, 1))
        [f] = await b.read(timeout=10)
        assert f[:2] == (Kind.RESULT, 1)
        await b.nothing_more(0.1)

    run(test)


def test_a_hung_handler_keeps_the_front_ends_told_it_blocks(run_links):  # noqa: F811  # (the fixture imported)
    """Told once a handler, however long it runs; the held answers still go out beside it."""
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        await _warm(bs)
        first.send(call(1, "add_ints", b"[1, 1]"), call(2, "spin", b"[0.5]"))
        frames = await _blocked_frames(first, 2)
        assert sorted(f[:2] for f in frames) == sorted([(Kind.RESULT, 1), (Kind.BLOCKED, 2)])
        await asyncio.sleep(0.2)
        assert await _blocked_frames(second, 1) == [blocked(0, math.inf)]
        await second.nothing_more(0.1)  # (once only)
        assert [f[:2] for f in await _blocked_frames(first, 2)] == [FREE[:2], (Kind.RESULT, 2)]

    run_links(test)
