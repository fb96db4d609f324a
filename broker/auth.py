"""Bearer-token authentication (sans-IO): who may call, by a token each caller is given.

An operator gives each client a token, under a name: the name is what the broker shows
(its log, the `token` label of metrics: bounded, one value per token); the token
is the secret, sent over HTTP as `Authorization: Bearer TOKEN` (RFC 6750 2.1). Tokens come
from a file (`auth_tokens_file`) and from the environment (`RPC_BROKER_AUTH_TOKENS`),
both read once at the start. When there are none, no one is asked for one (loopback
only by default: README, "Limits and safety defaults"). Over TLS with client certificates
(`tls_client_ca_file`), a verified certificate whose subject commonName is a token's name
stands for that token on the NDJSON stream (`Authenticator.has_name`; broker/frontend/stream.py);
HTTP asks for the token itself.

File forms (`load_file`):
    NAME.toml   a table per token: `[tokens.NAME]` with `token = "..."`, and optionally
                the token's own `allow_methods` and `deny_methods` (broker/policy.py),
                `rate_limit` and `rate_burst` (broker/ratelimit.py)
    any other   one `NAME:TOKEN` a line; blank lines and lines starting with `#` skipped
The environment: `NAME:TOKEN` entries separated by commas or white space.

A token is checked in constant time against every token (`hmac.compare_digest` of
SHA-256 digests, all of them compared whatever matches, so the time taken tells
neither which token nor how much of one was right). Token rules (`check_token`): 16 to
512 characters of RFC 6750's b64token (letters, digits, `-._~+/`, then `=` padding), so a
weak or malformed one is refused at the start rather than guessed later. Names: 1 to 64
of letters, digits, `_ . -`.
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import os
import re
import tomllib
import typing

from broker.errors import LocalError
from broker.files import FileRefused, read_bounded
from broker.policy import MethodRule, check_pattern
from broker.ratelimit import MAX_BURST, MAX_RATE, UNLIMITED, Rate, burst_for

__all__ = ["B64TOKEN", "ENV_TOKENS", "AuthError", "Authenticator", "Token", "load_tokens"]

ENV_TOKENS: typing.Final = "RPC_BROKER_AUTH_TOKENS"
MAX_FILE: typing.Final = 1 << 20  # bytes of a token file, at most
MIN_TOKEN: typing.Final = 16
MAX_TOKEN: typing.Final = 512
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
B64TOKEN: typing.Final = re.compile(r"[A-Za-z0-9\-._~+/]+=*\Z")  # RFC 6750 2.1 b64token (bench's --token-file too)
_MAKE_ONE = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
_TABLE_KEYS = ("allow_methods", "deny_methods", "rate_limit", "rate_burst")  # a token's own settings
_BEARER = re.compile(rb"[Bb][Ee][Aa][Rr][Ee][Rr] +([^ ]+) *\Z")


class AuthError(LocalError):
    """A token file or variable that cannot be used: its message says where and why
    (the broker does not start)."""


class Token(typing.NamedTuple):
    """One caller's token: `name` (shown: logs, the metrics' `token` label), the SHA-256 digest of
    its secret (the secret itself is not kept), and its own method policy, if any
    (`policy.MethodRule`: a .toml file's `allow_methods` and `deny_methods`)."""

    name: str
    digest: bytes
    rule: MethodRule | None = None
    rate: Rate | None = None  # its own rate limit (`rate_limit`, `rate_burst`: broker/ratelimit.py)
    where: str = ""  # where it was given, for messages: "auth_tokens_file: PATH, line N", or the variable's entry


def check_token(name: str, secret: str, where: str, rule: MethodRule | None = None,
                rate: Rate | None = None, toml: bool = False) -> Token:
    """A `Token` for `name` and `secret`, read from `where` (for messages; `toml`: a
    `[tokens.NAME]` table's, not a NAME:TOKEN line's); raise `AuthError` if either breaks
    its rule (see the module docstring)."""
    # (Neither is shown: written the wrong way round, TOKEN:NAME, the name is the secret;
    # hostile testing, round 114, M1: the whole token was in the error.)
    if not _NAME.match(name):
        raise AuthError(f"{where}: the token's name ([tokens.NAME]) breaks its rule: use 1 to 64 letters, "
                        "digits, '_', '.' or '-'" if toml else
                        f"{where}: the token's name (before the colon) breaks its rule: use 1 to 64 letters, "
                        "digits, '_', '.' or '-' (a line is NAME:TOKEN, the name first)")
    if not MIN_TOKEN <= len(secret) <= MAX_TOKEN or not B64TOKEN.match(secret):
        raise AuthError(
            f"{where}: the token {'(token = ...)' if toml else '(after the colon)'} breaks its rule: use {MIN_TOKEN}"
            f" to {MAX_TOKEN} characters of letters, digits and '-._~+/' (RFC 6750's b64token); to make one: {_MAKE_ONE}"
        )
    return Token(name, hashlib.sha256(secret.encode()).digest(), rule, rate, where)


def _rate(table: dict[str, object], where: str) -> Rate | None:
    """A table's own `rate_limit` (calls a second, > 0; 0: none, `UNLIMITED`, whatever the
    global one) and `rate_burst` (calls, >= 1; by default the rate rounded up), or None if
    it sets neither."""
    rate, burst = table.get("rate_limit"), table.get("rate_burst")
    if rate is None and burst is None:
        return None
    if rate is None:  # (new user, round 106: "rate_limit must be > 0" for a table that set none)
        raise AuthError(f"{where}: rate_burst without rate_limit: give the token's rate_limit too (its own rate"
                        " replaces the global rate_limit and rate_burst)")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= MAX_RATE:
        raise AuthError(f"{where}: rate_limit must be a number of calls a second, >= 0 (0: no limit for this"
                        f" token) and <= {MAX_RATE:g}")
    if rate == 0:  # (new user, round 106: a token could not be exempted from the global rate)
        if burst is not None:
            raise AuthError(f"{where}: rate_burst with rate_limit 0 (no limit for this token): drop rate_burst")
        return UNLIMITED
    if burst is None:
        burst = burst_for(rate)
    if isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= MAX_BURST:
        raise AuthError(f"{where}: rate_burst must be a whole number of calls, >= 1 and <= {MAX_BURST}")
    return Rate(float(rate), burst)


def _patterns(table: dict[str, object], key: str, where: str) -> tuple[str, ...]:
    """The glob patterns of `table[key]` (a list of strings), checked (`policy.check_pattern`)."""
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise AuthError(f'{where}: {key} must be a list of glob patterns, as ["add", "notes.*"]')
    for pattern in value:
        if not check_pattern(pattern):
            raise AuthError(f"{where}: {key}: {pattern!r} is not a glob of method names (letters, digits, "
                            "'_.-/:', and '*', '?', '[...]')")
    return tuple(value)


_TRAILING_COMMENT = re.compile(r"\s#")  # NAME:TOKEN # comment (a b64token has neither)


def _pairs(text: str, where: str, separators: str) -> list[tuple[str, str, str]]:
    """(name, secret, where) of each `NAME:TOKEN` entry of `text`."""
    pairs = []
    entries = 0
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for entry in re.split(separators, line):
            if not entry:
                continue
            entries += 1
            name, colon, secret = entry.partition(":")
            at = f"{where}, line {number}" if separators == r"\Z" else f"{where}, entry {entries}"
            if not colon:  # (nothing of it shown: it may be a token)
                raise AuthError(f"{at}: no colon: write NAME:TOKEN (a name for the logs, a colon, the token)")
            if _TRAILING_COMMENT.search(secret):  # (new user, round 109: "the token breaks its rule")
                raise AuthError(f"{at}: a comment after the token: a comment goes on a line of its own, "
                                "'#' first; the rest of the line is the token")
            pairs.append((name.strip(), secret.strip(), at))
    return pairs


_KEY = r"""(?:"([^"\\]*)"|'([^']*)'|([A-Za-z0-9_-]+))"""  # a TOML key: basic or literal string, or bare
_TABLE_HEAD = re.compile(r"\s*\[\s*" + _KEY + r"(?:\s*\.\s*" + _KEY + r")?\s*\]")
_TOKENS_KEY = re.compile(r"\s*tokens\s*\.\s*" + _KEY + r"\s*[.=]")  # tokens.NAME.token = / tokens.NAME = {...}
_NAME_KEY = re.compile(r"\s*" + _KEY + r"\s*[.=]")  # under [tokens]: NAME = {...} / NAME.token = ...


def _key(match: re.Match[str], first: int) -> str:
    """The key of groups first..first+2 of `match` (`_KEY`'s three forms)."""
    return next((g for g in match.group(first, first + 1, first + 2) if g is not None), "")


def _toml_lines(text: str) -> dict[str, int]:
    """The line number (from 1) where each token's table of a TOML token file begins: its
    `[tokens.NAME]` header, or a `tokens.NAME...` key, or a `NAME...` key under `[tokens]`
    (not found, so named without a line: a name written with escapes, a table made only by
    a deeper header, [tokens.NAME.sub], or inline in `tokens = {...}`). Read line by line,
    without parsing TOML: tomllib gives no positions (new user, round 108: a bad entry was
    named without its line)."""
    lines: dict[str, int] = {}
    table: tuple[str, str] | None = None  # the last [a] or [a.b] header's keys; None: the top level
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("["):
            head = _TABLE_HEAD.match(line)  # (None: [[an array]] or [a.b.c], where no token's table begins)
            table = (_key(head, 1), _key(head, 4)) if head else ("", "")
            if table[0] == "tokens" and table[1]:
                lines.setdefault(table[1], number)
            continue
        key = _TOKENS_KEY.match(line) if table is None else _NAME_KEY.match(line) if table == ("tokens", "") else None
        if key:
            lines.setdefault(_key(key, 1), number)
    return lines


def load_file(path: str, source: str = "auth_tokens_file") -> list[Token]:
    """The tokens of file `path`, named by `source` (where its name came from) in messages
    (its forms: the module docstring). Raises `AuthError` if it cannot be read or parsed,
    or a token breaks the rules."""
    where = f"{source}: {path}"
    try:  # (a regular file, and not past MAX_FILE: round 114, M4, /dev/zero)
        text = read_bounded(path, MAX_FILE).decode("utf-8")
    except FileRefused as exc:
        raise AuthError(f"{where}: {exc}: not a token file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # (ValueError: a NUL in its name, from a TOML string)
        raise AuthError(f"{where}: cannot read it: {exc}") from None
    if path.endswith(".toml"):
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise AuthError(f"{where}: not valid TOML: {exc}") from None
        others = sorted(set(document) - {"tokens"})
        if others:  # (hostile testing, round 131: a top-level deny_methods, or [token.bob], was skipped
            # without a word: the rules an operator meant for every token did not hold; fail closed)
            close = difflib.get_close_matches(others[0], ["tokens"], n=1)
            hint = (" (did you mean [tokens.NAME]?)" if close else
                    " (every setting of a token goes in its own [tokens.NAME] table: "
                    f"token, {', '.join(_TABLE_KEYS)})")
            raise AuthError(f"{where}: unknown {'table' if isinstance(document[others[0]], dict) else 'key'} "
                            f"{others[0]!r} at the top{hint}")
        tables = document.get("tokens")
        if not isinstance(tables, dict) or not tables:
            raise AuthError(f'{where}: no [tokens.NAME] table (each with token = "...")')
        tokens = []
        lines = _toml_lines(text)
        for name, table in tables.items():
            line = lines.get(name)
            at = f"{where}, line {line}: [tokens.{name}]" if line else f"{where}: [tokens.{name}]"
            secret = table.get("token") if isinstance(table, dict) else None
            if not isinstance(secret, str):
                raise AuthError(f'{at} needs token = "..." (a string)')
            unknown = sorted(set(table) - {"token", *_TABLE_KEYS})
            if unknown:
                raise AuthError(f"{at}: unknown key {unknown[0]!r} (known: token, {', '.join(_TABLE_KEYS)})")
            allow, deny = _patterns(table, "allow_methods", at), _patterns(table, "deny_methods", at)
            rule = MethodRule(allow, deny) if allow or deny else None
            tokens.append(check_token(name, secret, at, rule, _rate(table, at), toml=True))
        return tokens
    first = next((line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")), "")
    if first.startswith("["):  # (new user, round 109: a TOML file named tokens.conf said "no colon")
        raise AuthError(f"{where}: it starts with '[', as TOML does: a TOML token file must be "
                        "named *.toml; any other file is read as one NAME:TOKEN a line")
    tokens = [check_token(name, secret, at) for name, secret, at in _pairs(text, where, r"\Z")]
    if not tokens:  # (round 114, H2: an empty file turned the tokens off, silently)
        raise AuthError(f"{where}: no token in it (one NAME:TOKEN a line): an empty file would ask for none")
    return tokens


def load_tokens(path: str, environ: typing.Mapping[str, str] = os.environ, source: str = "auth_tokens_file") -> list[Token]:
    """Every token: those of file `path` ("" for none; `source`: where its name came from,
    for messages) and of `RPC_BROKER_AUTH_TOKENS`. Raises `AuthError` as `load_file`, and
    for a name or a token given twice (each must tell one caller)."""
    tokens = load_file(path, source) if path else []
    value = environ.get(ENV_TOKENS, "")
    from_env = [check_token(n, s, w) for n, s, w in _pairs(value, f"environment variable {ENV_TOKENS}", r"[,\s]+")]
    if value and not from_env:  # (round 114, H2: " , " turned the tokens off, silently; "" is unset)
        raise AuthError(f"environment variable {ENV_TOKENS}: no NAME:TOKEN in it: unset it, or give one")
    tokens += from_env
    names: dict[str, Token] = {}
    digests: dict[bytes, Token] = {}
    for token in tokens:  # (each said where, both places: new user, round 108, the file and line were not)
        first = names.get(token.name)
        if first is not None:
            raise AuthError(f"{token.where}: token name {token.name!r} given twice (first at {first.where}): each"
                            " name must tell one caller")
        first = digests.get(token.digest)
        if first is not None:
            raise AuthError(f"{token.where}: the token of {token.name!r} is also the token of {first.name!r} (at"
                            f" {first.where}): give each caller its own")
        names[token.name] = digests[token.digest] = token
    return tokens


class Authenticator:
    """Checks `Authorization` header values against `tokens` (at least one)."""

    __slots__ = ("_names", "_tokens")

    def __init__(self, tokens: typing.Sequence[Token]) -> None:
        if not tokens:
            raise ValueError("an Authenticator needs at least one token")
        self._tokens = tuple(tokens)
        self._names = frozenset(t.name for t in self._tokens)

    @property
    def names(self) -> tuple[str, ...]:
        """The tokens' names, in the order given."""
        return tuple(t.name for t in self._tokens)

    def has_name(self, name: str) -> bool:
        """Whether `name` is a token's name (a client certificate's commonName: the names are
        not secret, they are shown in the log and the metrics)."""
        return name in self._names

    def name_of(self, secret: bytes) -> str | None:
        """The name of the token `secret` is, or None. Constant time in `secret`'s
        content: every token's digest is compared (`hmac.compare_digest`)."""
        digest = hashlib.sha256(secret).digest()
        found = None
        for token in self._tokens:
            if hmac.compare_digest(digest, token.digest):
                found = token.name
        return found

    def check(self, authorization: bytes | None) -> str | None:
        """The name of the token an `Authorization` header value (None: absent) carries
        as `Bearer TOKEN` (the scheme's case ignored, RFC 9110 11.1), or None."""
        if authorization is None:
            return None
        match = _BEARER.match(authorization.strip(b" \t"))
        return self.name_of(match.group(1)) if match else None
