"""HTTP front-end hardening (issue 9, items 3-10 and 15): the real daemon over loopback.

Each test holds one defect found by hostile testing: memory per connection, request
deadlines, head limits, the probes' reserve, h2c upgrades, drain, half-close, the
Date and Retry-After headers, and the `path` label of the HTTP responses counter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import pytest
from conftest import FREED_AT_ONCE, Broker, rss_kib, sample, scrape_metrics, wait_for
from test_http_protocol import Conn, call
from test_http_protocol import post as _post

pytestmark = pytest.mark.usefixtures("event_loop_name")  # (on both event loops: conftest.BOTH_LOOPS)

# Every request names the broker's bind address as its Host and POSTs JSON as
# application/json: what any Host or Content-Type check lets through.


def post(body: bytes | str, path: str, headers: str = "") -> bytes:
    """test_http_protocol.post with `Host: 127.0.0.1`."""
    request = _post(body, path=path, headers=headers)
    assert b"Host: localhost\r\n" in request
    return request.replace(b"Host: localhost\r\n", b"Host: 127.0.0.1\r\n", 1)


def post_head(b: Broker, headers: str) -> bytes:
    """The head of a JSON POST to the broker's RPC path; `headers` ends it (CRLF CRLF)."""
    return f"POST {b.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}".encode()


