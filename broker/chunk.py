"""The batch chunk, sans-IO: several calls of one batch as one unit on the worker wire,
and their answers (the frames' layout: wire.py's docstring, CHUNK, CHUNK_PART, CHUNK_REPLY).

A CHUNK payload is, per call, a `CALL_ENTRY` (method index u16, flags u8, params length
u32) then the raw params; a CHUNK_PART or CHUNK_REPLY payload is, per answer, a
`REPLY_ENTRY` (the call's place in the chunk u32, kind u8: RESULT or ERROR, length u32)
then the raw result or error object. The broker writes chunks (`encode_requests`, `with_methods`)
and reads their answers (`answers`, `count_answers`); a worker reads chunks (`read_call`)
and writes answers (`add_answer`).

The hot loops of both sides (`dispatch.Dispatcher._fill_chunk`, `worker.chunks`'s
`_advance`) read the entries inline, with these structs, rather than call here once an
entry: a call costs about 60 ns, per call of every batch.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator

from broker.wire import CALL_ENTRY, NOTIFY_FLAG, REPLY_ENTRY

__all__ = ["add_answer", "answers", "count_answers", "encode_requests", "large_params", "read_call", "with_methods"]


def encode_requests(entries: list[tuple[int, typing.Any, typing.Any]]) -> tuple[bytes, list[int], list[typing.Any], list[int]]:
    """A CHUNK payload of the dispatcher's entries, (slot, `jsonrpc.Request`,
    `calls.Route`) each (slot < 0: a notification), with their slots, raw ids and method
    indexes in order: one pass (the dispatcher's hot path: three more passes cost 4.6 % of a
    batched call's instructions, benchmarks/hotpath_instructions.py)."""
    slots = []
    ids = []
    methods = []
    payload = bytearray()
    pack = CALL_ENTRY.pack
    for slot, request, route in entries:
        params = request.params
        payload += pack(route.method_index, 0 if slot >= 0 else NOTIFY_FLAG, len(params))
        payload += params
        slots.append(slot)
        ids.append(request.id)
        methods.append(route.method_index)
    return bytes(payload), slots, ids, methods


def with_methods(payload: bytes, methods: list[int]) -> bytes:
    """The CHUNK `payload` with its calls' method indexes replaced by `methods`, in order
    (a reload's new method table: `Dispatcher.set_methods`)."""
    out = bytearray(payload)
    size = CALL_ENTRY.size
    pos = 0
    for method in methods:
        _old, flags, length = CALL_ENTRY.unpack_from(out, pos)
        CALL_ENTRY.pack_into(out, pos, method, flags, length)
        pos += size + length
    return bytes(out)


def large_params(payload: bytes, least: int) -> int:
    """The bytes of the params of the calls of CHUNK `payload` that have `least` bytes of
    params or more each, together (0 if none has): what of it counts against a worker's
    bound on large params in flight (`dispatch.Dispatcher`, max_worker_params_bytes). O(its
    calls)."""
    unpack = CALL_ENTRY.unpack_from
    size = CALL_ENTRY.size
    end = len(payload)
    pos = 0
    total = 0
    while pos < end:
        _method, _flags, length = unpack(payload, pos)
        if length >= least:
            total += length
        pos += size + length
    return total


def read_call(payload: bytes, pos: int) -> tuple[int, bool, int, int]:
    """The call of a CHUNK payload at `pos`: (method index, notification?, params start,
    params end); the next call is at params end. Raises `struct.error` past the end."""
    method, flags, length = CALL_ENTRY.unpack_from(payload, pos)
    start = pos + CALL_ENTRY.size
    return method, bool(flags & NOTIFY_FLAG), start, start + length


def add_answer(unsent: bytearray, place: int, kind: int, body: bytes) -> None:
    """Append the answer of the chunk's call at `place` (RESULT or ERROR `kind`, its raw
    JSON `body`) to a CHUNK_PART or CHUNK_REPLY payload under way."""
    unsent += REPLY_ENTRY.pack(place, kind, len(body))
    unsent += body


def answers(payload: bytes) -> Iterator[tuple[int, int, int, int]]:
    """The answers of a CHUNK_PART or CHUNK_REPLY payload: (place, kind, body start, body
    end) each. A truncated last entry is not read."""
    unpack = REPLY_ENTRY.unpack_from
    size = REPLY_ENTRY.size
    end = len(payload)
    pos = 0
    while pos + size <= end:
        place, kind, length = unpack(payload, pos)
        pos += size
        yield place, kind, pos, pos + length
        pos += length


def count_answers(payload: bytes) -> int:
    """How many answers a CHUNK_PART or CHUNK_REPLY payload holds."""
    unpack = REPLY_ENTRY.unpack_from
    size = REPLY_ENTRY.size
    end = len(payload)
    pos = count = 0
    while pos + size <= end:
        pos += size + unpack(payload, pos)[2]
        count += 1
    return count
