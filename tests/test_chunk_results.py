"""A chunk answered with its calls' finished Response objects (wire.CHUNK_RESULTS, issue 14
item 2): the ids the front-end sent, echoed byte for byte in request order; the same answers,
counts and bounds as the same results in entries (CHUNK_REPLY) wherever the one-piece path
cannot be taken (past max_response_bytes or max_outgoing_bytes, after a part, the access log
writing every call); a worker's death, a deadline, a part and a broken worker's bytes around
it. In memory (test_dispatch_core.py's set-up), and through a real broker, with one front-end
and with two (each front-end's chunks answered on its own link, their ids as it sent them; the
worker's side: test_worker_sdk.py, `test_a_worker_answers_a_chunk_of_results_with_its_objects_...`).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import typing
from pathlib import Path

import pytest
from conftest import wait_for
from test_dispatch import _entries_from, add_worker
from test_dispatch_core import Clock, chunk_answers, one_worker
from test_frontends import peers_of, tcp_sockets

from broker import chunk
from broker.answers import Exchange
from broker.dispatch import Dispatcher
from broker.jsonrpc import Codec, ErrorCode
from broker.metrics import OK, CallMetrics
from broker.wire import CALL_ENTRY, RESULT, Kind

# Ids of every JSON type a call may have, as a client may write them: each must come back as
# written (a number past 64 bits, an exponent, escapes, raw UTF-8, null).
IDS = [b"1", b"123456789012345678901234567890", b"-1.5e+300", b'"a\\"\\\\\\u00e9\\n"', '"é ☃"'.encode(), b"null",
       b"0", b'""']


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> typing.Iterator[Clock]:
    """Time injected (test_dispatch_core.Clock)."""
    c = Clock(monkeypatch)
    yield c
    c.loop.close()


def batch_body(codec: Codec, ids: list[bytes], method: str = "a", between: bytes | None = None) -> typing.Any:
    """A batch of calls of `method` with these raw `ids` (params: their place), written by
    hand so each id keeps its bytes; `between`: an element put after the first call."""
    elements = [b'{"jsonrpc":"2.0","method":"%s","params":[%d],"id":%s}' % (method.encode(), i, id_)
                for i, id_ in enumerate(ids)]
    if between is not None:
        elements.insert(1, between)
    return codec.decode(b"[" + b",".join(elements) + b"]")


def sent_ids(frame: tuple[int, int, int, bytes]) -> list[bytes]:
    """The raw ids a CHUNK frame carries, in order."""
    ids, pos, payload = [], 0, frame[3]
    while pos < len(payload):
        _method, _notification, start, end = chunk.read_call(payload, pos)
        ids.append(payload[pos + CALL_ENTRY.size : start])
        pos = end
    return ids


def results_of(frame: tuple[int, int, int, bytes], results: list[bytes] | None = None) -> bytes:
    """A CHUNK_RESULTS payload answering the calls of a CHUNK frame (each its place, unless
    `results` says), with the ids it carries, as the worker writes it (`chunk.results_payload`)."""
    answers: list[bytes] = []
    for i, id_ in enumerate(sent_ids(frame)):
        answers += [id_, results[i] if results is not None else b"%d" % i]
    return chunk.results_payload(answers)


def entries_of(frame: tuple[int, int, int, bytes], results: list[bytes] | None = None) -> bytes:
    """The same answers as `results_of`, in entries (a CHUNK_REPLY's)."""
    n = len(sent_ids(frame))
    return chunk_answers(*((i, RESULT, results[i] if results is not None else b"%d" % i) for i in range(n)))


# -- chunk.py: the layout, byte for byte -------------------------------------------------


def test_a_chunks_results_are_its_response_objects_in_order_split_and_read_back_as_entries():
    payload = chunk.results_payload([IDS[0], b"3", IDS[1], b'"x"', IDS[2], b"[1,{}]"])
    assert payload == (b'{"jsonrpc":"2.0","id":1,"result":3}\n'
                       b'{"jsonrpc":"2.0","id":123456789012345678901234567890,"result":"x"}\n'
                       b'{"jsonrpc":"2.0","id":-1.5e+300,"result":[1,{}]}')
    parts = chunk.results(payload, 3)
    assert parts is not None and [json.loads(p)["result"] for p in parts] == [3, "x", [1, {}]]
    assert chunk.results(payload, 2) is None and chunk.results(payload, 4) is None
    assert chunk.entries_of(parts, IDS[:3]) == chunk_answers((0, RESULT, b"3"), (1, RESULT, b'"x"'),
                                                             (2, RESULT, b"[1,{}]"))
    assert chunk.entries_of(parts, [IDS[0], b"2", IDS[2]]) is None  # (an id not as sent: not the worker's to change)
    assert chunk.entries_of([parts[0][:-1]], IDS[:1]) is None  # (not a whole object)


# -- the front-end: one piece per chunk -------------------------------------------------


def test_ids_of_every_json_type_come_back_byte_for_byte_in_request_order_over_two_workers(clock):
    metrics = CallMetrics()
    d = Dispatcher(clock.loop, metrics=metrics, connection_share=1.0)
    d.set_methods(["a"])
    workers = [add_worker(d, 0, concurrency=100), add_worker(d, 1, concurrency=100)]
    done: list[Exchange] = []
    d.submit(batch_body(Codec(), IDS), done.append)
    frames = [f for w in workers for f in w.channel.take()]
    assert [f[0] for f in frames] == [Kind.CHUNK, Kind.CHUNK]
    assert sorted(sent_ids(f) for f in frames) == sorted([IDS[0::2], IDS[1::2]])  # (dealt out like cards)
    clock.advance(0.5)
    for w in workers:
        [frame] = [f for f in frames if f[1] in w.channel.deadlines]
        d.on_reply(w, Kind.CHUNK_RESULTS, frame[1], 0, results_of(frame, [b'"%d"' % IDS.index(i) for i in sent_ids(frame)]))
    [exchange] = done
    assert exchange.body() == b"[" + b",".join(
        b'{"jsonrpc":"2.0","id":%s,"result":"%d"}' % (id_, i) for i, id_ in enumerate(IDS)) + b"]"
    assert metrics.outcomes[0] == {OK: len(IDS)} and metrics.latency[0].sum_us == len(IDS) * 500_000
    assert exchange.budget.held == sum(map(len, exchange.answers)) and d.in_flight_calls == 0  # type: ignore[arg-type]
    assert all(w.outstanding == 0 for w in workers)


def test_a_chunk_whose_slots_are_not_evenly_spaced_fills_each_in_request_order(clock):
    d, w, codec, done = one_worker(clock.loop, ["a"])
    d.submit(batch_body(codec, IDS[:4], between=b'{"jsonrpc":"2.0","method":"nope","id":"x"}'), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, Kind.CHUNK_RESULTS, frame[1], 0, results_of(frame))
    answers = json.loads(done[0].body())
    assert [a.get("result", a.get("error", {}).get("code")) for a in answers] == [0, -32601, 1, 2, 3]


def twice(clock: Clock, reply: typing.Callable[[Dispatcher, typing.Any, tuple[int, int, int, bytes], bool], None],
          **settings: typing.Any) -> list[tuple[list[object], dict[int, int], int, int, int]]:
    """Run one scenario with the worker's answers in entries, then as Response objects
    (`reply(d, w, frame, as_results)`): per run, the answers, the outcomes counted, the bytes
    held, and the refusals of both bounds."""
    runs = []
    for as_results in (False, True):
        metrics = CallMetrics()
        d, w, codec, done = one_worker(clock.loop, ["a"], metrics=metrics, **settings)
        d.submit(batch_body(codec, IDS[:5]), done.append)
        [frame] = w.channel.take()
        reply(d, w, frame, as_results)
        assert len(done) == 1 and d.in_flight_calls == 0 and w.outstanding == 0
        runs.append(([json.loads(a) for a in done[0].answers], dict(metrics.outcomes[0]), done[0].budget.held,  # type: ignore[arg-type]
                     d.oversize_total, d.outgoing.refused_total))
    return runs


LARGE = [b"0", b'"%s"' % (b"x" * 300), b"2", b'"%s"' % (b"y" * 300), b"4"]


@pytest.mark.parametrize("limits", [{"max_response_bytes": 600}, {"max_outgoing_bytes": 600}])
def test_a_chunks_results_past_a_bound_are_refused_one_by_one_as_entries_would_be(clock, limits):
    """The objects do not fit as one piece: each is tested as an entry would be, those that
    do not fit refused -32603 alone, the others kept (its id as the front-end has it)."""

    def reply(d: Dispatcher, w: typing.Any, frame: tuple[int, int, int, bytes], as_results: bool) -> None:
        kind, payload = (Kind.CHUNK_RESULTS, results_of(frame, LARGE)) if as_results else \
            (Kind.CHUNK_REPLY, entries_of(frame, LARGE))
        d.on_reply(w, kind, frame[1], 0, payload)

    entries, results = twice(clock, reply, **limits)
    assert results == entries
    answers = entries[0]
    # (the third fits; the fourth does not, and its refusal leaves no room for the fifth)
    assert [a.get("result", a.get("error", {}).get("code")) for a in answers] == [0, "x" * 300, 2, -32603, -32603]  # type: ignore[union-attr]
    assert [a["id"] for a in answers] == [json.loads(i) for i in IDS[:5]]  # type: ignore[index]
    assert entries[1] == {OK: 3, ErrorCode.INTERNAL_ERROR: 2} and entries[3] + entries[4] == 2


def test_a_chunk_answered_in_part_then_whole_keeps_each_first_answer_once(clock):
    """A part, then (a worker that should not) every call's object: the one answered in the
    part keeps its first answer and is counted once, as with entries."""

    def reply(d: Dispatcher, w: typing.Any, frame: tuple[int, int, int, bytes], as_results: bool) -> None:
        d.on_reply(w, Kind.CHUNK_PART, frame[1], 0, chunk_answers((1, RESULT, b'"first"')))
        kind, payload = (Kind.CHUNK_RESULTS, results_of(frame)) if as_results else (Kind.CHUNK_REPLY, entries_of(frame))
        d.on_reply(w, kind, frame[1], 0, payload)

    entries, results = twice(clock, reply)
    assert results == entries
    assert [a["result"] for a in entries[0]] == [0, "first", 2, 3, 4] and entries[1] == {OK: 5}  # type: ignore[index]


def test_the_access_log_of_every_call_reads_a_chunks_results_one_by_one(clock):
    lines: list[tuple[int, int]] = []

    class Log:
        def chunk_results(self, call: typing.Any, places: list[int] | None, latency: float) -> None:
            lines.extend((p, 0) for p in (places if places is not None else range(len(call.slots))))

    d, w, codec, done = one_worker(clock.loop, ["a"])
    d.access_ok = Log()  # type: ignore[assignment]
    d.submit(batch_body(codec, IDS[:3]), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, Kind.CHUNK_RESULTS, frame[1], 0, results_of(frame))
    assert lines == [(0, 0), (1, 0), (2, 0)] and [a["result"] for a in json.loads(done[0].body())] == [0, 1, 2]


def test_a_worker_dying_after_one_chunk_of_a_batch_answered_fails_only_the_other(clock):
    metrics = CallMetrics()
    d = Dispatcher(clock.loop, metrics=metrics, connection_share=1.0)
    d.set_methods(["a"])
    first, second = add_worker(d, 0, concurrency=100), add_worker(d, 1, concurrency=100)
    second.pid = 77
    done: list[Exchange] = []
    d.submit(batch_body(Codec(), IDS[:6]), done.append)
    [one] = first.channel.take()
    [other] = second.channel.take()
    d.on_reply(first, Kind.CHUNK_RESULTS, one[1], 0, results_of(one))
    d.on_reply(second, Kind.CHUNK_PART, other[1], 0, chunk_answers((0, RESULT, b'"part"')))
    assert not done
    d.worker_lost(second, "killed by SIGKILL")
    expected: list[object] = [-32002] * 6
    for place, id_ in enumerate(sent_ids(one)):
        expected[IDS.index(id_)] = place
    expected[IDS.index(sent_ids(other)[0])] = "part"
    answers = json.loads(done[0].body())
    assert [a.get("result", a.get("error", {}).get("code")) for a in answers] == expected
    assert [a["id"] for a in answers] == [json.loads(i) for i in IDS[:6]]
    assert metrics.outcomes[0] == {OK: 4, ErrorCode.WORKER_DIED: 2}


def test_a_chunks_results_after_its_deadline_are_counted_late_and_change_no_answer(clock):
    d, w, codec, done = one_worker(clock.loop, ["a"], timeout=1.0)
    d.submit(batch_body(codec, IDS[:3]), done.append)
    [frame] = w.channel.take()
    clock.advance(1.5)
    answers = json.loads(done[0].body())
    assert [a["error"]["code"] for a in answers] == [-32001] * 3
    d.on_reply(w, Kind.CHUNK_RESULTS, frame[1], 0, results_of(frame))
    assert d.late_results_total == 3 and d.late_cancelled_total == 0 and w.outstanding == 0
    assert json.loads(done[0].body()) == answers


def test_a_chunk_given_back_in_part_takes_the_objects_of_the_calls_it_kept(clock):
    d, w, codec, done = one_worker(clock.loop, ["a"])
    d.submit(batch_body(codec, IDS[:4]), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, Kind.RETURN, frame[1], 2, _entries_from(frame[3], 2))  # calls 2 and 3 back
    d.on_reply(w, Kind.CHUNK_RESULTS, frame[1], 0, chunk.results_payload([IDS[0], b"0", IDS[1], b"1"]))
    assert not done and d.in_flight_calls + d.queued_calls == 2  # (those given back: as blocking calls, one by one)
    for _ in range(4):  # (bounded: two calls)
        for f in w.channel.take():
            assert f[0] == Kind.CALL
            d.on_reply(w, Kind.RESULT, f[1], 0, b'"again"')
    assert [a["result"] for a in json.loads(done[0].body())] == [0, 1, "again", "again"]


@pytest.mark.parametrize("payload", [
    b'{"jsonrpc":"2.0","id":1,"result":0}\n{"jsonrpc":"2.0","id":123456789012345678901234567890,"result":1}',
    b'{"jsonrpc":"2.0","id":1,"result":0}\n{"jsonrpc":"2.0","id":9,"result":1}\n'  # (an id it was not sent)
    b'{"jsonrpc":"2.0","id":-1.5e+300,"result":2}',
    b'{"jsonrpc":"2.0","id":1,"result":0}\n{"jsonrpc":"2.0","id":123456789012345678901234567890,"result":1}\n'
    b'{"jsonrpc":"2.0","id":-1.5e+300,"result":2',  # (not a whole object)
], ids=["two objects for three calls", "an id not as sent", "cut short"])
def test_a_broken_workers_objects_are_never_passed_on(clock, payload):
    """A worker's objects, read one by one (here: after a part), are checked to be one per
    call with the ids as sent: else the chunk's calls left are answered -32603 (logged). As
    one piece they are trusted as a worker's results in entries are (its own code writes
    them, and no result holds a `\n`: `ChunkRuns._advance`): only their count is checked."""
    d, w, codec, done = one_worker(clock.loop, ["a"])
    d.submit(batch_body(codec, IDS[:3]), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, Kind.CHUNK_PART, frame[1], 0, chunk_answers((0, RESULT, b'"part"')))
    d.on_reply(w, Kind.CHUNK_RESULTS, frame[1], 0, payload)
    answers = json.loads(done[0].body())
    assert [a["id"] for a in answers] == [json.loads(i) for i in IDS[:3]]
    assert [a.get("result") or a["error"]["data"] for a in answers] == ["part"] + ["the worker's answer was malformed"] * 2


def test_a_broken_workers_objects_not_one_a_call_are_never_passed_on_even_as_one_piece(clock):
    d, w, codec, done = one_worker(clock.loop, ["a"])
    d.submit(batch_body(codec, IDS[:3]), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, Kind.CHUNK_RESULTS, frame[1], 0, results_of(frame).replace(b"\n", b",", 1))
    assert [a["error"]["code"] for a in json.loads(done[0].body())] == [-32603] * 3


# -- a real broker: a batch of 100 over 2 workers --------------------------------------


def test_a_batch_over_two_workers_echoes_every_id_as_written_in_request_order(broker_factory):
    b = broker_factory("--workers", "2")
    ids = [IDS[i % len(IDS)] if i % 3 else b"%d" % (10**25 + i) for i in range(100)]
    body = b"[" + b",".join(b'{"jsonrpc":"2.0","method":"add","params":[%d,1],"id":%s}' % (i, id_)
                            for i, id_ in enumerate(ids)) + b"]"
    status, _, answer = b.post(body)
    assert status == 200
    assert answer == b"[" + b",".join(b'{"jsonrpc":"2.0","id":%s,"result":%d}' % (id_, i + 1)
                                      for i, id_ in enumerate(ids)) + b"]"


# -- a real broker with two front-ends: each chunk's objects to the connection that sent it -


# Valid ids of every JSON kind (JSON-RPC 2.0 section 4: a string, a number or null), as a
# client may write them: -0, fractions and exponents, past 64 bits, escapes, raw UTF-8.
EVERY_ID = [*IDS, b"-0", b"1.0", b"1e2", b"-1E+2", b"0.5e-3", b"-123456789012345678901234567890",
            b'"\\ud83d\\ude00 \\/ \\t"', b'"1"', b"2"]
# Not ids (an object, an array, a boolean): each such element is answered -32600 with id null.
NOT_IDS = [b"{}", b"[1]", b"true"]


def server_side(sock: socket.socket, port: int, pids: list[int]) -> int | None:
    """Which of the processes `pids` holds the server's end of `sock`, a connection to `port`
    (the kernel hands each to one front-end's listening socket): None if none does yet."""
    client = f":{sock.getsockname()[1]:04X}"
    server = f":{port:04X}"
    for line in (Path("/proc/net/tcp").read_text() + Path("/proc/net/tcp6").read_text()).splitlines():
        fields = line.split()
        if fields[1].endswith(server) and fields[2].endswith(client) and fields[9].isdigit() and int(fields[9]):
            for pid in pids:
                if int(fields[9]) in tcp_sockets(pid):
                    return pid
    return None


def test_a_batch_over_two_front_ends_answers_every_call_with_its_exact_id_on_each(broker_factory):
    """`--frontends 2`: every worker serves both front-ends, whose chunks carry the same call
    ids and the same client ids at once (the worker tags them by link, broker/worker/links.py).
    Each connection's batches come back with its own results, every id as its client wrote
    it, in request order, whichever front-end took the connection."""
    b = broker_factory("--workers", "2", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    pids = [b.pid, *peers_of(b.pid)]
    by_pid: dict[int, list[http.client.HTTPConnection]] = {pid: [] for pid in pids}
    conns: list[http.client.HTTPConnection] = []

    def post(conn: http.client.HTTPConnection, body: bytes) -> bytes:
        conn.request("POST", b.path, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read()

    try:
        # Connections until each front-end holds two (the kernel spreads them by their ports)
        for _ in range(64):
            if all(len(held) >= 2 for held in by_pid.values()):
                break
            conn = b.connection(30)
            conns.append(conn)
            assert post(conn, b'{"jsonrpc":"2.0","method":"add","params":[1,1],"id":0}') == (
                b'{"jsonrpc":"2.0","id":0,"result":2}')
            sock = typing.cast(socket.socket, conn.sock)
            wait_for(lambda s=sock: server_side(s, b.port, pids) is not None, timeout=10)  # type: ignore[misc]
            by_pid[typing.cast(int, server_side(sock, b.port, pids))].append(conn)
        assert all(len(held) >= 2 for held in by_pid.values()), {p: len(h) for p, h in by_pid.items()}
        # The answer each front-end gives an element that is not a valid request, alone
        invalid = {id_: post(conns[0], b'[{"jsonrpc":"2.0","method":"add","params":[0,0],"id":%s}]' % id_)[1:-1]
                   for id_ in NOT_IDS}
        assert all(json.loads(a)["id"] is None and json.loads(a)["error"]["code"] == -32600 for a in invalid.values())
        served = [conn for held in by_pid.values() for conn in held]

        def batch(k: int, mixed: bool) -> tuple[bytes, bytes]:
            """Connection `k`'s batch of 100 calls and the answer owed it, byte for byte;
            `mixed`: invalid elements and notifications among the calls (their slots not
            evenly spaced)."""
            elements, answers = [], []
            for i in range(100):
                id_ = EVERY_ID[i % len(EVERY_ID)]
                elements.append(b'{"jsonrpc":"2.0","method":"add","params":[%d,%d],"id":%s}' % (i, 1000 * k, id_))
                answers.append(b'{"jsonrpc":"2.0","id":%s,"result":%d}' % (id_, i + 1000 * k))
                if mixed and i % 7 == 3:
                    bad = NOT_IDS[i % len(NOT_IDS)]
                    elements.append(b'{"jsonrpc":"2.0","method":"add","params":[0,0],"id":%s}' % bad)
                    answers.append(invalid[bad])
                    elements.append(b'{"jsonrpc":"2.0","method":"add","params":[0,0]}')
            return b"[" + b",".join(elements) + b"]", b"[" + b",".join(answers) + b"]"

        for mixed in (False, True, False):  # each connection's batch at once on both front-ends
            owed = [batch(k, mixed) for k in range(len(served))]
            got: list[bytes | BaseException] = [b""] * len(served)

            def send(k: int, body: bytes, got: list[bytes | BaseException]) -> None:
                try:
                    got[k] = post(served[k], body)
                except BaseException as exc:  # (raised below, in the test's thread)
                    got[k] = exc

            threads = [threading.Thread(target=send, args=(k, owed[k][0], got)) for k in range(len(served))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            for k, answer in enumerate(got):
                if isinstance(answer, BaseException):
                    raise answer
                assert answer == owed[k][1], (k, mixed, answer[:300])
    finally:
        for conn in conns:
            conn.close()
