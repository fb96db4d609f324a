"""Fuzz harness: the NDJSON front-end, bytes in, through a real `StreamProtocol` in memory.

Input: `harness.plan`'s (flags, pieces). The pieces are what the client sends, fed to the
protocol read by read as the loop would (none while its reading is paused) on a
`frontends.MemoryTransport`, its listener's dispatcher an `EchoDispatcher`. Flags:

    bit 0  the client half-closes after its last piece (EOF), else it just goes
    bit 1  the client reads slowly: every write fills the transport's buffer (pause_writing),
           which drains a loop iteration later (bit 7: three)
    bit 2  calls are answered in the next loop iteration (else at once)
    bit 3  max_body_bytes 64 (else the default, 1 MiB)
    bit 4  max_batch 3 (else 1000)
    bit 5  max_response_bytes 256 (else 32 MiB): lines wait undispatched, one at a time
    bit 6  max_incoming_bytes 512 (else none): lines refused -32000

Checked (`frontends`): no exception escapes a call or a loop callback; the loop idles, and
reading is never paused for good; nothing is written after the close; the output is whole
lines, each a JSON-RPC response or an array of them (`check_answers`: ids null or the input's,
no call answered twice); every call the dispatcher answered is written, unless its connection
was gone first; the output is at most `AMPLIFICATION` times the input (memory linear in the
size); time is linear in the size (`harness.timed`).

Run: `python -m fuzz.ndjson_frontend [libFuzzer flags] [CORPUS_DIR]` (`make fuzz` does).
"""

from __future__ import annotations

import typing

from fuzz.harness import instrumented, json_suite, main, spec_bodies, with_plans

with instrumented(__name__ == "__main__"):
    from broker.dispatch import Dispatcher
    from broker.frontend.base import Incoming
    from broker.frontend.stream import StreamFrontend, StreamProtocol
    from fuzz.frontends import EchoDispatcher, Flags, RecordingCodec, connection_check

__all__ = ["AMPLIFICATION", "check", "seeds"]

# Bytes of output an input byte may cause, plus a constant: an invalid element of 2 bytes
# (`1,`) is answered with about 120 (a -32600 saying why).
AMPLIFICATION = 100
AMPLIFICATION_BASE = 4096


def _make(dispatcher: EchoDispatcher, options: Flags) -> tuple[StreamProtocol, RecordingCodec]:
    fe = StreamFrontend(
        typing.cast(Dispatcher, dispatcher),
        transport="unix",
        max_body_bytes=options.max_body_bytes,
        incoming=Incoming(options.max_incoming_bytes) if options.max_incoming_bytes else None,
    )
    codec = fe.codec = RecordingCodec(options.max_batch)
    return StreamProtocol(fe), codec


def _answers(out: bytes) -> list[bytes]:
    assert not out or out.endswith(b"\n"), f"an answer line left unfinished: {out[-200:]!r}"
    return out.split(b"\n")[:-1]


check = connection_check(_make, _answers, (AMPLIFICATION, AMPLIFICATION_BASE), "a `StreamProtocol`")


def seeds() -> list[bytes]:
    """The specification's example bodies and the JSONTestSuite files as lines (their own
    newlines made spaces), each alone and all in one stream, under each chunk plan and a few
    flags; and a few lines that are not JSON-RPC (an HTTP request line, a TLS-like byte)."""
    lines = [b.replace(b"\n", b" ").replace(b"\r", b" ") + b"\n" for b in spec_bodies() + json_suite()[::4]]
    lines += [b"POST / HTTP/1.1\r\n", b"\x16\x03\x01\x00", b'{"jsonrpc":"2.0","method":"a","id":1}\r\n\n\n']
    out: list[bytes] = []
    for line in lines:
        out += with_plans(line, 1)
    everything = b"".join(lines[:20])
    for flags in (0, 1, 3, 5, 7, 0x25, 0x49, 0x87, 0x11):
        out += with_plans(everything, flags)
    return out


if __name__ == "__main__":
    main("ndjson_frontend", check, seeds)
