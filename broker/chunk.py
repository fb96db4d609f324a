"""The batch chunk, sans-IO: several calls of one batch as one unit on the worker wire,
and their answers (the frames' layout: wire.py's docstring, CHUNK, CHUNK_PART, CHUNK_REPLY, CHUNK_RESULTS).

A CHUNK payload is, per call, a `CALL_ENTRY` (method index u16, flags u8, id length u32,
params length u32) then the client's raw id and the raw params; a CHUNK_PART or CHUNK_REPLY
payload is, per answer, a `REPLY_ENTRY` (the call's place in the chunk u32, kind u8: RESULT
or ERROR, length u32) then the raw result or error object; a CHUNK_RESULTS payload is the
chunk's finished Response objects, one per call in order, separated by `\n` (`results`,
`results_payload`, `entries_of`). The broker writes chunks (`encode_requests`, `with_methods`)
and reads their answers (`answers`, `count_answers`, `results`); a worker reads chunks
(`read_call`) and writes answers (`add_answer`, `results_payload`).

The hot loops of both sides (`replies.Replies._fill_chunk`, `worker.chunks`'s `_advance`)
read and write the entries and objects inline, with these structs and pieces, rather than
call here once an entry: a call costs about 60 ns, per call of every batch.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator

from broker.jsonrpc import _RESP_HEAD, _RESULT
from broker.wire import CALL_ENTRY, NOTIFY_FLAG, REPLY_ENTRY, RESULT

__all__ = [
    "RESULT_HEAD", "RESULT_MID", "add_answer", "answers", "count_answers", "encode_requests", "entries_of", "large_params",
    "read_call", "results", "results_payload", "with_methods",
]

# A result's Response object is RESULT_HEAD, its raw id, RESULT_MID, the raw result and `}`
# (`jsonrpc.response_result`'s pieces, which both sides of a CHUNK_RESULTS splice).
RESULT_HEAD = _RESP_HEAD
RESULT_MID = _RESULT
_RESULTS_SEP = b"\n"
_RESULTS_NEXT = b"}\n" + RESULT_HEAD  # (between two calls' id and result)


def encode_requests(entries: list[tuple[int, typing.Any, typing.Any]]) -> tuple[bytes, list[int], list[typing.Any], list[int]]:
    """A CHUNK payload of the dispatcher's entries, (slot, `jsonrpc.Request`,
    `calls.Route`) each (slot < 0: a notification, whose id is empty), with their slots, raw
    ids and method indexes in order: one pass (the dispatcher's hot path: three more passes
    cost 4.6 % of a batched call's instructions, benchmarks/hotpath_instructions.py)."""
    slots = []
    ids = []
    methods = []
    payload = bytearray()
    pack = CALL_ENTRY.pack
    for slot, request, route in entries:
        params = request.params
        id_ = request.id if slot >= 0 else b""
        payload += pack(route.method_index, 0 if slot >= 0 else NOTIFY_FLAG, len(id_), len(params))
        payload += id_
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
        _old, flags, id_length, length = CALL_ENTRY.unpack_from(out, pos)
        CALL_ENTRY.pack_into(out, pos, method, flags, id_length, length)
        pos += size + id_length + length
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
        _method, _flags, id_length, length = unpack(payload, pos)
        if length >= least:
            total += length
        pos += size + id_length + length
    return total


def read_call(payload: bytes, pos: int) -> tuple[int, bool, int, int]:
    """The call of a CHUNK payload at `pos`: (method index, notification?, params start,
    params end); its raw id is from `pos + CALL_ENTRY.size` to params start, and the next
    call is at params end. Raises `struct.error` past the end."""
    method, flags, id_length, length = CALL_ENTRY.unpack_from(payload, pos)
    start = pos + CALL_ENTRY.size + id_length
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


def results_payload(answers: list[bytes]) -> bytes:
    """A CHUNK_RESULTS payload of `answers`: a call's raw id, then its raw result, for each
    call of the chunk in order (compact JSON, with no `\n` in either). The objects are made
    by C code: a join per call, and one for all."""
    pairs = iter(answers)
    return b"".join((RESULT_HEAD, _RESULTS_NEXT.join(map(RESULT_MID.join, zip(pairs, pairs))), b"}"))


def results(payload: bytes, count: int) -> list[bytes] | None:
    """The `count` Response objects of a CHUNK_RESULTS payload, in the chunk's order;
    None if it does not hold that many (a broken worker's: the caller answers them
    -32603)."""
    parts = payload.split(_RESULTS_SEP)
    return parts if len(parts) == count else None


def entries_of(parts: list[bytes], ids: list[typing.Any]) -> bytes | None:
    """A CHUNK_REPLY payload of the same answers as the Response objects `parts` (a
    CHUNK_RESULTS's, `results`), whose ids are `ids` (the broker's own, as sent): each
    checked to be RESULT_HEAD, its id, RESULT_MID, a result and `}`, else None. For the
    slow paths, which read answers one by one (`Replies._fill_chunk`)."""
    out = bytearray()
    pack = REPLY_ENTRY.pack
    tail = len(RESULT_MID)
    for place, (part, id_) in enumerate(zip(parts, ids)):
        start = len(RESULT_HEAD) + len(id_) + tail
        if not (part.startswith(RESULT_HEAD) and part.endswith(b"}") and part[len(RESULT_HEAD) : start] == bytes(id_) + RESULT_MID):
            return None
        out += pack(place, RESULT, len(part) - start - 1)
        out += part[start:-1]
    return bytes(out)
