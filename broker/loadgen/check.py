"""Checks every answer the load generator gets. Sans-IO: (HTTP status, body, `Expect`) in,
counts out; an NDJSON answer line is checked as the body of a 200 (`Checker.check_line`).

Rules (JSON-RPC 2.0 spec sections 5, 5.1 and 6):

* Exactly one answer per call that has an id; none for notifications. Answers are
  matched to calls by their raw id bytes, compared byte for byte (``1.5e3`` is not
  ``1500.0``), as a multiset: an id sent twice (``--ids repeated``) must come back
  twice.
* An answer whose id was never sent is ``wrong_id``; a second answer for an id
  whose answers are used up is ``duplicate``; a call left without any answer is
  ``missing`` (a wrong-id answer stands in for one missing call, so a server that
  mangles one id counts one ``wrong_id``, not also one ``missing``).
* ``malformed``: a body that is not JSON, an answer that is not a Response object
  (``jsonrpc`` not ``"2.0"``, no ``id``, not exactly one of ``result``/``error``, an
  error without an integer ``code`` and string ``message``), an array answering a
  single call or an object answering a batch, an empty array, a status outside
  2xx/4xx/5xx, a 4xx/5xx carrying a result, or a body that answers only
  notifications. Each bad answer counts once; the good ones in the same body are
  still matched.
* A body of only notifications must get an empty body (204, or 200/202 empty).
* Accepted without failure: an error answer with ``"id": null`` to a *single* call
  (the server could not read the id: spec section 5), and one error object with
  ``"id": null`` answering a whole batch (a server refusing the body, e.g. a batch
  over its limit); their codes are counted in ``errors_by_code``, once per answer.
* ``calls`` counts calls *answered*: each call that got its own answer with its id,
  a result or a JSON-RPC error (an error with ``"id": null`` to a single call
  included), plus the notifications of the body (never answered: done once
  written). A call whose answer is missing, carries a wrong id or is malformed is
  not counted: per body, ``min(calls with an id, new wrong_id + missing +
  malformed)`` calls are taken back (a duplicate answer takes none back: its call
  was answered).
* A batch refused whole is counted as a request (it was answered) and in
  ``refused_batches``, but its calls are not counted in ``calls``: none of them ran.
  It is a JSON-RPC error answer like any other, not a failure (a batch of only
  notifications refused whole included: the spec makes the server answer an invalid
  request even when it holds no id).

On a stream the connection first finds the body a line answers (by id, see `stream`), then
checks the line against that body's `Expect` with the same rules; the lines it cannot
tie to any body (wrong id, duplicate, not JSON) it counts itself.
"""

from __future__ import annotations

import typing

import msgspec
from msgspec import Raw

from broker.loadgen.workload import Expect

__all__ = ["MAX_TOOL_ERROR_REASONS", "OTHER_REASONS", "Answer", "Checker", "Tally", "refuses_token"]

MAX_TOOL_ERROR_REASONS = 16  # distinct reasons kept in `Tally.tool_errors` (a bounded label set)
OTHER_REASONS = "(other reasons)"


class Answer(msgspec.Struct, gc=False):
    """A Response object, envelope only (raw `id`, `result`, `error`; empty = absent)."""

    jsonrpc: str = ""
    id: Raw = Raw()
    result: Raw = Raw()
    error: Raw = Raw()


class _ErrorObject(msgspec.Struct, gc=False):
    code: int
    message: str


