"""send_timeout (attack-a finding 4): a client that sends and never reads its answers is
closed, over HTTP and NDJSON; one that reads, however slowly, within it is served.

Pipelined batches of 1000 invalid elements (2 KB each) get ~72 KB of error answers:
the answers fill the client's small receive buffer, then the broker's write buffer,
then the broker pauses reading, and with reading paused neither request_timeout nor
keepalive_timeout applies. With `--send-timeout 2` such connections must be aborted
within a few seconds and the memory their unsent answers held released. Real broker,
real loopback sockets; every wait and every loop is bounded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import FREED_AT_ONCE, Broker, rss_kib, sample, scrape_metrics, start_broker, wait_for
from test_stream import free_port

SEND_TIMEOUT = 2.0
CONNECTIONS = 40
HELD_KIB = 20 * 1024  # growth a second round must stay well under (without bounds: ~70 MB a round)
BATCH = b"[" + b",".join([b"1"] * 1000) + b"]"  # 1000 invalid elements: 1000 error objects


def http_request(body: bytes) -> bytes:
    return (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def open_connections(b: Broker, transport: str) -> float:
    return sample(scrape_metrics(b), "rpc_broker_connections", transport=transport)


@pytest.fixture(scope="module")
def tb() -> Iterator[tuple[Broker, int]]:
    """A broker with `--send-timeout 2` and an NDJSON TCP port; long other timeouts, so
    only send_timeout can close a connection within the tests' deadlines. No access log: a
    round's 120,000 invalid elements would be as many lines, filling the stderr pipe this
    suite reads only now and then, and the queue behind it, ahead of the reset's WARNING."""
    port = free_port()
    b = start_broker("--workers", "1", "--stream-port", str(port), "--send-timeout", str(SEND_TIMEOUT),
                     "--keepalive-timeout", "300", "--request-timeout", "300", "--access-log", "off",
                     env=FREED_AT_ONCE)  # fmt: skip
    wait_for(lambda: "tcp://" in b.read_log(0.05), timeout=10)
    yield b, port
    assert b.stop() == 0, b.read_log()


