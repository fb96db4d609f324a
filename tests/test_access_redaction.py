"""Params in access lines (broker/accesslog.py): what redacting them (`redact`) and writing
them in a JSON line (`json_line`) costs the event loop, where both run, for params a client
chose to be costly; and that the shortcuts taken for that cost read a key as the rule says.
The names redacted are tested in test_dispatch_core_access.py."""

from __future__ import annotations

import json
import time
import typing

from hypothesis import example, given
from hypothesis import strategies as st

from broker.accesslog import (
    KEY_CHARS,
    PARAMS_KEPT_BYTES,
    REDACT_VALUES,
    REDACTED,
    SECRET_ENDINGS,
    SECRET_KEYS,
    SECRET_WORDS,
    _ascii,
    _params_text,
    json_line,
    redact,
    secret_key,
)

FDFA = "\ufdfa"  # ARABIC LIGATURE SALLALLAHOU ALAYHE WASALLAM: 18 characters under NFKC and NFKD, the most of any


def _keys(make_key: typing.Callable[[str], str], first: int) -> bytes:
    """An object of as many distinct keys `make_key(tag)` (each key's tag distinct from any
    other test's, so none is read from a cache) as fit PARAMS_KEPT_BYTES, as raw UTF-8 JSON."""
    pieces: list[bytes] = []
    size = 2
    for n in range(first, first + PARAMS_KEPT_BYTES):
        piece = json.dumps(make_key(format(n, "x")), ensure_ascii=False).encode() + b":0"
        if size + len(piece) + 1 > PARAMS_KEPT_BYTES:
            break
        pieces.append(piece)
        size += len(piece) + 1
    return b"{" + b",".join(pieces) + b"}"


# Params a client makes costly to redact, each of at most PARAMS_KEPT_BYTES (all kept): keys of
# U+FDFA after a tag of up to 6 hex digits (each key new to the run, none read from a cache)
HOSTILE: dict[str, typing.Callable[[int], bytes]] = {
    # hostile testing: NFKC and a casefold of 24,000 characters, 2.6 ms (4 ms here)
    "one key of 1,350 U+FDFA": lambda first: _keys(lambda tag: tag + FDFA * 1350, first),
    "keys of 64 characters": lambda first: _keys(lambda tag: tag + FDFA * (64 - len(tag)), first),
    "keys of 4 U+FDFA": lambda first: _keys(lambda tag: tag + FDFA * 4, first),
    "keys of 1 U+FDFA": lambda first: _keys(lambda tag: tag + FDFA, first),
}

def test_keys_that_normalize_to_many_characters_cost_no_more_than_ascii_keys_of_their_size() -> None:
    """Hostile testing: each key was NFKC-normalized and case-folded whatever its length, and
    U+FDFA makes 18 characters: a key of 1,358 of them cost 2.6 ms on the event loop, a 1 MiB
    batch of such calls 1.3 s. The work a call's params cost must be bounded by their size, as
    a plain key's is: here each shape's params cost at most twice what distinct ASCII keys of
    the same size do (before the bound, 2 to 7 times; since, a quarter at most). Best of 7 runs each, the shapes
    taken in turn, so a busy machine slows them alike; every key new to the run."""
    best = dict.fromkeys([*HOSTILE, "ascii"], float("inf"))
    for run in range(7):
        first = 0x100000 * (run + 1)  # (tags of 6 hex digits)
        for name, make in [*HOSTILE.items(), ("ascii", lambda first: _keys(lambda tag: "k" + tag, first))]:
            params = make(first)
            assert len(params) <= PARAMS_KEPT_BYTES
            start = time.perf_counter()
            _params_text(params)
            best[name] = min(best[name], time.perf_counter() - start)
    ascii_cost = best.pop("ascii")
    slow = {name: f"{cost / ascii_cost:.1f}x" for name, cost in best.items() if cost > 2 * ascii_cost}
    assert not slow, f"{slow} the cost of ASCII keys ({ascii_cost * 1e3:.3f} ms) for params of the same size"