class Tally:
    """Counters of one load process (all ints; merged by `add`).

    requests / calls: answered request bodies and the calls answered in them (a
        result or an error with the call's id; notifications count once written),
        counted only while recording (`recording` True: after warm-up). A batch
        refused whole is a request but adds no calls; a call left without a right
        answer (missing, wrong id, malformed) adds none either.
    errors_by_code: JSON-RPC error answers by code (while recording).
    refused_batches: batches answered by one error object for the whole body
        (while recording); each also counts once in `errors_by_code`.
    wrong_id / missing / duplicate / malformed: check failures (always counted:
        a wrong answer during warm-up is still wrong).
    transport_errors: requests lost to the transport (reset, closed, timed out,
        refused, unparsable HTTP), always counted.
    resent: HTTP requests sent again on a new connection after the server closed with them
        unanswered between answers (`loadgen.http`), always counted: not lost, but a
        request the server had read may have run twice (POST is not idempotent, RFC 9110
        9.2.2: a server that died with calls in flight shows here, not in transport_errors).
    unauthorized: answers refusing the caller's credentials (while recording): HTTP 401
        (RFC 6750 3.1), or on a stream an error with "id": null about its bearer token
        (the broker's answer to a connection's first line without a good one). Each is
        also counted as the error answer it is.
    first_problem: words for the first failure or transport error ("" if none), so a
        run against the wrong target says why ("connection refused", "HTTP 501 ...").

    MCP (``--mcp``, `broker.loadgen.mcp`):
    tool_errors: CallToolResults with ``isError: true`` by reason (while recording; at
        most `MAX_TOOL_ERROR_REASONS` reasons, the rest under `OTHER_REASONS`). Answered
        calls, counted in ``calls`` too, as JSON-RPC error answers are.
    initialized: 2025-11-25 handshakes completed (``initialize``, then
        ``notifications/initialized`` accepted), one per connection made; sessions:
        those whose ``initialize`` answer gave an ``Mcp-Session-Id``. Always counted.
    protocol_version: the version the calls were sent with ("" before any): 2026-07-28,
        or what the first ``initialize`` negotiated.
    """

    __slots__ = ("calls", "duplicate", "errors_by_code", "first_problem", "initialized", "malformed", "missing",
                 "protocol_version", "recording", "refused_batches", "requests", "resent", "sessions", "tool_errors",
                 "transport_errors", "unauthorized", "wrong_id")

    def __init__(self) -> None:
        self.recording = True
        self.requests = 0
        self.calls = 0
        self.errors_by_code: dict[int, int] = {}
        self.refused_batches = 0
        self.wrong_id = 0
        self.missing = 0
        self.duplicate = 0
        self.malformed = 0
        self.transport_errors = 0
        self.resent = 0
        self.unauthorized = 0
        self.first_problem = ""
        self.tool_errors: dict[str, int] = {}
        self.initialized = 0
        self.sessions = 0
        self.protocol_version = ""

    def problem(self, words: str) -> None:
        """Remember `words` if they describe the run's first problem."""
        if not self.first_problem:
            self.first_problem = words

    @property
    def failures(self) -> int:
        """Sum of the four check-failure counters."""
        return self.wrong_id + self.missing + self.duplicate + self.malformed

    @property
    def errors(self) -> int:
        """Total JSON-RPC error answers."""
        return sum(self.errors_by_code.values())

    def tool_error(self, reason: str, n: int = 1) -> None:
        """Count ``n`` CallToolResults with ``isError: true`` for ``reason``, keeping the
        labels bounded: past `MAX_TOOL_ERROR_REASONS` reasons a new one counts under
        `OTHER_REASONS`."""
        errors = self.tool_errors
        if reason not in errors and len(errors) >= MAX_TOOL_ERROR_REASONS:
            reason = OTHER_REASONS
        errors[reason] = errors.get(reason, 0) + n

    def add(self, other: Tally) -> None:
        """Add `other`'s counters into this one."""
        self.requests += other.requests
        self.calls += other.calls
        for code, n in other.errors_by_code.items():
            self.errors_by_code[code] = self.errors_by_code.get(code, 0) + n
        self.refused_batches += other.refused_batches
        self.wrong_id += other.wrong_id
        self.missing += other.missing
        self.duplicate += other.duplicate
        self.malformed += other.malformed
        self.transport_errors += other.transport_errors
        self.resent += other.resent
        self.unauthorized += other.unauthorized
        for reason, n in other.tool_errors.items():
            self.tool_error(reason, n)
        self.initialized += other.initialized
        self.sessions += other.sessions
        self.protocol_version = self.protocol_version or other.protocol_version
        self.problem(other.first_problem)


_NULL = b"null"
_BEARER_TOKEN = b"bearer token"  # in the broker's refusal of a stream's first line (frontend/stream.py)


def refuses_token(a: Answer) -> bool:
    """Whether the NDJSON answer ``a`` is a refusal of the connection's credentials: an
    error with ``"id": null`` about a bearer token, as the broker answers a TCP stream's
    first line without a token it knows (before it closes the connection)."""
    return bytes(a.id) == _NULL and _BEARER_TOKEN in bytes(a.error).lower()