def get(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


def received_http_bytes(b: Broker) -> float:
    return sample(scrape_metrics(b), "rpc_broker_received_bytes_total", transport="http")


# -- item 3: chunked bodies stay within max_body_bytes in memory --------------------------


def test_a_body_in_small_chunks_costs_about_its_size_in_memory(broker_factory, event_loop_name):
    """1,000,000 bytes as 2-byte chunks held ~27 MB (one object per chunk); the body
    is one buffer now, so the broker grows by about the body's size. (Since hostile
    testing, 2-byte chunks are refused, 400 at about the 1041st chunk, for what they cost
    in CPU: test_a_body_in_tiny_chunks_...; this sends the smallest chunks taken in bulk,
    MIN_CHUNK_BYTES, plus the SMALL_CHUNKS chunks of 2 bytes a body may also have.) A body
    of 16 MB: the allocator's and the loop's own noise, up to a few MB, is small beside it
    (with 4 MB, 6,160 KiB grown was measured once in CI, 1.6 times the body)."""
    from broker.frontend.http import MIN_CHUNK_BYTES, SMALL_CHUNKS

    size = 16_000_000
    # (glibc's mmap threshold fixed: by default it rises to the largest block freed, up to 32 MiB,
    # and the growing buffer is then reallocated in the heap, copied, its old block kept: 2.0 times
    # the body was measured once in CI; mmapped, it grows in place by mremap)
    b = broker_factory("--workers", "1", "--max-body-bytes", str(16 << 20), "--max-frame-bytes", str(20 << 20),
                       "--max-response-bytes", str(20 << 20), env={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    filler = size - len(call("echo", [""], 1))
    body = call("echo", ["x" * filler], 1).encode()
    assert len(body) == size
    head = post_head(b, "Transfer-Encoding: chunked\r\n\r\n")
    tiny = 2 * SMALL_CHUNKS
    chunks = b"".join(b"2\r\n" + body[i:i + 2] + b"\r\n" for i in range(0, tiny, 2)) + b"".join(
        b"%x\r\n%s\r\n" % (len(body[i:i + MIN_CHUNK_BYTES]), body[i:i + MIN_CHUNK_BYTES])
        for i in range(tiny, len(body), MIN_CHUNK_BYTES))
    with Conn(b, timeout=60) as warm:  # the same body once in one piece: the allocator's steady state
        warm.send(post(body, path=b.path))
        status, _, answer = warm.response()
        assert status == 200 and json.loads(answer)["result"] == ["x" * filler]
    before_bytes = received_http_bytes(b)
    before = rss_kib(b.pid)
    with Conn(b, timeout=60) as c:
        c.send(head + chunks)  # all but the last chunk: the body is held, unfinished
        wait_for(lambda: received_http_bytes(b) >= before_bytes + len(head) + len(chunks), timeout=60)
        grown = rss_kib(b.pid) - before
        c.send(b"0\r\n\r\n")
        status, _, answer = c.response()
        assert status == 200 and json.loads(answer)["result"] == ["x" * filler]
    # The body is 15,625 KiB; one bytes object per chunk (250,000 here, 112 bytes each and a
    # list slot) would add ~1.9 times it. Measured, the mmap threshold fixed: 0.97-0.98 times
    # on both loops; holding each chunk under 4 KiB as an object, 2.9 times. At 4 MB the
    # loop's and allocator's noise (up to 2.2 MB, once in CI) was too near the bound.
    limit = 1.6 * size / 1024
    assert grown < limit, f"broker RSS grew by {grown} KiB while holding a {size:,}-byte chunked body"


# -- item 4: request_timeout ---------------------------------------------------------------


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_trickling_in_gets_408_after_request_timeout(broker_factory, framing):
    """One byte of body every 0.3 s resets the idle clock, but not the request's."""
    b = broker_factory("--workers", "1", "--request-timeout", "1")
    body = call("add", [1, 2]).encode()
    if framing == "chunked":
        head = post_head(b, "Transfer-Encoding: chunked\r\n\r\n")
        trickle = b"".join(b"1\r\n%c\r\n" % byte for byte in body)
    else:
        head = post_head(b, f"Content-Length: {len(body)}\r\n\r\n")
        trickle = body
    with Conn(b) as c:
        c.send(head)
        start = time.monotonic()
        answered = False
        for i in range(30):  # bounded: at most ~9 s, well short of the whole body
            try:
                c.send(trickle[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            if not c.nothing_pending() or c.closed_within(0.3):
                answered = True
                break
        assert answered
        status, headers, answer = c.response()
        elapsed = time.monotonic() - start
        assert (status, headers["connection"]) == (408, "close")
        assert b"request_timeout 1 s" in answer
        assert 0.9 <= elapsed < 6  # not before the timeout
        assert c.closed_within(5)
    # Only the arrival counts: a call that takes longer than request_timeout is answered.
    with Conn(b) as c:
        c.send(post(call("sleep", [1.5], "slow"), path=b.path))
        status, _, answer = c.response()
        assert (status, json.loads(answer)["result"]) == (200, 1.5)
        c.send(post(call("add", [1, 2]), path=b.path))  # and the connection lives on
        assert c.response()[0] == 200


# -- item 5: the whole head counts, and the number of header fields -----------------------


def test_many_small_header_fields_get_431(broker_factory):
    b = broker_factory("--workers", "1")
    many = b"X: a\r\n" * 20_000  # 120 KB in one read; names and values alone are 40 KB
    with Conn(b) as c:
        c.send(post_head(b, "") + many + b"Content-Length: 2\r\n\r\n{}")
        status, headers, answer = c.response()
        assert (status, headers["connection"]) == (431, "close")
        assert c.closed_within(5)
    body = call("add", [1, 2]).encode()
    # post() sends Host, Content-Type and Content-Length: 97 more make 100, the limit.
    for extra, expected in ((97, 200), (98, 431)):
        with Conn(b) as c:
            c.send(post(body, path=b.path, headers="".join(f"X-{i}: a\r\n" for i in range(extra))))
            status, _, answer = c.response()
            assert status == expected, (extra, answer)
            if expected == 431:
                assert b"too many header fields (limit 100)" in answer


def test_the_head_limit_counts_the_whole_request_line(broker_factory):
    """Hostile testing (round 30): only the request line's target counted, so a head of
    65,553 bytes passed the 64 KiB limit. The request line and the header lines count
    whole (with their CRLFs; the blank line that ends the head does not)."""
    from broker.frontend.http import MAX_HEADER_BYTES

    b = broker_factory("--workers", "1")
    for size, expected in ((MAX_HEADER_BYTES, 200), (MAX_HEADER_BYTES + 1, 431)):
        start = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: "
        head = start + b"a" * (size - len(start) - 2) + b"\r\n"
        assert len(head) == size
        with Conn(b) as c:
            c.send(head + b"\r\n")
            assert c.response()[0] == expected, size


def test_a_head_request_refused_and_closed_gets_no_content(broker_factory):
    """Hostile testing (round 30): a HEAD refused with the connection's close (413, 505,
    two Host fields, an unsupported Transfer-Encoding) was answered with content, which
    RFC 9110 9.3.2 forbids. The next request on the connection would have read it."""
    b = broker_factory("--workers", "1", "--max-body-bytes", "1000")
    for request, status in [
        (b"HEAD / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 3000000\r\n\r\n", 413),
        (b"HEAD / HTTP/2.0\r\nHost: localhost\r\n\r\n", 505),
        (b"HEAD / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"HEAD / HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400),
    ]:
        with Conn(b) as c:
            c.send(request)
            got, headers, _ = c.response(head_only=True)
            assert (got, headers["connection"]) == (status, "close"), request
            assert c.closed_within(5)
            assert c.buf == b"", (request, c.buf)  # (nothing after the head: no content)


def test_the_partial_bodies_of_closed_connections_are_freed_at_once(broker_factory):
    """Hostile testing: a closed connection's partial body stayed alive with it, in a
    reference cycle (the httptools parser holds the protocol's callbacks), until the
    garbage collector's rare full run: rounds of 40 clients each sending most of a 1 MiB
    body and hanging up grew the broker by ~40 MB a round (65 -> 949 MB over rounds).
    The body is dropped when the connection is lost: later rounds reuse the first's memory.

    glibc's malloc is told to map every block of 64 KiB or more on its own, so a freed body
    goes back to the system at once (FREED_AT_ONCE). A kept body shows, 40 MB a round."""
    b = broker_factory("--workers", "1", env=FREED_AT_ONCE)
    size = 1 << 20
    head = post_head(b, f"Content-Length: {size}\r\n\r\n")
    piece = b"[" + b" " * (size - 2000)

    def one_round() -> int:
        want = received_http_bytes(b) + 40 * (len(head) + len(piece))
        conns = [Conn(b, timeout=30) for _ in range(40)]
        for c in conns:
            c.send(head + piece)
        wait_for(lambda: received_http_bytes(b) >= want, timeout=30)
        for c in conns:
            c.sock.close()
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_connections", transport="http") <= 1, timeout=30)
        return rss_kib(b.pid)

    # The baseline is the larger of two rounds: the first round's may hold the broker's
    # one-off costs (a new user's check, before the fixed threshold: 37 -> 70 MB, then flat).
    warm = [one_round() for _ in range(2)]
    rounds = [one_round() for _ in range(3)]
    assert max(rounds) - max(warm) < 30 * 1024, (warm, rounds)


def test_the_partial_heads_of_closed_connections_are_freed_at_once(broker_factory):
    """Hostile testing: as bodies were, a closed connection's partial head (a URL or a
    header value httptools was still building, up to 64 KiB) stayed alive in the
    parser/protocol cycle until a full garbage collection: rounds of 3000 connections
    each sending 60 KB of a head and hanging up grew the broker 219 -> 392 -> 510 MB.
    The parser is dropped at connection loss: later rounds reuse the first's memory."""
    b = broker_factory("--workers", "1", env=FREED_AT_ONCE)
    want = [received_http_bytes(b)]

    def one_round(i: int) -> int:
        conns = [Conn(b, timeout=30) for _ in range(300)]
        for n, c in enumerate(conns):
            c.send(b"POST /" + b"a" * 60000 if n % 2 else b"POST / HTTP/1.1\r\nX-Long: " + b"a" * 60000)
        want[0] += sum(60006 if n % 2 else 60027 for n in range(300))
        wait_for(lambda: received_http_bytes(b) >= want[0], timeout=30)
        for c in conns:
            c.sock.close()
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_connections", transport="http") <= 1, timeout=30)
        return rss_kib(b.pid)

    # A leak grows the broker 18 MB every round: 54 MB over the last three. A loaded machine
    # once showed one jump of 15 MB in the fourth round, then flat (a full suite beside
    # hostile testing): the baseline is the larger of two rounds, the bound 30 MB.
    warm = [one_round(i) for i in range(2)]
    rounds = [one_round(i) for i in range(2, 5)]
    assert max(rounds) - max(warm) < 30 * 1024, (warm, rounds)


# -- item 6: a full broker answers its probes -----------------------------------------------


def test_idle_connections_at_the_limit_make_room_for_probes_and_calls(broker_factory):
    """max_connections + 8 idle keep-alive connections took every slot and the probes'
    reserve: /healthz got 503. The oldest idle connection is closed to make room."""
    from broker.frontend.http import PROBE_RESERVE

    b = broker_factory("--workers", "1", "--max-connections", "4")
    idle: list[Conn] = []
    try:
        for _ in range(4 + PROBE_RESERVE):
            c = Conn(b)
            c.send(get("/healthz"))  # accepted and served, then idle
            assert c.response()[0] == 200
            idle.append(c)
            time.sleep(0.005)  # apart in the loop's clock (uvloop's has 1 ms steps): a strict order
        for path in ("/healthz", "/readyz", "/metrics"):
            with Conn(b) as probe:
                probe.send(get(path))
                status, _, _ = probe.response()
                assert status == 200, path
        with Conn(b) as c:
            c.send(post(call("add", [1, 2]), path=b.path))
            assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')
        # The least recently active connections made the room: those closed are the oldest
        # (how many depends on how soon the broker saw the probes' own closes).
        assert idle[0].closed_within(5)
        closed = [True] + [c.closed_within(0.2) for c in idle[1:]]
        assert closed == sorted(closed, reverse=True), "".join("x" if c else "." for c in closed)
    finally:
        for c in idle:
            c.sock.close()


def test_silent_connections_at_the_limit_make_room_after_a_second(broker_factory):
    """Connections that never send a byte are idle too, once a second old."""
    from broker.frontend.http import PROBE_RESERVE

    b = broker_factory("--workers", "1", "--max-connections", "4")
    silent = []  # accepted before the probe below
    try:
        for _ in range(4 + PROBE_RESERVE):
            silent.append(Conn(b))
            time.sleep(0.005)  # apart in the loop's clock (1 ms steps): "the oldest" is one connection

        def served(request: bytes) -> bool:
            with Conn(b) as c:
                try:
                    c.send(request)
                    return c.response()[0] == 200
                except (OSError, EOFError):
                    return False

        assert served(get("/healthz"))  # at once: in the reserve, in the place of a silent one
        wait_for(lambda: served(post(call("add", [1, 2]), path=b.path)), timeout=10, interval=0.2)
        assert silent[0].closed_within(5)  # the oldest made room
    finally:
        for c in silent:
            c.sock.close()


def test_requests_left_unfinished_at_the_limit_make_room_slowest_first(broker_factory):
    """Hostile testing, round 76: a connection with a request under way was never closed
    to make room, so one client holding every place with requests it never finished
    (slowloris: "POST / HTTP/1.1\\r\\n" and nothing more) had every other client's call
    answered 503 "too many connections" until request_timeout, 30 s, and again as it
    reconnected. At the limit, a connection with a request under way gives its place, the
    one whose request comes slowest first (round 78: the longest open went first, an
    honest pooled connection sending its request in two pieces), answered 408 saying why;
    the newcomer is served. Its client, still sending its body, reads the 408 (round 77:
    it was closed at once, and an uploader got EPIPE)."""
    b = broker_factory("--workers", "1", "--max-connections", "2")
    older = Conn(b)
    time.sleep(0.01)  # (apart in the loop's clock: `older` is the longest open)
    held = [Conn(b), older]
    try:
        held[0].send(post_head(b, "Content-Length: 100000\r\n\r\n") + b"[" * 1000)
        time.sleep(0.5)  # about 2 kB/s so far
        older.send(b"POST / HTTP/1.1\r\nX-Pad: " + b"a" * 20_000 + b"\r\n")  # far faster: it keeps its place
        time.sleep(0.02)
        with Conn(b) as c:
            c.send(post(call("add", [1, 2]), path=b.path))
            status, _, body = c.response()
            assert (status, json.loads(body)) == (200, {"jsonrpc": "2.0", "id": 1, "result": 3})
        for _ in range(20):  # the uploader goes on sending: discarded, no reset
            held[0].send(b"[" * 1000)
        status, headers, body = held[0].response()
        assert (status, headers["connection"]) == (408, "close"), (status, headers)
        assert json.loads(body)["error"].startswith("request still arriving after "), body
        assert held[0].closed_within(5)
        assert not older.closed_within(0.5)  # the longest open, faster, kept its place
        assert sample(scrape_metrics(b), "rpc_broker_connections_evicted_total", transport="http",
                      state="trickling") == 1
        assert ("http: max_connections 2 reached: closed a connection to make room (its request coming slowest; "
                "1 so far)") in b.read_log()  # (logged: new user, round 100)
    finally:
        for c in held:
            c.sock.close()


def test_a_request_begun_just_now_keeps_its_place_before_an_older_faster_one(broker_factory):
    """Hostile testing, round 80: ranked by bytes a second alone, an attacker's fresh
    connections (4 KB sent at once) outranked honest small calls caught between their head
    and their body, 24 answered 408. A request begun under 0.1 s ago goes after all others."""
    b = broker_factory("--workers", "1", "--max-connections", "2")
    attacker, honest = Conn(b), Conn(b)
    try:
        attacker.send(b"POST / HTTP/1.1\r\nX-Pad: " + b"a" * 4000)
        time.sleep(0.15)  # about 27 kB/s, and older than 0.1 s
        body = call("add", [1, 2])
        honest.send(post_head(b, f"Content-Length: {len(body)}\r\n\r\n"))  # its head: about 15 kB/s
        time.sleep(0.01)
        with Conn(b) as newcomer:
            newcomer.send(post(call("add", [2, 2]), path=b.path))
            assert newcomer.response()[0] == 200
        assert attacker.response()[0] == 408
        honest.send(body.encode())
        status, _, answer = honest.response()
        assert (status, json.loads(answer)["result"]) == (200, 3)
    finally:
        attacker.sock.close()
        honest.sock.close()


def test_a_request_whose_head_came_at_once_outranks_tricklers_while_its_body_comes(broker_factory):
    """Round 80's new user (HIGH): once a request's head was whole, only its body's bytes
    counted in its rate, so an honest request between its head (sent at once) and its body
    ranked as 0 bytes a second, below slowloris connections at 10, and was the one evicted.
    Its head's bytes count."""
    b = broker_factory("--workers", "1", "--max-connections", "3")
    tricklers = [Conn(b), Conn(b)]
    honest = Conn(b)
    try:
        for i, piece in enumerate(b"POST / HTTP/1.1\r\n"):  # 10 bytes a second each
            for c in tricklers:
                c.send(bytes([piece]))
            if i == 2:
                payload = call("add", [1, 2]).encode()
                honest.send(post_head(b, f"Content-Length: {len(payload)}\r\n\r\n"))  # its head at once
            if i == 5:
                break
            time.sleep(0.1)
        with Conn(b) as newcomer:  # (the honest request is 0.3 s old: past the 0.1 s grace)
            newcomer.send(post(call("add", [2, 2]), path=b.path))
            assert newcomer.response()[0] == 200
        honest.send(payload)
        status, _, answer = honest.response()
        assert (status, json.loads(answer)["result"]) == (200, 3)
        assert sum(1 for c in tricklers if c.closed_within(3)) == 1
    finally:
        for c in (*tricklers, honest):
            c.sock.close()


def test_connections_lingering_after_an_error_answer_make_room(broker_factory):
    """Hostile testing, round 78: a connection answered 413 (or 400) lingers half-closed,
    discarding what its client still sends, up to LINGER_TIME (30 s), and a byte a second
    kept it from counting as idle: two of them held every place at max_connections 2, and
    every newcomer got 503. A lingering connection gives its place first."""
    b = broker_factory("--workers", "1", "--max-connections", "2", "--max-body-bytes", "1000")
    held = []
    try:
        for _ in range(2):
            held.append(c := Conn(b))
            c.send(post_head(b, "Content-Length: 5000\r\n\r\n") + b"[" * 100)
            assert c.response()[0] == 413
        for _ in range(3):  # a byte each, more than a sweep apart: never silent for long
            for c in held:
                c.send(b"[")
            time.sleep(0.4)
        with Conn(b) as newcomer:
            newcomer.send(post(call("add", [1, 2]), path=b.path))
            assert newcomer.response()[0] == 200
        assert sample(scrape_metrics(b), "rpc_broker_connections_evicted_total", transport="http", state="idle") == 1
        assert "closed a connection to make room (idle, the least recently active; 1 so far)" in b.read_log()
    finally:
        for c in held:
            c.sock.close()


def test_requests_restarted_before_a_second_do_not_hold_every_place(broker_factory):
    """Hostile testing, round 77: a request's own age ranked it, so a client whose
    connections each finished a request and began the next every 0.8 s (pipelined
    GET /healthz) was never a second under way, never evictable, and every newcomer got
    503. The longest open connection with a request under way gives its place."""
    b = broker_factory("--workers", "1", "--max-connections", "2")
    held = [Conn(b)]
    time.sleep(0.01)  # (apart in the loop's clock, 1 ms steps: the first is the longest open)
    held.append(Conn(b))
    try:
        for c in held:
            c.send(get("/healthz") + b"GET /healthz HTTP/1.1\r\n")  # one answered, the next begun
        served = 0
        for _ in range(4):  # bounded: a newcomer a round, the holders restarting their requests
            for c in held:
                assert c.response()[0] == 200
            with Conn(b) as newcomer:
                newcomer.send(post(call("add", [2, 2]), path=b.path))
                served += newcomer.response()[0] == 200
            assert held[0].response()[0] == 408 and held[0].closed_within(5)
            held[0].sock.close()
            time.sleep(0.2)  # (the newcomer's close seen: its place free for the next holder)
            held = [held[1], Conn(b)]
            held[0].send(b"Host: 127.0.0.1\r\n\r\n" + b"GET /healthz HTTP/1.1\r\n")
            held[1].send(get("/healthz") + b"GET /healthz HTTP/1.1\r\n")
        assert served == 4
    finally:
        for c in held:
            c.sock.close()


def test_connections_sending_only_empty_lines_make_room_and_time_out(broker_factory):
    """Hostile testing: httptools skips empty lines before a request line (RFC 9112 2.2),
    but every byte counted as activity, so connections sending CRLF every 0.1 s were never
    idle: they held every place (new clients got 503 for as long as they kept at it) and
    outlived keepalive_timeout. Bytes that start no request are not activity now."""
    from broker.frontend.http import PROBE_RESERVE

    b = broker_factory("--workers", "1", "--max-connections", "4", "--keepalive-timeout", "2")
    keepers = [Conn(b) for _ in range(4 + PROBE_RESERVE)]
    stop = time.monotonic() + 6
    try:
        def keep() -> None:
            while time.monotonic() < stop:
                for c in keepers:
                    try:
                        c.sock.send(b"\r\n")
                    except OSError:
                        pass
                time.sleep(0.1)

        keeper = threading.Thread(target=keep, daemon=True)
        keeper.start()
        time.sleep(1.5)  # past SWEEP_SECONDS: a connection that never started a request is idle

        def served() -> bool:
            with Conn(b) as c:
                try:
                    c.send(post(call("add", [1, 2]), path=b.path))
                    return c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')
                except (OSError, EOFError):
                    return False

        assert served()  # in the place of one of them (it got 503 before)
        # keepalive_timeout (2 s) from their connection, whatever empty lines they send:
        assert all(c.closed_within(5) for c in keepers[1:])
        keeper.join(10)
    finally:
        for c in keepers:
            c.sock.close()


@pytest.mark.parametrize("opening", [b"GET /healthz HTTP/1.1\r\nX-a: ", b""])
def test_probes_get_through_a_reserve_flooded_with_fresh_slowloris_connections(broker_factory, opening):
    """A newcomer took the place of a reserve connection only if that one's request, or
    last byte, was a second old: an attacker opening a connection that trickles a head
    (or sends nothing) every 20 ms kept the 8 places full of younger ones, and /healthz
    got 503 while it ran. Every probe must be served."""
    b = broker_factory("--workers", "1", "--max-connections", "2")
    body = call("add", [1, 2]).encode()
    held = []  # max_connections taken by requests under way (their bodies still coming): not idle
    for _ in range(2):
        held.append(c := Conn(b))
        c.send(post_head(b, f"Content-Length: {len(body)}\r\n\r\n") + body[:5])
    attackers: list[socket.socket] = []
    stop = threading.Event()

    def attack() -> None:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not stop.is_set() and len(attackers) < 400:
            try:
                s = socket.create_connection(("127.0.0.1", b.port), timeout=2)
                if opening:
                    s.sendall(opening)
                attackers.append(s)
            except OSError:
                pass
            time.sleep(0.02)

    thread = threading.Thread(target=attack, daemon=True)
    statuses: list[int | str] = []
    try:
        thread.start()
        time.sleep(0.5)  # the reserve is full of attackers by now
        while thread.is_alive() and len(statuses) < 40:
            try:
                with Conn(b, timeout=5) as probe:
                    probe.send(get("/healthz"))
                    statuses.append(probe.response()[0])
            except (OSError, EOFError) as exc:
                statuses.append(type(exc).__name__)
            time.sleep(0.15)
    finally:
        stop.set()
        thread.join(10)
        for s in attackers:
            s.close()
        for c in held:
            c.sock.close()
    assert len(statuses) >= 5 and len(attackers) >= 50, (len(statuses), len(attackers))
    assert statuses == [200] * len(statuses), statuses


def test_one_read_of_many_pipelined_requests_does_not_hold_other_connections(broker_factory):
    """httptools parses a whole read at once, and libuv reads a connection up to 32 times
    (256 KB each) while it has data and reading is not paused: 50,000 pipelined GET
    /healthz (answered at once, so the pipeline never pauses reading) were all answered
    before another connection's request was even read, seconds later. The requests of
    a read are handled REQUESTS_PER_TURN at a time, as NDJSON lines are: a scrape sent
    once the flood is under way is answered while most of it still waits. (Ordered by
    the broker's own counter: no clock in the test.)"""
    b = broker_factory("--workers", "1")
    total = 50_000
    answers = [0]

    def read_answers(sock: socket.socket) -> None:
        tail = b""
        while answers[0] < total:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return
            data = tail + chunk
            answers[0] += data.count(b"HTTP/1.1 200")
            tail = data[-11:]

    before = sample(scrape_metrics(b), "rpc_broker_http_responses_total", path="health", status="200")
    with Conn(b, timeout=60) as flood:
        reader = threading.Thread(target=read_answers, args=(flood.sock,), daemon=True)
        reader.start()
        flood.send(get("/healthz") * total)
        wait_for(lambda: answers[0] > 0, timeout=30, interval=0.001)  # the flood is being served
        during = sample(scrape_metrics(b), "rpc_broker_http_responses_total", path="health", status="200")
        reader.join(60)
        assert answers[0] == total
    assert during - before < total / 2, (during - before, total)


def test_a_read_of_many_pipelined_calls_is_answered_whole_and_in_order(broker_factory):
    """The requests of a large read are parsed in pieces over several loop turns: calls
    with bodies of every size and framing, past PIPELINE_HIGH, all answered in order."""
    b = broker_factory("--workers", "1")
    requests, expected = [], []
    for i in range(300):
        body = call("echo", ["y" * (i * 37 % 9000)], i).encode()
        if i % 3 == 1:  # chunked, in pieces of 1000
            pieces = [body[j:j + 1000] for j in range(0, len(body), 1000)]
            requests.append(post_head(b, "Transfer-Encoding: chunked\r\n\r\n")
                            + b"".join(b"%x\r\n%s\r\n" % (len(x), x) for x in pieces) + b"0\r\n\r\n")
        else:
            requests.append(post(body, path=b.path))
        expected.append({"jsonrpc": "2.0", "id": i, "result": ["y" * (i * 37 % 9000)]})
    with Conn(b, timeout=60) as c:
        writer = threading.Thread(target=c.send, args=(b"".join(requests),), daemon=True)
        writer.start()  # (while this thread reads: the answers are larger than the buffers)
        got = [json.loads(c.response()[2]) for _ in requests]
        writer.join(30)
    assert got == expected


# -- item 7: h2c upgrade whose body comes after its head -------------------------------------


H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_h2c_upgrade_with_its_body_after_the_head_is_served_once(broker_factory, framing):
    """`curl --http2 -d @600k.json`: the head (with Expect: 100-continue), then the body
    in later reads. Answered once as HTTP/1.1, then closed."""
    b = broker_factory("--workers", "1")
    params = ["y" * 600_000]
    body = call("echo", params, 7).encode()
    if framing == "chunked":
        te = b"Transfer-Encoding: chunked\r\n"
        payload = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 65536]), body[i:i + 65536])
                           for i in range(0, len(body), 65536)) + b"0\r\n\r\n"
    else:
        te = b"Content-Length: %d\r\n" % len(body)
        payload = body
    with Conn(b, timeout=30) as c:
        c.send(post_head(b, "") + H2C + te + b"Expect: 100-continue\r\n\r\n")
        assert c.response()[0] == 100  # the head is read: the body comes in reads of its own
        c.send(payload)
        status, headers, answer = c.response()
        assert (status, headers["connection"]) == (200, "close")
        assert json.loads(answer) == {"jsonrpc": "2.0", "id": 7, "result": params}
        assert c.closed_within(5) and not c.buf


def test_an_h2c_upgrade_past_max_body_bytes_is_413(broker_factory):
    b = broker_factory("--workers", "1", "--max-body-bytes", "1000")
    big = call("echo", ["z" * 2000]).encode()
    with Conn(b) as c:
        c.send(post_head(b, "") + H2C + b"Transfer-Encoding: chunked\r\n\r\n")
        c.send(b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 100]), big[i:i + 100]) for i in range(0, len(big), 100)))
        status, headers, _ = c.response()
        assert (status, headers["connection"]) == (413, "close")
        assert c.closed_within(5)


