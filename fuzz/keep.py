"""Keep an input a harness found as a regression file: `python -m fuzz.keep HARNESS FILE [NAME]`.

Copies FILE (a crash-*, timeout-*, slow-unit-* or oom-* file libFuzzer wrote under
.fuzz/HARNESS/artifacts/, or any input) to tests/data/fuzz/HARNESS/NAME (default: FILE's name),
which tests/test_fuzz_regressions.py replays through the harness's `check`. It first replays it:
it says whether the input fails now (a finding not fixed yet: the test fails until it is) and
how (the exception). libFuzzer's own minimizer (`-minimize_crash=1`,
https://llvm.org/docs/LibFuzzer.html#minimizing-a-crash) runs argv[0] again as a program, which a
harness run as `python -m fuzz.HARNESS` is not: cut an input down by hand (`fuzz.replay` tells
whether a shorter one still fails), or keep it whole.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import traceback
from pathlib import Path

from fuzz.harness import REGRESSIONS
from fuzz.run import HARNESSES

__all__ = ["keep", "main"]


def keep(harness: str, source: Path, name: str | None = None) -> tuple[Path, str | None]:
    """Copy `source` to tests/data/fuzz/`harness`/`name`; return the copy's path and how the
    input fails the harness's `check` now (the exception's last line), None if it passes."""
    check = importlib.import_module(f"fuzz.{harness}").check
    data = source.read_bytes()
    try:
        check(data)
        failure = None
    except Exception as exc:  # (anything `check` raises is what the test would report)
        failure = traceback.format_exception_only(exc)[-1].strip()
    folder = REGRESSIONS / harness
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / (name or source.name)
    shutil.copyfile(source, target)
    return target, failure


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); exit status 2 on a usage error."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    if args[0] not in HARNESSES:  # (new user, round 105: a traceback)
        print(f"no harness {args[0]!r}: one of {', '.join(HARNESSES)}", file=sys.stderr)
        return 2
    if not Path(args[1]).is_file():
        print(f"no file {args[1]}: give the input libFuzzer wrote (fuzz: ... FOUND PATH)", file=sys.stderr)
        return 2
    target, failure = keep(args[0], Path(args[1]), args[2] if len(args) == 3 else None)
    print(f"kept {target}")
    print(f"it fails now: {failure}" if failure else "it passes now (fixed, or it depended on timing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
