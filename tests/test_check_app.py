"""`rpc-broker check-app` (issue 12, item 10): the app imported in a worker process as serve's
workers import it, its methods listed with their signatures, or why it cannot be served (exit
3, as nginx -t); a method whose type hint msgspec cannot decode is refused at registration,
naming the parameter, by check-app and by serve at the start. Real processes: the CLI, and a
broker for the start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, start_broker

PLAIN = ("method 'norm': parameter 'p': its type hint holds tests.apps.plain_hint.Point, which msgspec cannot "
         "decode from JSON (no dec_hook), so every call giving it would be refused -32602: hint it dict, list, a "
         "msgspec.Struct or a dataclass")


def check_app(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RPC_BROKER_")}
    return subprocess.run([sys.executable, "-m", "broker", "check-app", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**clean, **(env or {})})


def test_an_app_that_can_be_served_is_listed_method_by_method():
    done = check_app("broker.demo:faults")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "ok: app 'broker.demo:faults', 16 methods"
    rows = {line.split("(")[0].strip(): line for line in lines[1:-1]}
    assert len(rows) == 16
    assert rows["raise_error"].split() == ["raise_error(code:", "int,", "message:", "str,", "data:", "object", "=",
                                           "None)", "->", "None", "sync,", "tool"]
    assert rows["sleep"].endswith("async, tool") and rows["echo"].endswith("sync, raw params, tool")
    assert rows["sum"].endswith("sync")  # (*values: not a tool, broker/demo.py)
    assert lines[-1] == ("tools: add, crash, echo, fib, get_data, hang, huge_reply, leak, raise_error, sleep, slow,"
                         " subtract, worker_info")
    assert rows["add"].strip().split("  ")[0] == "add(a: int | float, b: int | float) -> int | float"


def test_without_app_the_settings_app_is_checked():
    done = check_app(env={"RPC_BROKER_APP": "broker.demo:registry"})
    assert done.returncode == 0 and done.stdout.startswith("ok: app 'broker.demo:registry', 10 methods\n"), done


@pytest.mark.parametrize(("app", "status", "said"), [
    ("tests.apps.plain_hint:registry", 3, f"ERROR cannot load app 'tests.apps.plain_hint:registry': TypeError: {PLAIN}"),
    ("no_such_module_here:registry", 3, "ModuleNotFoundError: No module named 'no_such_module_here' (the module is"
                                        " looked up from the current directory"),
    ("broker.demo:registr", 3, "(did you mean 'registry'?)"),
    ("mytools", 2, "app = 'mytools': expected module:attribute, as in mytools:registry"),
])
def test_an_app_that_cannot_be_served_is_refused_saying_why(app, status, said):
    done = check_app(app)
    assert done.returncode == status and said in done.stderr, done
    assert not done.stdout.startswith("ok")


def test_an_app_that_prints_at_its_import_passes_the_check():
    """New user, round 109: the report's line was looked for at the output's start only, so
    an app printing at its import (which serve runs) was refused: "its import ended the process"."""
    done = check_app("tests.apps.check_faults:registry", env={"CHECK_FAULT": "print"})
    assert done.returncode == 0 and "import-time print\nok: app 'tests.apps.check_faults:registry', 1 method\n" \
        in done.stdout, done


def test_serve_refuses_at_the_start_an_app_whose_hint_cannot_be_decoded():
    with pytest.raises(RuntimeError) as info:
        start_broker("--workers", "1", "--app", "tests.apps.plain_hint:registry", timeout=60)
    message = str(info.value)
    assert message.startswith("broker exited with 3:") and PLAIN in message, message


@pytest.mark.parametrize(("fault", "said"), [
    ("exit0", "app 'tests.apps.check_faults:registry': its import ended the process (exit 0) before it was loaded"),
    ("kill", "app 'tests.apps.check_faults:registry': its import killed the process (SIGKILL)"),
    ("hang", "app 'tests.apps.check_faults:registry': its import did not end within boot_timeout 2 s"),
])
def test_an_import_that_exits_kills_itself_or_hangs_fails_the_check(fault: str, said: str):
    """Hostile testing, round 114 (M3): os._exit(0) at import passed (exit 0, no output), an
    import that hangs hung check-app for good (serve gives a worker boot_timeout), a SIGKILL
    exited 247 saying nothing."""
    done = check_app("tests.apps.check_faults:registry", env={"CHECK_FAULT": fault, "RPC_BROKER_BOOT_TIMEOUT": "2"})
    assert done.returncode == 3 and said in done.stderr, done
