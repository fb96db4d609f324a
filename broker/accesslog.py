"""The access log: one line per JSON-RPC call answered (`AccessLog`), its fields, their rendering (`Renderer`), and the redaction of its params.

Theory of operation
-------------------
The dispatcher counts every answer it makes in `CallMetrics`; beside each count it hands
the same answer to an `AccessLog` (`Dispatcher.access` for errors, `Dispatcher.access_ok`
for results too), which is None when no line is wanted: with `access_log = "errors"` and
every call a success the hot path pays one `is not None` test per result, and nothing
else. A line is one call with an id (a request; a batch's element; never a notification,
which has no answer to report, nor an HTTP request as a whole). A call whose client left before
its answer, dropped from the queue or cancelled in its worker (`queueing.Queueing._drop`), has its
line then, `abandoned` (`ABANDONED`): every call with an id gets exactly one.

On the event loop's thread a line is only captured, as a plain tuple (an *entry*, laid
out as `ENTRY_FIELDS`) of values that do not change afterwards: the time, the connection's
peer as the transport gave it (a tuple, made into text later), the token's name, the
transport, the method's name, the client's raw id copied out of the request body (at most
`ID_BYTES` + 1 bytes: one more says it was longer), the duration, the code, the worker's
pid and the params kept (or None). No `logging.LogRecord`, no lock, no formatting: the
logging module's machinery (`Logger.isEnabledFor`, a `LogRecord`, a handler's lock, a
`queue.Queue`'s condition) and the ISO time and quoting of each field cost 2 to 7 us a
line, as much as the rest of a call's dispatch (measured: benchmarks/RESULTS.md, "Access
log cost"). The results of one batch chunk are one entry: its fields `method` and `id`
are lists, a line each. The entry goes to `emit` (`logpipe.LogPipe.access`: a list's
append, rendered every 50 ms in a batch and handed to a writer thread), which never blocks.

A batch of entries is turned into text (`Renderer.lines`: escaped, redacted, as text or
JSON) with what repeats cached: the second's time stamp, the peer's address, the quoted
token, transport and method names, the outcome names.

What an attacker controls is bounded and escaped: the method is the registered name or
"other" (never the string sent), the id at most `ID_BYTES` of its raw JSON, the params at
most `PARAMS_KEPT_BYTES` kept and `PARAMS_CHARS` written, their redaction's walk at most
`REDACT_VALUES` values and `KEY_CHARS` of a key (it runs on the loop); in text every value that is not
plain printable ASCII is quoted with JSON's escapes, so no control character, newline or
quote of a client's reaches the line as itself (a line cannot be forged).
"""

from __future__ import annotations

import functools
import json
import re
import struct
import time
import typing
import unicodedata
from collections.abc import Callable

import msgspec

from broker.catalog import DISCOVER
from broker.chunk import read_call
from broker.floats import decode_json
from broker.metrics import outcome_name
from broker.wire import RESULT

if typing.TYPE_CHECKING:
    from broker.answers import ResponseBudget
    from broker.calls import Call
    from broker.jsonrpc import Request

__all__ = [
    "ABANDONED", "ENTRY_FIELDS", "FLUSH_PARAMS_BYTES", "FLUSH_VALUES", "ID_BYTES", "KEY_CHARS", "MODES", "OUTCOME_ABANDONED", "PARAMS_CHARS", "PARAMS_KEPT_BYTES", "REDACTED", "REDACT_VALUES", "SECRET_ENDINGS", "SECRET_KEYS", "SECRET_WORDS",
    "UNSHOWN", "AccessLine", "AccessLog", "Entry", "Renderer", "address", "entry_lines", "escape_unshown", "json_line",
    "keep_params", "redact", "secret_key",
]  # fmt: skip

