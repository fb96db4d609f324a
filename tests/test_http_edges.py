"""HTTP front-end edges found by hostile testing (attack report A, items 1, 3, 5, 9, 10, 12).

Pipelined /metrics scrapes, chunked trailers, 100 Continue, absolute-form targets,
framing and version checks, and the probes' reserve: over real loopback sockets, the
daemon itself, or `HttpProtocol` in this process where what is counted is inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
import struct
import threading
import time
import typing
from collections.abc import AsyncIterator, Callable

import pytest
from conftest import Broker, sample, scrape_metrics, wait_for
from test_http_hardening import get, post, post_head
from test_http_protocol import Conn, call

from broker.frontend.http import HttpFrontend, HttpProtocol

pytestmark = pytest.mark.usefixtures("event_loop_name")  # (on both event loops: conftest.BOTH_LOOPS)

# -- item 1: /metrics scrapes, pipelined ----------------------------------------------------


class Ticker:
    """Counts the running loop's iterations: a callback that schedules itself again."""

    def __init__(self) -> None:
        self.tick = 0
        self.running = True
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._step)

    def _step(self) -> None:
        self.tick += 1
        if self.running:
            self._loop.call_soon(self._step)


@contextlib.asynccontextmanager
async def metrics_listener(
    metrics: Callable[[], bytes], max_connections: int = 10000
) -> AsyncIterator[tuple[int, HttpFrontend]]:
    """An `HttpFrontend` in this process (no workers) serving `metrics` as /metrics on
    loopback; yields its port and itself, and aborts its connections at the end."""
    from broker.dispatch import Dispatcher

    loop = asyncio.get_running_loop()
    fe = HttpFrontend(Dispatcher(loop), metrics=metrics, allowed_hosts=["127.0.0.1"], max_connections=max_connections)
    server = await loop.create_server(fe.protocol, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], fe
    finally:
        server.close()
        for conn in list(fe.connections):
            conn.abort()
        await server.wait_closed()


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    """One answer with a content-length: its body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0])
    return await asyncio.wait_for(reader.readexactly(length), 10)


def test_pipelined_scrapes_build_no_head_body_and_one_get_body_per_loop_iteration():
    """1,400 pipelined HEAD /metrics built the whole scrape each (to send 150 bytes) and
    1,000 GETs were all built in one read: the loop stalled for seconds. A HEAD builds no
    body; GET bodies are made one per loop iteration at most, and another connection's
    /healthz is answered while scrapes are still owed."""
    heads, gets = 300, 40
    ticks: list[int] = []  # the loop iteration of each scrape made

    async def scenario() -> None:
        ticker = Ticker()

        def metrics() -> bytes:
            ticks.append(ticker.tick)
            return b"# a scrape\n" * 2000

        async with metrics_listener(metrics) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            writer.write(get("/metrics", "HEAD") * heads)
            # The HEAD answers come whole, with no scrape made for them.
            for _ in range(heads):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 200 ") and b"text/plain" in head, head
            assert ticks == []
            # Another connection is answered while most GET bodies are still owed.
            writer.write(get("/metrics") * gets)
            await writer.drain()
            w2.write(get("/healthz"))
            assert (await asyncio.wait_for(r2.readuntil(b"\r\n"), 10)).startswith(b"HTTP/1.1 200")
            assert len(ticks) < gets, len(ticks)
            w2.close()
            for _ in range(gets):
                assert len(await read_answer(reader)) == 2000 * 11
            writer.close()
        ticker.running = False

    asyncio.run(scenario())
    assert len(ticks) == gets
    assert len(set(ticks)) == gets, "two scrapes made in one loop iteration"


def test_one_scrape_build_answers_every_connection_and_a_newcomer_waits_one_build():
    """Connections pipelining scrapes took turns, one build each: a new scrape waited for
    as many builds as connections had scrapes owed (600 connections pipelining GET /metrics
    and reading the answers made every Prometheus scrape time out at 10 s). One build now
    answers every scrape parsed before it, one copy a connection: a newcomer's scrape gets
    the first build made after its request was parsed, every answer is from a build made
    after its request was parsed, and N such connections cost one build per build, not N."""
    conns, gets = 40, 10
    ticks: list[int] = []  # the loop iteration of each build
    parsed: list[dict[int, int]] = []  # at each build: requests parsed on each connection, by client port

    async def scenario() -> tuple[list[list[int]], list[int], int, int]:
        ticker = Ticker()
        listener: list[HttpFrontend] = []

        def metrics() -> bytes:
            ticks.append(ticker.tick)
            parsed.append({
                conn.transport.get_extra_info("peername")[1]: conn.requests
                for conn in listener[0].connections if conn.transport is not None
            })  # fmt: skip
            return b"# build %d\n" % len(ticks)  # (small: no connection's writing pauses)

        async def answers(reader: asyncio.StreamReader, n: int) -> list[int]:
            return [int((await read_answer(reader)).split()[-1]) for _ in range(n)]

        async with metrics_listener(metrics) as (port, fe):
            listener.append(fe)
            pairs = [await asyncio.open_connection("127.0.0.1", port) for _ in range(conns)]
            for _, writer in pairs:
                writer.write(get("/metrics") * gets)
            readers = [asyncio.ensure_future(answers(reader, gets)) for reader, _ in pairs]
            while len(ticks) < 2:  # scrapes owed on every connection, 8 builds to go at least
                await asyncio.sleep(0)
            r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            w2.write(get("/healthz"))  # answered between builds
            assert (await asyncio.wait_for(r2.readuntil(b"\r\n"), 10)).startswith(b"HTTP/1.1 200")
            await asyncio.wait_for(r2.readuntil(b"}"), 10)  # (the rest of it)
            newcomer = w2.get_extra_info("sockname")[1]
            w2.write(get("/metrics"))
            (build,) = await answers(r2, 1)
            got = [await asyncio.wait_for(task, 30) for task in readers]
            ports = [writer.get_extra_info("sockname")[1] for _, writer in pairs]
            for _, writer in pairs:
                writer.close()
            w2.close()
        ticker.running = False
        return got, ports, newcomer, build

    got, ports, newcomer, build = asyncio.run(scenario())
    # The newcomer's scrape (its second request: after /healthz) was parsed before the
    # build that answered it, and after the one before that.
    assert parsed[build - 1][newcomer] == 2 and parsed[build - 2].get(newcomer, 0) < 2, (build, len(parsed))
    # Every answer is from a build made after its request was parsed: the j-th answer on a
    # connection, from a build that had seen j requests on it; one copy of a build each.
    for port, builds in zip(ports, got, strict=True):
        assert all(parsed[b - 1][port] >= j for j, b in enumerate(builds, 1)), (port, builds)
        assert builds == sorted(set(builds)), builds
    # One build per loop iteration at most, and a few more builds than one connection's
    # scrapes, not one for each scrape of each connection (400).
    assert len(set(ticks)) == len(ticks), "two builds in one loop iteration"
    assert gets <= len(ticks) < 2 * gets, len(ticks)


def test_pipelined_scrapes_leave_the_loop_as_long_between_them_as_they_take():
    """One scrape per loop iteration still cost one scrape per iteration of everyone
    else's calls (70-100 ms a call with the demo tools' 20 ms scrapes). The next build
    waits as long as the last one took: builds take at most half of the loop's time."""
    conns, gets, busy = 3, 4, 0.005
    spans: list[tuple[float, float]] = []  # (start, end) of each scrape, monotonic

    def metrics() -> bytes:
        start = time.monotonic()
        while time.monotonic() - start < busy:  # a scrape's CPU
            pass
        spans.append((start, time.monotonic()))
        return b"# a scrape\n"

    async def scenario() -> None:
        async with metrics_listener(metrics) as (port, _):
            pairs = [await asyncio.open_connection("127.0.0.1", port) for _ in range(conns)]
            for _, writer in pairs:
                writer.write(get("/metrics") * gets)
            for reader, writer in pairs:
                for _ in range(gets):
                    await read_answer(reader)
                writer.close()

    asyncio.run(scenario())
    assert len(spans) >= gets  # (one copy of a build a connection: `gets` builds at least)
    # (a lower bound the loop keeps however loaded the machine; half of it: uvloop's
    # clock counts whole milliseconds)
    short = [(a, b, c) for (a, b), (c, _) in itertools.pairwise(spans) if c - b < (b - a) / 2]
    assert not short, short


