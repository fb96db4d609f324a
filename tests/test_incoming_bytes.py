"""max_incoming_bytes: the request bytes still arriving, HTTP bodies and NDJSON lines not
finished yet, are bounded over all connections together. Hostile testing (issue 9): 200
connections each holding most of a 1 MiB body (or a 1 MiB NDJSON line with no newline)
grew the broker by about 190 MiB each way, and nothing but max_connections (10000 per
listener: about 10 GiB) bounded it."""

from __future__ import annotations

import json
import socket
import time
import typing

import pytest
from conftest import sample, scrape_metrics, wait_for
from test_http_protocol import Conn
from test_stream import Stream, line, result, start_stream_broker

pytestmark = pytest.mark.usefixtures("event_loop_name")  # (on both event loops: conftest.BOTH_LOOPS)

BODY = 200_000  # --max-body-bytes
LIMIT = 500_000  # --max-incoming-bytes: two and a half bodies
PART = 150_000  # what each client sends of its body before it stops


def head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def padded_call(size: int, id_: int) -> bytes:
    """An `add` call of exactly `size` bytes (spaces before its closing brace)."""
    call = f'{{"jsonrpc":"2.0","method":"add","params":[{id_},1],"id":{id_}'.encode()
    return call + b" " * (size - len(call) - 1) + b"}"


def incoming(b: object) -> float:
    return sample(scrape_metrics(b), "rpc_broker_incoming_bytes")  # type: ignore[arg-type]


def test_unfinished_bodies_and_lines_share_one_bound(tmp_path):
    """Three connections hold 150,000 bytes each of their bodies (two HTTP, one NDJSON):
    450,000 of the 500,000 allowed. A fourth whose body has come slower than theirs (begun
    before them), when it grows as much, is refused, HTTP 503 with a -32000 error and a
    close, NDJSON a -32000 line (its line dropped, the connection kept); those already
    holding finish and are answered, and the bytes they held are free again."""
    sb = start_stream_broker(tmp_path, "--workers", "1", "--max-body-bytes", str(BODY),
                             "--max-incoming-bytes", str(LIMIT))
    b = sb.broker
    try:
        assert sample(scrape_metrics(b), "rpc_broker_incoming_capacity_bytes") == LIMIT
        bodies = [padded_call(BODY, i) for i in range(3)]
        # (begun 3 s before the others: slower than each of them whenever it grows)
        late = Conn(b, timeout=30)
        late.send(head(b.path, BODY) + padded_call(BODY, 3)[:1000])
        late_line = sb.connect("unix")
        late_line.send(padded_call(BODY, 4)[:1000])
        wait_for(lambda: incoming(b) == 2000, timeout=10)
        time.sleep(3)
        first, second = Conn(b, timeout=30), Conn(b, timeout=30)
        first.send(head(b.path, BODY) + bodies[0][:PART])
        second.send(head(b.path, BODY) + bodies[1][:PART])
        wait_for(lambda: incoming(b) == 2 * PART + 2000, timeout=10)
        with sb.connect("tcp") as stream:
            stream.send(padded_call(BODY, 2)[:PART])
            wait_for(lambda: incoming(b) == 3 * PART + 2000, timeout=10)
            with late:  # past the bound, nothing slower: refused, its bytes dropped
                late.send(padded_call(BODY, 3)[1000:PART])
                status, headers, answer = late.response()
                assert status == 503, answer
                assert json.loads(answer) == {"jsonrpc": "2.0", "id": None, "error": {
                    "code": -32000, "message": "Server overloaded",
                    "data": f"request bodies arriving or waiting exceed max_incoming_bytes {LIMIT}"}}
                assert headers.get("retry-after") == "1"
                assert late.closed_within(5)
            with late_line:  # the same bound for NDJSON lines
                late_line.send(padded_call(BODY, 4)[1000:PART])
                assert json.loads(late_line.readline()) == {"jsonrpc": "2.0", "id": None, "error": {
                    "code": -32000, "message": "Server overloaded",
                    "data": f"lines arriving or waiting exceed max_incoming_bytes {LIMIT}"}}
                late_line.send(padded_call(BODY, 4)[PART:] + b"\n")  # the rest of the dropped line: skipped
                assert late_line.call(line("add", [5, 1], 5)) == result(5, 6)  # the connection goes on
            assert incoming(b) == 3 * PART
            assert sample(scrape_metrics(b), "rpc_broker_incoming_refused_total") == 2
            assert evicted_for_incoming(b) == 0
            # Those that held their place finish, and are answered.
            first.send(bodies[0][PART:])
            assert first.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":0,"result":1}')
            stream.send(padded_call(BODY, 2)[PART:] + b"\n")
            assert stream.readline() == result(2, 3)
            wait_for(lambda: incoming(b) == PART, timeout=10)
        second.sock.close()  # a client that hangs up frees what it held
        wait_for(lambda: incoming(b) == 0, timeout=10)
        with Conn(b, timeout=30) as again:  # room again
            again.send(head(b.path, BODY) + padded_call(BODY, 7)[:PART])
            wait_for(lambda: incoming(b) == PART, timeout=10)
            again.send(padded_call(BODY, 7)[PART:])
            assert again.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":7,"result":8}')
        first.sock.close()
    finally:
        assert b.stop() == 0, b.read_log()


