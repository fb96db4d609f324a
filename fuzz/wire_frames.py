"""Fuzz harness: the worker wire protocol (`broker.wire`, `broker.chunk`), frames both ways.

The broker and each worker read each other's frames with the same incremental decoder
(`wire.FrameDecoder`: the broker's `channel.WorkerChannel` with max_frame_bytes plus a reply
entry, the worker's `worker.runtime.WorkerProtocol` with max_frame_bytes), then each side reads
what its peer's kinds carry: the broker a HELLO (`decode_hello`), a RESULT or ERROR
(`replies.error_code`), a CHUNK_PART or CHUNK_REPLY's answers (`chunk.answers`,
`count_answers`) and a CHUNK_RESULTS's Response objects (`chunk.results`, `entries_of`); the worker a CALL, NOTIFY or CHUNK's deadline and flow (`wire.DEADLINE`) and a
CHUNK's calls (`chunk.read_call`).

Input: `harness.split`'s (flags, piece sizes, stream). Flags bit 0: the stream is records
made into valid frames (`encode_frame`; kind byte, aux byte, payload length byte, payload),
else raw bytes; bit 1: max_frame_bytes of 64 (a refusal met by short inputs), else the
default. The bytes go to the decoder in pieces of the input's sizes. Checked:

- the decoder raises nothing but `FrameError` (unknown kind, length past the limit), and
  after one is fed no more;
- the frames read piece by piece are those read at once, and those of a reference reader of
  the header (wire.py's diagram), with the same bytes left over (`buffered`); before a
  refusal, some of the reference's first frames (those of the reads before the bad one);
- the frames read, encoded again (`encode_frame`), are the bytes they came from;
- each side's reading of each frame raises nothing but its documented errors (`FrameError`
  or `WireMismatch` for a HELLO; `struct.error` past a CHUNK's end, where the worker answers
  the call "method not found"), and the chunk readers agree (`count_answers` and `answers`;
  `results` finds the objects a CHUNK_RESULTS holds and no other count, and `entries_of`
  refuses them or makes entries of them all);
- records mode: a CHUNK's calls (with their ids), a CHUNK_REPLY's answers and a CHUNK_RESULTS's
  objects built from the payload (`encode_requests`' layout, `add_answer`, `results_payload`) read
  back as built, and `with_methods` and `large_params` agree with them;
- time is linear in the size (`harness.timed`).

Run: `python -m fuzz.wire_frames [libFuzzer flags] [CORPUS_DIR]` (`make fuzz` does).
"""

from __future__ import annotations

import struct

from fuzz.harness import cut, instrumented, json_suite, main, split, timed

with instrumented(__name__ == "__main__"):
    from broker import chunk, wire
    from broker.replies import error_code

__all__ = ["check", "seeds"]

_SMALL_LIMIT = 64
_KIND_RANGE = 14  # kinds 0..13 in records mode: 0 is no kind (refused), 1..13 are wire.Kind


def _reference(stream: bytes, limit: int) -> tuple[list[tuple[int, int, int, bytes]], int, bool]:
    """(frames, bytes left over, refused) by wire.py's header diagram, read plainly."""
    frames: list[tuple[int, int, int, bytes]] = []
    pos = 0
    while len(stream) - pos >= wire.HEADER_SIZE:
        length, kind, call_id, aux = struct.unpack(">IBQI", stream[pos:pos + wire.HEADER_SIZE])
        if kind not in wire._KINDS or length > limit:
            return frames, len(stream) - pos, True
        if pos + wire.HEADER_SIZE + length > len(stream):
            break
        frames.append((kind, call_id, aux, stream[pos + wire.HEADER_SIZE:pos + wire.HEADER_SIZE + length]))
        pos += wire.HEADER_SIZE + length
    return frames, len(stream) - pos, False


def _feed(pieces: list[bytes], limit: int) -> tuple[list[tuple[int, int, int, bytes]], int, bool]:
    """(frames, bytes buffered, refused) of a decoder fed `pieces` in turn."""
    decoder = wire.FrameDecoder(limit)
    frames: list[tuple[int, int, int, bytes]] = []
    for piece in pieces:
        try:
            frames.extend(decoder.feed(piece))
        except wire.FrameError:
            return frames, -1, True
    return frames, decoder.buffered, False


