"""Smoke runs of the benchmark runner (benchmarks/run.py): it completes, every server it probes
answers correctly, and the report has its tables. Timings are never asserted.

The broker and the reference server always run; peers from the `bench` extra are probed only
when installed (`make test` installs the dev extra alone).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from conftest import listen_port, test_ports

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "benchmarks" / "run.py"
PEERS = {  # server name -> modules it needs
    "aiohttp-1p": ("aiohttp", "jsonrpcserver"),
    "aiohttp-2p": ("aiohttp", "jsonrpcserver", "gunicorn"),
    "fastapi-1w": ("fastapi_jsonrpc", "uvicorn"),
    "fastapi-2w": ("fastapi_jsonrpc", "uvicorn"),
}


STICKS_ENV = "BENCH_STICKS_DIR"  # (bench_servers.STICKS_ENV: where run.py takes the sticks from)
STAND_IN = """# A stand-in for issue 14's measuring stick {name}: benchmarks/reference_server.py (any path)
import runpy, sys
args, rest = [], sys.argv[1:]
while rest:
    flag = rest.pop(0)
    if flag == "--port":
        args += [flag, rest.pop(0)]
    elif flag == "--workers":
        rest.pop(0)
sys.argv = [sys.argv[0], *args]
runpy.run_path({server!r}, run_name="__main__")
"""


def stand_in_sticks(tmp_path: Path) -> Path:
    """A directory with limit_uvloop.py and broker_proto.py standing in for shared/reference's
    (tests need nothing outside the repository): each runs benchmarks/reference_server.py."""
    sticks = tmp_path / "sticks"
    sticks.mkdir()
    for name in ("limit_uvloop.py", "broker_proto.py"):
        (sticks / name).write_text(STAND_IN.format(name=name, server=str(ROOT / "benchmarks" / "reference_server.py")))
    return sticks


def run(tmp_path: Path, *flags: str, sticks: Path | None = None) -> tuple[str, str]:
    """`run.py` with `flags`, the measuring sticks taken from `sticks` (None: none)."""
    out = tmp_path / "RESULTS.md"
    env = {**os.environ, STICKS_ENV: str(sticks) if sticks is not None else ""}
    if (ports := test_ports()) is not None and "--ports" not in flags:  # (BROKER_TEST_PORTS)
        flags = (*flags, "--ports", f"{ports.start}-{ports.stop - 1}")
    done = subprocess.run([sys.executable, str(RUNNER), "--output", str(out), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out.read_text(), done.stdout


def probe_rows(report: str) -> dict[str, str]:
    """server -> its 'answered correctly' cell in the probe table."""
    section = report.split("## Correctness probes", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| (\S+) \| (yes|NO) \|", section, re.M)}


def tables(report: str) -> dict[str, list[str]]:
    """scenario heading -> the server names in its tables."""
    found: dict[str, list[str]] = {}
    for part in report.split("\n## ")[1:]:
        heading, _, body = part.partition("\n")
        rows = re.findall(r"^\| ([\w-]+) \| [\d,]+", body, re.M)
        if rows:
            found[heading] = rows
    return found


@pytest.mark.skipif(shutil.which("wrk") is None and importlib.util.find_spec("broker.loadgen") is None,
                    reason="neither wrk nor rpc-broker bench is available")
def test_quick_run_writes_the_tables(tmp_path: Path) -> None:
    report, stdout = run(tmp_path, "--quick", sticks=stand_in_sticks(tmp_path))
    quick = {"reference", "broker-2w", "limit-uvloop"}
    assert probe_rows(report) == dict.fromkeys(quick, "yes")
    found = tables(report)
    for scenario in ("S1: single `add` calls, 16 connections", "S1: single `add` calls, 64 connections",
                     "S2: batches of 100 `add`, 16 connections"):
        assert scenario in found, report
        assert set(found[scenario]) == quick, report
    # issue 14: the ratios to limit_uvloop.py and the CPU per call, from this run
    assert "| vs limit_uvloop.py |" in report and "## Ratios to limit_uvloop.py (issue 14)" in report
    assert "## CPU per call and the load tool's share" in report
    assert "Issue 14's targets, against limit_uvloop.py in this run" in report
    assert "| server | req/s median (min-max) | calls/s | p50 ms | p99 ms | vs reference |" in report
    assert "FAILED" not in report, report
    assert "## Machine" in report and "## Method" in report and "## Targets" in report
    assert "S2: batches of 100 `add`, 16 connections" in stdout  # the same tables are printed


def test_probe_every_installed_server(tmp_path: Path) -> None:
    installed = [name for name, mods in PEERS.items()
                 if all(importlib.util.find_spec(m) is not None for m in mods)]
    servers = ["reference", "broker-2w", *installed]
    report, _ = run(tmp_path, "--probe-only", "--servers", ",".join(servers))
    assert probe_rows(report) == dict.fromkeys(servers, "yes"), report


def test_a_run_keeps_the_sections_other_scripts_wrote(tmp_path: Path) -> None:
    # make bench rewrote the whole RESULTS.md and lost the figures pasted from
    # benchmarks/pathological.py and sync_mix.py; everything from the mark on is kept.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from run import KEEP_MARK
    finally:
        sys.path.pop(0)
    kept = f"{KEEP_MARK}\n\n## Pathological request bodies (codec)\n\n| shape | ms per MiB |\n| x | 1.0 |\n"
    (tmp_path / "RESULTS.md").write_text("# an old report\n\n## Correctness probes\n\nstale\n\n" + kept)
    report, _ = run(tmp_path, "--probe-only", "--servers", "reference")
    assert report.endswith(kept), report[-500:]
    assert "an old report" not in report and "stale" not in report
    assert probe_rows(report) == {"reference": "yes"}


def test_encoding_benchmark_prints_every_shape() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "encoding.py"), "--rounds", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line[:34].strip(): line[34:].split() for line in done.stdout.splitlines()[1:]}
    assert set(rows) == {"1000 plain dicts", "1000 dataclasses", "1000 Structs", "1000 UTC datetimes", "dict of 1000 int keys",
                         "1000 floats and a 2**70", "one dict with a set, 1000 times", "small dict"}, done.stdout
    assert all(float(cells[0]) > 0 for cells in rows.values()), done.stdout
    assert rows["1000 floats and a 2**70"][1] == "-"  # (orjson refuses the integer: no native figure)


def test_the_s3_verdict_shows_its_ratio_rounded_down() -> None:
    """Round 53, a new user (LOW): S3's verdict said "missed" beside "1.80x broker-1w", a
    ratio of 1.796 rounded up against its target of 1.8. The ratios are rounded down, as
    the verdict compares them."""
    bench = _load_runner()

    def measured(cps: float) -> list[object]:
        return [bench.Measure(rps=cps, cps=cps, p50=1.0, p99=2.0, p999=None, ok=True)]

    results = {"S3": {"loadgen": {"broker-2w": measured(1796.0), "broker-1w": measured(1000.0)}}}
    [s3] = [line for line in bench.targets(results, "loadgen") if line.startswith("- S3")]
    assert "**missed** (1.79x broker-1w)." in s3, s3
    results["S3"]["loadgen"]["broker-2w"] = measured(1800.0)
    [s3] = [line for line in bench.targets(results, "loadgen") if line.startswith("- S3")]
    assert "**met** (1.80x broker-1w)." in s3, s3


def test_the_servers_take_their_ports_from_the_range_given(tmp_path: Path) -> None:
    """Round 83's new user: `make bench` picked its ports with no way to choose them. With
    `--ports` they come from the range: one port, held by another socket, leaves none."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", listen_port()))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, str(RUNNER), "--probe-only", "--servers", "reference",
                               "--output", str(tmp_path / "R.md"), "--ports", f"{port}-{port}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode != 0 and f"no free port in --ports {port}-{port}" in done.stderr, done.stderr[-2000:]
    report, _ = run(tmp_path, "--probe-only", "--servers", "reference", "--ports", f"{port}-{port}")
    assert probe_rows(report) == {"reference": "yes"}