# -- items 3 and 9: the trailer section of a chunked body -----------------------------------


def chunked_head(b: Broker) -> bytes:
    return post_head(b, "Transfer-Encoding: chunked\r\n\r\n")


def test_an_unfinished_trailer_line_past_64_kib_gets_431(broker_factory):
    """After the last chunk, one unfinished trailer line was counted by nothing: 150 MB
    grew in httptools' buffer (quadratic copies). It counts against the head limit."""
    b = broker_factory("--workers", "1")
    body = call("add", [1, 2]).encode()
    with Conn(b, timeout=10) as c:
        c.send(chunked_head(b) + b"%x\r\n%s\r\n0\r\nX-T: " % (len(body), body))
        status = None
        try:
            for _ in range(40):  # up to 80 KiB, in reads of their own
                c.send(b"a" * 2048)
                if c.closed_within(0.01):
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        status = c.response()[0]
        assert status == 431


def test_one_chunk_line_past_64_kib_gets_431(broker_factory):
    """A chunk-size line's extension (`5;a=xxxx...`) was counted as neither head nor body:
    a client sent 1 GB of one chunk line within request_timeout, all parsed, and the
    request was then served (node caps extensions at 16 KiB, CVE-2024-22019). What a
    chunked body sends besides its data counts against the head's limit, plus a little a chunk."""
    b = broker_factory("--workers", "1")
    with Conn(b, timeout=10) as c:
        c.send(chunked_head(b) + b"5;a=")
        try:
            for _ in range(64):  # up to 256 KiB, in reads of their own
                c.send(b"x" * 4096)
                if c.closed_within(0.01):
                    break
            c.send(b"\r\n[1]  \r\n0\r\n\r\n")  # the request ends: it was served
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, body = c.response()
        assert (status, headers["connection"]) == (431, "close"), body