def _read_as_broker(kind: int, aux: int, payload: bytes) -> None:
    """What the broker's channel and dispatcher read of a worker's frame (channel.py, replies.py)."""
    if kind == wire.HELLO:
        try:
            hello = wire.decode_hello(payload)
        except wire.FrameError:  # (WireMismatch is one)
            return
        assert isinstance(hello.methods, list) and isinstance(hello.concurrency, int)
    elif kind == wire.RESULT or kind == wire.ERROR:
        assert isinstance(error_code(payload), int)
    elif kind == wire.CHUNK_PART or kind == wire.CHUNK_REPLY:
        entries = list(chunk.answers(payload))
        assert chunk.count_answers(payload) == len(entries), (chunk.count_answers(payload), len(entries))
        pos = 0
        for _place, _kind, start, end in entries:
            assert start == pos + wire.REPLY_ENTRY.size and end >= start, (pos, start, end)
            pos = end
    elif kind == wire.CHUNK_RESULTS:
        count = payload.count(b"\n") + 1
        parts = chunk.results(payload, count)
        assert parts is not None and chunk.results(payload, count + 1) is None
        made = chunk.entries_of(parts, [b"1"] * count)
        assert made is None or chunk.count_answers(made) == count


def _read_as_worker(kind: int, aux: int, payload: bytes) -> None:
    """What the worker's runtime reads of the broker's frame (worker/runtime.py, worker/chunks.py)."""
    if kind != wire.CALL and kind != wire.NOTIFY and kind != wire.CHUNK:
        return
    if len(payload) < wire.DEADLINE.size:
        return  # the worker closes: "a call with no deadline"
    wire.DEADLINE.unpack_from(payload)
    if kind == wire.CHUNK:
        pos = wire.DEADLINE.size
        for _ in range(min(aux, len(payload))):  # (aux calls; at most one a byte can hold)
            try:
                _method, _notify, start, pos = chunk.read_call(payload, pos)
            except struct.error:
                break  # (the worker answers it "method not found": worker/chunks.py `_advance`)
            assert start <= pos


def _records(stream: bytes) -> list[tuple[int, int, int, bytes]]:
    """Frames made of records: kind byte, aux byte, payload length byte, payload."""
    frames: list[tuple[int, int, int, bytes]] = []
    at = 0
    while at + 3 <= len(stream):
        kind, aux, n = stream[at] % _KIND_RANGE, stream[at + 1], stream[at + 2]
        frames.append((kind, len(frames), aux, stream[at + 3:at + 3 + n]))
        at += 3 + n
    return frames


def _check_chunks(payload: bytes) -> None:
    """A CHUNK's calls and a CHUNK_REPLY's answers built from `payload` read back as built."""
    calls = []
    at = 0
    while at < len(payload):
        n = payload[at] % 5
        calls.append((payload[at] * 257 % 65536, payload[at] & 1, payload[at + 1:at + 1 + n]))
        at += 1 + n
    ids = [p[:1] for _m, _f, p in calls]  # (any bytes: the worker reads past an id by its length)
    built = b"".join(wire.CALL_ENTRY.pack(m, f, len(i), len(p)) + i + p for (m, f, p), i in zip(calls, ids))
    pos, read = 0, []
    while pos < len(built):
        at = pos
        method, notify, start, pos = chunk.read_call(built, pos)
        read.append((method, int(notify), built[start:pos]))
        assert built[at + wire.CALL_ENTRY.size:start] == ids[len(read) - 1]
    assert read == calls, (read, calls)
    least = (payload[0] % 5) if payload else 1
    assert chunk.large_params(built, least) == sum(len(p) for _, _, p in calls if len(p) >= least)
    renamed = chunk.with_methods(built, [i for i in range(len(calls))])
    assert len(renamed) == len(built)
    pos = 0
    for i, (_m, f, p) in enumerate(calls):
        method, notify, start, pos = chunk.read_call(renamed, pos)
        assert (method, int(notify), renamed[start:pos]) == (i, f, p)
    answers = bytearray()
    for i, (_m, f, p) in enumerate(calls):
        chunk.add_answer(answers, i, wire.RESULT if f else wire.ERROR, p)
    got = [(place, kind, bytes(answers[s:e])) for place, kind, s, e in chunk.answers(bytes(answers))]
    assert got == [(i, wire.RESULT if f else wire.ERROR, p) for i, (_m, f, p) in enumerate(calls)]
    assert chunk.count_answers(bytes(answers)) == len(calls)
    if calls:  # (results hold no `\n`: compact JSON, checked by the worker)
        answers_kept: list[bytes] = []
        for i, (_m, _f, p) in enumerate(calls):
            answers_kept += [b"%d" % i, p.replace(b"\n", b" ")]
        parts = chunk.results(chunk.results_payload(answers_kept), len(calls))
        assert parts is not None
        entries = chunk.entries_of(parts, [b"%d" % i for i in range(len(calls))])
        assert entries is not None
        got = [(place, kind, entries[s:e]) for place, kind, s, e in chunk.answers(entries)]
        assert got == [(i, wire.RESULT, p.replace(b"\n", b" ")) for i, (_m, _f, p) in enumerate(calls)]


