"""The fuzz harnesses (fuzz/, `make fuzz`) in the suite: every input they found, kept under
tests/data/fuzz/HARNESS/, and a sample of their seeds, replayed through each harness's `check`
(no atheris needed); the checks themselves catch what they should; and a short run of each
harness under atheris (skipped, saying why, where atheris is not installed: `make test`
installs it, the dev extra)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # (fuzz/ is not installed: it is imported from the checkout)
    sys.path.insert(0, str(ROOT))

from conftest import stopped_with_its_processes  # noqa: E402

from fuzz import harness  # noqa: E402
from fuzz.run import HARNESSES  # noqa: E402

SEED_SAMPLE = 40  # seeds replayed a harness (evenly spread over its seeds)


def _regressions() -> list[tuple[str, Path]]:
    return [(name, path) for name in HARNESSES for path in harness.regressions(name)]


@pytest.mark.parametrize(("name", "path"), _regressions(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_a_kept_finding_passes_its_harness(name: str, path: Path) -> None:
    """Each file of tests/data/fuzz/HARNESS/ (an input a harness found: README, "Fuzzing")."""
    importlib.import_module(f"fuzz.{name}").check(path.read_bytes())


def test_every_kept_finding_is_under_a_harness_of_its_own() -> None:
    folders = {p.name for p in harness.REGRESSIONS.iterdir() if p.is_dir()} if harness.REGRESSIONS.is_dir() else set()
    assert folders <= set(HARNESSES), folders - set(HARNESSES)


@pytest.mark.parametrize("name", list(HARNESSES))
def test_a_sample_of_the_seeds_passes_its_harness(name: str) -> None:
    module = importlib.import_module(f"fuzz.{name}")
    seeds = module.seeds()
    assert len(seeds) >= 20
    for seed in seeds[:: max(1, len(seeds) // SEED_SAMPLE)]:
        module.check(seed)


def test_the_slow_input_check_fires_past_its_budget_and_not_below_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    def spin(data: bytes) -> int:
        end = time.thread_time() + 0.01
        while time.thread_time() < end:
            pass
        return 1

    monkeypatch.setattr(harness, "BASE_SECONDS", 0.001)
    monkeypatch.setattr(harness, "PER_KIB_SECONDS", 0.0)
    check = harness.timed(spin)
    check(b"x" * (harness.LINEAR_FROM_BYTES - 1))  # (small inputs are not timed)
    with pytest.raises(harness.SlowInput):
        check(b"x" * harness.LINEAR_FROM_BYTES)


def test_the_chunk_plan_cuts_the_stream_into_the_sizes_given_in_turn() -> None:
    assert harness.plan(b"\x05\x02\x00\x02abcdefgh") == (5, [b"a", b"bcd", b"e", b"fgh"])
    assert harness.plan(b"\x01\x00abc") == (1, [b"abc"])
    assert harness.plan(b"\x01") == (1, [])


def test_the_answer_check_refuses_a_call_answered_twice_and_an_id_not_sent() -> None:
    from fuzz.frontends import EchoDispatcher, check_answers, event_loop

    dispatcher = EchoDispatcher(event_loop(), False, 1 << 20)
    dispatcher.made.add(0)
    answer = b'{"jsonrpc":"2.0","id":7,"result":{"seq":0}}'
    assert check_answers([answer], [b'{"id":7}'], dispatcher) == {0}
    with pytest.raises(AssertionError, match="twice"):
        check_answers([answer, answer], [b'{"id":7}'], dispatcher)
    with pytest.raises(AssertionError, match="not in any body"):
        check_answers([answer], [b'{"id":8}'], dispatcher)


def test_the_http_output_check_refuses_a_response_cut_short() -> None:
    from fuzz.http_frontend import parse_responses

    whole = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 4\r\n\r\nnull"
    assert parse_responses(whole)[0].body == b"null"
    with pytest.raises(AssertionError, match="cut short"):
        parse_responses(whole[:-2])
    with pytest.raises(AssertionError, match="status line"):
        parse_responses(whole + b"garbage")


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed (the dev extra: make test installs it)")
@pytest.mark.parametrize("name", list(HARNESSES))
def test_a_short_fuzz_run_of_each_harness_finds_nothing(name: str, tmp_path: Path) -> None:
    """atheris's libFuzzer, 300 inputs from a few seeds (about 5 s): the harness runs under the
    fuzzer, instrumented, and exits 0."""
    module = importlib.import_module(f"fuzz.{name}")
    seeds = module.seeds()
    for i, seed in enumerate(seeds[:: max(1, len(seeds) // 10)]):
        (tmp_path / f"seed-{i}").write_bytes(seed)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", f"fuzz.{name}", "-runs=300", "-seed=1", f"-max_len={HARNESSES[name]}",
         "-timeout=60", f"-artifact_prefix={tmp_path}/", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, timeout=110,
    )  # fmt: skip
    log = done.stderr.decode(errors="replace")
    assert done.returncode == 0, log[-3000:]
    assert "Done 300 runs" in log, log[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed (the dev extra: make test installs it)")
def test_make_fuzz_s_runner_starts_from_no_work_directory_and_reports_the_inputs(tmp_path: Path) -> None:
    """`make fuzz` on a fresh clone (new user, round 104: it opened .fuzz/HARNESS/last.log before
    making .fuzz/HARNESS/, FileNotFoundError on every first run): fuzz.run with its work
    directory absent (FUZZ_WORK) runs the harness, makes the corpus and the log, and says how
    many inputs it ran."""
    work = tmp_path / "work"
    env = dict(os.environ, PYTHONPATH=str(ROOT), FUZZ_WORK=str(work))
    done = subprocess.run([sys.executable, "-m", "fuzz.run", "--seconds", "2", "wire_frames"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (work / "wire_frames" / "last.log").is_file() and (work / "wire_frames" / "corpus").is_dir()
    runs = re.search(r"fuzz: wire_frames: ([\d,]+) inputs", done.stdout)
    assert runs and int(runs.group(1).replace(",", "")) > 0, done.stdout


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed (the dev extra: make test installs it)")
def test_make_fuzz_s_runner_sent_sigterm_stops_its_harness(tmp_path: Path) -> None:
    """Hostile testing, round 112: SIGTERM to fuzz.run left its harness fuzzing until its own
    -max_total_time (for ever with --seconds 0, now refused)."""
    stopped = stopped_with_its_processes([sys.executable, "-m", "fuzz.run", "--seconds", "120", "wire_frames"], 1,
                                         env={"PYTHONPATH": str(ROOT), "FUZZ_WORK": str(tmp_path / "work")})
    assert not stopped.left, stopped.left
    # (new user, round 105: a KeyboardInterrupt traceback, exit 130)
    assert stopped.status == 143 and "Traceback" not in stopped.stderr, stopped.stderr
    assert "fuzz: interrupted by SIGTERM; what it started is stopped" in stopped.stderr
    refused = subprocess.run([sys.executable, "-m", "fuzz.run", "--seconds", "0", "wire_frames"], cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--seconds 0: at least 1" in refused.stderr


@pytest.mark.parametrize(("args", "said"), [
    (["nosuch", "x"], "no harness 'nosuch': one of jsonrpc_codec, wire_frames, http_frontend, ndjson_frontend"),
    (["http_frontend", "/nonexistent/crash-1"], "no file /nonexistent/crash-1: give the input libFuzzer wrote"),
])
def test_fuzz_keep_refuses_a_wrong_harness_or_path_in_one_line(args: list[str], said: str) -> None:
    """New user, round 105: a wrong harness or path ended `python -m fuzz.keep` in a traceback."""
    done = subprocess.run([sys.executable, "-m", "fuzz.keep", *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
