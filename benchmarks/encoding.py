"""What the worker's result encoding (`broker.worker.encode_result`) costs, per result shape.

Usage: .venv/bin/python benchmarks/encoding.py [--against TREE] [--rounds 200]

Each shape is a result a tool might return (1000 plain dicts, dataclasses, msgspec Structs, UTC datetimes,
a dict of int keys, floats beside one integer past 64 bits, a list repeating one dict).
For each it prints the microseconds `encode_result` takes and, beside it, orjson's own
encoding of the same value where orjson takes it natively (`OPT_SERIALIZE_NUMPY |
OPT_NON_STR_KEYS`): the ratio is what the worker's safety (no Python code of the result's
objects running while a C encoder walks it, one form per value whatever its neighbours)
costs. With `--against TREE` (another checkout, for example a `git worktree` at an older
commit) the same shapes are timed with that tree's `broker` too, in the same run,
alternating. The best of 5 repeats of `--rounds` calls each. Prints figures only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in a child with the tree's `broker` first on sys.path; prints {shape: [us, orjson us]}.
_CHILD = r"""
import dataclasses, datetime, json, sys, timeit
import msgspec
import orjson
from broker.worker import encode_result

@dataclasses.dataclass
class Point:
    x: int
    y: int

class Item(msgspec.Struct):
    name: str
    price: float
    tags: list

part = {f"k{i}": i for i in range(20)} | {"tags": {1, 2}}
SHAPES = {
    "1000 plain dicts": [{"a": i, "b": "x"} for i in range(1000)],
    "1000 dataclasses": [Point(i, i) for i in range(1000)],
    "1000 Structs": [Item("x", i / 7, ["a"]) for i in range(1000)],
    "1000 UTC datetimes": [datetime.datetime(2020, 1, 1, i % 24, tzinfo=datetime.UTC) for i in range(1000)],
    "dict of 1000 int keys": {i: i for i in range(1000)},
    "1000 floats and a 2**70": [2**70] + [i / 7 for i in range(1000)],
    "one dict with a set, 1000 times": [part] * 1000,
    "small dict": {"a": 1, "b": [1, 2, 3]},
}
OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
rounds = int(sys.argv[1])
out = {}
for name, value in SHAPES.items():
    n = rounds * 100 if name == "small dict" else rounds
    ours = min(timeit.repeat(lambda: encode_result(value), number=n, repeat=5)) / n
    try:
        orjson.dumps(value, option=OPTIONS)
        native = min(timeit.repeat(lambda: orjson.dumps(value, option=OPTIONS), number=n, repeat=5)) / n
    except TypeError:
        native = None
    out[name] = [ours * 1e6, None if native is None else native * 1e6]
print(json.dumps(out))
"""


def measure(tree: Path, rounds: int) -> dict[str, list[float | None]]:
    """{shape: [encode_result us, orjson us or None]} with `tree`'s broker package."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(rounds)], cwd=tree, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, check=True, timeout=600)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another checkout of rpc-broker to time beside this one")
    parser.add_argument("--rounds", type=int, default=200, help="calls per timing (100x for the small dict)")
    args = parser.parse_args()
    trees = [ROOT] + ([args.against.resolve()] if args.against else [])
    runs: dict[Path, list[dict[str, list[float | None]]]] = {tree: [] for tree in trees}
    for _ in range(2):  # alternating, so a busy moment hits both
        for tree in trees:
            runs[tree].append(measure(tree, args.rounds))
    best = {tree: {name: min(r[name][0] for r in results) for name in results[0]} for tree, results in runs.items()}
    native = {name: runs[ROOT][0][name][1] for name in best[ROOT]}
    head = f"{'shape':34} {'this tree us':>13} {'orjson us':>10} {'x orjson':>9}"
    if args.against:
        head += f" {'against us':>11} {'this/against':>13}"
    print(head)
    for name, ours in best[ROOT].items():
        ref = native[name]
        line = f"{name:34} {ours:13.2f} {'-' if ref is None else f'{ref:.2f}':>10} "
        line += f"{'-' if ref is None else f'{ours / ref:.1f}':>9}"
        if args.against:
            theirs = best[args.against.resolve()][name]
            line += f" {theirs:11.2f} {ours / theirs:13.2f}"
        print(line)


if __name__ == "__main__":
    main()
