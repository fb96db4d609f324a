"""A pytest plugin for `make mutate SCOPE=pool` (tests/mutation_scopes.toml): the code the
scope mutates runs in the processes the tests start (`python -m broker serve`: the pool is
the broker's), not in the test's own, where mutmut's stats run records which tests reach
which function; it would find none for them, and count each mutant "no tests", never run.

So during that stats run every function of the modules mutated (those mutants/ has results
for) is counted reached by every test: each mutant runs the scope's tests, fastest first,
until one fails. A mutant in code none of them reaches counts as survived, not "no tests".
The mutants themselves do run in those processes: they inherit MUTANT_UNDER_TEST, and import
the mutated `broker` from mutants/, their working directory (tests/conftest.py's ROOT).
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest


@cache
def _functions() -> frozenset[str]:
    """mutmut's names of the functions mutated: module.function, without `__mutmut_N`."""
    names: set[str] = set()
    for meta in Path.cwd().rglob("*.py.meta"):  # (pytest runs in mutants/)
        names.update(key.partition("__mutmut_")[0] for key in json.loads(meta.read_text())["exit_code_by_key"])
    return frozenset(names)


@pytest.hookimpl(tryfirst=True)  # (before mutmut's own hook reads what was reached)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    from mutmut.state import state

    state()._stats.update(_functions())