def test_a_key_past_key_chars_is_redacted_unread_and_a_compatibility_key_counts_its_length() -> None:
    assert redact({"x" * KEY_CHARS: 1, "x" * (KEY_CHARS + 1): 2, FDFA * 1358: 3}) == {
        "x" * KEY_CHARS: 1, "x" * (KEY_CHARS + 1): REDACTED, FDFA * 1358: REDACTED}
    # A key not in NFKC form costs as many values as it has characters; a name typed in another
    # script (in NFKC form) costs nothing more than an ASCII one
    budget = [REDACT_VALUES]
    redact({FDFA * 10: 0, "\uff4e\uff41\uff4d\uff45": 0, "имя": 0, "name": 0}, budget)
    assert budget == [REDACT_VALUES - 1 - 10 - 4 - 4]
    fullwidth = "{" + ",".join(f'"\uff4b{n:02d}":0' for n in range(REDACT_VALUES // 4)) + "}"
    assert _params_text(fullwidth.encode()).endswith(f"more than {REDACT_VALUES} values: not written)")
    cyrillic = "{" + ",".join(f'"к{n:02d}":0' for n in range(REDACT_VALUES // 4)) + "}"
    assert json.loads(_params_text(cyrillic.encode())) == json.loads(cyrillic)


def test_a_json_line_escapes_its_line_separators_at_the_cost_of_decoding_it() -> None:
    """A line's non-ASCII text was escaped with str.translate, a dict lookup a character: 20
    to 34 times the text's decoding (0.06 ms for a line's 1,024 characters of params, on the
    loop); now at most 8 times (about 2). Best of 5, over 1 MiB of text."""
    assert json_line('{"a":"\u2028\u2029\x85\u00e9\u0100"}'.encode()) == '{"a":"\\u2028\\u2029\\u0085\u00e9\u0100"}'
    encoded = json.dumps({"params": "\u0100" * (1 << 20) + "\u2028"}, ensure_ascii=False).encode()
    line = decoding = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        escaped = json_line(encoded)
        middle = time.perf_counter()
        encoded.decode()
        line, decoding = min(line, middle - start), min(decoding, time.perf_counter() - middle)
    assert escaped.endswith('\\u2028"}')
    assert line <= 8 * decoding, f"json_line {line * 1e3:.2f} ms, decoding {decoding * 1e3:.2f} ms"


def _words(text: str) -> list[str]:
    """The words of an ASCII `text`, as README states the rule, one character at a time: runs of
    letters and digits, cut between a letter and a digit, before a capital after a small letter,
    and before a capital followed by a small letter after a capital ("APIKey": API, Key)."""
    words: list[str] = []
    word = ""
    for i, c in enumerate(text):
        if not (c.isascii() and c.isalnum()):
            words += [word] if word else []
            word = ""
            continue
        if word:
            last, after = word[-1], text[i + 1 : i + 2]
            if (last.isdigit() != c.isdigit() or (last.islower() and c.isupper())
                    or (last.isupper() and c.isupper() and after.islower())):  # fmt: skip
                words.append(word)
                word = ""
        word += c
    return [w.lower() for w in [*words, word] if w]


@given(st.text("pinPINwsdWSDcvCVnNxX1_-aAeEtTokKyYsS\u212a\uff30\u00e9\u00df", max_size=24))
@example("APIKey2")
@example("pasSSN")
@example("PINCode")
def test_a_key_is_read_as_its_words_whatever_shortcut_reads_it(key: str) -> None:
    """`secret_key` skips the split into words unless a short name is in the key, matches the
    words' cases without lowering them, and caches: the same verdict as the rule read plainly."""
    words = _words(_ascii(key))
    folded = "".join(words)
    assert secret_key(key) == (
        folded.endswith(SECRET_ENDINGS) or any(name in folded for name in SECRET_KEYS)
        or any(word in SECRET_WORDS for word in words)
    ), words  # fmt: skip
