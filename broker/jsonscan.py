"""JSON nested past the parser's limit: checked and split in linear time, with no recursion.

msgspec's parser recurses, and stops (RecursionError) where Python's recursion limit does,
about 1000 levels down. The codec's slow path needs three things of such a body: is it
JSON at all (RFC 8259), where are its top value's children (a batch's elements), and which
members of a too-deep Request object nest too deep (`deep_members` for one object,
`batch_members` and `refused_members` for all of a batch's). This module answers them with a
constant number of passes over the bytes, in C (numpy and msgspec), whatever the shape:

0. A shortcut first (bytes methods): a text that is a run of `[`, bytes with no bracket,
   then a run of `]` (`[[[...]]]`, open or closed, scalars or escapes inside) is JSON
   exactly when the runs match and `[X]` is JSON (`_bracket_run`): under 1 ms for 1 MiB.
0b. Long run pairs collapsed (`_collapse`, array work on the long runs only): each
   `[`^a X `]`^b inside the body (a, b >= 32, X with no bracket, brace, quote or
   backslash, outside strings) is cut to 2 levels, by the same equivalence as step 0;
   when that removes an eighth of the body or more, steps 1 and 2 run on the collapsed
   text and the removed levels are added back to its depth (`_Collapsed` maps offsets
   both ways, for `nesting`, `deep_members` and `batch_members`). A 1 MiB request with
   500,000-deep params, or a batch of elements each 1001 deep, is then a few KiB to
   scan; a body with no run of 32 `[` pays one `bytes.find`.
1. Structure (numpy), one entry per byte. Escaped backslashes and quotes are blanked
   (`bytes.replace`), so every quote left opens or closes a string; a running xor over
   the quotes marks the bytes inside strings, whose class is blanked. Outside strings,
   `[ { ] } , :` get a class (int8), the brackets +1 or -1, and a cumulative sum of these
   gives the depth after each byte (int32); a bracket's level is the number of
   containers around it, not counting its own.
2. Validation (msgspec). Some levels are picked as cuts, one in each window of W levels
   (W about half the parser's limit), the one with the fewest containers opening at it.
   Each container opening at a cut is cut out of its parent and replaced there by ` 0 `;
   every part is then at most 2W levels deep, and msgspec checks them all, in one call.
   The body is JSON exactly when every part is: a valid part stays valid when a ` 0 `
   (a value there, since the part parsed) is replaced by a valid value, and conversely.
   Picking the emptiest level keeps the parts few (at most the number of containers
   divided by W). The histogram of levels and the brackets at the cuts are found in
   blocks of 64 KiB (the brackets alone when they are under 3/4 of the bytes); the parts
   are put together by array work on the cut points (parents, pieces, owners), with one
   Python slice per piece.

Where the time goes, for 1 MiB of `[[[...]]]` (measured): about 2 ms for the structure,
3.5 for the histogram and the cuts, 1.5 for putting the parts together, 3.5 for msgspec on
the parts, 12 in all for `scan_json`. Arrays as long as the body cost more than their passes
suggest: a 4 MiB int32 array in fresh memory costs 2 to 3 ms in page faults and cache
misses on this machine, against 0.5 ms for the same cumulative sum into memory in use,
which is why the cut work goes by blocks. Whole `Codec.decode` figures, measured over the
deep shapes of benchmarks/pathological.py at 1 MiB on a shared 2-core machine
(benchmarks/RESULTS.md, "Pathological request bodies", fourth pass): 1 to 9 ms per MiB
for the bodies steps 0 and 0b shrink, 14 to 25 for the others, the deep shapes with
short runs of brackets (`[0,`, `{"a":`, spaced `[ [`), where numpy's passes and msgspec
over the whole body add up (`Codec.decode` skips its own failed attempts for a body
with a run of 1000 `[` outside strings). The broker imports numpy as it starts (`load`):
imported on the first deep body, it held the event loop 130 ms once (hostile testing, round
60); a worker imports it on its first call here only (most never see params of many nesting
brackets).
"""

from __future__ import annotations

import sys
import typing

import msgspec

if typing.TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "Members", "NotJson", "Scanned", "batch_members", "deep_members", "load", "nesting", "nests_deeper",
    "refused_members", "scan_json",
]

_WS = b" \t\n\r"
_RAW = msgspec.json.Decoder(msgspec.Raw)


class NotJson(ValueError):
    """`scan_json` found bytes that are not one JSON text (RFC 8259); `args[0]` is the
    byte offset of the part found not to be JSON (0 when it is the top one)."""


class Scanned(typing.NamedTuple):
    """What `scan_json` found: the top value and its direct children.

    kind: the top value's first byte (0x5B "[" for an array, 0x7B "{" for an object).
    start, end: the top value's span in the buffer (whitespace around it excluded).
    children: one (start, end, run) per direct child, in order, up to `max_children`.
        For an object, the span runs from a member's name to its value. `run` is 0
        (one child each; a run of n scalar children would say n).
    total: how many children the top value has (all of them, past `max_children` too).
    depth: the deepest nesting of arrays and objects (a scalar is 0).
    structure: the scan's arrays, for `deep_members` on a child (no second pass).
    """

    kind: int
    start: int
    end: int
    children: list[tuple[int, int, int]]
    total: int
    depth: int
    structure: typing.Any = None