def test_against_runs_the_other_checkout_s_code(tmp_path: Path) -> None:
    """`--against TREE` starts broker-2w-against from TREE's code, beside this checkout's
    broker-2w (issue 10: before-and-after figures in one run): a copy whose demo `add` is
    off by one fails the probe there, and only there."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "broker", tree / "broker", ignore=shutil.ignore_patterns("__pycache__"))
    demo = tree / "broker" / "demo.py"
    source = demo.read_text()
    assert source.count("    return a + b\n") == 1
    demo.write_text(source.replace("    return a + b\n", "    return a + b + 1\n"))
    report, _ = run(tmp_path, "--probe-only", "--servers", "broker-2w,broker-2w-against", "--against", str(tree))
    assert probe_rows(report) == {"broker-2w": "yes", "broker-2w-against": "NO"}, report
    assert f"rpc-broker serve --workers 2 from {tree}" in report


def test_the_measuring_sticks_answer_their_probe(tmp_path: Path) -> None:
    """Issue 14: limit_uvloop.py and broker_proto.py --fast (stand-ins here), run from where
    they are, answer the probe suited to them (`add` alone, at /rpc)."""
    sticks = stand_in_sticks(tmp_path)
    report, _ = run(tmp_path, "--probe-only", "--servers", "limit-uvloop,proto-1w,proto-2w", sticks=sticks)
    assert probe_rows(report) == {"limit-uvloop": "yes", "proto-1w": "yes", "proto-2w": "yes"}, report
    assert f"Issue 14's measuring sticks (limit-uvloop, proto-1w, proto-2w) run from `{os.path.relpath(sticks, ROOT)}`" \
        in report


def test_the_sticks_are_looked_for_beside_the_checkout(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_servers import STICKS_ENV as RUNNERS
        from bench_servers import reference_dir
    finally:
        sys.path.pop(0)
    assert RUNNERS == STICKS_ENV
    (tmp_path / "repo").mkdir()
    assert reference_dir(tmp_path / "repo", {}) == (None, [tmp_path / "shared" / "reference"])
    (tmp_path / "shared" / "reference").mkdir(parents=True)
    (tmp_path / "shared" / "reference" / "limit_uvloop.py").write_text("")
    assert reference_dir(tmp_path / "repo", {})[0] is None  # (both scripts, or neither)
    (tmp_path / "shared" / "reference" / "broker_proto.py").write_text("")
    assert reference_dir(tmp_path / "repo", {})[0] == tmp_path / "shared" / "reference"
    assert reference_dir(tmp_path / "repo", {STICKS_ENV: ""}) == (None, [])  # (the tests' own: none)
    assert reference_dir(tmp_path / "repo", {STICKS_ENV: str(tmp_path / "shared" / "reference")})[0] == \
        tmp_path / "shared" / "reference"


def test_without_the_sticks_the_run_says_so_and_goes_on(tmp_path: Path) -> None:
    """A checkout with no shared/reference/ beside it (a copy of benchmarks/ alone) runs
    without them, saying so on its output and in the report."""
    shutil.copytree(ROOT / "benchmarks", tmp_path / "repo" / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__", "*.png"))
    out = tmp_path / "R.md"
    done = subprocess.run([sys.executable, str(tmp_path / "repo" / "benchmarks" / "run.py"), "--probe-only",
                           "--servers", "reference", "--output", str(out)], cwd=tmp_path / "repo",
                          env={k: v for k, v in os.environ.items() if k != STICKS_ENV},
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "measuring sticks (shared/reference/: limit_uvloop.py, broker_proto.py) are not beside" in done.stdout
    report = out.read_text()
    assert "**Issue 14's measuring sticks were not found**" in report, report
    assert probe_rows(report) == {"reference": "yes"}


def _load_runner() -> typing.Any:
    spec = importlib.util.spec_from_file_location("bench_run", RUNNER)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_run"] = bench  # (its dataclasses look their module up)
    spec.loader.exec_module(bench)
    return bench


def test_s5b_is_judged_on_h2load_when_it_ran_the_checked_figures_beside() -> None:
    """Issue 14, item 4: on two shared cores the checking generator's own CPU sets an open loop's
    tails, so S5b's target is judged on h2load's figures when it ran, the checked ones beside;
    without h2load, on the checked ones."""
    bench = _load_runner()
    from bench_report import issue14_targets

    def p99(ms: float) -> list[object]:
        return [bench.Measure(rps=1000.0, cps=1000.0, p50=1.0, p99=ms, p999=None, ok=True)]

    results = {"S5b": {"loadgen": {"broker-2w": p99(12.0), "limit-uvloop": p99(4.0)},
                       "h2load": {"broker-2w": p99(4.5), "limit-uvloop": p99(3.0)}}}
    [line] = [x for x in issue14_targets(results, False) if x.startswith("- S5b")]
    assert "**met** (4.50 ms against 3.00 ms, +1.50 ms, under h2load; 12.00 ms against 4.00 ms, +8.00 ms, " \
           "under checked)." in line, line
    del results["S5b"]["h2load"]
    [line] = [x for x in issue14_targets(results, False) if x.startswith("- S5b")]
    assert "**missed** (12.00 ms against 4.00 ms, +8.00 ms, under checked)." in line, line



def test_the_frontends_curve_is_read_from_broker_2w_and_its_n_front_end_runs() -> None:
    """Issue 14's "done when" lists a `--frontends` curve: `make bench` runs broker-2w-Nfe beside
    broker-2w (as many front-ends as the machine's cores, 2 at least) and the targets say calls/s,
    the ratio to one front-end and every broker process's CPU per call, from wrk's runs."""
    bench = _load_runner()
    from bench_report import issue14_targets
    from bench_servers import SERVERS

    assert "broker-2w-2fe" in [s.name for s in SERVERS]

    def cps(n: float) -> list[object]:
        return [bench.Measure(rps=n, cps=n, p50=1.0, p99=2.0, p999=None, ok=True)]

    results = {"S1-64": {"wrk": {"limit-uvloop": cps(80000.0), "broker-2w": cps(40000.0), "broker-2w-4fe": cps(70000.0),
                                 "broker-2w-2fe": cps(50000.0)}}}
    [line] = [x for x in issue14_targets(results, False) if x.startswith("- the `--frontends`")]
    assert "1 front-end 40,000 calls/s (1.00x); 2 front-ends 50,000 calls/s (1.25x); 4 front-ends 70,000 " \
           "calls/s (1.75x) under wrk" in line, line
    del results["S1-64"]["wrk"]["broker-2w"]
    [line] = [x for x in issue14_targets(results, False) if x.startswith("- the `--frontends`")]
    assert "not measured" in line, line

@pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load (nghttp2-client) is not installed")
def test_s5b_runs_under_h2load_too(tmp_path: Path) -> None:
    """With h2load installed, S5b is driven by it as well, at the same offered rate, and tabled."""
    report, stdout = run(tmp_path, "--servers", "limit-uvloop,broker-2w", "--scenarios", "S1-64,S5b",
                         "--repetitions", "1", "--duration", "1", sticks=stand_in_sticks(tmp_path))
    section = report.split("## S5b", 1)[1].split("\n## ", 1)[0]
    checked, h2 = section.split("Unchecked, h2load (`--h1`, open loop, native):")
    rate = re.findall(r"Offered rate: ([\d,]+) requests/s", section)
    assert len(rate) == 2 and rate[0] == rate[1], section
    assert set(re.findall(r"^\| ([\w-]+) \| [\d,]+", h2, re.M)) == {"limit-uvloop", "broker-2w"}, section
    assert "all answers checked: ok" in checked and "status only: ok" in h2 and "FAILED" not in section, section
    assert re.search(r"broker-2w +S5b +h2load ", stdout), stdout
    assert "- h2load: h2load nghttp2/" in report
