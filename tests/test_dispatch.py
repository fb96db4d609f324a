"""The dispatcher's deadline wheel, on real event loops (uvloop and asyncio)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from broker.dispatch import Call, DeadlineWheel, Route
from broker.jsonrpc import Request

LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


def make_call(call_id: int, timeout: float) -> Call:
    return Call.of(call_id, None, -1, Request("2.0", "m"), Route(0, timeout), 0.0)


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_deadlines_fire_in_order_once_and_not_when_removed(loop_name):
    fired: list[tuple[int, float]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wheel = DeadlineWheel(loop, lambda c: fired.append((c.call_id, loop.time() - start)), resolution=0.01)
        start = loop.time()
        calls = [make_call(1, 0.15), make_call(2, 0.05), make_call(3, 0.10), make_call(4, 0.05)]
        for c in calls:
            wheel.add(c, start)
        assert len(wheel) == 4 and all(c.tick for c in calls)
        wheel.remove(calls[3])  # answered before its deadline
        assert calls[3].tick == 0 and len(wheel) == 3
        await asyncio.sleep(0.3)
        assert len(wheel) == 0

    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(main())
    assert [cid for cid, _ in fired] == [2, 3, 1]
    for (cid, at), due in zip(fired, (0.05, 0.10, 0.15)):
        assert at >= due - 0.001, (cid, at)  # never early (rounded up to the next tick)


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_an_earlier_deadline_rearms_the_timer(loop_name):
    fired: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wheel = DeadlineWheel(loop, lambda c: fired.append(c.call_id))
        now = loop.time()
        wheel.add(make_call(1, 30.0), now)
        wheel.add(make_call(2, 0.02), now)  # must not wait behind the 30 s timer
        await asyncio.sleep(0.2)
        assert fired == [2]
        assert len(wheel) == 1

    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(main())
