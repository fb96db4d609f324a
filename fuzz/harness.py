"""What the fuzz harnesses share: seeds, the chunk plan, the slow-input check, the atheris main.

Sources: libFuzzer's manual (https://llvm.org/docs/LibFuzzer.html: flags `-max_total_time`,
`-timeout`, `-rss_limit_mb`, `-max_len`, `-artifact_prefix`, `-print_final_stats`; a corpus
directory is read at start and grown with inputs that find new coverage) and atheris's README
(https://github.com/google/atheris: `atheris.Setup(sys.argv, TestOneInput)`, `atheris.Fuzz()`,
`atheris.instrument_imports()` around the imports whose code is to be covered).

This module imports no `broker` code (a harness imports it first, then the broker's modules
inside `instrumented`, so that they are instrumented when fuzzing) and no atheris at import
time (the replay test runs the harnesses' `check` functions without it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

__all__ = [
    "DATA",
    "REGRESSIONS",
    "ROOT",
    "WORK",
    "SlowInput",
    "cut",
    "instrumented",
    "json_suite",
    "linear_budget",
    "main",
    "plan",
    "spec_bodies",
    "split",
    "timed",
    "with_plans",
]

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
REGRESSIONS = DATA / "fuzz"  # tests/data/fuzz/<harness>/: inputs found, replayed by the test suite
WORK = Path(os.environ.get("FUZZ_WORK") or ROOT / ".fuzz")  # .fuzz/<harness>/corpus (gitignored): each
# harness's libFuzzer corpus; FUZZ_WORK: another directory (the suite's run of `make fuzz`'s runner)

# -- the slow-input detector -------------------------------------------------------------
# libFuzzer's -timeout catches an input that hangs; this catches one that is merely
# superlinear: an input of `LINEAR_FROM_BYTES` or more must be processed within a fixed
# budget plus an allowance per KiB and per piece it was fed in (a piece costs a
# data_received call). Measured on this thread's CPU time (time.thread_time: another
# process on a busy machine does not count), with atheris's instrumentation: about 100
# times what a normal input takes (benchmarks/RESULTS.md, "Fuzzing"), so it never fires on
# a normal input, and a quadratic one of a few KiB passes it.
LINEAR_FROM_BYTES = 1024
BASE_SECONDS = 0.5
PER_KIB_SECONDS = 0.05
PER_PIECE_SECONDS = 0.002


class SlowInput(AssertionError):
    """An input took more CPU time than `linear_budget` allows for its size."""


def linear_budget(size: int, pieces: int = 1) -> float:
    """The CPU seconds an input of `size` bytes fed in `pieces` pieces may take."""
    return BASE_SECONDS + PER_KIB_SECONDS * size / 1024 + PER_PIECE_SECONDS * pieces


def timed(check: Callable[[bytes], int]) -> Callable[[bytes], None]:
    """`check` (which returns the number of pieces it fed the input in) wrapped so that it
    raises `SlowInput` when an input of `LINEAR_FROM_BYTES` or more takes longer than
    `linear_budget` of CPU time on this thread."""

    def run(data: bytes) -> None:
        began = time.thread_time()
        pieces = check(data)
        took = time.thread_time() - began
        if len(data) >= LINEAR_FROM_BYTES and took > linear_budget(len(data), pieces):
            raise SlowInput(
                f"{len(data)} bytes in {pieces} pieces took {took * 1000:.1f} ms of CPU"
                f" (budget {linear_budget(len(data), pieces) * 1000:.1f} ms)"
            )

    run.__doc__ = check.__doc__
    return run


# -- the chunk plan ----------------------------------------------------------------------
HEADER_BYTES = 2  # flags, then how many piece sizes follow (0-7)
MAX_SIZES = 7


def split(data: bytes) -> tuple[int, list[int], bytes]:
    """A harness input's (flags, piece sizes, stream): byte 0 is the harness's flags, byte
    1 % 8 the count n of piece sizes that follow (each a byte: a piece of 1 to 256 bytes),
    and the rest is the stream."""
    if len(data) < HEADER_BYTES:
        return (data[0] if data else 0), [], b""
    n = data[1] % (MAX_SIZES + 1)
    sizes = [b + 1 for b in data[HEADER_BYTES:HEADER_BYTES + n]]
    return data[0], sizes, data[HEADER_BYTES + len(sizes):]


def cut(stream: bytes, sizes: list[int]) -> list[bytes]:
    """`stream` cut into pieces of `sizes` in turn (no sizes: one piece; none if empty)."""
    if not sizes:
        return [stream] if stream else []
    pieces = []
    at = i = 0
    while at < len(stream):
        size = sizes[i % len(sizes)]
        pieces.append(stream[at:at + size])
        at += size
        i += 1
    return pieces


def plan(data: bytes) -> tuple[int, list[bytes]]:
    """A harness input as (flags, pieces): its stream (`split`) cut into pieces of its sizes
    in turn. So the fuzzer chooses the boundaries, and rare chunkings (one byte at a time,
    a boundary inside a CRLF) are explored as inputs of their own."""
    flags, sizes, stream = split(data)
    return flags, cut(stream, sizes)


# Chunk plans each seed is written with: whole, byte by byte, and an irregular one.
SEED_PLANS = (b"\x00\x00", b"\x00\x01\x00", b"\x00\x03\x06\x00\x3f")


def with_plans(stream: bytes, flags: int = 0) -> Iterator[bytes]:
    """`stream` as harness inputs, under each of `SEED_PLANS` (with `flags`)."""
    for header in SEED_PLANS:
        yield bytes([flags]) + header[1:] + stream


# -- seeds ---------------------------------------------------------------------------------


def json_suite() -> list[bytes]:
    """The JSONTestSuite parsing files (tests/data/JSONTestSuite/test_parsing), sorted by name."""
    return [p.read_bytes() for p in sorted((DATA / "JSONTestSuite" / "test_parsing").iterdir())]


def spec_bodies() -> list[bytes]:
    """The request bodies of the JSON-RPC 2.0 specification's examples
    (tests/data/spec_examples/*.txt: each `-->` line and its continuation lines)."""
    bodies = []
    for path in sorted((DATA / "spec_examples").glob("*.txt")):
        body: list[str] | None = None
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("-->"):
                if body is not None:
                    bodies.append("\n".join(body).encode())
                body = [line[3:].strip()]
            elif line.startswith(("<--", "#")):
                if body is not None:
                    bodies.append("\n".join(body).encode())
                body = None
            elif body is not None:
                body.append(line.strip())
        if body is not None:
            bodies.append("\n".join(body).encode())
    return [b for b in bodies if b]


def regressions(name: str) -> list[Path]:
    """The files kept under tests/data/fuzz/<name>/ (crashes and slow inputs found), sorted."""
    folder = REGRESSIONS / name
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")) if folder.is_dir() else []


# -- running under atheris ---------------------------------------------------------------


def instrumented(active: bool) -> contextlib.AbstractContextManager[object]:
    """A context for a harness's `broker` imports: atheris's `instrument_imports` limited to
    the broker's own modules when `active` (the harness runs as the fuzzer's main module),
    else nothing (replayed by the tests, atheris need not be installed)."""
    if not active:
        return contextlib.nullcontext()
    import atheris

    return typing.cast(contextlib.AbstractContextManager[object], atheris.instrument_imports(include=["broker"]))


def main(name: str, check: Callable[[bytes], None], seeds: Callable[[], Iterable[bytes]]) -> None:
    """Run `check` under atheris with this process's command line (libFuzzer's flags; the
    Makefile's `fuzz` target passes -max_total_time, -timeout, -rss_limit_mb, -max_len,
    -artifact_prefix and -print_final_stats). With no corpus directory given, .fuzz/<name>/corpus
    is used, seeded (when empty) from `seeds()` and the regression files of tests/data/fuzz/<name>/:
    copies, so the fuzzer never writes into tests/data."""
    import atheris

    argv = list(sys.argv)
    if not any(not a.startswith("-") for a in argv[1:]):
        corpus = WORK / name / "corpus"
        corpus.mkdir(parents=True, exist_ok=True)
        if not any(corpus.iterdir()):
            for i, seed in enumerate(seeds()):
                (corpus / f"seed-{i:04d}").write_bytes(seed)
            for path in regressions(name):
                shutil.copyfile(path, corpus / f"regression-{path.name}")
        argv.append(str(corpus))
    atheris.Setup(argv, check)
    atheris.Fuzz()
