"""The daemon's process: wires config, dispatcher, worker pool and front-ends together.

Kept apart from `cli.py` (argument handling) so tests and embedders can start a
broker from a `Config` without going through argv.

Signals (handlers only set an event; the main coroutine acts on it):
    SIGTERM, SIGINT  stop accepting, answer what is in flight (up to grace_period),
                     stop the workers, exit 0; a second one cuts the grace period short.
                     During the start (the workers import the app), the start is given
                     up: the workers are killed at once, exit 0
    SIGHUP           reload (`Pool.request_reload`): fresh workers import the app anew and,
                     once all are ready, replace the old ones and their method table in one
                     step; no call is lost; a failed reload leaves the old workers serving.
                     A SIGHUP during a reload (or while the broker starts) is not dropped:
                     one more reload runs once that ends, so the latest code is deployed.
                     Once a stop signal came, SIGHUP is ignored (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import socket
import sys
import typing

import msgspec

import broker
from broker import jsonscan
from broker.accesslog import AccessLog
from broker.auth import Authenticator, AuthError, load_tokens
from broker.config import Config, ConfigError, per_frontend, socket_group
from broker.dispatch import Dispatcher
from broker.frontend.base import OUT_LINGERING, Incoming, shed_outgoing
from broker.frontend.http import PROBE_OVERFLOW, PROBE_RESERVE, HttpFrontend
from broker.frontend.socketfile import check_socket_path, remove_socket, unix_server
from broker.frontend.stdio import Stdio, StdioFrontend, log_listeners, stdio_config
from broker.frontend.stream import StreamFrontend
from broker.listening import accepting, close_last, stop_listening
from broker.logpipe import LogPipe, access_to_logger
from broker.members import Members
from broker.metrics import BrokerCollector, CallMetrics, exposition, registry, samples
from broker.peers import Peers, tap
from broker.policy import MethodRule, Policy
from broker.pool import Pool, WorkerBootError
from broker.ratelimit import Limiter, Rate, burst_for, share
from broker.startup import exposure_warnings, fit_open_files, secret_file_warnings, warn_unserved_timeouts
from broker.statusfile import StatusFile
from broker.tls import TlsError, server_context
from broker.worker import WORKER_BOOT_ERROR

if typing.TYPE_CHECKING:
    from broker.peer import Peer

__all__ = ["run", "serve"]

log = logging.getLogger("broker")


def serve(config: Config, early: typing.Sequence[int] = (), stdio: Stdio | None = None, peer: Peer | None = None) -> int:
    """Run the broker until SIGTERM/SIGINT; return the process exit status.

    `early`: signals received before the loop's handlers (`broker.entry`).
    `stdio`: serve that face on stdin and stdout instead of the listeners (`run`), until
    stdin ends too (`rpc-broker stdio`: `broker.frontend.stdio.JSONRPC`).
    `peer`: run as a front-end past the first (broker/peer.py).
    0 after a clean shutdown, `WORKER_BOOT_ERROR` (3) when the workers cannot load
    the app (an exception or exit at import, or no HELLO within boot_timeout), 2 when
    the workers' socket cannot be made (socket_dir), 1 when the listening socket
    cannot be opened.
    """
    pipe = LogPipe(config.log_level.upper(), config.log_format)
    pipe.start()
    try:
        if config.event_loop == "asyncio":
            return asyncio.run(run(config, early=early, logs=pipe, stdio=stdio, peer=peer))
        import uvloop

        return uvloop.run(run(config, early=early, logs=pipe, stdio=stdio, peer=peer))
    finally:
        pipe.stop()  # (what is queued written: the last lines, "stopped" among them)


class LoopErrors:
    """The event loop's exception handler (`loop.set_exception_handler`): what the loop
    could not hand to the broker's code (an exception in a callback, a task's exception
    never retrieved, an accept failing for want of descriptors) is logged as an ERROR
    line that starts "event loop:", with its traceback; the same message again within
    `REPEAT_SECONDS` is counted, not logged, and the count said with its next line
    (asyncio's accept goes on after EMFILE, calling the handler up to its backlog of
    2048 times in a row: CPython's selector_events `_accept_connection`). The tests
    fail a broker whose log holds such a line."""

    REPEAT_SECONDS = 1.0
    MESSAGES_KEPT = 256  # distinct messages remembered (past that, forgotten all at once)

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}  # message: (loop time logged, repeats not logged since)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, typing.Any]) -> None:
        message = str(context.get("message") or "unhandled exception")
        now = loop.time()
        logged, repeats = self._last.get(message, (-self.REPEAT_SECONDS, 0))
        if now - logged < self.REPEAT_SECONDS:
            self._last[message] = (logged, repeats + 1)
            return
        if len(self._last) >= self.MESSAGES_KEPT:
            self._last.clear()
        self._last[message] = (now, 0)
        exception = context.get("exception")
        more = f" ({repeats} more like it not logged)" if repeats else ""
        details = "".join(f"; {key}: {value!r}"[:300] for key, value in sorted(context.items())
                          if key not in ("message", "exception"))
        log.error("event loop: %s%s%s", message, more, details,
                  exc_info=(type(exception), exception, exception.__traceback__)
                  if isinstance(exception, BaseException) else None)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SAME_STOP_S = 0.5
"""A SIGTERM this soon after the first stop signal is the same stop, not a second one
(which ends the grace period): `kill` of a process group under `make serve` delivers it
twice, GNU make forwarding the SIGTERM it gets to its children (round 30, new user)."""


async def _start_threads_masked(loop: asyncio.AbstractEventLoop) -> None:
    """Start libuv's thread pool (uvloop's getaddrinfo runs there; its threads are all
    made at its first use, and inherit the calling thread's signal mask) with the stop
    and reload signals blocked: only the main thread takes them then, so that
    `_ignore_signals` can hold them off the whole process (pthread_sigmask(3): a signal
    sent to a process goes to any thread that does not block it)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        with contextlib.suppress(OSError):
            await loop.getaddrinfo("127.0.0.1", 0, flags=socket.AI_NUMERICHOST)  # (no name service: at once)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _ignore_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Take the stop and reload signals' handlers off `loop` and ignore the signals from
    then on.

    The loop's `remove_signal_handler` gives each its default action back for an instant
    (terminate; SIGINT's raises KeyboardInterrupt, which Python raises where
    `signal.signal` is next called: a SIGINT pending then took this loop out, and the
    signals after it kept their default action; hostile testing, round 25; a SIGHUP in
    that instant still ended it by signal, once in a full test run, stop 24). So they
    are blocked meanwhile (the other threads block them from their start:
    `_start_threads_masked`), and ignored before they are let through again: one sent
    meanwhile is then discarded (POSIX: setting SIG_IGN discards a pending signal)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        for sig in _STOP_SIGNALS:
            with contextlib.suppress(KeyboardInterrupt):
                loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked - set(_STOP_SIGNALS))