MODES = ("off", "errors", "all")  # the access_log setting's values
ABANDONED = 1 << 53
"""The `code` of an entry for a call its client left before its answer (`Dispatcher.abandon`, or an
MCP tools/call cancelled: `Dispatcher.cancel`), dropped from the queue or cancelled in flight:
written `outcome=abandoned code=-`, as `rpc_broker_calls_abandoned` counts it. No answer's code:
an application's are within +-(2**53 - 1) (broker/worker/sdk.py), the broker's -32700..-32000."""
OUTCOME_ABANDONED = "abandoned"
ID_BYTES = 64  # of a client's raw id, kept for its line (longer ones end in "...")
PARAMS_KEPT_BYTES = 4096  # params longer than this are not kept for the log (their size is written)
PARAMS_CHARS = 1024  # of the redacted params' JSON written (longer ends in "...")
REDACTED = "[redacted]"
# Keys whose values are never logged (`secret_key`): a key read as its words (`_ascii`, `_WORD`:
# compatibility forms decomposed, NFKD, and accents dropped; runs of ASCII letters and digits,
# cut where a capital begins a word and between letters and digits; lower case: "X-Api-Key",
# "accessKeyId", a fullwidth "PASSWORD" and "tökén" as x api key, access key id, password, token)
# whose words joined ("folded": "xapikey") contain one of SECRET_KEYS or end in one of
# SECRET_ENDINGS, or one of whose words is one of SECRET_WORDS (short names, which as parts of
# a word are in too many others: otp in "footprint", pin in "shipping"); and a key longer than
# KEY_CHARS, unread. Wider than any list of names on purpose: a key logged redacted by mistake
# costs a line's detail ("monkey", "author", "random_seed"), a secret logged costs the secret
# (hostile testing, round 117: clientSecret, accessToken, x-api-key, db_password, privateKey
# and the like were logged; later, pw, otp, creds, mnemonic, seedPhrase, dsn, cvv, iban...; new
# users, round 109: credit_card, cc_number, account_number, verification_code, hmac, salt...).
SECRET_KEYS = frozenset({
    "password", "passwd", "passphrase", "passcode", "pincode", "secret", "token", "auth", "cookie", "session",
    "credential", "creds", "bearer", "signature", "jwt", "apikey", "privatekey", "privkey", "accesskey",
    "mnemonic", "seedphrase", "recoverycode", "backupcode", "mfacode", "otpcode",
    "connectionstring", "databaseurl", "dburl", "cardnumber", "creditcard", "ccnumber", "accountnumber",
    "verificationcode", "accesscode", "securityanswer", "connstr",
})  # fmt: skip
SECRET_WORDS = frozenset({
    "pass", "pwd", "pw", "pin", "sig", "otp", "totp", "hotp", "seed", "csrf", "xsrf", "dsn", "cvv", "cvc", "ssn",
    "iban", "hmac", "jwk", "salt",
})  # fmt: skip
SECRET_ENDINGS = ("key", "keys")  # ("apiKey", "ssh_keys", "keys"; "keyboard" and "keyId" are not)
# Characters of a key read, at most: a longer key is taken for a secret without reading it. The
# work is on the event loop, and NFKD makes up to 18 characters of one (U+FDFA): hostile testing,
# a key of 1,358 of them normalized (NFKC then) cost 2.6 ms, a 1 MiB batch of such calls stalled
# the loop 1.3 s. Past 64 characters a key is rarely a name someone chose. A shorter key with
# such characters counts its length against REDACT_VALUES (`_key_cost`).
KEY_CHARS = 64
REDACT_VALUES = 256  # of params' decoded values walked for redaction, at most (past it none is written)
# Of values walked for the lines rendered at once (`Renderer.lines`: the loop's batch of 50 ms), at
# most: past them a line's params are not written. Each call's walk is bounded, but not a batch of
# calls (hostile testing, round 119: 1 MB batches of calls each with 250 distinct keys stalled
# the loop 0.8 s each); 4,096 values cost the loop about 10 ms a batch.
FLUSH_VALUES = 4096
# And of params' bytes decoded and encoded for them, at most, objects or not: a value's cost is
# not its count (hostile testing, round 121: an integer of 4,090 digits, 340 us a line, in 1 MiB
# batches stalled the loop 1.2 s). At the worst shapes' 80 ns a byte, 256 KiB cost about 20 ms.
FLUSH_PARAMS_BYTES = 256 * 1024
OTHER = "other"  # the method of a call to a method not registered (as the metrics' label)
# An entry's fields, in order (a chunk's results: method and id are lists of the same length)
ENTRY_FIELDS = ("when", "peer", "token", "transport", "method", "id", "duration", "code", "pid", "params")
Entry = tuple[float, object, str, str, str | list[str], bytes | list[bytes], float, int, int, bytes | int | None]
_encode = msgspec.json.Encoder().encode
# An id written as it is: printable ASCII but space, '"', '=' and '\' (`_plain`); or a string of such
# characters and spaces, written JSON-quoted with its two quotes escaped
_PLAIN_ID = re.compile(rb"[\x21\x23-\x3c\x3e-\x5b\x5d-\x7e]+").fullmatch
_PLAIN_STRING_ID = re.compile(rb'"([\x20\x21\x23-\x5b\x5d-\x7e]*)"').fullmatch
_MILLIS = tuple(f".{ms:03d}Z" for ms in range(1000))  # a time stamp's end, by its millisecond
_CACHED = 4096  # peers (and quoted names) remembered by a `Renderer`, at most (then forgotten, all at once)