class Checker:
    """Checks answers into a `Tally` (one per load process; decoders reused)."""

    __slots__ = ("_decode", "_decode_error", "_decode_list", "_decode_one", "tally")

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self._decode = msgspec.json.Decoder(Answer | list[Answer]).decode
        self._decode_one = msgspec.json.Decoder(Answer).decode
        self._decode_list = msgspec.json.Decoder(list[Raw]).decode
        self._decode_error = msgspec.json.Decoder(_ErrorObject).decode

    def check(self, status: int, body: bytes, expect: Expect | Raw) -> None:
        """Check one HTTP answer (status code, whole body) to a body sent with `expect`
        (a `Raw`: the id of a single call, the `Workload.body` fast path)."""
        tally = self.tally
        if status == 401 and tally.recording:  # (one int compare a call: the hot path stays as it was)
            tally.unauthorized += 1
        if tally.first_problem:
            self._check(status, body, expect)
            return
        before = tally.failures
        self._check(status, body, expect)
        if tally.failures != before:
            tally.problem(f"bad answer: HTTP {status}, body {body[:120]!r}")

    def _check(self, status: int, body: bytes, expect: Expect | Raw) -> None:
        tally = self.tally
        if type(expect) is Raw:
            # Fast path: one call, one answer object, status 200.
            if status == 200:
                try:
                    a = self._decode_one(body)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
                else:
                    if (a.jsonrpc == "2.0" and a.id == expect and len(a.error) == 0
                            and len(a.result)):
                        if tally.recording:
                            tally.requests += 1
                            tally.calls += 1
                        return
            expect = Expect(False, (bytes(expect),), 1)
        if not tally.recording:
            self._check_body(status, body, expect)
            return
        tally.requests += 1
        tally.calls += expect.calls
        before = tally.wrong_id + tally.missing + tally.malformed
        self._check_body(status, body, expect)
        self._take_back(expect, before)

    def _take_back(self, expect: Expect, before: int) -> None:
        """Take back from ``calls`` the calls of the body just checked that got no right
        answer: one per wrong_id, missing or malformed counted since ``before``, at most
        one per call with an id (notifications count as done once written)."""
        tally = self.tally
        spoiled = tally.wrong_id + tally.missing + tally.malformed - before
        if spoiled:
            tally.calls -= min(len(expect.ids), spoiled)

    def _check_body(self, status: int, body: bytes, expect: Expect) -> None:
        tally = self.tally
        ids = expect.ids
        klass = status // 100
        if not body:
            if klass != 2:  # (a malformed answer stands in for one call left without one)
                tally.malformed += 1
                tally.missing += max(0, len(ids) - 1)
            else:
                tally.missing += len(ids)
            return
        if klass != 2 and klass != 4 and klass != 5:
            tally.malformed += 1
            tally.missing += max(0, len(ids) - 1)
            return
        try:
            decoded = self._decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._check_slow(klass, body, expect)
            return
        self._check_decoded(klass, decoded, expect)

    def check_line(self, line: bytes, expect: Expect | Raw, decoded: Answer | list[Answer] | None = None) -> None:
        """Check one NDJSON answer line to the body sent with `expect`, as the body of an
        HTTP 200; ``decoded``: the line already decoded by the reader (saves a decode)."""
        tally = self.tally
        before = tally.failures
        if decoded is None:
            self._check(200, line, expect)
        else:
            if isinstance(expect, Raw):
                expect = Expect(False, (bytes(expect),), 1)
            if tally.recording and type(decoded) is Answer and refuses_token(decoded):
                tally.unauthorized += 1
            if tally.recording:
                tally.requests += 1
                tally.calls += expect.calls
                spoiled = tally.wrong_id + tally.missing + tally.malformed
                self._check_decoded(2, decoded, expect)
                self._take_back(expect, spoiled)
            else:
                self._check_decoded(2, decoded, expect)
        if tally.failures != before:
            tally.problem(f"bad answer line: {line[:120]!r}")

    def _check_decoded(self, klass: int, decoded: Answer | list[Answer], expect: Expect) -> None:
        tally = self.tally
        ids = expect.ids
        if type(decoded) is Answer:
            # One call, one answer object.
            if (not expect.batch and len(ids) == 1 and decoded.jsonrpc == "2.0"
                    and bytes(decoded.id) == ids[0]):
                if len(decoded.error) == 0:
                    if len(decoded.result) and klass == 2:
                        return
                    tally.malformed += 1
                    return
                if len(decoded.result) == 0 and self._count_error(decoded.error):
                    return
                tally.malformed += 1
                return
            self._match([decoded], klass, expect)
            return
        answers = typing.cast(list[Answer], decoded)
        if klass == 2 and len(answers) == len(ids) and expect.batch:
            # Fast path: every answer a result, in request order (~0.3 µs a call
            # against ~3 µs for the multiset match).
            for a, id_ in zip(answers, ids):
                if not (len(a.error) == 0 and len(a.result) and bytes(a.id) == id_ and a.jsonrpc == "2.0"):
                    break
            else:
                return
        self._match(answers, klass, expect, array=True)

    def _check_slow(self, klass: int, body: bytes, expect: Expect) -> None:
        """The body did not decode as answers: find the good ones among the bad."""
        tally = self.tally
        try:
            raws = self._decode_list(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Not JSON, or not an array (then it is one malformed answer).
            tally.malformed += 1
            tally.missing += max(0, len(expect.ids) - 1)
            return
        answers: list[Answer] = []
        for raw in raws:
            try:
                answers.append(self._decode_one(raw))
            except (msgspec.DecodeError, msgspec.ValidationError):
                tally.malformed += 1
        bad = len(raws) - len(answers)
        self._match(answers, klass, expect, array=True, already_bad=bad)

    def _count_error(self, error: Raw) -> bool:
        try:
            code = self._decode_error(error).code
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        if self.tally.recording:
            by_code = self.tally.errors_by_code
            by_code[code] = by_code.get(code, 0) + 1
        return True

    def _refused(self, a: Answer, expect: Expect) -> bool:
        """Whether the single object ``a`` answering the batch ``expect`` is one error
        with ``"id": null`` for the whole body (the server refused it, e.g. past its
        batch limit); if so, count it as one error and one refused batch. The calls
        the callers counted on entry for this body are taken back: none of them ran."""
        if not (bytes(a.id) == _NULL and len(a.error) and len(a.result) == 0 and a.jsonrpc == "2.0"
                and self._count_error(a.error)):
            return False
        tally = self.tally
        if tally.recording:
            tally.calls -= expect.calls
            tally.refused_batches += 1
        return True

    def _valid(self, a: Answer, klass: int) -> bool:
        """Shape of one answer; counts its error code. False = malformed."""
        if a.jsonrpc != "2.0" or len(a.id) == 0:
            return False
        if len(a.error) == 0:
            return len(a.result) != 0 and klass == 2
        return len(a.result) == 0 and self._count_error(a.error)

    def _match(self, answers: list[Answer], klass: int, expect: Expect, *, array: bool = False,
               already_bad: int = 0) -> None:
        tally = self.tally
        ids = expect.ids
        if not array and expect.batch and self._refused(answers[0], expect):
            return
        if not ids:
            tally.malformed += max(1, len(answers))  # answers to notifications only
            return
        if array != expect.batch or (array and klass != 2) or (array and not answers and not already_bad):
            # (one malformed answer, standing in for one of the calls: round 26 counted
            # each call both malformed and missing)
            tally.malformed += 1
            tally.missing += max(0, len(ids) - 1)
            return
        left: dict[bytes, int] = {}
        for i in ids:
            left[i] = left.get(i, 0) + 1
        wrong = 0
        bad = already_bad
        for a in answers:
            if not self._valid(a, klass):
                bad += 1
                continue
            key = bytes(a.id)
            n = left.get(key)
            if n is None:
                if key == _NULL and not expect.batch:
                    left[ids[0]] = 0  # spec 5: id null when the server could not read it
                    continue
                wrong += 1
            elif n == 0:
                tally.duplicate += 1
            else:
                left[key] = n - 1
        tally.malformed += bad - already_bad
        unanswered = sum(left.values())
        tally.wrong_id += wrong
        # A wrong-id or malformed answer stands in for one unanswered call.
        tally.missing += max(0, unanswered - wrong - bad)
