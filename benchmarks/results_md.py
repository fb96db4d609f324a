"""benchmarks/RESULTS.md's sections written by the benchmark scripts other than run.py.

Each script owns one section between `<!-- NAME:begin -->` and `<!-- NAME:end -->` lines; a new
run replaces its section, or appends it at the end (below run.py's KEEP_MARK: run.py rewrites
what is above that line and keeps what is below).
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def markers(name: str) -> tuple[str, str]:
    """The begin and end lines of section `name`."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def put_section(name: str, lines: list[str], path: Path = RESULTS) -> None:
    """Write `lines` (markdown, without the markers) as section `name` of `path`: in place of
    the last run's, or at the end."""
    begin, end = markers(name)
    section = "\n".join([begin, *lines, end])
    text = path.read_text()
    if begin in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