def address(peer: object) -> str:
    """A transport's "peername" as the line names it: host:port, [v6 host]:port, "unix" for
    a Unix socket's ("" or None), "stdio" for stdio's, "-" when unknown."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return "unix" if peer == "" or peer is None else "stdio" if peer == "stdio" else "-"


def secret_key(key: str) -> bool:
    """Whether values under `key` are redacted (see SECRET_KEYS): a key longer than
    KEY_CHARS always, unread; another by its words (`_secret_name`)."""
    return len(key) > KEY_CHARS or _secret_name(key)


_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+").findall  # ("APIKey2": API, Key, 2)
_NOT_ALNUM = bytes(b for b in range(128) if not chr(b).isalnum()) + bytes(range(128, 256))  # (deleted by bytes.translate)
# Combining marks (the common blocks of them): an accent NFKD took off its letter, dropped so
# that "é" reads as "e"; any other character not ASCII parts words, as punctuation does
_MARKS = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]+").sub


def _ascii(key: str) -> str:
    """`key` as its words are read (see SECRET_KEYS): itself when ASCII (its own NFKD), else
    NFKD, accents dropped, "?" for any other character not ASCII. The cost is NFKD's, at
    most 18 characters made of one (U+FDFA: 10 us for 62 of them, where NFKC, composing
    again, took 70 us, and a Python loop over its result 80); the rest is passes in C."""
    if key.isascii():
        return key
    key = key.replace("\xdf", "ss").replace("\u1e9e", "SS")  # (sharp s: the one letter casefold makes ASCII, NFKD not)
    return _MARKS("", unicodedata.normalize("NFKD", key)).encode("ascii", "replace").decode()


@functools.lru_cache(maxsize=4096)  # (keys of at most KEY_CHARS: a few hundred bytes each held)
def _secret_name(key: str) -> bool:
    """Whether `key` (at most KEY_CHARS) names a secret (see SECRET_KEYS)."""
    text = _ascii(key)
    folded = text.encode().lower().translate(None, _NOT_ALNUM).decode()
    if folded.endswith(SECRET_ENDINGS) or _SECRET_PART(folded) is not None:
        return True
    # A short name counts only as a whole word: a key split into words only when one is in it
    # at all (about 0.1 us a word: 6 us for the 56 of 64 characters alternating letters and
    # digits, the costliest keys to read: about 0.7 ms a call of 4 KiB of such keys)
    return _SHORT_PART(folded) is not None and not _SHORT_WORDS.isdisjoint(_WORD(text))


_SECRET_PART = re.compile("|".join(sorted(SECRET_KEYS))).search
_SHORT_PART = re.compile("|".join(sorted(SECRET_WORDS))).search
# SECRET_WORDS as `_WORD` finds them, in each case a word has (pin, Pin, PIN): none lowered
_SHORT_WORDS = frozenset(form for word in SECRET_WORDS for form in (word, word.capitalize(), word.upper()))


def _key_cost(key: str) -> int:
    """What reading a non-ASCII `key` counts against REDACT_VALUES beside its value: its
    length when it is not in NFKC form (compatibility characters, as fullwidth letters and
    ligatures: those NFKD makes many characters of), else nothing (a name in any script as
    typed; a key past KEY_CHARS, not read)."""
    return 0 if len(key) > KEY_CHARS or unicodedata.is_normalized("NFKC", key) else len(key)


class _TooMany(Exception):
    """More than REDACT_VALUES values to walk."""


# Characters no line shows as they are (text or JSON): C0 (JSON escapes those), DEL and C1 (a
# terminal's escape sequences: U+009B is CSI), the line and paragraph separators and U+0085 that
# str.splitlines and log viewers take for line ends (hostile testing, round 117), and the invisible
# and bidirectional formatting characters that hide text or reorder what a terminal shows: soft
# hyphen, combining grapheme joiner, Arabic letter mark, Hangul fillers, zero-width ones, RLO and
# its kin, isolates, variation selectors, BOM, interlinear annotation, tags (rounds 121 and 122).
UNSHOWN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u034f\u061c\u115f\u1160\u180e\u200b-\u200f"
                     "\u2028-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb"
                     "\U000e0000-\U000e007f]")


def escape_unshown(text: str, escape: typing.Callable[[str], str]) -> str:
    """`text` with each of its `UNSHOWN` characters written `escape(char)`: each distinct one
    replaced everywhere at once, a pass in C (a substitution calling Python for each cost 50 ms
    of the event loop for 64 KiB of DEL: hostile testing, round 120)."""
    for char in set(UNSHOWN.findall(text)):
        text = text.replace(char, escape(char))
    return text


def _json_escape(char: str) -> str:
    """`char` as a JSON string's escape (RFC 8259 7: past U+FFFF, its UTF-16 surrogate pair)."""
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def json_line(encoded: bytes) -> str:
    """A JSON object's text as one line that shows as it is: its `UNSHOWN` characters, which
    JSON leaves as they are but for C0, escaped (`\\uNNNN`; a client's id or params, a
    worker's text, with U+2028 cut the line for a reader splitting lines there, with U+009B
    or U+202E moved the cursor or reordered the line in a terminal: hostile testing, rounds
    117 and 122). A pass in C (the text itself back when it is ASCII with no DEL)."""
    text = encoded.decode()
    if text.isascii() and "\x7f" not in text:
        return text
    return escape_unshown(text, _json_escape)


