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
