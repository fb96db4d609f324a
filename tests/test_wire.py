"""Sans-IO tests of `broker.wire`: frames in, frames out, under every way of splitting.

As h11's `tr()`: every stream is fed whole, one byte at a time and in random chunks,
and a trailing partial frame must be held back until the rest arrives.
"""

from __future__ import annotations

import math
import os
import random
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import wire
from broker.wire import HEADER_SIZE, FrameDecoder, FrameError, Kind, decode_hello, encode_call, encode_frame

Frame = tuple[int, int, int, bytes]

FRAMES: list[Frame] = [
    (Kind.HELLO, 0, 0, b'{"pid":1,"slot":0,"methods":[],"concurrency":1}'),
    (Kind.CALL, 1, 3, b"[42, 23]"),
    (Kind.NOTIFY, 2, 0, b""),
    (Kind.RESULT, 2**64 - 1, 2**32 - 1, b"19"),
    (Kind.ERROR, 7, 12, b'{"code":-32603,"message":"Internal error"}'),
    (Kind.CANCEL, 8, 0, b""),
    (Kind.CALL, 9, 0, bytes(range(256)) * 40),  # binary, 10 KiB
    (Kind.BYE, 0, 0, b""),
    (Kind.RETURN, 10, 1, b"\x00\x01\x00\x00\x00\x00\x02[]"),  # a chunk's calls from place 1: one call
]


def stream(frames: list[Frame]) -> bytes:
    return b"".join(encode_frame(*f) for f in frames)


def feed_chunks(chunks: list[bytes], decoder: FrameDecoder | None = None) -> list[Frame]:
    decoder = decoder or FrameDecoder()
    out: list[Frame] = []
    for chunk in chunks:
        out += decoder.feed(chunk)
    assert decoder.buffered == 0
    return out


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted({c for c in cuts if 0 < c < len(data)})
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def test_header_layout_matches_the_diagram():
    assert HEADER_SIZE == 17
    frame = encode_frame(Kind.RESULT, 0x0102030405060708, 0x0A0B0C0D, b"xyz")
    assert frame == (
        b"\x00\x00\x00\x03"  # payload length u32
        b"\x04"  # kind
        b"\x01\x02\x03\x04\x05\x06\x07\x08"  # call id u64
        b"\x0a\x0b\x0c\x0d"  # aux u32
        b"xyz"
    )
    assert [int(k) for k in Kind] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def test_whole():
    assert feed_chunks([stream(FRAMES)]) == FRAMES


def test_one_byte_at_a_time():
    data = stream(FRAMES)
    decoder = FrameDecoder()
    out: list[Frame] = []
    for i in range(len(data)):
        got = decoder.feed(data[i:i + 1])
        out += got
        assert decoder.buffered == (i + 1) - len(stream(out))
    assert out == FRAMES


def test_frames_are_bytes_and_independent_of_the_buffer():
    decoder = FrameDecoder()
    data = stream(FRAMES)
    first = decoder.feed(data[:30])  # HELLO is whole, CALL is not
    rest = decoder.feed(bytearray(data[30:]))
    for kind, call_id, aux, payload in first + rest:
        assert type(kind) is int and type(call_id) is int and type(aux) is int
        assert type(payload) is bytes
    assert first + rest == FRAMES


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_buffer_types(wrap):
    data = stream(FRAMES)
    assert feed_chunks([wrap(data[:40]), wrap(data[40:41]), wrap(data[41:])]) == FRAMES


def test_random_chunks_seeded():
    data = stream(FRAMES * 3)
    seed = int.from_bytes(os.urandom(4), "big")
    rnd = random.Random(seed)
    for _ in range(50):
        cuts = [rnd.randrange(len(data)) for _ in range(rnd.randrange(1, 40))]
        assert feed_chunks(split_at(data, cuts)) == FRAMES * 3, f"seed {seed}, cuts {sorted(cuts)}"


frames_st = st.lists(
    st.tuples(
        st.sampled_from([int(k) for k in Kind]),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=64),
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None, print_blob=True)
@given(frames_st, st.data())
def test_random_chunks(frames, data):
    raw = stream(frames)
    cuts = data.draw(st.lists(st.integers(0, max(len(raw), 1)), max_size=20), label="cuts")
    assert feed_chunks(split_at(raw, cuts)) == frames


@settings(max_examples=100, deadline=None, print_blob=True)
@given(frames_st.filter(bool), st.data())
def test_trailing_partial_frame_is_held_back(frames, data):
    raw = stream(frames)
    last = encode_frame(*frames[-1])
    keep = data.draw(st.integers(0, len(last) - 1), label="bytes of the last frame sent")
    decoder = FrameDecoder()
    head = raw[: len(raw) - len(last) + keep]
    assert decoder.feed(head) == frames[:-1]
    assert decoder.buffered == keep
    assert decoder.feed(last[keep:]) == frames[-1:]
    assert decoder.buffered == 0