def redact(value: object, budget: list[int] | None = None) -> object:
    """`value` (decoded JSON) with the value under every key that `secret_key` names
    replaced by `REDACTED`, in nested objects and in lists too. A new value; `value` is not
    changed. `budget`: [values left to walk], raises _TooMany past it (`_params_text`); each
    key counts one there too, and a non-ASCII key its `_key_cost`, before any key of its
    object is read."""
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooMany
    if type(value) is dict:
        if budget is not None:  # (keys charged before any is read: a params' NFKD work bounded)
            # (each key one more: a key named like a secret is not walked, and 350 distinct ones
            # charged nothing, 1 ms a line; hostile testing, round 120, stalled the loop 2.2 s)
            budget[0] -= len(value)
            for key in value:
                if not key.isascii():
                    budget[0] -= _key_cost(key)
            if budget[0] < 0:
                raise _TooMany
        return {key: REDACTED if len(key) > KEY_CHARS or _secret_name(key) else redact(item, budget)
                for key, item in value.items()}  # (`secret_key` inline: a call less a key)
    if type(value) is list:
        return [redact(item, budget) for item in value]
    return value


def keep_params(params: bytes | memoryview | msgspec.Raw, calls: int = 1) -> bytes | int:
    """What the log keeps of a call's raw params (of a chunk's `calls`: their CALL_ENTRY
    payload): a copy of them, or their size when they are longer than `PARAMS_KEPT_BYTES`
    a call (a request body is not kept alive for its log line)."""
    size = len(params)
    return bytes(params) if size <= PARAMS_KEPT_BYTES * calls else size


def _params_text(kept: bytes | int | None, left: list[int] | None = None) -> str:
    """The params as the line writes them: redacted JSON, at most PARAMS_CHARS characters.
    `left`: [values the lines rendered at once may still walk (`FLUSH_VALUES`), and bytes of
    params they may still decode (`FLUSH_PARAMS_BYTES`)], charged what this took; past
    either, params are not written."""
    if kept is None:
        return "-"
    if isinstance(kept, int):
        return f"({kept} bytes, not kept)"
    if not kept:
        return "-"  # (none sent)
    if left is not None:
        if left[0] <= 0 or left[1] < len(kept):
            return (f"({len(kept)} bytes, not written: {FLUSH_VALUES} values or {FLUSH_PARAMS_BYTES} bytes of params"
                    " for the lines of this moment)")
        left[1] -= len(kept)
    try:
        if b"{" in kept:  # (no object, no key: nothing to redact, nothing walked)
            budget = [REDACT_VALUES]
            try:
                text = _encode(redact(decode_json(kept), budget)).decode()  # (floats by float(): round 139)
            finally:
                if left is not None:
                    left[0] -= REDACT_VALUES - budget[0]
        else:
            text = _encode(decode_json(kept)).decode()
    except (msgspec.DecodeError, RecursionError):  # (nested past msgspec's limit)
        return f"({len(kept)} bytes, not decoded)"
    except _TooMany:  # (a line's redaction on the loop bounded: round 117, 0.8 ms a line of 1,364 values)
        return f"({len(kept)} bytes, more than {REDACT_VALUES} values: not written)"
    return text if len(text) <= PARAMS_CHARS else text[:PARAMS_CHARS] + "..."


def _plain(text: str) -> bool:
    """Whether `text` may go into a text line unquoted: printable ASCII, no space, quote or '='."""
    return bool(text) and text.isascii() and text.isprintable() and not any(c in text for c in ' "=\\')


def _quoted(text: str) -> str:
    """`text` as a logfmt value: as is when plain, else a JSON string (ASCII, every control
    character and quote escaped)."""
    return text if _plain(text) else json.dumps(text)  # (ensure_ascii: U+2028 and the like escaped too)