def test_a_chunk_line_past_64_kib_in_the_read_that_ends_the_request_gets_431(broker_factory):
    """The bound was checked after a parser feed only, and by then a request that ended in
    the feed had its count reset: a 100,000-byte chunk extension sent in one write with the
    rest of the request was served 200, alone or after another request, and so was an
    Upgrade request's body. A request is checked as it ends, counting the piece it ends in."""
    b = broker_factory("--workers", "1")
    body = call("add", [1, 2]).encode()
    one = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    long = b"%x;a=%s\r\n%s\r\n0\r\n\r\n" % (len(body), b"x" * 100_000, body)
    upgrade = post_head(b, "Connection: Upgrade\r\nUpgrade: h2c\r\nTransfer-Encoding: chunked\r\n\r\n")
    for before, head in [(b"", chunked_head(b)), (chunked_head(b) + one, chunked_head(b)), (b"", upgrade)]:
        with Conn(b, timeout=10) as c:
            try:
                c.send(before + head + long)
            except (BrokenPipeError, ConnectionResetError):
                pass
            if before:
                assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')
            status, headers, answer = c.response()
            assert (status, headers.get("connection")) == (431, "close"), (before, head, answer)


def test_chunked_calls_pipelined_in_one_write_are_each_held_to_their_own_bound(broker_factory):
    """The bound is checked as a request ends, counting the piece of the read it ends in,
    which may hold the requests after it: three chunked calls of 100 KB in one chunk
    each (a few bytes of framing), pipelined in one write, are all served."""
    b = broker_factory("--workers", "1")
    body = call("add", [1, 2]).encode().ljust(100_000)  # (JSON allows trailing whitespace)
    request = chunked_head(b) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with Conn(b, timeout=10) as c:
        c.send(request * 3)
        for _ in range(3):
            assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')


