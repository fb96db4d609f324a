"""`make mutate SCOPE=worker|pool`: the directory mutmut runs a scope other than the core in.

mutmut reads its settings only from ./pyproject.toml, so a scope runs in .mutate/<scope>/:
this writes there a copy of pyproject.toml whose [tool.mutmut] is the core's with the scope's
settings (tests/mutation_scopes.toml) in place, links `broker` and `tests` to this checkout's
(mutmut copies both into .mutate/<scope>/mutants/, which it puts first on sys.path, and the
brokers and workers the tests start run there too), and removes the last run's mutants/.

    python tests/mutation_scope.py SCOPE
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tomllib
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCOPES = ROOT / "tests" / "mutation_scopes.toml"
LINKED = ("broker", "tests")


def mutmut_settings(scope: dict[str, list[str]], core: dict[str, typing.Any]) -> dict[str, object]:
    """The core's [tool.mutmut], with the scope's modules, tests, deselected tests and plugins."""
    extra = [arg for test in scope.get("deselect", []) for arg in ("--deselect", test)]
    extra += [arg for plugin in scope.get("plugins", []) for arg in ("-p", plugin)]
    return {**core, "only_mutate": scope["only_mutate"], "pytest_add_cli_args_test_selection": scope["tests"],
            "pytest_add_cli_args": [*core.get("pytest_add_cli_args", []), *extra]}


def toml_section(settings: dict[str, object]) -> str:
    """[tool.mutmut] written out (strings, lists of strings and numbers: JSON's forms are TOML's)."""
    lines = ["[tool.mutmut]"]
    for key, value in settings.items():
        if isinstance(value, list):
            lines.append(f"{key} = [\n" + "".join(f"    {json.dumps(v)},\n" for v in value) + "]")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n\n"


def main() -> int:
    scopes = tomllib.loads(SCOPES.read_text())
    if len(sys.argv) != 2 or sys.argv[1] not in scopes:
        names, given = list(scopes), sys.argv[1] if len(sys.argv) > 1 else ""
        print(f"SCOPE must be core (the default), {', '.join(names[:-1])} or {names[-1]}, not {given!r}:"
              f" make mutate SCOPE={names[0]} ({sys.argv[0]} SCOPE writes the directory a scope other than"
              " the core runs in)", file=sys.stderr)
        return 2
    name = sys.argv[1]
    pyproject = (ROOT / "pyproject.toml").read_text()
    core = tomllib.loads(pyproject)["tool"]["mutmut"]
    section = toml_section(mutmut_settings(scopes[name], core))
    text, found = re.subn(r"^\[tool\.mutmut\]\n.*?(?=^\[)", lambda _: section, pyproject, flags=re.S | re.M)
    if found != 1:
        print(f"{ROOT / 'pyproject.toml'}: no [tool.mutmut] section followed by another", file=sys.stderr)
        return 1
    here = ROOT / ".mutate" / name
    shutil.rmtree(here / "mutants", ignore_errors=True)  # (each run starts afresh, as the core's)
    here.mkdir(parents=True, exist_ok=True)
    for linked in LINKED:
        link = here / linked
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ROOT / linked, target_is_directory=True)
    header = (f"# Written by tests/mutation_scope.py for `make mutate SCOPE={name}`: pyproject.toml with\n"
              f"# [tool.mutmut] from tests/mutation_scopes.toml [{name}]. Not to be edited: written anew each run.\n")
    (here / "pyproject.toml").write_text(header + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