def _kept_id(id_: bytes | memoryview | msgspec.Raw) -> bytes:
    """A copy of a raw id for its line: at most ID_BYTES + 1 bytes (more than ID_BYTES: truncated)."""
    return bytes(id_) if len(id_) <= ID_BYTES else bytes(memoryview(id_)[: ID_BYTES + 1])


def _id_text(id_: bytes, truncated: bool) -> str:
    """An id's text as a line shows it (not yet quoted): "-" for none, "..." after a truncated one."""
    text = id_.decode("utf-8", "backslashreplace") if id_ else "-"
    return text + "..." if truncated else text


class AccessLine(typing.NamedTuple):
    """One call's line, as the tests and `entry_lines` read it.

    when: time.time() of the answer (s); client: `address` of its connection's peer; token:
    its caller's token name ("" for none); transport: "http", "tcp", "unix" or "stdio"; method: the
    registered name or "other"; id: up to ID_BYTES of the raw id (bytes; b"" when none could
    be read); truncated: the id was longer; duration: seconds from arrival to answer; code: 0
    for a result, else the error's code; pid: of the worker that ran it, 0 if none did;
    params: what `keep_params` kept (None when params are not logged).
    """

    when: float
    client: str
    token: str
    transport: str
    method: str
    id: bytes
    truncated: bool
    duration: float
    code: int
    pid: int
    params: bytes | int | None

    def render(self, fmt: str) -> str:
        """The line, no newline: logfmt (`fmt` "text") or one JSON object ("json")."""
        return Renderer(fmt).line(self.when, self.client, self.token, self.transport, self.method, self.id,
                                  self.truncated, self.duration, self.code, self.pid, self.params)


def entry_lines(entry: Entry) -> list[AccessLine]:
    """The lines of an entry (one, or a chunk's results one each), as `AccessLine`s."""
    when, peer, token, transport, method, id_, duration, code, pid, params = entry
    client = address(peer)
    pairs: typing.Iterable[tuple[str, bytes]] = (
        zip(method, typing.cast(list[bytes], id_)) if isinstance(method, list) else [(method, typing.cast(bytes, id_))]
    )
    return [AccessLine(when, client, token, transport, m, i[:ID_BYTES], len(i) > ID_BYTES, duration, code, pid,
                       params) for m, i in pairs]