@pytest.mark.parametrize("extension", [b";x=1", b";x=" + b"a" * 200])
def test_chunk_extensions_count_a_little_a_chunk(broker_factory, extension):
    """The bound on a chunked body's framing grows with its chunks (CHUNK_FRAMING_BYTES
    each, with MAX_HEADER_BYTES to start): a short extension on each of 1,000 chunks is
    served; 200 bytes of extension on each goes past the bound long before the body ends."""
    from broker.frontend.http import CHUNK_FRAMING_BYTES, MAX_HEADER_BYTES

    b = broker_factory("--workers", "1")
    body = call("add", [1, 2]).encode().ljust(64 * 1000)  # (JSON allows trailing whitespace)
    chunks = b"".join(b"40%s\r\n%s\r\n" % (extension, body[i : i + 64]) for i in range(0, len(body), 64))
    framing = len(chunks) - len(body)
    with Conn(b, timeout=10) as c:
        try:
            c.send(chunked_head(b) + chunks + b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, answer = c.response()
    if framing < MAX_HEADER_BYTES + 1000 * CHUNK_FRAMING_BYTES:
        assert (status, answer) == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')
    else:
        assert status == 431, answer


def test_many_trailer_fields_get_431(broker_factory):
    b = broker_factory("--workers", "1")
    body = call("add", [1, 2]).encode()
    with Conn(b) as c:
        c.send(chunked_head(b) + b"%x\r\n%s\r\n0\r\n" % (len(body), body) + b"X: a\r\n" * 120 + b"\r\n")
        assert c.response()[0] == 431


@pytest.mark.parametrize(
    "trailer",
    ["Host: evil.example", "Origin: http://evil.example", "Content-Type: text/plain", "Expect: 100-continue"],
)
def test_trailer_fields_do_not_override_header_fields(broker_factory, trailer):
    """A trailer Host, Origin or Content-Type made a good request get 421, 403 or 415
    (RFC 9110 6.5.1: trailer fields are not merged into the header section)."""
    b = broker_factory("--workers", "1")
    body = call("add", [1, 2]).encode()
    with Conn(b) as c:
        c.send(chunked_head(b) + b"%x\r\n%s\r\n0\r\n%s\r\n\r\n" % (len(body), body, trailer.encode()))
        assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')
        c.send(get("/healthz"))  # and the connection goes on
        assert c.response()[0] == 200


# -- item 10: 100 Continue -------------------------------------------------------------------


def expect_post(b: Broker, body: bytes, version: str = "1.1", host: str = "127.0.0.1", ct: str = "application/json") -> bytes:
    return (
        f"POST {b.path} HTTP/{version}\r\nHost: {host}\r\nContent-Type: {ct}\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    ).encode() + body


def test_100_continue_is_never_ahead_of_an_earlier_answer(broker_factory):
    """100 Continue was written at once, before the final answer to an earlier
    pipelined request still being served (out of order)."""
    b = broker_factory("--workers", "1")
    with Conn(b) as c:
        c.send(post(call("sleep", [0.3]), path=b.path) + expect_post(b, call("add", [1, 2]).encode()))
        assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":0.3}')
        assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')  # no 100 between


@pytest.mark.parametrize(
    ("version", "host", "ct", "status"),
    [("1.0", "127.0.0.1", "application/json", 200), ("1.1", "evil.example", "application/json", 421),
     ("1.1", "127.0.0.1", "text/plain", 415)],
)
def test_no_100_continue_to_http_1_0_nor_before_a_refusal(broker_factory, version, host, ct, status):
    b = broker_factory("--workers", "1")
    with Conn(b) as c:
        c.send(expect_post(b, call("add", [1, 2]).encode(), version, host, ct))
        assert c.response()[0] == status  # the first answer: not 100


def test_100_continue_for_a_call_that_will_be_served(broker_factory):
    b = broker_factory("--workers", "1")
    with Conn(b) as c:
        request = expect_post(b, call("add", [1, 2]).encode())
        head, _, body = request.partition(b"\r\n\r\n")
        c.send(head + b"\r\n\r\n")
        assert c.response()[0] == 100
        c.send(body)
        assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')


# -- item 12: request targets, framing, versions ---------------------------------------------


def test_absolute_form_targets_are_served_by_their_authority(broker_factory):
    """`POST http://127.0.0.1:PORT/ HTTP/1.1` got 404; the target's authority is the host
    checked, and the Host header is ignored (RFC 9112 3.2.2)."""
    b = broker_factory("--workers", "1")
    body = call("add", [1, 2])
    good = post(body, path=f"http://127.0.0.1:{b.port}{b.path}").replace(b"Host: 127.0.0.1", b"Host: evil.example")
    bad = post(body, path=f"http://evil.example{b.path}?x=1")
    with Conn(b) as c:
        c.send(good + bad + f"GET HTTP://localhost:{b.port}/healthz HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')
        assert c.response()[0] == 421
        assert c.response()[0] == 200


@pytest.mark.parametrize(
    ("authority", "status"),
    [
        ("127.0.0.1:", 200),  # an empty port (RFC 3986 3.2.3 allows it): got 404 in the target
        ("127.0.0.1:65535", 200),
        ("[::1]:", 200),  # (round 9: 421 after an IPv6 literal)
        ("127.0.0.1:99999", 421),  # past 65535 no port (round 9: served); got 404 in the target
        ("[::1", 421),  # no closing bracket (round 9: served)
        ("LocalHost:1", 200),
        ("[::1]", 200),
        ("127.0.0.1:x", 421),  # got 404 in the target
        ("u@127.0.0.1", 421),  # userinfo (RFC 9110 4.2.4): was served in the target
        ("", 421),  # got 404 in the target
        ("evil.example", 421),
    ],
)
def test_an_absolute_form_authority_is_checked_exactly_like_a_host_header(broker_factory, authority, status):
    """The authority of `POST http://AUTHORITY/ HTTP/1.1` replaces the Host header (RFC
    9112 3.2.2): the same value gets the same answer in either place."""
    b = broker_factory("--workers", "1")
    body = call("add", [1, 2])
    in_host = post(body, path=b.path).replace(b"Host: 127.0.0.1", f"Host: {authority}".encode())
    in_target = post(body, path=f"http://{authority}{b.path}").replace(b"Host: 127.0.0.1", b"Host: 127.0.0.1:1")
    with Conn(b) as c:
        c.send(in_host + in_target)
        got = [c.response()[0], c.response()[0]]
    assert got == [status, status], authority


@pytest.mark.parametrize(
    ("request_", "status"),
    [
        (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: identity, chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"0\r\n\r\n", 400),
        (b"GET /healthz HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n", 505),
        # (hostile testing, round 8: versions the parser does not know were 400, not 505)
        (b"GET /healthz HTTP/1.2\r\nHost: 127.0.0.1\r\n\r\n", 505),
        (b"POST / HTTP/3.0\r\nHost: 127.0.0.1\r\n\r\n", 505),
        # HTTP/2's connection preface, sent with prior knowledge (round 26: 400 "Pause on PRI/Upgrade")
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
        (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n", 400),
    ],
)
def test_bad_framing_version_and_duplicate_host_are_refused(broker_factory, request_, status):
    b = broker_factory("--workers", "1")
    # (round 27: the 505 series was not exported from the start, so rate() missed the first)
    before = sample(scrape_metrics(b), "rpc_broker_http_responses_total", path="other", status=str(status))
    with Conn(b) as c:
        c.send(request_)
        got, headers, _ = c.response()
        assert (got, headers.get("connection")) == (status, "close")
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_http_responses_total", path="other",
                            status=str(status)) == before + 1)


# -- item 5: the probes' reserve ------------------------------------------------------------


def healthz_served(b: Broker) -> bool:
    try:
        with Conn(b, timeout=2) as c:
            c.send(get("/healthz"))
            return c.response()[0] == 200
    except (OSError, EOFError):
        return False


@pytest.mark.parametrize("mode", ["slowloris", "bad"])
def test_a_full_broker_answers_its_probes_past_hostile_connections(broker_factory, mode):
    """max_connections + 8 connections that each trickle a head (slowloris), or sent
    "X\\r\\n" and were half-closed after their 400 (lingering), took every slot and the
    probes' reserve for up to 30 s (or 75 s): /healthz got 503."""
    from broker.frontend.base import LINGER_TIMEOUT
    from broker.frontend.http import PROBE_RESERVE

    b = broker_factory("--workers", "1", "--max-connections", "4")
    hostile = [socket.create_connection(("127.0.0.1", b.port)) for _ in range(4 + PROBE_RESERVE)]
    try:
        for s in hostile:
            s.sendall(b"GET /healthz HTTP/1.1\r\nX-a: " if mode == "slowloris" else b"X\r\n")
        for _ in range(3):  # and again: the reserve is taken back each time
            for s in hostile:
                if mode == "slowloris":
                    try:
                        s.send(b"a")
                    except OSError:
                        pass
            wait_for(lambda: healthz_served(b), timeout=3 * LINGER_TIMEOUT / 5, interval=0.1)
        if mode == "bad":  # and the lingering ones are closed after LINGER_TIMEOUT
            for s in hostile:
                s.settimeout(LINGER_TIMEOUT + 4)
                try:
                    while s.recv(65536):
                        pass
                except ConnectionResetError:
                    pass
    finally:
        for s in hostile:
            s.close()


@pytest.mark.parametrize("mode", ["pipelined", "looping"])
def test_clients_scraping_on_the_probes_reserve_cannot_hold_the_probes_out(broker_factory, mode):
    """A reserve connection owed its answer kept its place: 8 that pipelined GET /metrics
    and never read were owed scrapes until send_timeout (60 s), and /healthz got 503
    "too many connections" for as long as they liked (a liveness probe would have the pod
    restarted). So did 8 that scrape in a loop, reading each answer: each one's scrape
    waits for the others' turns, so each is owed one nearly all the time. A probe now
    needs no place (answered at once); a scrape takes one: a pipelining one is reset."""
    from broker.frontend.http import PROBE_RESERVE

    b = broker_factory("--workers", "1", "--max-connections", "4")
    held = []  # the main pool: calls in flight, owed their answers (no place to give)
    for _ in range(4):
        held.append(s := socket.create_connection(("127.0.0.1", b.port)))
        s.sendall(post(call("sleep", [60]), path=b.path))
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_calls_in_flight") == 4, timeout=10)
    hogs: list[socket.socket] = []
    stop = threading.Event()
    loopers: list[threading.Thread] = []
    scrapes = [0]

    def loop_scrapes() -> None:  # scrape, read it, again; reconnect when put out
        while not stop.is_set():
            try:
                with Conn(b, timeout=5) as c:
                    hogs.append(c.sock)
                    while not stop.is_set():
                        c.send(get("/metrics"))
                        if c.response()[0] != 200:
                            break
                        scrapes[0] += 1
            except (OSError, EOFError):
                pass

    try:
        if mode == "pipelined":
            for _ in range(PROBE_RESERVE):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
                s.connect(("127.0.0.1", b.port))
                s.sendall(get("/metrics") * 2000)
                hogs.append(s)
            for s in hogs:  # each is in the reserve, owed scrapes: its first has come
                s.settimeout(10)
                assert s.recv(1).startswith(b"H")
        else:
            loopers = [threading.Thread(target=loop_scrapes, daemon=True) for _ in range(PROBE_RESERVE)]
            for t in loopers:
                t.start()
            wait_for(lambda: scrapes[0] >= 2 * PROBE_RESERVE, timeout=20)
        served = []
        for _ in range(8):
            served.append(healthz_served(b))
            time.sleep(0.1)
        assert served == [True] * len(served), served
        if mode == "looping":
            # Prometheus among them: a scrape on its kept connection, retried once on a new
            # one if that was closed between scrapes (as Go's HTTP client does), and a new
            # one after an answer saying close: a scrape displaced from the reserve while it
            # waited for its build got 503 (20 of 30, hostile testing round 8); answered
            # from the last build now.
            statuses = []
            prometheus = Conn(b, timeout=5)
            try:
                for _ in range(20):
                    for _attempt in range(2):
                        try:
                            prometheus.send(get("/metrics"))
                            status, headers, _ = prometheus.response()
                            break
                        except (OSError, EOFError):
                            status, headers = 0, {}
                            prometheus.sock.close()
                            prometheus = Conn(b, timeout=5)
                    statuses.append(status)
                    if status != 200 or headers.get("connection") == "close":
                        prometheus.sock.close()
                        prometheus = Conn(b, timeout=5)
                    time.sleep(0.05)
            finally:
                prometheus.sock.close()
            assert statuses == [200] * len(statuses), statuses
        if mode == "pipelined":  # a scrape takes a place: a pipelining one's, reset (its answers dropped)
            with Conn(b, timeout=5) as prometheus:
                prometheus.send(get("/metrics"))
                assert prometheus.response()[0] == 200
            # A reset hog's client may not see the broker's RST: its kernel, short of memory at
            # this SO_RCVBUF, dropped segments it had advertised room for, so the RST's
            # sequence number is past what it expects and is ignored (RFC 5961 3.2; CI saw
            # 0 of 8 gone once in 5 runs, with the broker's log saying one was reset). A byte
            # sent on each has the peer's kernel, which holds no socket for a reset one,
            # answer with an RST that it takes (an unfinished request line for the others).
            for s in hogs:
                with contextlib.suppress(OSError):
                    s.send(b"G")
            time.sleep(0.3)
            gone = 0
            for s in hogs:
                s.setblocking(False)
                try:
                    for _ in range(64):  # (what is still unread, of an answer cut short)
                        if not s.recv(65536):
                            gone += 1  # (an orderly end: counted too, though a reset is what comes)
                            break
                except ConnectionResetError:
                    gone += 1
                except BlockingIOError:
                    pass  # still open: its client is owed scrapes
            assert gone >= 1, gone
    finally:
        stop.set()
        for t in loopers:
            t.join(10)
        for s in held:  # reset, not closed: a half-closed client is still answered, after its 60 s
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        for s in held + hogs:
            s.close()


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait in the running loop until `predicate()` holds (checked every millisecond)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def served_side(fe: HttpFrontend, writer: asyncio.StreamWriter) -> HttpProtocol | None:
    """The listener's connection for the client side `writer`, if it holds one."""
    port = writer.get_extra_info("sockname")[1]
    for conn in fe.connections:
        if conn.transport is not None and conn.transport.get_extra_info("peername")[1] == port:
            return typing.cast(HttpProtocol, conn)
    return None


@contextlib.asynccontextmanager
async def full_listener() -> AsyncIterator[tuple[int, HttpFrontend]]:
    """`metrics_listener` at max_connections 2, both taken by calls owed their answers
    (queued: it has no worker), so a connection opened now goes to the probes' reserve;
    its next /metrics build is held (its pace never ends) until `fe._scrape_due()`."""
    async with metrics_listener(lambda: b"# a scrape\n", max_connections=2) as (port, fe):
        fe.dispatcher.set_methods(["add"])  # (known, so queued: with no worker it waits for good)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for _, writer in held:
            writer.write(post(call("add", [1, 2]), path="/"))
        await until(lambda: sum(conn.owed for conn in fe.connections) == 2)
        fe._pace = lambda started: None  # type: ignore[method-assign]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get("/metrics"))  # a build now: the next one waits
        await read_answer(reader)
        writer.close()
        yield port, fe
        for _, writer in held:
            writer.close()


async def status_of(reader: asyncio.StreamReader) -> int:
    return int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)).split()[1])