def non_reader(where: tuple[str, int], payload: bytes, seconds: float = 3.0, piece: int = 65536,
               gap: float = 0.0) -> socket.socket:
    """A connection with a 4 KiB receive buffer that sends `payload` (as much of it as the
    broker takes within `seconds`, `piece` bytes at a time, `gap` s apart) and reads nothing."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(where)
    s.setblocking(False)
    sent, deadline = 0, time.monotonic() + seconds
    while sent < len(payload) and time.monotonic() < deadline:
        try:
            sent += s.send(payload[sent : sent + piece])
            time.sleep(gap)
        except BlockingIOError:
            time.sleep(0.01)
    return s


@pytest.mark.parametrize("transport", ["http", "tcp"])
def test_clients_that_never_read_are_closed_within_send_timeout_and_their_memory_freed(tb, transport):
    """Two rounds of CONNECTIONS clients that pipeline requests and never read: each
    round's connections are aborted within send_timeout, and the memory their unsent
    answers held is freed for reuse: the second round leaves the broker no bigger than
    the first did (RSS itself need not fall: the allocator may keep freed heap pages).
    Each reset is counted (`rpc_broker_connections_send_timed_out_total`) and logged.
    Since max_response_bytes, a non-reader's requests wait undispatched once its write
    buffer is full, so what a round holds is bounded (test_response_limits measures it)."""
    b, stream_port = tb
    port = b.port if transport == "http" else stream_port
    payload = http_request(BATCH) * 120 if transport == "http" else (BATCH + b"\n") * 120
    baseline = open_connections(b, transport)
    reset_before = sample(scrape_metrics(b), "rpc_broker_connections_send_timed_out_total", transport=transport)

    def one_round() -> int:
        socks = [non_reader((b.host, port), payload, seconds=0.5) for _ in range(CONNECTIONS)]
        try:
            # Aborted within send_timeout, plus a sweep (1 s), plus margin for a loaded machine.
            wait_for(lambda: open_connections(b, transport) <= baseline, timeout=SEND_TIMEOUT + 20)
            for s in socks:  # the client sees the connection end (reset, or EOF after the data)
                s.setblocking(True)
                s.settimeout(10)
                try:
                    while s.recv(1 << 20):
                        pass
                except ConnectionResetError:
                    pass
        finally:
            for s in socks:
                s.close()
        return rss_kib(b.pid)

    after_first = one_round()
    after_second = one_round()
    assert after_second - after_first < HELD_KIB / 2, (after_first, after_second)
    # Each reset counted (new user, round 93: they were neither logged nor counted), and logged
    reset = sample(scrape_metrics(b), "rpc_broker_connections_send_timed_out_total", transport=transport)
    assert reset - reset_before == 2 * CONNECTIONS
    assert f"{transport}: reset a connection whose client took none of its answers for send_timeout 2 s" in b.read_log(0.05)
    assert b.call("echo", ["still serving"])["result"] == ["still serving"]


def read_slowly(s: socket.socket, expected: int) -> list[bytes]:
    """Read `expected` NDJSON answer lines, stopping to read for 1 s after every 10
    (shorter than send_timeout, with answers waiting); bounded by 120 s."""
    data = b""
    paused_at = 0
    deadline = time.monotonic() + 120
    while data.count(b"\n") < expected and time.monotonic() < deadline:
        if data.count(b"\n") >= paused_at + 10:
            paused_at += 10
            time.sleep(1.0)
        chunk = s.recv(65536)
        assert chunk, f"closed after {paused_at}+ answers"
        data += chunk
    return data.split(b"\n")[:expected]


@pytest.mark.parametrize("transport", ["http", "tcp"])
def test_a_slow_reader_within_send_timeout_keeps_its_connection_and_gets_every_answer(tb, transport):
    """A client that stops reading for less than send_timeout at a time (1 s pauses with
    `--send-timeout 2`) is never closed: its writes pause and resume as it reads."""
    b, stream_port = tb
    n = 40
    small = socket.socket()
    small.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with small as s:
        s.connect((b.host, b.port if transport == "http" else stream_port))
        s.settimeout(30)
        if transport == "http":
            s.sendall(http_request(BATCH) * n)
            data = b""
            deadline = time.monotonic() + 120
            answers = 0
            while answers < n and time.monotonic() < deadline:
                chunk = s.recv(65536)
                assert chunk, f"closed after {answers} answers"
                data += chunk
                while b"\r\n\r\n" in data:  # whole responses: head, then content-length bytes
                    head, _, rest = data.partition(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    if len(rest) < length:
                        break
                    assert head.startswith(b"HTTP/1.1 200"), head[:100]
                    assert len(json.loads(rest[:length])) == 1000
                    data = rest[length:]
                    answers += 1
                    if answers % 10 == 0:
                        time.sleep(1.0)  # a pause shorter than send_timeout, with answers waiting
            assert answers == n
        else:
            s.sendall((BATCH + b"\n") * n)
            lines = read_slowly(s, n)
            assert len(lines) == n and all(len(json.loads(line)) == 1000 for line in lines)
        # Still open: one more call is answered on the same connection.
        if transport == "http":
            s.sendall(http_request(b'{"jsonrpc":"2.0","method":"echo","params":["x"],"id":7}'))
            assert b'"result":["x"]' in s.recv(65536)
        else:
            s.sendall(b'{"jsonrpc":"2.0","method":"echo","params":["x"],"id":7}\n')
            assert b'"result":["x"]' in s.recv(65536)


@pytest.mark.parametrize("transport", ["http", "tcp"])
def test_a_client_reading_steadily_is_served_however_long_its_answers_take(tb, transport):
    """Hostile testing (round 11): a client that read all along, about 160 KB/s, 10
    pipelined answers of 400 kB, was reset after send_timeout (2 s here), its answers
    lost: its write buffer never went back under the low mark, so the clock that started
    when writing paused never restarted. It restarts now whenever the client has taken
    more bytes than at the sweep's last look: all 4 MB are read, in about 13 s."""
    b, stream_port = tb
    n, size = 10, 400_000
    bodies = [json.dumps({"jsonrpc": "2.0", "method": "echo", "params": ["x" * size], "id": i}).encode()
              for i in range(n)]
    data = b"".join(http_request(body) for body in bodies) if transport == "http" else b"".join(
        body + b"\n" for body in bodies)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    with s:
        s.connect((b.host, b.port if transport == "http" else stream_port))
        s.settimeout(10)
        threading.Thread(target=s.sendall, args=(data,), daemon=True).start()
        got = 0
        deadline = time.monotonic() + 90
        while got < n * size and time.monotonic() < deadline:
            chunk = s.recv(32768)  # (a reset raises here: the failure this test is for)
            assert chunk, f"closed after {got} bytes"
            got += len(chunk)
            time.sleep(0.1)
        assert got >= n * size


