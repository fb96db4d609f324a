"""Replay inputs through a harness's `check`, without atheris: `python -m fuzz.replay HARNESS [PATH ...]`.

PATH: files or directories of inputs (default: the harness's corpus, .fuzz/HARNESS/corpus, and
its kept findings, tests/data/fuzz/HARNESS/). Each input is cut to the harness's -max_len
(`fuzz.run.HARNESSES`), as libFuzzer cuts it. Prints how many passed and each failure (the
input's path and the exception's last line); exit status 1 if any failed. Under coverage.py it
measures the lines of the broker a corpus reaches (benchmarks/RESULTS.md, "Fuzzing"), with
coverage.py installed (not a dependency: `.venv/bin/python -m pip install coverage`):
`python -m coverage run --source=broker -m fuzz.replay http_frontend && python -m coverage report`.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

from fuzz.harness import WORK, regressions
from fuzz.run import HARNESSES

__all__ = ["main", "replay"]


def replay(harness: str, paths: list[Path]) -> tuple[int, list[tuple[Path, str]]]:
    """Run every input under `paths` (files, or directories of them) through `harness`'s
    `check`; return how many passed, and (path, failure) for the others."""
    check = importlib.import_module(f"fuzz.{harness}").check
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.iterdir()) if f.is_file())
    passed, failed = 0, []
    for path in files:
        try:
            check(path.read_bytes()[:HARNESSES[harness]])
            passed += 1
        except Exception as exc:  # (what the fuzzer would report)
            failed.append((path, traceback.format_exception_only(exc)[-1].strip()))
    return passed, failed


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); exit status 2 on a usage error."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in HARNESSES:  # (new user, round 104: say which)
        given = f"no harness {args[0]!r}" if args else "no harness named"
        print(f"{given}: python -m fuzz.replay HARNESS [PATH ...], HARNESS one of {', '.join(HARNESSES)}",
              file=sys.stderr)
        return 2
    harness = args[0]
    paths = [Path(a) for a in args[1:]] or [p for p in [WORK / harness / "corpus"] if p.is_dir()] + regressions(harness)
    passed, failed = replay(harness, paths)
    for path, failure in failed:
        print(f"FAILED {path}: {failure}")
    print(f"{harness}: {passed} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