def test_a_scrape_waiting_for_its_build_in_the_probes_reserve_outlasts_silent_newcomers():
    """At max_connections, a scrape waiting in the probes' reserve for its build was owed
    its answer, which the reserve gave up before a connection silent since accepted: an
    attacker opening a silent connection every 20 ms had every Prometheus scrape answered
    503 (37 of 37). Owed an answer goes last now: the silent ones go, oldest first."""
    from broker.frontend.http import PROBE_RESERVE

    async def scenario() -> int:
        async with full_listener() as (port, fe):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(get("/metrics"))  # Prometheus: it waits for the next build
            await until(lambda: (conn := served_side(fe, writer)) is not None and conn.owed == 1)
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2 * PROBE_RESERVE)]
            await until(lambda: served_side(fe, silent[-1][1]) is not None)  # (accepted in order)
            assert served_side(fe, silent[0][1]) is None  # (the reserve was full: the oldest gave its place)
            fe._scrape_due()
            status = await status_of(reader)
            for _, w in [*silent, (reader, writer)]:
                w.close()
            return status

    assert asyncio.run(scenario()) == 200


async def displaced_answer(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
    """The status, `connection` header and body of the answer a connection given up by
    the probes' reserve gets, read to the connection's end (it is closed after it)."""
    head, _, body = (await asyncio.wait_for(reader.read(), 10)).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get(b"connection", b""), body


def test_of_scrapes_waiting_in_the_probes_reserve_the_busiest_connection_gives_its_place_first():
    """When every connection in the probes' reserve is owed a scrape, a newcomer's scrape
    takes the place of the one that has made the most requests (a client scraping in a
    loop, not Prometheus, which makes one a scrape interval); it was the oldest request's.
    The one displaced is answered at once from the last build, and closed (it got 503:
    hostile testing, round 8, had 8 clients scraping in a loop win most places and a
    retrying Prometheus answered 503 on 20 of 30 scrapes)."""
    from broker.frontend.http import PROBE_RESERVE

    async def scenario() -> tuple[list[int], int]:
        async with full_listener() as (port, fe):
            scrapers = [await asyncio.open_connection("127.0.0.1", port) for _ in range(PROBE_RESERVE - 1)]
            for _, writer in scrapers:
                writer.write(get("/metrics"))  # one request each, waiting for the next build
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(10):  # a busy client: ten requests, then a scrape, the newest
                writer.write(get("/healthz"))
                assert await status_of(reader) == 200
                await asyncio.wait_for(reader.readuntil(b"}"), 10)
            writer.write(get("/metrics"))
            await until(lambda: len(fe.probe_conns) == PROBE_RESERVE and all(c.owed == 1 for c in fe.probe_conns))
            newcomer = await asyncio.open_connection("127.0.0.1", port)
            newcomer[1].write(get("/metrics"))
            await until(lambda: served_side(fe, newcomer[1]) in fe.probe_conns)
            busy = await displaced_answer(reader)  # (before the next build)
            fe._scrape_due()
            statuses = [await status_of(r) for r, _ in [*scrapers, newcomer]]
            for _, w in [*scrapers, (reader, writer), newcomer]:
                w.close()
            return statuses, busy

    statuses, busy = asyncio.run(scenario())
    assert (statuses, busy) == ([200] * PROBE_RESERVE, (200, b"close", b"# a scrape\n"))


def test_of_scrapes_waiting_in_the_probes_reserve_a_long_kept_prometheus_connection_keeps_its_place():
    """The rank among connections owed a scrape is requests per second of age (1 s at
    least), not a plain count: a Prometheus that has kept its connection for an hour has
    made hundreds of requests, far slower than the fresh connections an attacker churns
    (one request each, owed); with a plain count, the newcomer took Prometheus's place."""
    from broker.frontend.http import PROBE_RESERVE

    async def scenario() -> tuple[list[int], int]:
        async with full_listener() as (port, fe):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # Prometheus
            writer.write(get("/healthz"))
            assert await status_of(reader) == 200
            await asyncio.wait_for(reader.readuntil(b"}"), 10)
            await until(lambda: served_side(fe, writer) is not None)
            prometheus = served_side(fe, writer)
            prometheus.requests = 240  # an hour of scrapes every 15 s on this connection
            prometheus.accepted_at -= 3600
            writer.write(get("/metrics"))
            fresh = [await asyncio.open_connection("127.0.0.1", port) for _ in range(PROBE_RESERVE - 1)]
            for _, w in fresh:
                w.write(get("/metrics"))  # one request each, waiting for the next build
            await until(lambda: len(fe.probe_conns) == PROBE_RESERVE and all(c.owed == 1 for c in fe.probe_conns))
            newcomer = await asyncio.open_connection("127.0.0.1", port)
            newcomer[1].write(get("/metrics"))
            await until(lambda: served_side(fe, newcomer[1]) in fe.probe_conns)
            given_up = [c for c in (*fresh, newcomer) if served_side(fe, c[1]) is None]
            fe._scrape_due()
            kept = await status_of(reader)
            kept_open = served_side(fe, writer) is not None
            displaced = [await displaced_answer(r) for r, _ in given_up]
            for _, w in [*fresh, (reader, writer), newcomer]:
                w.close()
            return kept, kept_open, displaced

    kept, kept_open, displaced = asyncio.run(scenario())
    assert (kept, kept_open) == (200, True)
    assert displaced == [(200, b"close", b"# a scrape\n")]  # one fresh connection gave its place


def test_silent_newcomers_displace_no_scrape_owed_in_the_probes_reserve_and_probes_need_no_place():
    """Hostile testing (round 8): a newcomer always took the place of a reserve connection,
    so with all 8 places owed a scrape (7 clients scraping in a loop, and Prometheus) a
    flood of silent connections had scrapes answered 503, Prometheus's 13-23 of 30.
    A connection past max_connections now waits for its first request in a bounded
    overflow (PROBE_OVERFLOW, its oldest closed for a newcomer); only a scrape takes a
    place. A /healthz there is answered at once, with every place owed a scrape."""
    from broker.frontend.http import PROBE_OVERFLOW, PROBE_RESERVE

    async def scenario() -> tuple[list[int], int, int]:
        async with full_listener() as (port, fe):
            scrapers = [await asyncio.open_connection("127.0.0.1", port) for _ in range(PROBE_RESERVE)]
            for _, writer in scrapers:
                writer.write(get("/metrics"))  # each waiting for the next build
            await until(lambda: len(fe.probe_conns) == PROBE_RESERVE and all(c.owed == 1 for c in fe.probe_conns))
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2 * PROBE_OVERFLOW)]
            await until(lambda: served_side(fe, silent[-1][1]) is not None)  # (accepted in order)
            assert all(c.owed == 1 for c in fe.probe_conns)  # none displaced
            assert served_side(fe, silent[PROBE_OVERFLOW - 1][1]) is None  # the oldest of the overflow went
            assert len(fe.probe_overflow) == PROBE_OVERFLOW  # (bounded)
            probe = await asyncio.open_connection("127.0.0.1", port)
            probe[1].write(get("/healthz"))
            healthz = await status_of(probe[0])
            fe._scrape_due()
            statuses = [await status_of(r) for r, _ in scrapers]
            open_ = len(fe.connections)
            for _, w in [*scrapers, *silent, probe]:
                w.close()
            return statuses, healthz, open_

    statuses, healthz, open_ = asyncio.run(scenario())
    assert (statuses, healthz) == ([200] * PROBE_RESERVE, 200)
    assert open_ <= 2 + PROBE_RESERVE + PROBE_OVERFLOW


