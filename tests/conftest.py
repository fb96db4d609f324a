"""Shared fixtures: a real broker daemon on loopback, and a small HTTP client.

`broker_factory(*flags)` starts `python -m broker serve --port 0 ...` as a child
process, reads the address it bound from its "serving JSON-RPC on ..." line, and
stops it (SIGTERM, then SIGKILL) by its own PID at the end of the test.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import importlib.util
import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import Phase, settings

# `make mutate` (pyproject.toml's [tool.mutmut]) runs the suite with this profile: one
# verdict per mutant, the same in every run (a fixed seed, no database of other mutants'
# failures) and no shrinking (a mutant needs only to fail, not its smallest example).
settings.register_profile("mutate", derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate])

ROOT = Path(__file__).resolve().parent.parent
TESTDATA = ROOT / "tests" / "data"  # everything the tests read is in the repository
_SERVING = re.compile(r"serving JSON-RPC on https?://(\[[^\]]+\]|[^:/]+):(\d+)(/\S*)")


class Broker:
    """A running `rpc-broker serve` child process."""

    def __init__(self, proc: subprocess.Popen[bytes], host: str, port: int, path: str, log: list[str]) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self.path = path
        self.log = log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def connection(self, timeout: float = 30.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host.strip("[]"), self.port, timeout=timeout)

    def post(self, body: bytes | str, *, path: str | None = None, headers: dict[str, str] | None = None,
             timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
        """POST `body` on a fresh connection; return (status, headers, body)."""
        conn = self.connection(timeout)
        try:
            if isinstance(body, str):
                body = body.encode()
            conn.request("POST", path or self.path, body=body,
                         headers={"content-type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def call(self, method: str, params: object = None, id_: object = 1, timeout: float = 30.0) -> dict[str, object]:
        """One call; returns the decoded Response object."""
        req: dict[str, object] = {"jsonrpc": "2.0", "method": method, "id": id_}
        if params is not None:
            req["params"] = params
        _status, _, body = self.post(json.dumps(req), timeout=timeout)
        return json.loads(body)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = self.connection()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def read_log(self, timeout: float = 0.0) -> str:
        """Collect what the daemon wrote to stderr so far (waiting up to `timeout` s)."""
        _drain(self.proc, self.log, timeout)
        return "".join(self.log)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in `timeout` s. Returns the status.
        Raises AssertionError if the event loop's exception handler was called in its life
        (`broker.server.LoopErrors`: its "event loop:" lines; issue 10, item 8)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        _drain(self.proc, self.log, 0.0)
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            self.proc.stderr.close()
        loop_errors = [line for line in "".join(self.log).splitlines() if " ERROR event loop: " in line]
        assert not loop_errors, f"broker pid {self.pid}: its event loop's exception handler was called:\n" + \
            "\n".join(loop_errors[:5])
        return self.proc.returncode


def _drain(proc: subprocess.Popen[bytes], log: list[str], timeout: float) -> None:
    assert proc.stderr is not None
    if proc.stderr.closed:
        return
    fd = proc.stderr.fileno()
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        log.append(chunk.decode(errors="replace"))


def pytest_configure(config: pytest.Config) -> None:
    """Every process the suite starts gets a temporary directory of the suite's own (TMPDIR),
    removed at the end: a broker the tests kill leaves its worker socket's directory
    (`rpc-broker-*`) behind, and after `make test` none may stay in /tmp (new user, round
    67). This process's own (pytest's tmp_path) stays where it was: read first, then cached."""
    import shutil
    import tempfile

    tempfile.gettempdir()
    suite = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="rb-suite-")
    config.add_cleanup(lambda: shutil.rmtree(suite, ignore_errors=True))


TEST_PORTS_ENV = "BROKER_TEST_PORTS"
"""`BROKER_TEST_PORTS=LOW-HIGH` (e.g. 38700-38999), or several, comma-separated
(38450-38499,38650-38699): every port the suite listens on comes from there (brokers, their other
listeners, the tests' own servers), for a machine where other services hold fixed ports (new user,
round 114: the suite bound ports anywhere). Unset: the kernel picks (`listen_port` 0), and
`free_port` any port below the ephemeral range. (Not RPC_BROKER_*: the broker refuses a variable
of that prefix it does not know, and it inherits the suite's.) Under pytest-xdist (`make test`
runs `pytest -n`), each worker gets its own slice of them (`worker_slice`)."""

MIN_WORKER_PORTS = 8
"""The fewest ports a worker's slice may have: a test holds several at once (a broker's, its
stream port's, a prometheus'), and `free_port` gives the last 16 it gave only when no other is free."""
MANY_TESTS = 400
MANY_TESTS_PORTS = 100
"""The fewest a worker's slice may have for a run of more than `MANY_TESTS` tests
(`pytest_collection_modifyitems`)."""


def test_ports() -> range | None:
    """The ports BROKER_TEST_PORTS confines this process's listeners to, or None: the whole
    range, or under pytest-xdist this worker's slice of it (`worker_slice`). Raises
    `pytest.UsageError` for a malformed one or one too small for the workers."""
    text = os.environ.get(TEST_PORTS_ENV, "").strip()
    if not text:
        return None
    ranges = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        try:
            ports = range(int(low), int(high or low) + 1)
        except ValueError:
            ports = range(0)
        if not ports or ports.start < 1 or ports.stop > 65536:
            raise pytest.UsageError(f"{TEST_PORTS_ENV}={text!r}: expected LOW-HIGH[,LOW-HIGH...], ports 1 to 65535")
        ranges.append(ports)
    if len({port for r in ranges for port in r}) < sum(map(len, ranges)):
        raise pytest.UsageError(f"{TEST_PORTS_ENV}={text!r}: its ranges overlap")
    index, count = xdist_worker()
    ports = worker_slice(ranges, index, count)
    if len(ports) < MIN_WORKER_PORTS:
        raise pytest.UsageError(f"{TEST_PORTS_ENV}={text!r}: {len(ports)} ports for xdist worker {index} of {count},"
                                f" {MIN_WORKER_PORTS} needed: a wider range, or fewer workers (make test JOBS=N, pytest -n N)")
    return ports


def xdist_worker() -> tuple[int, int]:
    """(this process's index, the number of processes) among pytest-xdist's workers
    (PYTEST_XDIST_WORKER "gw3", PYTEST_XDIST_WORKER_COUNT, which xdist sets): (0, 1) outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return 0, 1
    return int(worker[2:]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def worker_slice(ranges: list[range], index: int, count: int) -> range:
    """Worker `index`'s (0 to `count` - 1) slice of the ports of `ranges` (in their order):
    the `count` workers get disjoint contiguous runs of about equal length, so that
    parallel workers never listen on one port. A slice that would straddle two ranges
    keeps only its longer part (a `range`: `make bench`'s --ports takes one)."""
    ports = [port for r in ranges for port in r]
    mine = ports[index * len(ports) // count:(index + 1) * len(ports) // count]
    runs: list[range] = []
    for port in mine:
        if runs and runs[-1].stop == port:
            runs[-1] = range(runs[-1].start, port + 1)
        else:
            runs.append(range(port, port + 1))
    return max(runs, key=len, default=range(0))


test_ports.__test__ = False  # type: ignore[attr-defined]  # (not a test, whatever its name)


def free_port() -> int:
    """A loopback TCP port nobody listens on now, for a listener the broker cannot be told
    to choose itself (`stream_port` 0 is off): one of BROKER_TEST_PORTS if set, else one
    below the kernel's ephemeral range (net.ipv4.ip_local_port_range): a port there, as
    `bind(0)` gives, can become another connection's source port before the broker binds it,
    and did on a busy machine ("Address already in use", new user, round 73). Under
    pytest-xdist, from this worker's slice of either (`worker_slice`): two workers' tests
    never get one port. Probed by a plain bind (no SO_REUSEADDR): tests bind it so too."""
    ports = test_ports()
    if ports is None:
        try:
            low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            low = 32768
        ports = worker_slice([range(10000, max(10001, low))], *xdist_worker())
    candidates = random.sample(ports, min(len(ports), 200))
    given = {port: i for i, port in enumerate(_GIVEN)}  # (0: the oldest; a port given twice, its last)
    candidates.sort(key=lambda port: given.get(port, -1))  # (those given lately last, the latest last of all:
    # in an xdist worker's 25 ports in TIME_WAIT may leave none other, and a stream port just given, its
    # broker not started, was given again as its --port, 7 times in a run)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.append(port)
            return port
    raise AssertionError(f"no free port in {ports.start}-{ports.stop - 1}")


# The ports `free_port` gave last: not given again while another is free, though free still (not
# bound yet: a broker's port and its stream port were the same one of a range of 100, 1 time in
# 90; of an xdist worker's 25, where the last 16 were given again once 8 were, 5 times in a run)
_GIVEN: collections.deque[int] = collections.deque(maxlen=16)


def listen_port() -> int:
    """The port to give a listener: 0 (the kernel picks) unless BROKER_TEST_PORTS is set,
    then a free one of its range (`free_port`)."""
    return free_port() if test_ports() is not None else 0


def start_broker(*flags: str, env: dict[str, str] | None = None, timeout: float = 60.0,
                 cwd: Path = ROOT) -> Broker:
    """Start a broker on 127.0.0.1, on a port the kernel picks (BROKER_TEST_PORTS: one of its
    range, another tried if it was taken meanwhile); raise if it is not serving in time.
    `cwd`: the checkout whose `broker` package runs (a benchmark's other tree)."""
    for attempt in range(5):
        try:
            return _start_broker(flags, env, timeout, cwd)
        except _PortTaken:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


class _PortTaken(RuntimeError):
    """The port `listen_port` gave was taken before the broker bound it."""


def _start_broker(flags: tuple[str, ...], env: dict[str, str] | None, timeout: float, cwd: Path) -> Broker:
    port = listen_port()
    argv = [sys.executable, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=cwd, env={**os.environ, **(env or {})})
    log: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _drain(proc, log, 0.1)
        m = _SERVING.search("".join(log))
        if m:
            return Broker(proc, m.group(1), int(m.group(2)), m.group(3), log)
        if proc.poll() is not None:
            _drain(proc, log, 0.5)
            proc.stderr.close()  # type: ignore[union-attr]
            text = "".join(log)
            if port and "address already in use" in text.lower() and f":{port}:" in text:
                raise _PortTaken(text)
            raise RuntimeError(f"broker exited with {proc.returncode}:\n{text}")
    proc.kill()
    proc.wait(10)
    proc.stderr.close()  # type: ignore[union-attr]
    raise RuntimeError(f"broker not serving after {timeout} s:\n{''.join(log)}")


@pytest.fixture
def broker_factory() -> Iterator[object]:
    """Start brokers with given flags; all are stopped at the end of the test. One still
    running then must stop cleanly, status 0, within STOP_SECONDS of its SIGTERM: a
    broker left holding its drain (a call or worker it waits on, leaked) fails the test
    that left it, where a silent SIGKILL hid it (issue 10, item 11). A test that ends
    or kills its broker itself checks what it expects of that."""
    started: list[Broker] = []

    def factory(*flags: str, env: dict[str, str] | None = None) -> Broker:
        b = start_broker(*flags, env=env)
        started.append(b)
        return b

    yield factory
    problems = []
    for b in started:
        began = time.monotonic()
        ended = b.proc.poll() is not None
        try:
            status = b.stop()  # (an ended one's log drained, its pipe closed)
        except AssertionError as exc:  # (the loop's exception handler was called: every broker is stopped first)
            problems.append(str(exc))
            continue
        took = time.monotonic() - began
        if not ended and (status != 0 or took > STOP_SECONDS):
            problems.append(f"broker pid {b.pid} stopped with status {status} in {took:.1f} s:\n{b.read_log()[-3000:]}")
    assert not problems, "\n".join(problems)


BOTH_LOOPS = frozenset({
    "test_http_protocol", "test_stream", "test_http_hardening", "test_http_edges", "test_cross_site",
    "test_jsonrpc_http", "test_incoming_bytes",
})
"""The front-end suites, run once with the broker on uvloop and once on asyncio (its
`event_loop` setting), as uvloop's own tests run on both (issue 10, item 8). Each marks
`pytest.mark.usefixtures("event_loop_name")`, and its module-scoped brokers take that
fixture, so that they are started anew for each loop."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `make mutate`'s profile, the fastest tests first: most mutants fail one of those,
    and mutmut stops there (-x). The durations are those mutmut measured in the process it
    forks each mutant's from (mutmut 3.8's `state()`); without them, the state machines
    (seconds each) go last.

    A run of more than `MANY_TESTS` tests (most of the suite) with BROKER_TEST_PORTS giving
    this process fewer than `MANY_TESTS_PORTS` is refused, `pytest.UsageError`, before any
    test runs: the ports brokers close linger in TIME_WAIT, and 25 a process ran out two
    thirds of the way through, 200 tests failing "no free port in ..." (new user, round 116)."""
    if xdist_worker()[1] == 1:  # (under pytest-xdist, its controller: `pytest_xdist_node_collection_finished`)
        _enough_ports(len(items), 1)
    if settings.get_current_profile_name() != "mutate":
        return
    durations: typing.Mapping[str, float] = {}
    try:
        from mutmut.state import state
    except ImportError:
        pass
    else:
        durations = state().duration_by_test
    items.sort(key=lambda item: durations.get(item.nodeid, 60.0 if item.path.name == "test_dispatch_states.py" else 1.0))


def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """pytest-xdist's controller, once a worker has collected: `_enough_ports` for the run."""
    count = getattr(getattr(node, "config", None), "option", None)
    _enough_ports(len(ids), int(getattr(count, "numprocesses", 1) or 1))


def _enough_ports(tests: int, count: int) -> None:
    """Stop the run (`pytest.exit`, status 4, said at once) if it has more than `MANY_TESTS`
    tests and BROKER_TEST_PORTS gives each of its `count` processes fewer than
    `MANY_TESTS_PORTS` ports: the ports brokers close linger in TIME_WAIT, and 25 a process
    ran out two thirds of the way through the suite, 200 tests failing "no free port in ..."
    (new user, round 116)."""
    text = os.environ.get(TEST_PORTS_ENV, "").strip()
    if not text or tests <= MANY_TESTS:
        return
    ranges = [range(int(low), int(high or low) + 1) for low, _, high in (part.strip().partition("-") for part in text.split(","))]
    fewest = min(len(worker_slice(ranges, index, count)) for index in range(count))
    if fewest < MANY_TESTS_PORTS:
        pytest.exit(f"{TEST_PORTS_ENV}={text!r} gives {fewest} ports to a process of {count}, and {tests} tests want"
                    f" {MANY_TESTS_PORTS} a process at least (brokers' ports linger in TIME_WAIT once closed): a wider"
                    " range, fewer processes (make test JOBS=N) or fewer tests", returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run the tests of a `BOTH_LOOPS` module with each event loop (module-scoped)."""
    if "event_loop_name" in metafunc.fixturenames and metafunc.module.__name__ in BOTH_LOOPS:
        metafunc.parametrize("event_loop_name", ["uvloop", "asyncio"], scope="module", indirect=True)


@pytest.fixture(scope="module")
def event_loop_name(request: pytest.FixtureRequest) -> Iterator[str]:
    """The event loop the brokers the module's tests start run on (RPC_BROKER_EVENT_LOOP,
    which they inherit): "uvloop" unless `pytest_generate_tests` says otherwise."""
    name = getattr(request, "param", "uvloop")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RPC_BROKER_EVENT_LOOP", name)
        yield name


@pytest.fixture(scope="module")
def broker(event_loop_name: str) -> Iterator[Broker]:
    """One broker with 2 workers shared by a test module (tests must not break it); on
    the module's `event_loop_name`."""
    b = start_broker("--workers", "2")
    yield b
    status = b.stop()
    assert status == 0, b.read_log()


@pytest.fixture
def short_tmp_path() -> Path:
    """A fresh directory of a short path, in the suite's TMPDIR (`pytest_configure`, removed at its
    end), for a --socket-dir: tmp_path's, 10 bytes longer under pytest-xdist (.../popen-gw0/...),
    was refused for its length (at most 74 bytes: the workers' socket in it, sun_path) before what
    a test checks."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="sd-", dir=os.environ["TMPDIR"]))


STOP_SECONDS = 10.0  # a broker owing nothing stops in well under a second; the grace period is 30 s


def children(pid: int) -> set[int]:
    """Live child processes of `pid` (from /proc; zombies not counted)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry))
    return out


def descendants(pid: int) -> set[int]:
    """Live processes under `pid`: its children, theirs, and so on (`children`)."""
    found, todo = set(), [pid]
    while todo:
        for child in children(todo.pop()) - found:
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (/proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Stopped(typing.NamedTuple):
    """What `stopped_with_its_processes` found: the processes left alive (SIGKILLed since),
    the script's exit status, and what it wrote to stderr."""

    left: set[int]
    status: int | None
    stderr: str


def stopped_with_its_processes(argv: list[str], started: int, timeout: float = 60.0,
                               env: dict[str, str] | None = None) -> Stopped:
    """Run `argv` (a script that starts processes of its own: a broker, load generators),
    wait until `started` processes run under it, SIGTERM it alone (as `kill PID` or a CI
    runner's timeout do), and return those of them still alive 30 s after it ended: none,
    if it stops what it started (hostile testing, round 112: a broker was left serving). Those
    are SIGKILLed before the return. Its exit status and stderr too: 143 and one line, no
    traceback (new user, round 105)."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    err = ""
    try:
        wait_for(lambda: len(descendants(proc.pid)) >= started, timeout=timeout, interval=0.2)
        under = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in under):
        time.sleep(0.2)
    left = {p for p in under if alive(p)}
    for pid in left:  # (the test that sees them fails; they are not left running past it)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return Stopped(left, proc.returncode, err)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything `sock` receives until its peer closes it (a reset ends it too)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def rpc(method: str, params: object = None, id_: object = 1) -> dict[str, object]:
    """A JSON-RPC 2.0 Request object (params left out when None)."""
    call: dict[str, object] = {"jsonrpc": "2.0", "method": method, "id": id_}
    if params is not None:
        call["params"] = params
    return call


def wait_for(predicate: object, timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll `predicate()` until true or raise AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


def load_generator() -> ModuleType:
    """grafana/generate.py as a module (it is a script, not part of the package)."""
    path = ROOT / "grafana" / "generate.py"
    spec = importlib.util.spec_from_file_location("rpc_broker_grafana_generate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_metrics(b: Broker, port: int | None = None,
                   connection: http.client.HTTPConnection | None = None) -> Samples:
    """Every sample of the broker's GET /metrics (on `port`, else its RPC port; or over
    `connection`, e.g. an HTTPS one), keyed by (name, sorted labels), parsed by
    prometheus-client's own text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = connection or http.client.HTTPConnection(b.host, port or b.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read()
        assert response.status == 200, (response.status, body)
        assert response.getheader("content-type", "").startswith("text/plain; version=0.0.4")
    finally:
        conn.close()
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# glibc's malloc maps each block of 64 KiB or more on its own, freed back to the system at
# once, where its default raises that threshold after the first such free and takes later
# blocks from the heap, whose holes make RSS wander by tens of MB: given to the brokers of
# tests that compare RSS between rounds, so that only memory still held shows (CI, stop 33:
# a round's 40 freed 1 MiB bodies read as 60 -> 68 -> 93 MB).
FREED_AT_ONCE = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def rss_kib(pid: int) -> int:
    """The resident set size of process `pid`, in KiB (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