def test_many_frames_in_one_feed():
    frames = [(Kind.CALL, i, i % 7, str(i).encode()) for i in range(5000)]
    decoder = FrameDecoder()
    data = stream(frames) + encode_frame(Kind.CALL, 5000, 0, b"partial")[:-3]
    assert decoder.feed(data) == frames
    assert decoder.buffered == HEADER_SIZE + 4
    assert decoder.feed(b"ial") == [(Kind.CALL, 5000, 0, b"partial")]


@pytest.mark.parametrize("kind", [0, 15, 0x7F, 0xFF])
def test_unknown_kind_raises_on_the_header_before_the_payload(kind):
    header = wire.HEADER.pack(1000, kind, 5, 0)
    decoder = FrameDecoder()
    for b in header[:-1]:  # an incomplete header is just waited for
        assert decoder.feed(bytes([b])) == []
    with pytest.raises(FrameError) as info:
        decoder.feed(header[-1:])
    assert f"unknown frame kind {kind}" in str(info.value)
    assert repr(header) in str(info.value)


def test_unknown_kind_after_good_frames():
    header = wire.HEADER.pack(0, 15, 1, 0)
    with pytest.raises(FrameError, match="unknown frame kind 15"):
        FrameDecoder().feed(encode_frame(Kind.CALL, 1, 0, b"[]") + header)


def test_oversize_length_raises_on_the_header_before_the_payload():
    decoder = FrameDecoder(max_frame_bytes=100)
    assert decoder.feed(encode_frame(Kind.CALL, 1, 0, b"x" * 100)) == [(Kind.CALL, 1, 0, b"x" * 100)]
    header = wire.HEADER.pack(101, Kind.CALL, 2, 0)
    with pytest.raises(FrameError) as info:
        decoder.feed(header)
    assert "frame of 101 bytes exceeds max_frame_bytes 100" in str(info.value)
    assert repr(header) in str(info.value)


def test_huge_length_at_the_default_limit():
    header = wire.HEADER.pack(2**32 - 1, Kind.RESULT, 1, 0)
    with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
        FrameDecoder().feed(header)


def test_length_at_the_limit_waits_for_the_payload():
    decoder = FrameDecoder(max_frame_bytes=100)
    assert decoder.feed(wire.HEADER.pack(100, Kind.CALL, 2, 0) + b"x" * 99) == []
    assert decoder.buffered == HEADER_SIZE + 99
    assert decoder.feed(b"y") == [(Kind.CALL, 2, 0, b"x" * 99 + b"y")]


# --- HELLO ---------------------------------------------------------------------------------


def test_decode_hello_round_trip():
    hello = wire.Hello(
        pid=123, slot=2, concurrency=10,
        methods=[wire.MethodInfo("add", {"type": "object"}, "a + b"), wire.MethodInfo("echo")],
    )
    got = decode_hello(msgspec.json.encode(hello))
    assert got == hello
    assert got.methods[1] == wire.MethodInfo("echo", {}, "")


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"not json",
        b"[]",
        b'{"wire":8,"pid":1,"slot":0,"methods":[]}',  # concurrency missing
        b'{"wire":8,"pid":"1","slot":0,"methods":[],"concurrency":1}',  # pid a string
        b'{"wire":8,"pid":1,"slot":0,"methods":{},"concurrency":1}',  # methods not a list
        b'{"wire":8,"pid":1,"slot":0,"methods":[{"doc":"x"}],"concurrency":1}',  # method without name
        b'{"wire":8,"pid":1,"slot":0,"methods":[],"concurrency":1,"extra":true}',  # unknown field
        b'{"wire":8,"pid":1,"slot":0,"methods":[],"concurrency":1.5}',
        b'{"wire":8,"pid":1,"slot":0,"methods":[],"concurrency":1}x',
    ],
)
def test_decode_hello_rejects_bad_payloads(payload):
    with pytest.raises(FrameError, match="bad HELLO"):
        decode_hello(payload)


def test_a_call_frame_carries_its_deadline_and_flow_before_its_params():
    """CALL, NOTIFY and CHUNK payloads start with the call's deadline, a big-endian f64
    of CLOCK_MONOTONIC seconds (inf: none), and its flow (its connection's number, u32),
    packed with the header by `CALL_HEADER`."""
    frame = encode_call(Kind.CALL, 7, 3, b"[1, 2]", 12345.5, 0xFFFFFFFF)
    assert frame == wire.HEADER.pack(18, Kind.CALL, 7, 3) + struct.pack(">dI", 12345.5, 0xFFFFFFFF) + b"[1, 2]"
    assert wire.CALL_HEADER.size == HEADER_SIZE + wire.DEADLINE.size
    [(kind, call_id, aux, payload), _] = FrameDecoder().feed(frame + encode_call(Kind.NOTIFY, 8, 0))
    deadline, flow = wire.DEADLINE.unpack_from(payload)
    assert (kind, call_id, aux, deadline, flow, payload[12:]) == (Kind.CALL, 7, 3, 12345.5, 0xFFFFFFFF, b"[1, 2]")
    assert wire.DEADLINE.unpack(encode_call(Kind.NOTIFY, 8, 0)[HEADER_SIZE:]) == (math.inf, 0)


