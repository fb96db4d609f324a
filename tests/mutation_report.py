"""`make mutate`'s summary: mutmut's results (mutants/**/*.py.meta) counted per module.

A mutant is *killed* when a test failed on it, *timeout* when the tests ran past mutmut's
time limit on it (an endless loop: detected too), *survived* when every test passed (or no
test ran the code it changed), and *equivalent* when it is named in
tests/mutation_equivalent.txt, with the reason no test could ever tell it from the code. The
score is the share of the non-equivalent mutants detected (killed or timeout).

    python tests/mutation_report.py [--fail-under PERCENT] [--survivors] [--mutants DIR]

DIR is the run's mutants/: ./mutants for the core (the default), .mutate/SCOPE/mutants for
`make mutate SCOPE=worker|pool`. --fail-under applies to the core only: another scope's
counts and score are printed, and the exit status says only whether there were results.

An equivalent mutant that a test killed, or that mutmut no longer makes (the code changed,
and mutants are numbered per function), is reported: the list must be checked again.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / "tests" / "mutation_equivalent.txt"

# mutmut 3.8's exit codes (mutmut/stats.py `status_by_exit_code`), grouped
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "survived", 33: "survived",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", -9: "timeout"}
COLUMNS = ("killed", "timeout", "survived", "equivalent", "other", "not run")


def equivalents(path: Path = EQUIVALENT) -> dict[str, str]:
    """The mutants judged equivalent: `name: reason` a line; a line starting `#` is a comment."""
    found: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, reason = line.partition(": ")
        if not sep or not reason.strip():
            raise SystemExit(f"{path}:{number}: expected `mutant name: reason`, got {line!r}")
        found[name.strip()] = reason.strip()
    return found


def results(mutants: Path) -> dict[str, tuple[str, int | None]]:
    """mutant name -> (module path, mutmut's exit code or None if it was not run)."""
    out: dict[str, tuple[str, int | None]] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        module = str(meta.relative_to(mutants))[: -len(".meta")]
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = (module, code)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fail-under", type=float, default=0.0, help="exit 1 under this score (%%)")
    parser.add_argument("--survivors", action="store_true", help="list the survivors' names")
    parser.add_argument("--mutants", type=Path, default=ROOT / "mutants",
                        help="the run's mutants/ (default: the core's); .mutate/SCOPE/mutants for a scope")
    args = parser.parse_args()

    scope = scope_of(args.mutants)
    found = results(args.mutants)
    if not found:
        run = "make mutate" if scope == "core" else f"make mutate SCOPE={scope}"
        print(f"no mutmut results under {args.mutants}: run `{run}`", file=sys.stderr)
        return 1
    # (the equivalents of the modules this run mutated: another scope's are not its)
    modules = {module[: -len(".py")].replace("/", ".") for module, _ in found.values()}
    judged = {name: why for name, why in equivalents().items() if any(name.startswith(f"{m}.x") for m in modules)}
    counts: dict[str, Counter[str]] = {}
    survivors: list[str] = []
    problems: list[str] = []
    for name, (module, code) in sorted(found.items()):
        status = STATUS.get(code, "other") if code is not None else "not run"
        if name in judged and status != "not run":
            if status in ("killed", "timeout"):
                problems.append(f"{name} is listed as equivalent but was {status}: not equivalent")
            else:
                status = "equivalent"
        elif status == "survived":
            survivors.append(name)
        elif status == "other":
            problems.append(f"{name}: mutmut exit code {code} (suspicious or crashed)")
        counts.setdefault(module, Counter())[status] += 1
    problems += [f"{name} is listed as equivalent but mutmut made no such mutant" for name in judged
                 if name not in found]
    unrun = sum(c["not run"] for c in counts.values())
    if unrun:  # (new user, round 101: a run of one module's mutants showed the others at 100 %)
        problems.append(f"{unrun} mutants not run (a sample, `make mutate SAMPLE=N`, a run of some only, `ARGS=...`,"
                        " or an interrupted run): left out of the score, and a module none of whose mutants ran"
                        " shows none")

    total: Counter[str] = Counter()
    width = max(len(m) for m in counts)
    if scope != "core":
        print(f"scope {scope} ({args.mutants})")
    print(f"{'module':<{width}}  " + "  ".join(f"{c:>10}" for c in COLUMNS) + "        score")
    for module, c in sorted(counts.items()):
        total += c
        print(f"{module:<{width}}  " + "  ".join(f"{c[k]:>10}" for k in COLUMNS) + f"  {shown(c)}")
    print(f"{'total':<{width}}  " + "  ".join(f"{total[k]:>10}" for k in COLUMNS) + f"  {shown(total)}")
    if not ran(total):
        for problem in problems:
            print(f"warning: {problem}", file=sys.stderr)
        print("no mutant was run: no score", file=sys.stderr)
        return 1
    print(f"\n{total['killed'] + total['timeout']} of {sum(total.values()) - total['equivalent'] - total['not run']} non-equivalent "
          f"mutants killed ({total['killed']} by a failing test, {total['timeout']} by a timeout): "
          f"{score(total):.1f} %; {total['survived']} survived, {total['equivalent']} equivalent")
    drawn = args.mutants / "sample.txt"  # (`make mutate SAMPLE=N`: the names drawn)
    if unrun and drawn.exists():
        low, high = wilson(total)
        print(f"a sample drawn at random ({len(drawn.read_text().split())} mutants, SAMPLE=N): a full run's score is "
              f"within {low:.1f} .. {high:.1f} %, 95 % of the time (Wilson score interval)")
    elif unrun:
        print("not a sample drawn at random (ARGS=..., or an interrupted run): no estimate of a full run's score")
    if args.survivors and survivors:
        print("\nsurvivors (`mutmut show NAME` for the change):")
        print("\n".join(f"  {name}" for name in survivors))
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    if scope != "core":  # (a gate is the core's only: the worker and the pool are measured, not held to one)
        if args.fail_under:
            print(f"--fail-under {args.fail_under:g} not applied: scope {scope}, not the core", file=sys.stderr)
        return 0
    if unrun and args.fail_under:  # (new user, round 103: a 20-mutant sample at 89.5 % failed the gate)
        print(f"--fail-under {args.fail_under:g} not applied: {unrun} mutants not run (the gate holds a full run)",
              file=sys.stderr)
        return 0
    if score(total) < args.fail_under:
        print(f"under {args.fail_under:g} % of non-equivalent mutants killed", file=sys.stderr)
        return 1
    return 0


def scope_of(mutants: Path) -> str:
    """"core" for ./mutants, else the scope whose directory holds it (.mutate/SCOPE/mutants)."""
    mutants = mutants.resolve()
    return "core" if mutants == (ROOT / "mutants").resolve() else mutants.parent.name


def shown(c: Counter[str]) -> str:
    """The score column: "-" when none of the mutants counted was run."""
    return f"{score(c):>9.1f} %" if ran(c) else f"{'-':>9}  "


def ran(c: Counter[str]) -> int:
    """How many of a module's mutants were run and not judged equivalent."""
    return sum(c.values()) - c["equivalent"] - c["not run"]


def wilson(c: Counter[str], z: float = 1.96) -> tuple[float, float]:
    """The score's 95 % interval (%, low and high) if the mutants run were drawn at random: the
    Wilson score interval of a binomial proportion (E. B. Wilson, 1927; Brown, Cai and DasGupta,
    "Interval Estimation for a Binomial Proportion", Statistical Science 16(2), 2001), which
    stays within 0..100 % and is not empty at 0 or 100 %, unlike p +- z*sqrt(p(1-p)/n)."""
    n = ran(c)
    if not n:
        return 0.0, 100.0
    p = score(c) / 100.0
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return 100.0 * max(0.0, centre - half), 100.0 * min(1.0, centre + half)


def score(c: Counter[str]) -> float:
    """Killed or timed out, in % of the mutants run and not judged equivalent."""
    counted = sum(c.values()) - c["equivalent"] - c["not run"]
    return 100.0 * (c["killed"] + c["timeout"]) / counted if counted else 100.0


if __name__ == "__main__":
    sys.exit(main())
