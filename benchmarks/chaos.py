"""`make chaos`: load over HTTP and NDJSON while workers are killed, stopped, reloaded and crashed,
and every call's fate accounted for (issue 11, item 3).

Usage: .venv/bin/python benchmarks/chaos.py [--seconds 60] [--seed N] [--workers 2]
                                            [--concurrency 8] [--event-gap 1.0] [--json]

Starts its own broker (`python -m broker serve --app broker.demo:faults` on 127.0.0.1, port 0,
NDJSON on a free TCP port and on a Unix socket in a temporary directory, with short deadlines
so that hung and stopped workers are dealt with within the run: `timeout` 2 s, `hang` 1 s,
`cancel_grace` 1 s, `grace_period` 5 s, `restart_backoff_max` 1 s). Its log goes to a file in
that directory, kept (and named) when the run fails.

Load: `--concurrency` connections (half HTTP/1.1 keep-alive, 2 bodies pipelined; half NDJSON
over TCP and the Unix socket, 8 calls in flight, answers matched by id), closed loop, singles
and batches of 2..8 of `add`, `echo`, `slow` calls and `update` notifications, every id unique
across the run (ints and strings): see `chaos_client`, a thin recording client on top of the
load generator's `Target` and `Answer` (the load generator does not keep calls by id).

Chaos, on a schedule drawn from `random.Random(--seed)` (times, kinds, and each event's own
draws: which worker in pid order, how long, which transport): `kill` SIGKILL a worker (a child
of the broker's pid); `stop` SIGSTOP a worker for cancel_grace + 0.5 s to timeout +
cancel_grace + 1.5 s, then SIGCONT; `hup2` two SIGHUPs in a row; `crash` and `hang` calls (on
connections of their own); `drop` close a load connection that has calls in flight (or a new
one, just written to) before its answers. The first events take each kind once (in a shuffled
order), so a run of at least about 8 s sees every kind.

Fates (per call with an id): answered exactly once (a right result, or an error of the broker's
own capacity or failure codes, counted by code); duplicated (answers past the first); wrong (a
result other than the expected one, another error code, an id never sent or sent on another
connection, an answer to a notification, a malformed answer); dropped (its connection closed by
this client first: not lost); lost (no answer by the end, after a final wait of timeout +
cancel_grace + 5 s; `lost_cut` of them had their connection closed by the broker).

Prints a table (or, with `--json`, one JSON object on stdout, schema `rpc-broker-chaos/1`), with
the broker's RSS and its workers' (KiB) at the start and the end, and its log's ERROR lines.
Exit status: 0 when lost, duplicated and wrong are all 0 and the broker stopped with status 0;
1 otherwise; 3 when the hard deadline (`--seconds` + 120 s) passed, the broker and its workers
then SIGKILLed. Every process it starts is stopped by its PID.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # this checkout's `broker`, the one its broker runs (`-m broker`, cwd ROOT)
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

import msgspec  # noqa: E402
import uvloop  # noqa: E402
from chaos_client import (  # noqa: E402
    NO_RESULT,
    Body,
    BodyMaker,
    HttpConnection,
    Ledger,
    RecordingConnection,
    StreamConnection,
    connect,
)
from conftest import children, free_port, listen_port, rss_kib  # noqa: E402  (the tests' helpers)
from results_md import put_section  # noqa: E402

from broker.loadgen.stopping import run as run_stopping  # noqa: E402
from broker.loadgen.stopping import stop_on_signals  # noqa: E402
from broker.loadgen.target import Target  # noqa: E402

KINDS = ("kill", "stop", "hup2", "crash", "hang", "drop")
SCHEMA = "rpc-broker-chaos/1"
HARD_EXTRA_S = 120.0  # the hard deadline: --seconds plus this (start, final wait, stop)
LOG_PROBLEMS = ("Traceback", "ERROR event loop", "CRITICAL")
# Of the calls answered, at least this share must be results: the chaos refuses some (a worker
# killed, stopped or hung takes the calls it holds, a restart refuses some), not most (hostile
# testing, round 113: a broker refusing 99 % of calls -32000 passed; a normal run gets 93 %).
MIN_RESULT_SHARE = 0.5
"""Marks of a broker log line that no chaos should cause (its loop's exception handler called, an
exception's traceback, a critical error): such a line fails the run. ERROR lines are expected (a
reload whose new worker was SIGKILLed fails, and says so) and only counted."""
_SERVING = re.compile(r"serving JSON-RPC on http://([^:/]+):(\d+)(/\S*)")


class Settings(argparse.Namespace):
    seconds: float
    seed: int
    workers: int
    concurrency: int
    event_gap: float
    timeout: float
    hang_timeout: float
    cancel_grace: float
    json: bool
    write: bool


def schedule(seed: int, seconds: float, gap: float) -> list[tuple[float, str]]:
    """The chaos events of a run: (seconds from the load's start, kind), in time order. Drawn
    from `random.Random(seed)`: between 1 s and `seconds` - 1.5 s, one every `gap` s on
    average, at least one of each kind (the kinds shuffled, then drawn at random)."""
    rng = random.Random(seed)
    first, last = min(1.0, seconds / 4), max(seconds - 1.5, seconds * 0.75)
    n = max(len(KINDS), round((last - first) / gap))
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(n - len(KINDS))]
    rng.shuffle(kinds)
    times = sorted(rng.uniform(first, last) for _ in range(n))
    return list(zip(times, kinds, strict=True))


class BrokerProcess:
    """The broker this run starts: `python -m broker serve ...`, stderr to `log_path`."""

    def __init__(self, s: Settings, workdir: Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / "broker.log"
        self.socket = str(workdir / "s.sock")
        self.stream_port = 0
        self.http = ("", 0, "/")
        self.proc: subprocess.Popen[bytes] | None = None
        self.known: set[int] = set()  # every worker pid seen: SIGKILLed at a hard stop
        self.flags = ["--app", "broker.demo:faults", "--workers", str(s.workers), "--timeout", str(s.timeout),
                      "--method-timeout", f"hang={s.hang_timeout}", "--cancel-grace", str(s.cancel_grace),
                      "--grace-period", "5", "--restart-backoff-max", "1", "--log-level", "warning",
                      "--stream-socket", self.socket]

    def start(self, timeout: float = 60.0) -> None:
        """Start it and wait for its serving line; a stream port taken meanwhile is tried anew."""
        for _attempt in range(3):
            self.stream_port = free_port()
            argv = [sys.executable, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(listen_port()),
                    "--stream-port", str(self.stream_port), *self.flags]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=ROOT)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                m = _SERVING.search(self.log())
                if m and f"tcp://127.0.0.1:{self.stream_port}" in self.log():
                    self.http = (m[1], int(m[2]), m[3])
                    return
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
            if self.proc.poll() is None:
                self.kill()
                raise RuntimeError(f"broker not serving after {timeout} s; log: {self.log_path}")
            if "Address already in use" not in self.log():
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.log()[-2000:]}")
        raise RuntimeError("broker could not bind a free stream port three times")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def workers(self) -> list[int]:
        """The broker's live child processes (its workers, a reload's new ones too), by pid."""
        pids = sorted(children(self.pid))
        self.known.update(pids)
        return pids

    def rss(self, workers: int, wait: float = 10.0) -> tuple[int, int, int]:
        """(the broker's RSS, its workers' summed, KiB; how many worker processes), once it has
        `workers` of them (a slot restarting, or a reload under way, has fewer or more), or after
        `wait` s."""
        deadline = time.monotonic() + wait
        while len(self.workers()) != workers and time.monotonic() < deadline:
            time.sleep(0.1)
        total = n = 0
        for pid in self.workers():
            try:
                total += rss_kib(pid)
            except (OSError, AssertionError):
                continue  # gone meanwhile
            n += 1
        try:
            return rss_kib(self.pid), total, n
        except (OSError, AssertionError):  # (it exited: hostile testing, round 113, a traceback, no verdict)
            return 0, total, n

    def metrics(self) -> dict[str, float]:
        """The restart and reload counters of its /metrics ({} if it does not answer)."""
        host, port, _ = self.http
        try:
            conn = http.client.HTTPConnection(host, port, timeout=5)
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            conn.close()
        except OSError:
            return {}
        out = {}
        for m in re.finditer(r'^rpc_broker_(worker_restarts|reloads)_total\{\w+="(\w+)"\} ([0-9.e+]+)$', text, re.M):
            if float(m[3]):
                out[f"{m[1]}:{m[2]}"] = float(m[3])
        return out

    def stop(self, wait: float = 25.0) -> tuple[int | None, float]:
        """SIGTERM, wait up to `wait` s, else SIGKILL it and its workers. (status, seconds taken)."""
        assert self.proc is not None
        began = time.monotonic()
        if self.proc.poll() is None:
            self.workers()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.kill()
                return None, time.monotonic() - began
        return self.proc.returncode, time.monotonic() - began

    def kill(self) -> None:
        """SIGKILL the broker and every worker of it ever seen (still a child of it: no other)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            mine = children(self.proc.pid) & self.known
            self.proc.kill()
            for pid in mine:
                _signal(pid, signal.SIGKILL)
            self.proc.wait(10)


