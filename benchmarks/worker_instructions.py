"""The worker's cost in CPU instructions per call, which a shared machine's noise does not move.

Usage: .venv/bin/python benchmarks/worker_instructions.py [--against TREE] [--small 4000] [--large 24000]
                                                        [--case both|single|chunk]

`benchmarks/hotpath_instructions.py` counts the front-end; this counts the other side: a
`WorkerProtocol` on one end of a socketpair, in this process, running pipelined CALL frames
of a trivial sync handler (`add`) sent 200 at a time, and a reader taking its RESULT frames
(`--case chunk`: CHUNK frames of 50 such calls with their ids, as a batch of 100 reaches each
of 2 workers, 4 a write, and their CHUNK_REPLY or CHUNK_RESULTS frames; in slices long enough
that no chunk is cut into parts, as at full speed).
Run under valgrind's callgrind at two sizes; the difference of the two counts over the
difference in calls is the instructions per call, start-up cancelled. Everything the worker
does for a call is in it: decoding the frame, the deadline check, binding the params, the
handler, encoding the result, the reply frame and its share of the writes (and the thread
that sends answers held behind a blocking handler, `_send_held`, asleep between its checks).
With `--against TREE` (another checkout, for example a `git worktree` at an older commit)
the same driver runs that tree's `broker` package too, and the ratio is printed. Needs
`valgrind` on the PATH; about a minute a run. Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from hotpath_instructions import callgrind_total, compared, valgrind_missing  # (this directory)

HERE = Path(__file__).resolve().parent
BATCH = 200  # CALL frames per write

# Run in a child with the tree's `broker` first on sys.path: N calls of `add`, BATCH a write.
_DRIVER = r"""
import asyncio, socket, sys, types
import uvloop
from broker import chunk, wire
from broker.worker import Registry, WorkerProtocol, chunks, held, runtime

registry = Registry()


@registry.method
def add(a: int, b: int) -> int:
    return a + b


async def main(calls: int, batch: int) -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    worker = WorkerProtocol(registry, slot=0, concurrency=10)
    transport, _ = await loop.create_unix_connection(lambda: worker, sock=ours)
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    frames = wire.FrameDecoder(1 << 24)
    while not frames.feed(await reader.read(65536)):  # the HELLO
        pass
    answered, call_id = 0, 1
    if CHUNK:  # (the tree's own CHUNK layout: `encode_requests` reads only these attributes)
        # The times that decide when a chunk's answers go out in parts, as at full speed
        # (50 `add` take about 0.2 ms): under callgrind every call takes some 50 times as
        # long, and now and then one 1 ms, and the 2 ms slices, the 1 ms of a slow sync call
        # and the 5 ms of a held handler (`_send_held`'s thread) would cut chunks into parts,
        # which a worker at full speed does not send.
        runtime.SLICE_SECONDS = 1.0
        chunks._SLOW_SYNC_S = 1.0
        held.HELD_SECONDS = 1.0
        calls_of = [(i, types.SimpleNamespace(params=b"[1, 2]", id=b"%d" % i), types.SimpleNamespace(method_index=0))
                    for i in range(CHUNK)]
        entries = chunk.encode_requests(calls_of)[0]
        for _ in range(calls // (batch * CHUNK)):
            writer.write(b"".join(wire.encode_call(wire.Kind.CHUNK, call_id + i, CHUNK, entries) for i in range(batch)))
            call_id += batch
            while answered < call_id - 1:
                answered += sum(1 for f in frames.feed(await reader.read(1 << 20)) if f[0] in ENDS)
    else:
        for _ in range(calls // batch):
            writer.write(b"".join(wire.encode_call(wire.Kind.CALL, call_id + i, 0, b"[1, 2]") for i in range(batch)))
            call_id += batch
            while answered < call_id - 1:
                answered += len(frames.feed(await reader.read(1 << 20)))
    transport.close()
    writer.close()


CHUNK = int(sys.argv[3])
ENDS = {wire.Kind.CHUNK_REPLY, getattr(wire.Kind, "CHUNK_RESULTS", wire.Kind.CHUNK_REPLY)}
uvloop.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""
CHUNK_CALLS = 50  # calls a CHUNK frame (--case chunk)
CHUNK_BATCH = 4  # CHUNK frames a write


def instructions(tree: Path, calls: int, case: str = "single") -> int:
    """Instructions callgrind counts for `calls` calls through `tree`'s worker, single calls
    (`case` "single") or in chunks ("chunk")."""
    chunk_args = [str(CHUNK_BATCH), str(CHUNK_CALLS)] if case == "chunk" else [str(BATCH), "0"]
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", _DRIVER,
         str(calls), *chunk_args],
        cwd=tree, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)},
    )
    return callgrind_total(done.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another rpc-broker checkout to compare with")
    parser.add_argument("--small", type=int, default=4000, help="calls of the small run (a multiple of 200)")
    parser.add_argument("--large", type=int, default=24000, help="calls of the large run (a multiple of 200)")
    parser.add_argument("--case", choices=["both", "single", "chunk"], default="both")
    args = parser.parse_args()
    if valgrind_missing():
        return 2
    trees = [HERE.parent] + ([args.against.resolve()] if args.against else [])
    print(f"worker instructions per call, in-process (callgrind; sync `add`, {BATCH} pipelined CALL frames a write,"
          f" or {CHUNK_BATCH} CHUNK frames of {CHUNK_CALLS} calls)")
    for case in ("single", "chunk") if args.case == "both" else (args.case,):
        figures = [(instructions(t, args.large, case) - instructions(t, args.small, case)) / (args.large - args.small)
                   for t in trees]
        print(compared(case, figures, trees))
    return 0


if __name__ == "__main__":
    sys.exit(main())