class Renderer:
    """Turns entries into lines (`entry`; `lines`, a batch of them): logfmt (`fmt` "text":
    key=value, quoted where needed) or one JSON object a line ("json"). Keeps what repeats:
    the current second's time stamp, the peers' addresses and the quoted names (a few
    thousand at most: `_CACHED`), so a common line costs one f-string."""

    __slots__ = ("_fast", "_heads", "_json", "_left", "_outcomes", "_peers", "_second", "_stamp", "_tails")

    def __init__(self, fmt: str = "text") -> None:
        if fmt not in ("text", "json"):
            raise ValueError(f"log_format = {fmt!r}: it must be text or json")
        self._json = fmt == "json"
        self._second: int | None = None
        self._stamp = ""
        self._peers: dict[object, str] = {}
        self._heads: dict[tuple[str, str, str, str], str] = {}  # client= ... method=, by those four
        self._fast: dict[tuple[object, str, str, object], str] = {}  # the same, by the peer as given
        self._tails: dict[tuple[int, int], str] = {}  # outcome= code= pid=, by code and pid
        self._outcomes: dict[int, str] = {}
        # values and bytes the params of the lines of one `lines` may walk and decode (`_params_text`)
        self._left = [FLUSH_VALUES, FLUSH_PARAMS_BYTES]

    def entry(self, entry: Entry) -> list[str]:
        """The lines of `entry` (one; a chunk's results: one each), no newlines."""
        when, peer, token, transport, method, id_, duration, code, pid, params = entry
        try:
            client = self._peers[peer]
        except (KeyError, TypeError):  # (TypeError: a peer that cannot be hashed)
            client = address(peer)
            if len(self._peers) >= _CACHED:
                self._peers.clear()
            try:
                self._peers[peer] = client
            except TypeError:
                pass
        if isinstance(method, list):
            line = self.line
            return [
                line(when, client, token, transport, m, i, False, duration, code, pid, params) if len(i) <= ID_BYTES
                else line(when, client, token, transport, m, i[:ID_BYTES], True, duration, code, pid, params)
                for m, i in zip(method, typing.cast(list[bytes], id_))
            ]  # fmt: skip
        raw = typing.cast(bytes, id_)
        truncated = len(raw) > ID_BYTES
        return [self.line(when, client, token, transport, method, raw[:ID_BYTES] if truncated else raw, truncated,
                          duration, code, pid, params)]

    def _time(self, when: float) -> str:
        """`when` as ISO 8601 UTC with milliseconds (truncated) and a Z; the second's part made
        once a second."""
        ms = int(when * 1000)
        second = ms // 1000
        if second != self._second:
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        return self._stamp + _MILLIS[ms - second * 1000]

    def lines(self, entries: typing.Iterable[Entry]) -> list[str]:
        """The lines of `entries`, in order (each entry's as `entry` makes them). The common
        text line (a number for its id, no params; a chunk's results too) is made here in
        one f-string, its cached parts looked up by the entry's own values. Their params
        walk `FLUSH_VALUES` values and decode `FLUSH_PARAMS_BYTES` at most, all lines together."""
        self._left[0] = FLUSH_VALUES
        self._left[1] = FLUSH_PARAMS_BYTES
        out: list[str] = []
        if self._json:
            for entry in entries:
                out += self.entry(entry)
            return out
        append = out.append
        fast = self._fast
        tails = self._tails
        millis = _MILLIS
        base = -(1 << 62)  # the current second's first millisecond (none yet: -1.0 s is a time too)
        stamp = ""
        for entry in entries:
            when, peer, token, transport, method, id_, duration, code, pid, params = entry
            if params is not None:
                out += self.entry(entry)
                continue
            try:
                tail = tails[code, pid]
            except KeyError:
                tail = self._tail(code, pid)
            ms = int(when * 1000)  # (`_time`, inline)
            if not base <= ms < base + 1000:
                stamp = self._time(when)[:-5]
                base = ms - ms % 1000
            if type(id_) is bytes:
                if not id_.isdigit() or len(id_) > ID_BYTES:
                    out += self.entry(entry)
                    continue
                try:
                    head = fast[peer, token, transport, method]
                except (KeyError, TypeError):  # (TypeError: a peer that cannot be hashed)
                    head = self._fast_head(peer, token, transport, typing.cast(str, method))
                append(f"time={stamp}{millis[ms - base]} {head} id={id_.decode()} duration={duration:.6f} {tail}")
                continue
            # A chunk's results: the same time, duration and tail on each line
            first = f"time={stamp}{millis[ms - base]} "
            last = f" duration={duration:.6f} {tail}"
            for m, i in zip(typing.cast(list[str], method), typing.cast(list[bytes], id_)):
                if not i.isdigit() or len(i) > ID_BYTES:
                    out += self.entry((when, peer, token, transport, m, i, duration, code, pid, None))
                    continue
                try:
                    head = fast[peer, token, transport, m]
                except (KeyError, TypeError):
                    head = self._fast_head(peer, token, transport, m)
                append(f"{first}{head} id={i.decode()}{last}")
        return out

    def _fast_head(self, peer: object, token: str, transport: str, method: str) -> str:
        """`_head` of a peer as the transport gave it, remembered by the peer (`lines`)."""
        head = self._head(address(peer), token, transport, method)
        if len(self._fast) >= _CACHED:
            self._fast.clear()
        try:
            self._fast[peer, token, transport, method] = head
        except TypeError:
            pass
        return head

    def _head(self, client: str, token: str, transport: str, method: str) -> str:
        """The text line's fields client= to method=, made once for each four of them."""
        heads = self._heads
        key = (client, token, transport, method)
        try:
            return heads[key]
        except KeyError:
            if len(heads) >= _CACHED:
                heads.clear()
            head = heads[key] = (f"client={_quoted(client)} token={_quoted(token) if token else '-'} "
                                 f"transport={_quoted(transport)} method={_quoted(method)}")
            return head

    def _tail(self, code: int, pid: int) -> str:
        """The text line's fields outcome= to pid=, made once for each code and pid."""
        tails = self._tails
        try:
            return tails[code, pid]
        except KeyError:
            if len(tails) >= _CACHED:
                tails.clear()
            tail = tails[code, pid] = f"outcome={self._outcome(code)} code={_code(code) or '-'} pid={pid or '-'}"
            return tail

    def _outcome(self, code: int) -> str:
        try:
            return self._outcomes[code]
        except KeyError:
            if len(self._outcomes) >= _CACHED:
                self._outcomes.clear()
            name = self._outcomes[code] = OUTCOME_ABANDONED if code == ABANDONED else outcome_name(code)
            return name

    def line(self, when: float, client: str, token: str, transport: str, method: str, id_: bytes,
             truncated: bool, duration: float, code: int, pid: int, params: bytes | int | None) -> str:
        """One call's line (the fields as `AccessLine`'s). `client`: its peer's `address`;
        `id_`: its raw id, at most ID_BYTES (`truncated`: it was longer; written with "...")."""
        if self._json:
            record: dict[str, object] = {
                "time": self._time(when), "log": "access", "client": client, "token": token or None,
                "transport": transport, "method": method, "id": _id_text(id_, truncated), "duration": round(duration, 6),
                "outcome": self._outcome(code), "code": _code(code) or None, "pid": pid or None,
            }  # fmt: skip
            if params is not None:
                record["params"] = _params_text(params, self._left)
            return json_line(_encode(record))
        if truncated:
            id_text = _quoted(_id_text(id_, True))
        elif id_.isdigit() or _PLAIN_ID(id_):  # (the common ids: numbers, plain words)
            id_text = id_.decode("ascii")
        elif match := _PLAIN_STRING_ID(id_):  # (a string of plain characters and spaces: its quotes escaped)
            id_text = '"\\"' + match.group(1).decode("ascii") + '\\""'
        else:
            id_text = _quoted(_id_text(id_, False))
        text = (f"time={self._time(when)} {self._head(client, token, transport, method)} id={id_text} "
                f"duration={duration:.6f} {self._tail(code, pid)}")
        if params is not None:
            text += " params=" + _quoted(_params_text(params, self._left))
        return text