def _signal(pid: int, sig: signal.Signals) -> bool:
    """Send `sig` to `pid`; False if it is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


class Run:
    """One chaos run against a started broker (see the module docstring)."""

    HTTP_DEPTH = 2  # bodies pipelined on an HTTP connection
    STREAM_DEPTH = 8  # calls in flight on an NDJSON connection

    def __init__(self, s: Settings, broker: BrokerProcess) -> None:
        self.s = s
        self.broker = broker
        self.rng = random.Random(s.seed)
        self.ledger = Ledger()
        self.maker = BodyMaker(self.ledger, self.rng)
        host, port, path = broker.http
        self.targets = {"http": Target.parse(f"http://{host}:{port}{path}"),
                        "tcp": Target.parse(f"tcp://127.0.0.1:{broker.stream_port}"),
                        "unix": Target.parse(f"unix://{broker.socket}")}
        self.slots = ["http" if i % 2 == 0 else ("tcp" if i % 4 == 1 else "unix") for i in range(s.concurrency)]
        self.conns: list[RecordingConnection | None] = [None] * s.concurrency
        self.extra: list[RecordingConnection] = []  # the connections of crash, hang and drop events
        self.sending = False
        self.stopped: dict[int, asyncio.TimerHandle] = {}  # SIGSTOPped workers: their SIGCONT
        self.events: list[dict[str, object]] = []
        self.connect_failures = 0
        self.t0 = self.t0_wall = 0.0

    # -- load ------------------------------------------------------------------------------
    def _new_conn(self, where: str) -> RecordingConnection:
        on_answer = self._fill
        if where == "http":
            return HttpConnection(self.ledger, self.targets["http"], on_answer)
        return StreamConnection(self.ledger, on_answer)

    async def _keep_open(self, i: int) -> None:
        """Load slot `i`: a connection sending while the load runs, reopened whenever it closes."""
        where = self.slots[i]
        while self.sending:
            conn = self._new_conn(where)
            if not await connect(self.targets[where], conn):
                self.connect_failures += 1
                await asyncio.sleep(0.1)
                continue
            self.conns[i] = conn
            self._fill(conn)
            await conn.closed

    def _fill(self, conn: RecordingConnection) -> None:
        depth = self.HTTP_DEPTH if conn.kind == "http" else self.STREAM_DEPTH
        while self.sending and conn.can_send(depth):
            body, calls = self.maker.body()
            conn.send(body, calls)

    # -- chaos -----------------------------------------------------------------------------
    async def _chaos(self) -> None:
        loop = asyncio.get_running_loop()
        for i, (at, kind) in enumerate(schedule(self.s.seed, self.s.seconds, self.s.event_gap)):
            await asyncio.sleep(max(0.0, self.t0 + at - loop.time()))
            if not self.sending:
                return
            rng = random.Random(f"{self.s.seed}:{i}")  # the event's own draws: seeded, whatever came before
            detail = await getattr(self, f"_event_{kind}")(rng)
            self.events.append({"t": round(loop.time() - self.t0, 2), "kind": kind, "detail": detail})

    def _pick_worker(self, rng: random.Random) -> int | None:
        pids = [p for p in self.broker.workers() if p not in self.stopped]
        return rng.choice(pids) if pids else None

    async def _event_kill(self, rng: random.Random) -> str:
        pid = self._pick_worker(rng)
        if pid is None or not _signal(pid, signal.SIGKILL):
            return "skipped: no worker"
        return f"SIGKILL worker {pid}"

    async def _event_stop(self, rng: random.Random) -> str:
        pid = self._pick_worker(rng)
        if pid is None or not _signal(pid, signal.SIGSTOP):
            return "skipped: no worker"
        s = self.s
        seconds = rng.uniform(s.cancel_grace + 0.5, s.timeout + s.cancel_grace + 1.5)
        self.stopped[pid] = asyncio.get_running_loop().call_later(seconds, self._cont, pid)
        return f"SIGSTOP worker {pid} for {seconds:.2f} s"

    def _cont(self, pid: int) -> None:
        self.stopped.pop(pid, None)
        _signal(pid, signal.SIGCONT)

    async def _event_hup2(self, rng: random.Random) -> str:
        _signal(self.broker.pid, signal.SIGHUP)
        _signal(self.broker.pid, signal.SIGHUP)
        return "SIGHUP, SIGHUP"

    async def _one_call(self, rng: random.Random, method: str, params: object) -> str:
        where = rng.choice(("http", "tcp", "unix"))
        conn = self._new_conn(where)
        conn.on_answer = lambda c: c.close() if not c.pending else None
        if not await connect(self.targets[where], conn):
            self.connect_failures += 1
            return f"skipped: cannot connect ({where})"
        self.extra.append(conn)
        data, key = self.maker.one(method, params)
        conn.send(Body(data, (key,), 0, False), [(key, method, NO_RESULT)])
        return f"{method} {key.decode()} over {where}"

    async def _event_crash(self, rng: random.Random) -> str:
        return await self._one_call(rng, "crash", {"how": rng.choice(("exit", "kill"))})

    async def _event_hang(self, rng: random.Random) -> str:
        return await self._one_call(rng, "hang", [])

    async def _event_drop(self, rng: random.Random) -> str:
        busy = [i for i, c in enumerate(self.conns) if c is not None and c.open and c.pending]
        if busy:
            i = rng.choice(busy)
            conn = self.conns[i]
            assert conn is not None
            return f"dropped load connection {i} ({self.slots[i]}) with {conn.drop()} call(s) in flight"
        where = rng.choice(("http", "tcp", "unix"))
        conn = self._new_conn(where)
        conn.on_answer = None
        if not await connect(self.targets[where], conn):
            self.connect_failures += 1
            return f"skipped: cannot connect ({where})"
        self.extra.append(conn)
        body, calls = self.maker.body()
        conn.send(body, calls)
        return f"dropped a new {where} connection with {conn.drop()} call(s) just written"

    # -- the run ---------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.t0 = loop.time()
        self.t0_wall = time.monotonic()
        self.sending = True
        slots = [asyncio.create_task(self._keep_open(i)) for i in range(self.s.concurrency)]
        chaos = asyncio.create_task(self._chaos())
        await asyncio.sleep(self.s.seconds)
        self.sending = False
        chaos.cancel()  # (an event under way ends here: its SIGCONT, if any, is still due below)
        await asyncio.gather(chaos, return_exceptions=True)
        # The final wait: every call has a deadline (timeout, from its arrival), so an answer
        # owed comes within it, or within cancel_grace more for a worker killed as hung.
        end = loop.time() + self.s.timeout + self.s.cancel_grace + 5.0
        while loop.time() < end and any(c.open and c.pending for c in self._all_conns()):
            await asyncio.sleep(0.05)
        for pid, handle in list(self.stopped.items()):
            handle.cancel()
            self._cont(pid)
        for c in self._all_conns():
            c.close()
        for task in slots:
            task.cancel()
        await asyncio.gather(*slots, return_exceptions=True)

    def _all_conns(self) -> list[RecordingConnection]:
        return [c for c in self.conns if c is not None] + self.extra


def _arm_hard_deadline(seconds: float, broker: BrokerProcess) -> threading.Timer:
    """At `seconds` from now, SIGKILL the broker and its workers and exit 3, whatever the run is
    doing (a broker that stops answering a stop, a harness stuck)."""

    def fire() -> None:
        sys.stderr.write(f"chaos: hard deadline ({seconds:.0f} s) passed: SIGKILL to the broker and its workers; "
                         f"its log: {broker.log_path}\n")
        try:
            broker.kill()
        finally:
            os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


class Report(msgspec.Struct, kw_only=True):
    """The outcome of a run (`--json` prints it, schema `SCHEMA`). Counts are of calls with an id
    unless named otherwise (see the module docstring for each fate); RSS in KiB; times in s."""

    schema: str = SCHEMA
    seed: int
    seconds: float
    workers: int
    concurrency: int
    event_gap: float
    broker_settings: dict[str, float]  # timeout, hang_timeout, cancel_grace
    sent: int
    notifications: int  # sent (never answered)
    sent_http: int
    sent_ndjson: int
    batches: int  # batch bodies sent (the others: single calls and notifications)
    answered_once: int  # a wrong answer included
    results_ok: int
    errors: int  # right error answers, by code in errors_by_code
    dropped: int
    lost: int
    lost_cut: int  # of the lost: their connection closed by the broker
    duplicated: int  # answers past a call's first
    duplicated_calls: int
    wrong: int
    errors_by_code: dict[str, int]
    error_spans: dict[str, list[list[float]]]  # per code: [first, last, count], s from the load's start
    events: dict[str, int]  # per kind: the events done (not skipped)
    event_log: list[dict[str, object]]  # {"t", "kind", "detail"}
    connect_failures: int
    rss_kib: dict[str, int]  # broker_start, broker_end, workers_start, workers_end (summed)
    worker_processes: list[int]  # how many the workers' RSS sums, at the start and the end
    broker_metrics: dict[str, float]  # its restart and reload counters at the end
    broker_exit: int | None  # None: it did not stop within its wait, and was killed
    broker_stop_s: float
    broker_error_lines: int
    broker_error_examples: list[str]
    broker_log_problems: list[str]  # lines of LOG_PROBLEMS (at most 20)
    examples: dict[str, list[str]]  # per failure kind, the first few
    failures: list[str]  # why the verdict is FAILED (empty: OK)
    ok: bool


def failures_of(fates: typing.Mapping[str, int], status: int | None, died: int | None, problems: int) -> list[str]:
    """Why a run failed (none: it passed): calls lost, duplicated or wrong (`fates`, the
    ledger's counts); fewer than MIN_RESULT_SHARE of the answers results; the broker exited
    during the run (`died`), or did not stop with status 0 (`status`; None: SIGKILLed at
    the end of its wait); `problems` lines of tracebacks or loop errors in its log."""
    failures = [f"{fates[k]:,} calls {k}" for k in ("lost", "duplicated", "wrong") if fates[k]]
    if fates["results_ok"] < MIN_RESULT_SHARE * fates["answered_once"]:
        failures.append(f"{fates['results_ok']:,} of {fates['answered_once']:,} calls answered got a result, under "
                        f"{MIN_RESULT_SHARE:.0%}: the broker refused most calls, not only those the chaos took")
    if died is not None:
        failures.append(f"the broker exited during the run, with status {died}")
    elif status != 0:
        failures.append(f"the broker stopped with status {status}" if status is not None
                        else "the broker did not stop within its wait (SIGKILLed)")
    if problems:
        failures.append(f"{problems} problem lines in the broker's log (tracebacks, loop errors)")
    return failures


def report(s: Settings, run: Run, broker: BrokerProcess, rss0: tuple[int, int, int], rss1: tuple[int, int, int],
           status: int | None, stop_s: float, metrics: dict[str, float], died: int | None = None) -> Report:
    """The run's outcome (`died`: the broker's exit status if it exited during the run)."""
    fates = run.ledger.summary()
    lines = broker.log().splitlines()
    error_lines = [line for line in lines if " ERROR " in line]
    problems = [line for line in lines if any(mark in line for mark in LOG_PROBLEMS)]
    done = [e for e in run.events if not str(e["detail"]).startswith("skipped")]
    failures = failures_of(fates, status, died, len(problems))
    ok = not failures
    return Report(
        seed=s.seed, seconds=s.seconds, workers=s.workers, concurrency=s.concurrency, event_gap=s.event_gap,
        broker_settings={"timeout": s.timeout, "hang_timeout": s.hang_timeout, "cancel_grace": s.cancel_grace},
        **fates, batches=run.maker.batches,
        errors_by_code={str(k): v for k, v in sorted(run.ledger.errors_by_code.items())},
        error_spans={str(k): spans(times, run.t0_wall) for k, times in sorted(run.ledger.error_times.items())},
        events={k: sum(1 for e in done if e["kind"] == k) for k in KINDS}, event_log=run.events,
        connect_failures=run.connect_failures,
        rss_kib={"broker_start": rss0[0], "broker_end": rss1[0], "workers_start": rss0[1], "workers_end": rss1[1]},
        worker_processes=[rss0[2], rss1[2]],
        broker_metrics=metrics, broker_exit=status, broker_stop_s=round(stop_s, 2),
        broker_error_lines=len(error_lines), broker_error_examples=error_lines[:5],
        broker_log_problems=problems[:20], examples=dict(run.ledger.examples), failures=failures, ok=ok)


def spans(times: list[float], t0: float, gap: float = 0.5) -> list[list[float]]:
    """When error answers of one code came: [first, last, how many] for each run of them no more
    than `gap` s apart, in seconds from the load's start `t0` (`time.monotonic()`'s clock)."""
    out: list[list[float]] = []
    for t in sorted(times):
        if out and t - t0 - out[-1][1] <= gap:
            out[-1][1] = round(t - t0, 2)
            out[-1][2] += 1
        else:
            out.append([round(t - t0, 2), round(t - t0, 2), 1])
    return out


def print_table(r: Report) -> None:
    """The report as a table of 80 columns (rich), then the failures' examples and the verdict."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"chaos: {r.seconds:g} s, seed {r.seed}, {r.workers} workers, {r.concurrency} connections")
    table.add_column("calls", justify="left")
    table.add_column("count", justify="right")
    rows = [("sent (with an id)", r.sent), ("  over HTTP", r.sent_http), ("  over NDJSON", r.sent_ndjson),
            ("  batches of them (bodies)", r.batches), ("notifications sent", r.notifications),
            ("answered exactly once", r.answered_once), ("  of them a right result", r.results_ok),
            ("  of them an expected error", r.errors), ("dropped with their connection", r.dropped),
            ("lost (no answer)", r.lost), ("  of them cut by the broker's close", r.lost_cut),
            ("answered twice (extra answers)", r.duplicated), ("wrong id or result", r.wrong)]
    rows += [(f"error {code}", n) for code, n in r.errors_by_code.items()]
    rows += [(f"event {kind}", n) for kind, n in r.events.items()]
    for name, value in rows:
        table.add_row(name, f"{value:,}")
    for name, kib in r.rss_kib.items():
        table.add_row(f"RSS {name.replace('_', ' ')} (MiB)", f"{kib / 1024:.1f}")
    table.add_row("worker processes at the start, the end", f"{r.worker_processes[0]}, {r.worker_processes[1]}")
    table.add_row("broker exit status", str(r.broker_exit))
    table.add_row("broker ERROR lines in its log", str(r.broker_error_lines))
    table.add_row("  of them problems (tracebacks, ...)", str(len(r.broker_log_problems)))
    Console(width=80).print(table)
    for kind, examples in r.examples.items():
        for text in examples:
            print(f"{kind}: {text}")
    for line in r.broker_error_examples:  # (new user, round 104: docs/bench.md promises them)
        print(f"broker ERROR: {line}")
    for line in r.broker_log_problems:
        print(f"broker log: {line}")
    print("verdict:", "OK: nothing lost, duplicated or wrong" if r.ok else "FAILED: " + "; ".join(r.failures))




