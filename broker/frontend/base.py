"""What every front-end listener shares: its connections, limits, counters and closing.

`Listener` is subclassed by `http.HttpFrontend` and `stream.StreamFrontend`; each
adds its protocol factory, its sweep (what "idle too long" means for it) and its drain.
The counters are read by `metrics.BrokerCollector` under the `transport` label.
"""

from __future__ import annotations

import asyncio
import logging
import typing

from broker.dispatch import Dispatcher
from broker.jsonrpc import Codec

__all__ = ["SWEEP_SECONDS", "Connection", "Listener"]

log = logging.getLogger("broker.frontend")

SWEEP_SECONDS = 1.0  # one sweep for all connections of a listener, not a timer each


class Connection(typing.Protocol):
    """What a listener needs of its connections."""

    def close(self) -> None: ...
    def abort(self) -> None: ...


class Listener:
    """Shared state of the connections of one listening socket.

    transport: the metrics' label ("http", "metrics", "tcp", "unix").
    max_connections: connections at once; the subclass decides what happens past it
        (`refused` counts and logs those turned away).
    keepalive_timeout: seconds, for the subclass's sweep.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        transport: str,
        max_body_bytes: int,
        max_batch: int,
        keepalive_timeout: float,
        max_connections: int,
    ) -> None:
        self.dispatcher = dispatcher
        self.transport = transport
        self.codec = Codec(max_batch)
        self.max_body_bytes = max_body_bytes
        self.max_response_bytes = dispatcher.max_response_bytes  # (read per request: one lookup)
        self.keepalive_timeout = keepalive_timeout
        self.max_connections = max_connections
        self.connections: set[typing.Any] = set()  # the subclass's protocol objects
        self.refused_total = 0
        self.received_bytes = 0
        self.sent_bytes = 0
        # HTTP responses by path label, then status: {"rpc": {b"200": 5}}; empty for streams
        self.statuses: dict[str, dict[bytes, int]] = {}
        self.draining = False
        self.loop = asyncio.get_running_loop()
        self._sweeper: asyncio.TimerHandle | None = None

    def refused(self) -> None:
        """Count a connection turned away at max_connections (logged now and then)."""
        self.refused_total += 1
        if self.refused_total == 1 or self.refused_total % 1000 == 0:
            log.warning("%s: max_connections %d reached: refusing connections (%d so far)",
                        self.transport, self.max_connections, self.refused_total)

    def start_sweeping(self) -> None:
        """Start the periodic `_sweep` (once; called by the protocol factory)."""
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(SWEEP_SECONDS, self._sweep_and_rearm)

    def _sweep_and_rearm(self) -> None:
        self._sweep()
        self._sweeper = self.loop.call_later(SWEEP_SECONDS, self._sweep_and_rearm)

    def _sweep(self) -> None:
        """Close connections idle or stalled too long (the subclass says which)."""

    async def wait_closed(self, timeout: float) -> None:
        """Wait up to `timeout` s for connections to finish writing and close; abort
        those still open, and stop sweeping."""
        deadline = self.loop.time() + timeout
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
