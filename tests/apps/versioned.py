"""A test app whose code "changes on disk" between reloads: its version and the methods
it registers come from the JSON file named by $VERSIONED_APP_FILE, read at import:
{"version": 1, "methods": ["a", "b"]}. "broken": true makes the import fail ("broken_after": s
seconds into it);
"import_seconds": s makes it take that long (it writes the file $VERSIONED_APP_FILE.importing-<pid>
first: the test knows it is in that import), "first_import_seconds": s only for the first process
to import that version (a cold cache; the others are quick); "sleepers": ["c"] registers sync
methods that sleep their one param's seconds (a sync call that blocks its worker),
"nappers": ["c"] async methods that do the same with asyncio.sleep; "recycled_once": true makes
the first worker of that version send itself SIGTERM as soon as it handles SIGTERM (its HELLO
and a BYE then go out together: recycled before the broker has it ready).

Every listed method answers {"method": its name, "version": the version}; `pid`,
`version` and `nap` (an async sleep, answered with the version) are always there."""

import asyncio
import json
import os
import signal
import threading
import time

from broker.worker import Registry

with open(os.environ["VERSIONED_APP_FILE"]) as f:
    SPEC = json.load(f)
if SPEC.get("broken"):
    time.sleep(SPEC.get("broken_after", 0))
    raise ImportError("this deploy is broken")
VERSION = SPEC["version"]
if SPEC.get("import_seconds"):  # a slow import
    open(f"{os.environ['VERSIONED_APP_FILE']}.importing-{os.getpid()}", "w").close()
    time.sleep(SPEC["import_seconds"])
if SPEC.get("first_import_seconds"):
    try:
        os.close(os.open(f"{os.environ['VERSIONED_APP_FILE']}.first-{VERSION}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        time.sleep(SPEC["first_import_seconds"])
    except FileExistsError:
        pass

if SPEC.get("recycled_once"):  # one worker of this version SIGTERMs itself once it handles SIGTERM
    def _recycle() -> None:
        while signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # (until its loop's handler is in)
            time.sleep(0.001)
        try:
            os.close(os.open(f"{os.environ['VERSIONED_APP_FILE']}.recycled-{VERSION}",
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=_recycle, daemon=True).start()

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
async def stubborn(seconds: float) -> None:
    """Waits `seconds`; cancelled, it goes on waiting them (a clean-up that takes long)."""
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        await asyncio.sleep(seconds)


@registry.method
async def nap(seconds: float) -> int:
    await asyncio.sleep(seconds)
    return VERSION
