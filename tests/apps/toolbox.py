"""Tools of every shape, for tests/test_tools.py and tests/test_discover.py: a structured
result and wrapped ones, a type that refers to itself (a tree), keyword-only parameters,
**kwargs, a raw tool, and a method that is not a tool (a dotted name, *values). The title of
`greet` is read from the file TOOLBOX_TITLE_FILE names, if it does ("Greet" otherwise), at
import: a test rewrites it before a reload."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from broker.worker import Registry, ToolAnnotations

registry = Registry(tools=True)

_TITLE_FILE = os.environ.get("TOOLBOX_TITLE_FILE")


class Point(msgspec.Struct):
    """A point in the plane."""

    x: float
    y: float


class Tree(msgspec.Struct):
    """A labelled tree."""

    label: str
    children: list[Tree] = []


@registry.method(title=Path(_TITLE_FILE).read_text().strip() if _TITLE_FILE else "Greet",
                 annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
def greet(name: str, *, punctuation: str = "!") -> str:
    """Say hello to `name`."""
    return f"Hello, {name}{punctuation}"


@registry.method(annotations={"readOnlyHint": True, "idempotentHint": True})
def midpoint(a: Point, b: Point) -> Point:
    """The point halfway between a and b."""
    return Point((a.x + b.x) / 2, (a.y + b.y) / 2)


@registry.method
def leaves(tree: Tree) -> list[str]:
    """The labels of the tree's leaves, left to right."""
    if not tree.children:
        return [tree.label]
    return [label for child in tree.children for label in leaves(child)]


@registry.method
def grow(label: str, depth: int = 1) -> Tree:
    """A chain of `depth` nodes below a root labelled `label`."""
    return Tree(label, [grow(f"{label}.{depth}", depth - 1)] if depth > 0 else [])


@registry.method
def tally(text: str, **weights: int) -> dict[str, int]:
    """The weight of each word of `text`: its count times its weight (1 if not given)."""
    out: dict[str, int] = {}
    for word in text.split():
        out[word] = out.get(word, 0) + weights.get(word, 1)
    return out


@registry.method(raw_params=True)
def raw(params: msgspec.Raw | None) -> msgspec.Raw | None:
    """The arguments, as they came."""
    return params


@registry.method(name="ns.total", tool=False)
def total(*values: int) -> int:
    """Not a tool: a dotted name, and its params come by position."""
    return sum(values)