class _Structure(typing.NamedTuple):
    """One entry per byte of the body (offsets are the indexes: nothing is compressed)."""

    cls: npt.NDArray[np.int8]  # 1 "[" or "{", -1 "]" or "}", 4 ",", 8 ":", 16 a closing quote, 0 other
    delta: npt.NDArray[np.int8]  # +1 an opener, -1 a closer, 0 any other byte
    depth: npt.NDArray[np.int32]  # containers open after each byte


_BLOCK = 1 << 16  # bytes a block in `_check`: its int32 arrays stay in the CPU's cache
_np: typing.Any = None
_CLASS: typing.Any = None
_QUOTE = 16  # the class of `"` before strings are blanked


def load() -> None:
    """Import numpy now (about 0.1 s), rather than inside the first call that needs it."""
    _numpy()


def _numpy() -> typing.Any:
    global _np, _CLASS
    if _np is None:
        import numpy

        cls = numpy.zeros(256, numpy.int8)
        for byte, code in zip(b'[{]},:"', (1, 1, -1, -1, 4, 8, _QUOTE), strict=True):
            cls[byte] = code
        _CLASS = cls.view(numpy.uint8).tobytes()  # a `bytes.translate` table
        _np = numpy
    return _np


def _structure(buf: bytes) -> _Structure:
    """The structural bytes of `buf` and their depth; raises `NotJson` when a string is
    left open or the brackets cannot pair up (too many closers, or some left open)."""
    np = _numpy()
    text = buf
    if b"\\" in buf:  # in JSON a backslash starts an escape: blank \\ and \" (same length)
        text = buf.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    # bytes.translate: 0.6 ms for 1 MiB, numpy's take 1.1, a fancy index twice that
    cls = np.frombuffer(text.translate(_CLASS), np.int8)  # (read-only: it is not changed)
    if b'"' in text:
        if text.count(b'"') % 2:
            raise NotJson(text.rfind(b'"'))
        # The quotes so far, odd (1) from an opening quote up to its closing one: the
        # bytes in strings are blanked (a closing quote keeps its class, which is no
        # bracket, comma or colon).
        outside = np.bitwise_xor.accumulate((cls == _QUOTE).view(np.uint8)).view(np.int8)
        outside ^= 1
        cls = np.multiply(cls, outside, out=outside)  # (into `outside`: no fresh array)
    delta = cls << 6  # the low two bits, sign-extended: 1 and -1 stay, 4 and 8 become 0
    delta >>= 6
    depth = np.cumsum(delta, dtype=np.int32)
    if len(depth):
        if depth.min() < 0:
            raise NotJson(int(np.argmax(depth < 0)))
        if depth[-1]:
            raise NotJson(len(buf))
    return _Structure(cls, delta, depth)