def _code(code: int) -> int:
    """An entry's code as its line writes it: 0 (none) for a result and for `ABANDONED`."""
    return 0 if code == ABANDONED else code


class AccessLog:
    """What the dispatcher tells of each call answered, as entries (tuples laid out as
    `ENTRY_FIELDS`) given to `emit`, on the event loop's thread.

    mode: "errors" (calls not ended in a result) or "all" (`MODES`; "off" makes none: the
    dispatcher holds no `AccessLog` then). log_params: keep each call's params for its
    line (redacted, bounded: `keep_params`, `redact`). emit: takes each entry, never blocks
    (`logpipe.LogPipe.access`). clock: time.time, for the lines' time.
    `names`: the registered methods, in the workers' order (set by the dispatcher's
    method table); index len(names) is "other".
    """

    __slots__ = ("_clock", "_known", "_names", "emit", "log_params", "mode")

    def __init__(self, mode: str, emit: Callable[[Entry], None], *, log_params: bool = False,
                 clock: Callable[[], float] | None = None) -> None:
        if mode not in MODES or mode == "off":
            raise ValueError(f"access_log = {mode!r}: it must be 'errors' or 'all' (no AccessLog for 'off')")
        self.mode = mode
        self.emit = emit
        self.log_params = log_params
        self._clock = clock or time.time
        self._names: list[str] = [OTHER]  # (the registered names, then "other")
        self._known: frozenset[str] = frozenset((DISCOVER,))  # (the methods `early` names: the broker's own too)

    @property
    def names(self) -> list[str]:
        """The registered methods, by method index."""
        return self._names[:-1]

    @names.setter
    def names(self, names: list[str]) -> None:
        self._names = [*names, OTHER]  # (a new list: entries made hold the old one's names)
        self._known = frozenset((*names, DISCOVER))

    def _method(self, index: int) -> str:
        names = self._names
        return names[index] if 0 <= index < len(names) else OTHER

    def call(self, call: Call, code: int, duration: float) -> None:
        """A single call (not a chunk) was answered: `code` 0 for a result, else its error's
        code; `duration` seconds after it arrived."""
        owner = call.owner
        worker = call.worker
        id_ = call.id
        params = None
        if self.log_params:
            params = call.kept if call.kept is not None else keep_params(call.params)
        try:
            method = self._names[call.index]  # (`_method` inline: a call less)
        except IndexError:
            method = OTHER
        self.emit((
            self._clock(), owner.peer, owner.caller, owner.transport, method,
            bytes(id_) if len(id_) <= ID_BYTES else _kept_id(id_), duration, code,
            worker.pid if worker is not None else 0, params,
        ))  # fmt: skip

    def element(self, chunk: Call, i: int, code: int, duration: float,
                read: tuple[bytes | int | None] | None = None) -> None:
        """The call at place `i` of the batch chunk `chunk` was answered (`code` as `call`);
        `read`: (its params as kept,) when the caller read them already (`chunk_results`)."""
        owner = chunk.owner
        worker = chunk.worker
        self.emit((
            self._clock(), owner.peer, owner.caller, owner.transport,
            self._method(typing.cast(list[int], chunk.methods)[i]),
            _kept_id(typing.cast(list[msgspec.Raw], chunk.ids)[i]), duration, code,
            worker.pid if worker is not None else 0,
            None if not self.log_params else read[0] if read is not None else _chunk_params(chunk, i),
        ))  # fmt: skip

    def chunk_results(self, chunk: Call, entries: typing.Iterable[int] | None, duration: float) -> None:
        """The calls at places `entries` of `chunk` (None: all of them) were answered with
        results: one entry for them all (with log_params, one each)."""
        methods = typing.cast(list[int], chunk.methods)
        ids = typing.cast(list[msgspec.Raw], chunk.ids)
        if self.log_params:  # (the payload read once: at each place from its start, a chunk's lines cost its
            every = _chunk_params_all(chunk)  # size squared; hostile testing, round 121: 61 ms a chunk of 500)
            for i in range(len(methods)) if entries is None else entries:
                self.element(chunk, i, 0, duration, (every[i] if i < len(every) else None,))
            return
        names = self._names
        places = range(len(methods)) if entries is None else list(entries)
        try:
            named = [names[m] for m in methods] if entries is None else [names[methods[i]] for i in places]
        except IndexError:  # (a method index past the table: "other", as `_method` says)
            named = [self._method(methods[i]) for i in places]
        if entries is None:
            kept = [bytes(x) if len(x) <= ID_BYTES else _kept_id(x) for x in ids]
        else:
            kept = [_kept_id(ids[i]) for i in places]
        owner = chunk.owner
        worker = chunk.worker
        self.emit((self._clock(), owner.peer, owner.caller, owner.transport, named, kept, duration, 0,
                   worker.pid if worker is not None else 0, None))

    def early(self, owner: ResponseBudget, request: Request, code: int) -> None:
        """A request answered before it became a call (rate limited, its method unknown or
        denied to its caller, or `rpc.discover`, the broker's own): its method is named only
        if registered, or if it is `rpc.discover`."""
        method = request.method if request.method in self._known else OTHER
        params = keep_params(request.params) if self.log_params else None
        self.emit((self._clock(), owner.peer, owner.caller, owner.transport, method, _kept_id(request.id), 0.0,
                   code, 0, params))

    def invalid(self, owner: ResponseBudget, answer: bytes, code: int) -> None:
        """An invalid element (or body) was answered `answer` (a whole Response object, the
        codec's: its id read back from it, null when none could be read)."""
        try:
            id_ = _kept_id(_decode_id(answer).id)
        except (msgspec.DecodeError, msgspec.ValidationError):
            id_ = b""
        self.emit((self._clock(), owner.peer, owner.caller, owner.transport, OTHER, id_, 0.0, code, 0,
                   None if not self.log_params else b""))