def write_results(r: Report, path: Path) -> None:
    """Put the figures of `r` into `path` (benchmarks/RESULTS.md) as its section "chaos" (results_md),
    replacing those of an earlier run, or at the end (below run.py's KEEP_MARK, which it keeps)."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    codes = ", ".join(f"{code} {n:,}" for code, n in r.errors_by_code.items()) or "none"
    events = ", ".join(f"{kind} {n}" for kind, n in r.events.items())
    restarts = ", ".join(f"{k} {v:g}" for k, v in r.broker_metrics.items()) or "none"
    rss = r.rss_kib
    rows = [("sent (with an id)", r.sent), ("answered exactly once", r.answered_once),
            ("of them a right result", r.results_ok), ("of them an expected error", r.errors),
            ("dropped with their connection", r.dropped), ("lost", r.lost), ("answered twice", r.duplicated),
            ("wrong id or result", r.wrong), ("notifications sent", r.notifications)]
    put_section("chaos", [
        "## Chaos", "",
        f"Written by `benchmarks/chaos.py --seconds {r.seconds:g} --seed {r.seed} --write` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (`make chaos`: docs/bench.md). {r.workers} workers, "
        f"{r.concurrency} connections (half HTTP, half NDJSON), `timeout` {r.broker_settings['timeout']:g} s, "
        f"`hang` {r.broker_settings['hang_timeout']:g} s, `cancel_grace` {r.broker_settings['cancel_grace']:g} s; "
        f"{os.cpu_count()} CPUs, load average {load} at the end. Events done: {events}. Errors by code: {codes}. "
        f"The broker's counters at the end: {restarts}. RSS (MiB) at the start and the end: the broker "
        f"{rss['broker_start'] / 1024:.1f} and {rss['broker_end'] / 1024:.1f}, its workers "
        f"{rss['workers_start'] / 1024:.1f} and {rss['workers_end'] / 1024:.1f}. The broker stopped with status "
        f"{r.broker_exit} in {r.broker_stop_s:g} s; its log had {r.broker_error_lines} ERROR "
        f"line{'s' if r.broker_error_lines != 1 else ''} "
        f"({len(r.broker_log_problems)} tracebacks or loop errors). Verdict: "
        + ("nothing lost, duplicated or wrong." if r.ok else "FAILED: " + "; ".join(r.failures) + "."),
        "", "| calls | count |", "|---|---:|", *(f"| {name} | {n:,} |" for name, n in rows),
    ], path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of load and chaos (default 60)")
    parser.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: drawn, then printed)")
    parser.add_argument("--workers", type=int, default=2, help="the broker's workers (default 2)")
    parser.add_argument("--concurrency", type=int, default=8, help="load connections (default 8)")
    parser.add_argument("--event-gap", type=float, default=1.0, help="mean seconds between chaos events (default 1)")
    parser.add_argument("--timeout", type=float, default=2.0, help="the broker's call deadline, s (default 2)")
    parser.add_argument("--hang-timeout", type=float, default=1.0, help="hang's deadline, s (default 1)")
    parser.add_argument("--cancel-grace", type=float, default=1.0, help="the broker's cancel_grace, s (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of a table")
    parser.add_argument("--write", action="store_true", help="also put the figures into benchmarks/RESULTS.md")
    s = parser.parse_args(argv, namespace=Settings())
    stop_on_signals()  # (its `finally` stops what it started: broker/loadgen/stopping.py)
    if s.seed is None:
        s.seed = random.randrange(1 << 31)
    if not (1 <= s.seconds <= 86400 and s.workers >= 1 and s.concurrency >= 1 and s.event_gap > 0):
        parser.error("--seconds must be 1..86400, --workers and --concurrency at least 1, --event-gap above 0")
    inherited = sorted(var for var in os.environ if var.startswith("RPC_BROKER_"))
    for var in inherited:  # (its broker takes the run's settings only: hostile testing, round 113)
        del os.environ[var]
    if inherited:
        print(f"chaos: ignoring {', '.join(inherited)} (the run's broker takes its own settings only)", file=sys.stderr)
    workdir = Path(tempfile.mkdtemp(prefix="rb-chaos-"))
    broker = BrokerProcess(s, workdir)
    timer = _arm_hard_deadline(s.seconds + HARD_EXTRA_S, broker)
    result: Report | None = None
    try:
        print(f"chaos: seed {s.seed}, {s.seconds:g} s", file=sys.stderr)
        broker.start()
        rss0 = broker.rss(s.workers)
        run = Run(s, broker)
        try:
            uvloop.run(run.run())
        finally:
            for pid in list(run.stopped):
                _signal(pid, signal.SIGCONT)
        died = broker.proc.poll() if broker.proc is not None else None
        rss1 = broker.rss(s.workers, 0 if died is not None else 10)
        metrics = broker.metrics()
        status, stop_s = broker.stop()
        result = report(s, run, broker, rss0, rss1, status, stop_s, metrics, died)
    finally:
        if result is None and broker.proc is not None:  # interrupted: SIGTERM first, so that it removes its socket directory
            broker.stop(5.0)  # (a SIGKILL leaves it behind: hostile testing, round 113)
        broker.kill()
        timer.cancel()
        if result is not None and result.ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"chaos: the broker's log is kept in {broker.log_path}", file=sys.stderr)
    if s.write:
        write_results(result, HERE / "RESULTS.md")
    if s.json:
        print(msgspec.json.format(msgspec.json.encode(result), indent=1).decode())
    else:
        print_table(result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    run_stopping("chaos", main)