METRICS_CONNECTIONS = 64  # connections at once on a separate metrics listener (metrics_port)
RESERVE = PROBE_RESERVE + PROBE_OVERFLOW  # connections an HTTP listener takes past max_connections
_LISTENER_NAMES = {
    "http": "JSON-RPC over HTTP: --port", "metrics": "metrics: --metrics-port",
    "tcp": "NDJSON over TCP: --stream-port", "unix": "NDJSON over a Unix socket: --stream-socket",
}  # fmt: skip (the setting that chooses where, by its flag: round 30, a new user)


def _banner(line: str, logs: LogPipe | None = None) -> None:
    """Print a start-up banner `line` to stderr: through `logs`, the process's log pipe, when
    there is one (its writer thread writes it, after the lines before it: the loop never
    waits on a full stderr; hostile testing, round 117, a stderr pipe already full at the
    start hung it, SIGTERM unheard), else in one write, newline and all. Its reader may be
    gone (`2>&1 | head -1` took an earlier line): the broker serves on, as it does when its
    log lines find no reader (logging drops them); the BrokenPipeError ended the start with
    exit 1 and left the socket directory behind (hostile testing, round 20)."""
    if logs is not None:
        logs.line(line)
        return
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except OSError:
        pass


def _url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _nobody_listens(host: str, port: int) -> None:
    """Raise `OSError` (EADDRINUSE) if a socket is bound to `host`:`port` already: a bind
    there without SO_REUSEPORT (SO_REUSEADDR, as asyncio's: a connection lingering in
    TIME_WAIT does not count) would fail too."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)


def _settings(config: Config, names: str) -> dict[str, typing.Any]:
    """The settings `names` (space-separated) of `config`, by name: the keyword arguments of a
    part (Dispatcher, Pool, a front-end) that take a setting of the same name as it is.
    Raises AttributeError for a name that is no setting."""
    return {name: getattr(config, name) for name in names.split()}


async def run(
    config: Config, started: asyncio.Future[tuple[str, int]] | None = None, early: typing.Sequence[int] = (),
    logs: LogPipe | None = None, stdio: Stdio | None = None, peer: Peer | None = None,
) -> int:
    """The broker's main coroutine; sets `started` to the bound (host, port) once ready
    (the first listener's; ("", 0) with none).
    `early`: stop and reload signals received before its handlers (`broker.entry`), acted
    on as if they came now (a stop gives the start up; a reload runs once started).
    `logs`: the process's log queue (`serve`'s), where access lines go too; None: they go
    to the `broker.access` logger (access_log on), with no drops counted.
    `stdio`: serve its front-end on stdin and stdout (broker/frontend/stdio.py), with the
    settings as `stdio_config` makes them: no listener but metrics_port's; the end of the
    connection (stdin's end once every answer is written, stdout's reader gone) stops
    the broker as SIGTERM does.
    `peer`: run as a front-end past the first (`--frontends N`, broker/peer.py): its workers
    handed over (broker/members.py), its TCP listeners the sockets it inherited, no Unix
    socket, metrics port nor status file of its own."""
    if stdio is not None:
        config = stdio_config(config)
    whole = config  # (what the other front-ends are started with: each takes its share, as this one does)
    if stdio is None:
        config = per_frontend(config)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(LoopErrors())
    await _start_threads_masked(loop)
    jsonscan.load()  # (not in the first deep body's turn: hostile testing, round 60, 130 ms)
    try:
        # (checked by config.load: read again, now; a peer's, as the first front-end read them: hostile
        # testing, round 127, a peer started again read the file edited since, and took other tokens)
        tokens = peer.tokens if peer is not None else load_tokens(config.auth_tokens_file)
    except AuthError as exc:
        log.error("%s", exc)
        return 2
    policy = Policy(MethodRule(config.allow_methods, config.deny_methods),
                    {t.name: t.rule for t in tokens if t.rule is not None}, (t.name for t in tokens))
    default = Rate(config.rate_limit, config.rate_burst or burst_for(config.rate_limit)) if config.rate_limit else None
    # (with several front-ends, each holds its share of every rate: `ratelimit.share`)
    n = config.frontend_count if stdio is None else 1
    limiter = Limiter(share(default, n) if default is not None else None,
                      {t.name: share(t.rate, n) for t in tokens if t.rate is not None}, (t.name for t in tokens))
    access = None
    if config.access_log != "off":
        emit = logs.access if logs is not None else access_to_logger(logging.getLogger("broker.access"))
        access = AccessLog(config.access_log, emit, log_params=config.log_params)
    dispatcher = Dispatcher(
        loop,
        policy=policy,
        limiter=limiter,
        access_log=access,
        metrics=CallMetrics() if config.metrics else None,
        **_settings(config, "max_queue max_queue_bytes max_worker_params_bytes timeout method_timeouts cancel_grace "
                    "sync_prefetch max_response_bytes max_outgoing_bytes connection_share"),
    )
    dispatcher.shared_workers = config.frontend_count > 1 and stdio is None
    pool: Pool | Members
    peers: Peers | None = None
    if peer is not None:
        pool = Members(dispatcher, loop, config.worker_count, config.max_frame_bytes, config.boot_timeout)
    else:
        pool = Pool(
            dispatcher,
            size=config.worker_count,
            concurrency=config.worker_concurrency,
            **_settings(config, "app max_depth max_frame_bytes restart_backoff_max boot_timeout socket_dir debug "
                        "log_level max_calls_per_worker max_calls_jitter max_worker_memory"),
            worker_stderr=logs.follow if logs is not None else None,  # (read and written on by the broker)
        )
        if config.frontend_count > 1 and stdio is None:  # (the others: broker/peers.py)
            peers = Peers(loop, config.frontend_count - 1, msgspec.to_builtins(whole), tokens)
            pool.peers = peers
            peers.on_killed = pool.killed_by_peer
            peers.on_struck = dispatcher.struck  # (and the other way: every peer strikes what this one saw)
            dispatcher.on_struck = peers.struck
            peers.on_restart = pool.request_reload
            pool.calls_elsewhere = peers.calls_sent
            dispatcher.membership_tap = tap(peers)
    status = StatusFile(config.status_file if peer is None else "")  # (for `rpc-broker reload`: broker/statusfile.py)

    def reload_reported(ok: bool | None, why: str) -> None:
        if ok is None:  # (begins: it answers every SIGHUP taken so far)
            status.update(reloads=status.status.reloads + 1, covers=status.status.sighups, outcome="running",
                          message="")
        else:
            status.update(outcome="ok" if ok else "failed", message=why)

    pool.on_reload = reload_reported
    stop = asyncio.Event()
    hurry = asyncio.Event()  # a second stop signal in the drain: the grace period ends now
    kill_now = asyncio.Event()  # a stop signal while the workers are asked to exit: SIGKILL them now

    first_stop: list[float] = []  # when the first stop signal came (loop time)
    phase: list[str] = []  # ["workers"] once the stop waits for the workers to exit (the drain is over)
    held: list[tuple[int, str, tuple[object, ...]]] = []  # (level, message, args): see `log_signal`
    stopping_logged: list[bool] = []

    def log_signal(level: int, message: str, *args: object) -> None:
        """Log a line of a signal handler; one that comes when the stop has begun but its
        line ("stopping:", or "stop signal while the workers start") is not logged yet is
        held, and logged right after it by `log_stopping` (round 31 saw a second SIGTERM
        logged before the stop; hostile testing, round 32: a SIGINT or SIGHUP too)."""
        if stop.is_set() and not stopping_logged:
            held.append((level, message, args))
        else:
            log.log(level, message, *args)

    def log_held() -> None:
        while held:
            level, message, args = held.pop(0)
            log.log(level, message, *args)

    def handle_stop(signum: int = signal.SIGTERM) -> None:
        now = loop.time()
        if stop.is_set():
            if signum == signal.SIGTERM and now - first_stop[0] < SAME_STOP_S:
                log_signal(logging.INFO, "SIGTERM again within %g s of the first: the same stop", SAME_STOP_S)
                return
            # (in the drain, the workers then have 1 s to exit, not 10; a signal in that second
            # kills them: new users, round 49, read "did not exit in 1.0 s" 55 ms after it)
            log_signal(logging.WARNING, (
                "another stop signal: killing the workers that have not exited yet (SIGKILL)" if phase else
                "second stop signal: answering what is left with 'shutting down' now; the workers then have"
                " 1 s to exit"))  # ("another": it may be the third, hostile testing round 50)
            if phase:
                kill_now.set()
            hurry.set()
        else:
            first_stop.append(now)
            pool.wind_down()  # (a reload queued now would start workers only to stop them)
            status.update(state="stopping")
        stop.set()

    def first_gone() -> None:
        """A peer's control socket ended: the first front-end is gone, and this one stops, as at SIGTERM."""
        if not stop.is_set():
            log.info("the first front-end is gone: stopping")
            handle_stop()

    def stdio_ended(why: str) -> None:
        """stdio's connection is lost (`StdioFrontend.on_lost`): the broker stops, as at SIGTERM."""
        if not stop.is_set():
            log.info("stdio: %s: stopping", why)
            handle_stop()

    def log_stopping(level: int, message: str, *args: object) -> None:
        """Log that the stop begins, then the lines of the signals that came before."""
        log.log(level, message, *args)
        stopping_logged.append(True)
        log_held()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle_stop, sig)

    def after_reload() -> None:
        warn_unserved_timeouts(config.method_timeouts, pool.methods or [])

    pool.after_reload = after_reload

    def handle_hup() -> None:
        if peer is not None:  # (the first front-end's to do: it reloads the workers every front-end shares)
            log_signal(logging.INFO, "SIGHUP to front-end %d: ignored (send it to the first front-end, pid %d)",
                       peer.number, os.getppid())
            return
        if stop.is_set():  # (a `systemctl reload` racing a stop: new workers would only be stopped)
            log_signal(logging.INFO, "SIGHUP while stopping: ignored")
            return
        log.info("SIGHUP: reloading the workers (the app is imported anew)")
        status.update(sighups=status.status.sighups + 1)
        pool.request_reload()  # coalesced: one during a reload or the start runs after it

    loop.add_signal_handler(signal.SIGHUP, handle_hup)
    for signum in list(early):  # (received before these handlers: `broker.entry`)
        if signum == signal.SIGHUP:
            handle_hup()
        else:
            handle_stop(signum)

    if logs is not None:  # (the access lines rendered on this loop, in batches; the workers' read: broker/logpipe.py)
        logs.attach(loop, ticks=access is not None)
    # (stdin and stdout moved off descriptors 0 and 1 before a worker starts: `take_stdio`)
    relay = None if stdio is None else stdio.relay()
    try:
        frontends: list[HttpFrontend | StreamFrontend] = []
        scrape = None
        gather = None  # (with several front-ends: each body made from all their series, broker/scrapes.py)
        if config.metrics and peer is not None:  # (its series to the first front-end, which sums them all,
            # and answers with the summed body it sends back: one view on every front-end, broker/peers.py)
            collector = BrokerCollector(dispatcher, None, frontends, config.max_queue, config.max_queue_bytes,
                                        logs.dropped_total if logs is not None else None)
            gather = peer.gather

            def scrape() -> bytes:
                return peer.exposition
        elif config.metrics:
            collector = BrokerCollector(dispatcher, typing.cast(Pool, pool), frontends, config.max_queue,
                                        config.max_queue_bytes, logs.dropped_total if logs is not None else None,
                                        peer_samples=peers.samples if peers is not None else None)
            reg = registry(collector)

            def scrape() -> bytes:
                return exposition(reg)

            if peers is not None:  # (every front-end's scrapes answered from its rounds: `Peers.serve_metrics`)
                rounds = peers.serve_metrics(scrape)
                gather = rounds.gather

                def scrape() -> bytes:
                    return rounds.body

        separate = config.metrics and config.metrics_port != 0 and peer is None
        streams = 0 if stdio else bool(config.stream_port) + bool(config.stream_socket)
        try:
            max_connections = fit_open_files(
                config.max_connections, 1 + streams,
                # the probes' reserve (its places and its overflow); the metrics listener's
                # connections and reserve; connections refused or evicted still being answered, each
                # listener's; per worker its
                # socket and process handle, up to three processes a slot (one that asked to leave
                # drains beside its replacement while a reload's new one starts); listening
                # sockets, logs, /proc reads of a scrape
                RESERVE + (METRICS_CONNECTIONS + RESERVE) * separate + OUT_LINGERING * (1 + streams)
                + 6 * config.worker_count + 64,
            )
        except ConfigError as exc:
            log.error("%s", exc)
            return 2
        # Who may call (issue 9 item 11): the bind addresses are always names of this server.
        hosts = (*config.allowed_hosts, config.host, config.metrics_host)
        incoming = Incoming(config.max_incoming_bytes)  # (one for all the listeners)
        auth = Authenticator(tokens) if tokens else None
        try:
            tls = server_context(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file,
                                 require_client_cert=auth is None)  # (checked by config.load: again, now)
        except TlsError as exc:
            log.error("%s", exc)
            return 2
        health = msgspec.json.encode({"status": "ok", "version": broker.version(), "app": config.app})
        http = _settings(config, "keepalive_timeout request_timeout send_timeout allowed_origins auth_metrics")
        # (front-end, host or socket path, port or None for a Unix socket)
        listeners: list[tuple[HttpFrontend | StreamFrontend, str, int | None]] = []
        if stdio is None:
            frontend = HttpFrontend(
                dispatcher, max_connections=max_connections, gather=gather,
                # (never on the RPC port with a metrics port: a peer's neither; new user, round 112)
                metrics=None if config.metrics_port != 0 else scrape,
                allowed_hosts=hosts, incoming=incoming, auth=auth, health=health,
                mcp_sessions=config.frontend_count == 1,
                **_settings(config, "rpc_path mcp_path max_body_bytes max_batch"), **http,
            )
            listeners.append((frontend, config.host, config.port))
        if separate:
            metrics_frontend = HttpFrontend(
                dispatcher, max_connections=METRICS_CONNECTIONS, metrics=scrape, gather=gather, serve_rpc=False,
                transport="metrics",
                allowed_hosts=hosts, incoming=incoming, auth=auth, health=health, **http,
            )
            listeners.append((metrics_frontend, config.metrics_host, config.metrics_port))
        for transport, where, port_ in (
            ("tcp", config.host, config.stream_port),
            ("unix", config.stream_socket, None),
        ):
            if (port_ if transport == "tcp" else where) and stdio is None and (
                peer is None or transport in peer.listeners):
                stream = StreamFrontend(
                    dispatcher, transport=transport, max_connections=max_connections, incoming=incoming,
                    auth=auth if transport == "tcp" else None,  # (the Unix socket: its file mode)
                    client_certs=bool(config.tls_client_ca_file) and transport == "tcp",
                    **_settings(config, "max_body_bytes max_batch keepalive_timeout send_timeout"),
                )
                listeners.append((stream, where, port_))
        # Bind the TCP listeners before the workers start, so a taken port fails at once
        # rather than after the app is imported in every worker; but listen (accept) only
        # once they are ready: until then a client is refused by the kernel (ECONNREFUSED,
        # which clients retry) instead of being answered before the method table is known
        # (-32601). The Unix socket is only checked now (not a socket, or in use: fail) and
        # bound once the workers are ready: a bound file nobody listens on would look stale
        # to another broker starting on the same path, which would replace it.
        bound: list[asyncio.Server | None] = []
        own_socket: tuple[str, int, int] | None = None  # (path, st_dev, st_ino) of the socket file made

        async def give_up() -> None:
            for server in bound:
                if server is not None:
                    server.close()
            remove_socket(own_socket)
            phase.append("workers")
            if peers is not None:
                await peers.stop(2.0)
            await pool.stop(timeout=2.0, hurry=kill_now)

        def cannot_listen(fe: HttpFrontend | StreamFrontend, where: str, port_: int | None, exc: OSError) -> None:
            hint = ""
            if exc.errno == errno.EADDRINUSE:
                flag = _LISTENER_NAMES[fe.transport].rpartition(" ")[2]
                who = "another process listens there"
                if port_ is not None:  # (round 34: only a connection's local port, in the ephemeral range)
                    who += f", or a connection has it as its local port (ss -tanp 'sport = :{port_}' shows which)"
                hint = f" ({who}: stop it, or choose another with {flag}; under make serve: make serve ARGS=\"{flag} ...\")"
                if config.reuse_port and port_ is not None:  # (new user, round 107: no word of it)
                    hint += " (reuse_port: the broker listening there must set it too, and run as the same user)"
            log.error("cannot listen (%s) on %s: %s%s", _LISTENER_NAMES[fe.transport],
                      where if port_ is None else f"{where}:{port_}", exc, hint)

        for fe, where, port_ in listeners:
            try:
                if port_ is None:
                    check_socket_path(where)
                    bound.append(None)
                elif peer is not None:  # (bound by the first front-end for this one: broker/peers.py)
                    bound.append(await loop.create_server(
                        accepting(fe, tls), sock=peer.listeners[fe.transport], backlog=2048, start_serving=False))
                else:
                    if peers is not None and not config.reuse_port and port_:
                        # (SO_REUSEPORT, which the front-ends share the port by, would let this one bind
                        # beside another broker of the same user listening there, and take part of its
                        # connections: hostile testing, round 126. Not unless reuse_port says so.)
                        _nobody_listens(where, port_)
                    bound.append(await loop.create_server(
                        accepting(fe, tls), where, port_, backlog=2048, start_serving=False,
                        reuse_port=config.reuse_port or peers is not None or None))
            except OSError as exc:
                cannot_listen(fe, where, port_, exc)
                await give_up()
                return 1
        if peers is not None:  # the other front-ends, on sockets of their own bound beside these
            try:
                peers.bind([(fe.transport, server.sockets[0].getsockname()) for (fe, _, _), server in zip(listeners, bound)
                            if server is not None and fe.transport in ("http", "tcp")])
                await peers.start()
            except OSError as exc:
                log.error("cannot start the other front-ends (frontends %d): %s", config.frontend_count, exc)
                await give_up()
                return 1
        if peer is not None:  # (its workers come as the first front-end hands them over)
            peer.attach(loop, typing.cast(Members, pool), lambda: first_gone())
        # A stop signal during the start (an import that takes long) stops at once, as it
        # would later: the workers still importing have nothing to finish.
        # (written once the listeners are bound, not before: a second broker started by
        # mistake, failing on its port, took the file from the running one for good; round 116, M3)
        status.update(state="starting")
        starting = asyncio.ensure_future(pool.start())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not starting.done():
            log_stopping(logging.WARNING, "stop signal while the workers start: start interrupted; stopping them")
            await give_up()
            await asyncio.wait([starting], timeout=5.0)  # returns once `stop` is called
            if starting.done() and not starting.cancelled():
                starting.exception()  # (a worker that failed meanwhile: nothing to report)
            log.info("stopped")
            return 0
        try:
            starting.result()
        except WorkerBootError as exc:
            log.error("%s (%s)", exc, exc.hint)
            await give_up()
            return WORKER_BOOT_ERROR
        except TimeoutError as exc:
            log.error("%s", exc)
            await give_up()
            return 1
        except ConfigError as exc:  # the workers' socket cannot be made (socket_dir)
            log.error("%s", exc)
            await give_up()
            return 2
        unserved = warn_unserved_timeouts(config.method_timeouts, pool.methods or [])
        servers: list[asyncio.Server] = []
        for (fe, where, port_), server in zip(listeners, bound):
            try:
                if server is None:
                    server = await unix_server(loop, fe.protocol, where, int(config.stream_socket_mode, 8),
                                                socket_group(config.stream_socket_group))
                    made = os.stat(where)
                    own_socket = (where, made.st_dev, made.st_ino)
                else:
                    await server.start_serving()  # listen(2) now
                    # uvloop raises nothing when listen(2) fails: it closes the socket, which
                    # then reads None (round 107: two brokers started at once on one port, the
                    # second died on a traceback at the banner rather than "cannot listen").
                    if None in server.sockets:
                        server.close()
                        raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
            except OSError as exc:  # (TCP: bound with SO_REUSEADDR beside a socket not listening yet)
                cannot_listen(fe, where, port_, exc)
                await give_up()
                return 1
            servers.append(server)
            frontends.append(fe)
        dispatcher.outgoing.on_full = lambda: shed_outgoing(dispatcher.outgoing, frontends)
        host, port = servers[0].sockets[0].getsockname()[:2] if servers else ("", 0)
        workers = (f"{pool.size} worker{'s' if pool.size != 1 else ''} (app {config.app}, event loop"
                   f" {config.event_loop}, pid {os.getpid()}"
                   + (f"; {peers.count + 1} front-end processes" if peers is not None else "") + ")")
        face: StdioFrontend | None = None  # stdio's
        if peer is not None:
            peer.serving()
            peer.share(functools.partial(samples, collector) if config.metrics else list)  # (for each `Collect`)
            log.info("front-end %d (pid %d) serving", peer.number, os.getpid())
        elif stdio is None or relay is None:
            _banner(f"rpc-broker: serving JSON-RPC on {_url(host, port, 'https' if tls else 'http')}{config.rpc_path}"
                    f" with {workers}", logs)
            if config.mcp_path:
                _banner(f"rpc-broker: serving MCP (Streamable HTTP) on {_url(host, port, 'https' if tls else 'http')}"
                        f"{config.mcp_path}", logs)
        else:  # (its connection served once the workers are ready: what came before waits in stdin)
            face = stdio.frontend(dispatcher, typing.cast(Pool, pool), config, incoming)  # (stdio: never a peer)
            face.on_lost = lambda: stdio_ended(relay.why)  # (stdio's end stops the broker as SIGTERM does)
            await relay.connect(face.protocol)
            frontends.append(face)
            _banner(f"rpc-broker: serving {stdio.what} on stdin and stdout with {workers}", logs)
            log_listeners(config)
        if (face.mcp if face is not None else config.mcp_path) and not dispatcher.catalog.tools():
            # (new user, round 111: the README's own app served an MCP host no tool, and nothing said so)
            log.warning("MCP serves no tools: app %s marks none (Registry(tools=True), or @registry.method(tool=True);"
                        " rpc-broker check-app lists them)", config.app)
        for fe, server in zip(frontends, servers):
            if peer is not None:  # (the first front-end's banners say where the broker serves)
                break
            if isinstance(fe, StreamFrontend):
                name = server.sockets[0].getsockname()
                # (a relative --stream-socket shown absolute: round 31 showed `unix://relative`)
                shown = (f"unix://{os.path.abspath(name)}" if fe.transport == "unix"
                         else _url(name[0], name[1], "tls" if tls else "tcp"))
                _banner(f"rpc-broker: serving NDJSON JSON-RPC on {shown}", logs)
            elif fe.metrics is not None:
                address = server.sockets[0].getsockname()
                _banner(f"rpc-broker: metrics on {_url(address[0], address[1], 'https' if tls else 'http')}/metrics",
                        logs)
        if config.stream_socket and int(config.stream_socket_mode, 8) & 0o007:
            log.warning("stream_socket_mode %s lets every user of this machine connect to %s and call every tool",
                        config.stream_socket_mode, config.stream_socket)
        exposed = config.host if stdio is None else config.metrics_host  # (stdio: the metrics listener, if any)
        for warning in [*(exposure_warnings(exposed, auth is not None, tls is not None, config.auth_metrics,
                                            bool(config.tls_client_ca_file)) if servers else ()),
                        *secret_file_warnings({"auth_tokens_file": config.auth_tokens_file,
                                               "tls_key_file": config.tls_key_file})]:
            log.warning("%s", warning)
        if auth is not None and (stdio is None or config.auth_metrics):
            names = auth.names
            log.info("bearer tokens asked for on %s: %d (%s%s)", "/metrics" if stdio else config.rpc_path
                     + (f" and {config.mcp_path}" if config.mcp_path else "")
                     + (" and /metrics" if config.auth_metrics else ""), len(names), ", ".join(names[:10]),
                     ", ..." if len(names) > 10 else "")
        if config.tls_client_ca_file:  # (what a certificate does here: it differs with and without tokens)
            log.info("client certificates verified against tls_client_ca_file %s on every TLS listener: %s",
                     config.tls_client_ca_file,
                     "required (no bearer tokens: probes and Prometheus need one too)" if auth is None else
                     "optional (HTTP keeps bearer tokens; on stream_port, one whose subject commonName is a token's"
                     " name authenticates as that token)")
        longest = max([config.timeout, *(t for name, t in config.method_timeouts.items() if name not in unserved)])
        if config.grace_period < longest:  # (round 69's new user: nothing linked the two)
            log.warning("a call's deadline (up to %s s) is longer than grace_period %s s: at a stop or a restart,"
                        " calls still running when the grace period ends are answered -32004 (raise"
                        " grace_period, and the service manager's stop timeout with it)", longest, config.grace_period)
        if config.debug:  # (round 60's new user: nothing said so at the start)
            log.warning("debug is on: error answers carry the handler's traceback to every client"
                        " (never on in production)")
        status.update(state="serving")
        if started is not None:
            started.set_result((host, port))
        await stop.wait()
        if peer is not None:  # (its scrapes waiting for a body answered now)
            peer.stopping()
        # (the other front-ends drain beside this one: the workers are stopped once they are done)
        peers_stopping = asyncio.ensure_future(peers.stop(config.grace_period + 15.0)) if peers is not None else None
        dispatcher.held_back = lambda: sum(fe.held() for fe in frontends)
        log_stopping(logging.INFO, "stopping: no new connections; answering what is in flight (grace %s s)",
                     config.grace_period)
        last = await stop_listening(loop, servers, frontends, face, tls, config.grace_period)
        grace_ends = loop.time() + config.grace_period
        await dispatcher.drain(config.grace_period, hurry)
        if last and peers_stopping is not None and not hurry.is_set():
            # (the metrics listener watches the other front-ends' drain too: new user, round 114,
            # it closed as this one's calls were done, /readyz and /metrics refused meanwhile)
            hurried = asyncio.ensure_future(hurry.wait())
            await asyncio.wait([peers_stopping, hurried], timeout=max(0.0, grace_ends - loop.time()) + 15.0,
                               return_when=asyncio.FIRST_COMPLETED)
            hurried.cancel()
        await close_last(servers, frontends, last, grace_ends - loop.time(), hurry)
        if relay is not None:  # (the last answers on their way to stdout)
            await relay.finish(0.2 if hurry.is_set() else 2.0)
        phase.append("workers")
        if peer is not None:  # (its counts since the last scrape, kept by the first front-end)
            await peer.last_words()
        if peers_stopping is not None:
            await peers_stopping
        await pool.stop(timeout=1.0 if hurry.is_set() else 10.0, hurry=kill_now)
        remove_socket(own_socket)
        if dispatcher.cut_off:  # (issue 12, item 13: the stop's log said nothing of them)
            log.warning("%d call%s cut off by the end of the grace period (answered -32004 \"grace period ended\");"
                        " stopped", dispatcher.cut_off, "s" if dispatcher.cut_off != 1 else "")
        else:
            log.info("stopped")
        return 0
    finally:
        if relay is not None:
            relay.close()
        if logs is not None:
            logs.detach()
        log_held()  # (a stop that ended without its line: the start failed meanwhile)
        status.stopped()  # (its workers stopped, its socket removed: `rpc-broker reload` now says so)
        # The process is ending: another stop or reload signal now has nothing to act on,
        # and must not kill it by signal instead of its exit code (hostile testing, round
        # 25: a SIGTERM just after "stopped" ended it with -15, a failed stop to systemd's
        # SuccessExitStatus=0 and to a supervisor comparing exit codes).
        _ignore_signals(loop)
