"""Params in access lines (broker/accesslog.py): the bounds on what redacting them (`redact`)
costs the event loop, where it runs, for params a client chose to be costly, and that the
shortcuts taken for that cost read a key as the rule says. What they cost is measured by
benchmarks/redaction.py (figures, not a test); the names redacted are tested in
test_dispatch_core_access.py."""

from __future__ import annotations

import json

import msgspec
from hypothesis import example, given
from hypothesis import strategies as st

from broker.accesslog import (
    FLUSH_PARAMS_BYTES,
    FLUSH_VALUES,
    KEY_CHARS,
    REDACT_VALUES,
    REDACTED,
    SECRET_ENDINGS,
    SECRET_KEYS,
    SECRET_WORDS,
    Entry,
    Renderer,
    _ascii,
    _params_text,
    json_line,
    redact,
    secret_key,
)

FDFA = "\ufdfa"  # ARABIC LIGATURE SALLALLAHOU ALAYHE WASALLAM: 18 characters under NFKC and NFKD, the most of any


def test_a_key_past_key_chars_is_redacted_unread_and_a_compatibility_key_counts_its_length() -> None:
    assert redact({"x" * KEY_CHARS: 1, "x" * (KEY_CHARS + 1): 2, FDFA * 1358: 3}) == {
        "x" * KEY_CHARS: 1, "x" * (KEY_CHARS + 1): REDACTED, FDFA * 1358: REDACTED}
    # A key not in NFKC form costs as many values as it has characters; a name typed in another
    # script (in NFKC form) costs nothing more than an ASCII one
    budget = [REDACT_VALUES]
    redact({FDFA * 10: 0, "\uff4e\uff41\uff4d\uff45": 0, "имя": 0, "name": 0}, budget)
    assert budget == [REDACT_VALUES - 1 - 4 - 10 - 4 - 4]  # (the object, its 4 keys, then what they cost)
    fullwidth = "{" + ",".join(f'"\uff4b{n:02d}":0' for n in range(REDACT_VALUES // 4)) + "}"
    assert _params_text(fullwidth.encode()).endswith(f"more than {REDACT_VALUES} values: not written)")
    cyrillic = "{" + ",".join(f'"к{n:02d}":0' for n in range(REDACT_VALUES // 4)) + "}"
    assert json.loads(_params_text(cyrillic.encode())) == json.loads(cyrillic)


def test_a_json_line_escapes_what_a_terminal_or_a_viewer_would_not_show_as_it_is() -> None:
    """Line separators (round 117); DEL, C1 (U+009B, CSI), RLO, zero-width and tag characters
    in a client's id or params, raw in a JSON line, moved a terminal's cursor or reordered the
    line (hostile testing, round 122): escaped, the JSON the same once parsed."""
    text = "\u2028\u2029\x85\x7f\x9b2J\u202e\u200b\u061c\ufe0f\U000e0041 \u00e9\u0100 ok"
    line = json_line(msgspec.json.encode({"id": text}))
    assert line == ('{"id":"\\u2028\\u2029\\u0085\\u007f\\u009b2J\\u202e\\u200b\\u061c\\ufe0f'
                    '\\udb40\\udc41 \u00e9\u0100 ok"}')
    assert json.loads(line) == {"id": text}
    assert json_line(b'{"a":"plain"}') == '{"a":"plain"}'


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


def test_the_lines_rendered_at_once_walk_flush_values_at_most_and_the_next_lines_again() -> None:
    """Each call's walk is bounded (REDACT_VALUES), and the lines rendered at once are too
    (FLUSH_VALUES: hostile testing, round 119, 1 MB batches of calls with 250 distinct keys
    each stalled the loop 0.8 s each): past it a line's params are not written; the next
    batch of lines starts anew."""
    params = ("{" + ",".join(f'"k{n}":{n}' for n in range(99)) + "}").encode()
    walked = 1 + 99 + 99  # (the object, its keys, their values)
    entries: list[Entry] = [(1.5, "", "", "unix", "m", str(i).encode(), 0.0, 0, 42, params)
                            for i in range(FLUSH_VALUES // walked + 5)]
    for style in ("text", "json"):
        renderer = Renderer(style)
        for _ in range(2):
            lines = renderer.lines(entries)
            written = [line for line in lines if "k98" in line]
            assert len(written) == -(-FLUSH_VALUES // walked), style  # (the last one walked takes it past)
            assert all("bytes of params for the lines of this moment" in line for line in lines[len(written):])


def test_keys_named_like_secrets_count_against_the_budget_though_not_walked() -> None:
    """Hostile testing, round 120: a key named like a secret is redacted, its value not
    walked, and charged nothing: params of 350 distinct such keys cost 1 ms a line and one
    value, and batches of them stalled the loop 2.2 s. Each key counts now."""
    params = ("{" + ",".join(f'"x{n}pin":0' for n in range(REDACT_VALUES)) + "}").encode()
    assert _params_text(params) == f"({len(params)} bytes, more than {REDACT_VALUES} values: not written)"
    left = [FLUSH_VALUES, FLUSH_PARAMS_BYTES]
    params = ("{" + ",".join(f'"x{n}pin":0' for n in range(100)) + "}").encode()
    _params_text(params, left)
    assert left == [FLUSH_VALUES - 101, FLUSH_PARAMS_BYTES - len(params)]


def test_the_lines_rendered_at_once_decode_flush_params_bytes_at_most_objects_or_not() -> None:
    """Hostile testing, round 121: params with no object were decoded and encoded charged
    nothing (an integer of 4,090 digits, 340 us a line: 1 MiB batches stalled the loop 1.2 s).
    Every params' bytes count now; past FLUSH_PARAMS_BYTES a line's are not written."""
    params = b"[" + b"9" * 4000 + b"]"
    entries: list[Entry] = [(1.5, "", "", "unix", "m", str(i).encode(), 0.0, 0, 42, params)
                            for i in range(FLUSH_PARAMS_BYTES // len(params) + 5)]
    for style in ("text", "json"):
        lines = Renderer(style).lines(entries)
        written = [line for line in lines if "9" * 100 in line]
        assert len(written) == FLUSH_PARAMS_BYTES // len(params), style
        assert all("bytes of params for the lines of this moment" in line for line in lines[len(written):])
