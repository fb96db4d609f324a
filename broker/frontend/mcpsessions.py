"""MCP's sessions (revision 2025-11-25), sans-IO: the stdio process's, and HTTP's `Mcp-Session-Id`s (`Sessions`).

Source: the MCP specification 2025-11-25, basic/transports, "Session Management": a server
MAY assign a session id at `initialize` (`Mcp-Session-Id`), a client sends it on every later
request, a request with an id the server no longer knows is answered 404 (and its client
MUST start a new session), DELETE ends one. Revision 2026-07-28 has none.

A session is what a `notifications/cancelled` names a call of the client's within
(`Session.calls`): ids are the client's own, and collide across clients. The table of HTTP
sessions is bounded (`MAX_SESSIONS`), each session idle past `SESSION_IDLE_SECONDS`
forgotten, and each belongs to the client that began it (its token's name, or without
tokens its address: `owner`), which alone may use it: another client's request naming it is
told it does not exist (hostile testing, round 123: one token's client cancelled, used and
ended another's session, given its id). No client's session is ever taken for another's: a
client holds at most `SESSIONS_PER_CLIENT`, past which its own least recently used goes, and
with the table full a new `initialize` gets no session (`begin` None: a session is the
server's option, and its client goes on without one, its calls cancelled by closing their
connection). Round 123: 10,000 `initialize` in half a second evicted every other client's
session, and the official SDK's client does not begin a new one when told 404; round 124:
with the table's least recently used evicted, 11 addresses (or tokens) did it still.
"""

from __future__ import annotations

import collections
import secrets
import time
import typing

__all__ = ["CALLS_PER_SESSION", "MAX_SESSIONS", "SESSIONS_PER_CLIENT", "SESSION_IDLE_SECONDS", "Session", "Sessions"]

MAX_SESSIONS = 10_000
"""HTTP sessions kept at once; past it the least recently used goes (its client, told 404, is to begin
another)."""
SESSIONS_PER_CLIENT = 1_000
"""Sessions one client (a token, or an address) keeps at once; past it, its own least recently used goes."""
CALLS_PER_SESSION = 4096
"""`tools/call`s of a session a `notifications/cancelled` can name at once (`Session.calls`): past it the
oldest is forgotten (its call runs to its end)."""
SESSION_IDLE_SECONDS = 3600.0
"""An HTTP session unused this long is forgotten (its client gets 404 and begins another)."""


class Session:
    """One client's session: the stdio process's, or an HTTP client's `Mcp-Session-Id` (`id`).
    `version`: negotiated by `initialize` ("" before); `owner`: the client that began it;
    `used`: when it was last named, monotonic seconds; `calls`: the front-end's handle of each
    `tools/call` in flight, by raw id (for `notifications/cancelled`)."""

    __slots__ = ("calls", "id", "owner", "used", "version")

    def __init__(self, session_id: str = "", version: str = "", owner: str = "") -> None:
        self.id = session_id
        self.version = version
        self.owner = owner
        self.used = 0.0
        self.calls: dict[bytes, object] = {}


class Sessions:
    """The HTTP sessions: `begin` one for a client, `find` one by id for its client, `end` one.

    max_sessions, per_client, idle: `MAX_SESSIONS`, `SESSIONS_PER_CLIENT`, `SESSION_IDLE_SECONDS`.
    clock: monotonic seconds (injected by tests). Each operation is O(1) amortised (the idle are
    forgotten oldest first as they are met).
    """

    def __init__(self, max_sessions: int = MAX_SESSIONS, per_client: int = SESSIONS_PER_CLIENT,
                 idle: float = SESSION_IDLE_SECONDS, clock: typing.Callable[[], float] = time.monotonic) -> None:
        self._all: collections.OrderedDict[str, Session] = collections.OrderedDict()  # least recently used first
        self._owned: dict[str, collections.OrderedDict[str, None]] = {}  # each client's, alike
        self._max = max_sessions
        self._per_client = per_client
        self._idle = idle
        self._clock = clock

    def __len__(self) -> int:
        return len(self._all)

    def begin(self, owner: str, version: str) -> Session | None:
        """A new session of client `owner` (`Session.id`: 192 random bits, URL-safe), in the room of its
        own least recently used past `SESSIONS_PER_CLIENT`; None when the table is full (no one
        else's is taken)."""
        self._forget_idle()
        owned = self._owned.get(owner)
        if owned is not None and len(owned) >= self._per_client:
            self._drop(next(iter(owned)))
        elif len(self._all) >= self._max:
            return None
        session = Session(secrets.token_urlsafe(24), version, owner)
        session.used = self._clock()
        self._all[session.id] = session
        self._owned.setdefault(owner, collections.OrderedDict())[session.id] = None
        return session

    def find(self, session_id: bytes, owner: str) -> Session | None:
        """Client `owner`'s session by that id, now its most recently used; None for an id of no
        session, of one forgotten or ended, or of another client's."""
        self._forget_idle()
        key = session_id.decode("latin-1")
        session = self._all.get(key)
        if session is None or session.owner != owner:
            return None
        session.used = self._clock()
        self._all.move_to_end(key)
        self._owned[owner].move_to_end(key)
        return session

    def end(self, session_id: bytes, owner: str) -> bool:
        """End client `owner`'s session by that id (HTTP DELETE); whether it was one of its own."""
        if self.find(session_id, owner) is None:
            return False
        self._drop(session_id.decode("latin-1"))
        return True

    def _drop(self, key: str) -> None:
        session = self._all.pop(key)
        owned = self._owned[session.owner]
        del owned[key]
        if not owned:
            del self._owned[session.owner]

    def _forget_idle(self) -> None:
        now = self._clock()
        while self._all:
            oldest = next(iter(self._all.values()))
            if now - oldest.used < self._idle:
                return
            self._drop(oldest.id)
