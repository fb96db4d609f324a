"""The hot path's cost in CPU instructions per call, which a shared machine's noise does not move.

Usage: .venv/bin/python benchmarks/hotpath_instructions.py [--against TREE] [--small 640] [--large 1920]

Runs `benchmarks/hotpath.py` (one round, metrics on) under valgrind's callgrind, which
counts the instructions the process executes: the same code and input give the same count
whatever else the machine is doing, where CPU time varies by 20 % or more here. Each case
(single `add` calls, and calls in batches of 100) runs at two sizes; the difference of the
two counts divided by the difference in calls is the instructions per call, with the
start-up (interpreter, imports, set-up) cancelled out. With `--against TREE` (another
checkout of rpc-broker, for example a `git worktree` at an older commit) the same script
drives that tree's `broker` package too, and the ratio is printed. Needs `valgrind` on the
PATH (Debian's package); about a minute a run. Prints figures only: nothing here is a test.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
_COLLECTED = re.compile(r"Collected : (\d+)")


def instructions(tree: Path, case: str, requests: int) -> int:
    """Instructions callgrind counts for one round of `case` with `requests` bodies (single
    calls) or batches, driving `tree`'s broker package with this tree's hotpath.py."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "hotpath.py"
        # hotpath.py puts its parent's parent first on sys.path: a copy inside `tree` drives it
        copy = tree / "benchmarks" / f"_hotpath_{Path(tmp).name}.py"
        shutil.copy(HERE / "hotpath.py", copy)
        try:
            flag = ["--requests", str(requests)] if case == "single" else ["--requests", "64", "--batch-requests", str(requests)]
            done = subprocess.run(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={script}.out", sys.executable, str(copy),
                 "--rounds", "1", "--case", case, *flag],
                cwd=tree, capture_output=True, text=True, check=True,
            )
        finally:
            copy.unlink()
    return callgrind_total(done.stderr)


def callgrind_total(stderr: str) -> int:
    """The instruction count callgrind printed on `stderr` ("Collected : N"); exits the
    script saying so if there is none."""
    match = _COLLECTED.search(stderr)
    if not match:
        raise SystemExit(f"no callgrind total in:\n{stderr[-2000:]}")
    return int(match.group(1))


def valgrind_missing() -> bool:
    """True, after saying so on stderr, when `valgrind` is not on the PATH."""
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return True
    return False


def compared(label: str, figures: list[float], trees: list[Path]) -> str:
    """One line of figures: this tree's, and with `--against` the other tree's and the ratio."""
    line = f"{label:7s} {figures[0]:10,.0f} this tree"
    if len(figures) > 1:
        line += f"   {figures[1]:10,.0f} {trees[1]}   ratio {figures[0] / figures[1]:.3f}"
    return line


def per_call(tree: Path, case: str, small: int, large: int) -> float:
    calls = 1 if case == "single" else 100
    return (instructions(tree, case, large) - instructions(tree, case, small)) / ((large - small) * calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another rpc-broker checkout to compare with")
    parser.add_argument("--small", type=int, default=640, help="single-call bodies of the small run (batches: /10)")
    parser.add_argument("--large", type=int, default=1920, help="single-call bodies of the large run (batches: /10)")
    args = parser.parse_args()
    if valgrind_missing():
        return 2
    trees = [HERE.parent] + ([args.against.resolve()] if args.against else [])
    print("front-end instructions per call, in-process (callgrind; metrics on)")
    for case, small, large in (("single", args.small, args.large), ("batch", args.small // 10, args.large // 10)):
        print(compared(case, [per_call(tree, case, small, large) for tree in trees], trees))
    return 0


if __name__ == "__main__":
    sys.exit(main())