def unread_by_broker(broker_port: int, client_port: int) -> int:
    """Bytes the broker's end of a loopback TCP connection has received and not read
    (rx_queue in /proc/net/tcp): more than 0 while the broker paused reading it."""
    local = f"0100007F:{broker_port:04X}"
    remote = f"0100007F:{client_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return int(fields[4].split(":")[1], 16)
    return 0


def broker_has_connection_from(pid: int, port: int) -> bool:
    """Whether the broker process still holds a TCP socket to the client port `port`."""
    return any(c.raddr and c.raddr.port == port for c in psutil.Process(pid).net_connections(kind="tcp"))


def test_a_non_reader_owing_nothing_is_not_evicted_as_idle_but_closed_by_send_timeout(broker_factory):
    """A client whose requests are all answered but whose answers sit unsent (writing
    paused) is not idle: closing it to make room at max_connections would wait forever
    for the answers to leave, out of sight of every sweep (its socket and buffers held for
    good). It is left to send_timeout, which aborts it; another idle one makes room."""
    send_timeout = 4.0
    b = broker_factory("--workers", "1", "--max-connections", "3", "--send-timeout", str(send_timeout),
                       "--keepalive-timeout", "300", "--request-timeout", "300")
    # One request per segment, 5 ms apart: each read the broker makes ends a request, so
    # once it pauses reading none is under way; it owes nothing, its answers are unsent.
    request = http_request(BATCH)
    stuck = non_reader((b.host, b.port), request * 100, seconds=2.0, piece=len(request), gap=0.005)
    port = stuck.getsockname()[1]
    others = []
    try:
        wait_for(lambda: unread_by_broker(b.port, port) > 0, timeout=20)  # writing, then reading paused
        for _ in range(3):  # the third one finds max_connections reached: one idle one goes
            conn = b.connection(timeout=30)
            conn.request("POST", "/", body=b'{"jsonrpc":"2.0","method":"echo","params":[1],"id":1}',
                         headers={"content-type": "application/json", "host": "127.0.0.1"})
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["result"] == [1]
            others.append(conn)
        assert broker_has_connection_from(b.pid, port)
        wait_for(lambda: not broker_has_connection_from(b.pid, port), timeout=send_timeout + 20)
    finally:
        stuck.close()
        for conn in others:
            conn.close()


@pytest.mark.parametrize("transport", ["tcp", "http"])
def test_answers_the_kernel_holds_for_a_non_reader_do_not_escape_send_timeout(tb, transport):
    """Hostile testing (round 16): NDJSON clients that ask for two 900 kB answers each and
    read nothing: the broker's write buffer never fills (the kernel's send queue grows to
    take them both: 1.8 MB a connection), so its writing never paused, and nothing timed
    them out (NDJSON connections are never idle-closed): 40 such held 72 MB of kernel
    memory for good. Over HTTP (round 17) they were found only once keep-alive ran out,
    twice: 2 x keepalive_timeout + send_timeout (210 s with the defaults; here 300 s of
    keep-alive). The sweep looks at the kernel's queue too: they are reset within
    send_timeout."""
    b, stream_port = tb
    body = json.dumps({"jsonrpc": "2.0", "method": "echo", "params": ["x" * 900_000], "id": 1}).encode()
    big = body + b"\n" if transport == "tcp" else http_request(body)
    port = stream_port if transport == "tcp" else b.port
    baseline = open_connections(b, transport)
    socks = [non_reader((b.host, port), big * 2, seconds=2.0) for _ in range(4)]
    try:
        wait_for(lambda: open_connections(b, transport) == baseline + 4, timeout=10)
        # Reset within send_timeout, plus a sweep (1 s) or two, plus margin for a loaded machine.
        wait_for(lambda: open_connections(b, transport) <= baseline, timeout=SEND_TIMEOUT + 20)
    finally:
        for s in socks:
            s.close()
    assert b.call("echo", ["still serving"])["result"] == ["still serving"]