def test_a_hello_of_another_wire_version_is_told_apart_whatever_fields_it_has():
    """Hostile testing (round 21): a newer worker's HELLO with a field this broker does not
    know was refused as a malformed HELLO ("unknown field"), and the broker said the app
    could not load. Its version is read first, whatever else it holds."""
    newer = b'{"pid": 7, "slot": 1, "methods": [], "concurrency": 1, "wire": 9, "resumable": true}'
    with pytest.raises(wire.WireMismatch, match=r"worker 1 \(pid 7\) speaks wire version 9, this broker 8") as info:
        decode_hello(newer)
    assert (info.value.pid, info.value.slot, info.value.version) == (7, 1, 9)
    before_flows = b'{"pid": 7, "slot": 1, "methods": [], "concurrency": 1, "wire": 2}'  # (calls without a flow)
    with pytest.raises(wire.WireMismatch, match="speaks wire version 2, this broker 8"):
        decode_hello(before_flows)
    before_return = b'{"pid": 7, "slot": 1, "methods": [], "concurrency": 1, "wire": 3}'  # (no RETURN)
    with pytest.raises(wire.WireMismatch, match="speaks wire version 3, this broker 8"):
        decode_hello(before_return)
    before_ids = b'{"pid": 7, "slot": 1, "methods": [], "concurrency": 1, "wire": 4}'  # (chunks without ids)
    with pytest.raises(wire.WireMismatch, match="speaks wire version 4, this broker 8"):
        decode_hello(before_ids)
    before_alone = b'{"pid": 7, "slot": 1, "methods": [], "concurrency": 1, "wire": 5}'  # (no ALONE, HOLD)
    with pytest.raises(wire.WireMismatch, match="speaks wire version 5, this broker 8"):
        decode_hello(before_alone)
    before_blocked = b'{"pid": 7, "slot": 1, "methods": [], "concurrency": 1, "wire": 6}'  # (no BLOCKED)
    with pytest.raises(wire.WireMismatch, match="speaks wire version 6, this broker 8"):
        decode_hello(before_blocked)
    before_starts = b'{"pid": 7, "slot": 1, "methods": [], "concurrency": 1, "wire": 7}'  # (no STARTS, no turns)
    with pytest.raises(wire.WireMismatch, match="speaks wire version 7, this broker 8"):
        decode_hello(before_starts)
    older = b'{"pid": 7, "slot": 1, "methods": [{"name": "a"}], "concurrency": 1}'  # (no version: 1's)
    with pytest.raises(wire.WireMismatch, match="speaks wire version 1"):
        decode_hello(older)
    same = b'{"pid": 7, "slot": 1, "methods": [], "concurrency": 1, "wire": 8, "resumable": true}'
    with pytest.raises(FrameError, match="bad HELLO") as bad:
        decode_hello(same)
    assert type(bad.value) is FrameError
    ok = decode_hello(b'{"pid": 7, "slot": 1, "methods": [], "concurrency": 1, "wire": 8}')
    assert (ok.pid, ok.slot, ok.wire) == (7, 1, 8)


@given(st.lists(st.tuples(st.integers(0, wire.MAX_METHODS), st.booleans(), st.binary(max_size=40)), max_size=20),
       st.data())
def test_a_chunk_and_its_answers_round_trip(calls, data):
    """broker/chunk.py: what the broker writes of a chunk the worker reads back, call by
    call; a reload's new method indexes replace the old in place; the answers a worker adds
    are read back in order, and counted."""
    from msgspec import Raw

    from broker import chunk
    from broker.dispatch import Route
    from broker.jsonrpc import Request

    def entries(methods):
        return [(-1 if note else i, Request("2.0", "m", Raw(params), Raw(b"%d" % i)), Route(m, 1.0))
                for i, (m, (_, note, params)) in enumerate(zip(methods, calls))]

    payload, slots, ids, methods = chunk.encode_requests(entries([m for m, _, _ in calls]))
    assert methods == [m for m, _, _ in calls] and [bytes(i) for i in ids] == [b"%d" % i for i in range(len(calls))]
    assert slots == [-1 if note else i for i, (_, note, _) in enumerate(calls)]
    pos, read = 0, []
    for _ in calls:
        method, notification, start, end = chunk.read_call(payload, pos)
        read.append((method, notification, payload[start:end]))
        pos = end
    assert read == calls and pos == len(payload)
    new = data.draw(st.lists(st.integers(0, wire.MAX_METHODS), min_size=len(calls), max_size=len(calls)))
    assert chunk.with_methods(payload, new) == chunk.encode_requests(entries(new))[0]
    unsent = bytearray()
    bodies = [(i, wire.RESULT if i % 2 else wire.ERROR, p) for i, (_, _, p) in enumerate(calls)]
    for place, kind, body in bodies:
        chunk.add_answer(unsent, place, kind, body)
    assert [(place, kind, bytes(unsent[s:e])) for place, kind, s, e in chunk.answers(bytes(unsent))] == bodies
    assert chunk.count_answers(bytes(unsent)) == len(bodies)
