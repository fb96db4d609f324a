"""Seconds `Method.bind` takes on params of numbers msgspec reads slowly (`1e308`) and on ordinary ones.

Usage: .venv/bin/python benchmarks/slow_numbers.py [--against TREE] [--rounds 3]

Binds each case's params (about 1 MiB, or 8 KiB) to a method of tests/apps/bignums.py, the
best of `--rounds`, in a child process per tree (this one, and `--against TREE`: another
checkout, e.g. a `git worktree` of main, whose `broker` package is imported instead), and
prints the seconds side by side with what the binding said, and the cost of
`slow_numbers` alone on this tree (broker/worker/slow_numbers.py). Hostile testing, round
136, F2. Wall-clock figures on a shared machine: compare the columns of one run. Prints
figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
MIB = (1 << 20) - 100


def _array(token: bytes, size: int = MIB) -> bytes:
    return b"[" + b",".join([token] * ((size - 1) // (len(token) + 1))) + b"]"


CASES: dict[str, tuple[str, bytes]] = {
    "1 MiB of 1e308 to mark(tag: str, ...)": ("mark", _array(b"1e308")),
    "1 MiB of 1e308 to total(list[float])": ("total", b"[" + _array(b"1e308", MIB - 2) + b"]"),
    "8 KiB of 1e308 to mark (not counted)": ("mark", _array(b"1e308", 8 * 1024)),
    "1 MiB of 1.5 to total(list[float])": ("total", b"[" + _array(b"1.5", MIB - 2) + b"]"),
    "1 MiB of 1.5e10 to total(list[float])": ("total", b"[" + _array(b"1.5e10", MIB - 2) + b"]"),
    "1 MiB of 1.5 to mark (refused)": ("mark", _array(b"1.5")),
    "1 MiB of prose to mark": ("mark", json.dumps(["the seventeen elephants entered " * 32000]).encode()),
}

_CHILD = """
import importlib.util, json, sys, time
from broker.worker.params import Method
rounds, name, app, params = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.stdin.buffer.read()
spec = importlib.util.spec_from_file_location("bignums", app)
bignums = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bignums)
method = Method(name, getattr(bignums, name))
best, said = float("inf"), "bound"
for _ in range(rounds):
    t = time.perf_counter()
    try:
        method.bind(params, 64)
    except Exception as exc:
        said = f"{type(exc).__name__} {str(exc)[:60]}"
    best = min(best, time.perf_counter() - t)
print(json.dumps([best, said]))
"""


def bind_seconds(tree: Path, name: str, params: bytes, rounds: int) -> tuple[float, str]:
    """Best seconds of `rounds` binds of `params` to bignums' `name`, importing `tree`'s broker."""
    env = dict(os.environ, PYTHONPATH=str(tree))  # (the app from this tree, by its path)
    app = str(HERE / "tests" / "apps" / "bignums.py")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(rounds), name, app], input=params, env=env,
                         capture_output=True, check=True, cwd=tree).stdout
    best, said = json.loads(out)
    return best, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout to bind with, side by side")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from broker.worker.slow_numbers import slow_numbers  # (this tree's)

    for label, (name, params) in CASES.items():
        here, said = bind_seconds(HERE, name, params, args.rounds)
        t = time.perf_counter()
        slow_numbers(params)
        check = time.perf_counter() - t
        line = f"{label:42} {len(params):>8} B  this tree {here:7.3f} s  (count {check * 1e3:5.2f} ms)  {said}"
        if args.against is not None:
            there, said_there = bind_seconds(args.against, name, params, args.rounds)
            line += f"\n{'':53} against   {there:7.3f} s  {said_there}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