class _IdOnly(msgspec.Struct):
    id: msgspec.Raw = msgspec.Raw(b"null")


_decode_id = msgspec.json.Decoder(_IdOnly).decode


def _chunk_params(chunk: Call, i: int) -> bytes | int | None:
    """The params of the call at place `i` of `chunk`, from its CALL_ENTRY payload as kept
    (`Call.kept` once sent, else its params), or None if they cannot be read."""
    payload = chunk.kept if chunk.kept is not None else chunk.params
    if isinstance(payload, int):
        return payload  # (not kept: its size)
    pos = 0
    try:
        for _ in range(i + 1):
            _method, _notification, start, pos = read_call(payload, pos)
    except struct.error:  # (not a whole payload)
        return None
    return keep_params(memoryview(payload)[start:pos])


def _chunk_params_all(chunk: Call) -> list[bytes | int | None]:
    """The params of every call of `chunk`, in order, as `_chunk_params` reads one (as far as
    its payload can be read)."""
    payload = chunk.kept if chunk.kept is not None else chunk.params
    count = len(typing.cast(list[int], chunk.methods))
    if isinstance(payload, int):
        return [payload] * count
    out: list[bytes | int | None] = []
    pos = 0
    try:
        for _ in range(count):
            _method, _notification, start, pos = read_call(payload, pos)
            out.append(keep_params(memoryview(payload)[start:pos]))
    except struct.error:  # (not a whole payload: the rest None)
        pass
    return out


def results_of(payload: bytes, slots: list[int], skip: typing.Container[int]) -> list[int]:
    """The places of a CHUNK_REPLY or CHUNK_PART `payload`'s results owed (slot >= 0) and
    not in `skip` (refused past a bound, or answered before)."""
    from broker.chunk import answers as chunk_answers

    return [i for i, kind, _start, _end in chunk_answers(payload)
            if kind == RESULT and i < len(slots) and slots[i] >= 0 and i not in skip]
