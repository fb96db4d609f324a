"""What the slowest request bodies cost the codec, in-process: `Codec.decode` on each shape.

Usage: .venv/bin/python benchmarks/pathological.py [--max-bytes 1048576] [--rounds 5]

Each shape is grown to several sizes up to `--max-bytes` (the default `max_body_bytes`,
1 MiB) and decoded `--rounds` times; the figure is the fastest round (the least noisy on a
shared machine), as microseconds per KiB and milliseconds per MiB of body, with the
answer's first error code. The shapes are the worst ones found for each part of the
codec: nesting past the parser's limit (closed, left open, with members at each level,
with scalar or container siblings, batches whose elements each nest just past it in one
member or another), unclosed strings and runs of escapes, many invalid
batch elements, batches past `max_batch`, long keys, huge numbers, `\\u` escapes that send
a valid batch down the slow path, many small notifications. Linear time shows as a
steady µs per KiB across sizes; the aim is under 10 ms per MiB for every shape.

The last lines give two worsts. Per MiB, the worst over bodies of 256 KiB and more
only: the shapes made of batch elements are capped by `max_batch` (1000 elements), so
some never grow past a few KiB (`invalid objects {}` is 3001 bytes at every size asked),
and their µs per KiB is a fixed cost per element (about 0.3 µs) spread over few bytes,
not a rate that grows with the body; they stay listed above. And the absolute worst:
the most milliseconds any one body took, whatever its size. Prints
figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.jsonrpc import Codec, Request

KiB = 1024


def repeat_to(unit: bytes, size: int) -> int:
    return max(1, size // len(unit))


def call(params: bytes, id_: bytes = b"1") -> bytes:
    return b'{"jsonrpc":"2.0","method":"echo","params":' + params + b',"id":' + id_ + b"}"


def deep_params(size: int) -> bytes:
    n = max(1100, (size - 60) // 2)
    return b"[" + call(b"[" * n + b"]" * n) + b',{"jsonrpc":"2.0","method":"add","params":[1,2],"id":2}]'


def id_after_deep_params(size: int) -> bytes:
    n = max(1100, (size - 60) // 2)
    return b'{"jsonrpc":"2.0","method":"echo","params":' + b"[" * n + b"]" * n + b',"id":7}'


def in_string(size: int) -> bytes:
    return b"[" * 1100 + b'"' + b'\\"' * repeat_to(b'\\"', size - 1101)


JUST_PAST = 1001  # levels: an element `{"params":` these deep nests just past the parser's limit
DEEP_HEAD = b'{"id":1,"jsonrpc":"2.0","method":"echo",'


def batch_of(elements: list[bytes], size: int) -> bytes:
    """A batch of `elements` repeated in turn, as many as fit in `size` (max_batch at most)."""
    unit = sum(len(e) + 1 for e in elements) / len(elements)
    n = max(len(elements), min(1000, int((size - 2) // unit)))
    return b"[" + b",".join(elements[i % len(elements)] for i in range(n)) + b"]"


def nest(levels: int, opening: bytes = b"[", closing: bytes = b"]", inner: bytes = b"") -> bytes:
    return opening * levels + inner + closing * levels


# Batches whose elements each nest just past the parser's limit (hostile testing: every
# element took the deep path alone, 75 to 115 ms per MiB), in each member the answer reads
JUST_PAST_PARAMS = DEEP_HEAD + b'"params":' + nest(JUST_PAST) + b"}"
BATCH_SHAPES: dict[str, Callable[[int], bytes]] = {
    "batch, params just past": lambda s: batch_of([JUST_PAST_PARAMS], s),
    "batch, id just past": lambda s: batch_of([b'{"jsonrpc":"2.0","method":"echo","id":' + nest(JUST_PAST) + b"}"], s),
    "batch, other member just past": lambda s: batch_of([DEEP_HEAD + b'"x":' + nest(JUST_PAST) + b"}"], s),
    "batch, {\"a\": params just past": lambda s: batch_of([DEEP_HEAD + b'"params":' + nest(JUST_PAST, b'{"a":', b"}", b"1") + b"}"], s),
    "batch, params just past, \\\" ids": lambda s: batch_of([b'{"id":"\\"","jsonrpc":"2.0","method":"echo","params":' + nest(JUST_PAST) + b"}"], s),
        "batch, params of runs of 40 just past": lambda s: batch_of([DEEP_HEAD + b'"params":' + (b"[" * 40 + b"1,") * 26 + b"1" + b"]" * 1040 + b"}"], s),
        "batch, just past and normal": lambda s: batch_of([JUST_PAST_PARAMS, call(b"[" + b"1," * 1000 + b"1]")], s),
    "batch ~1000, every other just past": lambda s: batch_of([JUST_PAST_PARAMS, call(b"[1,2]")], s),
    # ids nested under the limit, each invalid (hostile testing, round 8: parsed three times)
    "batch, ids 484 deep": lambda s: batch_of([b'{"jsonrpc":"2.0","method":"echo","id":' + nest(484) + b"}"], s),
    # notifications (no id) just past: dropped unanswered, as a notification is (F6)
    "batch, notifications just past": lambda s: batch_of([b'{"jsonrpc":"2.0","method":"echo","params":' + nest(JUST_PAST) + b"}"], s),
}

SHAPES: dict[str, Callable[[int], bytes]] = {
    # the issue's own: an unclosed string of escaped quotes inside 1100 arrays
    "deep + unclosed escapes": in_string,
    "deep arrays, closed": lambda s: b"[" * (s // 2) + b"]" * (s // 2),
    "deep arrays, open": lambda s: b"[" * s,
    "deep objects": lambda s: b'{"a":' * (s // 6) + b"1" + b"}" * (s // 6),
    "deep [0, siblings": lambda s: b"[0," * (s // 4) + b"0" + b"]" * (s // 4),
    "deep [[], siblings": lambda s: b"[[]," * (s // 5) + b"0" + b"]" * (s // 5),
    "deep [[0], siblings": lambda s: b"[[0]," * (s // 6) + b"0" + b"]" * (s // 6),
    "deep spaced [ [": lambda s: b"[ " * (s // 3) + b"]" * (s // 3),
    "deep {\"k\":[ with keys": lambda s: b'{"k":[' * (s // 7) + b"]}" * (s // 7),
    "deep params, batch of 2": deep_params,
    "deep [[],[]... in params": lambda s: b"[" + call(b"[" * 1100 + b"[]," * repeat_to(b"[],", s - 2300) + b"0" + b"]" * 1100) + b"]",
    "id after deep params": id_after_deep_params,
    "deep, then 1,1,1...": lambda s: b"[" * 1100 + b"1," * repeat_to(b"1,", s - 2200) + b"1" + b"]" * 1100,
    "deep, then {},{},...": lambda s: b"[" * 1100 + b"{}," * repeat_to(b"{},", s - 2200) + b"1" + b"]" * 1100,
    "deep, then escaped strings": lambda s: b"[" * 1100 + b'"\\"[\\\\",' * repeat_to(b'"\\"[\\\\",', s - 2200) + b"1" + b"]" * 1100,
    # jsonscan's deep_members tries each member value over 64 levels deep with msgspec
    "members 70 deep, params too": lambda s: b'{"jsonrpc":"2.0","method":"m",' + b"".join(
        b'"a%d":' % i + b"[" * 70 + b"]" * 70 + b"," for i in range(repeat_to(b'"a0000":' + b"[]" * 70 + b",", s - 2300))
    ) + b'"params":' + b"[" * 1100 + b"]" * 1100 + b',"id":3}',
    # hostile testing, F7: deep params before 170,000 flat members (c); an object nested
    # by a two-level unit (`{"":[`); a valid flat call holding 1000 `[` in a string, which
    # paid the deep scan first (a), next to the same call without them (the baseline)
    "deep params, then 170k members": lambda s: b'{"jsonrpc":"2.0","method":"m","params":' + b"[" * 1100
    + b"]" * 1100 + b"," + b'"a":1,' * repeat_to(b'"a":1,', s - 2300) + b'"id":1}',
    'deep {"":[ alternating': lambda s: b'{"":[' * (s // 7) + b"1" + b"]}" * (s // 7),
    "flat call (baseline)": lambda s: call(b"[" + b"1," * repeat_to(b"1,", s - 100) + b"1]"),
    "flat call, 1000 [ in a string": lambda s: call(b'["' + b"[" * 1000 + b'",' + b"1," * repeat_to(b"1,", s - 1100) + b"1]"),
    **BATCH_SHAPES,
    "unclosed string": lambda s: b'["' + b"a" * s,
    "unclosed escapes": lambda s: b'["' + b'\\"' * (s // 2),
    "invalid elements [1,1,...]": lambda s: b"[" + b",".join([b"1"] * repeat_to(b"1,", s)) + b"]",
    "invalid elements, padded": lambda s: b"[" + b",".join([b"1" + b" " * 1000] * min(1000, repeat_to(b" " * 1001, s))) + b"]",
    "invalid objects {}": lambda s: b"[" + b",".join([b"{}"] * min(1000, repeat_to(b"{},", s))) + b"]",
    "invalid method, big params": lambda s: b"[" + b",".join(
        [b'{"jsonrpc":"2.0","method":1,"params":[' + b"1," * 500 + b'1],"id":1}'] * min(1000, repeat_to(b"1," * 520, s))
    ) + b"]",
    "long key": lambda s: b'{"jsonrpc":"2.0","method":"m","' + b"k" * s + b'":1,"id":1}',
    "huge number id": lambda s: b'{"jsonrpc":"2.0","method":"m","id":' + b"9" * s + b"}",
    "\\u escapes (suspect)": lambda s: b"[" + b",".join(
        [b'{"jsonrpc":"2.0","method":"m","params":["\\u00e9' + b"\\u00e9" * 150 + b'"],"id":1}'] * min(1000, repeat_to(b"\\u00e9" * 155, s))
    ) + b"]",
    "many small notifications": lambda s: b"[" + b",".join(
        [b'{"jsonrpc":"2.0","method":"m"}'] * min(1000, repeat_to(b'{"jsonrpc":"2.0","method":"m"},', s))
    ) + b"]",
}


SMALL: dict[str, bytes] = {
    **{f"params nested {n} deep": b'{"jsonrpc":"2.0","method":"nosuch","params":' + nest(n) + b',"id":1}'
       for n in (900, 990, 999, 1001, 1100)},
    "1000 invalid {}": b"[" + b",".join([b"{}"] * 1000) + b"]",
    "1000 invalid 1": b"[" + b",".join([b"1"] * 1000) + b"]",
    "a valid add": b'{"jsonrpc":"2.0","method":"add","params":[1,2],"id":1}',
}


def code_of(codec: Codec, body: bytes) -> str:
    decoded = codec.decode(body)
    if not decoded.items:  # only notifications too deep to forward: no answer at all
        return f"none ({decoded.dropped} dropped)"
    first = decoded.items[0]
    if type(first) is Request:
        return "request"
    return str(first).split('"code":')[1].split(",")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-bytes", type=int, default=1024 * KiB)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    codec = Codec()
    sizes = [s for s in (16 * KiB, 64 * KiB, 256 * KiB, 1024 * KiB) if s <= args.max_bytes] or [args.max_bytes]
    print(f"{'shape':30} {'bytes':>9} {'us/KiB':>9} {'ms/MiB':>8}  answer")
    worst = (0.0, "", 0)  # ms per MiB, the shape, its bytes: bodies of 256 KiB and more
    slowest = (0.0, "", 0)  # ms for one body, the shape, its bytes: any body
    for name, make in SHAPES.items():
        for size in sizes:
            body = make(size)
            if len(body) > args.max_bytes:  # whole shapes, never cut: trim the size asked
                body = make(size - (len(body) - args.max_bytes) - 64)
            answer = code_of(codec, body)  # untimed: the first deep body also imports numpy
            best = float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                codec.decode(body)
                best = min(best, time.perf_counter() - t0)
            per_kib = best * 1e6 / (len(body) / KiB)
            if len(body) >= 256 * KiB:
                worst = max(worst, (per_kib * 1.024, name, len(body)))
            slowest = max(slowest, (best * 1e3, name, len(body)))
            print(f"{name:30} {len(body):>9} {per_kib:>9.2f} {per_kib * 1.024:>8.2f}  {answer}")
    if worst[1]:
        print(f"worst per MiB (bodies of 256 KiB and more): {worst[1]}, {worst[0]:.2f} ms per MiB ({worst[2]} bytes)")
    print(f"slowest body: {slowest[1]}, {slowest[0]:.2f} ms ({slowest[2]} bytes)")
    # Small bodies: a fixed cost per body, which bytes do not show (hostile testing, round
    # 11: 2 KB bodies nested just past the parser's limit took 1.5 ms each, and a turn of 16
    # of them 25 ms; a turn ends after TURN_SECONDS of a connection's reads now).
    print(f"\n{'small body':30} {'bytes':>9} {'us/body':>9} {'ms/MiB':>8}  answer")
    for name, body in SMALL.items():
        answer = code_of(codec, body)
        best = float("inf")
        for _ in range(args.rounds * 4):
            t0 = time.perf_counter()
            codec.decode(body)
            best = min(best, time.perf_counter() - t0)
        print(f"{name:30} {len(body):>9} {best * 1e6:>9.0f} {best * 1e3 / (len(body) / (KiB * KiB)):>8.0f}  {answer}")


if __name__ == "__main__":
    main()
