"""A test app whose params are built into sets, dict keys and enum.Flag members: what
hash flooding and IntFlag's member cache reached (issue 9, hostile testing round 36)."""

import asyncio
import decimal
import enum
import os
import uuid

import msgspec

from broker.worker import Registry

registry = Registry()


Perm = enum.IntFlag("Perm", {f"P{i}": 1 << i for i in range(24)})  # (a member for each of 24 bits)


Mode = enum.IntFlag("Mode", {f"M{i}": 1 << i for i in range(24)})


class Tagged(msgspec.Struct):
    tags: set[int] = set()
    children: list["Tagged"] = []


@registry.method
def pid() -> int:
    return os.getpid()


@registry.method
def distinct(ids: set[uuid.UUID]) -> int:
    """How many distinct UUIDs."""
    return len(ids)


@registry.method
def pairs(points: frozenset[tuple[int, int]], *, scale: int = 1) -> int:
    return len(points) * scale


@registry.method
def weights(table: dict[int, float]) -> float:
    return sum(table.values())


@registry.method
def tree(root: Tagged) -> int:
    return len(root.tags) + sum(tree(child) for child in root.children)


def _depth(root: Tagged) -> int:
    depth, node = 1, root
    while node.children:
        depth, node = depth + 1, node.children[0]
    return depth


@registry.method
def tree_depth(root: Tagged) -> int:
    """How deep the first children go (without recursion: the params may be deeper than it takes)."""
    return _depth(root)


@registry.method
def priced_tree_depth(root: Tagged, fee: decimal.Decimal = decimal.Decimal(0)) -> int:
    """`tree_depth` beside a Decimal: each value bound from its own text."""
    return _depth(root)


@registry.method
def perms(*flags: Perm) -> int:  # type: ignore[valid-type]
    """How many flags (each a combination of Perm's 24 bits)."""
    return len(flags)


@registry.method
def perms_later(*flags: Perm):  # type: ignore[no-untyped-def,valid-type]
    """A sync handler returning a coroutine (as one a decorator hides): run as an async one."""
    async def count() -> int:
        await asyncio.sleep(0.01)
        return len(flags)

    return count()


@registry.method
def modes(*flags: Mode) -> int:  # type: ignore[valid-type]
    return len(flags)


@registry.method
def flag_members() -> dict[str, int]:
    """How many members each Flag class holds in its value map (its own and made)."""
    return {"Perm": len(Perm._value2member_map_), "Mode": len(Mode._value2member_map_)}