# -- item 8: SIGTERM waits for a request under way ------------------------------------------


def test_sigterm_answers_a_keep_alive_request_whose_body_is_still_coming(broker_factory):
    b = broker_factory("--workers", "1")
    body = call("add", [20, 22], 2).encode()
    with Conn(b) as c:
        c.send(post(call("add", [1, 2], 1), path=b.path))
        assert c.response()[0] == 200  # the connection has served a request: keep-alive
        c.send(post_head(b, f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"))
        assert c.response()[0] == 100  # the head is in; the body is under way
        c.send(body[:10])
        os.kill(b.pid, signal.SIGTERM)
        wait_for(lambda: "stopping" in b.read_log(0.05), timeout=10)  # drain has run
        c.send(body[10:])
        status, headers, answer = c.response()
        assert (status, headers["connection"]) == (200, "close")
        assert answer == b'{"jsonrpc":"2.0","id":2,"result":42}'
        assert c.closed_within(5)
    assert b.proc.wait(20) == 0


# -- item 9: a client that half-closes gets its answers ----------------------------------------


def test_a_half_closed_client_gets_its_answers_then_eof(broker_factory):
    b = broker_factory("--workers", "1")
    with Conn(b) as c:  # what `nc -N` does: send, shutdown(SHUT_WR), read
        c.send(post(call("sleep", [0.3], 1), path=b.path) + post(call("add", [1, 2], 2), path=b.path))
        c.sock.shutdown(socket.SHUT_WR)
        assert c.response()[2] == b'{"jsonrpc":"2.0","id":1,"result":0.3}'
        assert c.response()[2] == b'{"jsonrpc":"2.0","id":2,"result":3}'
        assert c.closed_within(5) and not c.buf
    with Conn(b) as c:  # answered at once, before the EOF is read
        c.send(get("/healthz"))
        c.sock.shutdown(socket.SHUT_WR)
        assert c.response()[0] == 200
        assert c.closed_within(5) and not c.buf
    with Conn(b) as c:  # nothing owed: closed
        c.sock.shutdown(socket.SHUT_WR)
        assert c.closed_within(5) and not c.buf


# -- item 10: Date on every answer, Retry-After on 503 --------------------------------------


def _date(headers: dict[str, str]) -> datetime:
    when = parsedate_to_datetime(headers["date"])
    assert headers["date"].endswith(" GMT") and when.tzinfo is not None, headers["date"]
    return when


def test_every_answer_has_a_date_and_503s_a_retry_after(broker_factory):
    b = broker_factory("--workers", "1", "--max-body-bytes", "1000", "--max-connections", "3",
                       "--worker-concurrency", "1", "--max-queue", "0")
    requests = [
        (post(call("add", [1, 2]), path=b.path), 200),
        (post('{"jsonrpc":"2.0","method":"update","params":[1]}', path=b.path), 204),
        (post("{bad", path=b.path), 400),
        (get("/nope"), 404),
        (get(b.path), 405),
        (get("/healthz", "HEAD"), 200),
        (get("/metrics"), 200),
        (post(call("echo", ["x" * 2000]), path=b.path), 413),
    ]
    now = datetime.now(UTC)
    with Conn(b) as c:
        for request, expected in requests:
            c.send(request)
            status, headers, _ = c.response(head_only=request.startswith(b"HEAD"))
            assert status == expected
            assert abs((_date(headers) - now).total_seconds()) < 10
            assert "retry-after" not in headers
    with Conn(b) as c:
        c.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X: a\r\n" * 200 + b"\r\n")
        status, headers, _ = c.response()
        assert status == 431 and _date(headers)
    # (nothing in flight first: the notification above held the one slot on a loaded machine, and
    # the sleep was the call refused 503)
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_calls_in_flight") == 0, timeout=10)
    with Conn(b) as busy:  # the one worker slot taken, no queue: the next call is overloaded
        busy.send(post(call("sleep", [3], "busy"), path=b.path))
        # (until the broker has the sleep in flight: an add sent meanwhile took the slot, and
        # the sleep, coming after it on a loaded machine, was the one refused 503; a sleep of
        # 1 s ended once before a scrape on a loaded machine saw it in flight)
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_calls_in_flight") == 1, timeout=10)
        status, headers, answer = b.post(call("add", [1, 2]))
        assert status == 503 and json.loads(answer)["error"]["code"] == -32000
        assert headers["retry-after"] == "1" and _date(headers)
        assert busy.response()[0] == 200
    # Past max_connections, no connection able to give its place (owed an answer): the
    # reserve serves probes only
    b1 = broker_factory("--workers", "1", "--max-connections", "1")
    with Conn(b1) as holder:
        holder.send(post(call("sleep", [2], "held"), path=b1.path))
        wait_for(lambda: sample(scrape_metrics(b1), "rpc_broker_calls_in_flight") == 1, timeout=10)
        with Conn(b1) as over:
            over.send(post(call("add", [1, 2]), path=b1.path))
            status, headers, _ = over.response()
            assert (status, headers["retry-after"]) == (503, "1") and _date(headers)
        assert holder.response()[0] == 200


def test_the_date_is_refreshed(broker_factory):
    b = broker_factory("--workers", "1")

    def date() -> str:
        with Conn(b) as c:
            c.send(get("/healthz"))
            return c.response()[1]["date"]

    first = date()
    wait_for(lambda: date() != first, timeout=10, interval=0.2)


# -- item 15: rpc_broker_http_responses_total by path ---------------------------------------


def test_http_responses_are_counted_by_path(broker_factory):
    b = broker_factory("--workers", "1", "--rpc-path", "/rpc")
    before = scrape_metrics(b)
    assert b.post(call("add", [1, 2]))[0] == 200
    assert b.post(call("add", [1, 2]), path="/other")[0] == 404
    for path in ("/healthz", "/readyz", "/healthz?x=1"):
        assert b.get(path)[0] == 200
    with Conn(b) as c:
        c.send(b"\x16\x03\x01garbage\r\n\r\n")
        assert c.response()[0] == 400
    after = scrape_metrics(b)

    def moved(path: str, status: str) -> float:
        name = "rpc_broker_http_responses_total"
        return sample(after, name, path=path, status=status) - sample(before, name, path=path, status=status)

    assert moved("rpc", "200") == 1
    assert moved("health", "200") == 2
    assert moved("ready", "200") == 1
    assert moved("metrics", "200") == 1  # `before`
    assert moved("other", "404") == 1
    assert moved("other", "400") == 1  # not readable as HTTP: no path to speak of
    mcp = b'{"jsonrpc":"2.0","id":1,"method":"ping"}'
    assert b.post(mcp, path="/mcp")[0] == 200
    assert b.post(b'{"jsonrpc":"2.0","method":"notifications/initialized"}', path="/mcp")[0] == 202
    after = scrape_metrics(b)
    assert moved("mcp", "200") == 1 and moved("mcp", "202") == 1
    labels = {dict(key[1]).get("path") for key in after if key[0] == "rpc_broker_http_responses_total"}
    assert labels == {"rpc", "mcp", "health", "ready", "metrics", "other"}


def test_a_body_in_tiny_chunks_is_refused_once_its_chunks_cost_more_than_its_bytes(broker_factory):
    """Hostile testing: a 1 MiB body sent as 1-byte chunks (6 MiB on the wire) took about
    400 ms of the loop, two Python callbacks per chunk. A body may have SMALL_CHUNKS
    chunks plus one per MIN_CHUNK_BYTES; one with more is refused with 400 at once. A body
    in chunks of MIN_CHUNK_BYTES, or a small one in fewer chunks, is served."""
    from broker.frontend.http import MIN_CHUNK_BYTES, SMALL_CHUNKS

    b = broker_factory("--workers", "1")
    head = post_head(b, "Transfer-Encoding: chunked\r\n\r\n")

    def chunked(body: bytes, size: int) -> bytes:
        return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                        for i in range(0, len(body), size)) + b"0\r\n\r\n"

    filler = " " * (SMALL_CHUNKS * MIN_CHUNK_BYTES * 4)
    body = call("echo", [1], 1).encode()[:-1] + filler.encode() + b"}"
    with Conn(b) as c:  # chunks of MIN_CHUNK_BYTES: served
        c.send(head + chunked(body, MIN_CHUNK_BYTES))
        status, _, answer = c.response()
        assert status == 200 and json.loads(answer)["result"] == [1], answer
    small = call("add", [1, 2]).encode()
    with Conn(b) as c:  # a small body in 1-byte chunks, fewer than SMALL_CHUNKS: served
        assert len(small) < SMALL_CHUNKS
        c.send(head + chunked(small, 1))
        assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":1,"result":3}')
    with Conn(b, timeout=30) as c:  # 1-byte chunks of a large body: 400, and the connection closes
        c.send(head + chunked(body[: 4 * SMALL_CHUNKS], 1)[:-5])
        status, _, answer = c.response()
        assert status == 400, answer
        refused_at = next(n for n in range(SMALL_CHUNKS, 2 * SMALL_CHUNKS) if (n - SMALL_CHUNKS) * MIN_CHUNK_BYTES > n - 1)
        assert b"chunked body in %d chunks for %d bytes: more than %d plus one per %d bytes" % (
            refused_at, refused_at - 1, SMALL_CHUNKS, MIN_CHUNK_BYTES) in answer
        assert c.closed_within(5)


def test_large_pipelined_bodies_on_one_connection_are_all_answered_in_order(broker_factory):
    """Reading pauses for a loop turn after TURN_BYTES (hostile testing: one client's 1 MiB
    bodies were decoded 8 at a time, /healthz p50 0.5 -> 29 ms; 1.6 ms after, measured in
    benchmarks/pipelined_reads.py): the pauses lose and reorder nothing."""
    b = broker_factory("--workers", "1")
    bodies = [b'{"jsonrpc":"2.0","method":"nope","params":["' + b"a" * 900_000 + b'"],"id":%d}' % i
              for i in range(12)]
    with Conn(b, timeout=60) as c:
        c.send(b"".join(post(body, path=b.path) for body in bodies))
        for i in range(12):
            status, _, answer = c.response()
            assert status == 200 and json.loads(answer)["id"] == i
            assert json.loads(answer)["error"]["code"] == -32601


@pytest.mark.parametrize(("method", "path", "label", "headers"), [
    ("POST", "/nope", "other", "Content-Type: application/json\r\n"),
    ("GET", "/healthz", "health", "Content-Type: application/json\r\n"),
    ("POST", "/", "rpc", "Content-Type: application/json\r\n"),
    # (round 27: a web page's POST, which it sends without a preflight)
    ("POST", "/", "rpc-cross-site", "Content-Type: text/plain\r\nOrigin: https://evil.example\r\n"),
])
def test_a_body_past_max_body_bytes_is_json_rpc_only_on_the_rpc_path(broker_factory, method, path, label, headers):
    """Hostile testing (round 26): a body past max_body_bytes sent to /healthz, /metrics
    or any other path got a JSON-RPC -32600 error object and was counted in
    rpc_broker_calls_total and errors_total: anyone could move those without sending
    JSON-RPC; round 27: so could a web page, on rpc_path. Off rpc_path, or from where
    it may not call, it is a plain 413, counted by path and status only."""
    b = broker_factory("--workers", "1", "--max-body-bytes", "1000")
    before = scrape_metrics(b)
    with Conn(b) as c:
        c.send(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
               f"Content-Length: 5000\r\n\r\n".encode() + b"x" * 5000)
        status, _, body = c.response()
    assert status == 413
    label = label.partition("-")[0]
    if label == "rpc" and "Origin" not in headers:
        assert json.loads(body)["error"]["code"] == -32600
    else:
        assert json.loads(body) == {"error": "body exceeds max_body_bytes 1000"}
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_http_responses_total", path=label, status="413") == 1)
    after = scrape_metrics(b)
    moved = 1 if label == "rpc" and "Origin" not in headers else 0
    assert sample(after, "rpc_broker_errors_total", code="-32600") - sample(before, "rpc_broker_errors_total",
                                                                            code="-32600") == moved
    assert (sample(after, "rpc_broker_calls_total", method="other", outcome="invalid_request")
            - sample(before, "rpc_broker_calls_total", method="other", outcome="invalid_request")) == moved


def _big_answer_then(b: Broker, then: bytes, after: bytes) -> tuple[bytes, str]:
    """Pipeline a call with a 3.5 MB answer (not read for a moment), then `then`, then
    `after` (bytes the client sends anyway); read everything: (bytes, "eof" or "reset")."""
    body = call("echo", ["z" * 3_500_000]).encode()
    s = socket.create_connection((b.host, b.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    try:
        s.sendall(post_head(b, f"Content-Length: {len(body)}\r\n\r\n") + body)
        time.sleep(0.5)  # not reading: the answer waits in the broker's write buffer
        s.sendall(then)
        time.sleep(0.1)
        s.sendall(after)
        time.sleep(0.3)
        got, how = bytearray(), "eof"
        s.settimeout(10)
        try:
            while chunk := s.recv(1 << 20):
                got += chunk
        except ConnectionResetError:
            how = "reset"
        return bytes(got), how
    finally:
        s.close()


@pytest.mark.parametrize(("then", "status"), [
    (b"POST /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 50\r\n"
     b"Expect: 100-continue\r\n\r\n", b"404"),
    (b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", b"404"),
], ids=["expect-refused", "upgrade"])
def test_a_request_answered_then_closed_lingers_and_cuts_no_earlier_answer(broker_factory, then, status):
    """Hostile testing (round 28): a refused request expecting 100-continue, and an
    Upgrade request, were answered and the connection closed at once: the bytes the
    client sent after (the body all the same, a websocket frame) reset it, cutting the
    3.5 MB answer of an earlier call at 128 kB. They half-close now and discard what
    comes: the earlier answer whole, then theirs, then the end."""
    b = broker_factory("--workers", "1", "--max-body-bytes", str(8 * 1024 * 1024))
    got, how = _big_answer_then(b, then, b"y" * 50)
    assert how == "eof"
    first, _, rest = got.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 ") and len(rest) > 3_500_000, (first, len(rest))
    assert rest[-400:].count(b"HTTP/1.1 " + status) == 1


def test_a_refused_upgrade_expecting_100_continue_gets_its_status_at_once(broker_factory):
    """Hostile testing (round 28): with Upgrade too, a refused request expecting
    100-continue got neither the 100 nor its status (408 after request_timeout)."""
    b = broker_factory("--workers", "1")
    with Conn(b) as c:
        c.send(b"POST /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 10\r\n"
               b"Connection: Upgrade\r\nUpgrade: websocket\r\nExpect: 100-continue\r\n\r\n")
        status, headers, _ = c.response()
        assert (status, headers.get("connection")) == (404, "close")


def test_an_http_1_0_call_with_no_host_past_max_body_bytes_is_a_json_rpc_413(broker_factory):
    """Hostile testing (round 28): HTTP/1.0 with no Host may call rpc_path, but past
    max_body_bytes it got the plain 413 meant for requests that may not call."""
    b = broker_factory("--workers", "1", "--max-body-bytes", "1000")
    with Conn(b) as c:
        c.send(b"POST / HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
        status, _, body = c.response()
    assert status == 413 and json.loads(body)["error"]["code"] == -32600
