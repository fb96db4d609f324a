"""broker/scrapes.py: /metrics bodies made in rounds, on demand, from every front-end's
series (`serve --frontends N`). `Rounds` on a real event loop, fed as `Peers` feeds it
(tests/test_frontends.py runs it in real brokers)."""

from __future__ import annotations

import asyncio
import functools
import time
import typing

from broker.scrapes import COLLECT_SECONDS, Rounds


class Peers:
    """What `Peers` gives `Rounds`: the serving peers it asks (`collect`), the bodies made."""

    def __init__(self, serving: set[int], build_seconds: float = 0.0) -> None:
        self.serving = serving
        self.asked: list[tuple[int, float]] = []  # (round, loop time)
        self.built: list[float] = []  # loop times of the builds' ends
        self.build_seconds = build_seconds
        self.loop = asyncio.get_running_loop()

    def collect(self, round_: int) -> set[int]:
        self.asked.append((round_, self.loop.time()))
        return set(self.serving)

    def build(self) -> bytes:
        time.sleep(self.build_seconds)  # (a build holds the loop as a large app's does)
        self.built.append(self.loop.time())
        return b"body %d" % len(self.built)


def on_loop(test: typing.Callable[[], typing.Coroutine[None, None, None]]) -> typing.Callable[[], None]:
    """Run the coroutine test on a fresh event loop."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@on_loop
async def test_no_body_is_made_until_a_scrape_asks():
    peers = Peers({1, 2})
    rounds = Rounds(asyncio.get_running_loop(), peers.collect, peers.build)
    await asyncio.sleep(0.05)
    assert peers.asked == [] and peers.built == [] and rounds.body == b""


@on_loop
async def test_a_scrape_gets_a_body_made_once_every_peer_answered_and_never_at_once():
    peers = Peers({1, 2})
    rounds = Rounds(asyncio.get_running_loop(), peers.collect, peers.build)
    got: list[bytes] = []
    rounds.gather(lambda: got.append(rounds.body))
    assert got == [] and peers.asked == []  # (`done` never before `gather` returns)
    await settle()
    assert [r for r, _ in peers.asked] == [1]
    rounds.heard(1, 1)
    rounds.heard(2, 0)  # (an answer to another round counts for nothing)
    await settle()
    assert got == [] and peers.built == []
    rounds.heard(2, 1)
    assert got == [b"body 1"]


@on_loop
async def test_a_scrape_asking_during_a_round_waits_for_the_next():
    # (the round's peers may have sent their series before its call was answered)
    peers = Peers({1})
    rounds = Rounds(asyncio.get_running_loop(), peers.collect, peers.build)
    got: list[tuple[str, bytes]] = []
    rounds.gather(lambda: got.append(("first", rounds.body)))
    await settle()
    rounds.gather(lambda: got.append(("second", rounds.body)))
    rounds.heard(1, 1)
    assert got == [("first", b"body 1")]
    await asyncio.sleep(0.01)  # (the next round's start: paced by the build, a few µs here)
    assert [r for r, _ in peers.asked] == [1, 2]
    rounds.heard(1, 2)
    assert got == [("first", b"body 1"), ("second", b"body 2")]


@on_loop
async def test_scrapes_asking_together_share_one_round():
    peers = Peers({1, 2, 3})
    rounds = Rounds(asyncio.get_running_loop(), peers.collect, peers.build)
    got: list[int] = []
    for i in range(10):
        rounds.gather(lambda i=i: got.append(i))  # type: ignore[misc]
    await settle()
    for number in (1, 2, 3):
        rounds.heard(number, 1)
    assert got == list(range(10)) and len(peers.asked) == 1 and len(peers.built) == 1


@on_loop
async def test_a_peer_that_exits_or_says_nothing_holds_no_round():
    peers = Peers({1, 2})
    loop = asyncio.get_running_loop()
    rounds = Rounds(loop, peers.collect, peers.build)
    got: list[float] = []
    rounds.gather(lambda: got.append(loop.time()))
    await settle()
    rounds.heard(1, 1)
    rounds.gone(2)  # (it exited: `Peers._watch`)
    assert len(got) == 1
    rounds.gather(lambda: got.append(loop.time()))
    await asyncio.sleep(0.01)
    began = peers.asked[-1][1]
    rounds.heard(1, 2)  # peer 2 (stopped) never answers: its last series count after COLLECT_SECONDS
    await asyncio.wait_for(_until(lambda: len(got) == 2), COLLECT_SECONDS * 5)
    assert got[1] - began >= COLLECT_SECONDS - 0.002


@on_loop
async def test_with_no_peer_serving_a_scrape_is_answered_in_the_next_turn():
    peers = Peers(set())
    rounds = Rounds(asyncio.get_running_loop(), peers.collect, peers.build)
    got: list[bytes] = []
    rounds.gather(lambda: got.append(rounds.body))
    assert got == []
    await settle()
    assert got == [b"body 1"]


@on_loop
async def test_rounds_are_paced_by_their_builds():
    # (scrapes in a loop cannot keep the first front-end busy building: the next round starts
    # no sooner than as long after a build as it took, as one front-end's builds are paced)
    peers = Peers(set(), build_seconds=0.05)
    rounds = Rounds(asyncio.get_running_loop(), peers.collect, peers.build)
    done = asyncio.Event()
    count = 0

    def again() -> None:
        nonlocal count
        count += 1
        if count == 4:
            done.set()
        else:
            rounds.gather(again)

    rounds.gather(again)
    await asyncio.wait_for(done.wait(), 10)
    starts = [t for _, t in peers.asked]
    for built, start in zip(peers.built, starts[1:]):
        assert start - built >= 0.05 - 0.002, (peers.built, starts)


@on_loop
async def test_the_stop_answers_the_scrapes_waiting_and_makes_no_more_rounds():
    # (hostile testing, round 130: a scrape waiting for its round at SIGTERM was closed unanswered)
    peers = Peers({1})
    rounds = Rounds(asyncio.get_running_loop(), peers.collect, peers.build)
    got: list[bytes] = []
    rounds.gather(lambda: got.append(rounds.body))
    await settle()
    rounds.gather(lambda: got.append(rounds.body))  # (for the next round)
    rounds.stop()
    assert got == [b"body 1", b"body 1"] and len(peers.asked) == 1
    rounds.gather(lambda: got.append(rounds.body))
    assert len(got) == 2  # (never before `gather` returns)
    await asyncio.sleep(COLLECT_SECONDS + 0.1)
    assert got == [b"body 1"] * 3 and len(peers.built) == 1 and len(peers.asked) == 1


async def _until(condition) -> None:  # type: ignore[no-untyped-def]
    while not condition():
        await asyncio.sleep(0.005)



@on_loop
async def test_a_body_that_cannot_be_made_leaves_no_scrape_waiting():
    peers = Peers(set())
    failing = [True]

    def build() -> bytes:
        if failing[0]:
            raise ValueError("a collector broke")
        return peers.build()

    rounds = Rounds(asyncio.get_running_loop(), peers.collect, build)
    got: list[bytes] = []
    rounds.gather(lambda: got.append(rounds.body))
    await settle()
    assert got == [b""]  # (answered, with the last body: none yet)
    failing[0] = False
    rounds.gather(lambda: got.append(rounds.body))
    await asyncio.sleep(0.01)
    assert got == [b"", b"body 1"]


def test_a_sum_of_the_same_counts_in_another_order_never_goes_back():
    # (hostile testing, round 130: a dead peer's last counts moved to the end of the sum, and a
    # `_sum` read 342.13013300000006 then 342.130133: a counter reset to Prometheus)
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from broker.metrics import add_samples

    def families() -> list:  # type: ignore[type-arg]
        counter = CounterMetricFamily("rpc_broker_x_seconds", "x", labels=["m"])
        counter.add_metric(["a"], 0.1)
        gauge = GaugeMetricFamily("rpc_broker_open", "y")
        gauge.add_metric([], 5.0)
        return [counter, gauge]

    high: dict = {}  # type: ignore[type-arg]
    seen = []
    for others in (
        [[("rpc_broker_x_seconds", "rpc_broker_x_seconds_total", {"m": "a"}, 0.2)],
         [("rpc_broker_x_seconds", "rpc_broker_x_seconds_total", {"m": "a"}, 0.3),
          ("rpc_broker_open", "rpc_broker_open", {}, 2.0)]],
        [[("rpc_broker_x_seconds", "rpc_broker_x_seconds_total", {"m": "a"}, 0.5)]],  # (the same counts: 0.2 + 0.3)
        [[("rpc_broker_x_seconds", "rpc_broker_x_seconds_total", {"m": "a"}, 0.6)]],
    ):
        got = families()
        add_samples(got, others, high)
        seen.append((got[0].samples[0].value, got[1].samples[0].value))
    assert (0.1 + 0.2) + 0.3 > 0.1 + 0.5  # (the floats' order matters)
    assert [counter for counter, _ in seen] == [(0.1 + 0.2) + 0.3] * 2 + [0.1 + 0.6]
    assert [gauge for _, gauge in seen] == [7.0, 5.0, 5.0]  # (a gauge goes down: a peer gone)