def test_a_connection_whose_answers_the_kernel_still_holds_is_not_closed_to_make_room(broker_factory):
    """Hostile testing (round 18): at max_connections, connections whose answers all sat
    in the kernel's send queue (written, their client not reading) looked idle until the
    next sweep, and were closed to make room: a close leaves those bytes in the kernel
    (a few MB a connection), out of send_timeout's reach and counted nowhere. They are not
    idle: the newcomer is refused (503) instead, and send_timeout resets them later."""
    b = broker_factory("--workers", "1", "--max-connections", "4", "--send-timeout", "3",
                       "--max-body-bytes", "2000000", "--keepalive-timeout", "300")
    body = json.dumps({"jsonrpc": "2.0", "method": "echo", "params": ["x" * 1_000_000], "id": 1}).encode()
    baseline = open_connections(b, "http")  # (the scrape's own)
    socks = [non_reader((b.host, b.port), http_request(body), seconds=2.0) for _ in range(4)]
    try:
        # (their bodies in first: a connection whose request is still arriving gives its place
        # at max_connections, to the scrape below too)
        time.sleep(0.5)
        wait_for(lambda: open_connections(b, "http") >= baseline + 4, timeout=10)
        # Their answers written, in the kernel (out of the budget): the next sweep, within
        # 1 s, would see them (before the fix too: this asks at once, before it comes).
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_outgoing_bytes") == 0, timeout=10, interval=0.005)
        status, _, answer = b.post(json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 2}))
        assert status == 503, answer
        wait_for(lambda: open_connections(b, "http") <= baseline, timeout=SEND_TIMEOUT + 20)  # reset in time
        assert b.call("add", [1, 2])["result"] == 3
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("transport", ["http", "tcp"])
def test_at_max_connections_a_non_reader_found_idle_does_not_spin_the_loop(broker_factory, transport):
    """Hostile testing (round 19): at max_connections, a connection that looked idle but
    whose answer the kernel still held (not all taken) was skipped for eviction, found
    again by the next scan at once, and so on: the loop spun for good, every listener
    froze and SIGTERM went unheard. The scan leaves it out now: the newcomer's /healthz
    is answered from the probes' reserve, and the broker stops as asked."""
    stream = free_port()
    b = broker_factory("--workers", "1", "--max-connections", "1", "--send-timeout", "5",
                       "--stream-port", str(stream))
    body = json.dumps({"jsonrpc": "2.0", "method": "echo", "params": ["x" * 900_000], "id": 1}).encode()
    payload = http_request(body) if transport == "http" else body + b"\n"
    a = non_reader((b.host, b.port if transport == "http" else stream), payload, seconds=2.0)
    try:
        time.sleep(0.3)  # (its answer written into the kernel, before the next sweep looks)
        with socket.create_connection((b.host, b.port if transport == "http" else stream), timeout=5) as s:
            if transport == "http":
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert s.recv(4096).startswith(b"HTTP/1.1 200 "), "no /healthz answer: the loop is stuck"
            else:  # (refused at once: a -32000 line, then closed)
                assert b'"code":-32000' in s.recv(4096)
        with socket.create_connection((b.host, b.port), timeout=5) as s:  # (and the HTTP port lives)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
    finally:
        a.close()
