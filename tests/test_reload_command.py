"""`rpc-broker reload` (issue 12, item 11): SIGHUP a running broker and wait for that
reload's outcome through its status file; real brokers, real workers, and an app module
written into tmp_path that the tests change and break between reloads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, Broker, listen_port

from broker.reloadcmd import EXIT_FAILED, EXIT_NO_BROKER, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE

APP = """from broker.worker import Registry
import time
time.sleep({sleep})
registry = Registry()


@registry.method
def ver() -> int:
    return {version}
"""


def write_app(tmp_path: Path, version: int = 1, sleep: float = 0.0, broken: bool = False) -> None:
    """Write the app module `relapp` into `tmp_path` (whole: written beside, then renamed)."""
    text = 'raise ImportError("broken on purpose")\n' if broken else APP.format(version=version, sleep=sleep)
    tmp = tmp_path / "relapp.tmp"
    tmp.write_text(text)
    tmp.replace(tmp_path / "relapp.py")


def start(broker_factory, tmp_path: Path, *flags: str) -> tuple[Broker, Path]:
    write_app(tmp_path)
    status = tmp_path / "status.json"
    b = broker_factory("--workers", "2", "--app", "relapp:registry", "--status-file", str(status), *flags,
                       env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    return b, status


def reload(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPC_BROKER_")}
    return subprocess.run([sys.executable, "-m", "broker", "reload", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_reload_exits_0_once_the_new_workers_serve_the_new_code(broker_factory, tmp_path: Path) -> None:
    b, status = start(broker_factory, tmp_path)
    assert b.call("ver")["result"] == 1
    write_app(tmp_path, version=2)
    done = reload("--status-file", str(status), "--pid", str(b.pid))
    assert done.returncode == EXIT_OK, done.stderr
    assert "reloaded" in done.stdout
    # The outcome is the new code's: no call needs to wait for it any more.
    assert {b.call("ver", id_=i)["result"] for i in range(6)} == {2}
    document = json.loads(status.read_text())
    assert (document["pid"], document["state"], document["outcome"], document["sighups"]) == (b.pid, "serving", "ok", 1)


def test_a_config_file_s_mistakes_elsewhere_do_not_block_a_reload(broker_factory, tmp_path: Path) -> None:
    """New user, round 107: `reload --config FILE` read the whole file, and a mistake made
    for the next restart (`workers = -1`, an unknown key) exited 2, no SIGHUP sent, though a
    reload reads no setting. It reads its status file and boot timeout alone now."""
    b, status = start(broker_factory, tmp_path)
    write_app(tmp_path, version=2)
    config = tmp_path / "broker.toml"
    config.write_text(f'workers = -1\nno_such_setting = 1\nstatus_file = "{status}"\nboot_timeout = 30\n')
    done = reload("--config", str(config), "--pid", str(b.pid))
    assert done.returncode == EXIT_OK, done.stderr
    assert b.call("ver")["result"] == 2
    config.write_text('status_file = 5\n')  # (its own settings are still checked)
    done = reload("--config", str(config), "--pid", str(b.pid))
    assert done.returncode == 2 and "status_file = 5" in done.stderr, done.stderr
    # A file that is not TOML at all: exit 2 saying to give --status-file; with it, the reload
    # goes on (new user, round 110: a syntax error blocked it, systemctl reload failing untried)
    config.write_text('workers = \n')
    done = reload("--config", str(config), "--pid", str(b.pid))
    assert done.returncode == 2 and "invalid TOML" in done.stderr and "give --status-file" in done.stderr
    write_app(tmp_path, version=3)
    done = reload("--config", str(config), "--status-file", str(status), "--pid", str(b.pid))
    assert done.returncode == EXIT_OK and "invalid TOML" in done.stderr, done.stderr
    assert b.call("ver")["result"] == 3


def test_a_reload_whose_code_fails_to_import_exits_1_saying_why_then_a_mended_one_0(
        broker_factory, tmp_path: Path) -> None:
    """The failure's reason is the worker's own line (its exception), and the old code serves
    on. The next reload, of mended code, is not confused by that earlier failed outcome,
    still in the file when it asks."""
    b, status = start(broker_factory, tmp_path)
    write_app(tmp_path, broken=True)
    failed = reload("--status-file", str(status), "--pid", str(b.pid))
    assert failed.returncode == EXIT_FAILED, (failed.stdout, failed.stderr)
    assert "ImportError: broken on purpose" in failed.stderr and "the old workers serve on" in failed.stderr
    assert b.call("ver")["result"] == 1
    write_app(tmp_path, version=3)
    mended = reload("--status-file", str(status), "--pid", str(b.pid))
    assert mended.returncode == EXIT_OK, mended.stderr
    assert b.call("ver")["result"] == 3
    # And a second reload of the same code is its own, again: it waits for its own outcome.
    assert reload("--status-file", str(status)).returncode == EXIT_OK


def test_a_reload_still_running_at_the_timeout_exits_4(broker_factory, tmp_path: Path) -> None:
    b, status = start(broker_factory, tmp_path)
    write_app(tmp_path, version=2, sleep=3.0)
    slow = reload("--status-file", str(status), "--timeout", "0.5")
    assert slow.returncode == EXIT_TIMEOUT, slow.stderr
    assert "still running" in slow.stderr
    assert b.call("ver", timeout=30)["result"] in (1, 2)  # (serving meanwhile)


def test_a_stale_status_file_is_refused_not_taken_for_the_broker(broker_factory, tmp_path: Path) -> None:
    """A broker that stopped says so in its file (new user, round 108: it said "stopping"
    still): the command says it stopped (exit 5), and never signals whatever has the pid
    now. A killed broker's file (its last state left) names a pid gone: refused as stale;
    a pid that is not the file's is refused, and so is a file naming a live pid whose
    process started at another time (reused)."""
    b, status = start(broker_factory, tmp_path)
    assert b.stop() == 0
    document = json.loads(status.read_text())
    assert (document["pid"], document["state"]) == (b.pid, "stopped")
    gone = reload("--status-file", str(status))
    assert gone.returncode == EXIT_NO_BROKER, gone.stderr
    assert f"the broker is not running: pid {b.pid} stopped at " in gone.stderr, gone.stderr
    document.update(state="serving")  # (as a broker killed by SIGKILL leaves it)
    status.write_text(json.dumps(document))
    killed = reload("--status-file", str(status))
    assert killed.returncode == EXIT_NO_BROKER and "not running" in killed.stderr, killed.stderr
    assert "stale" in killed.stderr
    # Another live process's pid, with a file of its own: the file says another start time.
    document.update(pid=os.getpid(), process_start=document["process_start"] + 1, state="serving")
    status.write_text(json.dumps(document))
    reused = reload("--status-file", str(status))
    assert reused.returncode == EXIT_NO_BROKER and "earlier process" in reused.stderr, reused.stderr


def test_a_broker_whose_workers_fail_to_start_leaves_its_status_file_saying_stopped(tmp_path: Path) -> None:
    """A start that ends (exit 3: the app cannot be imported) after the file said "starting"
    says "stopped" too, and `reload` says so, not that a broker is starting."""
    write_app(tmp_path, broken=True)
    status = tmp_path / "status.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPC_BROKER_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{tmp_path}"
    failed = subprocess.run([sys.executable, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(listen_port()),
                             "--workers", "1", "--app", "relapp:registry", "--status-file", str(status)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 3, failed.stderr
    assert json.loads(status.read_text())["state"] == "stopped"
    done = reload("--status-file", str(status))
    assert done.returncode == EXIT_NO_BROKER and " stopped at " in done.stderr, done.stderr


def test_a_pid_that_is_not_the_status_file_s_broker_is_refused(broker_factory, tmp_path: Path) -> None:
    b, status = start(broker_factory, tmp_path)
    other = reload("--status-file", str(status), "--pid", str(os.getpid()))
    assert other.returncode == EXIT_NO_BROKER, other.stderr
    assert f"is pid {b.pid}'s" in other.stderr
    assert json.loads(status.read_text())["sighups"] == 0  # nothing was signalled


def test_no_broker_or_no_status_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = reload("--status-file", str(tmp_path / "none.json"))
    assert missing.returncode == EXIT_NO_BROKER
    assert "no status file" in missing.stderr and "none.json" in missing.stderr
    unset = reload()
    assert unset.returncode == EXIT_USAGE and "status_file" in unset.stderr
    (tmp_path / "junk.json").write_text("not json")
    junk = reload("--status-file", str(tmp_path / "junk.json"))
    assert junk.returncode == EXIT_NO_BROKER and "not a status file" in junk.stderr


def test_an_earlier_reload_s_outcome_is_never_taken_for_the_one_asked_for(tmp_path: Path) -> None:
    """The file says a reload failed (covers every SIGHUP taken so far), and names a live
    process that takes SIGHUP without acting on it (a broker busy elsewhere): the command
    waits for the outcome of a reload begun after its SIGHUP, and times out (4) saying the
    broker has not taken it; it does not report the old failure (1)."""
    from broker.statusfile import Status, process_start

    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_IGN);"
                              " print('ready', flush=True); time.sleep(60)", "broker", "serve"],  # (as a broker's argv)
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        status = tmp_path / "status.json"
        status.write_text(json.dumps({
            "pid": child.pid, "process_start": process_start(child.pid), "state": "serving", "sighups": 3,
            "reloads": 2, "covers": 3, "outcome": "failed", "message": "an earlier failure", "time": 0.0}))
        assert Status(pid=child.pid)  # (the document's shape)
        waited = reload("--status-file", str(status), "--pid", str(child.pid), "--timeout", "0.5")
        assert waited.returncode == EXIT_TIMEOUT, (waited.stdout, waited.stderr)
        assert "has not taken the SIGHUP" in waited.stderr and "earlier failure" not in waited.stderr
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("start", ["real", "zero"])
def test_a_status_file_naming_another_process_does_not_get_it_signalled(tmp_path: Path, start: str) -> None:
    """Hostile testing, round 116, H1: a status file written to name an unrelated process
    (its start time read from /proc, or 0) had `reload` without --pid send it SIGHUP, which
    ended it. The process must be an `rpc-broker serve` of the file owner's user."""
    from broker.statusfile import process_start

    victim = subprocess.Popen(["sleep", "60"])
    try:
        status = tmp_path / "status.json"
        status.write_text(json.dumps({
            "pid": victim.pid, "process_start": process_start(victim.pid) if start == "real" else 0,
            "state": "serving", "sighups": 0, "reloads": 0, "covers": 0, "outcome": "none", "message": "",
            "time": 0.0}))
        done = reload("--status-file", str(status), "--timeout", "1")
        assert done.returncode == EXIT_NO_BROKER, done.stderr
        assert "is no rpc-broker serve process: not signalled" in done.stderr
        time.sleep(0.2)
        assert victim.poll() is None  # (alive: no SIGHUP)
    finally:
        victim.kill()
        victim.wait(10)


