"""max_response_bytes: what one connection may be owed of answers it has not read
(attack-b finding 3: 8 pipelined batches of big answers, never read, took the broker from
36 MB to 973 MB). Real broker, real workers (tests/apps/hostile.py `async_blob`), real
sockets on loopback: the broker's resident memory is read from /proc while a client
pipelines batches with big answers and does not read; then the client reads, and every
call must be answered exactly once.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import typing

import pytest
from conftest import Broker, free_port, sample, scrape_metrics, start_broker, wait_for

APP = "tests.apps.hostile:registry"
LIMIT = 8 * 1024 * 1024  # --max-response-bytes
BLOB = 300_000  # bytes of each result: 100 of them make a 30 MB batch answer
BATCH = 100
BURST = 8  # bodies sent at once (read together): 240 MB of answers
BODIES = 16  # pipelined in all: 480 MB of answers
TOO_LARGE = f"responses owed on this connection exceed max_response_bytes {LIMIT}"


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (Linux /proc/<pid>/status VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for row in f:
            if row.startswith("VmRSS:"):
                return int(row.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def batch_body(tag: int) -> bytes:
    return json.dumps(
        [{"jsonrpc": "2.0", "method": "async_blob", "params": [BLOB], "id": f"{tag}-{i}"} for i in range(BATCH)]
    ).encode()


def http_request(body: bytes) -> bytes:
    return (
        b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


def recv_until(sock: socket.socket, buf: bytearray, done: typing.Callable[[], bool]) -> None:
    """Receive into `buf` until `done()` (the socket's timeout bounds each read)."""
    while not done():
        chunk = sock.recv(1 << 20)
        assert chunk, "connection closed"
        buf += chunk


def read_http_response(sock: socket.socket, buf: bytearray) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a content-length from `sock` (rest kept in `buf`)."""
    recv_until(sock, buf, lambda: b"\r\n\r\n" in buf)
    head, _, _ = bytes(buf).partition(b"\r\n\r\n")
    del buf[: len(head) + 4]
    length = next(int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:]) if k.lower() == b"content-length")
    recv_until(sock, buf, lambda: len(buf) >= length)
    body = bytes(buf[:length])
    del buf[:length]
    return int(head[9:12]), body


def read_line(sock: socket.socket, buf: bytearray) -> bytes:
    recv_until(sock, buf, lambda: b"\n" in buf)
    line, _, _ = bytes(buf).partition(b"\n")
    del buf[: len(line) + 1]
    return line


def quiet(b: Broker) -> bool:
    """No call in flight or queued, seen on two scrapes 0.2 s apart (the calls the broker
    dispatched are all answered; what it holds back stays held back)."""
    for _ in range(2):
        s = scrape_metrics(b)
        if sample(s, "rpc_broker_calls_in_flight") or sample(s, "rpc_broker_queued_calls"):
            return False
        time.sleep(0.2)
    return True


def check_batch(answer: list[dict[str, object]], tag: int) -> tuple[int, int]:
    """Every call of batch `tag` answered exactly once: a full result, or -32603 saying
    max_response_bytes, with its own id. Returns (results, refused)."""
    assert sorted(str(a["id"]) for a in answer) == sorted(f"{tag}-{i}" for i in range(BATCH))
    results = refused = 0
    for a in answer:
        if "result" in a:
            assert a["result"] == "x" * BLOB
            results += 1
        else:
            assert a["error"] == {"code": -32603, "message": "Internal error", "data": TOO_LARGE}, a
            refused += 1
    return results, refused


def answered(b: Broker) -> float:
    """Calls of async_blob answered so far, whatever their outcome, and calls abandoned (their
    connection gone first: `Dispatcher.abandon`)."""
    return sum(
        v for (name, labels), v in scrape_metrics(b).items()
        if (name == "rpc_broker_calls_total" and ("method", "async_blob") in labels)
        or name == "rpc_broker_calls_abandoned_total"
    )  # fmt: skip


@pytest.mark.parametrize("transport", ["http", "ndjson"])
def test_a_client_that_does_not_read_big_answers_holds_about_max_response_bytes(transport: str) -> None:
    """8 pipelined batches sent at once (the broker reads them together), each answer
    (30 MB) past max_response_bytes (8 MiB), not read; then 8 more: 480 MB of answers in
    all. The first 8 run and share the budget (their results past it are refused); the
    next 8 wait undispatched while the client does not read; the broker's memory grows by
    far less than 240 MB (every answer was kept before). Once the client reads, the waiting
    ones run one after the other, each with the whole budget: every call of every batch is
    answered exactly once (a result, or -32603 with its id)."""
    flags = ["--workers", "2", "--app", APP, "--max-response-bytes", str(LIMIT), "--timeout", "60"]
    port = 0
    if transport == "ndjson":
        port = free_port()
        flags += ["--stream-port", str(port)]
    b = start_broker(*flags)
    sock = socket.socket()
    try:
        if transport == "ndjson":
            wait_for(lambda: "tcp://" in b.read_log(0.05), timeout=10)
        assert b.call("async_blob", [10])["result"] == "x" * 10  # workers warm
        before = rss_bytes(b.pid)
        # A small receive window, so that the kernel's buffers (up to 4 MiB of send buffer
        # here: tcp_wmem) take less than one budget's worth of answers.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", port or b.port))
        frame = http_request if transport == "http" else (lambda body: body + b"\n")
        peak = before
        for first, last in ((0, BURST), (BURST, BODIES)):
            sock.sendall(b"".join(frame(batch_body(tag)) for tag in range(first, last)))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                peak = max(peak, rss_bytes(b.pid))
                if peak - before > 250 * 1024 * 1024 or quiet(b):
                    break
            peak = max(peak, rss_bytes(b.pid))
            # The budget (8 MiB), the transient copies of one answer while it is written,
            # the bodies read, the workers' reply frames passing through (the calls of the
            # bodies read together all run; their results past the budget are dropped as
            # they come): tens of MB. 128 MiB is a generous margin; 240 MB were kept before.
            assert peak - before < 128 * 1024 * 1024, f"RSS grew by {(peak - before) / 2**20:.0f} MiB"
            # The burst ran; the bodies sent after it wait: none of their calls ran.
            assert answered(b) == 1 + BATCH * BURST

        # Now read: every call answered exactly once, in every batch.
        buf = bytearray()
        seen: set[int] = set()
        for _ in range(BODIES):
            if transport == "http":
                status, body = read_http_response(sock, buf)
                assert status == 200
            else:
                body = read_line(sock, buf)
            answer = json.loads(body)
            tag = int(str(answer[0]["id"]).partition("-")[0])
            assert tag not in seen
            seen.add(tag)
            results, refused = check_batch(answer, tag)
            if tag >= BURST:  # run one at a time once the client read: each had the whole budget
                assert results >= LIMIT // (BLOB + 100) - 1, (tag, results)  # (id and members: < 100 bytes)
            assert refused > 0  # 30 MB of results do not fit in 8 MiB
        assert seen == set(range(BODIES))
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):  # nothing more: no answer twice
            sock.recv(1)
        assert answered(b) == 1 + BATCH * BODIES
    finally:
        sock.close()
        assert b.stop() == 0, b.read_log()


def test_results_past_max_response_bytes_get_internal_error_with_their_own_ids(broker_factory) -> None:  # type: ignore[no-untyped-def]
    """A batch whose answer would pass max_response_bytes: the results that would push it
    past are answered -32603 with their own ids, the others (small ones included) as
    usual; a single result past it is -32603 too (status 200, as every -32603)."""
    limit = 64 * 1024
    b: Broker = broker_factory("--workers", "1", "--app", APP, "--max-response-bytes", str(limit))
    conn = b.connection()  # one keep-alive connection: its budget is given back after each answer

    def post(body: object) -> tuple[int, bytes]:
        conn.request("POST", "/", body=json.dumps(body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()

    calls = [{"jsonrpc": "2.0", "method": "async_blob", "params": [25_000], "id": i} for i in range(4)]
    calls += [{"jsonrpc": "2.0", "method": "async_blob", "params": [3], "id": "small"}]
    for _ in range(2):
        status, raw = post(calls)
        assert status == 200
        answer = {json.dumps(a["id"]): a for a in json.loads(raw)}
        assert sorted(answer) == sorted(json.dumps(c["id"]) for c in calls)
        assert answer['"small"']["result"] == "xxx"
        big = [answer[str(i)] for i in range(4)]
        kept = [a for a in big if "result" in a]
        assert len(kept) == 2, big  # 2 x 25 kB fit in 64 KiB, a third does not
        assert all(a["result"] == "x" * 25_000 for a in kept)
        for a in big:
            if "error" in a:
                assert a["error"] == {
                    "code": -32603, "message": "Internal error",
                    "data": f"responses owed on this connection exceed max_response_bytes {limit}",
                }  # fmt: skip
        assert len(raw) <= limit + 1024
    status, raw = post({"jsonrpc": "2.0", "method": "async_blob", "params": [70_000], "id": "one"})
    assert status == 200
    assert json.loads(raw)["id"] == "one"
    assert json.loads(raw)["error"]["data"] == f"responses owed on this connection exceed max_response_bytes {limit}"
    assert sample(scrape_metrics(b), "rpc_broker_responses_oversize_total") == 2 + 2 + 1
    status, raw = post({"jsonrpc": "2.0", "method": "async_blob", "params": [60_000], "id": 2})
    assert json.loads(raw)["result"] == "x" * 60_000
    conn.close()


def test_connections_that_do_not_read_hold_at_most_max_outgoing_bytes_together() -> None:
    """max_response_bytes bounds one connection; 40 connections that never read held
    300 MiB (hostile testing), 10,000 could hold 320 GiB. All connections together now
    hold at most max_outgoing_bytes: answers past it are -32603, and the sweep resets the
    connections not reading theirs, most owed first, until under half the limit. Then a
    client that reads is answered as usual; the others still open get every answer, each
    call exactly once."""
    # 30 x 300 kB: 9 MB a batch, past the kernel's send buffer (up to 4 MiB here: tcp_wmem),
    # whose bytes the broker does not hold; 24 connections: 192 MiB held, unbounded.
    limit, total, conns, blobs = LIMIT, 32 * 1024 * 1024, 24, 30
    b = start_broker(
        "--workers", "2", "--app", APP, "--timeout", "60",
        "--max-response-bytes", str(limit), "--max-outgoing-bytes", str(total),
    )  # fmt: skip
    socks: list[socket.socket] = []
    try:
        assert b.call("async_blob", [10])["result"] == "x" * 10  # workers warm
        before = rss_bytes(b.pid)
        peak = before
        for tag in range(conns):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.settimeout(30)
            sock.connect(("127.0.0.1", b.port))
            body = json.dumps([
                {"jsonrpc": "2.0", "method": "async_blob", "params": [BLOB], "id": f"{tag}-{i}"} for i in range(blobs)
            ]).encode()  # fmt: skip
            sock.sendall(http_request(body))
            socks.append(sock)
        held = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            peak = max(peak, rss_bytes(b.pid))
            metrics = scrape_metrics(b)
            held.append(sample(metrics, "rpc_broker_outgoing_bytes"))
            if answered(b) >= 1 + conns * blobs and sample(metrics, "rpc_broker_connections_shed_total", transport="http"):
                break
            time.sleep(0.1)
        metrics = scrape_metrics(b)
        assert answered(b) == 1 + conns * blobs
        assert sample(metrics, "rpc_broker_outgoing_refused_total") > 0
        shed = sample(metrics, "rpc_broker_connections_shed_total", transport="http")
        assert shed >= 1
        assert max(held) <= total + 64 * 1024, held  # (each refusal's small answer is admitted past it)
        # Unbounded, 24 x 8 MiB = 192 MiB of answers would be kept.
        assert peak - before < 96 * 1024 * 1024, f"RSS grew by {(peak - before) / 2**20:.0f} MiB"
        assert b.call("async_blob", [10])["result"] == "x" * 10  # a client that reads
        # Those still open get their whole answer, each call once; the others were reset.
        kept = cut = 0
        for tag, sock in enumerate(socks):
            buf = bytearray()
            try:
                status, raw = read_http_response(sock, buf)
            except (ConnectionResetError, AssertionError):  # (AssertionError: closed, from recv_until)
                cut += 1
                continue
            assert status == 200
            answer = json.loads(raw)
            assert sorted(a["id"] for a in answer) == sorted(f"{tag}-{i}" for i in range(blobs))
            for a in answer:
                assert a.get("result") == "x" * BLOB or a["error"]["code"] == -32603, a
            kept += 1
        metrics = scrape_metrics(b)  # (a sweep after the last refusals may have shed more)
        assert cut == sample(metrics, "rpc_broker_connections_shed_total", transport="http") >= shed
        assert kept == conns - cut
        assert sample(metrics, "rpc_broker_outgoing_bytes") == 0
    finally:
        for sock in socks:
            sock.close()
        assert b.stop() == 0, b.read_log()


def test_clients_that_read_cannot_hold_max_outgoing_bytes_with_answers_queued_behind_a_slow_call() -> None:
    """Hostile testing (round 9): 4 connections each sent a slow call, then echo calls of
    about 1 MB pipelined behind it, and read: their finished answers, kept in order
    behind the slow call, filled max_outgoing_bytes, and only connections not reading
    were reset, so every other client's call (a 10-byte echo too) was -32603 for as long
    as the slow calls lasted. The connections owed the most are reset at once now,
    whatever their clients do: another client is answered as usual right after."""
    limit, total = 4 * 1024 * 1024, 8 * 1024 * 1024
    b = start_broker("--workers", "2", "--timeout", "60", "--max-response-bytes", str(limit),
                     "--max-outgoing-bytes", str(total))
    socks: list[socket.socket] = []
    blob = "x" * 900_000
    try:
        assert b.call("echo", ["warm"])["result"] == ["warm"]
        for tag in range(4):
            sock = socket.create_connection(("127.0.0.1", b.port), timeout=30)
            socks.append(sock)
            calls = [{"jsonrpc": "2.0", "method": "sleep", "params": [20], "id": f"{tag}-slow"}]
            calls += [{"jsonrpc": "2.0", "method": "echo", "params": [blob], "id": f"{tag}-{i}"} for i in range(4)]
            sock.sendall(b"".join(http_request(json.dumps(c).encode()) for c in calls))
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_connections_shed_total", transport="http") >= 1,
                 timeout=30)
        metrics = scrape_metrics(b)
        assert sample(metrics, "rpc_broker_outgoing_refused_total") >= 1
        assert sample(metrics, "rpc_broker_outgoing_bytes") <= total
        started = time.monotonic()
        answers = [b.call("echo", ["victim"]) for _ in range(5)]  # (the slow calls still run: 20 s)
        assert answers == [{"jsonrpc": "2.0", "id": 1, "result": ["victim"]}] * 5, answers
        assert time.monotonic() - started < 10
    finally:
        for sock in socks:
            sock.close()
        assert b.stop() == 0, b.read_log()


def test_answers_the_broker_makes_itself_count_while_queued_behind_a_slow_call() -> None:
    """Hostile testing (round 9): requests the front-end answers itself (here 421, a Host
    not allowed) pipelined behind a slow call were queued unbounded and counted nowhere
    (1000 connections that never read: 500 MB), and a 421 echoed all of a 30 KB Host.
    They count in the connection's budget and max_outgoing_bytes now, reading pauses
    past 64 owed, and the Host shown is cut at 200 bytes."""
    b = start_broker("--workers", "1")
    try:
        sock = socket.create_connection(("127.0.0.1", b.port), timeout=30)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        slow = json.dumps({"jsonrpc": "2.0", "method": "sleep", "params": [3], "id": "slow"}).encode()
        bad = (b"POST / HTTP/1.1\r\nHost: " + b"\xff" * 30_000 + b"\r\nContent-Type: application/json\r\n"
               b"Content-Length: 2\r\n\r\n{}")
        sender = threading.Thread(target=sock.sendall, args=(http_request(slow) + bad * 200,), daemon=True)
        sender.start()  # (it blocks while reading is paused: until the slow call ends)
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_outgoing_bytes") > 0, timeout=10)
        time.sleep(0.5)
        held = sample(scrape_metrics(b), "rpc_broker_outgoing_bytes")
        assert 0 < held <= 65 * 1024, held  # 64 or 65 answers of well under 1 KiB, reading paused
        # The rest waits in the kernels' buffers (the sender may even have sent it all: a
        # receive buffer grows to tcp_rmem's most, 32 MB on the CI machine; seen in a full
        # run). Read, all 200 answers would hold about 100 kB: still 64 or 65 after a while.
        sender.join(1.0)
        assert sample(scrape_metrics(b), "rpc_broker_outgoing_bytes") == held
        buf = bytearray()
        status, body = read_http_response(sock, buf)
        assert (status, json.loads(body)["id"]) == (200, "slow")
        for _ in range(200):
            status, body = read_http_response(sock, buf)
            assert status == 421 and len(body) < 600, body
        sender.join(10)
        assert sample(scrape_metrics(b), "rpc_broker_outgoing_bytes") == 0
        sock.close()
    finally:
        assert b.stop() == 0, b.read_log()


def test_answers_made_at_once_count_in_the_budgets() -> None:
    """Hostile testing (round 10): answers the dispatcher makes at once ("Method not
    found", which echoes the id; invalid batch elements) were counted in no budget: 30
    connections each owing a slow call, then pipelining calls of an unknown method with
    900 kB ids and never reading, held 400 MB with rpc_broker_outgoing_bytes at 0. They
    count now: the connection's next requests wait past max_response_bytes, and past
    max_outgoing_bytes the connections owed the most are reset."""
    limit, total = 1024 * 1024, 4 * 1024 * 1024
    b = start_broker("--workers", "1", "--timeout", "60", "--max-response-bytes", str(limit),
                     "--max-outgoing-bytes", str(total))
    socks: list[socket.socket] = []
    try:
        slow = json.dumps({"jsonrpc": "2.0", "method": "sleep", "params": [20], "id": "slow"}).encode()
        unknown = json.dumps({"jsonrpc": "2.0", "method": "nope", "id": "i" * 900_000}).encode()
        for _ in range(8):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.connect(("127.0.0.1", b.port))
            sock.setblocking(False)
            socks.append(sock)
            data = memoryview(http_request(slow) + http_request(unknown) * 6)
            deadline = time.monotonic() + 5
            while data and time.monotonic() < deadline:  # (as much as the kernels take)
                try:
                    data = data[sock.send(data):]
                except BlockingIOError:
                    time.sleep(0.01)
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_outgoing_bytes") > 0, timeout=10)
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_connections_shed_total", transport="http") >= 1,
                 timeout=10)
        assert sample(scrape_metrics(b), "rpc_broker_outgoing_bytes") <= total + 2 * limit
        assert b.call("echo", ["bystander"])["result"] == ["bystander"]
    finally:
        for sock in socks:
            sock.close()
        assert b.stop() == 0, b.read_log()


def test_broker_errors_past_max_outgoing_bytes_start_the_shedding_too() -> None:
    """Every answer the dispatcher makes counts through one method (`ResponseBudget.keep`),
    which starts the shedding past max_outgoing_bytes wherever the answer is made: round
    10's fix started it only for answers made at once, and broker errors (here timeouts,
    which echo 900 kB ids too) took the total past the bound with nothing shed."""
    limit, total = 1024 * 1024, 4 * 1024 * 1024
    b = start_broker("--workers", "1", "--timeout", "1", "--max-response-bytes", str(limit),
                     "--max-outgoing-bytes", str(total))
    socks: list[socket.socket] = []
    try:
        for k in range(8):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.connect(("127.0.0.1", b.port))
            socks.append(sock)
            calls = [{"jsonrpc": "2.0", "method": "sleep", "params": [20], "id": f"slow-{k}"}]
            calls += [{"jsonrpc": "2.0", "method": "sleep", "params": [20], "id": f"{k}" * 900_000}] * 6
            sock.sendall(b"".join(http_request(json.dumps(c).encode()) for c in calls))
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_connections_shed_total", transport="http") >= 1,
                 timeout=15)
        assert b.call("echo", ["bystander"])["result"] == ["bystander"]
    finally:
        for sock in socks:
            sock.close()
        assert b.stop() == 0, b.read_log()


@pytest.mark.parametrize("transport", ["http", "tcp"])
def test_answers_for_a_connection_gone_are_dropped_at_once(transport: str) -> None:
    """Hostile testing (round 13): a batch's answers made before its connection was lost
    were kept until its last call ended, and those made after it too, counted nowhere,
    and so were the requests of calls sent: 180 clients that sent `[a 12 s sleep, an
    echo of 900 kB]` and reset held 160 MB for 12 s. They go at the loss now (a request's
    params once it is sent), and the calls still running fill their slots with nothing.
    Measured as the allocator sees it: a second round of such clients, while the first
    round's sleeps still run, reuses the memory the first one freed (RSS itself need not
    fall); before, it took as much again."""

    port = free_port()
    b = start_broker("--workers", "2", "--timeout", "60", "--stream-port", str(port))
    socks: list[socket.socket] = []

    def round_(tag: str) -> int:
        for k in range(40):
            body = json.dumps([{"jsonrpc": "2.0", "method": "sleep", "params": [8], "id": f"s{k}"},
                               {"jsonrpc": "2.0", "method": "echo", "params": [tag * 900_000], "id": f"e{k}"}]).encode()
            sock = socket.create_connection(("127.0.0.1", b.port if transport == "http" else port), timeout=30)
            sock.sendall(http_request(body) if transport == "http" else body + b"\n")
            socks.append(sock)
        echoed = 1 + 40 * (1 + (tag == "f"))
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_calls_total", method="echo", outcome="ok") >= echoed,
                 timeout=60)  # (every echo answered: its answer waits for the sleep beside it)
        held = rss_bytes(b.pid)
        for sock in socks:  # reset: nothing of what it is owed can be sent any more
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()
        socks.clear()
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_connections", transport=transport) <= (transport == "http"),
                 timeout=10)  # (a scrape is a connection on the HTTP port)
        assert sample(scrape_metrics(b), "rpc_broker_outgoing_bytes") < 100_000  # (36 MB of echoes dropped)
        return held

    try:
        wait_for(lambda: "tcp://" in b.read_log(0.05), timeout=10)
        assert b.call("echo", ["warm"])["result"] == ["warm"]
        before = rss_bytes(b.pid)
        first = round_("e")
        second = round_("f")  # (the first round's sleeps run on: 8 s)
        assert first - before > 30_000_000, (before, first)  # (the test does hold what it means to)
        # (before: 40-70 MB more; a loaded machine's allocator: up to 21 MB, 98dcbb4's full run)
        assert second - first < 30_000_000, (before, first, second)
        # (the calls of a connection reset are cancelled: round 57, they kept their places)
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_calls_abandoned_total", where="in_flight") == 80
                 and sample(scrape_metrics(b), "rpc_broker_calls_in_flight") == 0, timeout=30)
    finally:
        for sock in socks:
            sock.close()
        assert b.stop() == 0, b.read_log()



def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process `pid` has used (/proc/<pid>/stat)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_request_waiting_behind_one_dispatched_from_the_wait_costs_no_cpu() -> None:
    """Hostile testing (round 14): requests that waited go one at a time; while the one
    dispatched ran, the next was scheduled again every loop turn (it found the one before
    still running, and scheduled itself again): a core spun for as long as that call ran
    (up to its timeout, and a client can repeat it). Here two `add` batches' answers (74
    kB) pass max_response_bytes (64 KiB) behind a slow call, so the next two requests
    wait; the first of them (a 4 s sleep) runs with the second behind it: 2 s of that now
    cost the broker a small part of a second of CPU (it spent about all of the 2 before)."""
    b = start_broker("--workers", "2", "--max-response-bytes", "65536")
    batch = json.dumps([{"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": k} for k in range(1000)]).encode()

    def call_(method: str, params: list[object], id_: int) -> bytes:
        return http_request(json.dumps({"jsonrpc": "2.0", "method": method, "params": params, "id": id_}).encode())

    def sleeps_answered() -> float:
        return sum(value for (name, labels), value in scrape_metrics(b).items()
                   if name == "rpc_broker_calls_total" and ("method", "sleep") in labels)

    try:
        with socket.create_connection(("127.0.0.1", b.port), timeout=30) as s:
            s.sendall(call_("sleep", [1], 1) + http_request(batch) + http_request(batch))
            time.sleep(0.3)
            s.sendall(call_("sleep", [4], 3) + call_("add", [1, 2], 4))  # (they wait)
            wait_for(lambda: sleeps_answered() == 1 and sample(scrape_metrics(b), "rpc_broker_calls_in_flight") == 1,
                     timeout=10)  # (the first sleep answered, the second running, `add` 4 behind it)
            before = cpu_seconds(b.pid)
            time.sleep(2.0)
            spent = cpu_seconds(b.pid) - before
            buf = bytearray()
            statuses = [read_http_response(s, buf)[0] for _ in range(5)]
        assert len(statuses) == 5
        assert spent < 0.5, spent
    finally:
        assert b.stop() == 0, b.read_log()


def test_an_http_client_that_fell_behind_gets_its_next_requests_one_at_a_time(broker_factory) -> None:  # type: ignore[no-untyped-def]
    """Hostile testing (round 27): a client that fell behind (a 6 MB answer it read late,
    past a quarter of its 16 MiB budget) and drains its buffer while a slow call is still
    owed: its next requests go one at a time, until it takes an answer at once or is owed
    nothing (docs/operations.md, "Memory for answers"). Over HTTP the mode ended at once, at the
    flush after the buffer drained (nothing written, and the buffer never full then): four
    requests of 5 MB answers ran together, and the last ones were refused -32603. One at a
    time, each has the whole budget: all four answered."""
    b: Broker = broker_factory("--workers", "2", "--app", APP, "--max-response-bytes", str(16 * 1024 * 1024),
                               "--timeout", "60")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.settimeout(30)
        sock.connect((b.host, b.port))

        def call(id_: str, size: int, delay: float) -> bytes:
            return http_request(json.dumps({"jsonrpc": "2.0", "method": "async_blob", "params": [size, delay],
                                            "id": id_}).encode())

        sock.sendall(call("A", 6_000_000, 0) + call("B", 10, 4.0))
        time.sleep(0.5)  # not reading: A's answer fills the socket, then the write buffer
        buf = bytearray()
        assert read_http_response(sock, buf)[0] == 200  # A, all of it: the buffer drains, B still owed
        for i in range(4):
            sock.sendall(call(f"C{i}", 5_000_000, 1.0))
            time.sleep(0.2)
        answers = [json.loads(read_http_response(sock, buf)[1]) for _ in range(5)]
    assert [a["id"] for a in answers] == ["B", "C0", "C1", "C2", "C3"]
    assert [len(a.get("result", "")) for a in answers[1:]] == [5_000_000] * 4, [a.get("error") for a in answers]


@pytest.mark.parametrize("first", ["call", "batch"])
def test_the_request_owed_first_is_not_refused_for_the_finished_answers_queued_behind_it(
    broker_factory, first: str  # type: ignore[no-untyped-def]
) -> None:
    """Hostile testing (round 112, M1): a call owed first on its connection (a slow one),
    then a 60 KB result and 42 404s pipelined behind it, filling max_response_bytes (64 KiB):
    the call was answered -32603 "response exceeds max_response_bytes", though its answer
    is written before theirs and refusing it freed none of them. It counts only its own
    answers now (`ResponseBudget.counted`; each of the four checks, and a request not owed
    first, in memory: tests/test_dispatch_core_head.py)."""
    b: Broker = broker_factory("--workers", "2", "--app", "broker.demo:faults", "--max-response-bytes", "65536")
    if first == "call":
        head: object = {"jsonrpc": "2.0", "id": "A", "method": "slow", "params": [0.5]}
    else:
        head = [{"jsonrpc": "2.0", "id": f"A{i}", "method": "slow", "params": [0.5]} for i in range(3)]
    big = {"jsonrpc": "2.0", "id": "B", "method": "huge_reply", "params": [60_000]}
    after = {"jsonrpc": "2.0", "id": "C", "method": "huge_reply", "params": [5_000]}
    not_found = b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection((b.host, b.port), timeout=30) as sock:
        sock.sendall(http_request(json.dumps(head).encode()) + http_request(json.dumps(big).encode()))
        time.sleep(0.2)  # B's answer is in, behind A
        sock.sendall(not_found * 42 + http_request(json.dumps(after).encode()))
        buf = bytearray()
        status, raw = read_http_response(sock, buf)
        answer = json.loads(raw)
        if first == "call":
            assert (status, answer) == (200, {"jsonrpc": "2.0", "id": "A", "result": 0.5})
        else:
            assert (status, answer) == (200, [{"jsonrpc": "2.0", "id": f"A{i}", "result": 0.5} for i in range(3)])
        status, raw = read_http_response(sock, buf)
        assert (status, json.loads(raw)) == (200, {"jsonrpc": "2.0", "id": "B", "result": "x" * 60_000})
        assert [read_http_response(sock, buf)[0] for _ in range(42)] == [404] * 42
        status, raw = read_http_response(sock, buf)
        assert (status, json.loads(raw)) == (200, {"jsonrpc": "2.0", "id": "C", "result": "x" * 5_000})
    assert sample(scrape_metrics(b), "rpc_broker_responses_oversize_total") == 0