def test_bodies_of_requests_answered_without_them_are_not_kept(broker_factory):
    """Hostile testing: the body of a request that no route takes (GET /healthz with a
    body, a 404, a 415) stayed in memory and counted in max_incoming_bytes while its
    keep-alive connection idled: 256 such connections filled the whole budget for
    keepalive_timeout, and every request arriving in pieces was refused 503."""
    b = broker_factory("--workers", "1", "--max-body-bytes", str(BODY), "--max-incoming-bytes", str(LIMIT))
    idle = [Conn(b, timeout=30) for _ in range(3)]
    try:
        for c, (method, path, ctype) in zip(idle, [("GET", "/healthz", "application/json"), ("POST", "/nope", "application/json"),
                                                   ("POST", b.path, "text/plain")], strict=True):
            body = b"x" * (BODY - 10)
            c.send(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:1000])
            wait_for(lambda: incoming(b) > 0, timeout=10)  # (arrives in pieces)
            c.send(body[1000:])
            assert c.response()[0] in (200, 404, 415)
        wait_for(lambda: incoming(b) == 0, timeout=10)  # answered: nothing is held for them
        with Conn(b, timeout=30) as c:  # and a call arriving in pieces is served
            call = padded_call(BODY, 9)
            c.send(head(b.path, BODY) + call[:PART])
            wait_for(lambda: incoming(b) == PART, timeout=10)
            c.send(call[PART:])
            assert c.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":9,"result":10}')
    finally:
        for c in idle:
            c.sock.close()


def test_an_unfinished_body_or_line_is_freed_at_eof_while_answers_are_owed(tmp_path):
    """Hostile testing (round 8): a client sent a slow call and most of a next body (or
    line), then closed; the broker, owing the slow call's answer, kept the connection open
    to write it, and the unfinished bytes stayed counted in max_incoming_bytes for the
    slow call's length (past request_timeout), other clients' bodies refused 503
    meanwhile. At EOF an unfinished body can no longer complete: freed at once (an NDJSON
    line ends at EOF: answered -32700, cut short)."""
    sb = start_stream_broker(tmp_path, "--workers", "1", "--max-body-bytes", str(BODY),
                             "--max-incoming-bytes", str(LIMIT))
    b = sb.broker
    slow = b'{"jsonrpc":"2.0","method":"sleep","params":[3],"id":"slow"}'
    try:
        with Conn(b, timeout=30) as http, sb.connect("tcp") as stream:
            http.send(head(b.path, len(slow)) + slow + head(b.path, BODY) + padded_call(BODY, 1)[:PART])
            stream.send(slow + b"\n" + padded_call(BODY, 2)[:PART])
            wait_for(lambda: incoming(b) == 2 * PART, timeout=10)
            http.sock.shutdown(socket.SHUT_WR)
            stream.sock.shutdown(socket.SHUT_WR)
            wait_for(lambda: incoming(b) == 0, timeout=1.5)  # at once, not when the sleep ends (3 s)
            assert json.loads(stream.readline(10))["error"]["code"] == -32700
            status, _, answer = http.response()
            assert (status, json.loads(answer)) == (200, {"jsonrpc": "2.0", "id": "slow", "result": 3})
            assert json.loads(stream.readline(10)) == {"jsonrpc": "2.0", "id": "slow", "result": 3}
    finally:
        assert b.stop() == 0, b.read_log()


