"""`make mutate SAMPLE=N`: the names of N of a run's mutants, drawn at random, one a line.

A full run of a scope whose tests start real processes (the pool's: up to 35 s a mutant) takes
hours; the share killed among mutants drawn at random estimates the full run's score
(tests/mutation_report.py prints its 95 % interval: about +-5 points for N = 300 at 70 %).
Run in the directory mutmut runs in (the core's checkout, or .mutate/SCOPE/): this has mutmut
write the mutants, as `mutmut run` does first (mutmut's own functions, pinned mutmut 3.8), and
draws from their names with a fixed seed, so that the same code gives the same sample; `mutmut
run NAMES...` then runs only those (and keeps the files written: the code is unchanged).

    python tests/mutation_sample.py N [SEED]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import sys
from pathlib import Path

from mutmut.__main__ import create_mutants, store_lines_covered_by_tests
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths


def mutant_names(mutants: Path) -> list[str]:
    """Every mutant mutmut made, by name (`broker.pool.x_spawn__mutmut_3`), sorted."""
    return sorted(name for meta in mutants.rglob("*.py.meta")
                  for name in json.loads(meta.read_text())["exit_code_by_key"])


def main() -> int:
    if len(sys.argv) not in (2, 3) or not sys.argv[1].isdigit() or int(sys.argv[1]) < 1:
        print(f"usage: {sys.argv[0]} N [SEED]  (N >= 1 mutants, drawn with SEED, default 'rpc-broker')",
              file=sys.stderr)
        return 2
    count, seed = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) == 3 else "rpc-broker")
    # (what mutmut's `_run` does before its stats run: mutmut/__main__.py, 3.8.1)
    set_mutant_under_test("mutant_generation")
    Path("mutants").mkdir(exist_ok=True)
    said = io.StringIO()  # (mutmut's list of files copied: shown only if it fails; new user, round 103)
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            copy_src_dir()
            copy_also_copy_files()
            setup_source_paths()
            store_lines_covered_by_tests()
            create_mutants(os.cpu_count() or 2)
    except BaseException:
        sys.stderr.write(said.getvalue())
        raise
    names = mutant_names(Path("mutants"))
    if not names:
        print("mutmut made no mutant: nothing to draw from", file=sys.stderr)
        return 1
    drawn = random.Random(seed).sample(names, min(count, len(names)))
    print(f"{len(drawn)} of {len(names)} mutants drawn at random (seed {seed!r}); mutmut's progress counts all"
          f" {len(names)}", file=sys.stderr)
    print("\n".join(sorted(drawn)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
