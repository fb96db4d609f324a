"""Every relative link of README.md and docs/*.md resolves: the file exists and, for a
`#anchor`, the file has a heading whose GitHub anchor it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^()\s]*)\)")


def _without_code(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a file's headings: lowercased, punctuation but `-` and `_`
    dropped, spaces made `-`; a repeated one gets `-1`, `-2`, ..."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.*?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links() -> list[tuple[Path, str]]:
    found = []
    for path in DOCS:
        for target in LINK.findall(_without_code(path.read_text(encoding="utf-8"))):
            if not re.match(r"[a-z]+:", target):
                found.append((path, target))
    return found


def test_there_are_links_to_check() -> None:
    assert len(links()) > 50


@pytest.mark.parametrize(("path", "target"), links(), ids=lambda v: str(v.name) if isinstance(v, Path) else v)
def test_link_resolves(path: Path, target: str) -> None:
    file, _, anchor = target.partition("#")
    dest = (path.parent / file).resolve() if file else path
    assert dest.exists(), f"{path.relative_to(ROOT)} links to {target}: no such file"
    if anchor:
        assert anchor in anchors(dest), f"{path.relative_to(ROOT)} links to {target}: no such heading"


def test_the_architecture_page_names_every_module_by_its_docstring() -> None:
    """docs/architecture.md's table of modules has a row for every module of broker/ (the load
    generator's as one package), none for a module that is gone, and each row says what the
    module's docstring says first (its first paragraph): it had drifted from both (issue 10,
    item 9)."""
    import ast

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("| module | role |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    rows = dict(re.findall(r"^\| `(broker/[\w/]*?(?:\.py|/))` \| (.*) \|$", table, re.M))
    modules = {
        str(path.relative_to(ROOT)) for path in (ROOT / "broker").glob("**/*.py")
        if (path.name != "__init__.py" or path.parent.name == "config") and "loadgen" not in path.parts
    }
    assert set(rows) == modules | {"broker/loadgen/"}
    for module in sorted(modules):
        docstring = ast.get_docstring(ast.parse((ROOT / module).read_text(encoding="utf-8"))) or ""
        said = " ".join(docstring.strip().split("\n\n")[0].split()).replace("|", "\\|")
        assert rows[module] == said, module
