"""An HTTP connection's state as the modules of its methods see it (`HttpState`), for the type checker.

`http.HttpProtocol` holds the state (its `__slots__`, made by its `__init__`) and inherits
the methods of broker/frontend/httprequest.py (`Requests`: the parser's callbacks and the
routing of a request), broker/frontend/httpanswer.py (`Answers`: the answers, in order,
and the close) and broker/frontend/httpevict.py (`Eviction`: whether and how it gives its
place), mixins with no state of their own. They subclass `HttpState`, which declares
what they read of the connection and of one another's methods, once; at run time it is an
empty class, with empty `__slots__` (so that the connection keeps no `__dict__`).
"""

from __future__ import annotations

import enum
import typing

from broker.frontend.connection import Connection

if typing.TYPE_CHECKING:
    import asyncio
    from collections import deque

    import httptools

    from broker.answers import Exchange, ResponseBudget
    from broker.frontend.httplistener import HttpFrontend
    from broker.frontend.httpowed import Deferred, Owed
    from broker.frontend.httprequest import _Request
    from broker.jsonrpc import ErrorCode
    from broker.ratelimit import Bucket

__all__ = ["Close", "HttpState"]


class Close(enum.IntEnum):
    """How an HTTP connection ends (`HttpProtocol._close`), once what it is owed is written.

    KEEP: open for the next request (keep-alive). 0, so that `if self._close:` reads
        "closing" (one test on the hot path, as the flag it replaces).
    CLOSE: no request is read any more, what the client still sends is discarded; closed
        after the answers owed (an answer without keep-alive, a refusal, the stop).
    LINGER: as CLOSE, but the answer is followed by a half-close, reading on and
        discarding for at most LINGER_TIMEOUT silent (nginx's lingering close): the
        client may still be sending a request answered before it was read (400, 408,
        413, 431, 503, a refused `Expect: 100-continue`, an Upgrade), and a close with
        its bytes unread would reset the connection and cut the answer.

    It only goes forward: KEEP to CLOSE or LINGER, CLOSE to LINGER (a close decided
    first, `self._close or Close.CLOSE`, leaves LINGER as it is).
    """

    KEEP = 0
    CLOSE = 1
    LINGER = 2


class HttpState(Connection):
    """What `http.HttpProtocol`'s mixins read of its state and of one another's methods."""

    if typing.TYPE_CHECKING:
        _auth_value: bytes | None
        _backlog: bytes
        _budget: ResponseBudget
        _busy: Exchange | None
        _close: Close
        _bucket: Bucket | None
        _denied: typing.AbstractSet[str]
        _eof: bool
        _fe: HttpFrontend
        _framing: int
        _head_bytes: int
        _head_done: bool
        _incoming: int
        _keep_header: bytes
        _one_by_one: bool
        _parser: httptools.HttpRequestParser
        _parsing: bool
        _probe_only: bool
        _read_at: float
        _request: _Request
        _responses: deque[Owed]
        _scraped: int
        _stuck_since: float
        _transport: asyncio.Transport | None
        _unread: int
        _unsent: int
        _upgrade: tuple[bytes, bytes] | None
        _waiting: deque[Deferred]
        _waiting_bytes: int
        _write_paused: bool
        accepted_at: float
        caller: str
        last_active: float
        lingering_since: float
        read_paused: bool
        request_started: float
        requests: int
        scrape_waiting: bool
        send_stalled: float
        sent: int

        # http.HttpProtocol's
        @property
        def owed(self) -> int: ...
        def _framing_check(self) -> None: ...

        # httprequest.Requests'
        def _gated(self) -> bool: ...
        def _may_call(self) -> bool: ...
        def _path_of(self, url: bytes) -> str: ...

        # httpanswer.Answers'
        def _answer(self, exchange: Exchange) -> tuple[bytes, bool]: ...
        def _answer_and_close(self, status: int, message: bytes) -> None: ...
        def _discarding(self) -> None: ...
        def _drop_unfinished(self) -> None: ...
        def _exchange_done(self, exchange: Exchange) -> None: ...
        def _flush_ready(self) -> None: ...
        def _head_request(self) -> bool: ...
        def _queue(self, response: bytes, keep_alive: bool, path: str) -> None: ...
        def _queue_invalid(self, status: int, data: str, keep_alive: bool, path: str, cors: bytes = b"") -> None: ...
        def _queue_plain(
            self, status: int, message: bytes, keep_alive: bool, path: str, extra: bytes = b"", head: bool = False
        ) -> None: ...
        def _refuse_body(
            self, status: int = 413, body: bytes | None = None, code: int = ErrorCode.INVALID_REQUEST
        ) -> None: ...
        def _write(self, data: bytes, keep_alive: bool, path: str) -> None: ...
        def scrape_built(self) -> None: ...  # (and the listener's: `HttpFrontend.wait_scrape`)

        # httpevict.Eviction's
        def _claim_place(self) -> None: ...
    else:
        # (At run time only: to mypy, a class whose bases all declare `__slots__` may assign
        # no attribute but theirs, and the mixins' attributes are `HttpProtocol`'s slots.)
        __slots__ = ()
