"""The daemon's process: wires config, dispatcher, worker pool and front-ends together.

Kept apart from `cli.py` (argument handling) so tests and embedders can start a
broker from a `Config` without going through argv.

Signals (handlers only set an event; the main coroutine acts on it):
    SIGTERM, SIGINT  stop accepting, answer what is in flight (up to grace_period),
                     stop the workers, exit 0; a second one cuts the grace period short
    SIGHUP           rolling restart of the workers (`Pool.reload`): each is replaced by a
                     fresh process that imports the app anew; no call is lost
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from broker.config import Config
from broker.dispatch import Dispatcher
from broker.frontend.http import HttpFrontend
from broker.metrics import BrokerCollector, CallMetrics, exposition, registry
from broker.pool import Pool, WorkerBootError
from broker.worker import WORKER_BOOT_ERROR

__all__ = ["run", "serve"]

log = logging.getLogger("broker")


def serve(config: Config) -> int:
    """Run the broker until SIGTERM/SIGINT; return the process exit status.

    0 after a clean shutdown, `WORKER_BOOT_ERROR` (3) when the workers cannot load
    the app, 1 when the listening socket cannot be opened.
    """
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s broker pid %(process)d %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    import uvloop

    return uvloop.run(run(config))


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def fit_open_files(max_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard limit so `max_connections` client
    sockets fit (plus 64 for the listener, worker sockets and logs), as nginx's
    worker_rlimit_nofile does; return the connection limit that really fits."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    fits = max_connections if soft == resource.RLIM_INFINITY else min(max_connections, soft - 64)
    if fits < max_connections:
        log.warning("open-files limit %d allows %d connections, not max_connections %d", soft, fits, max_connections)
    return max(1, fits)


async def run(config: Config, started: asyncio.Future[tuple[str, int]] | None = None) -> int:
    """The broker's main coroutine; sets `started` to the bound (host, port) once ready."""
    loop = asyncio.get_running_loop()
    dispatcher = Dispatcher(
        loop,
        max_queue=config.max_queue,
        max_queue_bytes=config.max_queue_bytes,
        timeout=config.timeout,
        method_timeouts=config.method_timeouts,
        cancel_grace=config.cancel_grace,
        metrics=CallMetrics() if config.metrics else None,
    )
    pool = Pool(
        dispatcher,
        size=config.worker_count,
        app=config.app,
        concurrency=config.worker_concurrency,
        max_depth=config.max_depth,
        max_frame_bytes=config.max_frame_bytes,
        restart_backoff_max=config.restart_backoff_max,
        socket_dir=config.socket_dir,
        debug=config.debug,
        log_level=config.log_level,
    )
    stop = asyncio.Event()
    hurry = asyncio.Event()

    def handle_stop() -> None:
        if stop.is_set():
            log.warning("second stop signal: answering what is left with 'shutting down' now")
            hurry.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle_stop)
    loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP while starting: ignored")
    reloads: set[asyncio.Task[bool]] = set()

    def handle_hup() -> None:
        log.info("SIGHUP: rolling restart of the workers")
        task = loop.create_task(pool.reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    try:
        try:
            await pool.start()
        except WorkerBootError as exc:
            log.error("%s", exc)
            await pool.stop(timeout=2.0)
            return WORKER_BOOT_ERROR
        except TimeoutError as exc:
            log.error("%s", exc)
            await pool.stop(timeout=2.0)
            return 1
        frontends: list[HttpFrontend] = []
        scrape = None
        if config.metrics:
            collector = BrokerCollector(dispatcher, pool, frontends, config.max_queue)
            reg = registry(collector)

            def scrape() -> bytes:
                return exposition(reg)

        separate = config.metrics and config.metrics_port != 0
        frontend = HttpFrontend(
            dispatcher,
            rpc_path=config.rpc_path,
            max_body_bytes=config.max_body_bytes,
            max_batch=config.max_batch,
            keepalive_timeout=config.keepalive_timeout,
            max_connections=fit_open_files(config.max_connections),
            metrics=None if separate else scrape,
        )
        frontends.append(frontend)
        servers: list[asyncio.Server] = []
        listeners = [(frontend, config.host, config.port)]
        if separate:
            metrics_frontend = HttpFrontend(
                dispatcher, max_connections=64, metrics=scrape, serve_rpc=False,
                keepalive_timeout=config.keepalive_timeout,
            )  # fmt: skip
            frontends.append(metrics_frontend)
            listeners.append((metrics_frontend, config.metrics_host, config.metrics_port))
        for fe, bind_host, bind_port in listeners:
            try:
                servers.append(await loop.create_server(fe.protocol, bind_host, bind_port, backlog=2048))
            except OSError as exc:
                log.error("cannot listen on %s:%s: %s", bind_host, bind_port, exc)
                for server in servers:
                    server.close()
                await pool.stop(timeout=2.0)
                return 1
        host, port = servers[0].sockets[0].getsockname()[:2]
        print(
            f"rpc-broker: serving JSON-RPC on {_url(host, port)}{config.rpc_path}"
            f" with {pool.size} worker{'s' if pool.size != 1 else ''} (app {config.app})",
            file=sys.stderr,
            flush=True,
        )
        if config.metrics:
            where = servers[-1].sockets[0].getsockname()[:2]
            print(f"rpc-broker: metrics on {_url(*where)}/metrics", file=sys.stderr, flush=True)
        loop.add_signal_handler(signal.SIGHUP, handle_hup)
        if started is not None:
            started.set_result((host, port))
        await stop.wait()
        log.info("stopping: no new connections; answering what is in flight (grace %s s)", config.grace_period)
        for server in servers:
            server.close()
        for fe in frontends:
            fe.drain()
        await dispatcher.drain(config.grace_period, hurry)
        for fe in frontends:
            await fe.wait_closed(timeout=0.2 if hurry.is_set() else 2.0)
        await pool.stop(timeout=1.0 if hurry.is_set() else 10.0)
        log.info("stopped")
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