def test_a_scrape_connection_in_the_probes_reserve_keeps_its_place_between_scrapes():
    """Hostile testing (round 8): Prometheus's kept connection in the reserve, served and
    idle between scrapes, was closed for any newcomer (by make_room too, as an idle
    connection), so its every scrape came on a fresh connection and fought for a place.
    Silent newcomers now take no place: it is still open for its next scrape."""
    from broker.frontend.http import PROBE_OVERFLOW, PROBE_RESERVE

    async def scenario() -> list[int]:
        async with full_listener() as (port, fe):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            statuses = []
            silent: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
            for _ in range(2):
                writer.write(get("/metrics"))
                await until(lambda: (conn := served_side(fe, writer)) is not None and conn.owed == 1)
                fe._scrape_due()
                statuses.append(await status_of(reader))
                await read_answer_rest(reader)
                for _ in range(PROBE_RESERVE + PROBE_OVERFLOW):
                    silent.append(await asyncio.open_connection("127.0.0.1", port))
                await until(lambda: served_side(fe, silent[-1][1]) is not None)  # (accepted in order)
            for _, w in [*silent, (reader, writer)]:
                w.close()
            return statuses

    assert asyncio.run(scenario()) == [200, 200]


async def read_answer_rest(reader: asyncio.StreamReader) -> None:
    """The rest of an answer whose status line `status_of` read."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0])
    await asyncio.wait_for(reader.readexactly(length), 10)


def test_the_probes_reserve_overflow_closes_connections_silent_for_a_sweep():
    """The overflow's connections (past max_connections, no place taken) are closed once
    idle for a sweep: silent since accepted, or served a probe."""
    from broker.frontend.base import SWEEP_SECONDS
    from broker.frontend.http import PROBE_OVERFLOW

    async def scenario() -> list[bytes]:
        async with full_listener() as (port, fe):
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(PROBE_OVERFLOW - 1)]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(get("/healthz"))
            assert await status_of(reader) == 200
            await until(lambda: len(fe.probe_overflow) == PROBE_OVERFLOW)
            for conn in fe.probe_overflow:
                conn.last_active -= 2 * SWEEP_SECONDS
            fe._sweep()
            ends = [await asyncio.wait_for(r.read(), 10) for r, _ in silent]
            await asyncio.wait_for(reader.read(), 10)  # (the rest of its answer, then the end)
            for _, w in [*silent, (reader, writer)]:
                w.close()
            return ends

    assert asyncio.run(scenario()) == [b""] * (PROBE_OVERFLOW - 1)


def test_a_lingering_close_behind_a_large_answer_reads_on_and_cuts_nothing(broker_factory):
    """Hostile testing (round 23): a call with a 7 MB answer (more than the kernel's send
    queue takes), then a request refused 413 (a lingering close) whose client goes on
    uploading while it reads the answer at 400 KB/s. Reading had been paused while the
    answer left, and the lingering close did not resume it: the client looked silent, and
    5 s later the connection was closed with its bytes unread, a reset that cut the answer
    (2.7 of 6 MB arrived). It reads on, discarding, and closes only once the answers are
    taken: both arrive whole."""
    b = broker_factory("--workers", "1", "--app", "tests.apps.ledger:registry")
    body = json.dumps({"jsonrpc": "2.0", "method": "big", "params": [7_000_000], "id": 1}).encode()
    s = socket.create_connection(("127.0.0.1", b.port))
    try:
        s.sendall(post(body, b.path) + b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50000000\r\n\r\n")
        stop = threading.Event()

        def upload() -> None:  # the refused body, still coming (bounded: 20 s at most)
            deadline = time.monotonic() + 20
            with contextlib.suppress(OSError):
                while not stop.is_set() and time.monotonic() < deadline:
                    s.send(b" " * 65536)
                    time.sleep(0.02)

        uploader = threading.Thread(target=upload, daemon=True)
        uploader.start()
        got = bytearray()
        s.settimeout(30)
        try:
            while chunk := s.recv(16384):
                got += chunk
                time.sleep(len(chunk) / 400_000)
        finally:
            stop.set()
            uploader.join(5)
    finally:
        s.close()
    assert got.count(b"HTTP/1.1 200 OK") == 1 and got.count(b"HTTP/1.1 413 ") == 1, bytes(got[:200])
    head, _, rest = bytes(got).partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    assert json.loads(rest[:length])["result"] == "x" * 7_000_000


def test_a_refused_request_queued_behind_slow_answers_reads_on(broker_factory):
    """Hostile testing (round 24): a large answer, a slow call, then a request refused 413
    whose client uploads the refused body before it reads. The first answer filled the
    write buffer, so reading paused, and resumed only once the 413 was written, behind
    the slow call: the client, blocked mid-upload, read nothing, and send_timeout reset
    the connection (the 8 MB answer cut at 128 kB, the others lost). Its input is
    discarded from the refusal on: reading goes on, and every answer arrives."""
    b = broker_factory("--workers", "2", "--app", "tests.apps.ledger:registry", "--send-timeout", "4",
                       "--method-timeout", "hold=60")
    first = json.dumps({"jsonrpc": "2.0", "method": "big", "params": [8_000_000], "id": 1}).encode()
    slow = json.dumps({"jsonrpc": "2.0", "method": "hold", "params": [6.0], "id": 2}).encode()
    size = 20_000_000
    s = socket.create_connection(("127.0.0.1", b.port))
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.sendall(post(first, b.path) + post(slow, b.path) + b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size)
        time.sleep(1.0)
        s.settimeout(40)
        sent = 0
        while sent < size:  # (all of it before reading: blocked if the broker does not read)
            sent += s.send(b" " * min(65536, size - sent))
        got = bytearray()
        while chunk := s.recv(1 << 20):
            got += chunk
    finally:
        s.close()
    assert re.findall(rb"HTTP/1\.1 \d\d\d", bytes(got)) == [b"HTTP/1.1 200", b"HTTP/1.1 200", b"HTTP/1.1 413"]
    assert b'"id":2,"result":6.0' in got and got.count(b"x" * 1000) >= 7000


def test_a_post_with_no_length_gets_411_saying_so(broker_factory):
    """Hostile testing, round 77 (LOW): a POST with neither Content-Length nor
    Transfer-Encoding (`curl -X POST` with no data) got a bare -32700: it has no body (RFC
    9112 6.3), and 411 Length Required says what is missing (RFC 9110 15.5.12). An empty
    body declared so (Content-Length: 0) is still a parse error."""
    b = broker_factory("--workers", "1")
    with Conn(b) as c:
        c.send(post_head(b, "\r\n"))
        status, _, body = c.response()
        assert status == 411, (status, body)
        error = json.loads(body)["error"]
        assert error["code"] == -32600 and "Content-Length" in error["data"], error
        c.send(post(call("add", [1, 2]), path=b.path))  # (the connection serves on)
        assert c.response()[0] == 200
    status, _, body = b.post(b"")  # (http.client: Content-Length: 0)
    assert status == 400 and json.loads(body)["error"]["code"] == -32700, (status, body)