def _window() -> int:
    """Levels per cut window: parts are at most twice as deep, under the parser's limit
    less the frames in use (msgspec's levels and Python's frames share one count)."""
    frames = 0
    frame = sys._getframe()
    while frame is not None:
        frames += 1
        frame = frame.f_back  # type: ignore[assignment]
    return max(4, (sys.getrecursionlimit() - frames - 50) // 2)


def _cut(buf: bytes, opens: npt.NDArray[np.intp], ends: npt.NDArray[np.intp]) -> tuple[bytes, bytes]:
    """`buf` cut at the containers `opens[k]:ends[k]` (sorted by `opens`, nested or
    apart): the top part, and an array of the others, each container with the ones
    cut inside it replaced by ` 0 `. Array work per container, no Python loop over them."""
    np = _np
    count = len(opens)
    # The cut containers around each opening (itself too), and its parent: the last
    # container opened before it one such level up (none at level 1: the top part).
    nest = np.arange(1, count + 1) - np.searchsorted(np.sort(ends), opens, side="right")
    keys = np.sort(nest * (count + 1) + np.arange(count))
    found = keys[np.maximum(np.searchsorted(keys, (nest - 1) * (count + 1) + np.arange(count)) - 1, 0)]
    owner_after = np.where(nest > 1, found % (count + 1) + 1, 0)  # part 0 is the top one
    # The pieces between cut points, each with the part it belongs to: after an opening,
    # the container's own; after an end, its parent's. An end sorts before an opening
    # at the same offset.
    points = np.concatenate(([0], opens, ends))
    owners = np.concatenate(([0], np.arange(1, count + 1), owner_after))
    order = np.argsort(np.concatenate(([0], opens * 2 + 1, ends * 2)), kind="stable")
    starts = points[order]
    stops = np.append(starts[1:], len(buf))
    owners = owners[order]
    by_part = np.argsort(owners, kind="stable")
    owners = owners[by_part]
    pieces = [buf[a:b] for a, b in zip(starts[by_part].tolist(), stops[by_part].tolist(), strict=True)]
    n_top = int(np.searchsorted(owners, 1))
    # Between two pieces of one part, a container was cut: " 0 "; between parts, ",".
    seps = [b"," if s else b" 0 " for s in (owners[n_top + 1:] != owners[n_top:-1]).tolist()]
    rest = pieces[n_top:]
    joined: list[bytes] = [b""] * (2 * len(rest) - 1)
    joined[0::2] = rest
    joined[1::2] = seps
    return b" 0 ".join(pieces[:n_top]), b"[" + b"".join(joined) + b"]"


def _check(buf: bytes, st: _Structure, deepest: int) -> None:
    """Raise `NotJson` unless `buf` is one JSON text (see the module's docstring)."""
    np = _np
    window = _window()
    if deepest < window:
        parts = b""
        top = buf
    else:
        # The brackets alone when they are few (a body mostly of strings or scalars),
        # else every byte; block by block: arrays as long as the body (4 MiB of int32
        # for 1 MiB) cost more in fresh pages and cache misses than the work on them.
        is_bracket = st.delta != 0  # (nonzero on a bool array: 2.5 times faster than on int8)
        brackets = np.flatnonzero(is_bracket) if 4 * np.count_nonzero(is_bracket) < 3 * len(buf) else None
        depths, deltas = (st.depth, st.delta) if brackets is None else (st.depth.take(brackets), st.delta.take(brackets))
        opened = np.zeros(deepest + 1, np.int64)  # [L + 1]: containers opening at level L
        blocks = [(a, min(a + _BLOCK, len(depths))) for a in range(0, len(depths), _BLOCK)]
        for a, b in blocks:
            up = depths[a:b][deltas[a:b] == 1]  # after each opener: its level + 1
            if len(up):
                low = int(up.min())
                counts = np.bincount(up - low)
                opened[low:low + len(counts)] += counts
        rows = (deepest - 1 + window - 1) // window
        padded = np.full(rows * window, len(buf) + 1, np.int64)
        padded[: deepest - 1] = opened[2:]
        cuts = padded.reshape(rows, window).argmin(axis=1) + np.arange(rows) * window + 1
        is_cut = np.zeros(deepest + 1, bool)
        is_cut[cuts] = True
        found: list[typing.Any] = []  # per block: offsets of the brackets at cut levels
        levels: list[typing.Any] = []  # and their levels
        for a, b in blocks:
            delta = deltas[a:b]
            level = depths[a:b] - (delta == 1)  # a bracket's level: containers around it, not its own
            hits = np.flatnonzero(is_cut.take(level) & (delta != 0))
            found.append(hits + a)
            levels.append(level.take(hits))
        at_cut = np.concatenate(found)
        if brackets is not None:
            at_cut = brackets.take(at_cut)
        # At one level, openers and closers alternate (the depth never drops below it
        # between them): sorted by level, then offset, they pair up in turn.
        order = at_cut[np.argsort(np.concatenate(levels), kind="stable")]
        opens, ends = order[0::2], order[1::2] + 1
        by_open = np.argsort(opens, kind="stable")
        top, parts = _cut(buf, opens[by_open], ends[by_open])
    try:
        _RAW.decode(top)
    except msgspec.DecodeError:
        raise NotJson(0) from None
    if parts:
        try:
            _RAW.decode(parts)
        except msgspec.DecodeError:
            raise NotJson(1) from None


class _Run(typing.NamedTuple):
    """The structure `scan_json` keeps for a text `[[...[X]...]]` with a bracket-free X:
    where its run of `[` starts and how long it is (the depth of a span is the number
    of those `[` in it)."""

    start: int
    length: int


def _bracket_run(buf: bytes, start: int, end: int) -> Scanned | None:
    """`scan_json` of `buf[start:end]` when it is a run of two `[` or more, bytes with
    no bracket at all, then a run of `]` (`[[[[...]]]]`, left open or not, escapes or
    scalars in the middle); None for any other text. Two comparisons and the bytes'
    own searches (`bytes.lstrip` takes 1.2 ms for 512 KiB of `[`; numpy's first
    mismatch 0.06 ms).

    Such a text is JSON exactly when both runs have the same length and `[X]` is JSON:
    X holds no bracket (in a string or not), so the innermost `[` is closed by the first
    `]`, each `[` around it holds one value only, and `[V]` is JSON exactly when V is."""
    np = _numpy()
    codes = np.frombuffer(buf, np.uint8)[start:end]
    opened = int(np.argmax(codes != 0x5B)) or len(codes)  # (0: every byte is `[`)
    closed = int(np.argmax(codes[::-1] != 0x5D))  # (the first byte is no `]`)
    middle = buf[start + opened:end - closed]
    if b"[" in middle or b"]" in middle or b"{" in middle or b"}" in middle:
        return None
    if opened != closed:
        raise NotJson(0)
    try:
        _RAW.decode(b"[" + middle + b"]")
    except msgspec.DecodeError:
        raise NotJson(0) from None
    return Scanned(0x5B, start, end, [(start + 1, end - 1, 0)], 1, opened, _Run(start, opened))


_MIN_RUN = 32  # brackets: a run pair shorter than this is left as it is
_LONG_RUN = b"[" * _MIN_RUN
_X_MAX = 16  # bytes after a run of `[` looked at together for the end of X
# X's bytes: 0 a byte X may hold, 1 the `]` that ends X, 2 a byte it may not hold
_X_CLASS = bytes(1 if b == 0x5D else 2 if b in b'[{}"\\' else 0 for b in range(256))
_X_MARKS = bytes(0 if c == 0 else 1 for c in _X_CLASS)  # (as bools: any byte X may not hold)


class _Collapsed(typing.NamedTuple):
    """The structure `scan_json` keeps for a body whose long run pairs it collapsed
    (`_collapse`): the collapsed text's arrays, its depth with the removed levels
    added back, and where the collapsed runs were, to map offsets both ways.

    A text offset x is the body offset x + the levels removed before it, a run's
    removed `[` counting from its innermost `[` on and its removed `]` from its
    innermost `]` on: a value that started at the first removed `[` starts at the
    innermost `[` in the text, and one that ended after the last removed `]` ends
    after the innermost `]`."""

    st: _Structure
    inner: npt.NDArray[np.intp]  # text offsets of the innermost `[` of each run pair
    close: npt.NDArray[np.intp]  # and of its innermost `]`
    inner_at: npt.NDArray[np.intp]  # body offsets: the first removed `[` of each
    close_at: npt.NDArray[np.intp]  # and its innermost `]`
    removed: npt.NDArray[np.intp]  # levels removed by the pairs before each (one more entry)

    def body(self, x: typing.Any) -> typing.Any:
        """Body offsets of text offsets (an int or an array)."""
        np = _np
        r = self.removed
        return x + r[np.searchsorted(self.inner, x)] + r[np.searchsorted(self.close, x)]

    def text(self, y: typing.Any) -> typing.Any:
        """Text offsets of body offsets that start or end values (an int or an array)."""
        np = _np
        r = self.removed
        return y - r[np.searchsorted(self.inner_at, y)] - r[np.searchsorted(self.close_at, y)]


def _low_zero_bytes(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.intp]:
    """How many low-order bytes of each (nonzero) word are zero: the lowest set bit,
    isolated, is a power of two, which float64 holds exactly."""
    low = x & (~x + _np.uint64(1))
    shifts: npt.NDArray[np.intp] = _np.log2(low.astype(_np.float64)).astype(_np.intp)
    return shifts >> 3


def _long_runs(buf: bytes, codes: npt.NDArray[np.uint8], byte: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Starts and ends of the runs of `byte` in `buf` of `_MIN_RUN` bytes or more (and
    of some shorter ones, 24 bytes or more). Such a run holds 3 aligned 8-byte words
    of `byte` or more: the words are found by one comparison a word (0.1 ms for 1 MiB,
    however many short runs there are), and each run of them is widened by the bytes
    of `byte` in the words on either side, read off those words' values (a word's
    bytes are in memory order from its low end: little-endian)."""
    np = _np
    pattern = np.uint64(int.from_bytes(bytes([byte]) * 8, "little"))
    raw = np.frombuffer(buf + bytes(16 - len(buf) % 8), "<u8")  # (a partial last word, padded)
    words = raw[: len(buf) // 8] == pattern
    edges = np.flatnonzero(words[1:] != words[:-1]) + 1
    if len(words) and words[0]:
        edges = np.concatenate(([0], edges))
    if len(edges) % 2:
        edges = np.append(edges, len(words))
    first, last = edges[0::2], edges[1::2]
    keep = last - first >= 3
    first, last = first[keep], last[keep]
    ends = last * 8 + _low_zero_bytes(raw.take(last) ^ pattern)  # (the word after: never all `byte`)
    # The word before, its high bytes first (byte-swapped); none before the first word.
    before = np.where(first > 0, raw.take(np.maximum(first - 1, 0)) ^ pattern, np.uint64(0xFF))
    grown = np.where(first > 0, _low_zero_bytes(before.byteswap()), 0)
    return first * 8 - grown, ends


def _collapse(buf: bytes) -> tuple[bytes, npt.NDArray[np.intp], npt.NDArray[np.intp], npt.NDArray[np.intp]] | None:
    """`buf` with each run pair `[`^a X `]`^b (a, b >= `_MIN_RUN`, outside strings, X
    with no bracket, brace, quote or backslash) cut to `[`^(a-k) X
    `]`^(b-k), k = min(a, b) - 2 (the outermost `[` and `]` stay: no value starts or
    ends in the removed bytes but the one the outermost holds, which starts at the
    first removed `[` and ends after the last): the text, and per pair its innermost
    `[` and `]` in `buf` and its k. None when the pairs would remove under an eighth of
    `buf`. The text is JSON exactly when `buf` is: each of the k removed levels
    held one value only, the next (the innermost `[` closes at the first `]`: X holds
    no bracket, and is in no string), as in `_bracket_run`. Array work on the long
    runs only, and one gather of the kept bytes; a pair left out only costs its levels."""
    np = _numpy()
    # (`bytes.find` of a run of 32: 0.1 ms for 1 MiB: bodies with no long run pay little.)
    if len(buf) < 4 * _MIN_RUN or _LONG_RUN not in buf:
        return None
    codes = np.frombuffer(buf, np.uint8)
    o_starts, e = _long_runs(buf, codes, 0x5B)

    def enough(levels: typing.Any) -> bool:  # an eighth of buf or more to remove
        return 16 * int(levels.sum()) >= len(buf)

    # The cheap refusals first, each followed by the count of what is left (at most
    # a - 2 levels a pair).
    if not enough(e - o_starts - 2):
        return None
    # Outside strings: an even number of quotes before X, escaped ones blanked first
    # (as `_structure` blanks them).
    text = buf if b"\\" not in buf else buf.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    quotes = np.flatnonzero(np.frombuffer(text, np.uint8) == 0x22)
    ok = np.searchsorted(quotes, e) % 2 == 0
    if not enough((e - o_starts - 2)[ok]):
        return None
    o_starts, e = o_starts[ok], e[ok]
    # X = buf[e:f], f the first `]` after the run of `[`: no bracket, brace, quote or
    # backslash before it. The first `_X_MAX` bytes after each run of `[` are looked
    # at together; a longer X (a scalar of many digits, spaces) by a pass of its own.
    at = np.minimum(e[:, None] + np.arange(_X_MAX), len(buf) - 1)
    kinds = np.frombuffer(_X_CLASS, np.uint8).take(codes.take(at))
    width = np.argmax(kinds != 0, axis=1)
    found = kinds[np.arange(len(e)), width]
    ok = found != 2
    if not enough((e - o_starts - 2)[ok]):
        return None
    o_starts, e, width, found = o_starts[ok], e[ok], width[ok], found[ok]
    c_starts, c_ends = _long_runs(buf, codes, 0x5D)
    if not len(c_starts):
        return None
    j = np.minimum(np.searchsorted(c_starts, e), len(c_starts) - 1)
    f = c_starts[j]  # and that `]` starts a long run of `]`
    ok = np.where(found == 1, e + width == f, (f >= e) & (f <= np.append(o_starts[1:], len(buf))))
    longer = np.flatnonzero(ok & (found == 0))
    if len(longer):  # any such byte from e to f (spans apart): a reduceat over the body
        marks = np.frombuffer(buf.translate(_X_MARKS), np.bool_)
        bounds = np.empty(2 * len(longer), np.intp)
        bounds[0::2], bounds[1::2] = e[longer], f[longer]
        ok[longer] = ~np.logical_or.reduceat(marks, bounds)[0::2]
    k = np.minimum(e - o_starts, c_ends[j] - f) - 2  # (the outermost pair stays: see above)
    ok &= k > 0
    if not enough(k[ok]):
        return None
    e, f, k = e[ok], f[ok], k[ok]
    # Kept: up to the removed `[` (k before the innermost), from the innermost `[`
    # to the innermost `]`, then from after the removed `]` on.
    froms = np.sort(np.concatenate(([0], e - 1, f + 1 + k)))  # (the pairs are apart, in order)
    tos = np.sort(np.concatenate((e - 1 - k, f + 1, [len(buf)])))
    # The kept bytes gathered by one index (a slice a piece: 180 ns each, 9 ms for
    # 16,000 pairs): each piece's offsets, shifted to where it starts in buf.
    sizes = tos - froms
    shift = np.repeat(froms - (np.cumsum(sizes) - sizes), sizes)
    text = codes.take(np.arange(len(shift)) + shift).tobytes()
    return text, e - 1, f, k


def _collapsed_scan(buf: bytes, found: tuple[bytes, typing.Any, typing.Any, typing.Any]) -> tuple[_Collapsed, int]:
    """Check the collapsed text (`NotJson` for it is for `buf` too), and give its
    structure with the removed levels added back, and the deepest nesting of `buf`."""
    np = _np
    text, inner_at, close_at, k = found
    st = _structure(text)
    _check(text, st, int(st.depth.max()) if len(st.depth) else 0)
    removed = np.concatenate(([0], np.cumsum(k)))
    before = 2 * removed[:-1] + k  # bytes removed before each innermost `[` and `]`
    inner, close = inner_at - before, close_at - before
    add = np.zeros(len(text) + 1, np.int32)  # k levels from the innermost `[` to its `]`
    add[inner] += k.astype(np.int32)
    add[close] -= k.astype(np.int32)
    depth = st.depth + np.cumsum(add[:-1], dtype=np.int32)
    view = _Collapsed(_Structure(st.cls, st.delta, depth), inner, close, inner_at - k, close_at, removed)
    return view, int(depth.max())


def scan_json(buf: bytes, max_children: int = 0, exact_depth: bool = True) -> Scanned:
    """Check that `buf` is one JSON text (RFC 8259) and find its top value's children,
    at any depth, in time linear in `len(buf)` and without recursion.

    The UTF-8 of strings is not checked here (`Codec.decode` checks the whole body);
    escapes are checked as msgspec checks them for `Raw` (a lone surrogate passes).
    `max_children` caps the children listed (0: no cap); `total` counts them all.
    `depth` is always exact (`exact_depth` is kept for callers). Raises `NotJson`.
    Cost: linear, 0.9 to 25 ms per MiB of `Codec.decode` measured on the deep shapes
    (benchmarks/RESULTS.md, "Pathological request bodies"); the module's docstring says how.
    """
    start = len(buf) - len(buf.lstrip(_WS))
    end = len(buf.rstrip(_WS))
    if buf.startswith(b"[[", start):  # 1 MiB of `[[[...]]]`: about 0.5 ms here, 12 by numpy
        run = _bracket_run(buf, start, end)
        if run is not None:
            return run
    collapsed = _collapse(buf)
    kept: _Structure | _Collapsed
    if collapsed is None:
        st = kept = _structure(buf)
        deepest = int(st.depth.max()) if len(st.depth) else 0
        _check(buf, st, deepest)
    else:  # long run pairs: the collapsed text checked, the levels added back
        kept, deepest = _collapsed_scan(buf, collapsed)
        st = kept.st
    kind = buf[start]
    if kind != 0x5B and kind != 0x7B:
        return Scanned(kind, start, end, [], 0, 0)
    commas = _np.flatnonzero((st.depth == 1) & (st.cls == 4))
    if not len(commas) and not buf[start + 1:end - 1].strip(_WS):
        return Scanned(kind, start, end, [], 0, deepest, kept)
    total = len(commas) + 1
    listed = total if not max_children else min(total, max_children)
    # Only the commas before the last child listed become Python ints: 170,000 members
    # of a 1 MiB request took 5 ms to list for the one child asked (measured).
    commas = commas[:listed]
    if type(kept) is _Collapsed:
        commas = kept.body(commas)
    seps = [start, *commas.tolist(), end - 1]
    children: list[tuple[int, int, int]] = []
    for i in range(listed):
        a, b = seps[i] + 1, seps[i + 1]
        piece = buf[a:b]
        children.append((a + len(piece) - len(piece.lstrip(_WS)), a + len(piece.rstrip(_WS)), 0))
    return Scanned(kind, start, end, children, total, deepest, kept)


# `nests_deeper`'s skeleton of a text: its quotes and brackets (braces as brackets), and
# each skeleton byte's step in depth (int8: `[` 1, `]` -1, a quote 0).
_SKELETON = bytes(0x5B if b == 0x7B else 0x5D if b == 0x7D else b for b in range(256))
_NOT_SKELETON = bytes(b for b in range(256) if b not in b'"[]{}')
_STEP = bytes(1 if b == 0x5B else 0xFF if b == 0x5D else 0 for b in range(256))


def nests_deeper(buf: bytes, limit: int) -> bool:
    """Whether `buf`, one JSON text (checked already: the answer for other bytes is
    unspecified), nests arrays and objects more than `limit` levels deep.

    What the worker's max_depth check needs, without `scan_json`'s work (a check of the
    whole text and its children: 5 to 30 ms per MiB, measured) for the many texts that
    hold brackets but cannot nest that deep. In steps, each only when the one before
    could not tell:
    1. more than `limit` brackets at all (`bytes.count`: most params have fewer);
    2. the skeleton: escapes blanked, every byte but quotes and brackets deleted
       (braces become brackets), one `bytes.translate`; then every `""` removed, which
       keeps the parity of the quotes before each bracket, so only strings holding
       brackets are left, and those brackets cut out (`split`, or numpy when there
       are many);
    3. rounds of `replace(b"[]", b"")` on what is left, each removing one level (the
       innermost pairs), stopping as soon as the pairs left are too few to nest past
       the levels left; past a budget of work (4 times the skeleton: nesting near the
       limit everywhere), numpy's cumulative sum over what is left.
    A 1 MiB call whose params hold a string of 1000 `[` costs the two counts and the
    translate, about 1 ms; 100 small objects about what msgspec takes to read them."""
    if buf.count(b"[") + buf.count(b"{") <= limit:
        return False
    text = buf if b"\\" not in buf else buf.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    skeleton = text.translate(_SKELETON, _NOT_SKELETON)
    if b'"' in skeleton:
        skeleton = skeleton.replace(b'""', b"")  # (a run of quotes keeps one at most: one pass)
        if b'"' in skeleton:  # strings holding brackets: cut them out
            if skeleton.count(b'"') > _SPLIT_QUOTES:
                return _deeper(skeleton, limit)
            skeleton = b"".join(skeleton.split(b'"')[0::2])
    budget = 4 * len(skeleton)
    for level in range(limit):
        if len(skeleton) <= 2 * (limit - level):  # each level left takes a [ and a ]
            return False
        budget -= len(skeleton)
        if budget < 0:
            return _deeper(skeleton, limit - level)
        skeleton = skeleton.replace(b"[]", b"")
    return len(skeleton) > 0


_SPLIT_QUOTES = 256  # quotes: past this many, numpy cuts the strings out (a Python object a piece)


def _deeper(skeleton: bytes, limit: int) -> bool:
    """`nests_deeper` of a skeleton by numpy: the cumulative sum of its steps, a
    bracket between a quote and the next (in a string) not counted."""
    np = _numpy()
    steps = np.frombuffer(skeleton.translate(_STEP), np.int8)
    if b'"' in skeleton:  # from an opening quote to its closing one: 1 (steps there are 0 then)
        inside = np.bitwise_xor.accumulate(np.frombuffer(skeleton, np.uint8) == 0x22)
        steps = np.where(inside, np.int8(0), steps)
    return int(np.cumsum(steps, dtype=np.int32).max()) > limit


def nesting(parent: Scanned, start: int, end: int) -> int:
    """How deep the value at `start:end` of the text `parent` scanned nests: its levels of
    arrays and objects (0 for a scalar, or when `parent` kept no structure)."""
    if parent.structure is None or start >= end:
        return 0
    if type(parent.structure) is _Run:  # the `[` of the run that are in the span
        run = parent.structure
        return max(0, min(end, run.start + run.length) - max(start, run.start))
    if type(parent.structure) is _Collapsed:
        view = parent.structure
        depth = view.st.depth
        start, end = int(view.text(start)), int(view.text(end))
    else:
        depth = parent.structure.depth
    return int(depth[start:end].max()) - (int(depth[start - 1]) if start else 0)


def deep_members(obj: bytes, parent: Scanned | None = None, offset: int = 0) -> tuple[list[int], list[int], list[bool]]:
    """The member values of `obj`, a JSON object (valid, checked already), nested over
    64 levels: their starts, their ends and whether each is refused (msgspec cannot read
    it: its `Raw` decoder, one level down, raises RecursionError), as three lists in
    order; empty lists when none is refused.

    The caller replaces them (the refused ones by a marker), then decodes the copy:
    msgspec's own rules for duplicate and escaped names tell which members they were.
    `parent`: the `scan_json` of a text holding `obj` at `offset` (its arrays are then
    reused instead of scanning `obj` again). Array work per member, no Python loop
    over them (a Request object of 1 MiB can have 7,000 such members)."""
    np = _numpy()
    view = None if parent is None else parent.structure
    if type(view) is _Structure:
        span = slice(offset, offset + len(obj))
        cls, depth = view.cls[span], view.depth[span]
    elif type(view) is _Collapsed:  # in the collapsed text's offsets, mapped back below
        at = int(view.text(offset))  # (obj starts and ends a value: it maps)
        span = slice(at, int(view.text(offset + len(obj))))
        cls, depth = view.st.cls[span], view.st.depth[span]
    else:
        view = None
        cls, _, depth = _structure(obj)
    base = int(depth[0])  # containers open after obj's "{"
    # The colons and commas at obj's level: a pass over the classes for each, then the
    # depths of those bytes only (masks over the whole object, its depths compared
    # with its level byte by byte, cost about twice as much for a 1 MiB request of
    # 170,000 flat members next to its deep params, measured).
    colons = np.flatnonzero(cls == 8)
    colons = colons[depth.take(colons) == base]
    if not len(colons):
        return [], [], []
    # The deepest point from one ":" to the next: the member's value (a name is flat).
    nesting = np.maximum.reduceat(depth, colons) - base
    tried = np.flatnonzero(nesting > 64)
    if not len(tried):
        return [], [], []
    nesting, firsts = nesting.take(tried), colons.take(tried)
    # Each one ends at the "," after it at obj's level, or at obj's own "}".
    commas = np.flatnonzero(cls == 4)
    commas = commas[depth.take(commas) == base]
    closing = len(depth) - 1 - (len(obj) - len(obj.rstrip(_WS)))
    stops = np.append(commas, closing)
    starts, ends = firsts + 1, stops[np.searchsorted(stops, firsts)]
    if view is not None and type(view) is _Collapsed:  # back to obj's own offsets
        starts, ends = view.body(starts + at) - offset, view.body(ends + at) - offset
    # msgspec takes one recursion step per array or object level, so whether it can
    # read a value depends on its nesting only: find the least nesting it refuses by
    # a binary search over the nestings present, one real value of each tried.
    levels, first = np.unique(nesting, return_index=True)
    lo, hi = 0, len(levels)  # levels[hi:] refused; levels[:lo] read
    while lo < hi:
        mid = (lo + hi) // 2
        i = int(first[mid])
        start, end = int(starts[i]), int(ends[i])
        try:
            _RAW.decode(b"[" + obj[start:end] + b"]")
            lo = mid + 1
        except RecursionError:
            hi = mid
    if hi == len(levels):
        return [], [], []
    return starts.tolist(), ends.tolist(), (nesting >= levels[hi]).tolist()



class Members(typing.NamedTuple):
    """The members of a batch's object elements, all elements at once (`batch_members`).

    starts, ends: each member value's span in the body, in order (from the byte after
        its ":" to its "," or its object's "}"); owners: the element (an index in
        `Scanned.children`) each belongs to.
    nesting: each value's levels of arrays and objects (a scalar is 0).
    depth: per element, 1 + the nesting of its deepest member (0 when it has none).
    """

    starts: npt.NDArray[np.intp]
    ends: npt.NDArray[np.intp]
    owners: npt.NDArray[np.intp]
    nesting: npt.NDArray[np.intp]
    depth: list[int]


def batch_members(parent: Scanned) -> Members | None:
    """`deep_members`' spans and nestings for the members of every object element of
    the batch `parent` scanned, by array work on its structure: a constant number of
    passes over the body, none per element (`deep_members` costs about 140 us of numpy
    calls an element). None when the scan kept no per-byte structure (a `[[[...]]]`
    run, whose only child is an array)."""
    np = _numpy()
    view = parent.structure
    if type(view) is _Structure:
        st = view
    elif type(view) is _Collapsed:  # in the collapsed text's offsets, mapped back below
        st = view.st
    else:
        return None
    # Members of an element are at depth 2, after its "{" (the top "[" opens depth 1).
    # The bytes that shallow are few in a deep batch (every byte in a flat one).
    shallow = np.flatnonzero(st.depth <= 2)
    cls, depth = st.cls.take(shallow), st.depth.take(shallow)
    colons = shallow[(cls == 8) & (depth == 2)]
    ends = shallow[((cls == 4) & (depth == 2)) | ((cls == -1) & (depth == 1))]
    ends = ends[np.searchsorted(ends, colons)]  # the "," or "}" after each ":"
    firsts = np.array([a for a, _, _ in parent.children], np.intp)
    if type(view) is _Collapsed:
        firsts = view.text(firsts)
    owners = np.searchsorted(firsts, colons, side="right") - 1
    own = np.zeros(len(firsts), np.intp)
    nests = owners
    if len(colons):  # the deepest point of each value, from its ":" to its end (a name is flat)
        bounds = np.empty(2 * len(colons), np.intp)
        bounds[0::2], bounds[1::2] = colons, ends
        nests = np.maximum.reduceat(st.depth, bounds)[0::2].astype(np.intp) - 2
        groups = np.flatnonzero(np.diff(owners, prepend=-1))  # each element's first member
        own[owners.take(groups)] = np.maximum.reduceat(nests, groups) + 1
    starts = colons + 1
    if type(view) is _Collapsed:
        starts, ends = view.body(starts), view.body(ends)
    return Members(starts, ends, owners, nests, own.tolist())


def refused_members(buf: bytes, members: Members, chosen: list[int]) -> tuple[list[int], list[int], list[bool], list[int]]:
    """`deep_members` for each element in `chosen` (indexes into `members.depth`, in
    order) at once: the starts, ends, refusals and owners of the members over 64
    levels deep of the chosen elements that have a refused member, in order (an
    element with none refused has none listed, as `deep_members` gives it none)."""
    np = _np
    mask = np.zeros(len(members.depth), bool)
    mask[chosen] = True
    tried = np.flatnonzero(mask.take(members.owners) & (members.nesting > 64))
    if not len(tried):
        return [], [], [], []
    nests = members.nesting.take(tried)
    least = _least_refused(buf, members.starts.take(tried), members.ends.take(tried), nests)
    refused = nests >= least
    owners = members.owners.take(tried)
    # Per element, whether any member was refused: then all its tried members are listed.
    listed = np.zeros(len(members.depth), bool)
    listed[owners[refused]] = True
    keep = listed.take(owners)
    return (
        members.starts.take(tried[keep]).tolist(),
        members.ends.take(tried[keep]).tolist(),
        refused[keep].tolist(),
        owners[keep].tolist(),
    )


def _least_refused(buf: bytes, starts: npt.NDArray[np.intp], ends: npt.NDArray[np.intp], nests: npt.NDArray[np.intp]) -> int:
    """The least nesting msgspec refuses among `nests` (one more than the deepest when
    it refuses none), by `deep_members`' binary search with one real value of each.
    Called from `refused_members` one frame below the codec's `_deep_items`, so its
    probes run as deep in Python's stack as `deep_members`' ran for `_deep_element`
    (msgspec's levels and Python's frames share one count: one frame more would
    refuse one level less)."""
    np = _np
    levels, first = np.unique(nests, return_index=True)
    lo, hi = 0, len(levels)  # levels[hi:] refused; levels[:lo] read
    while lo < hi:
        mid = (lo + hi) // 2
        i = int(first[mid])
        try:
            _RAW.decode(b"[" + buf[int(starts[i]):int(ends[i])] + b"]")
            lo = mid + 1
        except RecursionError:
            hi = mid
    return int(levels[hi]) if hi < len(levels) else int(levels[-1]) + 1