def _check(data: bytes) -> int:
    flags, sizes, stream = split(data)
    limit = _SMALL_LIMIT if flags & 2 else wire.MAX_FRAME_BYTES
    records = None
    if flags & 1:
        records = _records(stream)
        stream = b"".join(wire.encode_frame(*frame) for frame in records)
    pieces = cut(stream, sizes)
    frames, buffered, refused = _feed(pieces, limit)
    whole, _, whole_refused = _feed([stream], limit)
    ref, left, ref_refused = _reference(stream, limit)
    assert (refused, whole_refused) == (ref_refused, ref_refused), (refused, whole_refused, ref_refused)
    if refused:
        # The frames of the read that holds a bad header are not returned (`feed` raises), so
        # which come before the refusal depends on the reads; the connection closes either way.
        assert ref[:len(frames)] == frames and ref[:len(whole)] == whole, "frames before a refusal differ"
    else:
        assert frames == whole == ref, "frames read piece by piece, at once and by the reference differ"
        assert buffered == left, (buffered, left)
    again = b"".join(wire.encode_frame(*frame) for frame in frames)
    assert stream.startswith(again), "the frames read, encoded again, are not the bytes read"
    if records is not None:
        good = all(kind != 0 and len(p) <= limit for kind, _, _, p in records)
        if good:
            assert frames == records and not refused, "valid frames not read back as written"
        for kind, _, _, payload in records:
            if kind == wire.CHUNK:
                _check_chunks(payload)
    for kind, _call_id, aux, payload in frames:
        _read_as_broker(kind, aux, payload)
        _read_as_worker(kind, aux, payload)
    return max(len(pieces), 1)


check = timed(_check)
check.__doc__ = """Feed `data` (a harness input: `harness.split`) to the frame decoders and
readers and check the invariants of this module's docstring; raises `AssertionError`
(`harness.SlowInput` if too slow)."""


def seeds() -> list[bytes]:
    """Valid frame streams of every kind (a HELLO with real fields, calls, a chunk and its
    reply), raw and as records, whole and in pieces; and a few JSON files as HELLO payloads."""
    hello = (b'{"pid":1,"slot":0,"methods":[{"name":"echo","params_schema":{}}],"concurrency":4,'
             b'"sync_methods":["echo"],"wire":%d}' % wire.VERSION)
    call = wire.encode_call(wire.CALL, 7, 0, b"[1,2]", 12.5, 3)
    entries = wire.CALL_ENTRY.pack(0, 0, 1, 5) + b"7[1,2]" + wire.CALL_ENTRY.pack(1, 1, 0, 2) + b"{}"
    chunk_frame = wire.encode_call(wire.CHUNK, 8, 2, entries, 99.0, 4 | wire.RETURNABLE)
    reply = bytearray()
    chunk.add_answer(reply, 0, wire.RESULT, b"3")
    chunk.add_answer(reply, 1, wire.ERROR, wire.CANCEL_ACK)
    frames = [
        wire.encode_frame(wire.HELLO, 0, 0, hello),
        call,
        chunk_frame,
        wire.encode_frame(wire.RESULT, 7, 120, b'{"sum":3}'),
        wire.encode_frame(wire.ERROR, 9, wire.NOT_RUN, wire.CANCEL_ACK),
        wire.encode_frame(wire.CHUNK_REPLY, 8, 80, bytes(reply)),
        wire.encode_frame(wire.CHUNK_RESULTS, 8, 80, b'{"jsonrpc":"2.0","id":7,"result":3}\n'
                                                     b'{"jsonrpc":"2.0","id":"x","result":[]}'),
        wire.encode_frame(wire.CANCEL, 7),
        wire.encode_frame(wire.BYE, 0),
    ]
    out = []
    for flags in (0, 2):
        for header in (b"\x00", b"\x01\x00", b"\x03\x10\x00\x3f"):
            out.append(bytes([flags]) + header + b"".join(frames))
            out.extend(bytes([flags]) + header + frame for frame in frames)
    records = bytes([wire.HELLO, 0, len(hello)]) + hello + bytes([wire.CHUNK, 2, 9]) + b"\x02[]\x03{}\x00\x01x"
    out += [b"\x01\x00" + records, b"\x01\x02\x00\x06" + records]
    out += [b"\x00\x00" + wire.encode_frame(wire.HELLO, 0, 0, j) for j in json_suite()[::8]]
    return out


if __name__ == "__main__":
    main("wire_frames", check, seeds)
