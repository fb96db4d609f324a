"""A test app whose code "changes on disk" between reloads: its version and the methods
it registers come from the JSON file named by $VERSIONED_APP_FILE, read at import:
{"version": 1, "methods": ["a", "b"]}. "broken": true makes the import fail;
"import_seconds": s makes it take that long; "sleepers": ["c"] registers sync
methods that sleep their one param's seconds (a sync call that blocks its worker),
"nappers": ["c"] async methods that do the same with asyncio.sleep.

Every listed method answers {"method": its name, "version": the version}; `pid`,
`version` and `nap` (an async sleep, answered with the version) are always there."""

import asyncio
import json
import os
import time

from broker.worker import Registry

with open(os.environ["VERSIONED_APP_FILE"]) as f:
    SPEC = json.load(f)
if SPEC.get("broken"):
    raise ImportError("this deploy is broken")
time.sleep(SPEC.get("import_seconds", 0))  # a slow import
VERSION = SPEC["version"]

registry = Registry()


def _make(name: str):  # type: ignore[no-untyped-def]
    def handler() -> dict[str, object]:
        return {"method": name, "version": VERSION}

    return handler


for _name in SPEC["methods"]:
    registry.method(name=_name)(_make(_name))


def _sleeper(name: str):  # type: ignore[no-untyped-def]
    def handler(seconds: float) -> dict[str, object]:
        time.sleep(seconds)
        return {"method": name, "version": VERSION}

    return handler


for _name in SPEC.get("sleepers", []):
    registry.method(name=_name)(_sleeper(_name))


def _napper(name: str):  # type: ignore[no-untyped-def]
    async def handler(seconds: float) -> dict[str, object]:
        await asyncio.sleep(seconds)
        return {"method": name, "version": VERSION}

    return handler


for _name in SPEC.get("nappers", []):
    registry.method(name=_name)(_napper(_name))


@registry.method
def pid() -> int:
    return os.getpid()


@registry.method
def version() -> int:
    return VERSION


@registry.method
async def nap(seconds: float) -> int:
    await asyncio.sleep(seconds)
    return VERSION