def test_a_second_broker_failing_on_the_port_leaves_the_status_file_to_the_first(broker_factory, tmp_path) -> None:
    """Hostile testing, round 116, M3: a second broker started by mistake wrote "starting"
    before it failed on its port, and the running one stopped writing its file for good:
    every later reload exited 5. It writes once its listeners are bound."""
    b, status = start(broker_factory, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPC_BROKER_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{tmp_path}"
    second = subprocess.run([sys.executable, "-m", "broker", "serve", "--workers", "1", "--app", "relapp:registry",
                             "--port", str(b.port), "--status-file", str(status)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and "cannot listen" in second.stderr, second.stderr
    document = json.loads(status.read_text())
    assert (document["pid"], document["state"]) == (b.pid, "serving")  # (nor "stopped" as it ended)
    write_app(tmp_path, version=2)
    done = reload("--status-file", str(status), "--pid", str(b.pid))
    assert done.returncode == EXIT_OK, done.stderr


def test_a_timeout_that_is_no_number_of_seconds_or_a_pid_past_any_is_refused(tmp_path: Path) -> None:
    """Hostile testing, round 116, L2 and L3: `--timeout nan` (or inf) waited for good; a
    pid of 20 digits in the file ended in an OverflowError's traceback, exit 1."""
    for value in ("nan", "inf", "0"):
        done = reload("--status-file", str(tmp_path / "s.json"), "--timeout", value)
        assert done.returncode == EXIT_USAGE and "give seconds, a number > 0" in done.stderr, done.stderr
    status = tmp_path / "status.json"
    status.write_text('{"pid": 99999999999999999999, "process_start": 0, "state": "serving"}')
    done = reload("--status-file", str(status), "--timeout", "1")
    assert done.returncode == EXIT_NO_BROKER and "names no process id" in done.stderr, done.stderr


def test_a_fifo_at_the_status_files_path_blocks_nothing_and_a_symlink_is_not_followed(tmp_path: Path) -> None:
    """Hostile testing, round 116: a FIFO put at the status file's path blocked the broker's
    event loop at its next update (its read back) and `reload` for good (H2); a symbolic link
    at its temporary file's path had the broker overwrite the link's target (M4)."""
    from broker.statusfile import StatusFile, read_status

    path = tmp_path / "status.json"
    os.mkfifo(path)
    started = time.monotonic()
    with pytest.raises(ValueError, match="is not a regular file"):
        read_status(str(path))
    status = StatusFile(str(path))
    status.update(state="starting")  # (the first write replaces the FIFO, as rename does)
    os.unlink(path)
    os.mkfifo(path)
    status.update(state="serving")  # (reads it back first: a FIFO now, not waited on; then replaces it)
    assert time.monotonic() - started < 5 and read_status(str(path)).state == "serving"
    os.unlink(path)
    os.mkfifo(path)
    done = reload("--status-file", str(path), "--timeout", "1")
    assert done.returncode == EXIT_NO_BROKER and "is not a regular file" in done.stderr, done.stderr
    target = tmp_path / "precious"
    target.write_text("precious data")
    os.unlink(path)
    os.symlink(target, f"{path}.{os.getpid()}.tmp")
    status.update(state="stopping")
    assert target.read_text() == "precious data"
    assert read_status(str(path)).state == "stopping"


def test_reload_help_lists_every_exit_code() -> None:
    """New user, round 108: `reload --help` listed no exit code 2 (a missing status file, a
    bad --timeout); each code the command returns has its line under "Exit codes:"."""
    from broker import reloadcmd

    done = reload("--help")
    assert done.returncode == 0, done.stderr
    listed = [int(m) for m in re.findall(r"^  (\d+)  ", done.stdout.split("Exit codes:\n", 1)[1], re.M)]
    codes = sorted(getattr(reloadcmd, name) for name in reloadcmd.__all__ if name.startswith("EXIT_"))
    assert listed == codes == [EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_NO_BROKER], done.stdout



def test_a_second_broker_taking_over_a_running_ones_status_file_says_so(broker_factory, tmp_path) -> None:
    """New user, round 109: a second broker given the same status file (another port) took it
    over without a word; `rpc-broker reload` then followed it, not the first. It warns now;
    a file left by a broker that is gone is taken without one."""
    b, status = start(broker_factory, tmp_path)
    second = broker_factory("--workers", "1", "--app", "relapp:registry", "--status-file", str(status),
                            env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    deadline = time.monotonic() + 10
    while f"status file {status} was pid {b.pid}'s, a broker still running" not in second.read_log(0.1):
        assert time.monotonic() < deadline, second.read_log(0.1)
    assert json.loads(status.read_text())["pid"] == second.pid
    assert "was pid" not in b.read_log(0.1)  # (the first started on a file of no running broker's)
