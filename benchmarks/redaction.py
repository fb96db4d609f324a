"""What redacting a call's params costs the event loop (`log_params`), for params a client chose to be costly.

Usage: .venv/bin/python benchmarks/redaction.py [--runs 7]

Each shape is one call's params of at most PARAMS_KEPT_BYTES (4 KiB: all kept), its keys
distinct from every other run's (none read from `secret_key`'s cache), rendered with
`accesslog._params_text` as the access log does on the loop. The figure is the fastest of
`--runs` runs, the shapes taken in turn, and its ratio to distinct ASCII keys of the same
size measured in the same run (the aim: at most about 1, the cost bounded by the params'
size whatever NFKC makes of a key; before the bound, a key of 1,358 U+FDFA cost 2.6 ms,
2 to 7 times). Then `json_line` on 1 MiB of non-ASCII text, against decoding it (before:
20 to 34 times, `str.translate`'s lookup a character). Prints figures only: nothing here is
a test.
"""

from __future__ import annotations

import argparse
import json
import time
import typing

from broker.accesslog import PARAMS_KEPT_BYTES, _params_text, json_line

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

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    shapes = {**HOSTILE, "distinct ASCII keys": lambda first: _keys(lambda tag: "k" + tag, first)}
    best = dict.fromkeys(shapes, float("inf"))
    for run in range(args.runs):
        first = 0x100000 * (run + 1)  # (tags of 6 hex digits: every key new to the run)
        for name, make in shapes.items():
            params = make(first)
            start = time.perf_counter()
            _params_text(params)
            best[name] = min(best[name], time.perf_counter() - start)
    ascii_cost = best["distinct ASCII keys"]
    print(f"{'params of at most 4 KiB':<28} {'ms a call':>10} {'x ASCII':>8}")
    for name, cost in best.items():
        print(f"{name:<28} {cost * 1e3:>10.3f} {cost / ascii_cost:>8.2f}")
    encoded = json.dumps({"params": "\u0100" * (1 << 20) + "\u2028"}, ensure_ascii=False).encode()
    line = decoding = float("inf")
    for _ in range(args.runs):
        start = time.perf_counter()
        json_line(encoded)
        middle = time.perf_counter()
        encoded.decode()
        line, decoding = min(line, middle - start), min(decoding, time.perf_counter() - middle)
    print(f"json_line, 1 MiB of non-ASCII text: {line * 1e3:.2f} ms, {line / decoding:.1f} x decoding it")


if __name__ == "__main__":
    main()