def test_unfinished_heads_count_in_max_incoming_bytes(broker_factory):
    """Hostile testing (round 8): only bodies and lines counted; 3000 connections each
    holding 63 KiB of an unfinished head (a URL, or a header value) took the broker from
    57 to 232 MB past a max_incoming_bytes of 16 MiB. A head under way counts now: its
    bytes since it began, the whole read it began in (a head begun after a request that
    ended in the same read included). Past the bound: 503, closed; finished heads and
    closed connections give theirs back."""
    b = broker_factory("--workers", "1", "--max-body-bytes", str(BODY), "--max-incoming-bytes", str(LIMIT))
    part = 60_000  # of a head: 8 of them fit in LIMIT, the 9th does not
    conns = []
    late = Conn(b, timeout=30)  # (begun 3 s before the others: slower than each whenever it grows)
    try:
        late.send(b"GET /" + b"c" * 100)
        wait_for(lambda: incoming(b) == 105, timeout=10)
        time.sleep(3)
        for i in range(8):
            c = Conn(b, timeout=30)
            conns.append(c)
            if i % 2:  # a whole request, then most of the next head, in one send
                c.send(get_healthz() + b"GET /" + b"a" * part)
                assert c.response()[0] == 200
            else:  # a URL, then a header value, in two sends
                c.send(b"GET /" + b"a" * 1000)
                wait_for(lambda n=i: incoming(b) >= n * part + 1000, timeout=10)
                c.send(b" HTTP/1.1\r\nX-Pad: " + b"b" * (part - 1020))
            wait_for(lambda n=i + 1: incoming(b) >= n * part - 100, timeout=10)
        assert incoming(b) <= LIMIT
        with late:  # past the bound, nothing slower: refused
            late.send(b"c" * part)
            status, _, answer = late.response()
            assert status == 503, answer
            # (a head under way: not known to be JSON-RPC, a plain error; round 28: a JSON-RPC
            # -32000, counted in errors_total and calls_total whatever its path)
            assert json.loads(answer) == {"error": f"request bodies arriving or waiting exceed max_incoming_bytes {LIMIT}"}
            assert late.closed_within(5)
        conns[1].send(b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # a head finished: its bytes given back
        assert conns[1].response()[0] == 404
        for c in conns[:4]:
            c.sock.close()  # closed: theirs too
        wait_for(lambda: incoming(b) <= 4 * part + 2000, timeout=10)
    finally:
        for c in conns:
            c.sock.close()
        late.sock.close()
    wait_for(lambda: incoming(b) == 0, timeout=10)


def evicted_for_incoming(b: object) -> float:
    metrics = scrape_metrics(b)  # type: ignore[arg-type]
    return sum(sample(metrics, "rpc_broker_connections_evicted_total", transport=t, state="incoming")
               for t in ("http", "tcp", "unix"))


def test_requests_still_arriving_slower_give_way_to_a_faster_one_at_max_incoming_bytes(tmp_path):
    """Hostile testing, round 102 (MEDIUM): connections holding requests left unfinished,
    and silent, kept max_incoming_bytes full, and every other client's request that came in
    more than one read was refused (89 of 90 for 75 s after one burst). At the bound, the
    requests under way that came slower than the one needing room give way now, the slowest
    first, each answered why (408, or a -32600 line) and closed: here the oldest holder of
    three for an HTTP body, the next for an NDJSON line; the third, faster, finishes."""
    sb = start_stream_broker(tmp_path, "--workers", "1", "--max-body-bytes", str(BODY),
                             "--max-incoming-bytes", str(LIMIT))
    b = sb.broker
    opened: list[Conn] = []
    lines: list[Stream] = []
    try:
        oldest = Conn(b, timeout=30)  # (held 2 s, 1 s and 0 s before the first newcomer: the slowest first)
        oldest.send(head(b.path, BODY) + padded_call(BODY, 0)[:PART])
        wait_for(lambda: incoming(b) == PART, timeout=10)
        time.sleep(1)
        older = sb.connect("tcp")
        lines.append(older)
        older.send(padded_call(BODY, 1)[:PART])
        wait_for(lambda: incoming(b) == 2 * PART, timeout=10)
        time.sleep(1)
        newest = Conn(b, timeout=30)
        opened += [oldest, newest]
        newest.send(head(b.path, BODY) + padded_call(BODY, 2)[:PART])
        wait_for(lambda: incoming(b) == 3 * PART, timeout=10)
        honest = Conn(b, timeout=30)  # needs room: the oldest gives way
        opened.append(honest)
        honest.send(head(b.path, BODY) + padded_call(BODY, 3)[:PART])
        status, _, answer = oldest.response()
        assert status == 408, answer
        assert answer.startswith(b'{"error":"request still arriving after '), answer
        assert answer.endswith(b" s, slower than another, while the broker holds max_incoming_bytes "
                               b'%d of requests arriving"}' % LIMIT), answer
        assert oldest.closed_within(5)
        wait_for(lambda: incoming(b) == 3 * PART, timeout=10)
        honest_line = sb.connect("unix")  # the same for a line: the older gives way
        lines.append(honest_line)
        honest_line.send(padded_call(BODY, 4)[:PART])
        refusal = json.loads(older.readline())
        assert refusal["id"] is None and refusal["error"]["code"] == -32600, refusal
        assert refusal["error"]["data"].startswith("line still arriving after "), refusal
        assert refusal["error"]["data"].endswith(
            f" s, slower than another, while the broker holds max_incoming_bytes {LIMIT} of requests arriving")
        older.closed_within(5)
        assert evicted_for_incoming(b) == 2
        assert sample(scrape_metrics(b), "rpc_broker_incoming_refused_total") == 0
        log = b.read_log()  # (logged once, at the first: new user, round 100)
        assert log.count(f"max_incoming_bytes {LIMIT} reached: closed a connection whose request came slower") == 1
        assert "to make room (1 so far)" in log
        # Those that were not slower finish, and are answered.
        honest.send(padded_call(BODY, 3)[PART:])
        assert honest.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":3,"result":4}')
        honest_line.send(padded_call(BODY, 4)[PART:] + b"\n")
        assert honest_line.readline() == result(4, 5)
        newest.send(padded_call(BODY, 2)[PART:])
        assert newest.response()[:3:2] == (200, b'{"jsonrpc":"2.0","id":2,"result":3}')
        wait_for(lambda: incoming(b) == 0, timeout=10)
    finally:
        for c in (*opened, *lines):
            c.sock.close()
        assert b.stop() == 0, b.read_log()


def get_healthz() -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def test_an_unfinished_body_answered_early_is_freed_at_its_answer_not_when_the_linger_ends(broker_factory):
    """Hostile testing (round 9): 900 kB of a chunked body followed by a bad chunk-size
    line got 400 at once, or of a Content-Length body left unfinished got 408 at
    request_timeout; either way the bytes stayed held and counted in max_incoming_bytes
    for the lingering close's 30 s while the client trickled a byte a second. They go
    with the answer now."""
    b = broker_factory("--workers", "1", "--request-timeout", "1")
    head = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    chunked = Conn(b, timeout=30)
    sized = Conn(b, timeout=30)
    try:
        chunked.send(head + b"Transfer-Encoding: chunked\r\n\r\n2bf20\r\n" + b" " * 180_000)
        sized.send(head + b"Content-Length: 1000000\r\n\r\n" + b" " * 180_000)
        wait_for(lambda: incoming(b) == 2 * 180_000, timeout=10)
        chunked.send(b"\r\nZZZ\r\n")  # a bad chunk-size line: 400
        assert chunked.response()[0] == 400
        assert sized.response()[0] == 408  # (request_timeout, 1 s)
        for c in (chunked, sized):
            c.send(b" ")  # (still sending: the linger goes on)
        wait_for(lambda: incoming(b) == 0, timeout=3)  # at the answers, not 30 s later
    finally:
        chunked.sock.close()
        sized.sock.close()


def test_an_early_answer_queued_behind_a_slow_call_frees_the_body_at_once(broker_factory):
    """Hostile testing (round 10): a chunked body answered 400 (a bad chunk-size line)
    while a slow call was owed before it: the 400 waited its turn, and the 180 kB of the
    body stayed counted in max_incoming_bytes until it was written (the slow call's
    length). They go when the answer is made."""
    b = broker_factory("--workers", "1")
    slow = b'{"jsonrpc":"2.0","method":"sleep","params":[5],"id":"slow"}'
    with Conn(b, timeout=30) as c:
        c.send(head(b.path, len(slow)) + slow + b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n2bf20\r\n" + b" " * 180_000)
        wait_for(lambda: incoming(b) == 180_000, timeout=10)
        c.send(b"\r\nZZZ\r\n")
        wait_for(lambda: incoming(b) == 0, timeout=2)  # not after the slow call (5 s)
        status, _, answer = c.response()
        assert (status, json.loads(answer)["id"]) == (200, "slow")
        assert c.response()[0] == 400


def owing(id_bytes: int, seconds: float) -> bytes:
    """A batch that leaves its connection owed more than 64 KiB at once (an unknown
    method's answer echoes its long id) until a `sleep` of `seconds` returns."""
    return json.dumps([
        {"jsonrpc": "2.0", "method": "sleep", "params": [seconds], "id": 1},
        {"jsonrpc": "2.0", "method": "nosuch", "id": "x" * id_bytes},
    ]).encode()


def test_whole_bodies_and_lines_waiting_to_be_dispatched_count_too(tmp_path):
    """Hostile testing, round 11: a connection owed max_response_bytes keeps the requests
    it sends next undispatched (reading pauses) and they were counted nowhere: 300
    connections each owing a slow call and then sending a 1 MiB body held 322 MiB
    (rpc_broker_incoming_bytes 0). They count now while they wait; one that would pass
    max_incoming_bytes is refused (HTTP 503 in its place, after the answer owed before it;
    NDJSON a -32000 line), and those that waited are served when their turn comes."""
    sb = start_stream_broker(tmp_path, "--workers", "1", "--max-body-bytes", str(BODY),
                             "--max-incoming-bytes", str(LIMIT), "--max-response-bytes", str(64 * 1024))
    b = sb.broker
    conns: list[Conn] = []
    try:
        owed = owing(70_000, 4.0)
        # The two that will be refused owe their answers first (their 70 kB batches arrive
        # while there is room: arriving, past the bound, they would be refused as such).
        late, late_line = Conn(b, timeout=30), sb.connect("unix")
        conns.append(late)
        late.send(head(b.path, len(owed)) + owed)
        late_line.send(owed + b"\n")
        conns += [Conn(b, timeout=30) for _ in range(2)]
        for i, conn in enumerate(conns[1:]):
            conn.send(head(b.path, len(owed)) + owed + head(b.path, PART) + padded_call(PART, i))
        wait_for(lambda: incoming(b) == 2 * PART, timeout=10)
        with sb.connect("tcp") as stream, late_line:
            stream.send(owed + b"\n" + padded_call(PART, 2) + b"\n")
            wait_for(lambda: incoming(b) == 3 * PART, timeout=10)
            late_line.send(padded_call(PART, 4) + b"\n")  # past the bound: refused (NDJSON: at once)
            assert json.loads(late_line.readline()) == {"jsonrpc": "2.0", "id": None, "error": {
                "code": -32000, "message": "Server overloaded",
                "data": f"lines arriving or waiting exceed max_incoming_bytes {LIMIT}"}}
            late.send(head(b.path, PART) + padded_call(PART, 3))
            wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_incoming_refused_total") == 2, timeout=10)
            assert incoming(b) == 3 * PART
            status, _, first = late.response()  # (HTTP: in its place, after the answer owed)
            assert status == 200 and [a["id"] for a in json.loads(first)] == [1, "x" * 70_000]
            status, headers, answer = late.response()
            assert status == 503, answer
            assert json.loads(answer)["error"] == {"code": -32000, "message": "Server overloaded",
                "data": f"request bodies arriving or waiting exceed max_incoming_bytes {LIMIT}"}
            assert headers.get("retry-after") == "1"
            assert sample(scrape_metrics(b), "rpc_broker_incoming_refused_total") == 2
            # Those that waited are served in their turn, and what they held is free again.
            for i, conn in enumerate(conns[1:]):
                assert conn.response()[0] == 200
                assert conn.response()[:3:2] == (200, f'{{"jsonrpc":"2.0","id":{i},"result":{i + 1}}}'.encode())
            got = [json.loads(stream.readline()) for _ in range(2)]
            assert {"jsonrpc": "2.0", "id": 2, "result": 3} in got, got
            for conn in conns:
                conn.sock.close()
            wait_for(lambda: incoming(b) == 0, timeout=10)
    finally:
        for conn in conns:
            conn.sock.close()
        assert b.stop() == 0, b.read_log()


def test_a_read_left_for_a_later_turn_is_not_counted_twice_as_its_requests_wait(tmp_path):
    """Hostile testing, round 15: a connection owed max_response_bytes sends 100 requests
    of about 1 kB in one write (100-110 kB, under max_incoming_bytes). One turn takes 16 of
    them (they wait, counted); the rest, kept for a later turn, stayed counted while its
    requests were moved to wait, each counted again: 7 of 100 NDJSON lines were refused
    -32000 (HTTP: 10 of 100 answered 503). Each byte counts once now: all 100 are served,
    on each port in turn."""
    limit = 110_000
    sb = start_stream_broker(tmp_path, "--workers", "1", "--max-body-bytes", "100000",
                             "--max-incoming-bytes", str(limit), "--max-response-bytes", "65536")
    b = sb.broker
    owed = owing(70_000, 2.0)
    calls = [padded_call(1000, i) for i in range(100)]
    served = [{"jsonrpc": "2.0", "id": i, "result": i + 1} for i in range(100)]

    def owing_and_sending(send: typing.Callable[[bytes], None], framed: list[bytes]) -> None:
        send(framed[0])
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_outgoing_bytes") >= 70_000, timeout=10)
        time.sleep(0.3)  # (settled: the requests then come in one read, as in the finding)
        send(b"".join(framed[1:]))  # (one write, most of it for later turns)

    try:
        with sb.connect("tcp") as stream:
            owing_and_sending(stream.send, [owed + b"\n"] + [call + b"\n" for call in calls])
            got = [json.loads(line) for line in stream.lines(101, timeout=30)]
            assert [a for a in got if isinstance(a, dict) and "error" in a] == []
            assert [a["id"] for a in got[0]] == [1, "x" * 70_000]
            assert got[1:] == served
        wait_for(lambda: incoming(b) == 0, timeout=10)
        with Conn(b, timeout=30) as conn:
            owing_and_sending(conn.send, [head(b.path, len(c)) + c for c in [owed, *calls]])
            assert conn.response()[0] == 200
            answers = [conn.response()[::2] for _ in range(100)]
            assert [a for a in answers if a[0] != 200] == []
            assert [json.loads(a[1]) for a in answers] == served
        assert sample(scrape_metrics(b), "rpc_broker_incoming_refused_total") == 0
        wait_for(lambda: incoming(b) == 0, timeout=10)
    finally:
        assert b.stop() == 0, b.read_log()
